"""`pdctl profile` through a simulated 1P1D behind the gateway, then `pdctl advise` on the profile it wrote.

The simulator (h100 profile, slowed 4x) waits its timing model's steps and the probes measure at least that wait,
so the profile's points are bounded below by the model (no upper bound: a loaded 2-core machine adds time)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pdctl.capacity.profile import load
from pdctl.sim.timing import get_profile
from pdctl.testing import SimProcess
from tests.bench.test_on_sim import KEY, gateway, sims

__all__ = ["gateway", "sims"]  # the fixtures this module borrows

SLOW = ["--sim-profile", "h100", "--sim-speed", "0.25", "--sim-kv-scale", "0.001"]


def test_profile_then_advise_then_write(
    sims: Callable[..., SimProcess], gateway: Callable[..., str], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    p = sims(SLOW, "prefill", connector="NixlConnector")
    d = sims(SLOW, "decode", connector="NixlConnector")
    url = gateway(p.url, d.url)
    # Traffic before the profile: one prompt twice, so the prefill's prefix cache hits on the second.
    prompt = "The same long context for every question. " * 60
    for _ in range(2):
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60, trust_env=False)  # fmt: skip
        assert r.status_code == 200, r.text
    out = tmp_path / "profile.json"
    result = cli(
        "profile", "--gateway", url, "-c", str(tmp_path / "none.toml"), "-s", str(tmp_path / "gw.json"),
        "-o", str(out), "--prompt-lens", "256,2048", "--repeats", "2", "--running", "1,4", "--contexts", "256",
        "--output-len", "12", env={"BENCH_TEST_KEY": KEY},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    prof = load(out)
    model = get_profile("h100")
    assert 1900 <= prof.prefill[1].prompt_tokens <= 2200  # the server's own count of the probe
    long = prof.prefill[1]
    assert long.prefill_s >= 0.8 * model.prefill_s(long.prompt_tokens) / 0.25, prof.prefill
    assert long.ttft_s > long.prefill_s
    one = next(pt for pt in prof.decode if pt.running == 1)
    assert one.step_s >= 0.85 * model.decode_step_s(1, one.context_tokens) / 0.25, prof.decode
    assert prof.prefill_s_per_token > 0 and prof.model == "tiny"
    # counted before the probes: the second request's hits on the prefill, no request served on decode alone
    assert prof.prefix_cache_hit_rate is not None and 0.3 < prof.prefix_cache_hit_rate < 0.6, prof
    assert prof.local_share == 0.0

    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"slo": {"ttft_ms": 4000, "tpot_ms": 400, "p90": True}}))
    result = cli("advise", str(out), "-s", str(settings), "--isl", "128:0.9,2048:0.1", "--osl", "64", "--rate", "2",
                 "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    advice = json.loads(result.stdout)
    assert advice["verdict"] in ("pd", "colocated") and advice["predicted"]["meets_slo"]
    assert advice["capacity_rate"] > 2 and advice["slo"]["ttft_ms"] == 4000
    assert "hit rate" in result.stderr and "from the profile" in result.stderr

    config = tmp_path / "config.toml"
    config.write_text("# mine\n[prefill]\nmodel = 'm'  # keep\n\n[decode]\nmodel = 'm'\n")
    result = cli("advise", str(out), "-s", str(settings), "--isl", "128", "--osl", "64", "--engines", "4", "--pd",
                 "--write", str(config))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "verdict: P/D" in result.output
    text = config.read_text()
    assert "# mine" in text and "# keep" in text
    prefill_n = int(text.split("[prefill]")[1].split("replicas = ")[1].split()[0])
    decode_n = int(text.split("[decode]")[1].split("replicas = ")[1].split()[0])
    assert prefill_n + decode_n == 4


def test_advise_errors_are_one_line(tmp_path: Path, cli: Callable[..., Any]) -> None:
    bad = tmp_path / "p.json"
    bad.write_text('{"source": 1}')
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"slo": {"ttft_ms": 400, "tpot_ms": 40}}))
    result = cli("advise", str(bad), "-s", str(settings), "--isl", "128", "--osl", "8", "--rate", "1")
    assert result.exit_code == 1 and "p.json: not a pdctl profile" in result.output
    assert "Traceback" not in result.output
