"""A short gateway-vs-direct run for CI: records ratios to a JSON file, never fails on absolute times.

Simulator workers in fast mode; for each arm (``direct`` and ``pdctl-colocated`` against the decode worker,
``direct-pd`` and ``pdctl-pd`` over both legs) one throughput window (workers unpaced) and one latency window
(workers pacing tokens at ``--tpot-ms``). Written: chunks/s, TTFT p50/p99, the gateway's CPU per 1k chunks,
and the ratios gateway/direct (throughput) and gateway - direct (TTFT). The whole run takes well under 60 s
with the defaults; ``tests/test_benchmarks_smoke.py`` runs it with smaller ones and checks only that the
numbers exist and the throughput ratio clears a generous bound.

    .venv/bin/python -m benchmarks.ci_guard [--streams 16] [--seconds 3] [--out benchmarks/results/ci_guard.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _harness as H
from benchmarks import gateway_overhead as G

ARMS = ("direct", "pdctl-colocated", "direct-pd", "pdctl-pd")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3.0, help="measurement window per arm and mode")
    ap.add_argument("--warmup-s", type=float, default=0.5)
    ap.add_argument("--tpot-ms", type=float, default=20.0)
    ap.add_argument("--out", default=str(G.BENCH / "results" / "ci_guard.json"))
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    result: dict[str, Any] = {"machine": H.machine(), "streams": args.streams, "seconds": args.seconds, "arms": {}}
    opts = argparse.Namespace(warmup_s=args.warmup_s, measure_s=args.seconds)
    with tempfile.TemporaryDirectory(prefix="pdbench-ci-") as logs:
        for mode, speed in (("throughput", 1000.0), ("latency", 0.2 / args.tpot_ms)):
            s = G.Setup(H.start_sim(f"prefill-{mode}", "kv_producer", logs, speed),
                        H.start_sim(f"decode-{mode}", "kv_consumer", logs, speed), logs)  # fmt: skip
            try:
                for arm in ARMS:
                    for _attempt in range(3):
                        r = G.measure(arm, s, mode, [args.streams], opts, seed=0)
                        lvl = r["levels"][str(args.streams)]
                        # On a machine loaded by other work a whole short window can pass without one chunk
                        # (seen at load averages above 10): measure that arm again rather than record a 0.
                        if lvl["chunks"] > 0 and lvl["requests"] > 0:
                            break
                        result.setdefault("retried", []).append(f"{mode}/{arm}")
                    entry = result["arms"].setdefault(arm, {})
                    if mode == "throughput":
                        entry.update(chunks_per_s=lvl["chunks_per_s"], errors_throughput=lvl["errors"],
                                     proxy_cpu_per_1k_chunks_s=lvl["proxy_cpu_per_1k_chunks_s"],
                                     peak_rss_mb=r.get("peak_rss_mb"))  # fmt: skip
                    else:
                        entry.update(ttft_p50_ms=lvl["ttft_p50_ms"], ttft_p99_ms=lvl["ttft_p99_ms"],
                                     requests=lvl["requests"], errors_latency=lvl["errors"])  # fmt: skip
            finally:
                s.prefill.stop()
                s.decode.stop()
    a = result["arms"]

    def ratio(x: float, y: float) -> float | None:
        return x / y if y else None

    result["ratios"] = {
        "colocated_throughput": ratio(a["pdctl-colocated"]["chunks_per_s"], a["direct"]["chunks_per_s"]),
        "pd_throughput": ratio(a["pdctl-pd"]["chunks_per_s"], a["direct-pd"]["chunks_per_s"]),
        "colocated_added_ttft_p50_ms": a["pdctl-colocated"]["ttft_p50_ms"] - a["direct"]["ttft_p50_ms"],
        "pd_added_ttft_p50_ms": a["pdctl-pd"]["ttft_p50_ms"] - a["direct-pd"]["ttft_p50_ms"],
    }
    result["wall_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["ratios"]))
    print(f"wrote {args.out} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
