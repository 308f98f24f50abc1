"""An httpx transport that sends over aiohttp: httpx's API for pdctl's code, aiohttp's C HTTP parser underneath.

Used by the gateway's worker clients (and usable by the bench client). Why (docs/performance.md): with
httpx's default transport every streamed chunk goes through httpcore, anyio and h11's pure-Python
chunked-encoding reader, and every request through httpcore's connection pool, whose bookkeeping grows with
the number of open connections; profiling the gateway put 35-50 % of its CPU there.
aiohttp parses HTTP in C (llhttp) and hands over everything already buffered in one piece, which cut the
gateway's CPU per streamed chunk by about half at the same throughput. Keeping httpx as the API means the
gateway's error handling, timeouts and tests stay as they are; only the bytes move differently
(LiteLLM made the same move, BerriAI/litellm#11097).

Mapping: per-request ``timeout`` (httpx's ``connect``/``read``) -> ``aiohttp.ClientTimeout(sock_connect,
sock_read)``; connection failures -> ``httpx.ConnectError``/``ConnectTimeout``; a stalled read ->
``httpx.ReadTimeout``; a broken stream -> ``httpx.RemoteProtocolError``/``ReadError``. A response closed
before its end closes the connection (the worker sees the client leave and aborts the request).
``HTTP(S)_PROXY`` and ``.netrc`` are not read (aiohttp's ``trust_env`` reads ``.netrc`` in a thread on every
request, which cost a quarter of the gateway's CPU): pdctl's workers are local.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx

__all__ = ["AiohttpTransport"]


def _timeouts(request: httpx.Request) -> aiohttp.ClientTimeout:
    t: dict[str, Any] = request.extensions.get("timeout") or {}
    return aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))


class _Body(httpx.AsyncByteStream):
    """The response body as httpx reads it; chunks are whatever aiohttp has buffered."""

    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._resp = resp
        self._request = request
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                yield chunk
        except (aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError, asyncio.TimeoutError) as exc:
            raise httpx.ReadTimeout(str(exc) or "read timed out", request=self._request) from exc
        except aiohttp.ClientPayloadError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=self._request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=self._request) from exc
        self._done = True

    async def aclose(self) -> None:
        if self._done:
            self._resp.release()
        else:
            self._resp.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One ``aiohttp.ClientSession`` (created on first use, inside the running loop).

    ``max_connections`` None = unlimited (httpx's ``Limits`` do not reach a custom transport, so the cap is here).
    """

    def __init__(self, keepalive_expiry_s: float = 30.0, max_connections: int | None = None) -> None:
        self._keepalive_s = keepalive_expiry_s
        self._limit = max_connections or 0
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=self._keepalive_s, use_dns_cache=True)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
                timeout=aiohttp.ClientTimeout(total=None),
            )  # fmt: skip
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
        except aiohttp.ConnectionTimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "connect timed out", request=request) from exc
        except (aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError, asyncio.TimeoutError) as exc:
            raise httpx.ReadTimeout(str(exc) or "read timed out", request=request) from exc
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        except aiohttp.ServerDisconnectedError as exc:
            raise httpx.RemoteProtocolError(str(exc) or "server disconnected", request=request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
        headers = [(k, v) for k, v in resp.raw_headers]
        return httpx.Response(
            resp.status, headers=headers, stream=_Body(resp, request), request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (resp.reason or "").encode()},
        )  # fmt: skip

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
