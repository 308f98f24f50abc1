"""Ports for tests and benchmarks: a fresh free one each time, and whether one is free."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from pdctl.testing.invariants import port_free

__all__ = ["free_port", "port_free"]

_HANDED_OUT: set[int] = set()
_LOWEST = 20000


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' local ports), 32768 if unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port that is free now, below the kernel's ephemeral range, never the same one twice.

    Below the ephemeral range because a port picked there (by binding port 0) can be taken by any outgoing
    connection in the minutes before a slow server binds it: on a loaded machine, a vLLM engine's side channel
    or a gateway then fails with "address already in use". Random, so parallel sessions rarely pick alike.
    """
    top = _ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(_LOWEST, top) if top > _LOWEST + 1000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError("no free TCP port on 127.0.0.1")
