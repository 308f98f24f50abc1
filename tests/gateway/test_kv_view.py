"""Adaptive PD's exact view (``routing.prefix_view = "exact"``): vLLM's KV cache events into a per-worker index, the
prompt's exact token ids, and the decision made with both, through a real ZMQ socket.

The events are built with the wire structs of :mod:`pdctl.vllm.kv_events` (their shape is checked against real vLLM
recordings in tests/vllm/test_kv_events.py) and published from a PUB socket that connects, as vLLM's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from pdctl.errors import LaunchError
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.chat_template import ChatTemplate
from pdctl.gateway.memory import MemoryWorkers
from pdctl.gateway.routing.exact_view import ExactIndex, token_block_hashes
from pdctl.gateway.routing.kv_events import EventsRelay, KvEventSubscriber
from pdctl.gateway.settings import GatewaySettings, LocalModel
from pdctl.gateway.tokens import TokenCounter
from pdctl.sim.text import Tokenizer, apply_chat_template
from pdctl.vllm.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.fakes.gateway_harness import KEY, asgi_request, make_settings, run_app
from tests.gateway.test_adaptive import _decisions, _decoded, _prefill, _turn

BS = 16
_ENC = msgspec.msgpack.Encoder()


def _stored(ids: Sequence[int], hashes: Sequence[int], parent: int | None = None, extra: Any = None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(ids), block_size=BS,
                       lora_id=None, medium="GPU", lora_name=None, extra_keys=extra or [None] * len(hashes),
                       group_idx=0, kv_cache_spec_kind="full_attention")  # fmt: skip


def _frames(topic: str, seq: int, *events: Any) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), _ENC.encode(KVEventBatch(1.0, list(events), 0))]


def test_the_index_rehashes_token_ids_and_follows_parents_removals_and_clears() -> None:
    ids = list(range(100, 100 + 5 * BS))
    want = token_block_hashes(ids, BS)
    assert len(want) == 5 and token_block_hashes(ids[: 2 * BS + 3], BS) == want[:2]  # a partial block is not cached
    ix = ExactIndex()
    ix.apply(_stored(ids[: 2 * BS], [901, 902]))  # the engine's own hashes: any values
    assert ix.block_size == BS and ix.match(want) == 2
    ix.apply(_stored(ids[2 * BS : 4 * BS], [903, 904], parent=902))  # chained from the parent's tokens
    assert ix.match(want) == 4
    ix.apply(_stored(ids[4 * BS :], [999], parent=12345))  # an unknown parent cannot be chained: left out
    assert ix.match(want) == 4 and ix.orphans == 1
    ix.apply(BlockRemoved(block_hashes=[903], medium="GPU"))  # evicted: the prefix ends before it
    assert ix.match(want) == 2
    ix.apply(AllBlocksCleared())
    assert ix.match(want) == 0 and len(ix) == 0 and ix.block_size == BS
    # blocks stored with extra keys (a LoRA, a cache_salt) never match a plain prompt, as in the engine
    ix.apply(_stored(ids[:BS], [1], extra=[("salt",)]))
    assert ix.match(want) == 0


def test_the_subscriber_starts_a_view_over_after_a_gap_or_a_restart() -> None:
    counted: list[tuple[str, str]] = []
    sub = KvEventSubscriber("tcp://127.0.0.1:1", lambda t, w: counted.append((t, w)))
    ids = list(range(3 * BS))
    want = token_block_hashes(ids, BS)
    sub.feed(_frames("decode", 0, _stored(ids[:BS], [1])))
    sub.feed(_frames("decode", 1, _stored(ids[BS : 2 * BS], [2], parent=1)))
    view = sub.view("decode")
    assert view is not None and view.match(want) == 2
    sub.feed(_frames("decode", 5, _stored(ids[2 * BS :], [3], parent=2)))  # seqs 2-4 were lost
    assert view.match(want) == 0  # nothing before the gap is trusted, and block 3's parent is gone with it
    sub.feed(_frames("decode", 6, _stored(ids[:BS], [1])))
    assert view.match(want) == 1
    other = list(range(900, 900 + BS))
    sub.feed(_frames("decode", 0, _stored(other, [7])))  # a restarted engine counts from 0 again, cache empty
    assert view.match(want) == 0 and view.match(token_block_hashes(other, BS)) == 1
    assert ("decode", "restart") in counted and ("decode", "gap") in counted
    sub.feed([b"decode", b"short", b""])
    assert ("-", "malformed") in counted and sub.view("prefill") is None


CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_the_chat_template_renders_as_transformers_does_and_declines_what_vllm_rewrites(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|im_end|>", "special": true}}')
    tpl = ChatTemplate.load(tmp_path)
    assert tpl is not None and tpl.special_tokens == {"eos_token": "<|im_end|>"}
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    text = tpl.render({"messages": msgs})
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tpl.render({"messages": msgs, "add_generation_prompt": False}) == text.removesuffix(
        "<|im_start|>assistant\n"
    )
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        pass
    else:  # the reference renderer, where installed (it comes with vLLM)
        rendered, _ = render_jinja_template([[{**msgs[0]}, {"role": "user", "content": "Hi"}]], chat_template=CHATML,
                                            add_generation_prompt=True)  # fmt: skip
        assert rendered == [text]
    # vLLM's rewrites, followed (pdctl.gateway.prompt_view): text parts joined with a newline for a template that
    # takes a string, a developer message as system for a template that lacks the role, tools passed to the template
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert tpl.render(parts) == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    assert tpl.render({"messages": [{"role": "developer", "content": "x"}]}) == (
        "<|im_start|>system\nx<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tpl.render({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}) == text
    declined: list[dict[str, Any]] = [
        {"messages": [*msgs, {"role": "assistant", "content": "He"}], "continue_final_message": True},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": []},
    ]
    assert [tpl.render(b) for b in declined] == [None] * len(declined)
    raising = ChatTemplate("{{ raise_exception('no system role') }}", {})
    assert raising.render({"messages": msgs}) is None
    (tmp_path / "chat_template.jinja").write_text("{% generation %}x{% endgeneration %}")  # transformers-only tag
    assert ChatTemplate.load(tmp_path) is None


def test_prompt_ids_are_the_simulators_own_for_its_models() -> None:
    tc = TokenCounter()
    tc.load({}, sim=["tiny"])
    body = _turn()
    ids = asyncio.run(tc.prompt_ids("tiny", "/v1/chat/completions", body))
    assert ids == Tokenizer().encode(apply_chat_template(body["messages"]))
    assert asyncio.run(tc.prompt_ids("tiny", "/v1/completions", {"prompt": "a b c"})) == Tokenizer().encode("a b c")
    assert asyncio.run(tc.prompt_ids("tiny", "/v1/completions", {"prompt": [5, 6, 7]})) == [5, 6, 7]
    claude = {"model": "tiny", "max_tokens": 8, "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
              {"type": "text", "text": "Be brief."}], "messages": body["messages"][1:]}  # fmt: skip
    assert asyncio.run(tc.prompt_ids("tiny", "/v1/messages", claude)) == Tokenizer().encode(
        apply_chat_template([{"role": "system", "content": "Be brief."}, *body["messages"][1:]])
    )  # the simulator drops the billing block, as vLLM 0.32
    no_max = {k: v for k, v in claude.items() if k != "max_tokens"}
    assert asyncio.run(tc.prompt_ids("tiny", "/v1/messages", no_max)) is None  # the simulator's 400
    assert asyncio.run(tc.prompt_ids("other", "/v1/chat/completions", body)) is None  # no tokenizer: not exact
    assert asyncio.run(tc.prompt_ids("other", "/v1/completions", {"prompt": [9, 8]})) == [9, 8]  # ids: any model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_gateway_decides_with_the_decodes_own_events(caplog: pytest.LogCaptureFixture) -> None:
    """Events published for decode-1 make a chat local there (view=exact); cleared, it takes both legs."""
    port = _free_port()
    workers = MemoryWorkers()
    workers["prefill"].script(*(_prefill() for _ in range(4)))
    for i in range(2):
        workers[f"decode-{i}"].script(*(_decoded() for _ in range(4)))
    body = _turn()
    ids = Tokenizer().encode(apply_chat_template(body["messages"]))
    full = len(ids) // BS * BS
    caplog.set_level("INFO", logger="pdctl.gateway.access")

    async def test(app: Gateway) -> None:
        async with _publisher(app, port) as pub:
            await _until(app, pub, "decode-1", _frames("decode-1", 0, _stored(ids[:full], range(1, full // BS + 1))))
            reply = await asgi_request(app, "/v1/chat/completions", body)
            assert reply.status == 200 and reply.headers["x-pd-path"] == "local", reply.body
            assert len(workers["decode-1"].completions()) == 1
            assert not workers["prefill"].completions() and not workers["decode-0"].completions()
            metric = app.metrics.registry.get_sample_value
            assert metric("pdctl_pd_view_cached_tokens_total", {"view": "exact"}) == full
            assert metric("pdctl_pd_view_cached_tokens_total", {"view": "approx"}) == 0  # the gateway sent nothing
            assert metric("pdctl_pd_view_disagreements_total", {"path": "local"}) == 1
            assert (metric("pdctl_kv_events_total", {"instance": "decode-1", "event": "BlockStored"}) or 0) >= 1
            await pub.send_multipart(_frames("decode-1", 1, AllBlocksCleared()))
            view = app.kv_events.view("decode-1")
            assert view is not None
            for _ in range(200):
                if not len(view):
                    break
                await asyncio.sleep(0.01)
            reply = await asgi_request(app, "/v1/chat/completions", body)
            assert reply.status == 200 and reply.headers["x-pd-path"] == "disagg"
            assert _decisions(app, "disagg", "uncached_tokens") == 1

    settings = _exact_settings(port)
    app = run_app(create_app(settings, KEY, clients=workers), test)
    assert app.kv_events is not None and not app.kv_events.bound  # the socket is closed with the gateway
    assert any("view=exact" in r.getMessage() for r in caplog.records)


def test_each_view_is_bounded_by_what_its_engine_reports_it_holds() -> None:
    """decode-1's /metrics says its KV cache holds 4 blocks (vllm:cache_config_info): its view holds at most 8 and
    starts over when events claim more; decode-0 reports nothing and keeps the configured bound."""
    port = _free_port()
    workers = MemoryWorkers()
    workers["decode-1"].metrics = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",num_cpu_blocks="None",num_gpu_blocks="4"} 1.0\n'
    )
    ids = list(range(12 * BS))

    async def test(app: Gateway) -> None:
        pool = app.router.pool
        for _ in range(300):
            if [i.kv_blocks for i in pool.instances if i.name == "decode-1"] == [4]:
                break
            await asyncio.sleep(0.01)
        assert {i.name: i.kv_blocks for i in pool.instances} == {"prefill": None, "decode-0": None, "decode-1": 4}
        metric = app.metrics.registry.get_sample_value
        seen_topics = ("decode-0", "decode-1")
        async with _publisher(app, port) as pub:
            for topic in seen_topics:
                await _until(app, pub, topic, _frames(topic, 0, _stored(ids[: 4 * BS], range(1, 5))))
                await pub.send_multipart(_frames(topic, 1, _stored(ids[4 * BS :], range(5, 13), parent=4)))
            for _ in range(300):
                counts = [metric("pdctl_kv_events_total", {"instance": t, "event": "BlockStored"}) for t in seen_topics]
                if counts[0] == counts[1] == 2:
                    break
                await asyncio.sleep(0.01)
            seen = [app.kv_events.view(t) for t in ("decode-0", "decode-1")] if app.kv_events else []
            assert [len(v) if v is not None else None for v in seen] == [12, 0]  # 12 > 2 x 4: decode-1's started over
            assert metric("pdctl_kv_events_total", {"instance": "decode-1", "event": "overflow"}) == 1
            assert metric("pdctl_kv_events_total", {"instance": "decode-0", "event": "overflow"}) is None

    run_app(create_app(_exact_settings(port), KEY, clients=workers), test)


def _exact_settings(port: int) -> GatewaySettings:
    """Adaptive PD over one prefill and two decodes serving the simulator's ``tiny``, the exact view on ``port``."""
    settings = make_settings(["http://prefill.invalid"], ["http://decode-0.invalid", "http://decode-1.invalid"],
                             models=(LocalModel("tiny", 4096, engine="sim"),))  # fmt: skip
    return dataclasses.replace(
        settings,
        routing=dataclasses.replace(
            settings.routing, pd_mode="adaptive", prefix_view="exact", kv_events_port=port, local_max_uncached_tokens=64
        ),
    )


@contextlib.asynccontextmanager
async def _publisher(app: Gateway, port: int) -> AsyncIterator[Any]:
    """A PUB socket connected to the gateway's events port once it is bound (vLLM's PUB connects to a
    ``tcp://host:port`` endpoint); closed on leaving."""
    assert app.kv_events is not None
    for _ in range(200):
        if app.kv_events.bound:
            break
        await asyncio.sleep(0.01)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield pub
    finally:
        pub.close(linger=0)
        ctx.term()


async def _until(app: Gateway, pub: Any, topic: str, frames: list[bytes]) -> None:
    """Publish ``frames`` until the subscriber has them (a PUB drops messages until the connection is up)."""
    assert app.kv_events is not None
    for _ in range(300):
        await pub.send_multipart(frames)
        await asyncio.sleep(0.02)
        view = app.kv_events.view(topic)
        if view is not None and len(view):
            return
    pytest.fail(f"no KV event from {topic} reached the gateway")


def test_the_relay_gives_every_gateway_process_every_event(tmp_path: Path) -> None:
    """gateway.workers > 1: the parent binds the events port and relays; two subscribers that connect to the relay
    (two processes' views) each apply what one engine published."""
    port = _free_port()
    relay = EventsRelay(f"tcp://127.0.0.1:{port}", tmp_path / "relay.ipc")
    relay.start()
    ids = list(range(2 * BS))

    async def main() -> list[int]:
        subs = [KvEventSubscriber(relay.endpoint, connect=True) for _ in range(2)]
        tasks = [asyncio.ensure_future(s.run()) for s in subs]
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.connect(f"tcp://127.0.0.1:{port}")
        try:
            for _ in range(300):  # a PUB drops messages until the subscriptions have travelled the relay
                await pub.send_multipart(_frames("decode", 0, _stored(ids, [1, 2])))
                await asyncio.sleep(0.02)
                views = [s.view("decode") for s in subs]
                if all(v is not None and len(v) for v in views):
                    break
            return [
                v.match(token_block_hashes(ids, BS)) if v is not None else 0 for v in (s.view("decode") for s in subs)
            ]
        finally:
            pub.close(linger=0)
            ctx.term()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        assert asyncio.run(main()) == [2, 2]
    finally:
        relay.close()
    taken = EventsRelay(f"tcp://127.0.0.1:{port}", tmp_path / "again.ipc")
    blocker = zmq.Context()
    held = blocker.socket(zmq.SUB)
    held.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(LaunchError, match="cannot bind"):
            taken.start()
    finally:
        held.close(linger=0)
        blocker.term()


def test_an_agent_route_is_judged_by_the_exact_view_whatever_its_billing_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Claude Code /v1/messages turn (billing line, tools, tool_use/tool_result) is rendered as the engine renders
    it, so the decode's own events say it is held: local, ``view=exact``, though its billing line is new."""
    from pdctl.sim.agentapi import chat_request as sim_chat
    from tests.agent_corpus import claude_code

    port = _free_port()
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill())
    for i in range(2):
        workers[f"decode-{i}"].default = _decoded()
    turn = {**claude_code(2, seed=5, trailing_system=False)[1], "model": "tiny", "stream": False}
    other = json.loads(json.dumps(turn))
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.999; cc_entrypoint=cli; cch=00000;"
    ids = Tokenizer().encode(apply_chat_template(sim_chat(other, "/v1/messages")[0]))  # the engine's, another line
    full = len(ids) // BS * BS
    caplog.set_level("INFO", logger="pdctl.gateway.access")

    async def test(app: Gateway) -> None:
        async with _publisher(app, port) as pub:
            await _until(app, pub, "decode-1", _frames("decode-1", 0, _stored(ids[:full], range(1, full // BS + 1))))
            reply = await asgi_request(app, "/v1/messages", turn)
            assert reply.status == 200 and reply.headers["x-pd-path"] == "local", reply.body
            assert reply.headers["x-pd-decode"] == "decode-1"

    settings = _exact_settings(port)
    run_app(create_app(settings, KEY, clients=workers), test)
    line = next(r.getMessage() for r in caplog.records if "path=local" in r.getMessage())
    assert "view=exact" in line and f"cached_tokens={full}" in line, line
