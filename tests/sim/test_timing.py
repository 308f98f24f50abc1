"""The timing model against bench-anchors.md §5, and the scheduler's batching (no wall clock involved)."""

from __future__ import annotations

import asyncio

import pytest

from pdctl.sim.engine import EngineConfig, SimEngine, SimRequest
from pdctl.sim.logfmt import VllmLog
from pdctl.sim.timing import LINKS, PROFILES, get_link, get_profile

H100 = PROFILES["h100"]


def test_qwen3_8b_shape_matches_anchors() -> None:
    m = H100.model
    assert m.kv_bytes_per_token == 147_456
    assert 2048 * m.kv_bytes_per_token == 301_989_888
    assert m.params_nonemb == pytest.approx(6.95e9, rel=0.01)
    assert m.params_total == pytest.approx(8.19e9, rel=0.01)
    assert m.weight_bytes == pytest.approx(16.4e9, rel=0.01)


def test_h100_prefill_and_decode_times_match_anchors() -> None:
    # Anchors: 2048-token prefill ~60 ms at 50 % MFU; decode step floor 4.9 ms (H100) / 3.4 ms (H200) at 100 % BW.
    assert H100.prefill_s(2048) == pytest.approx(0.060, rel=0.05)
    assert H100.prefill_flops(2048, 0) == pytest.approx(29.7e12, rel=0.03)
    step = H100.decode_step_s(1, 2048)
    assert 0.0049 < step < 0.008
    assert 0.0034 < PROFILES["h200"].decode_step_s(1, 2048) < step
    # Batch 32 × 2048 context reads 9.7 GB of KV on top of the weights: 7.8 ms at 100 % BW.
    assert H100.decode_step_s(32, 2048) == pytest.approx((16.38e9 + 9.66e9) / (3.35e12 * 0.9) + 0.0005, rel=0.02)
    assert PROFILES["a100"].prefill_s(2048) > H100.prefill_s(2048) * 3


@pytest.mark.parametrize(
    ("link", "expected_s"),
    [("tcp-1g", 2.58), ("rdma-100g", 0.024), ("rdma-400g", 0.006), ("nvlink", 0.00067)],
)
def test_kv_transfer_of_2048_tokens(link: str, expected_s: float) -> None:
    t = LINKS[link].transfer_s(2048 * H100.model.kv_bytes_per_token)
    assert t == pytest.approx(expected_s, rel=0.1)


def test_recipe_claim_1gbe_transfer_longer_than_many_decode_steps() -> None:
    t = LINKS["tcp-1g"].transfer_s(2048 * H100.model.kv_bytes_per_token)
    assert t > 100 * H100.decode_step_s(64, 2048)
    assert t > 0.4  # the whole 400 ms TTFT SLO


def test_unknown_names_list_choices() -> None:
    with pytest.raises(ValueError, match="fast, h100, h200, a100"):
        get_profile("tpu")
    with pytest.raises(ValueError, match="tcp-1g"):
        get_link("carrier-pigeon")


def _engine(**kw: object) -> SimEngine:
    cfg = EngineConfig(
        model="m",
        served_model_name="m",
        profile=H100,
        link=LINKS["nvlink"],
        kv_scale=0.001,
        **kw,  # type: ignore[arg-type]
    )
    return SimEngine(cfg, log=VllmLog(level="ERROR"))


def _req(n: int, max_tokens: int = 100) -> SimRequest:
    # Distinct ids per prompt length, so the prefix cache does not share blocks between requests.
    ids = [n * 100_000 + i for i in range(n)]
    return SimRequest(request_id=f"r{n}-{max_tokens}", prompt_ids=ids, max_tokens=max_tokens, temperature=0)


def test_colocated_long_prompt_stretches_the_decode_step() -> None:
    async def run() -> tuple[float, float, int]:
        eng = _engine(max_num_batched_tokens=8192, enable_chunked_prefill=False, max_model_len=8192)
        for i in range(16):
            eng.add(_req(256 + i))
        prefill, decode = eng._schedule()
        eng._apply(prefill, decode)
        prefill, decode = eng._schedule()
        assert not prefill and len(decode) == 16
        quiet = H100.step_s([], [r.prompt_len + len(r.output_ids) for r in decode])
        eng._apply(prefill, decode)
        eng.add(_req(6000))
        prefill, decode = eng._schedule()
        assert [c for _, c in prefill] == [6000] and len(decode) == 16
        mixed = H100.step_s([(c, r.num_computed) for r, c in prefill], [r.prompt_len + 1 for r in decode])
        return quiet, mixed, len(decode)

    quiet, mixed, _ = asyncio.run(run())
    # The 16 streams' next token waits for the whole 6000-token prefill: tens of decode steps in one.
    assert quiet < 0.01
    assert mixed > 0.15
    assert mixed > 20 * quiet


def test_chunked_prefill_splits_by_token_budget_and_seq_limit() -> None:
    async def run() -> list[list[int]]:
        eng = _engine(max_num_batched_tokens=2048, max_num_seqs=3)
        for n, m in ((5000, 100), (100, 100), (100, 101), (100, 102)):
            eng.add(_req(n, m))
        steps = []
        for _ in range(4):
            prefill, decode = eng._schedule()
            steps.append([c for _, c in prefill] + [1] * len(decode))
            eng._apply(prefill, decode)
        return steps

    # 5000 tokens in 2048-token chunks; the short prompts fill the rest of the third step; the fourth
    # prompt waits because max_num_seqs = 3.
    assert asyncio.run(run()) == [[2048], [2048], [904, 100, 100], [1, 1, 1]]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    async def run() -> list[int]:
        eng = _engine(max_num_batched_tokens=8192, enable_chunked_prefill=False, max_model_len=8192)
        eng.add(_req(5000))
        eng.add(_req(5000))
        prefill, _ = eng._schedule()
        return [c for _, c in prefill]

    assert asyncio.run(run()) == [5000]


def test_experiment_colocated_tpot_climbs_while_pd_stays_at_the_step_time() -> None:
    # Virtual time: deterministic, independent of how loaded this machine is.
    from pdctl.sim.experiment import Workload, run_mode

    wl = Workload(streams=8, out_len=64, long_prompt=8000, long_every_s=0.25, duration_s=6.0)
    colo = run_mode("colocated", wl)
    pd = run_mode("pd", wl)
    step = H100.decode_step_s(8, 264)
    assert colo.errors == 0 and pd.errors == 0 and pd.long_ttft_s
    colo_p90, pd_p90 = (m.summary()["tpot_ms"]["p90"] / 1000 for m in (colo, pd))
    assert colo_p90 > 0.1  # hundreds of ms: every step carries an 8000-token prefill
    assert pd_p90 < 1.5 * step
    # The stalled tokens themselves: one whole prefill between two tokens of a running stream.
    assert max(colo.itl_s) > 0.9 * H100.prefill_s(8000)
