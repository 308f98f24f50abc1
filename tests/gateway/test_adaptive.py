"""Adaptive PD (``routing.pd_mode = "adaptive"``): the prefix view and the per-request decision, on in-memory workers.

The gateway runs in the test's event loop; its workers are :class:`~pdctl.gateway.memory.MemoryWorker` scripts,
so what each worker received (and what it did not) is read back from its calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from pdctl.config import RoutingConfig
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from pdctl.gateway.prefix import BLOCK_CHARS, PrefixIndex, block_hashes, prompt_text
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


def _run(workers: MemoryWorkers, n_decode: int, test: Callable[[Gateway], Awaitable[None]], **routing: Any) -> Gateway:
    decode = [f"http://decode-{i}.invalid" for i in range(n_decode)]
    settings = make_settings(["http://prefill.invalid"], decode)
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
        slow = asyncio.ensure_future(asgi_request(app, CHAT, short, request_id="slow"))
        for _ in range(500):  # until the slow request is on the decode
            if workers["decode"].completions():
                break
            await asyncio.sleep(0.01)
        replies.append(await asgi_request(app, CHAT, short, request_id="second"))
        replies.append(await slow)

    app = _run(workers, 1, test, local_max_decode_requests=1)
    second, slow = replies
    assert slow.headers["x-pd-path"] == "local" and second.headers["x-pd-path"] == "disagg"
    assert _decisions(app, "disagg", "decode_busy") == 1


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
    assert [c.request_id for c in workers["prefill"].completions()] == ["r"]
    assert app.metrics.registry.get_sample_value("pdctl_retries_total", {"leg": "local"}) == 1


def test_adaptive_settings_are_declared_with_their_defaults() -> None:
    r = RoutingConfig()
    assert r.pd_mode == "always" and r.local_max_uncached_tokens == 512 and r.local_max_uncached_share == 1.0
