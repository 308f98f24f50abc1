"""Adaptive PD's threshold swept on the simulator: ``routing.local_max_uncached_tokens`` against the agent workload.

    .venv/bin/python -m benchmarks.adaptive_sweep                                   # cpu-small, 0..1024, 4 conversations
    .venv/bin/python -m benchmarks.adaptive_sweep --thresholds always,0,256,1024 --conversations 4,8

One prefill and one decode simulator (``python -m pdctl.sim``, NixlConnector, the ``cpu-small`` profile fitted to
vLLM CPU by ``benchmarks/calibrate_sim.py``, ``--sim-speed 1``: real time), the settings of examples/cpu-ab
(``max_model_len`` 8192, ``max_num_seqs`` 16) and vLLM CPU's ``max_num_batched_tokens`` (2048), then per threshold a gateway with ``pd_mode = "adaptive"`` and
that ``local_max_uncached_tokens`` (``always``: ``pd_mode = "always"``, the reference) over the same two workers,
and ``pdctl bench -w agent`` with scripts/ab-demo.sh's agent flags for the small model. Every bench run sends
prompts of its own, so no run finds an earlier run's prompts in a prefix cache.

Per threshold and conversation count: later turns' (2+) TTFT p50 / p90, TPOT p50, paths, KV bytes moved (the
workers' ``vllm:nixl_bytes_transferred``) and SLO attainment under ``--goodput`` (default: the TTFT ≤ 3,480 ms,
TPOT ≤ 46 ms that scripts/ab-demo.sh scaled from the real engines' unloaded latencies on 2026-12-04). Writes
the runs' JSON (``--out``) and prints a Markdown table. Only loopback and free ports.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    Proc,
    fmt,
    md_table,
    run_pdctl_bench,
    start_gateway_with,
    start_nixl_sim,
    stopping,
    write_report,
)
from pdctl.sim.timing import PROFILES
from pdctl.testing import free_port

KEY = "adaptive-sweep-key-not-secret"
MODEL = "small"
# scripts/ab-demo.sh's agent workload for the small model.
AGENT = ["-w", "agent", "--system-len", "500", "--context-len", "1000", "--turns", "4:6", "--user-len", "120:160",
         "--answer-len", "24:32", "--timeout", "600", "--no-progress"]  # fmt: skip


def start_worker(name: str, role: str, log_dir: str, profile: str, speed: float, kv_scale: float) -> Proc:
    flags = ["--sim-profile", profile, "--sim-speed", repr(speed), "--sim-kv-scale", repr(kv_scale),
             "--max-model-len", "8192", "--max-num-seqs", "16", "--max-num-batched-tokens", "2048"]  # fmt: skip
    return start_nixl_sim(name, role, log_dir, MODEL, flags)


def start_gateway(name: str, log_dir: str, prefill: str, decode: str, threshold: str) -> Proc:
    port = free_port()
    routing: dict[str, Any] = {"prefill_endpoint": prefill, "decode_endpoint": decode, "strategy": "pd_disagg",
                               "kv_connector": "NixlConnector"}  # fmt: skip
    if threshold == "always":
        routing["pd_mode"] = "always"
    else:
        routing.update(pd_mode="adaptive", local_max_uncached_tokens=int(threshold))
    settings = {
        "gateway": {"listen": f"127.0.0.1:{port}", "api_key_env": "PDCTL_API_KEY", "request_timeout_s": 600},
        "routing": routing,
        "slo": {"ttft_ms": 60000, "tpot_ms": 10000, "p90": True, "admission": False},
        "logging": {"level": "warning"},
    }
    return start_gateway_with(name, log_dir, port, settings, KEY)


def bench(gateway: str, workers: Sequence[Proc], conversations: int, goodput: Sequence[str], out: Path,
          seed: int) -> dict[str, Any]:  # fmt: skip
    flags = ["--gateway", gateway, "--model", MODEL, *AGENT, "--conversations", str(conversations),
             "--seed", str(seed), "--goodput", *goodput]  # fmt: skip
    for w in workers:
        flags += ["--metrics-url", f"{w.url}/metrics"]
    return run_pdctl_bench(flags, KEY, out, timeout_s=1200)


def row(threshold: str, conversations: int, run: dict[str, Any]) -> dict[str, Any]:
    """The sweep's numbers of one run."""
    pd = run["pdctl"]
    later = pd.get("turn_groups", {}).get("2+", {})
    ttft = later.get("ttft", {})
    tpot = later.get("tpot", {})
    return {
        "threshold": threshold,
        "conversations": conversations,
        "requests": run["completed"],
        "failed": run["failed"],
        "later_ttft_p50_ms": ttft.get("p50"),
        "later_ttft_p90_ms": ttft.get("p90"),
        "later_tpot_p50_ms": tpot.get("p50"),
        "tpot_p50_ms": run.get("median_tpot_ms"),
        "paths": pd.get("paths", {}),
        "kv_bytes": pd.get("kv_transfer", {}).get("kv_bytes", 0),
        "kv_transfers": pd.get("kv_transfer", {}).get("kv_transfers", 0),
        "slo_attainment": pd.get("slo_attainment"),
    }


def markdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    columns = ("conversations", "local_max_uncached_tokens", "turns 2+ TTFT p50 / p90 (ms)",
               "TPOT p50 (ms): all / turns 2+", "paths", "KV moved (MB / transfers)", "SLO attainment")  # fmt: skip

    def cells(r: dict[str, Any]) -> list[str]:
        att = "-" if r["slo_attainment"] is None else f"{100 * r['slo_attainment']:.1f} %"
        return [str(r["conversations"]), str(r["threshold"]),
                f"{fmt(r['later_ttft_p50_ms'], 0, grouped=True)} / {fmt(r['later_ttft_p90_ms'], 0, grouped=True)}",
                f"{fmt(r['tpot_p50_ms'], 1, grouped=True)} / {fmt(r['later_tpot_p50_ms'], 1, grouped=True)}",
                ", ".join(f"{k} {v}" for k, v in sorted(r["paths"].items())),
                f"{r['kv_bytes'] / 1e6:.1f} / {r['kv_transfers']}", att]  # fmt: skip

    return md_table(columns, "rlllllr", (cells(r) for r in rows))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--thresholds", default="always,0,128,256,512,1024",
                   help="local_max_uncached_tokens values; `always`: pd_mode always (the reference)")  # fmt: skip
    p.add_argument("--conversations", default="4", help="conversation counts, e.g. 4,8")
    p.add_argument("--profile", default="cpu-small", choices=sorted(PROFILES), help="the simulator's profile")
    p.add_argument("--speed", type=float, default=1.0, help="--sim-speed (1: real time)")
    p.add_argument("--kv-scale", type=float, default=1.0, help="--sim-kv-scale")
    p.add_argument("--goodput", nargs="+", default=["ttft:3480", "tpot:46"], help="SLOs as pdctl bench takes them")
    p.add_argument("--seed", type=int, default=0, help="workload seed (the same conversations at every threshold)")
    p.add_argument("--out", default="benchmarks/results/adaptive_sweep.json", help="the report (JSON)")
    args = p.parse_args(argv)
    thresholds = [t.strip() for t in args.thresholds.split(",") if t.strip()]
    for t in thresholds:
        if t != "always" and not t.isdigit():
            p.error(f"--thresholds: expected `always` or integers >= 0, got {t!r}")
    counts = [int(c) for c in args.conversations.split(",") if c.strip()]

    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="adaptive-sweep-") as tmp, stopping() as procs:
        prefill = start_worker("prefill", "kv_both", tmp, args.profile, args.speed, args.kv_scale)
        procs.append(prefill)
        decode = start_worker("decode", "kv_both", tmp, args.profile, args.speed, args.kv_scale)
        procs.append(decode)
        for n in counts:
            for t in thresholds:
                gw = start_gateway(f"gw-{t}-{n}", tmp, prefill.url, decode.url, t)
                try:
                    run = bench(gw.url, (prefill, decode), n, args.goodput, Path(tmp) / f"{t}-{n}.json", args.seed)
                finally:
                    gw.stop()
                run["label"] = f"{t} x{n}"
                runs.append(run)
                rows.append(row(t, n, run))
                print("\n".join(markdown(rows[-1:])[2:]), flush=True)
    fields = {"profile": args.profile, "speed": args.speed, "goodput": args.goodput, "rows": rows, "runs": runs}
    out = write_report(args.out, "benchmarks.adaptive_sweep", argv, started, fields)
    print(f"\n{args.profile}, --sim-speed {args.speed:g}, SLO {' '.join(args.goodput)}:\n")
    print("\n".join(markdown(rows)))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
