"""F2: the SSE relay forwards the event stream byte for byte, however the bytes are split."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.gateway.record import RequestRecord
from pdctl.gateway.relay import relay
from pdctl.vllm.transport import Client
from tests.fakes._http import chunked


class _Chunks:
    """A body as the relay reads it; empty pieces are dropped, as a transport never hands one over mid-stream."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = iter([c for c in chunks if c])

    async def read(self) -> bytes:
        return b"".join(self.chunks)

    async def chunk(self) -> bytes:
        return next(self.chunks, b"")


def _run(chunks: list[bytes]) -> tuple[bytes, Any]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def go() -> Any:
        ex = RequestRecord(send=send, request_id="r", started=0.0, deadline=1e12)
        return await relay(ex, _Chunks(chunks), True)

    result = asyncio.run(go())
    assert sent[0]["type"] == "http.response.start"
    assert sent[-1]["more_body"] is False
    return b"".join(m.get("body", b"") for m in sent[1:]), result


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)


@settings(max_examples=60, deadline=None)
@given(st.lists(texts, min_size=1, max_size=8), st.lists(st.integers(0, 10_000), max_size=12), st.booleans())
def test_relay_is_byte_exact(tokens: list[str], cuts: list[int], crlf: bool) -> None:
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    events = [b"data: " + json.dumps({"choices": [{"text": t}]}, ensure_ascii=False).encode() + sep for t in tokens]
    usage = b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": len(tokens)}}).encode() + sep
    data = b"".join(events) + usage + b"data: [DONE]" + sep
    body, result = _run(_split(data, cuts))
    assert body == data
    assert result.error is None and result.done
    assert result.completion_tokens == len(tokens)


@settings(max_examples=30, deadline=None)
@given(st.lists(texts, min_size=1, max_size=5), st.lists(st.integers(0, 10_000), max_size=6))
def test_stream_without_done_ends_with_one_error_event(tokens: list[str], cuts: list[int]) -> None:
    data = b"".join(b"data: " + json.dumps({"t": t}).encode() + b"\n\n" for t in tokens)
    cut = len(data) - 1 - len(tokens[-1].encode()) // 2  # the worker vanished mid-event
    whole = data[: data.rfind(b"\n\n", 0, cut) + 2] if data.rfind(b"\n\n", 0, cut) >= 0 else b""
    body, result = _run(_split(data[:cut], cuts))
    assert body.startswith(whole)
    rest = body[len(whole) :]
    assert rest.startswith(b'data: {"error"') and rest.endswith(b"\n\n") and rest.count(b"\n\n") == 1
    assert json.loads(rest.strip()[6:])["error"]["code"] == "upstream_error"
    assert result.error is not None and b"[DONE]" not in body


def test_last_chunk_goes_with_the_end_only_when_the_body_is_complete() -> None:
    """On the worker client: a stream whose end arrived with its last event is answered with one final write
    (the last events and the end of the body); one whose end comes later gets its last event at once."""
    events = b'data: {"choices":[{"text":"a"}]}\n\n'
    done = b"data: [DONE]\n\n"

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(chunked(events))
            await writer.drain()
            await asyncio.sleep(0.05)
            if head.startswith(b"POST /together"):
                writer.write(chunked(done) + b"0\r\n\r\n")  # the last event and the end in one TCP write
            else:
                writer.write(chunked(done))
                await writer.drain()
                await asyncio.sleep(0.3)  # the end comes much later
                writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def relayed(client: Client, path: str) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        resp = await client.request("POST", path, body=b"{}")
        try:
            ex = RequestRecord(send=send, request_id="r", started=0.0, deadline=1e12)
            result = await relay(ex, resp, True)
        finally:
            resp.close()
        assert result.error is None and result.done
        return sent[1:]

    async def main() -> None:
        server = await asyncio.start_server(worker, "127.0.0.1", 0)
        async with server:
            client = Client(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", read_timeout_s=5.0)
            try:
                together = await relayed(client, "/together")
                apart = await relayed(client, "/apart")
            finally:
                await client.aclose()
        assert [(m["body"], m["more_body"]) for m in together] == [(events, True), (done, False)]
        assert [(m["body"], m["more_body"]) for m in apart] == [(events, True), (done, True), (b"", False)]

    asyncio.run(main())
