"""Whether an engine is serving, from its main threads' CPU time (pdctl.runtime.idle_threads.ActivityWatch): a
real process with a thread that spins all the time, as NIXL's progress thread does, and a main thread that runs
only while a file exists, as vLLM's forward pass runs only while a request does."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdctl.runtime.idle_threads import HOLD_S, ActivityWatch, watched_pids

_ENGINE = """
import hashlib, os, sys, threading, time
started = threading.Event()
def spin():  # without the GIL most of the time, as NIXL's native thread: the main thread never waits for it
    started.set()
    block = bytes(4 << 20)
    while True:
        hashlib.sha256(block)
spinner = threading.Thread(target=spin, daemon=True)
spinner.start()
started.wait()
print(spinner.native_id, flush=True)
while True:  # the main thread steps while the file exists, as vLLM's forward pass runs while a request does
    if os.path.exists(sys.argv[1]):
        sum(range(100_000))
    else:
        time.sleep(0.1)
"""


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[int, int, Path]]:
    """``(pid, the spinning thread's id, the file that makes it step)``."""
    busy = tmp_path / "busy"
    with subprocess.Popen([sys.executable, "-c", _ENGINE, str(busy)], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            yield proc.pid, int(proc.stdout.readline()), busy
        finally:
            proc.kill()


def test_a_spinning_thread_alone_is_not_serving_a_stepping_one_is_until_the_hold_ends(
    engine: tuple[int, int, Path],
) -> None:
    pid, spinner, busy = engine
    watch = ActivityWatch.of([(pid, spinner)], {pid: 1}, top=pid)
    assert watch.pids == (pid,)
    t0 = time.monotonic()
    assert not watch.serving(t0)  # a first look has nothing to compare with
    time.sleep(0.3)
    assert not watch.serving(t0 + 0.3)  # the spinner ran ~0.3 s of CPU, and it is left out
    busy.touch()
    time.sleep(0.3)
    assert watch.serving(t0 + 0.6)
    busy.unlink()
    time.sleep(0.1)
    watch.serving(t0 + 0.7)  # the last of the step's time
    time.sleep(0.3)
    assert watch.serving(t0 + 1.0)  # idle again, but within the hold
    time.sleep(0.3)
    assert not watch.serving(t0 + 1.0 + HOLD_S)


def test_a_process_gone_reads_as_not_serving(engine: tuple[int, int, Path]) -> None:
    pid, _spinner, busy = engine
    busy.touch()
    watch = ActivityWatch((pid, 2**22 + 1))  # the second pid is above Linux's largest: never a process
    watch.serving(0.0)
    time.sleep(0.3)
    assert watch.serving(0.3)
    assert not ActivityWatch((2**22 + 1,)).serving(0.0)


def test_watched_pids_are_the_spinners_process_and_its_parent_below_the_api_server() -> None:
    tree = {10: 1, 20: 10, 30: 20, 40: 10}  # API server 10 -> engine core 20 -> worker 30; 40 another child
    assert watched_pids([(30, 31)], tree, top=10) == (20, 30)
    assert watched_pids([(20, 21)], tree, top=10) == (20,)  # its parent is the API server
    assert watched_pids([(10, 11)], tree, top=10) == (10,)  # a single-process engine: the spinner's own
    assert watched_pids([(30, 31)], {30: 20}, top=10) == (30,)  # a parent outside the recorded tree
