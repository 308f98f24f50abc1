"""httpx's API over aiohttp's sockets, for ``pdctl bench`` (and tests), whose code stays on httpx.

* :class:`AiohttpTransport`: an ``httpx.AsyncBaseTransport`` over one ``aiohttp.ClientSession``; the body is read
  as aiohttp buffers it (:class:`_Body`).
* Mapping: per-request ``timeout`` (httpx's ``connect``/``read``) -> ``aiohttp.ClientTimeout(sock_connect,
  sock_read)``; aiohttp's failures are first sorted into the kinds of :class:`pdctl.vllm.transport.TransportError`
  (:func:`_classify`), then raised as httpx's: ``httpx.ConnectError`` / ``ConnectTimeout``; a stalled read ->
  ``httpx.ReadTimeout``; a broken stream -> ``httpx.RemoteProtocolError`` / ``ReadError`` (LiteLLM made the same
  move, BerriAI/litellm#11097).

Why aiohttp under httpx: at 800 requests/s, over httpx's own transport, pdctl bench completed only ~313 requests/s;
over this one it keeps up with ``vllm bench serve`` (docs/performance.md, "The bench client against vllm bench
serve", Capacity).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx

from pdctl.vllm.transport import TransportError

__all__ = ["AiohttpTransport"]


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

    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._resp = resp
        self._request = request
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            try:
                chunk = await self._resp.content.readany()
            except _CAUGHT as exc:
                raise _to_httpx(_classify(exc), self._request) from exc
            if not chunk:
                self._done = True
                break
            yield chunk

    async def aclose(self) -> None:
        # Back to the pool when read to the end; else drop the connection (the worker aborts the request).
        if self._done:
            self._resp.release()
        else:
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
            resp.status, headers=headers, stream=_Body(resp, request), request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (resp.reason or "").encode()},
        )  # fmt: skip

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
