"""The HTTP edge: what a client may hold of the gateway before its request reaches the app.

uvicorn's httptools protocol enforces none of these limits (``h11_max_incomplete_event_size`` is h11's alone, and
``limit_concurrency`` answers 503 without ``Retry-After`` after the request head was read). :class:`EdgeProtocol`
enforces them per connection, on top of uvicorn's protocol:

* **request head** (request line and headers, as bytes on the wire) above ``gateway.max_header_bytes``, or more
  than ``gateway.max_headers`` header lines: 431, counted as the bytes arrive, so httptools never buffers more;
* **head timeout**: the head not complete ``gateway.header_timeout_s`` after the connection opened or its first
  byte arrived: 408 when part of it came, a plain close when nothing did;
* **body timeout**: no byte of the body for ``gateway.body_timeout_s`` (between two reads, as nginx's
  ``client_body_timeout``; time with reading paused by uvicorn does not count): 408 if no response started,
  else a close;
* **connections** above ``gateway.max_connections`` (this process's share): 503 with ``Retry-After`` at once,
  before any byte is read;
* **keep-alive**: ``gateway.keepalive_timeout_s`` idle after a response (uvicorn's own timer).

A refusal writes a JSON error with ``connection: close``, half-closes, and reads and drops what the client still
sends for up to :data:`LINGER_S` (nginx's lingering close): closing with unread input would reset the connection,
and the client could lose the answer. Nothing here runs per response chunk; per request, timers are armed only
while a head or a body is incomplete after a read.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pdctl.config import GatewayConfig
from pdctl.gateway.errors import error_body

__all__ = [
    "FDS_PER_CONNECTION",
    "FD_RESERVE",
    "LINGER_S",
    "RETRY_AFTER_S",
    "EdgeLimits",
    "EdgeProtocol",
    "attach_limits",
    "connection_cap",
]

#: How long a refused connection reads and drops the client's input before it closes.
LINGER_S = 2.0
#: ``Retry-After`` of the 503 above ``gateway.max_connections``.
RETRY_AFTER_S = 1
#: File descriptors a client connection may need: its own, and one to each leg's worker.
FDS_PER_CONNECTION = 3
#: File descriptors kept for everything else (listeners, logs, probes, the event loop).
FD_RESERVE = 128
#: The attribute of uvicorn's ``Config`` that carries the limits to each connection's protocol.
_LIMITS_ATTR = "pdctl_edge_limits"

_HEAD, _BODY = 0, 1
_log = logging.getLogger("pdctl.gateway.edge")


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """One gateway process's edge limits; the defaults are ``GatewayConfig``'s."""

    max_header_bytes: int = 60 * 1024
    max_headers: int = 100
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096
    keepalive_timeout_s: float = 30.0

    @classmethod
    def of(cls, g: GatewayConfig, process: tuple[int, int] = (0, 1)) -> EdgeLimits:
        """The limits of ``g`` for gateway process ``process = (index, processes)``: its share of the connections
        (the parts sum to ``g.max_connections``, at least 1 each, as the rate limits' shares)."""
        index, n = process
        share = g.max_connections // n + (1 if index < g.max_connections % n else 0)
        return cls(
            max_header_bytes=g.max_header_bytes,
            max_headers=g.max_headers,
            header_timeout_s=g.header_timeout_s,
            body_timeout_s=g.body_timeout_s,
            max_connections=max(1, share),
            keepalive_timeout_s=g.keepalive_timeout_s,
        )


def attach_limits(config: uvicorn.Config, limits: EdgeLimits) -> None:
    """Have every connection that ``config``'s server accepts run under ``limits`` (else the defaults)."""
    setattr(config, _LIMITS_ATTR, limits)


def connection_cap(wanted: int) -> int:
    """The connection cap this process's file descriptors allow, at most ``wanted``.

    Raises the soft ``RLIMIT_NOFILE`` toward the hard one when ``wanted`` connections need more (as nginx's
    ``worker_rlimit_nofile``), so the cap's 503 comes before ``accept()`` fails with EMFILE."""
    need = wanted * FDS_PER_CONNECTION + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - FD_RESERVE) // FDS_PER_CONNECTION))


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request the edge refuses."""


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the gateway's edge limits (:class:`EdgeLimits`)."""

    #: When this process last logged that it refused connections over its cap (one line a minute at most).
    _cap_logged_at: ClassVar[float] = float("-inf")

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        limits = getattr(config, _LIMITS_ATTR, None)
        self._limits: EdgeLimits = limits if isinstance(limits, EdgeLimits) else EdgeLimits()
        # uvicorn declares an int; its timer (loop.call_later) takes any number of seconds.
        self.timeout_keep_alive = self._limits.keepalive_timeout_s  # type: ignore[assignment]
        self._phase = _HEAD
        self._head_left = self._limits.max_header_bytes
        self._head_started = False  # a byte of the current head arrived
        self._heads = 0  # heads read whole on this connection
        self._last_read = 0.0  # the body's latest byte (loop time)
        self._timer: asyncio.TimerHandle | None = None  # the head's, the body's, or the linger's
        self._too_many_headers = False  # on_headers_complete stopped the parser
        self._refused = False

    # Connection events
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections:
            now = time.monotonic()
            if now - EdgeProtocol._cap_logged_at >= 60.0:
                EdgeProtocol._cap_logged_at = now
                _log.warning(
                    "%d connections open, above gateway.max_connections (this process's share %d): new ones get "
                    "503", len(self.connections) - 1, self._limits.max_connections,
                )  # fmt: skip
            self._refuse(503, "too many connections to the gateway", "too_many_connections", RETRY_AFTER_S)
            return
        self._timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: read and dropped
        self._unset_keepalive_if_required()
        while self._phase == _HEAD and len(data) > self._head_left:
            # Feed the head's allowance alone: if the head did not end within it, it is too large.
            room, heads = self._head_left, self._heads
            self._head_left = 0
            self._feed(data[:room])
            data = data[room:]
            if self._refused or self.transport.is_closing():
                return
            if self._heads == heads:
                self._refuse(431, "the request's headers are larger than the gateway's limit", "headers_too_large")
                return
        if self._phase == _HEAD:
            self._head_left -= len(data)
        else:
            self._last_read = self.loop.time()
        self._feed(data)
        if self._timer is None and not self._refused and not self.transport.is_closing():
            if self._phase == _BODY:
                self._last_read = self.loop.time()
                self._timer = self.loop.call_later(self._limits.body_timeout_s, self._body_timed_out)
            elif self._head_started:
                self._timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def _feed(self, data: bytes) -> None:
        # uvicorn's data_received, with the edge's refusals told apart from malformed requests.
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._too_many_headers:
                self._refuse(431, "the request has more header lines than the gateway's limit", "headers_too_large")
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    # Parser callbacks
    def on_message_begin(self) -> None:
        self._head_started = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._head_started = False
        self._heads += 1
        self._phase = _BODY
        self._cancel_timer()
        if len(self.headers) > self._limits.max_headers:
            self._too_many_headers = True
            raise _Refused
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = _HEAD
        self._head_left = self._limits.max_header_bytes
        self._cancel_timer()
        super().on_message_complete()

    # Timers
    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A pipelined head waits for the response in progress; its time starts again after.
            self._timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)
        elif self._head_started:
            self._refuse(408, "the request's headers did not arrive in time", "request_timeout")
        else:
            self.transport.close()  # nothing sent: an idle connection

    def _body_timed_out(self) -> None:
        self._timer = None
        if self._phase != _BODY:
            return
        now = self.loop.time()
        if self.flow.read_paused or self.cycle.waiting_for_100_continue:
            self._last_read = now  # uvicorn is not reading, or the client waits for its 100: not the slow one
        idle = now - self._last_read
        if idle < self._limits.body_timeout_s:
            self._timer = self.loop.call_later(self._limits.body_timeout_s - idle, self._body_timed_out)
            return
        cycle = self.cycle
        if cycle.response_started:
            self.transport.close()
            return
        # The app waiting in receive() hears of a disconnect, and anything it sends is dropped.
        cycle.disconnected = True
        cycle.message_event.set()
        self._refuse(408, "the request's body did not arrive in time", "request_timeout")

    # Refusals
    def _refuse(self, status: int, message: str, code: str, retry_after_s: int | None = None) -> None:
        """Answer ``status`` with an OpenAI-shaped error and close, lingering to read what the client still sends."""
        self._refused = True
        self._cancel_timer()
        body = error_body(message, "server_error" if status >= 500 else "invalid_request_error", code=code)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body))
        if retry_after_s is not None:
            head.append(b"retry-after: %d\r\n" % retry_after_s)
        head += [b"\r\n", body]
        transport = self.transport
        transport.write(b"".join(head))
        if not transport.can_write_eof():  # TLS: its close flushes and says goodbye
            transport.close()
            return
        transport.write_eof()
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_S, transport.close)
