"""Adaptive PD (``routing.pd_mode = "adaptive"``): the prefix view and the per-request decision, on in-memory workers.

The gateway runs in the test's event loop; its workers are :class:`~pdctl.gateway.memory.MemoryWorker` scripts,
so what each worker received (and what it did not) is read back from its calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

from pdctl.config import RateLimitConfig, RoutingConfig, SLOConfig
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from pdctl.gateway.routing.approx_view import BLOCK_CHARS, PrefixIndex, block_hashes, prompt_text
from pdctl.vllm.protocol import REQUIRED_DECODE_FIELDS
from tests.fakes.gateway_harness import KEY, AsgiReply, asgi_request, make_settings, run_app

CHAT = "/v1/chat/completions"
HISTORY = [
    {"role": "system", "content": "You are a coding agent. " * 200},  # ~4,800 characters: ~1,200 tokens
    {"role": "user", "content": "Fix the failing test in tests/test_io.py."},
]


def _turn(*extra: dict[str, str]) -> dict[str, Any]:
    return {"model": "tiny", "messages": [*HISTORY, *extra], "max_tokens": 8}


def _prefill() -> MemoryReply:
    params: dict[str, Any] = {f: f"p-{f}" for f in REQUIRED_DECODE_FIELDS}
    params.update(remote_block_ids=[1, 2], remote_port=5600, do_remote_prefill=True, do_remote_decode=False)
    return MemoryReply.json({"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params})


def _decoded() -> MemoryReply:
    return MemoryReply.json({"id": "cmpl-d", "choices": [{"index": 0, "message": {"content": "done"}}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 1}})  # fmt: skip


def _run(
    workers: MemoryWorkers, n_decode: int, test: Callable[[Gateway], Awaitable[None]], settings_kw: Any = None,
    **routing: Any,
) -> Gateway:  # fmt: skip
    """Run ``test`` on an adaptive gateway over ``workers`` (``make_settings`` keywords in ``settings_kw``)."""
    decode = [f"http://decode-{i}.invalid" for i in range(n_decode)]
    settings = make_settings(["http://prefill.invalid"], decode, **(settings_kw or {}))
    settings = dataclasses.replace(
        settings, routing=dataclasses.replace(settings.routing, pd_mode="adaptive", **routing)
    )
    return run_app(create_app(settings, KEY, clients=workers), test)


def _decisions(app: Gateway, path: str, reason: str) -> float:
    return app.metrics.registry.get_sample_value("pdctl_pd_decisions_total", {"path": path, "reason": reason}) or 0.0


def _decode_calls(workers: MemoryWorkers, n: int) -> dict[str, list[dict[str, Any]]]:
    return {f"decode-{i}": [c.json() for c in workers[f"decode-{i}"].completions()] for i in range(n)}


def test_prompt_text_keeps_the_history_in_order() -> None:
    first = prompt_text(_turn())
    later = prompt_text(_turn({"role": "assistant", "content": "Looking."}, {"role": "user", "content": "Go on."}))
    assert later.startswith(first) and len(later) > len(first)
    # a prompt that differs early shares no block with it
    other = prompt_text({"messages": [{"role": "system", "content": "Another agent. " * 400}]})
    assert not set(block_hashes(first)) & set(block_hashes(other))
    assert prompt_text({"prompt": [1, 2, 3]}) != prompt_text({"prompt": [1, 2, 4]})


def test_block_hashes_chain_so_a_block_matches_only_after_its_prefix() -> None:
    a = block_hashes("x" * BLOCK_CHARS * 3 + "tail")
    assert len(a) == 3 and len(set(a)) == 3  # identical text, three different blocks: each hash carries its parent
    b = block_hashes("y" + "x" * (BLOCK_CHARS * 3 - 1))
    assert not set(a) & set(b)


def test_prefix_index_matches_leading_blocks_and_evicts_the_least_recently_used() -> None:
    index = PrefixIndex(capacity=4)
    index.insert([1, 2, 3])
    assert index.match([1, 2, 3, 9]) == 3 and index.match([9, 1]) == 0
    index.insert([7, 8])  # capacity 4: block 1, the least recently used, goes
    assert len(index) == 4 and index.match([1, 2]) == 0 and index.match([7, 8]) == 2
    index.insert([2])  # touched: now 3 is the oldest
    index.insert([10])
    assert index.match([2]) == 1 and index.match([3]) == 0
    index.clear()
    assert len(index) == 0


def test_a_later_turn_goes_local_to_the_decode_holding_its_history() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill())
    for i in range(2):
        workers[f"decode-{i}"].default = _decoded()
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, _turn(), request_id="t1"))
        nxt = _turn({"role": "assistant", "content": "Looking at it."}, {"role": "user", "content": "Also lint it."})
        replies.append(await asgi_request(app, CHAT, nxt, request_id="t2"))

    app = _run(workers, 2, test)
    first, second = replies
    assert first.status == 200 and first.headers["x-pd-path"] == "disagg"
    assert second.status == 200 and second.headers["x-pd-path"] == "local"
    assert "x-pd-prefill" not in second.headers
    assert second.headers["x-pd-decode"] == first.headers["x-pd-decode"]  # where turn 1's prompt is cached
    assert [c.request_id for c in workers["prefill"].completions()] == ["t1"]  # no prefill leg for turn 2
    calls = _decode_calls(workers, 2)[first.headers["x-pd-decode"]]
    assert [("kv_transfer_params" in c) for c in calls] == [True, False]
    assert calls[1]["messages"][-1]["content"] == "Also lint it."
    assert _decisions(app, "disagg", "uncached_tokens") == 1 and _decisions(app, "local", "cached") == 1


def test_a_decode_that_was_down_is_assumed_to_have_lost_its_cache() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill(), _prefill())
    workers["decode"].default = _decoded()
    replies: list[AsgiReply] = []
    nxt = _turn({"role": "assistant", "content": "Looking at it."}, {"role": "user", "content": "Also lint it."})

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, _turn(), request_id="t1"))
        decode = next(i for i in app.pool.instances if i.role == "decode")
        decode.set_healthy(False)  # a probe saw it down (a crash), then up again: a restarted engine
        decode.set_healthy(True)
        replies.append(await asgi_request(app, CHAT, nxt, request_id="t2"))

    app = _run(workers, 1, test)
    assert [r.headers["x-pd-path"] for r in replies] == ["disagg", "disagg"]
    assert _decisions(app, "disagg", "uncached_tokens") == 2 and _decisions(app, "local", "cached") == 0


def test_a_short_fresh_prompt_goes_local_unless_the_share_rule_says_otherwise() -> None:
    short = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}
    for share, path in ((1.0, "local"), (0.5, "disagg")):
        workers = MemoryWorkers()
        workers["prefill"].script(_prefill())
        workers["decode"].default = _decoded()
        replies: list[AsgiReply] = []

        async def test(app: Gateway, out: list[AsgiReply] = replies) -> None:
            out.append(await asgi_request(app, CHAT, short))

        app = _run(workers, 1, test, local_max_uncached_share=share)
        assert replies[0].status == 200 and replies[0].headers["x-pd-path"] == path
        reason = "cached" if path == "local" else "uncached_share"
        assert _decisions(app, path, reason) == 1
        assert len(workers["prefill"].completions()) == (0 if path == "local" else 1)


def test_a_busy_decode_gets_no_local_prefill() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill())
    workers["decode"].script(MemoryReply.json({"id": "slow", "choices": []}, delay_s=0.3), _decoded())
    short = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.extend(await _beside_a_slow_stream(app, workers, short))

    app = _run(workers, 1, test, local_max_decode_requests=1)
    second, slow = replies
    assert slow.headers["x-pd-path"] == "local" and second.headers["x-pd-path"] == "disagg"
    assert _decisions(app, "disagg", "decode_busy") == 1


async def _beside_a_slow_stream(app: Gateway, workers: MemoryWorkers, body: dict[str, Any]) -> list[AsgiReply]:
    """``body`` sent as "slow", then, once it is on the decode, as "second": the replies, second first."""
    slow = asyncio.ensure_future(asgi_request(app, CHAT, body, request_id="slow"))
    for _ in range(500):  # until the slow request is on the decode
        if workers["decode"].completions():
            break
        await asyncio.sleep(0.01)
    return [await asgi_request(app, CHAT, body, request_id="second"), await slow]


def test_no_local_prefill_that_would_stall_the_decodes_streams_past_local_max_stall_ms() -> None:
    """With a stream in flight on the decode, a prompt whose prefill would take longer than local_max_stall_ms (its
    uncached tokens x the prefill seconds per token measured) takes both legs; on an idle decode it goes local."""
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill())
    workers["decode"].script(MemoryReply.json({"id": "slow", "choices": []}, delay_s=0.3), _decoded(), _decoded())
    short = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": 4}
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        app.admission.sec_per_token.add(0.001)  # 1 ms a token, as if measured on leg 1s: ~40 tokens stall 40 ms
        replies.extend(await _beside_a_slow_stream(app, workers, short))
        replies.append(await asgi_request(app, CHAT, short, request_id="third"))  # the decode is idle again

    app = _run(workers, 1, test, local_max_stall_ms=10.0)
    second, slow, third = replies
    assert slow.headers["x-pd-path"] == "local" and third.headers["x-pd-path"] == "local"
    assert second.headers["x-pd-path"] == "disagg"
    assert _decisions(app, "disagg", "decode_stall") == 1 and _decisions(app, "local", "cached") == 2


def test_a_local_attempt_that_fails_before_any_byte_takes_the_two_legs() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill())
    workers["decode"].script(MemoryReply(500, (b"engine error",)), _decoded())
    short = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, short, request_id="r"))

    app = _run(workers, 1, test)
    (reply,) = replies
    assert reply.status == 200 and reply.headers["x-pd-path"] == "disagg"
    # the two legs run as a new pipeline with an id of its own; the request counts once, as decided (local)
    assert [c.request_id for c in workers["prefill"].completions()] == ["r-retry1"]
    assert [c.request_id for c in workers["decode"].completions()] == ["r", "r-retry1"]
    assert app.metrics.registry.get_sample_value("pdctl_retries_total", {"leg": "local"}) == 1
    assert _decisions(app, "local", "cached") == 1 and _decisions(app, "disagg", "cached") == 0


def test_adaptive_settings_are_declared_with_their_defaults() -> None:
    r = RoutingConfig()
    assert r.pd_mode == "always" and r.local_max_uncached_tokens == 512 and r.local_max_uncached_share == 1.0


SHORT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SHORT_STREAM = {**SHORT, "stream": True}
DONE = b"data: [DONE]\n\n"


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode() + b"\n\n"


def _metric(app: Gateway, name: str, **labels: str) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


def test_client_disconnect_on_a_local_stream_closes_the_decode_call() -> None:
    workers = MemoryWorkers()
    workers["decode"].script(MemoryReply.sse([_event("a"), 30.0, _event("b"), DONE]))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        call = asgi_request(app, CHAT, SHORT_STREAM, disconnect_after_chunks=1)
        replies.append(await asyncio.wait_for(call, timeout=10))  # not the 30 s the decode would still take

    app = _run(workers, 1, test)
    (reply,) = replies
    assert reply.headers["x-pd-path"] == "local" and reply.body == _event("a")
    (call,) = workers["decode"].completions()
    assert call.response is not None and call.response.closed_early is True  # vLLM aborts the request
    assert not workers["prefill"].completions()
    assert _metric(app, "pdctl_client_cancelled_total", phase="streaming") == 1
    assert _metric(app, "pdctl_requests_total", path="local", status="499") == 1


def test_client_leaving_a_local_request_before_its_first_token_closes_the_decode_call_and_sends_no_release() -> None:
    workers = MemoryWorkers()
    workers["decode"].script(MemoryReply.sse([30.0, _event("a"), DONE]))

    async def test(app: Gateway) -> None:
        call = asgi_request(app, CHAT, SHORT_STREAM, request_id="gone", disconnect_after_s=0.05)
        reply = await asyncio.wait_for(call, timeout=10)
        assert reply.headers["x-pd-path"] == "local" and reply.body == b""  # the client left before a token

    app = _run(workers, 1, test)
    (call,) = workers["decode"].completions()  # no release leg: no prefill holds KV for it
    assert call.request_id == "gone" and call.response is not None and call.response.closed_early is True
    assert not workers["prefill"].completions()
    assert sum(_metric(app, "pdctl_kv_release_total", outcome=o) for o in ("ok", "error", "nothing_held")) == 0
    assert _metric(app, "pdctl_requests_total", path="local", status="499") == 1


def test_rate_limit_applies_to_a_request_that_would_go_local() -> None:
    workers = MemoryWorkers()
    workers["decode"].default = _decoded()
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        for rid in ("first", "second"):
            replies.append(await asgi_request(app, CHAT, SHORT, request_id=rid))

    app = _run(workers, 1, test, {"rate_limit": RateLimitConfig(requests_per_minute=1)})
    first, second = replies
    assert first.status == 200 and first.headers["x-pd-path"] == "local"
    assert second.status == 429 and int(second.headers["retry-after"]) >= 1
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert [c.request_id for c in workers["decode"].completions()] == ["first"]
    assert not workers["prefill"].completions()
    assert _decisions(app, "local", "cached") == 1  # the refused request never reached the decision


def test_admission_refuses_a_request_that_would_go_local_when_decode_would_miss_the_tpot_slo() -> None:
    """Decode streams at 50 ms a token against a 10 ms TPOT target: with one stream running, another local
    request would make it worse, so it is refused (503) like a request for the two legs."""
    stream = MemoryReply.sse([_event("a"), 0.05, _event("b"), 0.05, _event("c"), 0.05, _event("d"), DONE])
    workers = MemoryWorkers()
    workers["decode"].script(stream, MemoryReply.sse([_event("a"), 0.5, _event("b"), DONE]))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, SHORT_STREAM, request_id="measured"))  # cold: admitted
        running = asyncio.ensure_future(asgi_request(app, CHAT, SHORT_STREAM, request_id="running"))
        while len(workers["decode"].completions()) < 2:
            await asyncio.sleep(0.01)
        replies.append(await asgi_request(app, CHAT, SHORT_STREAM, request_id="refused"))
        replies.append(await running)

    slo = SLOConfig(ttft_ms=10_000, tpot_ms=10, p90=False, admission=True)
    app = _run(workers, 1, test, {"slo": slo})
    measured, refused, running = replies
    assert measured.headers["x-pd-path"] == "local" and running.headers["x-pd-path"] == "local"
    assert refused.status == 503 and refused.json()["error"]["code"] == "server_overloaded"
    assert "time per output token" in refused.json()["error"]["message"] and "retry-after" in refused.headers
    assert [c.request_id for c in workers["decode"].completions()] == ["measured", "running"]
    assert not workers["prefill"].completions()
    assert _metric(app, "pdctl_rejected_total", reason="slo_tpot") == 1


def test_admission_does_not_refuse_a_local_request_for_the_prefill_queue() -> None:
    """A request served on the decode alone never waits for the prefill: a long prompt queued there must not
    make the predictor refuse it, as it refuses another long prompt that would queue behind."""

    def long_turn(n: int) -> dict[str, Any]:  # ~1,000 tokens, none cached: both legs
        return {"model": "tiny", "messages": [{"role": "user", "content": f"{n} " + "long " * 800}], "max_tokens": 4}

    workers = MemoryWorkers()
    workers["prefill"].script(_prefill_after(0.2), _prefill_after(1.0))
    workers["decode"].default = _decoded()
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, long_turn(1), request_id="long-1"))  # measures the prefill
        queued = asyncio.ensure_future(asgi_request(app, CHAT, long_turn(2), request_id="long-2"))
        while len(workers["prefill"].completions()) < 2 and not queued.done():
            await asyncio.sleep(0.01)
        replies.append(await asgi_request(app, CHAT, long_turn(3), request_id="long-3"))
        replies.append(await asgi_request(app, CHAT, SHORT, request_id="short"))
        replies.append(await queued)

    slo = SLOConfig(ttft_ms=100, tpot_ms=10_000, p90=False, admission=True)
    app = _run(workers, 1, test, {"slo": slo})
    first, long_3, short, long_2 = replies
    assert first.headers["x-pd-path"] == "disagg" and long_2.headers["x-pd-path"] == "disagg"
    assert long_3.status == 503 and "time to first token" in long_3.json()["error"]["message"]
    assert short.status == 200 and short.headers["x-pd-path"] == "local"
    assert [c.request_id for c in workers["prefill"].completions()] == ["long-1", "long-2"]
    assert _metric(app, "pdctl_rejected_total", reason="slo_ttft") == 1


def _prefill_after(delay_s: float) -> MemoryReply:
    reply = _prefill()
    return MemoryReply(reply.status, reply.parts, delay_s)
