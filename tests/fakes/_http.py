"""A minimal asyncio HTTP/1.1 server for the fakes: full control over resets, stalls and aborts."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


def completion_body(oid: str, model: Any, chat: bool, text: str, finish: str, prompt_tokens: int, tokens: int) -> Any:
    """A whole OpenAI completion (``chat`` or legacy) answering with ``text``."""
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        if chat
        else {"index": 0, "text": text, "finish_reason": finish}
    )
    return {
        "id": oid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens},
    }


def chunked(data: bytes) -> bytes:
    """``data`` as one piece of an HTTP/1.1 chunked body (``data`` not empty: a piece of length 0 ends the body)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def chunk_event(oid: str, model: Any, chat: bool, text: str, finish: str | None) -> bytes:
    """One streamed OpenAI chunk as an SSE event."""
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    obj = {
        "id": oid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "model": model,
        "choices": [{**choice, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


class Response:
    """Helpers a handler uses to answer."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.w = req.writer
        self.sent_headers = False

    async def send(
        self, status: int, body: bytes, ctype: str = "application/json", headers: dict[str, str] | None = None
    ) -> None:
        h = {"content-type": ctype, "content-length": str(len(body)), "connection": "close", **(headers or {})}
        head = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        self.w.write(head.encode() + body)
        await self.w.drain()

    async def json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        await self.send(status, json.dumps(obj).encode(), headers=headers)

    async def start_stream(self, headers: dict[str, str] | None = None) -> None:
        h = {
            "content-type": "text/event-stream",
            "transfer-encoding": "chunked",
            "connection": "close",
            **(headers or {}),
        }
        head = "HTTP/1.1 200 OK\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        self.w.write(head.encode())
        await self.w.drain()
        self.sent_headers = True

    async def chunk(self, data: bytes) -> None:
        self.w.write(chunked(data))
        await self.w.drain()

    async def end_stream(self) -> None:
        self.w.write(b"0\r\n\r\n")
        await self.w.drain()

    def reset(self) -> None:
        self.w.transport.abort()


Handler = Callable[[Request, Response], Awaitable[None]]


async def _serve_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            method, path, _ = line.decode().split(" ", 2)
            headers: dict[str, str] = {}
            while True:
                h = await reader.readline()
                if h in (b"\r\n", b"\n", b""):
                    break
                k, _, v = h.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            n = int(headers.get("content-length", "0"))
            body = await reader.readexactly(n) if n else b""
            req = Request(method, path.split("?")[0], headers, body, reader, writer)

            async def watch(req: Request = req) -> None:
                try:
                    data = await reader.read(1)
                except (ConnectionError, asyncio.IncompleteReadError):
                    data = b""
                if not data:
                    req.aborted.set()

            # Every response says "connection: close", so reading ahead cannot eat a next request.
            watcher = asyncio.ensure_future(watch())
            try:
                await handler(req, Response(req))
            finally:
                watcher.cancel()
            break
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        try:
            writer.close()
        except Exception:
            pass


async def serve(host: str, port: int, handler: Handler, ready: Callable[[int], None]) -> None:
    server = await asyncio.start_server(lambda r, w: _serve_conn(r, w, handler), host, port)
    ready(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


def main(handler: Handler, spec: dict[str, Any], on_port: Callable[[int], None] | None = None) -> None:
    """A fake's command line: ``--port`` (0: any free one) and ``--spec`` (JSON merged into ``spec``); serves
    ``handler`` on 127.0.0.1 and prints ``PORT <n>`` once listening (after ``on_port(n)``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--spec", default="{}")
    args = ap.parse_args()
    spec.update(json.loads(args.spec))

    def ready(port: int) -> None:
        if on_port is not None:
            on_port(port)
        print(f"PORT {port}", flush=True)

    asyncio.run(serve("127.0.0.1", args.port, handler, ready))
