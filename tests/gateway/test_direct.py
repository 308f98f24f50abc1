"""The stream relay's direct path (pdctl.gateway.direct) under the gateway's own server, uvicorn with httptools.

Each test serves a small ASGI app that relays one worker response with :func:`pdctl.gateway.relay.relay`, through
:class:`pdctl.vllm.transport.Client`, from a fake worker (an asyncio server in the same loop) to a raw socket client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn

from pdctl.gateway.direct import HttpProtocol, client_socket, watch_disconnect
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.relay import RelayResult, relay
from pdctl.testing import free_port
from pdctl.vllm.transport import Client
from tests.fakes._http import chunked

Worker = Callable[[asyncio.StreamWriter], Awaitable[None]]


def _event(i: int, size: int = 20) -> bytes:
    return b'data: {"choices":[{"text":"' + (b"%06d" % i) * (size // 6 + 1) + b'"}]}\n\n'


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@contextlib.asynccontextmanager
async def _serving(app: Any, http: Any) -> AsyncIterator[int]:
    """``app`` under uvicorn with the ``http`` protocol and no lifespan (only HTTP scopes reach it); yields its
    port."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=http, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def _setup(
    worker: Worker, read_timeout_s: float | None = None, sndbuf: int | None = None
) -> AsyncIterator[tuple[int, list[RelayResult]]]:
    """A fake worker answering every request with ``worker``; a uvicorn app relaying it; yields the app's port.

    ``sndbuf``: the app's socket to the client gets this small a kernel send buffer, so a client that does not
    read fills it within a few pieces (the kernel would otherwise take megabytes)."""

    handlers: set[asyncio.Task[Any]] = set()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            writer.write(HEAD)
            await worker(writer)
            await writer.drain()
            await reader.read()  # until the gateway closes the connection
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def serve_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(answer(reader, writer))
        handlers.add(task)
        task.add_done_callback(handlers.discard)

    wserver = await asyncio.start_server(serve_worker, "127.0.0.1", 0)
    wport = wserver.sockets[0].getsockname()[1]
    client = Client(f"http://127.0.0.1:{wport}", read_timeout_s=read_timeout_s)
    results: list[RelayResult] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if sndbuf is not None:
            send.__self__.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        resp = await client.request("POST", "/v1/completions", body=b"{}")
        try:
            ex = RequestRecord(send=send, request_id="r", started=0.0, deadline=1e12)
            results.append(await relay(ex, resp, True))
        finally:
            resp.close()

    try:
        async with _serving(app, "httptools") as port:
            yield port, results
    finally:
        await client.aclose()
        wserver.close()
        for handler in list(handlers):
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


async def _get(
    port: int, read_delay_s: float = 0.0, rcvbuf: int | None = None, mark: tuple[int, asyncio.Event] | None = None
) -> bytes:
    """POST through the app from a raw socket; returns the decoded (de-chunked) body. ``mark``: set the event
    once that many bytes arrived."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    await asyncio.sleep(read_delay_s)
    raw = b""
    while True:
        data = await loop.sock_recv(sock, 1 << 16)
        if not data:
            break
        raw += data
        if mark is not None and len(raw) >= mark[0]:
            mark[1].set()
    sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower()
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n", body
            return out
        out += body[:size]
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


def _relay_once(
    worker: Worker,
    read_timeout_s: float | None = None,
    sndbuf: int | None = None,
    read_delay_s: float = 0.0,
    rcvbuf: int | None = None,
    mark: tuple[int, asyncio.Event] | None = None,
) -> tuple[bytes, RelayResult]:
    """One request through :func:`_setup`'s app (its options) read by :func:`_get` (its options): the body the
    client got and the app's one relay result."""

    async def go() -> tuple[bytes, RelayResult]:
        async with _setup(worker, read_timeout_s, sndbuf) as (port, results):
            body = await _get(port, read_delay_s, rcvbuf, mark)
            [result] = results
            return body, result

    return asyncio.run(go())


def test_paced_stream_goes_the_direct_path_byte_for_byte() -> None:
    """Events arriving one by one (some split mid-event) reach the client exactly, written by the direct path."""
    events = [_event(i) for i in range(12)]
    done = b"data: [DONE]\n\n"

    async def worker(writer: asyncio.StreamWriter) -> None:
        for i, e in enumerate(events):
            if i % 4 == 3:  # an event split across two reads
                writer.write(chunked(e[:7]))
                await writer.drain()
                await asyncio.sleep(0.01)
                e = e[7:]
            writer.write(chunked(e))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(chunked(done) + b"0\r\n\r\n")

    body, result = _relay_once(worker)
    assert body == b"".join(events) + done
    assert result.error is None and result.done and result.events == 13
    assert result.direct >= 8, result.direct  # the last piece goes through send, with the end


def test_the_first_token_goes_the_direct_path_too() -> None:
    """A stream's first piece is written from the worker connection's read callback as well: under load a wake-up
    of the relay task waits a whole turn of the event loop, which would delay every first token."""
    first = _event(0)
    done = b"data: [DONE]\n\n"

    async def worker(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.05)  # the headers first, alone, as vLLM sends them before its first token
        writer.write(chunked(first))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(chunked(done) + b"0\r\n\r\n")

    body, result = _relay_once(worker)
    assert body == first + done
    assert result.error is None and result.done and result.events == 2
    assert result.direct == 1  # the first event; the last goes with the end of the response, via send


def test_slow_client_gets_everything_in_order() -> None:
    """A client that does not read for a while: uvicorn pauses writing, the direct path declines, the relay waits
    for the client through send; nothing is lost or reordered, and the direct path resumes afterwards."""
    events = [_event(i, 2000) for i in range(1500)]  # ~3 MB, far beyond the shrunk socket buffers
    paced = [_event(i) for i in range(12)]
    caught_up = asyncio.Event()

    async def worker(writer: asyncio.StreamWriter) -> None:
        for i in range(0, len(events), 10):
            writer.write(chunked(b"".join(events[i : i + 10])))
            await writer.drain()
            await asyncio.sleep(0.001)
        await caught_up.wait()  # the client has read all of it
        for e in paced:
            writer.write(chunked(e))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    body, result = _relay_once(worker, sndbuf=4096, read_delay_s=0.5, rcvbuf=4096,
                               mark=(len(b"".join(events)), caught_up))  # fmt: skip
    assert body == b"".join(events) + b"".join(paced) + b"data: [DONE]\n\n"
    assert result.error is None and result.done and result.events == 1500 + 12 + 1
    assert result.direct >= 10, result.direct  # the paced events, once the client reads again


def test_read_timeout_counts_direct_pieces_and_still_fires_on_a_stall() -> None:
    """Pieces taken by the direct path reset the read (idle) timeout; a worker that then stalls still ends the
    stream with one error event."""

    async def worker(writer: asyncio.StreamWriter) -> None:
        for i in range(8):  # 0.8 s of steady output, beyond the 0.3 s read timeout in total
            writer.write(chunked(_event(i)))
            await writer.drain()
            await asyncio.sleep(0.1)
        await asyncio.sleep(5)  # then nothing

    body, result = _relay_once(worker, read_timeout_s=0.3)
    assert body.startswith(b"".join(_event(i) for i in range(8)))
    assert body.count(b'"error"') == 1 and body.endswith(b"\n\n")
    assert result.error is not None and result.error.code == "upstream_timeout"
    assert result.direct >= 6


def test_no_direct_path_without_uvicorn_or_before_a_chunked_start() -> None:
    async def send(message: dict[str, Any]) -> None:
        pass

    assert client_socket(send) is None

    async def go() -> None:
        seen: list[object] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            seen.append(client_socket(send))  # before the response started
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            seen.append(client_socket(send))  # a response with a length is not chunked
            await send({"type": "http.response.body", "body": b"ok"})

        async with _serving(app, "httptools") as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert (await reader.read()).endswith(b"ok")
            writer.close()
        assert seen == [None, None]

    asyncio.run(go())


def test_the_gateway_protocol_tells_a_request_its_client_left_without_a_task() -> None:
    """Under :class:`HttpProtocol` a request learns of its client's disconnect from the connection itself (one
    call, no task blocked in ``receive()``); under uvicorn's own protocol it cannot, and says so."""

    async def go(http: Any) -> tuple[list[bool], list[str]]:
        registered: list[bool] = []
        calls: list[str] = []
        done = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await receive()  # the body
            registered.append(watch_disconnect(send, lambda: calls.append("gone")))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 5)  # released once the client has left

        async with _serving(app, http) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            assert b"first" in await reader.readuntil(b"first")
            writer.close()
            for _ in range(200):
                if calls or not registered[0]:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            done.set()
        return registered, calls

    registered, calls = asyncio.run(go(HttpProtocol))
    assert registered == [True] and calls == ["gone"]
    registered, calls = asyncio.run(go("httptools"))
    assert registered == [False] and calls == []


def test_a_client_gone_before_the_watch_is_told_at_once_and_a_finished_one_never() -> None:
    async def go() -> tuple[list[str], list[str]]:
        early: list[str] = []
        late: list[str] = []
        left = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await receive()
            if scope["path"] == "/early":
                await left.wait()
                await asyncio.sleep(0.1)  # the connection is lost by now
                assert watch_disconnect(send, lambda: early.append("gone"))
                return
            assert watch_disconnect(send, lambda: late.append("gone"))
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            watch_disconnect(send, None)

        async with _serving(app, HttpProtocol) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            writer.close()
            left.set()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /late HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            assert (await reader.readuntil(b"ok")).endswith(b"ok")
            writer.close()  # after a complete response: not a disconnect of a request in progress
            await asyncio.sleep(0.2)
        return early, late

    early, late = asyncio.run(go())
    assert early == ["gone"]
    assert late == []
