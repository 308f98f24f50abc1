"""Process groups in tests: stop one politely, kill what a test left behind, ask whether a pid still runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable

import psutil

from pdctl.runtime.pgroup import signal_group

__all__ = ["alive", "kill_groups", "stop_group"]


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
