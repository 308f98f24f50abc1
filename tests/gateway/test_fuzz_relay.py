"""F2: Hypothesis on the gateway's SSE relay (``pdctl.gateway.relay.relay``), fed by a fake decode stream.

Arbitrary chunk splits (inside ``\\r\\n`` and inside UTF-8 sequences), LF or CRLF line ends, comments,
streams that end with ``[DONE]``, end cleanly without it, break with a transport error, or stop in the
middle of an event. A spec-conformant SSE parser reads what the client got: its events must equal the
worker's complete events, plus exactly one OpenAI-shaped error event (and no ``[DONE]``) when the worker
did not finish (N1: no truncated success, no garbage event). The same streams also go through the whole gateway
on in-memory workers, once on the two legs and once on the decode alone (``routing.pd_mode = "adaptive"``): the
client gets the same bytes on both paths.

``PDCTL_FUZZ_EXAMPLES=5000 pytest tests/gateway/test_fuzz_relay.py`` runs a longer search (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.config.settings import PdMode
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.memory import MemoryReply, MemoryWorkers, Part
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.relay import relay
from pdctl.testing.invariants import client_outcome
from pdctl.vllm.protocol import REQUIRED_DECODE_FIELDS
from pdctl.vllm.sse import sse_events as parse_sse
from pdctl.vllm.transport import TransportError
from tests.fakes.gateway_harness import KEY, AsgiReply, asgi_request, make_settings, run_app

EXAMPLES = int(os.environ.get("PDCTL_FUZZ_EXAMPLES", "300"))


class FakeDecodeStream:
    """A decode worker's body (the relay's ``Body``), chunk by chunk; optionally the connection breaks at the end.

    Empty chunks are dropped, as a transport never hands one over mid-stream (``b""`` means the end). With
    ``peek``, it reports ``at_end()`` as :class:`pdctl.vllm.transport.Response` does (the whole body in and read), so
    the relay sends the last chunk with the end of the response.
    """

    def __init__(self, chunks: list[bytes], error: bool, peek: bool = False) -> None:
        self.left = [c for c in chunks if c]
        self.chunks = iter(self.left)
        self.read_n = 0
        self.error = error
        if peek:
            self.at_end = lambda: self.read_n == len(self.left) and not self.error

    async def read(self) -> bytes:
        return b"".join([c async for c in self._iter()])

    async def chunk(self) -> bytes:
        await asyncio.sleep(0)
        for c in self.chunks:
            self.read_n += 1
            return c
        if self.error:
            raise TransportError("broken", "peer closed connection without sending complete message body")
        return b""

    async def _iter(self) -> AsyncIterator[bytes]:
        while c := await self.chunk():
            yield c


async def _relay(chunks: list[bytes], error: bool, peek: bool = False) -> tuple[bytes, Any]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    now = time.monotonic()
    ex = RequestRecord(send=send, request_id="fuzz", started=now, deadline=now + 30, stream=True)
    resp = FakeDecodeStream(chunks, error, peek)
    result = await relay(ex, resp, stream=True)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = sent[1:]
    assert all(m["type"] == "http.response.body" for m in bodies)
    assert all(m.get("more_body") for m in bodies[:-1]) and not bodies[-1].get("more_body")
    return b"".join(m["body"] for m in bodies), result


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
payloads = st.one_of(
    st.builds(
        lambda t, r: json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": r}]}, ensure_ascii=False),
        texts,
        st.sampled_from([None, None, None, "stop"]),
    ),
    st.builds(lambda t: json.dumps({"choices": [{"delta": {"content": t}}]}, ensure_ascii=False), texts),
)


@st.composite
def streams(draw: st.DrawFn) -> dict[str, Any]:
    events = draw(st.lists(payloads, min_size=0, max_size=8))
    style = draw(st.sampled_from(["\n", "\r\n", "\r", "mixed"]))

    def eol() -> str:  # the spec allows CRLF, LF and CR, even mixed within one stream
        return draw(st.sampled_from(["\n", "\r\n", "\r"])) if style == "mixed" else style

    def end() -> str:  # a line end, then a blank line (CR then LF would be one CRLF, not two ends)
        first, second = eol(), eol()
        return first + ("\r" if first == "\r" and second.startswith("\n") else second)

    ending = draw(st.sampled_from(["done", "done", "eof", "error", "mid_event"]))
    parts: list[str] = []
    for e in events:
        if draw(st.booleans()) and draw(st.booleans()):
            parts.append(f": keep-alive{end()}")
        parts.append(f"data: {e}{end()}")
    complete = list(events)
    if ending == "done":
        parts.append(f"data: [DONE]{end()}")
        complete.append("[DONE]")
    raw = "".join(parts).encode("utf-8")
    if ending == "mid_event":
        partial = f"data: {draw(payloads)}{eol()}".encode()
        raw += partial[: draw(st.integers(1, len(partial) - 1))]
    cuts = sorted(set(draw(st.lists(st.integers(0, max(0, len(raw))), max_size=12))))
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True) if b > a]
    return {"raw": raw, "chunks": chunks, "events": complete, "ending": ending}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.booleans())
def test_relay_output_events_equal_input_events(s: dict[str, Any], peek: bool) -> None:
    error = s["ending"] in ("error", "mid_event") and bool(s["chunks"])
    out, result = asyncio.run(_relay(s["chunks"], error, peek))
    got = parse_sse(out)
    if s["ending"] == "done":
        assert out == s["raw"]  # a finished stream passes through byte for byte
        assert got == s["events"] and result.error is None and result.done
        return
    # The worker did not finish: its complete events, then exactly one OpenAI-shaped error, no [DONE].
    assert got[:-1] == s["events"], (got, s["events"])
    err = json.loads(got[-1])
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["code"] == "upstream_error"
    assert "[DONE]" not in got and result.error is not None
    # What a client sees is a terminal error (N1), never a truncated success or a garbage event.
    assert client_outcome(200, out, stream=True).violation is None


def _through_gateway(parts: list[Part], pd_mode: PdMode) -> AsgiReply:
    """A short streamed chat request through the gateway whose decode answers ``parts``."""
    params: dict[str, Any] = {f: f"p-{f}" for f in REQUIRED_DECODE_FIELDS}
    params.update(remote_block_ids=[1], remote_port=5600, do_remote_prefill=True, do_remote_decode=False)
    workers = MemoryWorkers()
    workers["prefill"].script(MemoryReply.json({"id": "p", "choices": [], "kv_transfer_params": params}))
    workers["decode"].script(MemoryReply.sse(parts))
    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"], max_retries=0)
    settings = dataclasses.replace(settings, routing=dataclasses.replace(settings.routing, pd_mode=pd_mode))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
        replies.append(await asgi_request(app, "/v1/chat/completions", body))

    run_app(create_app(settings, KEY, clients=workers), test)
    return replies[0]


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_the_local_path_relays_a_decode_stream_as_the_two_legs_do(s: dict[str, Any]) -> None:
    parts: list[Part] = list(s["chunks"])
    if s["ending"] in ("error", "mid_event") and parts:
        parts.append(TransportError("broken", "peer closed connection without sending complete message body"))
    disagg, local = _through_gateway(parts, "always"), _through_gateway(parts, "adaptive")
    assert (disagg.headers["x-pd-path"], local.headers["x-pd-path"]) == ("disagg", "local")
    assert local.status == disagg.status and local.body == disagg.body
    if s["ending"] != "done":  # a worker that did not finish: a terminal error for the client on both paths (N1)
        assert client_outcome(local.status, local.body, stream=True).violation is None


def test_parser_discards_an_unfinished_event() -> None:
    assert parse_sse(b"data: a\r\n\r\ndata: b\n\ndata: c") == ["a", "b"]
    assert parse_sse(b": ping\n\ndata: x\ndata: y\n\n") == ["x\ny"]


def test_lf_then_crlf_blank_line_ends_an_event() -> None:
    """Found by the fuzzer: a blank line written as LF + CRLF was not seen as an event boundary, so the
    relay held the rest of the stream back and then dropped it (a finished stream became an error)."""
    raw = [b'data: {"choices":[{"text":"a","finish_reason":"stop"}]}\n\r\n', b"data: [DONE]\n\r\n"]
    out, result = asyncio.run(_relay(raw, error=False))
    assert out == b"".join(raw) and result.error is None and result.done
    assert parse_sse(out)[-1] == "[DONE]"
