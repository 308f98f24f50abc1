"""Smoke runs of the benchmarks: ci_guard records the gateway-vs-direct ratios, slo_whatif scores saved runs,
server_cpu's `floor` arm answers what uvicorn does, and gateway_overhead's summary adds the mean TTFT (no timing
assertions).

ci_guard has only generous bounds: every arm streamed without errors and the gateway kept at least 5 % of the direct
throughput (it keeps 50-100 % on an idle machine; docs/performance.md). The JSON is left in the test's tmp
folder and its ratios are printed, so CI logs carry them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_guard_records_gateway_ratios(tmp_path: Path) -> None:
    out = tmp_path / "ci_guard.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.ci_guard", "--streams", "4", "--seconds", "1.5",
         "--warmup-s", "0.5", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    print(proc.stdout)
    data = json.loads(out.read_text())
    assert set(data["arms"]) == {"direct", "pdctl-colocated", "direct-pd", "pdctl-pd"}
    for arm, a in data["arms"].items():
        assert a["errors_throughput"] == 0 and a["errors_latency"] == 0, (arm, a)
        assert a["chunks_per_s"] > 0 and a["requests"] > 0, (arm, a)
        assert math.isfinite(a["ttft_p50_ms"]) and a["ttft_p50_ms"] > 0, (arm, a)
    for arm in ("pdctl-colocated", "pdctl-pd"):
        assert data["arms"][arm]["proxy_cpu_per_1k_chunks_s"] > 0
        assert data["arms"][arm]["peak_rss_mb"] > 0
    r = data["ratios"]
    assert r["colocated_throughput"] >= 0.05, r
    assert r["pd_throughput"] >= 0.05, r
    assert math.isfinite(r["colocated_added_ttft_p50_ms"]) and math.isfinite(r["pd_added_ttft_p50_ms"])


def test_slo_whatif_scores_saved_runs_with_bench_rule(tmp_path: Path) -> None:
    # two runs of 4 requests: TTFT 0.1 / 0.5 s, TPOT (latency - ttft) / (tokens - 1) = 10 / 50 ms, one failure
    run = {"ttfts": [0.1, 0.1, 0.5, 0.0], "latencies": [0.19, 0.55, 0.59, 0.0], "output_lens": [10, 10, 10, 0],
           "errors": ["", "", "", "HTTP 500"], "duration": 2.0, "completed": 3}  # fmt: skip
    path = tmp_path / "ab.json"
    path.write_text(json.dumps([{**run, "label": "colocated", "request_rate": 2.0}, {**run, "label": "pd"}]))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.slo_whatif", str(path), "--goodput", "ttft:200", "tpot:20",
         "--goodput", "tpot:60"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()
    # ttft<=200 & tpot<=20: only the first request (25 %, 0.5 req/s); tpot<=60: the three that completed
    assert rows[2] == "| colocated | 2/s | 25.0 % / 0.50 | 75.0 % / 1.50 |"
    assert rows[3].startswith("| pd |") and rows[3].endswith("| 25.0 % / 0.50 | 75.0 % / 1.50 |")
    bad = subprocess.run([sys.executable, "-m", "benchmarks.slo_whatif", str(path), "--goodput", "ttfx:1"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert bad.returncode == 2 and "expected KEY:MS" in bad.stderr and "Traceback" not in bad.stderr


def test_ab_summary_tables_read_the_runs_own_numbers(tmp_path: Path) -> None:
    stats = {"p50": 50.0, "p90": 90.0, "p99": 990.0, "max": 1234.0}
    kinds = {"short": {"ttft": stats, "tpot": stats, "itl": stats, "itl_spikes": {"gaps": 3}}, "long": {"ttft": stats}}
    pdctl = {"by_kind": kinds, "paths": {"local": 7, "disagg": 2}, "kv_transfer": {"kv_bytes": 2.5e6},
             "slo_attainment": 0.875}  # fmt: skip
    run = {"label": "adaptive", "request_rate": 4.0, "completed": 9, "request_goodput": 3.5, "median_tpot_ms": 12.0,
           "pdctl": pdctl}  # fmt: skip
    path = tmp_path / "ab.json"
    path.write_text(json.dumps([run]))
    cmd = [sys.executable, "-m", "benchmarks.ab_summary", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2] == (
        "| 4/s | adaptive | 50.0 / 990 | 50.0 / 90.0 / 990 | 1,234 | 3 | 50.0 / 990 | disagg 2, local 7 | 2.5 | "
        "3.50 | 87.5 % |"
    )
    groups = {"1": {"ttft": {"p50": 400.0, "p90": 500.0}}, "2+": {"ttft": {"p50": 40.0, "p90": 60.0}}}
    cache = {"u1": {"name": "prefill", "hit_rate": 0.25}, "u2": {"name": "decode", "hit_rate": 0.8}}
    path.write_text(json.dumps([{**run, "pdctl": {**pdctl, "turn_groups": groups, "prefix_cache": cache}}]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stdout.splitlines()[2] == (
        "| adaptive | 400 / 500 | 40.0 / 60.0 | 12.0 | disagg 2, local 7 | 2.5 | 25 % / 80 % |"
    ), proc.stdout
    bad = subprocess.run(
        [*cmd[:-1], str(tmp_path / "none.json")], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_server_cpu_floor_answers_what_uvicorn_answers(tmp_path: Path) -> None:
    # server_cpu's `floor` arm bounds what a server of pdctl's own could save only if it writes uvicorn's answer
    import httpx

    from benchmarks import _harness as H
    from pdctl.testing import free_port

    answers = {}
    for arm in ("none", "floor"):
        port = free_port()
        proc = H.start(arm, [sys.executable, "-m", "benchmarks.server_cpu", "--serve", arm, str(port)], port,
                       str(tmp_path), cwd=str(ROOT))  # fmt: skip
        try:
            with httpx.Client(base_url=proc.url) as client:
                replies = [client.post("/v1/completions", content=b'{"prompt":"hi"}') for _ in range(2)]
        finally:
            proc.stop()
        answers[arm] = [(r.status_code, r.http_version, sorted(k for k in r.headers if k != "date"),
                         r.headers["transfer-encoding"], r.content) for r in replies]  # fmt: skip
    assert answers["floor"] == answers["none"]
    assert answers["none"][0][4].endswith(b"data: [DONE]\n\n")


def test_gateway_overhead_adds_mean_ttft_where_percentiles_jump_a_step() -> None:
    from benchmarks.gateway_overhead import markdown, summarize

    def level(ttfts: list[float]) -> dict[str, object]:
        return {"1024": {"ttfts_ms": ttfts, "tpots_ms": [320.0], "chunks_per_s": 2600.0, "errors": 0,
                         "requests": len(ttfts), "proxy_cpu_per_1k_chunks_s": None, "client_cpu_util": None}}  # fmt: skip

    # A slow pace puts TTFTs in modes a 320 ms step apart: one request of 100 crossing over moves p50 by a step.
    base = [1200.0] * 50 + [1520.0] * 50
    proxied = [1200.0] * 49 + [1520.0] * 51
    report = {"runs": [{"arm": "direct-pd", "mode": "latency", "round": 0, "levels": level(base)},
                       {"arm": "pdctl-pd", "mode": "latency", "round": 0, "levels": level(proxied)}]}  # fmt: skip
    row = next(r for r in summarize(report)["rows"] if r["arm"] == "pdctl-pd")
    assert row["added_ttft_p50_ms"] == 160.0  # the median of the baseline sits between its two modes
    assert math.isclose(row["added_ttft_mean_ms"], 3.2)
    assert "| added mean ms |" in markdown(summarize(report)) and "| 3.20 |" in markdown(summarize(report))


def test_chaos_counts_what_clients_see_when_a_decode_is_killed(tmp_path: Path) -> None:
    """One SIGKILL of the only decode with two greedy streams in flight, on simulator workers: every stream is
    counted as served (then token-identical to the fault-free answer: the simulator is deterministic) or as a
    client-visible failure, and the supervisor's restart brings both legs back."""
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--cases", "kill-decode", "--decodes", "1", "--repeats", "1",
         "--streams", "2", "--max-tokens", "32", "--settle-s", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["references"] == {"default": 2}
    (run,) = data["runs"]
    assert run["case"] == "kill-decode" and run["target"].startswith("decode")
    assert run["recovery_s"] is not None
    for s in run["streams"]:
        assert (s["status"], s["verdict"]) in (("ok", "identical"),) or s["status"] != "ok", s
    (row,) = data["summary"]
    assert row["client_failures"] == sum(s["status"] != "ok" for s in run["streams"])
    assert row["diverged"] == 0 and row["wrong_length"] == 0
