"""pdctl.transport.AiohttpTransport against small real asyncio HTTP servers: httpx's API and errors over aiohttp."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from pdctl.transport import AiohttpTransport, Client, TransportError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length) if length else b""


async def _sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            head, body = await _read_request(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        if head.startswith(b"POST /stream"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(3):
                event = b'data: {"n": %d}\n\n' % i
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.01)
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        elif head.startswith(b"POST /long"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            try:
                for _ in range(500):
                    writer.write(b"6\r\ndata:\n\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.01)
            except ConnectionError:
                return
        elif head.startswith(b"POST /echo"):
            out = b'{"got": %d, "rid": "%s"}' % (len(body), _header(head, b"x-request-id"))
            writer.write(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(out), out))  # fmt: skip
        elif head.startswith(b"GET /stall"):
            await asyncio.sleep(30)
        await writer.drain()


def _header(head: bytes, name: bytes) -> bytes:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(name + b":"):
            return line.split(b":", 1)[1].strip()
    return b""


async def _server(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_post_stream_and_connection_reuse() -> None:
    peers: set[int] = set()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.add(writer.get_extra_info("peername")[1])
        await _sse(reader, writer)

    async def main() -> None:
        server, base = await _server(handler)
        async with server:
            client = httpx.AsyncClient(base_url=base, transport=AiohttpTransport())
            try:
                r = await client.post("/echo", content=b"x" * 100, headers={"x-request-id": "abc"})
                assert r.status_code == 201
                assert r.json() == {"got": 100, "rid": "abc"}
                for _ in range(3):
                    async with client.stream("POST", "/stream", content=b"{}") as resp:
                        assert resp.headers["content-type"] == "text/event-stream"
                        data = b"".join([c async for c in resp.aiter_raw()])
                    assert data.count(b"data:") == 4 and data.endswith(b"data: [DONE]\n\n")
            finally:
                await client.aclose()
        assert len(peers) == 1  # one keep-alive connection served all four requests

    asyncio.run(main())


def test_connect_error_on_a_closed_port() -> None:
    async def main() -> None:
        server, base = await _server(_sse)
        server.close()
        await server.wait_closed()
        client = httpx.AsyncClient(base_url=base, transport=AiohttpTransport())
        try:
            with pytest.raises(httpx.ConnectError):
                await client.get("/health")
        finally:
            await client.aclose()

    asyncio.run(main())


def test_read_timeout_from_the_request_timeout() -> None:
    async def main() -> None:
        server, base = await _server(_sse)
        async with server:
            client = httpx.AsyncClient(base_url=base, transport=AiohttpTransport(), timeout=httpx.Timeout(0.3))
            try:
                with pytest.raises(httpx.ReadTimeout):
                    await client.get("/stall")
            finally:
                await client.aclose()

    asyncio.run(main())


async def _server_sees_client_leave(
    read_one_then_close: Callable[[str], Awaitable[Callable[[], Awaitable[None]]]],
) -> None:
    """``read_one_then_close(base)`` opens a 500-event stream, reads one piece and closes that response early,
    returning how to close its client. Before the client itself closes (which would drop every connection
    anyway) the server must see the client leave, as vLLM does (it aborts the request)."""
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _sse(reader, writer)
        gone.set()

    server, base = await _server(handler)
    async with server:
        close_client = await read_one_then_close(base)
        try:
            await asyncio.wait_for(gone.wait(), timeout=3.0)
        finally:
            await close_client()


def test_closing_a_stream_early_closes_the_connection() -> None:
    async def read_one_then_close(base: str) -> Callable[[], Awaitable[None]]:
        client = httpx.AsyncClient(base_url=base, transport=AiohttpTransport())
        resp = await client.send(client.build_request("POST", "/long", content=b"{}"), stream=True)
        assert (await resp.aiter_raw().__anext__()).startswith(b"data:")
        await resp.aclose()
        return client.aclose

    asyncio.run(_server_sees_client_leave(read_one_then_close))


# ---- the gateway's native client (pdctl.transport.Client): the same sockets without httpx


def test_client_reads_whole_and_chunked_bodies_over_one_connection() -> None:
    peers: set[int] = set()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.add(writer.get_extra_info("peername")[1])
        await _sse(reader, writer)

    async def main() -> None:
        server, base = await _server(handler)
        async with server:
            client = Client(base, read_timeout_s=5.0, headers={"x-request-id": "default"})
            try:
                r = await client.request("POST", "/echo", body=b"x" * 10, headers={"x-request-id": "abc"})
                assert r.status == 201 and await r.json() == {"got": 10, "rid": "abc"}
                r.close()
                r = await client.request("POST", "/echo", body=b"")
                assert await r.json() == {"got": 0, "rid": "default"}  # the client's default header
                r.close()
                r = await client.request("POST", "/stream", body=b"{}")
                assert r.headers["content-type"] == "text/event-stream"
                pieces = []
                while piece := await r.chunk():
                    pieces.append(piece)
                r.close()
                data = b"".join(pieces)
                assert data.count(b"data:") == 4 and data.endswith(b"data: [DONE]\n\n")
                assert len(pieces) >= 2  # pieces arrive as sent (10 ms apart), not after the end
            finally:
                await client.aclose()
        assert len(peers) == 1  # every call went over one keep-alive connection

    asyncio.run(main())


def test_client_failures_have_kinds() -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata:\n\r\n")
        await writer.drain()
        writer.close()  # mid-body, without the last chunk

    async def main() -> None:
        server, base = await _server(_sse)
        async with server:
            client = Client(base, read_timeout_s=0.3)
            try:
                with pytest.raises(TransportError) as info:
                    await client.request("GET", "/stall")
                assert info.value.kind == "timeout"
                with pytest.raises(TransportError) as info:
                    await client.request("GET", "/stall", total_timeout_s=0.1)
                assert info.value.kind == "timeout"
            finally:
                await client.aclose()
        closed = Client(base)
        with pytest.raises(TransportError) as info:
            await closed.request("GET", "/health")
        assert info.value.kind == "connect"
        await closed.aclose()
        server, base = await _server(broken)
        async with server:
            client = Client(base, read_timeout_s=5.0)
            try:
                r = await client.request("POST", "/x", body=b"{}")
                assert await r.chunk() == b"data:\n"
                with pytest.raises(TransportError) as info:
                    while await r.chunk():
                        pass
                assert info.value.kind == "broken"
                r.close()
            finally:
                await client.aclose()

    asyncio.run(main())


def test_client_closing_a_stream_early_drops_the_connection() -> None:
    async def read_one_then_close(base: str) -> Callable[[], Awaitable[None]]:
        client = Client(base)
        r = await client.request("POST", "/long", body=b"{}")
        assert (await r.chunk()).startswith(b"data:")
        r.close()
        return client.aclose

    asyncio.run(_server_sees_client_leave(read_one_then_close))
