"""pdctl.testing and pdctl.runtime.pgroup: the helpers every process test relies on, on real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from pdctl.runtime.pgroup import signal_group
from pdctl.testing import alive, free_port, kill_groups, port_free, stop_group

# A group leader that exits on SIGTERM but leaves a child (in its group) that ignores SIGTERM.
ORPHANING = (
    "import signal, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "time.sleep(60)\n"
)


def _start_orphaning() -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, "-c", ORPHANING], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    proc.stdout.readline()  # the child's ready line: its SIGTERM handler is set
    return proc, child


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_stop_group_takes_the_children_the_leader_left() -> None:
    proc, child = _start_orphaning()
    try:
        assert alive(child)
        assert stop_group(proc, grace_s=5.0) == 0  # the leader's own SIGTERM exit
        assert _gone_within(child, 5.0)
    finally:
        kill_groups([proc.pid, child])


def test_signal_group_of_a_gone_group_is_false() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    assert signal_group(proc.pid, signal.SIGTERM) is False
    kill_groups([proc.pid])  # nothing to do, and no error


def test_free_ports_are_free_and_never_repeat() -> None:
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(port_free(p) for p in ports)
