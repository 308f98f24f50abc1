"""Minimal PD two-leg proxies, one per server/client library pair, to choose the gateway's libraries.

Each does only what every PD proxy must: read the body, leg 1 (prefill, ``max_tokens=1``, not streamed) via
:mod:`pdctl.vllm.protocol`, leg 2 (decode) streamed back chunk by chunk. No auth, limits, metrics or logs, so
the numbers show what the libraries cost, and the gap to the real gateway shows what its features cost.

Variants (``--variant``):

* ``uvicorn-httpx``    raw ASGI on uvicorn (uvloop + httptools) with one pooled ``httpx.AsyncClient`` per
                       worker: the gateway's current stack.
* ``uvicorn-aiohttp``  the same server, worker legs with one ``aiohttp.ClientSession`` per worker.
* ``aiohttp``          aiohttp end to end: ``aiohttp.web`` server and ``ClientSession`` legs (on uvloop).

    .venv/bin/python -m benchmarks.proto_proxy --variant uvicorn-aiohttp --port P --prefill URL --decode URL
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pdctl.vllm.protocol import build_decode_body, build_prefill_body

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
_JSON = [(b"content-type", b"application/json")]


async def _read(receive: Receive) -> bytes:
    parts = []
    while True:
        m = await receive()
        parts.append(m.get("body", b""))
        if not m.get("more_body"):
            return b"".join(parts)


class _AsgiApp:
    """What both raw-ASGI variants do alike: the lifespan, ``/health`` and the request's JSON body; a variant's
    :meth:`proxy` makes the two legs."""

    async def startup(self) -> None:
        """Before the first request."""

    async def shutdown(self) -> None:
        """After the last request."""

    async def proxy(self, path: str, body: dict[str, Any], send: Send) -> None:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await self.startup()
                    await send({"type": "lifespan.startup.complete"})
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": _JSON})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        await self.proxy(scope["path"], json.loads(await _read(receive)), send)


class _HttpxApp(_AsgiApp):
    def __init__(self, prefill: str, decode: str) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=30.0)
        self.p = httpx.AsyncClient(base_url=prefill, limits=limits, timeout=300)
        self.d = httpx.AsyncClient(base_url=decode, limits=limits, timeout=300)

    async def proxy(self, path: str, body: dict[str, Any], send: Send) -> None:
        r1 = await self.p.post(path, content=json.dumps(build_prefill_body(body)).encode(),
                               headers={"content-type": "application/json"})  # fmt: skip
        params = r1.json().get("kv_transfer_params")
        req = self.d.build_request("POST", path, content=json.dumps(build_decode_body(body, params)).encode(),
                                   headers={"content-type": "application/json"})  # fmt: skip
        resp = await self.d.send(req, stream=True)
        try:
            await send({"type": "http.response.start", "status": resp.status_code, "headers": _SSE})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await resp.aclose()


class _AiohttpClientApp(_AsgiApp):
    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill, decode
        self.p: Any = None
        self.d: Any = None

    async def startup(self) -> None:
        import aiohttp

        def session(base: str) -> aiohttp.ClientSession:
            conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)
            return aiohttp.ClientSession(base_url=base, connector=conn, timeout=aiohttp.ClientTimeout(total=300),
                                         auto_decompress=False)  # fmt: skip

        self.p, self.d = session(self.prefill), session(self.decode)

    async def shutdown(self) -> None:
        await self.p.close()
        await self.d.close()

    async def proxy(self, path: str, body: dict[str, Any], send: Send) -> None:
        h = {"content-type": "application/json"}
        async with self.p.post(path, data=json.dumps(build_prefill_body(body)).encode(), headers=h) as r1:
            params = (await r1.json(content_type=None)).get("kv_transfer_params")
        async with self.d.post(path, data=json.dumps(build_decode_body(body, params)).encode(), headers=h) as resp:
            await send({"type": "http.response.start", "status": resp.status, "headers": _SSE})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})


def _serve_uvicorn(app: Any, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", lifespan="on",
                access_log=False, log_level="warning", backlog=4096)  # fmt: skip


def _serve_aiohttp(prefill: str, decode: str, port: int) -> None:
    import aiohttp
    import uvloop
    from aiohttp import web

    sessions: dict[str, aiohttp.ClientSession] = {}

    async def start(_: web.Application) -> None:
        for name, base in (("p", prefill), ("d", decode)):
            sessions[name] = aiohttp.ClientSession(
                base_url=base, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
                timeout=aiohttp.ClientTimeout(total=300), auto_decompress=False,
            )  # fmt: skip

    async def stop(_: web.Application) -> None:
        for s in sessions.values():
            await s.close()

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        path = request.path
        h = {"content-type": "application/json"}
        async with sessions["p"].post(path, data=json.dumps(build_prefill_body(body)).encode(), headers=h) as r1:
            params = (await r1.json(content_type=None)).get("kv_transfer_params")
        dbody = json.dumps(build_decode_body(body, params)).encode()
        async with sessions["d"].post(path, data=dbody, headers=h) as resp:
            out = web.StreamResponse(status=resp.status, headers={"content-type": "text/event-stream; charset=utf-8"})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=4096)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=["uvicorn-httpx", "uvicorn-aiohttp", "aiohttp"], required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    a = ap.parse_args()
    if a.variant == "uvicorn-httpx":
        _serve_uvicorn(_HttpxApp(a.prefill, a.decode), a.port)
    elif a.variant == "uvicorn-aiohttp":
        _serve_uvicorn(_AiohttpClientApp(a.prefill, a.decode), a.port)
    else:
        _serve_aiohttp(a.prefill, a.decode, a.port)


if __name__ == "__main__":
    main()
