"""The SLO autopilot (``routing.pd_mode = "auto"``): the learned cost model, the per-request choice, and the
gateway in front of simulator workers.

The choice tests build the gateway's own pool and router and hold calls in flight on an instance the way a running
stream does (:meth:`~pdctl.gateway.routing.pool.Instance.track`); the costs start from the simulator's h100 profile
(:mod:`pdctl.sim.timing`) and learn through the cost model's observation API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path as FsPath
from typing import Any

import httpx
import pytest

from pdctl.config import SLOConfig
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.memory import MemoryWorkers
from pdctl.gateway.routing.costs import BUSY_WINDOW_S, CostModel, Path, Seed
from pdctl.runtime.trace import parse_access
from pdctl.sim.timing import get_profile
from pdctl.testing import SimProcess, start_sim
from tests.fakes.gateway_harness import KEY, GatewayThread, make_settings, wait_for

H100 = get_profile("h100")
#: The h100 profile's costs: prefill seconds per token, an idle decode step and its growth per stream.
SEED = Seed(
    prefill_s_per_token=H100.prefill_s(2048) / 2048,
    step_s=H100.decode_step_s(1, 1024),
    step_s_per_stream=(H100.decode_step_s(128, 1024) - H100.decode_step_s(1, 1024)) / 127,
    kv_s_per_token=3e-6,
)


# ------------------------------------------------------------------------------------------------ the cost model


def test_learned_costs_move_toward_what_is_observed() -> None:
    m = CostModel(SEED)
    assert m.prefill_s_per_token("p") == SEED.prefill_s_per_token
    for t in range(10):  # leg 1s four times slower than the seed: the load changed
        m.observe_prefill("p", 0, 4 * SEED.prefill_s_per_token * 1000, 1000, now=100.0 + t)
    assert m.prefill_s_per_token("p") == pytest.approx(4 * SEED.prefill_s_per_token)
    for n in (1, 8, 16, 32):  # decode steps of 10 ms + 1 ms per stream
        m.observe_stream("d", 0, 0.010 + 0.001 * n, n, now=0.0)
    assert m.step_s("d", 64) == pytest.approx(0.010 + 0.001 * 64)
    m.observe_kv("d", 0, 0.02, 2000)
    assert m.kv_s_per_token("d") == pytest.approx(1e-5)
    m.observe_prefill("d", 0, 0.5, 100, now=50.0)  # still counted, but out of the busy window by t = 60
    assert m.busy("d", 51.0) == pytest.approx(0.5 / BUSY_WINDOW_S)
    assert m.busy("d", 50.0 + BUSY_WINDOW_S + 1) == 0.0


def test_a_new_epoch_starts_again_from_the_seeds() -> None:
    m = CostModel(SEED)
    m.observe_prefill("p", 0, 1.0, 1000, now=0.0)
    assert m.prefill_s_per_token("p") == pytest.approx(1e-3)
    m.observe_epoch("p", 1)  # the engine restarted: its cache and its load are gone
    assert m.prefill_s_per_token("p") == SEED.prefill_s_per_token


def test_a_local_prefill_stall_is_counted_on_the_running_streams() -> None:
    m = CostModel(SEED)
    idle = m.predict(Path("local", "d", "d", 0, 4000, 0, 0), now=0.0)
    busy = m.predict(Path("local", "d", "d", 0, 4000, 0, 32), now=0.0)
    moved = m.predict(Path("disagg", "p", "d", 0, 4000, 4000, 32), now=0.0)
    assert idle.others_tpot_s is None
    assert busy.others_tpot_s is not None and moved.others_tpot_s is not None
    assert busy.others_tpot_s > moved.others_tpot_s  # only the local path stalls the decode's streams
    assert moved.ttft_s > busy.ttft_s - 1e-9  # and the P→D path pays the KV transfer


# ------------------------------------------------------------------------------------------------ the choice


def _gateway(ttft_ms: float = 1000.0, tpot_ms: float = 10.0) -> Gateway:
    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"],
                             slo=SLOConfig(ttft_ms=ttft_ms, tpot_ms=tpot_ms, admission=False))  # fmt: skip
    settings = dataclasses.replace(settings, routing=dataclasses.replace(settings.routing, pd_mode="auto"))
    app = create_app(settings, KEY, clients=MemoryWorkers())
    assert app.router.autopilot is not None
    app.router.autopilot.model = CostModel(SEED)
    return app


def _body(tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "word " * tokens}], "max_tokens": 64}


@contextlib.contextmanager
def _streams(app: Gateway, role: str, n: int) -> Iterator[None]:
    """``n`` calls in flight on the instance of ``role``, as ``n`` running streams hold it."""
    inst = app.pool.by_role(role)[0]  # type: ignore[arg-type]
    with contextlib.ExitStack() as stack:
        for _ in range(n):
            stack.enter_context(inst.track(1024))
        yield


def _choose(app: Gateway, tokens: int) -> tuple[str, str]:
    assert app.router.autopilot is not None and app.router.chooser is not None
    plan = app.router.chooser.decide(app.pool, _body(tokens), tokens)
    choice = app.router.autopilot.choose(app.pool, plan)
    assert choice is not None
    return choice.chosen.kind, choice.plan.log_fields()


def test_an_idle_decode_serves_a_small_prompt_alone() -> None:
    kind, fields = _choose(_gateway(), 200)
    assert kind == "local"
    assert "decision=auto" in fields and "auto=local" in fields
    assert "auto_local=decode:" in fields and "auto_whole=prefill:" in fields and "auto_disagg=prefill:" in fields


def test_a_saturated_decode_sends_the_whole_request_to_an_idle_prefill() -> None:
    app = _gateway(tpot_ms=10.0)
    with _streams(app, "decode", 128):  # one more stream there: a step of 12.4 ms
        kind, fields = _choose(app, 200)
    assert kind == "whole", fields
    assert app.router.autopilot is not None and app.router.autopilot.streams(app.pool.by_role("prefill")[0]) == 1


def test_a_long_prompt_on_a_busy_decode_under_a_tight_tpot_takes_both_legs() -> None:
    app = _gateway(tpot_ms=10.0)
    with _streams(app, "decode", 64):  # 9.2 ms steps: room for one more stream, not for a 240 ms stall
        kind, fields = _choose(app, 8000)
        assert kind == "disagg", fields  # a whole request would meet the SLOs too, but hold the prefill engine
        assert _choose(app, 100)[0] == "local"  # a small prompt's stall is spread thin over the streams' outputs


def test_a_prefill_busy_with_leg_1s_slows_a_stream_placed_there() -> None:
    app = _gateway(tpot_ms=10.0)
    assert app.router.autopilot is not None and app.router.chooser is not None

    def whole_tpot() -> float:
        assert app.router.autopilot is not None and app.router.chooser is not None
        plan = app.router.chooser.decide(app.pool, _body(200), 200)
        cands = app.router.autopilot.candidates(app.pool, plan, time.monotonic())
        return next(c.prediction.tpot_s for c in cands if c.kind == "whole")

    idle = whole_tpot()
    now = time.monotonic()
    for i in range(5):  # the prefill spent half of the last seconds on leg 1s: every step of a stream there waits
        app.router.autopilot.model.observe_prefill("prefill", 0, 0.5, 16000, now=now - i * 0.5)
    assert whole_tpot() == pytest.approx(2 * idle, rel=0.05)


def test_safety_keeps_the_running_streams_within_their_tpot_unless_every_path_breaks_it() -> None:
    app = _gateway(ttft_ms=50.0, tpot_ms=10.0)  # a TTFT no path can meet for a long prompt
    with _streams(app, "decode", 64):
        kind, fields = _choose(app, 8000)
    assert kind != "local", fields  # the smallest TTFT, but it stalls 64 streams past their SLO


def test_a_restarted_engine_is_predicted_from_the_seeds_again() -> None:
    app = _gateway()
    assert app.router.autopilot is not None
    decode = app.pool.by_role("decode")[0]
    app.router.autopilot.model.observe_prefill("decode", decode.epoch, 2.0, 1000, now=0.0)
    assert app.router.autopilot.model.prefill_s_per_token("decode") == pytest.approx(2e-3)
    decode.set_healthy(False)  # the health probe saw it down, then back: a new epoch
    decode.set_healthy(True)
    _choose(app, 200)
    assert app.router.autopilot.model.prefill_s_per_token("decode") == SEED.prefill_s_per_token


# ------------------------------------------------------------------------------------------------ on the simulator


@pytest.fixture
def pair(tmp_path: FsPath) -> Iterator[tuple[SimProcess, SimProcess]]:
    args = ["--max-model-len", "2048", "--sim-profile", "fast"]
    p = start_sim(args, str(tmp_path), name="prefill", model="sim-model", role="kv_producer")
    try:
        d = start_sim(args, str(tmp_path), name="decode", model="sim-model", role="kv_consumer")
        try:
            yield p, d
        finally:
            d.stop()
    finally:
        p.stop()


def test_auto_on_the_simulator_streams_learns_and_logs_its_predictions(
    pair: tuple[SimProcess, SimProcess], caplog: pytest.LogCaptureFixture
) -> None:
    p, d = pair
    settings = make_settings([p.url], [d.url], models=(), slo=SLOConfig(ttft_ms=2000, tpot_ms=100))
    settings = dataclasses.replace(settings, routing=dataclasses.replace(settings.routing, pd_mode="auto"))
    caplog.set_level(logging.INFO, logger="pdctl.gateway.access")
    g = GatewayThread(settings)
    try:
        assert wait_for(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 200, timeout=20)
        for i in range(4):
            body = {"model": "sim-model", "stream": True, "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"question {i}: how are you?"}]}  # fmt: skip
            headers = {"authorization": f"Bearer {KEY}", "x-request-id": f"auto-{i}"}
            with httpx.stream("POST", g.url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
                text = "".join(r.iter_text())
                assert r.status_code == 200 and r.headers["x-pd-path"] == "local", text
            assert text.rstrip().endswith("data: [DONE]")

        def access() -> list[dict[str, str]]:
            return [a for r in caplog.records if r.name == "pdctl.gateway.access"
                    if (a := parse_access(f" pdctl.gateway.access {r.getMessage()}")) is not None]  # fmt: skip

        assert wait_for(lambda: len(access()) == 4, timeout=10)  # each line is written once its stream has ended
        lines = access()
        for a in lines:
            assert a["decision"] == "auto" and a["auto"] == "local"
            assert a["auto_local"].startswith("decode:") and a["auto_disagg"].startswith("prefill:")
            ttft_ms, tpot_ms, others = a["auto_local"].split(":")[1].split("/")
            assert float(ttft_ms) > 0 and float(tpot_ms) >= 0 and others == "-"  # one stream at a time
        autopilot = g.app.router.autopilot
        assert autopilot is not None
        learned = autopilot.model.engines["decode"]
        assert len(learned.steps) == 4  # every stream taught the model its step time
        assert learned.prefill.count >= 1  # and its prefill time (a TTFT below one predicted step teaches none)
        assert autopilot.model.prefill_s_per_token("decode") != Seed().prefill_s_per_token
        metrics = httpx.get(g.url + "/metrics", timeout=10).text
        assert 'pdctl_autopilot_ttft_ratio_count{path="local"} 4.0' in metrics
        assert 'pdctl_autopilot_tpot_ratio_count{path="local"} 4.0' in metrics  # 8 tokens each: a TPOT to compare
        assert "request_id" not in metrics.split("pdctl_autopilot_ttft_ratio")[1].split("\n# ")[0]
    finally:
        g.stop()
