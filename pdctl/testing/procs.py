"""Processes in tests: wait until one serves, stop its group politely, kill what a test left behind, ask whether a
pid still runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import psutil

from pdctl.runtime.pgroup import signal_group

__all__ = ["alive", "kill_groups", "stop_group", "wait_until_ready"]


def wait_until_ready(
    proc: subprocess.Popen[bytes], url: str, timeout_s: float, *, name: str, log: Path | None = None
) -> None:
    """Return once GET ``url`` answers 200 (asked every 0.1 s, no proxy from the environment). A RuntimeError
    naming ``name`` when ``proc`` exits first or ``timeout_s`` passes (``proc`` is left running), ending with the
    last 2,000 characters of the ``log`` file when one is given."""

    def tail() -> str:
        return "" if log is None else ":\n" + log.read_text(errors="replace")[-2000:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}{tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{name} not ready after {timeout_s:g} s{tail()}")


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> int | None:
    """SIGTERM ``proc``'s group (it leads one), SIGKILL the group after ``grace_s``; return its exit code.

    The group is SIGKILLed even when the leader exits in time: children it left behind go too.
    """
    signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    signal_group(proc.pid, signal.SIGKILL)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        return None


def kill_groups(pids: Iterable[int]) -> None:
    """Teardown: SIGKILL the group each pid leads and the pid itself (what is gone is skipped)."""
    for pid in pids:
        signal_group(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not count)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
