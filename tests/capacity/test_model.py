"""The sizing model: its queues, the colocated stall, the verdict, and the inputs it refuses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdctl.capacity import model as m
from pdctl.capacity.profile import (
    DeploymentProfile,
    ProfileError,
    decode_step_s,
    dump,
    load,
    prefill_s,
    prefill_tokens_per_s,
)
from pdctl.sim.timing import get_profile

SLO = m.Slo(0.4, 0.04)
RECIPE = m.Workload(m.parse_histogram("128:0.9 4096:0.1", "isl"), m.parse_histogram("128:0.9 8:0.1", "osl"))


def test_profile_curves_follow_the_points(h100: DeploymentProfile) -> None:
    sp = get_profile("h100")
    assert prefill_s(h100, 2048) == pytest.approx(sp.prefill_s(2048))
    assert prefill_s(h100, 3000) == pytest.approx(sp.prefill_s(3000), rel=0.05)  # between points
    assert decode_step_s(h100, 8, 256) == pytest.approx(sp.decode_step_s(8, 256), rel=0.02)
    assert decode_step_s(h100, 64, 1000) > decode_step_s(h100, 64, 256)  # context costs KV reads
    assert prefill_tokens_per_s(h100) == pytest.approx(8192 / sp.prefill_s(8192))


def test_profile_round_trips_and_bad_files_name_the_field(h100: DeploymentProfile, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(dump(h100))
    assert load(path) == h100
    data = json.loads(path.read_text())
    data["decode"][1]["running"] = "many"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"p\.json: not a pdctl profile: .*\$\.decode\[1\]\.running"):
        load(path)
    data["decode"][1]["running"] = 4
    data["schema_version"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="schema_version 2"):
        load(path)
    path.write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        load(path)


def test_a_profile_whose_prefill_does_not_grow_is_refused_with_its_points(
    h100: DeploymentProfile, tmp_path: Path
) -> None:
    """What a noisy CPU run wrote (64 tokens 39 ms, 512 tokens 24 ms): V_P would divide by zero."""
    data = json.loads(dump(h100))
    data["prefill"] = [dict(data["prefill"][0], prompt_tokens=64, prefill_s=0.039),
                       dict(data["prefill"][1], prompt_tokens=512, prefill_s=0.024)]  # fmt: skip
    path = tmp_path / "noisy.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"noisy\.json: prefill: .*64 tokens 39\.0 ms, 512 tokens 24\.0 ms") as err:
        load(path)
    assert "--repeats" in (err.value.hint or "")


def test_prefill_is_a_queue_of_work(h100: DeploymentProfile) -> None:
    """Doubling the prefill engines halves their utilisation; past V_P the prediction says saturated."""
    one = m.predict_pd(h100, RECIPE, SLO, 20, 1, 2)
    two = m.predict_pd(h100, RECIPE, SLO, 20, 2, 2)
    assert two.prefill_utilization == pytest.approx(one.prefill_utilization / 2)
    assert two.ttft_p90_s <= one.ttft_p90_s
    vp = prefill_tokens_per_s(h100)
    over = m.predict_pd(h100, RECIPE, SLO, 1.05 * vp / RECIPE.isl.mean, 1, 4)
    assert not over.meets and "prefill saturated" in over.reason and math.isinf(over.ttft_p90_s)


def test_decode_slots_bound_the_rate(h100: DeploymentProfile) -> None:
    long_out = m.Workload(m.parse_histogram("128", "isl"), m.parse_histogram("2000", "osl"))
    ok = m.predict_pd(h100, long_out, SLO, 2, 1, 1)
    assert ok.meets and ok.decode_running == pytest.approx(2 * 2000 * ok.tpot_p50_s, rel=0.1)
    full = m.predict_pd(h100, long_out, SLO, 8, 1, 1)  # ~8 × 2000 × 8 ms = 128 streams > 64
    assert not full.meets and "decode saturated" in full.reason


def test_colocated_prefills_stall_decode_and_pd_does_not(h100: DeploymentProfile) -> None:
    long_prompts = m.Workload(m.parse_histogram("200:0.8 8000:0.2", "isl"), m.parse_histogram("128:0.8 8:0.2", "osl"))
    co = m.predict_colocated(h100, long_prompts, SLO, 8, 1)
    pd = m.predict_pd(h100, long_prompts, SLO, 8, 1, 1)
    assert co.tpot_p90_s > 2 * pd.tpot_p90_s
    assert pd.tpot_p90_s < 1.2 * decode_step_s(h100, 64, 8000)


def test_verdict_follows_the_engines_each_shape_needs(h100: DeploymentProfile) -> None:
    easy = m.size_for_rate(h100, RECIPE, SLO, 10)
    assert easy.verdict == "colocated" and easy.chosen.engines == 1 and easy.chosen.meets
    assert easy.capacity_rate > 10 and easy.headroom == pytest.approx(easy.capacity_rate / 10 - 1)
    strict = m.Slo(2.0, 0.008)  # a TPOT only a decode that never prefills meets
    long_prompts = m.Workload(m.parse_histogram("200:0.8 8000:0.2", "isl"), m.parse_histogram("128:0.8 8:0.2", "osl"))
    tight = m.size_for_rate(h100, long_prompts, strict, 6)
    assert tight.verdict == "pd" and tight.chosen.meets, tight.as_dict()
    assert tight.colocated is not None and tight.colocated.engines > 2 * tight.chosen.engines


def test_engines_mode_reports_the_best_split(h100: DeploymentProfile) -> None:
    adv = m.size_for_engines(h100, RECIPE, SLO, 4)
    assert adv.capacity_rate > 0 and adv.pd is not None and adv.pd.engines == 4
    assert adv.chosen.meets
    rate = m.max_rate(h100, RECIPE, SLO, adv.chosen.mode, adv.chosen.prefill, adv.chosen.decode)
    assert rate == pytest.approx(adv.capacity_rate)
    assert not m.predict(h100, RECIPE, SLO, rate * 1.2, adv.chosen.mode, adv.chosen.prefill, adv.chosen.decode).meets


def test_histograms_and_bench_files(tmp_path: Path) -> None:
    h = m.parse_histogram("# prompt lengths\n128:9\n4096:1\n", "isl.txt")
    assert h.mean == pytest.approx(0.9 * 128 + 0.1 * 4096)
    with pytest.raises(m.AdviceError, match=r"isl.txt:2: 'x:1' is not VALUE"):
        m.parse_histogram("1\nx:1", "isl.txt")
    with pytest.raises(m.AdviceError, match=r"--osl:1: '5:-1'"):
        m.parse_histogram("5:-1", "--osl")
    with pytest.raises(m.AdviceError, match="no values"):
        m.parse_histogram("# nothing", "--isl")
    result = {"completed": 3, "input_lens": [100, 100, 300], "output_lens": [10, 0, 30], "request_throughput": 2.5,
              "pdctl": {"prefix_cache": {"u": {"name": "prefill", "hit_rate": 0.25}}}}  # fmt: skip
    wl = m.workload_from_results(result, "r.json")
    assert wl.isl.mean == 200 and wl.osl.mean == 20 and wl.rate == 2.5 and wl.hit_rate == 0.25
    with pytest.raises(m.AdviceError, match=r"r\.json: no input_lens"):
        m.workload_from_results({"completed": 0}, "r.json")


def test_autoscale_plan_thresholds_come_from_the_slo_and_the_profile(h100: DeploymentProfile) -> None:
    low = m.best_pd(h100, RECIPE, SLO, 20)
    high = m.best_pd(h100, RECIPE, SLO, 80)
    plan = m.autoscale_plan(h100, RECIPE, SLO, low, high)
    assert (plan.prefill_min, plan.decode_min) == (low.prefill, low.decode)
    assert plan.prefill_max >= plan.prefill_min and plan.decode_max >= plan.decode_min
    assert high.engines > low.engines
    own = prefill_s(h100, RECIPE.isl.mean)
    assert plan.threshold_s == pytest.approx(0.4 - own - 2.95e-6 * RECIPE.isl.mean - 0.006, abs=0.005)
    assert plan.v_p == prefill_tokens_per_s(h100) and plan.tokens_per_request == RECIPE.isl.mean
    assert plan.streams_per_replica == pytest.approx(0.8 * 64, abs=1)  # h100's steps stay far under 32 ms
    strict = m.autoscale_plan(h100, RECIPE, m.Slo(0.4, 0.0075), low, high)
    assert 1 <= strict.streams_per_replica < plan.streams_per_replica
