"""pdctl.bench.aiohttp_transport.AiohttpTransport against small real asyncio HTTP servers: httpx's API and errors over aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.bench.aiohttp_transport import AiohttpTransport
from pdctl.vllm.transport import Client, TransportError
from tests.fakes._http import chunked
from tests.fakes.helpers import self_signed_cert

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
                writer.write(chunked(event))
                await writer.drain()
                await asyncio.sleep(0.01)
            done = b"data: [DONE]\n\n"
            writer.write(chunked(done) + b"0\r\n\r\n")
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


def _sse_noting_peers(peers: set[int]) -> Handler:
    """:func:`_sse`, adding each connection's client port to ``peers`` (one keep-alive connection: one port)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.add(writer.get_extra_info("peername")[1])
        await _sse(reader, writer)

    return handler


async def _server(handler: Handler) -> tuple[asyncio.Server, str]:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:  # the server's end of each connection, whatever its handler did (no unclosed transport)
            writer.close()

    server = await asyncio.start_server(closing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_post_stream_and_connection_reuse() -> None:
    peers: set[int] = set()

    async def main() -> None:
        server, base = await _server(_sse_noting_peers(peers))
        async with server:
            async with httpx.AsyncClient(base_url=base, transport=AiohttpTransport()) as client:
                r = await client.post("/echo", content=b"x" * 100, headers={"x-request-id": "abc"})
                assert r.status_code == 201
                assert r.json() == {"got": 100, "rid": "abc"}
                for _ in range(3):
                    async with client.stream("POST", "/stream", content=b"{}") as resp:
                        assert resp.headers["content-type"] == "text/event-stream"
                        data = b"".join([c async for c in resp.aiter_raw()])
                    assert data.count(b"data:") == 4 and data.endswith(b"data: [DONE]\n\n")
        assert len(peers) == 1  # one keep-alive connection served all four requests

    asyncio.run(main())


def test_connect_error_on_a_closed_port() -> None:
    async def main() -> None:
        server, base = await _server(_sse)
        server.close()
        await server.wait_closed()
        async with httpx.AsyncClient(base_url=base, transport=AiohttpTransport()) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get("/health")

    asyncio.run(main())


def test_read_timeout_from_the_request_timeout() -> None:
    async def main() -> None:
        server, base = await _server(_sse)
        async with server:
            timeout = httpx.Timeout(0.3)
            async with httpx.AsyncClient(base_url=base, transport=AiohttpTransport(), timeout=timeout) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.get("/stall")

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


# ---- the gateway's native client (pdctl.vllm.transport.Client): the same sockets without httpx


def test_client_reads_whole_and_chunked_bodies_over_one_connection() -> None:
    peers: set[int] = set()

    async def main() -> None:
        server, base = await _server(_sse_noting_peers(peers))
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


# ---- the raw client's own behaviours, on asyncio's loop and on uvloop (the gateway's)


@contextlib.asynccontextmanager
async def _client_of(handler: Handler, **kwargs: Any) -> AsyncIterator[Client]:
    """A :class:`Client` of a server running ``handler``, both closed at the end."""
    server, base = await _server(handler)
    async with server:
        client = Client(base, **kwargs)
        try:
            yield client
        finally:
            await client.aclose()


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Awaitable[None]], None]:
    """Runs a test's coroutine on one event loop implementation; an error the loop only logs (one raised in a
    protocol callback, e.g. ``connection_lost`` after ``aclose``) fails the test."""
    if request.param == "uvloop":
        import uvloop

        loop_run: Callable[[Awaitable[None]], None] = uvloop.run
    else:
        loop_run = asyncio.run

    def runner(coro: Awaitable[None]) -> None:
        errors: list[dict[str, Any]] = []

        async def main() -> None:
            def record(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
                # A fake server's handler task cancelled at the end is the servers' business, not the client's.
                if not isinstance(context.get("exception"), asyncio.CancelledError):
                    errors.append(context)

            asyncio.get_running_loop().set_exception_handler(record)
            await coro
            for _ in range(3):
                await asyncio.sleep(0.01)  # the closed connections' connection_lost callbacks

        loop_run(main())
        assert not errors, errors

    return runner


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    """``body`` in chunked transfer encoding, cut into chunks of ``sizes`` (cycled), with a chunk extension."""
    out, i, n = [], 0, 0
    while i < len(body):
        size = sizes[n % len(sizes)]
        out.append(b"%x;ext=1\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]))
        i, n = i + size, n + 1
    return b"".join(out) + b"0\r\nx-trailer: yes\r\n\r\n"


def test_chunked_body_with_odd_boundaries_then_reuse(run: Callable[[Awaitable[None]], None]) -> None:
    """Chunk-size lines, data and CRLFs split across TCP writes one byte at a time, in every combination."""
    body = b"".join(b'data: {"i": %d}\n\n' % i for i in range(40)) + b"data: [DONE]\n\n"
    wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(body, [1, 7, 2, 33, 3])
    peers: set[int] = set()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.add(writer.get_extra_info("peername")[1])
        while True:
            try:
                await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            for i in range(0, len(wire), 5):  # 5-byte writes: every boundary lands somewhere mid-token
                writer.write(wire[i : i + 5])
                await writer.drain()
                if i % 50 == 0:
                    await asyncio.sleep(0)

    async def main() -> None:
        async with _client_of(handler, read_timeout_s=5.0) as client:
            for _ in range(3):
                r = await client.request("POST", "/v1/completions", body=b"{}")
                pieces = []
                while piece := await r.chunk():
                    pieces.append(piece)
                r.close()
                assert b"".join(pieces) == body
            r = await client.request("POST", "/v1/completions", body=b"{}")
            assert await r.read() == body
            r.close()
        assert len(peers) == 1

    run(main())


def test_content_length_and_close_delimited_bodies(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await _read_request(reader)
            if head.startswith(b"GET /sized"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhe")
                await writer.drain()
                await asyncio.sleep(0.01)
                writer.write(b"llo")
            elif head.startswith(b"GET /empty"):
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            else:  # neither a length nor chunks: the body ends when the connection does
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end")
                await writer.drain()
                writer.close()
                return
            await writer.drain()

    async def main() -> None:
        async with _client_of(handler, read_timeout_s=5.0) as client:
            r = await client.request("GET", "/sized")
            assert (r.status, await r.read()) == (200, b"hello")
            r.close()
            r = await client.request("GET", "/empty")
            assert (r.status, await r.read()) == (204, b"")
            r.close()
            r = await client.request("GET", "/until-close")
            assert r.headers["content-type"] == "text/plain"
            assert await r.read() == b"until the end"
            r.close()

    run(main())


def test_reset_mid_body_is_broken_and_the_next_call_reconnects(run: Callable[[Awaitable[None]], None]) -> None:
    calls = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        await _read_request(reader)
        calls += 1
        if calls == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
            await writer.drain()
            await asyncio.sleep(0.05)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()  # RST, not FIN
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async def main() -> None:
        async with _client_of(handler, read_timeout_s=5.0) as client:
            r = await client.request("POST", "/x", body=b"{}")
            assert await r.chunk() == b"x" * 10  # what arrived is handed over before the failure
            with pytest.raises(TransportError) as info:
                await r.chunk()
            assert info.value.kind == "broken"
            r.close()
            r = await client.request("POST", "/x", body=b"{}")
            assert await r.read() == b"ok"
            r.close()

    run(main())


def test_stalls_end_in_timeouts(run: Callable[[Awaitable[None]], None]) -> None:
    """A read timeout bounds each wait (so a slow but steady body passes it), a total timeout the whole call."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for _ in range(100 if head.startswith(b"POST /drip") else 1):
                writer.write(b"1\r\nx\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)
            await asyncio.sleep(30)  # then nothing
        except ConnectionError:
            pass

    async def main() -> None:
        async with _client_of(handler, read_timeout_s=0.3) as client:
            r = await client.request("POST", "/stall", body=b"{}")
            assert await r.chunk() == b"x"
            with pytest.raises(TransportError) as info:
                await r.chunk()
            assert info.value.kind == "timeout"
            r.close()
            r = await client.request("POST", "/drip", body=b"{}", total_timeout_s=0.6)
            got = b""
            with pytest.raises(TransportError) as info:
                while piece := await r.chunk():
                    got += piece
            assert info.value.kind == "timeout"
            assert len(got) >= 3  # pieces 50 ms apart passed the 300 ms read timeout until the total ran out
            r.close()

    run(main())


def test_a_stall_timeout_bounds_the_waits_from_the_first_piece_on(run: Callable[[Awaitable[None]], None]) -> None:
    """``Response.stall_timeout``: a stream's token deadline, shorter than the read timeout, bounds each wait once
    the first piece is in (a first piece slower than it still arrives); a longer one changes nothing."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            await writer.drain()
            await asyncio.sleep(0.6)  # the first piece: slower than the stall timeout
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(30)  # then nothing
        except ConnectionError:
            pass

    async def main() -> None:
        async with _client_of(handler, read_timeout_s=20.0) as client:
            r = await client.request("POST", "/stream", body=b"{}")
            r.stall_timeout(0.2)
            assert await r.chunk() == b"x"
            with pytest.raises(TransportError) as info:  # (wait_for: without the stall timeout, 20 s would pass)
                await asyncio.wait_for(r.chunk(), 10.0)
            assert info.value.kind == "timeout"
            r.close()
        async with _client_of(handler, read_timeout_s=0.3) as client:
            r = await client.request("POST", "/stream", body=b"{}")
            r.stall_timeout(30.0)  # longer than the read timeout: the read timeout still bounds the first wait
            with pytest.raises(TransportError) as info:
                await asyncio.wait_for(r.chunk(), 10.0)
            assert info.value.kind == "timeout"
            r.close()

    run(main())


def test_keep_alive_closed_by_the_worker(run: Callable[[Awaitable[None]], None]) -> None:
    """A worker that closes after answering (idle keep-alive end, or ``connection: close``): the next call
    goes on a new connection. One that closes a reused connection under a new request: a GET is sent again,
    a POST fails ``broken`` (it may have been processed)."""
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        head, _ = await _read_request(reader)
        served += 1
        if head.startswith(b"GET /close-header"):
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(0.2)  # a client that reused this connection would hang here
        elif head.startswith((b"GET /then-drop", b"POST /then-drop")):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await _read_request(reader)  # the next request on this connection is never answered
                served += 1
        writer.close()

    async def main() -> None:
        async with _client_of(handler, read_timeout_s=5.0) as client:
            for path in ("/close-header", "/close-header"):
                r = await client.request("GET", path)
                assert await r.read() == b"ok"
                r.close()
            r = await client.request("GET", "/then-drop")
            assert await r.read() == b"ok"
            r.close()
            r = await client.request("GET", "/then-drop")  # reused, dropped, sent again on a new connection
            assert await r.read() == b"ok"
            r.close()
            assert served == 5  # 2 + 1 + the dropped GET and its second sending
            with pytest.raises(TransportError) as info:
                await client.request("POST", "/then-drop", body=b"{}")
            assert info.value.kind == "broken"
            r = await client.request("POST", "/then-drop", body=b"{}")  # the broken one was not pooled
            assert await r.read() == b"ok"
            r.close()

    run(main())


def test_idle_connections_close_after_keepalive(run: Callable[[Awaitable[None]], None]) -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()  # until the client closes its side
        gone.set()

    async def main() -> None:
        async with _client_of(handler, keepalive_s=0.1) as client:
            r = await client.request("GET", "/")
            await r.read()
            r.close()
            await asyncio.wait_for(gone.wait(), timeout=5.0)  # closed by the client, not by aclose()

    run(main())


def test_a_partly_read_response_is_never_pooled(run: Callable[[Awaitable[None]], None]) -> None:
    peers: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[1])
        await _sse(reader, writer)

    async def main() -> None:
        async with _client_of(handler, read_timeout_s=5.0) as client:
            r = await client.request("POST", "/long", body=b"{}")
            assert (await r.chunk()).startswith(b"data:")
            r.close()  # mid-body
            r = await client.request("POST", "/echo", body=b"abc")
            assert await r.json() == {"got": 3, "rid": ""}
            r.close()
        assert len(peers) == 2

    run(main())


def test_reading_pauses_while_the_reader_does_not_read(run: Callable[[Awaitable[None]], None]) -> None:
    """A 64 MiB body and a reader that stops after one piece: the worker's writes wait on TCP instead of the
    whole body piling up in the gateway's memory; reading again gets every byte in order."""
    piece = bytes(range(256)) * 256  # 64 KiB
    total = 1024
    written = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(piece) * total))
        with contextlib.suppress(ConnectionError):
            for _ in range(total):
                writer.write(piece)
                await writer.drain()
                written += 1

    async def main() -> None:
        async with _client_of(handler, read_timeout_s=5.0) as client:
            r = await client.request("GET", "/big")
            got = len(await r.chunk())
            seen = -1
            while seen != written:  # until the worker is held back (or has written everything)
                seen = written
                await asyncio.sleep(0.1)
            assert written < total
            rest = []
            while data := await r.chunk():
                rest.append(data)
            body = b"".join(rest)
            assert got + len(body) == len(piece) * total
            assert body[:1024] == (piece * 2)[got % len(piece) :][:1024]
            r.close()

    run(main())


def test_invalid_http_and_bad_headers(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with _client_of(handler, read_timeout_s=5.0) as client:
            with pytest.raises(TransportError) as info:
                await client.request("GET", "/")
            assert info.value.kind == "broken"
            with pytest.raises(ValueError, match="line break"):
                await client.request("GET", "/", headers={"x-request-id": "a\r\nx-injected: 1"})
        with pytest.raises(ValueError, match="not an http"):
            Client("ftp://127.0.0.1:1")

    run(main())


def test_cancelling_a_call_drops_its_connection(run: Callable[[Awaitable[None]], None]) -> None:
    """Cancelled while waiting for the headers (the gateway's client left): the worker sees the client leave."""
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()
        gone.set()

    async def main() -> None:
        async with _client_of(handler) as client:
            call = asyncio.ensure_future(client.request("POST", "/slow", body=b"{}"))
            await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.wait_for(gone.wait(), timeout=3.0)

    run(main())


def test_aclose_ends_a_stream_in_progress(run: Callable[[Awaitable[None]], None]) -> None:
    async def main() -> None:
        server, base = await _server(_sse)
        async with server:
            client = Client(base, read_timeout_s=5.0)
            r = await client.request("POST", "/long", body=b"{}")
            assert (await r.chunk()).startswith(b"data:")
            await client.aclose()
            with pytest.raises(TransportError) as info:
                while await r.chunk():
                    pass
            assert info.value.kind == "broken"
            r.close()

    run(main())


def test_https_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``https://`` worker: a certificate nobody trusts fails as ``connect``; a trusted one (here through
    ``SSL_CERT_FILE``, which the default context reads) serves calls over one kept-alive TLS connection."""
    cert, key = self_signed_cert(tmp_path, days=30)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    peers: set[int] = set()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.add(writer.get_extra_info("peername")[1])
        await _sse(reader, writer)

    async def main(expect_trusted: bool) -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_tls)
        async with server:
            client = Client(f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}", read_timeout_s=5.0)
            try:
                if not expect_trusted:
                    with pytest.raises(TransportError) as info:
                        await client.request("POST", "/echo", body=b"x")
                    assert info.value.kind == "connect" and "CERTIFICATE_VERIFY_FAILED" in str(info.value)
                    return
                for n in (1, 2):
                    r = await client.request("POST", "/echo", body=b"x" * n)
                    assert await r.json() == {"got": n, "rid": ""}
                    r.close()
            finally:
                await client.aclose()

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    asyncio.run(main(expect_trusted=False))
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    asyncio.run(main(expect_trusted=True))
    assert len(peers) == 1  # both calls over one TLS connection (a refused handshake never reaches the handler)
