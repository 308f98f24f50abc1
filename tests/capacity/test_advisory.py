"""The gateway's advice for one window (pdctl/capacity/advisory.py): histograms from Prometheus buckets, and the
status against the counts serving now, checked against ``pdctl advise``'s own model."""

from __future__ import annotations

import math
import random

import pytest

from pdctl.capacity import model as m
from pdctl.capacity.advisory import MIN_REQUESTS, advise_counts, histogram_from_buckets
from pdctl.capacity.profile import DeploymentProfile

SLO = m.Slo(0.4, 0.04)


def _workload(isl: float, osl: float, rate: float) -> m.Workload:
    return m.Workload(m.Histogram(((isl, 1.0),)), m.Histogram(((osl, 1.0),)), rate)


def test_buckets_become_a_histogram_with_the_windows_exact_mean() -> None:
    # 30 requests at or below 128 tokens (all above 64), 10 between 2048 and 4096, 2 above the last bound
    cumulative = {64.0: 0.0, 128.0: 30.0, 2048.0: 30.0, 4096.0: 40.0, math.inf: 42.0}
    total = 30 * 100 + 10 * 3000 + 2 * 9000
    h = histogram_from_buckets(cumulative, total)
    assert h is not None
    assert h.mean == pytest.approx(total / 42)
    weights = [w for _, w in h.bins]
    assert weights == [30.0, 10.0, 2.0]
    values = [v for v, _ in h.bins]
    assert values[0] < values[1] < values[2]  # the shape is the buckets' order
    assert histogram_from_buckets({128.0: 0.0, math.inf: 0.0}, 0.0) is None


def test_a_window_with_too_few_requests_gives_no_advice(h100: DeploymentProfile) -> None:
    a = advise_counts(h100, _workload(128, 128, 5.0), SLO, 5.0, MIN_REQUESTS - 1, 1, 1)
    assert a.status == "idle" and a.recommended is None and (a.recommended_prefill, a.recommended_decode) == (1, 1)
    assert advise_counts(h100, None, SLO, 5.0, 100, 1, 1).status == "idle"


def test_long_prompts_at_a_high_rate_want_more_prefills_than_one(h100: DeploymentProfile) -> None:
    w = _workload(4096, 16, 40.0)
    a = advise_counts(h100, w, SLO, 40.0, 400, 1, 1)
    best = m.best_pd(h100, w, SLO, 40.0)
    assert a.status in ("under_prefill", "under_both")
    assert a.current is not None and not a.current.meets
    assert (a.recommended_prefill, a.recommended_decode) == (best.prefill, best.decode)
    assert a.recommended_prefill > 1
    assert "misses the TTFT SLO" in a.reason or "misses the SLO" in a.reason


def test_many_long_streams_want_more_decodes(h100: DeploymentProfile) -> None:
    w = _workload(128, 1024, 60.0)
    best = m.best_pd(h100, w, SLO, 60.0)
    assert best.meets and best.decode > 1
    a = advise_counts(h100, w, SLO, 60.0, 400, best.prefill, 1)
    assert a.status in ("under_decode", "under_both") and a.recommended_decode == best.decode


def test_a_deployment_larger_than_the_traffic_needs_is_over_and_one_that_fits_is_ok(h100: DeploymentProfile) -> None:
    w = _workload(512, 64, 2.0)
    over = advise_counts(h100, w, SLO, 2.0, 200, 4, 4)
    assert over.status == "over" and over.recommended is not None and over.recommended.engines < 8
    best = m.best_pd(h100, w, SLO, 2.0)
    fits = advise_counts(h100, w, SLO, 2.0, 200, best.prefill, best.decode)
    assert fits.status == "ok" and fits.current is not None and fits.current.meets


def test_an_slo_no_split_meets_is_unreachable(h100: DeploymentProfile) -> None:
    w = _workload(4096, 64, 1.0)
    a = advise_counts(h100, w, m.Slo(0.0001, 0.04), 1.0, 100, 1, 1, limit=4)
    assert a.status == "unreachable" and "no split of up to 4 engines" in a.reason


def _lengths(name: str, n: int = 600) -> list[tuple[float, float]]:
    rng = random.Random(1)
    if name == "recipe":  # pdctl bench -w mixed
        return [
            (rng.choices([128.0, 4096.0], [0.9, 0.1])[0], rng.choices([128.0, 8.0], [0.9, 0.1])[0]) for _ in range(n)
        ]
    if name == "long":
        return [(rng.choice([4000.0, 8000.0]), 64.0) for _ in range(n)]
    # coding-agent turns: long, spread contexts and short answers (log-normal)
    return [(float(int(rng.lognormvariate(math.log(12000), 0.5))), float(int(rng.lognormvariate(math.log(200), 0.8)) + 1))
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("name", ["recipe", "long", "agent"])
def test_the_gateways_bucketed_lengths_advise_as_the_exact_lengths_do(h100: DeploymentProfile, name: str) -> None:
    """The advisor sees lengths only through its histograms' buckets (√2 apart) and sums: it recommends what `pdctl
    advise` on the exact lengths does, for the recipe's mix and long prompts at 1000/8 ms and for log-normal agent
    turns at 2000/20 ms (600 requests; at 1 to 30 requests/s)."""
    from pdctl.gateway.metrics import GatewayMetrics

    pairs = _lengths(name)
    metrics = GatewayMetrics()
    for isl, osl in pairs:
        metrics.prompt_tokens.observe(isl)
        metrics.generation_tokens.observe(osl)
    isl_h = histogram_from_buckets(*metrics.histogram("pdctl_request_prompt_tokens"))
    osl_h = histogram_from_buckets(*metrics.histogram("pdctl_request_generation_tokens"))
    assert isl_h is not None and osl_h is not None
    exact = m.Workload(m.Histogram.of([a for a, _ in pairs]), m.Histogram.of([b for _, b in pairs]))
    assert isl_h.mean == pytest.approx(exact.isl.mean) and osl_h.mean == pytest.approx(exact.osl.mean)
    bucketed = m.Workload(isl_h, osl_h)
    slo = m.Slo(2.0, 0.02) if name == "agent" else m.Slo(1.0, 0.008)
    for rate in (1.0, 3.0, 10.0, 30.0):
        e, b = m.best_pd(h100, exact, slo, rate), m.best_pd(h100, bucketed, slo, rate)
        assert e.meets and b.meets and (e.prefill, e.decode) == (b.prefill, b.decode), (name, rate, e, b)
