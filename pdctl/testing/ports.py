"""Ports for tests and benchmarks: a fresh free one each time, and whether one is free."""

from __future__ import annotations

import socket

from pdctl.invariants import port_free

__all__ = ["free_port", "port_free"]

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, then release), never the same one twice.

    The kernel may hand a just-released port out again at once; a test that asks for an HTTP port and a
    side-channel port in a row would then get the same number for both.
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
