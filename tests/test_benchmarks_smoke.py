"""Smoke runs of the benchmarks: ci_guard records the gateway-vs-direct ratios, slo_whatif scores saved runs, and
server_cpu's `floor` arm answers what uvicorn does (no timing assertions).

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
