"""The client's socket under uvicorn, for the stream relay's direct path (:func:`pdctl.gateway.sse.relay`).

ASGI's ``send`` is a coroutine, so relaying a piece of decode's stream through it costs the relay task one
wake-up per piece. Once a stream's headers are out, :func:`client_socket` gives a writer that frames a piece
in HTTP/1.1 chunked encoding, byte for byte what uvicorn's ``send`` writes, and writes it to the client's
transport from inside the worker connection's read callback (:meth:`pdctl.transport.Response.forward`).
:meth:`ClientSocket.writable` is false while uvicorn's flow control has writing paused (the client reads
slower than decode writes), after the client left, or once the response is complete: the relay then goes back
to ``send``, which waits for the client. The end of the response always goes through ``send`` (keep-alive and
uvicorn's own bookkeeping stay uvicorn's).

This reaches into uvicorn's httptools protocol (its ``RequestResponseCycle``: ``transport``, ``flow``,
``chunked_encoding``, ``disconnected``, ``response_complete``). Any other server, or a uvicorn without them,
gets None, and the relay uses ``send`` alone. ``tests/gateway/test_direct.py`` checks that the gateway's own
server takes the direct path, so an upgrade that loses it fails a test instead of passing slower.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ClientSocket", "client_socket"]


class ClientSocket:
    """Writes body pieces of a started chunked response straight to the client's transport."""

    __slots__ = ("_cycle", "_flow", "_write")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._write = cycle.transport.write

    def writable(self) -> bool:
        """Whether a piece may be written now (else it must go through ``send``, which waits for the client)."""
        cycle = self._cycle
        return not (self._flow.write_paused or cycle.disconnected or cycle.response_complete)

    def write(self, data: bytes) -> None:
        """One chunk of the body (``data`` not empty), as uvicorn's ``send`` frames it."""
        self._write(b"%x\r\n%s\r\n" % (len(data), data))


#: What :class:`ClientSocket` reads of uvicorn's ``RequestResponseCycle`` (and of its ``flow``).
_CYCLE_ATTRS = ("chunked_encoding", "response_started", "scope", "disconnected", "response_complete", "transport")


def client_socket(send: Any) -> ClientSocket | None:
    """The direct writer under ``send``, once ``send`` started a chunked response; None where there is none."""
    cycle = getattr(send, "__self__", None)
    if cycle is None or type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl":
        return None
    if not all(hasattr(cycle, a) for a in _CYCLE_ATTRS) or not hasattr(getattr(cycle, "flow", None), "write_paused"):
        return None
    if cycle.chunked_encoding is not True or not cycle.response_started or cycle.scope.get("method") == "HEAD":
        return None
    return ClientSocket(cycle)
