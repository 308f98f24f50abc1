"""Smoke run of benchmarks.ci_guard: the gateway-vs-direct ratios get recorded (no timing assertions).

Only generous bounds: every arm streamed without errors and the gateway kept at least 5 % of the direct
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
