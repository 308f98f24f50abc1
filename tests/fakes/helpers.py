"""Helpers for tests that start real processes: free ports, fake-worker specs, leftover cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import psutil

from pdctl.plan import ProcessSpec
from pdctl.sim.testing import free_port

FAKE_WORKER = str(Path(__file__).with_name("fake_worker.py"))


def fake_spec(
    name: str, role: str = "prefill", *args: str, wave: int = 0, port: int | None = None, **kw: Any
) -> ProcessSpec:
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    return ProcessSpec(
        name=name,
        role=role,  # type: ignore[arg-type]
        argv=(sys.executable, FAKE_WORKER, "--port", str(port), *args),
        env=kw.pop("env", {"PYTHONUNBUFFERED": "1"}),
        url=url,
        ready_url=f"{url}/health",
        wave=wave,
        ports=(port,),
        **kw,
    )


def port_free(port: int) -> bool:
    """No one listens there (SO_REUSEADDR, as servers bind: TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def kill_tree_of_groups(pids: list[int]) -> None:
    """Teardown: SIGKILL the group of each pid and the pid itself (ignore what is gone)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
