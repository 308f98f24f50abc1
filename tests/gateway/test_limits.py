"""Rate limits (G9, X7), the SLO predictor and early rejection (G10), overflow to upstream."""

from __future__ import annotations

import threading

import httpx
import pytest

from pdctl.config import RateLimitConfig, SLOConfig
from pdctl.gateway.admission import Admission
from pdctl.gateway.errors import ApiError
from pdctl.gateway.ratelimit import RateLimiter
from tests.fakes.gateway_harness import UPSTREAM_KEY, FakeProc, GatewayThread, make_settings, wait_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_rejection_by_one_limit_consumes_no_other() -> None:
    clock = Clock()
    rl = RateLimiter(RateLimitConfig(requests_per_minute=3, tokens_per_minute=100, max_concurrency=1), clock)
    rl.acquire(10)
    for _ in range(5):
        with pytest.raises(ApiError) as exc:
            rl.acquire(10)
        assert exc.value.reason == "max_concurrency"
    rl.release()
    # the five refusals charged neither requests nor tokens
    rl.acquire(10)
    rl.release()
    rl.acquire(10)
    rl.release()
    with pytest.raises(ApiError) as exc:
        rl.acquire(10)
    assert exc.value.reason == "requests_per_minute" and exc.value.status == 429
    retry = dict(exc.value.headers())[b"retry-after"]
    assert retry == b"60"
    clock.t += 61
    rl.acquire(95)
    rl.release()
    with pytest.raises(ApiError) as exc:
        rl.acquire(10)
    assert exc.value.reason == "tokens_per_minute"
    with pytest.raises(ApiError) as exc:
        rl.acquire(500)
    assert exc.value.should_retry is False


def test_admission_predictor() -> None:
    adm = Admission(SLOConfig(ttft_ms=400, tpot_ms=40, p90=False))
    assert adm.decide(1000, 10, 1).reason == "cold"
    adm.observe_prefill(0.1, 1000, 0)  # 0.1 ms per token
    adm.observe_handoff(0.05)
    ok = adm.decide(500, 500, 1)
    assert ok.admit and ok.ttft_s == pytest.approx(0.15)
    late = adm.decide(1000, 3000, 1)  # 4000 tokens ahead+own -> 0.45 s > 0.4 s
    assert not late.admit and late.reason == "ttft" and late.retry_after_s >= 1
    # an idle deployment always admits (keeps measuring; nothing to relieve)
    assert adm.decide(100_000, 0, 0).reason == "idle"
    adm.observe_itl(0.010, 1)
    adm.observe_itl(0.030, 11)
    assert adm.predict_tpot(21) == pytest.approx(0.050)
    assert adm.decide(10, 0, 20).reason == "tpot"
    assert adm.decide(10, 0, 3).admit
    p90 = Admission(SLOConfig(p90=True))
    for x in (0.1, 0.3, 0.1, 0.3):
        p90.observe_handoff(x)
    assert p90.handoff.value(True) > p90.handoff.value(False)  # type: ignore[operator]


def test_g9_concurrency_cap_burst(procs: tuple) -> None:
    fakes, gws = procs
    p = FakeProc("fake_pd_worker.py", {})
    d = FakeProc("fake_pd_worker.py", {"chunks": 5, "chunk_delay": 0.3})
    fakes += [p, d]
    g = GatewayThread(make_settings([p.url], [d.url], rate_limit=RateLimitConfig(max_concurrency=2)))
    gws.append(g)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        with g.client() as c:
            r = c.post("/v1/chat/completions", json=CHAT)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ok = [r for r in results if r.status_code == 200]
    limited = [r for r in results if r.status_code == 429]
    assert len(ok) + len(limited) == 12
    assert 2 <= len(ok) < 12
    for r in limited:
        assert r.headers["retry-after"].isdigit()
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(d.completions()) == len(ok)
    assert g.metric("pdctl_rejected_total", reason="max_concurrency") == len(limited)


def test_x7_requests_per_minute(procs: tuple) -> None:
    fakes, gws = procs
    w = FakeProc("fake_pd_worker.py", {})
    fakes.append(w)
    g = GatewayThread(make_settings([w.url], [w.url], rate_limit=RateLimitConfig(requests_per_minute=5)))
    gws.append(g)
    with g.client() as c:
        codes = [c.post("/v1/chat/completions", json=CHAT) for _ in range(10)]
    assert [r.status_code for r in codes] == [200] * 5 + [429] * 5
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in codes[5:])


def _slo_gateway(procs: tuple, **kw: object) -> tuple[FakeProc, FakeProc, GatewayThread]:
    fakes, gws = procs
    p = FakeProc("fake_pd_worker.py", {"delay": 0.5})
    d = FakeProc("fake_pd_worker.py", {})
    fakes += [p, d]
    g = GatewayThread(
        make_settings([p.url], [d.url], slo=SLOConfig(ttft_ms=100, tpot_ms=1000, p90=False), **kw),
        upstream_key=UPSTREAM_KEY,
    )
    gws.append(g)
    return p, d, g


def _in_background(g: GatewayThread) -> threading.Thread:
    def run() -> None:
        with g.client() as c:
            c.post("/v1/chat/completions", json=CHAT)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_g10_slo_early_rejection(procs: tuple) -> None:
    p, d, g = _slo_gateway(procs)
    with g.client() as c:
        first = c.post("/v1/chat/completions", json=CHAT)  # cold start: admitted, measured
        assert first.status_code == 200
        busy = _in_background(g)  # idle deployment: admitted; now prefill has work queued
        assert wait_for(lambda: len(p.completions()) == 2)
        r = c.post("/v1/chat/completions", json=CHAT)
        busy.join(30)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "server_overloaded" and "time to first token" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-should-retry"] == "false"
    assert len(p.completions()) == 2 and len(d.completions()) == 2
    assert g.metric("pdctl_rejected_total", reason="slo_ttft") == 1
    assert g.metric("pdctl_requests_total", path="rejected", status="503") == 1


def test_slo_overflow_to_upstream(procs: tuple) -> None:
    fakes, gws = procs
    up = FakeProc("fake_upstream.py", {"models": []})
    pf = FakeProc("fake_pd_worker.py", {"delay": 0.5})
    df = FakeProc("fake_pd_worker.py", {})
    fakes += [up, pf, df]
    settings = make_settings(
        [pf.url], [df.url], upstream=up.url, slo=SLOConfig(ttft_ms=100, tpot_ms=1000, p90=False, overflow="upstream")
    )
    g = GatewayThread(settings, upstream_key=UPSTREAM_KEY)
    gws.append(g)
    with g.client() as c:
        assert c.post("/v1/chat/completions", json=CHAT).headers["x-pd-path"] == "disagg"
        busy = _in_background(g)
        assert wait_for(lambda: len(pf.completions()) == 2)
        r = c.post("/v1/chat/completions", json=CHAT)
        busy.join(30)
    assert r.status_code == 200 and r.headers["x-pd-path"] == "upstream"
    assert len(pf.completions()) == 2
    assert [e["body"]["model"] for e in up.log() if e["path"].endswith("completions")] == ["tiny"]
    assert g.metric("pdctl_rejected_total", reason="slo_ttft_overflow") == 1
