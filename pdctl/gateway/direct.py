"""The client's connection under uvicorn: the stream relay's direct path, and the request's disconnect.

**Direct path** (:func:`pdctl.gateway.relay.relay`).
ASGI's ``send`` is a coroutine, so relaying a piece of decode's stream through it costs the relay task one
wake-up per piece. Once a stream's headers are out, :func:`client_socket` gives a writer that frames a piece
in HTTP/1.1 chunked encoding, byte for byte what uvicorn's ``send`` writes, and writes it to the client's
transport from inside the worker connection's read callback (:meth:`pdctl.vllm.transport.Response.forward`).
:meth:`ClientSocket.writable` is false while uvicorn's flow control has writing paused (the client reads
slower than decode writes), after the client left, or once the response is complete: the relay then goes back
to ``send``, which waits for the client. The end of the response always goes through ``send`` (keep-alive and
uvicorn's own bookkeeping stay uvicorn's).

**Disconnect** (:func:`watch_disconnect`). ASGI tells an app that its client left only through ``receive()``, so
an app that wants to know while it waits on something else keeps a task per request blocked in ``receive()``. The
gateway's server runs :class:`HttpProtocol` instead of uvicorn's own: its ``connection_lost`` calls the
callback the request registered, with no task.

This reaches into uvicorn's httptools protocol (its ``RequestResponseCycle``: ``transport``, ``flow``,
``chunked_encoding``, ``disconnected``, ``response_complete``, ``on_response``). Any other server, or a uvicorn
without them, gets None and False: the relay uses ``send`` alone, the gateway a watcher task.
``tests/gateway/test_direct.py`` checks that the gateway's own server takes both, so an upgrade that loses one fails
a test instead of passing slower.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdctl.gateway.edge import EdgeProtocol

__all__ = ["ClientSocket", "HttpProtocol", "client_socket", "watch_disconnect"]

#: The attribute of uvicorn's ``RequestResponseCycle`` that holds a request's disconnect callback.
_ON_DISCONNECT = "pdctl_on_disconnect"


class HttpProtocol(EdgeProtocol):
    """uvicorn's httptools protocol, with the gateway's edge limits (:mod:`pdctl.gateway.edge`), that also calls the
    callback of :func:`watch_disconnect` when the client of a request in progress leaves."""

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            gone = getattr(cycle, _ON_DISCONNECT, None)
            if gone is not None:
                setattr(cycle, _ON_DISCONNECT, None)
                gone()


def watch_disconnect(send: Any, gone: Callable[[], None] | None) -> bool:
    """Have ``gone`` called once if the client of the request that ``send`` answers leaves before the response is
    complete (None: no longer); False when the server cannot (it is not :class:`HttpProtocol`'s).

    Call it once the body is read. A client already gone is told at once.
    """
    cycle = getattr(send, "__self__", None)
    protocol = getattr(getattr(cycle, "on_response", None), "__self__", None)
    if cycle is None or not isinstance(protocol, HttpProtocol) or not hasattr(cycle, "disconnected"):
        return False
    setattr(cycle, _ON_DISCONNECT, gone)
    if gone is not None:
        if cycle.disconnected:
            setattr(cycle, _ON_DISCONNECT, None)
            gone()
        else:
            # uvicorn pauses reading while a large body waits to be read, and only receive() resumes it; a paused
            # connection would not see its client leave.
            cycle.flow.resume_reading()
    return True


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
