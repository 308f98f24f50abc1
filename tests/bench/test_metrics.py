"""pdctl.bench.metrics against hand-computed values (vLLM's definitions)."""

from __future__ import annotations

import math
import random

import pytest

from pdctl.bench.client import RequestResult
from pdctl.bench.metrics import SLO, meets_slo, parse_goodput, percentile, stats, summarize, tpot_s


def ok(
    index: int, ttft: float, latency: float, out: int, itl: list[float], prompt: int, sent: float = 0.0
) -> RequestResult:
    r = RequestResult(index, "random", out, prompt)
    r.success, r.ttft_s, r.latency_s, r.output_tokens, r.itl_s = True, ttft, latency, out, itl
    r.prompt_tokens, r.sent_s, r.elapsed_s, r.status, r.pd_path = prompt, sent, latency, 200, "disagg"
    return r


def failed(index: int, error: str = "HTTP 500: boom", sent: float = 0.0, elapsed: float = 0.1) -> RequestResult:
    r = RequestResult(index, "random", 8, 40)
    r.error, r.sent_s, r.elapsed_s, r.status = error, sent, elapsed, 500
    return r


@pytest.fixture
def sample() -> list[RequestResult]:
    return [
        # TPOT = (0.5 - 0.1) / (5 - 1) = 100 ms
        ok(0, 0.1, 0.5, 5, [0.1, 0.1, 0.1, 0.1], 10, sent=0.0),
        # one output token: no TPOT sample
        ok(1, 0.2, 0.2, 1, [], 20, sent=0.5),
        # TPOT = (0.8 - 0.3) / (11 - 1) = 50 ms
        ok(2, 0.3, 0.8, 11, [0.05] * 10, 30, sent=1.0),
        failed(3, sent=1.5),
    ]


def test_tpot_definition_and_one_token_outputs(sample: list[RequestResult]) -> None:
    assert tpot_s(sample[0]) == pytest.approx(0.1)
    assert tpot_s(sample[1]) is None
    assert tpot_s(sample[2]) == pytest.approx(0.05)
    assert tpot_s(sample[3]) is None


def test_counts_and_throughputs(sample: list[RequestResult]) -> None:
    s = summarize(sample, 2.0)
    assert (s.completed, s.failed, s.rejected) == (3, 1, 0)
    assert s.total_input_tokens == 60
    assert s.total_output_tokens == 17
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(8.5)
    assert s.total_token_throughput == pytest.approx(38.5)
    assert s.errors == {"HTTP 500": 1}
    assert s.paths == {"disagg": 3, "unknown": 1}


def test_latency_statistics(sample: list[RequestResult]) -> None:
    s = summarize(sample, 2.0, percentiles=(90, 99))
    assert s.ttft.count == 3
    assert s.ttft.mean == pytest.approx(200.0)
    assert s.ttft.median == pytest.approx(200.0)
    assert s.ttft.std == pytest.approx(math.sqrt(20000 / 3))
    assert s.ttft.percentiles[90.0] == pytest.approx(280.0)
    assert s.ttft.percentiles[99.0] == pytest.approx(298.0)
    # TPOT only from requests with > 1 output token
    assert s.tpot.count == 2
    assert s.tpot.mean == pytest.approx(75.0)
    assert s.tpot.percentiles[90.0] == pytest.approx(95.0)
    # ITL pooled over requests: 4 x 100 ms + 10 x 50 ms
    assert s.itl.count == 14
    assert s.itl.mean == pytest.approx(900 / 14)
    assert s.itl.median == pytest.approx(50.0)
    assert s.e2el.mean == pytest.approx(500.0)
    assert s.e2el.max == pytest.approx(800.0)


def test_goodput_and_attainment(sample: list[RequestResult]) -> None:
    slo = SLO(ttft_ms=250, tpot_ms=80)
    assert not meets_slo(sample[0], slo)  # TPOT 100 ms > 80
    assert meets_slo(sample[1], slo)  # one token: TPOT passes
    assert not meets_slo(sample[2], slo)  # TTFT 300 ms > 250
    assert not meets_slo(sample[3], slo)  # failed
    s = summarize(sample, 2.0, slo=slo)
    assert s.good_requests == 1
    assert s.request_goodput == pytest.approx(0.5)
    assert s.slo_attainment == pytest.approx(0.25)  # the failure counts against attainment
    assert s.ttft_attainment == pytest.approx(0.5)
    assert s.tpot_attainment == pytest.approx(0.5)
    assert s.slo_met is False
    relaxed = summarize(sample[:3], 2.0, slo=SLO(ttft_ms=1000, tpot_ms=1000, attainment=0.9))
    assert relaxed.slo_attainment == pytest.approx(1.0)
    assert relaxed.slo_met is True


def test_no_slo_means_no_goodput(sample: list[RequestResult]) -> None:
    s = summarize(sample, 2.0)
    assert s.request_goodput is None and s.slo_attainment is None and s.slo_met is None


def test_e2el_slo(sample: list[RequestResult]) -> None:
    s = summarize(sample, 2.0, slo=SLO(e2el_ms=600))
    assert s.good_requests == 2  # 500 and 200 ms; 800 ms misses


def test_warmup_results_are_excluded(sample: list[RequestResult]) -> None:
    warm = ok(99, 5.0, 9.0, 3, [1.0, 1.0], 10)
    warm.warmup = True
    assert summarize([*sample, warm], 2.0) == summarize(sample, 2.0)


def test_rejections_are_failures_and_counted() -> None:
    r = failed(0, "HTTP 503: overloaded")
    r.pd_path = "rejected"
    s = summarize([r, ok(1, 0.1, 0.2, 2, [0.1], 5)], 1.0, slo=SLO(ttft_ms=400))
    assert (s.completed, s.failed, s.rejected) == (1, 1, 1)
    assert s.slo_attainment == pytest.approx(0.5)


def test_empty_run_gives_zeros() -> None:
    s = summarize([], 1.0, slo=SLO(ttft_ms=1))
    assert s.completed == 0 and s.ttft.mean == 0.0 and s.ttft.percentiles[99.0] == 0.0
    assert s.slo_attainment == 0.0 and s.slo_met is False


def test_max_concurrency_and_token_rate() -> None:
    a = ok(0, 0.1, 1.0, 3, [0.1, 0.1], 1, sent=0.0)  # tokens at 0.1, 0.2, 0.3
    b = ok(1, 0.1, 1.0, 2, [0.1], 1, sent=0.5)  # overlaps a; tokens at 0.6, 0.7
    c = ok(2, 0.1, 0.1, 1, [], 1, sent=2.0)  # alone; token at 2.1
    s = summarize([a, b, c], 3.0)
    assert s.max_concurrent_requests == 2
    assert s.max_output_tokens_per_s == 5.0


def test_percentile_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 5, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
        st = stats(values, (90,))
        assert st.std == pytest.approx(float(np.std(values)))


def test_percentile_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_parse_goodput() -> None:
    slo = parse_goodput(["ttft:400", "tpot:40"])
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms) == (400.0, 40.0, None)
    assert parse_goodput(["ttft:300,e2el:2000"]).as_dict() == {"ttft": 300.0, "e2el": 2000.0}
    for bad in (["ttft"], ["foo:1"], ["tpot:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_itl_spikes_use_the_tpot_slo_else_a_multiple_of_the_median() -> None:
    short = ok(0, 0.1, 0.5, 5, [0.02, 0.3, 0.02, 0.02], 10)  # one 300 ms stall
    steady = ok(1, 0.1, 0.3, 5, [0.02, 0.02, 0.02, 0.02], 10)
    long = ok(2, 1.0, 1.2, 3, [0.15, 0.05], 900)
    long.kind = "long"
    s = summarize([short, steady, long], 2.0, slo=SLO(tpot_ms=100))
    # threshold = the TPOT SLO: the 300 ms and the 150 ms gaps, in two requests, out of 10 gaps
    assert (s.itl_spikes.threshold_ms, s.itl_spikes.gaps, s.itl_spikes.requests) == (100, 2, 2)
    assert s.itl_spikes.share == pytest.approx(0.2)
    assert s.spikes_by_kind["random"].gaps == 1 and s.spikes_by_kind["random"].requests == 1
    assert s.spikes_by_kind["long"].gaps == 1
    # no TPOT SLO: 5 x the ITL median (20 ms) = 100 ms, the same two gaps
    plain = summarize([short, steady, long], 2.0)
    assert plain.itl_spikes.threshold_ms == pytest.approx(100.0) and plain.itl_spikes.gaps == 2
