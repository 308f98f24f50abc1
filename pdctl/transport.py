"""HTTP to the workers over aiohttp: a small native client for the gateway, and httpx's API for the bench.

Why aiohttp: with httpx's default transport every streamed chunk goes through httpcore, anyio and h11's
pure-Python chunked-encoding reader, and every request through a connection pool whose bookkeeping grows
with the number of open connections; aiohttp parses HTTP in C (llhttp) and hands over everything already
buffered in one piece. The measurements are in docs/performance.md, section 2.

* :class:`Client` / :class:`Response`: what the gateway's worker legs use. No httpx layer per request or
  per chunk (request building, auth and redirect handling, cookies, three async generators per chunk),
  the largest cost left after the move to aiohttp (section 2, step 2). Failures below HTTP raise
  :class:`TransportError` with a ``kind`` (``connect``, ``connect_timeout``, ``timeout``, ``broken``).
* :class:`AiohttpTransport`: the same sockets under httpx's API, for ``pdctl bench`` (and tests), whose
  code stays on httpx. Mapping: per-request ``timeout`` (httpx's ``connect``/``read``) ->
  ``aiohttp.ClientTimeout(sock_connect, sock_read)``; connect failures -> ``httpx.ConnectError`` /
  ``ConnectTimeout``; a stalled read -> ``httpx.ReadTimeout``; a broken stream ->
  ``httpx.RemoteProtocolError`` / ``ReadError`` (LiteLLM made the same move, BerriAI/litellm#11097).

A response closed before its end closes the connection (the worker sees the client leave and aborts the
request). ``HTTP(S)_PROXY`` and ``.netrc`` are not read (aiohttp's ``trust_env`` reads ``.netrc`` in a
thread on every request, a large share of the gateway's CPU, section 2): pdctl's workers are local.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

import aiohttp
import httpx

__all__ = ["AiohttpTransport", "Client", "Response", "TransportError"]


Kind = Literal["connect", "connect_timeout", "timeout", "broken"]


class TransportError(Exception):
    """A worker call failed below HTTP. ``kind``: ``connect`` (refused, reset before an answer), ``connect_timeout``,
    ``timeout`` (no data within the read timeout) or ``broken`` (the connection or the body broke off)."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind: Kind = kind


def _classify(exc: BaseException) -> TransportError:
    """aiohttp's (and asyncio's) exceptions as one :class:`TransportError`."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return TransportError("connect_timeout", str(exc) or "connect timed out")
    if isinstance(exc, aiohttp.SocketTimeoutError | aiohttp.ServerTimeoutError | asyncio.TimeoutError):
        return TransportError("timeout", str(exc) or "read timed out")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return TransportError("connect", str(exc))
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return TransportError("broken", str(exc) or "server disconnected")
    return TransportError("broken", str(exc) or type(exc).__name__)


_CAUGHT = (aiohttp.ClientError, asyncio.TimeoutError)


def _session(keepalive_s: float, limit: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=keepalive_s, use_dns_cache=True)
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
        timeout=aiohttp.ClientTimeout(total=None),
    )  # fmt: skip


class Response:
    """A worker's answer: status and headers at once, the body on demand (whole, or piece by piece)."""

    __slots__ = ("_done", "_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self._done = False
        self.status = resp.status
        self.headers = resp.headers

    async def read(self) -> bytes:
        """The whole body."""
        try:
            data = await self._resp.read()
        except _CAUGHT as exc:
            raise _classify(exc) from exc
        self._done = True
        return data

    async def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not)."""
        return json.loads(await self.read())

    async def chunk(self) -> bytes:
        """The next piece of the body, as much as has arrived; ``b""`` at its end."""
        try:
            data = await self._resp.content.readany()
        except _CAUGHT as exc:
            raise _classify(exc) from exc
        if not data:
            self._done = True
        return data

    def close(self) -> None:
        """Back to the pool when read to the end; else drop the connection (the worker aborts the request)."""
        if self._done:
            self._resp.release()
        else:
            self._resp.close()


class Client:
    """One pooled ``aiohttp.ClientSession`` to one base URL (created on first use, inside the running loop).

    ``read_timeout_s`` bounds every wait for data (an idle timeout: headers, then each piece of the body);
    ``connect_timeout_s`` the connection; ``total_timeout_s`` (per call) the whole call, body included.
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
        self._read_timeout_s = read_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        # Streams (no total) share one object; a total is per call (leg 1's is what is left of its deadline).
        self._idle_timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout_s, sock_read=read_timeout_s)

    def _timeout(self, total_s: float | None) -> aiohttp.ClientTimeout:
        if total_s is None:
            return self._idle_timeout
        return aiohttp.ClientTimeout(total=total_s, sock_connect=self._connect_timeout_s,
                                     sock_read=self._read_timeout_s)  # fmt: skip

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
        if self._session is None or self._session.closed:
            self._session = _session(self._keepalive_s, 0)
        merged = {**self._headers, **headers} if headers else self._headers
        try:
            resp = await self._session.request(
                method, self.base_url + path, data=body, headers=merged, timeout=self._timeout(total_timeout_s),
                allow_redirects=False, compress=None,
            )  # fmt: skip
        except _CAUGHT as exc:
            raise _classify(exc) from exc
        return Response(resp)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def _timeouts(request: httpx.Request) -> aiohttp.ClientTimeout:
    t: dict[str, Any] = request.extensions.get("timeout") or {}
    return aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))


def _to_httpx(err: TransportError, request: httpx.Request) -> httpx.HTTPError:
    if err.kind == "connect_timeout":
        return httpx.ConnectTimeout(str(err), request=request)
    if err.kind == "timeout":
        return httpx.ReadTimeout(str(err), request=request)
    if err.kind == "connect":
        return httpx.ConnectError(str(err), request=request)
    return httpx.RemoteProtocolError(str(err), request=request)


class _Body(httpx.AsyncByteStream):
    """The response body as httpx reads it; chunks are whatever aiohttp has buffered."""

    def __init__(self, resp: Response, request: httpx.Request) -> None:
        self._resp = resp
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            try:
                chunk = await self._resp.chunk()
            except TransportError as err:
                raise _to_httpx(err, self._request) from err
            if not chunk:
                break
            yield chunk

    async def aclose(self) -> None:
        self._resp.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's API over one ``aiohttp.ClientSession`` (created on first use, inside the running loop).

    ``max_connections`` None = unlimited (httpx's ``Limits`` do not reach a custom transport, so the cap is here).
    """

    def __init__(self, keepalive_expiry_s: float = 30.0, max_connections: int | None = None) -> None:
        self._keepalive_s = keepalive_expiry_s
        self._limit = max_connections or 0
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = _session(self._keepalive_s, self._limit)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._get_session()
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = await request.aread()
        try:
            resp = await session.request(
                request.method,
                str(request.url),
                data=body or None,
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                timeout=_timeouts(request),
                allow_redirects=False,
                compress=None,
            )
        except _CAUGHT as exc:
            raise _to_httpx(_classify(exc), request) from exc
        headers = [(k, v) for k, v in resp.raw_headers]
        return httpx.Response(
            resp.status, headers=headers, stream=_Body(Response(resp), request), request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (resp.reason or "").encode()},
        )  # fmt: skip

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
