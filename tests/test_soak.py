"""Soak (reliability case L1): traffic at concurrency 32 through ``pdctl up``-started simulator workers and
the gateway, random client disconnects, one decode and one prefill SIGKILL; then N1–N6 must hold.

The short form runs in CI under ``routing.pd_mode = "adaptive"``, so its traffic takes both paths: short
prompts and conversations' later turns on the decode alone, long prompts and first turns on both legs. ``-m soak``
runs the documented long one under both modes (the same code as ``benchmarks/soak.py``). Also here: regressions
the soak found.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from benchmarks.soak import SoakConfig, SoakReport, run_soak
from pdctl.config.settings import PdMode
from pdctl.gateway.metrics import GatewayMetrics
from pdctl.gateway.routing.pool import Pool
from tests.fakes.gateway_harness import FakeProc, make_settings

KEY = "sk-soak-test-key-0123456789abcdef"


@pytest.mark.timeout(240)
def test_short_soak_nothing_lost(tmp_path: Path) -> None:
    cfg = SoakConfig(requests=160, concurrency=32, disconnect_p=0.10, seed=11, warm_requests=32, pd_mode="adaptive")
    report = run_soak(cfg, tmp_path, KEY)
    text = report.render()
    print(text)
    (tmp_path / "soak-report.json").write_text(json.dumps(report.to_json(), indent=2))
    assert report.invariants is not None, text
    assert report.ok, text
    assert not report.notes, text
    # The faults really happened and the workers came back.
    assert len(report.faults) == 2 and report.restarts.get("decode") == 1 and report.restarts.get("prefill") == 1
    client = report.client
    assert client.hung == 0 and client.cancelled > 0 and client.succeeded > cfg.requests // 3, text
    assert client.sent >= cfg.requests + cfg.warm_requests
    _assert_both_paths(report)


def _assert_both_paths(report: SoakReport) -> None:
    """Under adaptive the gateway took both paths, by its own /metrics and by the answers' ``x-pd-path``."""
    text = report.render()
    assert report.gateway["pd_local"] > 0 and report.gateway["pd_disagg"] > 0, text
    assert report.paths.get("local", 0) > 0 and report.paths.get("disagg", 0) > 0, text


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pd_mode", ["always", "adaptive"])
def test_long_soak_nothing_lost(tmp_path: Path, request: pytest.FixtureRequest, pd_mode: PdMode) -> None:
    if "soak" not in (request.config.getoption("-m") or ""):
        pytest.skip("the long soak runs only when asked for: pytest -m soak tests/test_soak.py")
    report = run_soak(SoakConfig(pd_mode=pd_mode), tmp_path, KEY)
    print(report.render())
    assert report.ok and not report.notes, report.render()
    if pd_mode == "adaptive":
        _assert_both_paths(report)
    else:
        assert report.gateway["pd_local"] == 0 and report.paths.get("local", 0) == 0, report.render()


def test_breaker_cooldown_does_not_grow_across_recovered_incidents() -> None:
    """The soak found that the ejection multiplier never reset: incident k ejected a worker for k x cooldown."""
    fake = FakeProc("fake_pd_worker.py", {"role": "decode"})
    try:
        settings = make_settings([fake.url], [fake.url], breaker_threshold=2, breaker_cooldown_s=0.2)

        async def incidents() -> list[float]:
            pool = Pool(settings, GatewayMetrics())
            inst = pool.by_role("decode")[0]
            cooldowns = []
            try:
                for _ in range(3):
                    pool.record_failure(inst)
                    pool.record_failure(inst)
                    assert inst.breaker_open
                    cooldowns.append(inst.open_until - time.monotonic())
                    await asyncio.sleep(0.25)
                    await pool.probe(inst)  # half-open: a healthy probe after the cooldown closes it
                    assert not inst.breaker_open
                    pool.record_success(inst)  # then real traffic succeeds again
            finally:
                await pool.close()
            return cooldowns

        cooldowns = asyncio.run(incidents())
    finally:
        fake.kill()
    assert all(c <= 0.2 for c in cooldowns), cooldowns
