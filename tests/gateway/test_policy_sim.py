"""Per-pool routing policies in front of simulator workers (2P2D): ``prefill_policy = "cache_aware"`` and
``decode_policy = "kv_aware"`` with the workers' own KV cache events, end to end over HTTP."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdctl.runtime.trace import parse_access
from pdctl.testing import SimProcess, start_sim
from pdctl.testing.ports import free_port
from pdctl.vllm.kv_events import publisher_config
from pdctl.vllm.promtext import metric_value, samples
from tests.fakes.gateway_harness import KEY, GatewayThread, make_settings, wait_for


@pytest.fixture
def two_by_two(tmp_path: Path) -> Iterator[tuple[list[SimProcess], int]]:
    """Two prefill and two decode simulators publishing their KV cache events to one free port."""
    events = free_port()
    sims: list[SimProcess] = []
    try:
        for name, role in (("prefill-0", "kv_producer"), ("prefill-1", "kv_producer"),
                           ("decode-0", "kv_consumer"), ("decode-1", "kv_consumer")):  # fmt: skip
            config = publisher_config(f"tcp://127.0.0.1:{events}", name)
            args = ["--max-model-len", "2048", "--sim-profile", "fast", "--kv-events-config", json.dumps(config)]
            sims.append(start_sim(args, str(tmp_path), name=name, model="sim-model", role=role))
        yield sims, events
    finally:
        for s in sims:
            s.stop()


def _events(url: str, instance: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return metric_value(samples(text), "pdctl_kv_events_total", instance=instance, event="BlockStored") or 0.0


def test_later_turns_follow_the_kv_and_sessions_break_ties(
    two_by_two: tuple[list[SimProcess], int], caplog: pytest.LogCaptureFixture
) -> None:
    sims, events = two_by_two
    settings = make_settings([s.url for s in sims[:2]], [s.url for s in sims[2:]], models=())
    routing = dataclasses.replace(settings.routing, prefix_view="exact", kv_events_port=events,
                                  prefill_policy="cache_aware", decode_policy="kv_aware")  # fmt: skip
    caplog.set_level(logging.INFO, logger="pdctl.gateway.access")
    g = GatewayThread(dataclasses.replace(settings, routing=routing))
    try:
        assert wait_for(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 200, timeout=20)

        def complete(prompt: list[int], rid: str, session: str | None = None) -> httpx.Response:
            headers = {"authorization": f"Bearer {KEY}", "x-request-id": rid}
            if session:
                headers["x-session-id"] = session
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4}
            r = httpx.post(g.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200 and r.headers["x-pd-path"] == "disagg", r.text
            return r

        # A PUB socket drops what it publishes before its connection is up (ZMQ's slow joiner): warm up until
        # every worker's events reach the gateway, so the views hold every block from here on.
        subscriber = g.app.kv_events
        assert subscriber is not None
        for i in range(60):
            if len(subscriber.views) == len(sims):
                break
            complete(list(range(90000 + 100 * i, 90040 + 100 * i)), f"warm{i}")
        assert wait_for(lambda: len(subscriber.views) == len(sims), timeout=10), subscriber.views
        history = list(range(1000, 1320))  # token ids: exact for any model; 20 blocks of 16
        first = complete(history, "t1")
        held = first.headers["x-pd-decode"]
        assert wait_for(lambda: _events(g.url, held) >= 1, timeout=20)
        for turn in range(2, 6):
            history = [*history, *range(5000 + 40 * turn, 5040 + 40 * turn)]
            r = complete(history, f"t{turn}")
            assert r.headers["x-pd-decode"] == held, turn  # the decode holding the conversation's KV
            assert r.headers["x-pd-prefill"] == first.headers["x-pd-prefill"], turn  # the prefill's view matches
            assert wait_for(lambda n=turn: _events(g.url, held) >= n, timeout=20)
        # Unrelated prompts cost the same on both idle decodes: the session's last decode wins each tie.
        picks = [complete(list(range(20000 + 400 * i, 20300 + 400 * i)), f"s{i}", "sess-1").headers["x-pd-decode"]
                 for i in range(6)]  # fmt: skip
        assert len(set(picks)) == 1, picks
    finally:
        g.stop()
    fields = {f["request_id"]: f for f in (parse_access(f" pdctl.gateway.access {r.getMessage()}")
                                           for r in caplog.records) if f is not None}  # fmt: skip
    t5 = fields["t5"]
    assert t5["decision"] == "always" and t5["decode_pick"] == "kv_aware:cost"
    costs = dict(s.split(":") for s in t5["decode_scores"].split(","))
    other = next(n for n in costs if n != held)
    assert int(costs[held]) < int(costs[other])
    assert t5["prefill_pick"] == "cache_aware:match"
    assert {fields[f"s{i}"]["decode_pick"] for i in range(1, 6)} == {"kv_aware:session"}
