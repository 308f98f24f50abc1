"""A tiny process that kills a deployment's process groups when its supervisor dies, even by SIGKILL.

The supervisor starts ``python -m pdctl.runtime.watchdog`` with a pipe on its stdin and writes one line per
started process group (``g PGID``) or stray descendant (``p PID``); ``d PGID`` / ``u PID`` forget one. When
the supervisor dies, the kernel closes the pipe's write end and the watchdog reads EOF: it sends SIGTERM
to every recorded group, waits a few seconds, then SIGKILLs them. ``exit`` ends it without killing
(a clean shutdown already stopped everything). It lives in its own session so a terminal's Ctrl-C does
not reach it, and imports nothing but the standard library (and ``pdctl.runtime.pgroup``) so it starts fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdctl.runtime.pgroup import signal_group

__all__ = ["Watchdog", "main"]

GRACE_S = 3.0


def _kill(groups: set[int], pids: set[int], sig: int) -> bool:
    alive = False
    for g in groups:
        alive = signal_group(g, sig) or alive
    for p in pids:
        try:
            os.kill(p, sig)
            alive = True
        except OSError:
            pass
    return alive


def main() -> None:
    """Read commands from stdin until EOF or ``exit``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    groups: set[int] = set()
    pids: set[int] = set()
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "exit":
            return
        if not arg.isdigit():
            continue
        n = int(arg)
        if cmd == "g":
            groups.add(n)
        elif cmd == "p":
            pids.add(n)
        elif cmd == "d":
            groups.discard(n)
        elif cmd == "u":
            pids.discard(n)
    if not _kill(groups, pids, signal.SIGTERM):
        return
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if not _kill(groups, pids, 0):
            return
    _kill(groups, pids, signal.SIGKILL)


class Watchdog:
    """The supervisor's side: start the watchdog, tell it about groups, end it cleanly."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self) -> int:
        """Start the watchdog process; returns its pid."""
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "pdctl.runtime.watchdog"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        return self._popen.pid

    @property
    def pid(self) -> int:
        """The watchdog's pid (0 before start)."""
        return self._popen.pid if self._popen else 0

    def _send(self, line: str) -> None:
        if self._popen is None or self._popen.stdin is None:
            return
        try:
            self._popen.stdin.write(line.encode() + b"\n")
            self._popen.stdin.flush()
        except (OSError, ValueError):
            pass

    def watch_group(self, pgid: int) -> None:
        """Kill this group if the supervisor dies."""
        self._send(f"g {pgid}")

    def forget_group(self, pgid: int) -> None:
        """This group was stopped cleanly."""
        self._send(f"d {pgid}")

    def watch_pid(self, pid: int) -> None:
        """Kill this process (a descendant outside the group) if the supervisor dies."""
        self._send(f"p {pid}")

    def close(self) -> None:
        """End the watchdog without killing anything."""
        if self._popen is None:
            return
        self._send("exit")
        try:
            if self._popen.stdin:
                self._popen.stdin.close()
        except OSError:
            pass
        try:
            self._popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()
        self._popen = None


if __name__ == "__main__":
    main()
