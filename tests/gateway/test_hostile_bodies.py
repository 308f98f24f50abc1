"""Bodies and streams that would cost the gateway what the client chooses (docs/reliability.md, Hostile clients and
hostile networks): the body limit sized from the model, limits checked before a body is read, list lengths and
``max_tokens`` bounded, a migratable stream's kept events, session ids and the SSE partial-event buffer bounded.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdctl.gateway.agent_sessions import MAX_SESSION_CHARS, session_hint
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.errors import ApiError
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from pdctl.gateway.migration import read_sent, summary_event
from pdctl.gateway.relay import KEEP_PIECES, MAX_PENDING, Kept, _Stream
from pdctl.gateway.request import (
    BODY_BYTES_PER_TOKEN,
    BODY_MARGIN_BYTES,
    BODY_MARGIN_VALUES,
    BODY_VALUES_PER_TOKEN,
    OFF_LOOP_BYTES,
    UNSIZED_BODY_BYTES,
    body_limit,
    check_fits,
    parse_body,
    parse_body_off_loop,
    validate,
    value_limit,
)
from pdctl.gateway.settings import LocalModel
from tests.fakes.gateway_harness import KEY, AsgiReply, RateLimitConfig, asgi_request, make_settings, run_app

CHAT = "/v1/chat/completions"
DECODED = MemoryReply.json({"id": "d", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "hi"}}],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 1}})  # fmt: skip
PREFILLED = MemoryReply.json({"id": "p", "choices": [], "usage": {"prompt_tokens": 5}})


def _serve(bodies: list[tuple[str, Any]], models: tuple[LocalModel, ...] = (LocalModel("tiny", 2048),),
           worker_models: tuple[dict[str, Any], ...] | None = None, **extra: Any,
           ) -> tuple[list[AsgiReply], MemoryWorkers]:  # fmt: skip
    workers = MemoryWorkers()
    workers["prefill"].default = PREFILLED
    workers["decode"].default = DECODED
    if worker_models is not None:
        workers["prefill"].models = workers["decode"].models = worker_models
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        for path, body in bodies:
            replies.append(await asgi_request(app, path, body))

    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"], models=models, **extra)
    run_app(create_app(settings, KEY, clients=workers), test)
    return replies, workers


def _calls(workers: MemoryWorkers) -> int:
    return len(workers["prefill"].completions()) + len(workers["decode"].completions())


# ---------------------------------------------------------------------------------------------------- bodies


def test_the_body_limit_is_sized_from_the_largest_context_served() -> None:
    assert body_limit(4096, [2048], False) == 4096  # configured
    assert body_limit(None, [2048, 40960], False) == 40960 * BODY_BYTES_PER_TOKEN + BODY_MARGIN_BYTES
    assert body_limit(None, [2048, None], False) == UNSIZED_BODY_BYTES  # one not known yet
    assert body_limit(None, [2048], True) == UNSIZED_BODY_BYTES  # an upstream's models: unknown
    assert UNSIZED_BODY_BYTES < 64 << 20


def test_a_body_over_the_sized_limit_is_a_413_before_any_worker_is_called() -> None:
    limit = 2048 * BODY_BYTES_PER_TOKEN + BODY_MARGIN_BYTES
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * limit}], "max_tokens": 8}
    (reply,), workers = _serve([(CHAT, big)], max_body_bytes=None)
    assert reply.status == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert str(limit) in reply.json()["error"]["message"] and _calls(workers) == 0


def test_a_body_with_more_values_than_any_prompt_needs_is_a_413_before_it_is_parsed() -> None:
    """A token-id prompt within the byte limit but with millions of values: refused from its commas while it
    arrives (parsing it would hold the GIL for a few hundred ms); the largest prompt the model accepts passes."""
    assert value_limit(None, [2048], False) == 2048 * BODY_VALUES_PER_TOKEN + BODY_MARGIN_VALUES
    assert value_limit(4096, [2048], False) is None and value_limit(None, [2048], True) is None
    limit = 2048 * BODY_VALUES_PER_TOKEN + BODY_MARGIN_VALUES
    over = {"model": "tiny", "prompt": [7] * (limit + 1), "max_tokens": 1}
    fits = {"model": "tiny", "prompt": [7] * 2048, "max_tokens": 1}
    assert len(json.dumps(over)) < 2048 * BODY_BYTES_PER_TOKEN + BODY_MARGIN_BYTES  # within the byte limit
    (refused, served), workers = _serve([("/v1/completions", over), ("/v1/completions", fits)], max_body_bytes=None,
                                        worker_models=({"id": "tiny", "max_model_len": 2048},))  # fmt: skip
    error = refused.json()["error"]
    assert refused.status == 413 and error["code"] == "request_too_large" and str(limit) in error["message"]
    assert served.status == 200 and _calls(workers) >= 1
    (configured,), _ = _serve([("/v1/completions", over)], max_body_bytes=64 << 20)
    assert configured.status == 400  # the bound lifted with the sizing: then too long for the context


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/v1/completions", {"prompt": list(range(2049)), "max_tokens": 1}, "prompt"),
     ("/v1/completions", {"prompt": [[1, 2], list(range(3000))], "max_tokens": 1}, "prompt"),
     (CHAT, {"messages": [{"role": "user", "content": ""}] * 2049, "max_tokens": 1}, "messages")],
)  # fmt: skip
def test_a_list_longer_than_the_context_is_a_clear_400(path: str, body: dict[str, Any], param: str) -> None:
    (reply,), workers = _serve([(path, {"model": "tiny", **body})])
    error = reply.json()["error"]
    assert reply.status == 400 and error["code"] == "context_length_exceeded" and error["param"] == param
    assert "2048" in error["message"] and _calls(workers) == 0


def test_a_key_at_its_limit_is_refused_before_its_body_is_read() -> None:
    import asyncio

    workers = MemoryWorkers()
    workers["prefill"].default = PREFILLED
    workers["decode"].default = DECODED
    reads: list[str] = []
    status: list[int] = []

    async def test(app: Gateway) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        assert (await asgi_request(app, CHAT, body)).status == 200
        scope = {"type": "http", "method": "POST", "path": CHAT, "headers": [
            (b"authorization", f"Bearer {KEY}".encode()), (b"content-length", b"1000000")]}  # fmt: skip

        async def receive() -> dict[str, Any]:
            reads.append("read")
            await asyncio.sleep(3600)  # a client that never finishes its body
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await asyncio.wait_for(app(scope, receive, send), 30)

    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"],
                             rate_limit=RateLimitConfig(requests_per_minute=1))  # fmt: skip
    run_app(create_app(settings, KEY, clients=workers), test)
    assert status == [429] and reads == []


def test_a_body_being_read_holds_its_keys_concurrency_slot() -> None:
    """max_concurrency bounds the bodies a key has in the gateway's memory: while one body is still arriving, the
    key's next request is refused before its own body is read; once the first ends, the slot is free again."""
    import asyncio

    workers = MemoryWorkers()
    workers["prefill"].default = PREFILLED
    workers["decode"].default = DECODED
    reads: list[int] = []
    statuses: list[int] = []

    def scope() -> dict[str, Any]:
        return {"type": "http", "method": "POST", "path": CHAT, "headers": [
            (b"authorization", f"Bearer {KEY}".encode()), (b"content-length", b"1000000")]}  # fmt: skip

    async def test(app: Gateway) -> None:
        arrived = asyncio.Event()

        async def slow(n: int) -> dict[str, Any]:
            reads.append(n)
            arrived.set()
            await asyncio.sleep(3600)  # a client that never finishes its body
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        first = asyncio.ensure_future(app(scope(), lambda: slow(1), send))
        await asyncio.wait_for(arrived.wait(), 10)
        await asyncio.wait_for(app(scope(), lambda: slow(2), send), 10)
        assert statuses == [429] and reads == [1]
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        assert (await asgi_request(app, CHAT, body)).status == 200

    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"],
                             rate_limit=RateLimitConfig(max_concurrency=1))  # fmt: skip
    run_app(create_app(settings, KEY, clients=workers), test)


def test_a_large_body_parses_off_the_loop_as_a_small_one_does() -> None:
    import asyncio

    body = {"model": "m", "prompt": list(range(OFF_LOOP_BYTES // 4)), "kv_transfer_params": {"remote_host": "x"}}
    raw = json.dumps(body).encode()
    assert len(raw) > OFF_LOOP_BYTES
    assert asyncio.run(parse_body_off_loop(raw, 64)) == parse_body(raw, 64) == {"model": "m", "prompt": body["prompt"]}
    with pytest.raises(ApiError) as bad:
        asyncio.run(parse_body_off_loop(raw[:-1], 64))
    assert bad.value.status == 400


# ------------------------------------------------------------------------------------------------- max_tokens


def test_max_tokens_is_bounded_where_the_context_is_unknown() -> None:
    req = validate({"prompt": "x", "max_tokens": 10**400}, "/v1/completions", "m")
    with pytest.raises(ApiError) as err:
        check_fits(req, "upstream", True, None)
    assert (err.value.status, err.value.param) == (400, "max_tokens")
    unknown = ({"id": "tiny", "object": "model"},)  # the workers do not say their max_model_len
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**400}
    (reply, fine), workers = _serve([(CHAT, body), (CHAT, {**body, "max_tokens": 8})],
                                    models=(LocalModel("tiny", None),), worker_models=unknown)  # fmt: skip
    assert reply.status == 400 and reply.json()["error"]["param"] == "max_tokens" and fine.status == 200
    assert len(workers["decode"].completions()) == 1  # the refused one reached no worker


# ------------------------------------------------------------------------------------------------ the four bounds


def _chunk(i: int) -> bytes:
    ev = {
        "id": "cmpl-1",
        "created": 7,
        "model": "tiny",
        "choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None, "token_ids": [i]}],
    }
    if i == 0:
        ev["prompt_token_ids"] = [1, 2, 3]
    return b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"


def test_a_migratable_stream_keeps_what_a_continuation_needs_not_every_event() -> None:
    chunks = [_chunk(i) for i in range(8000)]
    chunks.append(b'data: {"id":"cmpl-1","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n')
    chunks.append(b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":8000}}\n\n')
    keep = Kept(fold=summary_event)
    for c in chunks:
        keep.add(c)
    assert len(keep.events) < KEEP_PIECES and sum(map(len, keep.events)) < sum(map(len, chunks)) // 10
    assert read_sent(keep.events, keep.prompt_ids) == read_sent(chunks, None)
    assert read_sent(keep.events, keep.prompt_ids).tokens == list(range(8000))


def test_a_session_id_is_bounded_in_size_and_still_sticks() -> None:
    long = "s" * 60 * 1024
    hint = session_hint({}, long)
    assert hint is not None and len(hint) <= MAX_SESSION_CHARS and hint == session_hint({}, long)
    assert session_hint({}, long + "x") != hint
    assert session_hint({"conversation": {"id": long}}) == hint
    assert session_hint({"metadata": {"user_id": long}}) == hint
    assert session_hint({}, "short-session") == "short-session"


def test_the_sse_partial_event_buffer_is_bounded_without_a_blank_line() -> None:
    stream = _Stream("openai", None)
    piece = b"data: " + b"x" * 65536 + b"\n"
    out = b""
    for _ in range(64):  # 4 MiB and no blank line
        out += stream.take(piece)
        assert len(stream.pending) <= MAX_PENDING + len(piece)
    assert out + stream.pending == piece * 64  # every byte goes out, in order
    assert stream.take(b"data: end\n\n").endswith(b"data: end\n\n") and stream.pending == b""
