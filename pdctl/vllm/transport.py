"""HTTP to the workers: a raw HTTP/1.1 client for the gateway's legs (httpx's API over aiohttp, for the bench, is
:mod:`pdctl.bench.aiohttp_transport`).

* :class:`Client` / :class:`Response`: what the gateway's worker legs use. One asyncio ``Protocol`` per pooled
  keep-alive connection, each response parsed by httptools (llhttp, in C); a request is written as one bytes
  buffer whose request line and fixed headers are encoded once per worker and path; body pieces are handed
  over as they arrive (everything that arrived since the last read in one piece), and reading pauses while
  more than 256 KiB wait unread. :meth:`Response.forward` hands each later piece to a callback from inside the
  socket's read callback instead (no task wake-up per piece: the gateway's stream relay). Why not aiohttp's
  client, which it replaced: 36–44 µs per prefill call against aiohttp's 83–104 (docs/performance.md, "Choosing
  the gateway's libraries").

Failures below HTTP raise :class:`TransportError` with a ``kind``: ``connect`` (refused, unresolvable, TLS
failed), ``connect_timeout``, ``timeout`` (a read timeout, or the call's total) or ``broken`` (the connection
closed or reset, or invalid HTTP, after it was made).

Connections (:class:`Client`): a connection goes back to the pool only after a complete response that allows
keep-alive; an idle one is closed after ``keepalive_s`` (below the worker's own keep-alive, so the worker never
closes one under a new request); a response closed before its end closes its connection, so the worker sees
the client leave and aborts the request. A GET sent on a reused connection that the worker closed before
answering is sent once more on a new connection (RFC 9112 §9.3.1); a POST is not, it may have been processed.
Not supported, as pdctl's workers need none of it: proxies and ``.netrc``, redirects, compression, HEAD, 1xx
responses, pipelining.
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
from collections.abc import Callable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

import httptools

__all__ = ["Client", "Response", "Sink", "TransportError"]

Sink = Callable[[bytes], bool]
"""Takes a piece of a response body (True), or declines it (False: it stays for :meth:`Response.chunk`)."""


Kind = Literal["connect", "connect_timeout", "timeout", "broken"]


class TransportError(Exception):
    """A worker call failed below HTTP. ``kind``: ``connect`` (refused, unresolvable, TLS failed),
    ``connect_timeout``, ``timeout`` (no data within the read timeout, or the call's total timeout passed) or
    ``broken`` (the connection or the body broke off, or the worker did not speak HTTP)."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind: Kind = kind


#: Unread body bytes above which a connection stops reading (the worker's writes then wait on TCP).
_HIGH_WATER = 256 * 1024
#: Timers fire on the loop's millisecond clock: a wait is over when less than this is left of it.
_SLACK_S = 0.001
_RETRY_SAFE = frozenset({"GET"})


class _Conn(asyncio.Protocol):
    """One keep-alive connection: bytes go to the parser of the response in progress, if any."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.resp: Response | None = None
        self.lost = False
        self.idle = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or self.parser is None:
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        resp._got_bytes = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            resp._fail(TransportError("broken", f"invalid HTTP from {self.client.base_url}: {exc}"))
            self.close()
            return
        if resp._sink is not None and resp._buf:
            resp._give()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client._forget(self)
        if self.resp is not None:
            self.resp._lost(exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """A worker's answer: status and headers at once, the body on demand (whole, or piece by piece).

    It is the parser's protocol (httptools calls ``on_*``): each piece of the body is appended to a list and
    wakes the reader, no copy and no task per piece. After :meth:`forward`, what arrived in one socket read goes
    to the sink instead, in that read's callback; the reader wakes only for the body's end, a failure, a
    timeout, or a piece the sink declined.
    """

    __slots__ = (
        "_buf", "_complete", "_conn", "_due", "_error", "_got_bytes", "_headed", "_high", "_keep", "_loop", "_paused",
        "_raw", "_read_s", "_sink", "_size", "_stall_s", "_timer", "_total_due", "_waiter", "status",
    )  # fmt: skip

    def __init__(self, conn: _Conn, loop: asyncio.AbstractEventLoop, read_s: float | None, total_due: float | None):
        self._conn: _Conn | None = conn
        self._loop = loop
        self._read_s = read_s
        self._total_due = total_due
        self._due = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._raw: list[tuple[bytes, bytes]] = []
        self._buf: list[bytes] = []
        self._size = 0
        self._high = _HIGH_WATER
        self._paused = False
        self._headed = False
        self._complete = False
        self._keep = False
        self._got_bytes = False
        self._error: TransportError | None = None
        self._sink: Sink | None = None
        self._stall_s: float | None = None
        self.status = 0

    @property
    def headers(self) -> Mapping[str, str]:
        """The response headers, names in lower case (repeated ones joined with ``", "``)."""
        out: dict[str, str] = {}
        for k, v in self._raw:
            name, value = k.decode("latin-1").lower(), v.decode("latin-1")
            out[name] = f"{out[name]}, {value}" if name in out else value
        return out

    async def read(self) -> bytes:
        """The whole body."""
        self._high = 1 << 62  # a whole body is wanted: never pause
        self._resume()
        while not self._complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        data = b"".join(self._buf)
        self._buf.clear()
        self._size = 0
        return data

    async def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not)."""
        return json.loads(await self.read())

    async def chunk(self) -> bytes:
        """The next piece of the body, as much as has arrived; ``b""`` at its end."""
        buf = self._buf
        while not buf:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            await self._wait()
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        self._size = 0
        if self._paused:
            self._resume()
        return data

    def forward(self, sink: Sink | None) -> None:
        """From now on hand the body's pieces to ``sink`` as they arrive (None: back to :meth:`chunk`).

        Everything one socket read brought goes to ``sink`` in one call, unless that read also completed the
        body: then it stays for :meth:`chunk`, which returns it with :meth:`at_end` true (so the caller can send
        it together with the end of its own response). A piece ``sink`` declines stays for :meth:`chunk` too, in
        order: ``sink`` must decline every later piece until the caller has read that one. A piece taken by
        ``sink`` counts as data for the read timeout.
        """
        self._sink = sink

    def stall_timeout(self, read_s: float) -> None:
        """From the body's first piece on, bound each wait for the next piece by ``read_s`` (a stream's token
        deadline) instead of the client's read timeout, when it is shorter."""
        if self._read_s is None or read_s < self._read_s:
            self._stall_s = read_s

    def _tighten(self) -> None:
        read_s = self._stall_s
        assert read_s is not None
        self._stall_s = None
        self._read_s = read_s
        due = self._loop.time() + read_s
        if self._total_due is not None and self._total_due < due:
            due = self._total_due
        self._due = due
        # The armed timer is for the longer timeout: one at the new, earlier due replaces it (the chain re-arms
        # itself from there as later pieces move the due on).
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._loop.call_at(due, self._on_timer)

    def at_end(self) -> bool:
        """Whether the whole body has arrived and been read: the next :meth:`chunk` returns ``b""`` at once."""
        return self._complete and not self._buf and self._error is None

    def close(self) -> None:
        """Back to the pool when complete; else drop the connection (the worker aborts the request)."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn.resp = conn.parser = None
        if self._complete and self._keep and self._error is None and not conn.lost:
            if self._paused and conn.transport is not None:
                conn.transport.resume_reading()
            conn.client._release(conn)
        else:
            conn.close()

    # -- waiting, with the read and total timeouts on one lazily re-armed timer per response

    def _wait(self) -> asyncio.Future[None]:
        """A future the next event resolves (headers, body, end, failure, timeout); awaited by the caller, so
        a wait costs no coroutine frame of its own. Once done it stays as ``_waiter``: nothing wakes a done one."""
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        read_s, total_due = self._read_s, self._total_due
        if read_s is not None or total_due is not None:
            due = loop.time() + read_s if read_s is not None else math.inf
            if total_due is not None and total_due < due:
                due = total_due
            self._due = due
            if self._timer is None:
                self._timer = loop.call_at(due, self._on_timer)
        return waiter

    def _give(self) -> None:
        """Hand what arrived to the sink (called after a socket read was parsed; the body is not complete)."""
        buf = self._buf
        if self._complete or self._error is not None:
            return  # the reader was woken: it takes the rest, and the end with it
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        sink = self._sink
        assert sink is not None
        if not sink(data):
            self._wake()
            return
        buf.clear()
        self._size = 0
        if self._paused:
            self._resume()
        if self._read_s is not None:
            due = self._loop.time() + self._read_s
            total_due = self._total_due
            self._due = due if total_due is None or due < total_due else total_due

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms it again
        now = self._loop.time()
        if self._due - now > _SLACK_S:
            self._timer = self._loop.call_at(self._due, self._on_timer)
            return
        total = self._total_due is not None and self._total_due - now <= _SLACK_S
        what = "the call's total timeout passed" if total else f"no data within the read timeout ({self._read_s}s)"
        self._error = TransportError("timeout", what)
        waiter.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, err: TransportError) -> None:
        if self._error is None and not self._complete:
            self._error = err
        self._wake()

    def _resume(self) -> None:
        conn = self._conn
        if self._paused and conn is not None and conn.transport is not None and not conn.lost:
            conn.transport.resume_reading()
        self._paused = False

    def _lost(self, exc: Exception | None) -> None:
        if not self._complete and self._error is None:
            if self._headed and self._ends_at_close():
                self._complete = True  # a body without length or chunks ends with its connection
            else:
                why = f": {exc}" if exc else ""
                self._error = TransportError("broken", f"the worker closed the connection{why}")
        self._wake()

    def _ends_at_close(self) -> bool:
        if self.status in (204, 304):
            return False
        for k, v in self._raw:
            name = k.lower()
            if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in v.lower()):
                return False
        return True

    # -- httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name, value))

    def on_headers_complete(self) -> None:
        conn = self._conn
        assert conn is not None and conn.parser is not None
        self.status = conn.parser.get_status_code()
        self._keep = conn.parser.should_keep_alive()
        self._headed = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._stall_s is not None:
            self._tighten()
        self._buf.append(body)
        self._size += len(body)
        if self._size > self._high and not self._paused:
            conn = self._conn
            if conn is not None and conn.transport is not None and not conn.lost:
                conn.transport.pause_reading()
                self._paused = True
        if self._sink is not None:
            return  # handed over (or the reader woken) once the whole read is parsed: _Conn.data_received
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()


class Client:
    """Pooled keep-alive connections to one base URL (``http://`` or ``https://``), opened on first use.

    ``read_timeout_s`` bounds every wait for data (an idle timeout: headers, then each piece of the body);
    ``connect_timeout_s`` the connection; ``total_timeout_s`` (per call) the whole call, body included.
    ``headers`` go with every request; a call's own headers replace those of the same name.
    """

    def __init__(
        self,
        base_url: str,
        *,
        read_timeout_s: float | None = None,
        connect_timeout_s: float | None = None,
        keepalive_s: float = 30.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._tls = parts.scheme == "https"
        self._ssl: ssl.SSLContext | None = None
        self._prefix = parts.path
        self._read_timeout_s = read_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        fixed = {"host": parts.netloc.rpartition("@")[2]}
        fixed.update({k.lower(): v for k, v in (headers or {}).items()})
        for k, v in fixed.items():
            _check_header(k, v)
        self._fixed = fixed
        self._heads: dict[tuple[str, str], bytes] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: list[_Conn] = []
        self._conns: set[_Conn] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        total_timeout_s: float | None = None,
    ) -> Response:
        """Send one request; returns once the status line and headers are in (close the response when done)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        total_due = None if total_timeout_s is None else loop.time() + total_timeout_s
        data = self._encode(method, path, body, headers)
        retry = method in _RETRY_SAFE
        while True:
            conn, reused = await self._acquire(loop, total_due)
            resp = Response(conn, loop, self._read_timeout_s, total_due)
            conn.resp = resp
            conn.parser = httptools.HttpResponseParser(resp)
            assert conn.transport is not None
            conn.transport.write(data)
            try:
                while not resp._headed:
                    if resp._error is not None:
                        raise resp._error
                    await resp._wait()
            except TransportError as err:
                resp.close()
                if retry and reused and not resp._got_bytes and err.kind == "broken":
                    retry = False
                    continue
                raise
            except BaseException:
                resp.close()
                raise
            return resp

    async def aclose(self) -> None:
        """Close every connection (a call still streaming ends ``broken``)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in self._idle:
            conn.idle = False
        self._idle.clear()
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()

    # -- encoding

    def _head(self, method: str, path: str, drop: frozenset[str] = frozenset()) -> bytes:
        lines = [f"{method} {self._prefix}{path} HTTP/1.1\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in self._fixed.items() if k not in drop]
        return "".join(lines).encode("latin-1")

    def _encode(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str] | None) -> bytes:
        if headers:
            extra = []
            drop: set[str] = set()
            for k, v in headers.items():
                _check_header(k, v)
                if k.lower() in self._fixed:
                    drop.add(k.lower())
                extra.append(f"{k}: {v}\r\n")
            head = self._head(method, path, frozenset(drop)) if drop else self._cached_head(method, path)
            head += "".join(extra).encode("latin-1")
        else:
            head = self._cached_head(method, path)
        if body is None:
            if method == "GET":
                return head + b"\r\n"
            body = b""
        return b"".join((head, b"content-length: %d\r\n\r\n" % len(body), body))

    def _cached_head(self, method: str, path: str) -> bytes:
        head = self._heads.get((method, path))
        if head is None:
            head = self._heads[method, path] = self._head(method, path)
        return head

    # -- the pool

    async def _acquire(self, loop: asyncio.AbstractEventLoop, total_due: float | None) -> tuple[_Conn, bool]:
        idle = self._idle
        while idle:
            conn = idle.pop()
            conn.idle = False
            if not conn.lost:
                if loop.time() - conn.idle_since < self._keepalive_s:
                    return conn, True
                conn.close()
        return await self._connect(loop, total_due), False

    async def _connect(self, loop: asyncio.AbstractEventLoop, total_due: float | None) -> _Conn:
        timeout = self._connect_timeout_s
        kind: Kind = "connect_timeout"
        if total_due is not None and (timeout is None or total_due - loop.time() < timeout):
            timeout, kind = max(0.0, total_due - loop.time()), "timeout"
        if self._tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        conn = _Conn(self)
        made = loop.create_connection(lambda: conn, self._host, self._port, ssl=self._ssl)
        try:
            await (made if timeout is None else asyncio.wait_for(made, timeout))
        except TimeoutError:  # ours, or the system's (ETIMEDOUT)
            within = f" within {timeout:.1f}s" if timeout is not None else ""
            raise TransportError(kind, f"no connection to {self.base_url}{within}") from None
        except OSError as exc:  # refused, unreachable, unresolvable, TLS
            raise TransportError("connect", f"cannot connect to {self.base_url}: {exc}") from None
        self._conns.add(conn)
        return conn

    def _release(self, conn: _Conn) -> None:
        loop = self._loop
        assert loop is not None
        conn.idle = True
        conn.idle_since = loop.time()
        self._idle.append(conn)
        if self._sweeper is None:
            self._sweeper = loop.call_at(conn.idle_since + self._keepalive_s, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive_s`` (the list is oldest first)."""
        self._sweeper = None
        idle = self._idle
        assert self._loop is not None
        cutoff = self._loop.time() - self._keepalive_s + _SLACK_S
        n = 0
        while n < len(idle) and idle[n].idle_since <= cutoff:
            n += 1
        expired = idle[:n]
        del idle[:n]
        for conn in expired:
            conn.idle = False
            conn.close()
        if idle:
            self._sweeper = self._loop.call_at(idle[0].idle_since + self._keepalive_s, self._sweep)

    def _forget(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        if conn.idle:
            conn.idle = False
            self._idle.remove(conn)


def _check_header(name: str, value: str) -> None:
    if "\r" in name or "\n" in name or ":" in name or "\r" in value or "\n" in value:
        raise ValueError(f"HTTP header {name!r}: a line break (or a colon in the name) is not allowed")
