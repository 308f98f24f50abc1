"""Reliability cases G1-G8 and the PD routing corner cases: fallback detection, colocated, xPyD.

Each test names the reliability case (docs/gateway.md, "Reliability cases covered by tests") and the invariants it
checks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from pdctl.config import RateLimitConfig
from tests.conftest import stopped_at_teardown
from tests.fakes.gateway_harness import FakeProc, GatewayThread, make_settings, wait_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


@pytest.fixture
def fakes() -> Iterator[list[FakeProc]]:
    yield from stopped_at_teardown(FakeProc.kill)


def _fake(fakes: list[FakeProc], **spec: object) -> FakeProc:
    f = FakeProc("fake_pd_worker.py", dict(spec))
    fakes.append(f)
    return f


@pytest.fixture
def gateways() -> Iterator[list[GatewayThread]]:
    yield from stopped_at_teardown(GatewayThread.stop)


def _gw(gateways: list[GatewayThread], *args: object, http: str | None = None, **kw: object) -> GatewayThread:
    settings = make_settings(*args, **kw)  # type: ignore[arg-type]
    g = GatewayThread(settings) if http is None else GatewayThread(settings, http=http)
    gateways.append(g)
    return g


OneOfEach = Callable[..., tuple[FakeProc, FakeProc, GatewayThread]]


@pytest.fixture
def one_p_one_d(fakes: list[FakeProc], gateways: list[GatewayThread]) -> OneOfEach:
    """Starts a fake prefill (``p``: its spec), a fake decode (``d``) and a gateway in front of them (the other
    keywords go to the gateway's settings); returns the three."""

    def start(
        p: dict[str, object] | None = None, d: dict[str, object] | None = None, **gateway: object
    ) -> tuple[FakeProc, FakeProc, GatewayThread]:
        prefill, decode = _fake(fakes, **(p or {})), _fake(fakes, **(d or {}))
        return prefill, decode, _gw(gateways, [prefill.url], [decode.url], **gateway)  # type: ignore[arg-type]

    return start


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


#: The disconnect cases run under the gateway's own protocol (its connection tells the request) and under plain
#: uvicorn, where the gateway watches ``receive()`` with a task.
UNDER = pytest.mark.parametrize("http", [None, "httptools"], ids=["gateway-protocol", "asgi-watcher"])


@UNDER
def test_g1_disconnect_mid_stream_aborts_decode(one_p_one_d: OneOfEach, http: str | None) -> None:
    """G1 (N1 cancel, N2, N6): auth and rate limiting on; the fake decode sees the abort."""
    _, d, g = one_p_one_d(d={"chunks": 200, "chunk_delay": 0.1}, http=http, rate_limit=RateLimitConfig(60, 100000, 4))
    with (
        g.client() as c,
        c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 200, "stream": True}) as r,
    ):
        first = next(r.iter_raw())
        assert first.startswith(b"data:")
    # closing the client response closes the socket
    assert wait_for(lambda: any(e["aborted"] for e in d.completions()), timeout=5)
    assert wait_for(lambda: g.app.in_flight == 0 and g.app.limiter.active == 0, timeout=5)
    assert wait_for(lambda: d.metric("num_requests_running") == 0, timeout=5)
    assert g.metric("pdctl_client_cancelled_total", phase="streaming") == 1


@UNDER
def test_g2_disconnect_during_prefill_releases_kv(one_p_one_d: OneOfEach, http: str | None) -> None:
    """G2 (N2, N3): prefill completes, one release leg goes to decode, prefill's held blocks return to 0."""
    p, d, g = one_p_one_d(p={"delay": 1.0, "lease_s": 600}, http=http)
    with g.client(timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "g2req"})
    assert wait_for(lambda: any(e["finished"] for e in p.completions()), timeout=10)
    assert wait_for(lambda: len(d.completions()) == 1, timeout=10)
    [release] = d.completions()
    assert release["headers"]["x-request-id"] == "g2req-release"
    assert release["body"]["max_tokens"] == 1 and release["body"]["stream"] is False
    assert release["body"]["kv_transfer_params"]["remote_request_id"] == "cmpl-g2req-0"
    assert wait_for(lambda: p.metric("held_blocks") == 0, timeout=10)
    assert wait_for(lambda: g.metric("pdctl_kv_release_total", outcome="ok") == 1, timeout=5)
    assert g.metric("pdctl_client_cancelled_total", phase="before_first_byte") == 1
    assert g.app.in_flight == 0


@UNDER
def test_g3_non_stream_disconnect_cancels_decode(one_p_one_d: OneOfEach, http: str | None) -> None:
    """G3 (N2): a non-streaming request is cancelled upstream, not run to completion."""
    _, d, g = one_p_one_d(d={"chunks": 50, "chunk_delay": 0.2}, http=http)
    with g.client(timeout=0.8) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50})
    assert wait_for(lambda: any(e["aborted"] for e in d.completions()), timeout=5)
    assert not any(e["finished"] for e in d.completions())


def test_g4_prefill_reset_retried_once_with_fresh_id(one_p_one_d: OneOfEach) -> None:
    """G4 (N1, N3): one retry with a new request id and fresh kv_transfer_params; success."""
    p, d, g = one_p_one_d(p={"reset_first": 1})
    with g.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "g4req"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "g4req"
    ids = [e["headers"]["x-request-id"] for e in p.completions()]
    assert ids == ["g4req", "g4req-retry1"]
    [leg2] = d.completions()
    assert leg2["headers"]["x-request-id"] == "g4req-retry1"
    assert leg2["body"]["kv_transfer_params"]["remote_request_id"] == "cmpl-g4req-retry1-0"
    assert g.metric("pdctl_retries_total", leg="prefill") == 1


def test_g5_decode_dies_mid_stream(one_p_one_d: OneOfEach) -> None:
    """G5 (N1, N3): 3 chunks, then one SSE error event; no [DONE], no invented finish_reason, no retry."""
    p, _, g = one_p_one_d(d={"chunks": 10, "die_after": 3})
    with (
        g.client() as c,
        c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 10, "stream": True}) as r,
    ):
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    events = _events(raw)
    assert len(events) == 4
    assert all(json.loads(e[6:])["choices"][0]["finish_reason"] is None for e in events[:3])
    err = json.loads(events[3][6:])["error"]
    assert err["code"] == "upstream_error" and set(err) == {"message", "type", "param", "code"}
    assert b"[DONE]" not in raw
    assert len(p.completions()) == 1
    assert g.metric("pdctl_requests_total", path="disagg", status="stream_error") == 1


def test_prefill_crash_is_not_counted_against_decode(one_p_one_d: OneOfEach) -> None:
    """A prefill dies with leg 1 of three requests answered; decode's KV pulls fail (HTTP 500, as vLLM's NIXL
    read from a dead prefill). Those failures are the prefill's: decode's breaker stays closed, prefill is out."""
    _, d, g = one_p_one_d(
        p={"exit_after_replies": 3},
        d={"delay": 0.5, "pull_fail_status": 500},
        breaker_threshold=2,
        health_interval_s=60.0,
    )
    with g.client() as c:
        results: list[tuple[int, str]] = []

        def one() -> None:
            r = c.post("/v1/chat/completions", json=CHAT)
            results.append((r.status_code, r.json()["error"]["code"]))

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Each retry meets the dead prefill (502), or finds it already ejected by the failures counted so far (503):
        # which one depends on how the three requests interleave. Neither is ever blamed on decode.
        assert len(results) == 3, results
        assert all(r in {(502, "prefill_unavailable"), (503, "server_overloaded")} for r in results), results
        assert len(d.completions()) == 3  # every request reached decode, and decode failed each one

        def instances() -> dict[str, dict[str, object]]:
            return {i["name"]: i for i in c.get("/ready").json()["instances"]}

        assert wait_for(lambda: instances()["prefill"]["healthy"] is False, timeout=5)
        time.sleep(0.3)  # let every failure be counted
        state = instances()
        assert state["decode"]["breaker_open"] is False and state["decode"]["healthy"] is True, state


def test_g6_decode_stall_hits_idle_timeout(one_p_one_d: OneOfEach) -> None:
    """G6 (N1, N2): the idle timeout fires, an SSE error is sent and the fake decode sees the abort."""
    _, d, g = one_p_one_d(d={"chunks": 10, "stall_after": 2}, request_timeout_s=1.5)
    with (
        g.client() as c,
        c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 10, "stream": True}) as r,
    ):
        raw = b"".join(r.iter_raw())
    events = _events(raw)
    assert len(events) == 3
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_timeout"
    assert wait_for(lambda: any(e["aborted"] for e in d.completions()), timeout=5)


def test_g7_prefill_errors_bounded_retries(one_p_one_d: OneOfEach) -> None:
    """G7 (N1): P answers 500 x3 then 200: gateway.max_retries (2) retries, then an error; the next succeeds."""
    p, d, g = one_p_one_d(p={"fail_first": 3})
    with g.client() as c:
        r1 = c.post("/v1/chat/completions", json=CHAT)
        assert r1.status_code == 502
        assert r1.json()["error"]["code"] == "prefill_failed"
        assert len(p.completions()) == 3 and len(d.completions()) == 0
        assert g.metric("pdctl_retries_total", leg="prefill") == 2
        r2 = c.post("/v1/chat/completions", json=CHAT)
        assert r2.status_code == 200
        assert len(p.completions()) == 4 and len(d.completions()) == 1


def test_g7_overall_deadline_includes_retries(one_p_one_d: OneOfEach) -> None:
    """G7: a slow prefill uses up the request's deadline; no second attempt past it."""
    p, d, g = one_p_one_d(p={"delay": 3.0}, request_timeout_s=1.0)
    with g.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "prefill_timeout"
    assert len(p.completions()) == 1 and len(d.completions()) == 0


def test_g8_breaker_opens_and_half_open_probe_closes(one_p_one_d: OneOfEach) -> None:
    """G8 (N1): after 5 consecutive P failures requests fail fast (503 + Retry-After) without touching P."""
    p, _, g = one_p_one_d(p={"fail_first": 10**6}, breaker_cooldown_s=1.0, max_retries=1)
    with g.client() as c:
        codes = [c.post("/v1/chat/completions", json=CHAT).status_code for _ in range(3)]
        # the fifth failure (request 3's first attempt) opens the breaker: its retry finds no prefill
        assert codes == [502, 502, 503]
        seen = len(p.completions())
        assert seen == 5
        fast = c.post("/v1/chat/completions", json=CHAT)
        assert fast.status_code == 503 and int(fast.headers["retry-after"]) >= 1
        assert fast.json()["error"]["code"] == "server_overloaded"
        assert len(p.completions()) == seen
        p.control(fail_first=0)
        assert wait_for(lambda: c.post("/v1/chat/completions", json=CHAT).status_code == 200, timeout=10)


@pytest.mark.parametrize(("kv", "reason"), [("missing", "missing"), ("partial", "missing_fields")])
def test_no_silent_fallback(one_p_one_d: OneOfEach, kv: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="pdctl.gateway")
    _, d, g = one_p_one_d(p={"kv": kv})
    with g.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "fbreq"})
    assert r.status_code == 200
    assert r.headers["x-pd-path"] == "fallback"
    assert g.metric("pdctl_pd_fallback_total", reason=reason) == 1
    assert g.metric("pdctl_requests_total", path="fallback", status="200") == 1
    [leg2] = d.completions()
    assert "kv_transfer_params" not in leg2["body"]
    assert any(
        "fbreq" in rec.getMessage() and "fallback" in rec.getMessage()
        for rec in caplog.records
        if rec.levelname == "WARNING"
    )


def test_shared_storage_connector_two_legs(one_p_one_d: OneOfEach) -> None:
    p, d, g = one_p_one_d(p={"kv": "missing"}, connector="ExampleConnector")
    with g.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "same prompt", "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-pd-path"] == "disagg"
    [leg1], [leg2] = p.completions(), d.completions()
    assert leg1["body"]["max_tokens"] == 1 and "kv_transfer_params" not in leg1["body"]
    assert leg2["body"]["prompt"] == "same prompt" and "kv_transfer_params" not in leg2["body"]
    assert g.metric("pdctl_pd_fallback_total") == 0


def test_colocated_whole_request_least_loaded(one_p_one_d: OneOfEach) -> None:
    a, b, g = one_p_one_d(
        p={"chunks": 4, "chunk_delay": 0.3}, d={"chunks": 4, "chunk_delay": 0.3}, strategy="colocated"
    )
    results: list[httpx.Response] = []

    def one() -> None:
        with g.client() as c:
            results.append(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4}))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for n, t in enumerate(threads, 1):
        t.start()  # the second starts once the first is on a worker: least-loaded must pick the other one
        assert wait_for(lambda n=n: len(a.completions()) + len(b.completions()) == n, timeout=10)  # type: ignore[misc]
    for t in threads:
        t.join(30)
    assert [r.status_code for r in results] == [200, 200]
    assert {r.headers["x-pd-path"] for r in results} == {"colocated"}
    assert len(a.completions()) == 1 and len(b.completions()) == 1
    for e in a.completions() + b.completions():
        assert e["body"]["max_tokens"] == 4 and "kv_transfer_params" not in e["body"]


def test_xpyd_least_loaded_and_unhealthy_out(fakes: list[FakeProc], gateways: list[GatewayThread]) -> None:
    # Prefill holds each request 3 s, so all four overlap there even when a loaded machine staggers the
    # threads (at 1 s, one that came more than a second late found a prefill already free again).
    ps = [_fake(fakes, delay=3.0), _fake(fakes, delay=3.0)]
    ds = [_fake(fakes, chunks=5, chunk_delay=0.3), _fake(fakes, chunks=5, chunk_delay=0.3)]
    g = _gw(gateways, [p.url for p in ps], [d.url for d in ds])
    statuses: list[int] = []
    barrier = threading.Barrier(4)

    def together() -> None:
        with g.client() as c:  # the client is built before the barrier: only the requests start together
            barrier.wait(10)
            statuses.append(c.post("/v1/chat/completions", json=CHAT).status_code)

    threads = [threading.Thread(target=together) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert statuses == [200] * 4
    assert [len(p.completions()) for p in ps] == [2, 2]
    assert [len(d.completions()) for d in ds] == [2, 2]
    ps[0].kill()
    with g.client() as c:
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            assert r.headers["x-pd-prefill"] == "prefill-1"
    assert wait_for(lambda: g.metric("pdctl_instance_healthy", instance="prefill-0", role="prefill") == 0)
