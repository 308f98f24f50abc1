"""The SLO autopilot against the fixed configurations on the simulator: ``auto``, always-PD, adaptive, colocated.

    .venv/bin/python -m benchmarks.autopilot_sides                                # h100, 1P1D, rates 1,2,4
    .venv/bin/python -m benchmarks.autopilot_sides --rates 1,2,4 -n 40 --slo 2000,80 --speed 0.1

One prefill (``kv_producer``) and one decode (``kv_consumer``) simulator (``python -m pdctl.sim``, NixlConnector,
the ``h100`` profile, ``--sim-speed`` 0.1 by default: every simulated time ×10 in wall time, so the two-core
machine's HTTP overhead stays small beside it), then per side a gateway over the same two workers:

* ``always``: ``pd_mode = "always"`` (every request on both legs);
* ``adaptive``: ``pd_mode = "adaptive"`` with its defaults (up to 512 uncached tokens on the decode alone);
* ``colocated``: ``strategy = "colocated"`` (whole requests on either engine, least loaded);
* ``auto``: ``pd_mode = "auto"``, whose ``slo`` is the benchmark's pair (the other sides ignore it).

and ``pdctl bench -w mixed`` (the recipe's mix: 128-token chats, one in ten a 4,096-token prompt) at each rate, the
sides interleaved per rate. Reports, per rate and side, SLO attainment under ``--goodput`` (the ``--slo`` pair, in
wall milliseconds), TTFT and TPOT p50 / p90 and the paths taken. Writes the runs' JSON (``--out``) and prints a
Markdown table. Only loopback and free ports.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import Proc, fmt, run_pdctl_bench, start_gateway_with, start_nixl_sim, stopping, write_report
from pdctl.testing import free_port

KEY = "autopilot-sides-key-not-secret"
MODEL = "Qwen/Qwen3-8B"
SIDES = ("always", "adaptive", "colocated", "auto")
MIXED = ["-w", "mixed", "--timeout", "600", "--no-progress"]


def start_worker(name: str, role: str, log_dir: str, speed: float) -> Proc:
    flags = ["--sim-profile", "h100", "--sim-speed", repr(speed), "--max-model-len", "8192", "--max-num-seqs", "128",
             "--max-num-batched-tokens", "2048"]  # fmt: skip
    return start_nixl_sim(name, role, log_dir, MODEL, flags)


def start_gateway(name: str, log_dir: str, prefill: str, decode: str, side: str, slo: tuple[float, float]) -> Proc:
    port = free_port()
    routing: dict[str, Any] = {"prefill_endpoint": prefill, "decode_endpoint": decode, "strategy": "pd_disagg",
                               "kv_connector": "NixlConnector"}  # fmt: skip
    if side == "colocated":
        routing["strategy"] = "colocated"
    else:
        routing["pd_mode"] = side
    settings = {
        "gateway": {"listen": f"127.0.0.1:{port}", "api_key_env": "PDCTL_API_KEY", "request_timeout_s": 600},
        "routing": routing,
        "slo": {"ttft_ms": slo[0], "tpot_ms": slo[1], "p90": False, "admission": False},
        "logging": {"level": "warning"},
    }
    return start_gateway_with(name, log_dir, port, settings, KEY)


def bench(gateway: str, rate: float, n: int, goodput: Sequence[str], out: Path, seed: int) -> dict[str, Any]:
    flags = ["--gateway", gateway, "--model", MODEL, *MIXED, "--rate", repr(rate), "-n", str(n), "--seed", str(seed),
             "--goodput", *goodput]  # fmt: skip
    return run_pdctl_bench(flags, KEY, out, timeout_s=1800)


def row(side: str, rate: float, run: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one run."""
    pd = run.get("pdctl", {})
    return {
        "side": side,
        "rate": rate,
        "requests": run["completed"],
        "failed": run["failed"],
        "ttft_p50_ms": run.get("median_ttft_ms"),
        "ttft_p90_ms": run.get("p90_ttft_ms"),
        "tpot_p50_ms": run.get("median_tpot_ms"),
        "tpot_p90_ms": run.get("p90_tpot_ms"),
        "paths": pd.get("paths", {}),
        "slo_attainment": pd.get("slo_attainment"),
    }


def markdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| req/s | side | SLO attainment | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | paths | failed |",
        "|---:|---|---:|---|---|---|---:|",
    ]
    for r in rows:
        paths = ", ".join(f"{k} {v}" for k, v in sorted(r["paths"].items()))
        att = "-" if r["slo_attainment"] is None else f"{100 * r['slo_attainment']:.1f} %"
        lines.append(
            f"| {r['rate']:g} | {r['side']} | {att} | {fmt(r['ttft_p50_ms'], 0, grouped=True)} / {fmt(r['ttft_p90_ms'], 0, grouped=True)} | "
            f"{fmt(r['tpot_p50_ms'], 1, grouped=True)} / {fmt(r['tpot_p90_ms'], 1, grouped=True)} | {paths} | {r['failed']} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1,2,4", help="request rates (req/s, wall time)")
    p.add_argument("-n", "--requests", type=int, default=40, help="requests per run")
    p.add_argument("--sides", default=",".join(SIDES), help="sides, in the order run at each rate")
    p.add_argument("--slo", default="2000,80", help="TTFT,TPOT in wall ms: auto's slo and the bench's --goodput")
    p.add_argument("--speed", type=float, default=0.1, help="--sim-speed (0.1: ten times slower than real time)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (the same requests on every side)")
    p.add_argument("--out", default="benchmarks/results/autopilot_sides.json", help="the report (JSON)")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    for s in sides:
        if s not in SIDES:
            p.error(f"--sides: expected some of {', '.join(SIDES)}, got {s!r}")
    ttft, tpot = (float(x) for x in args.slo.split(","))
    goodput = [f"ttft:{ttft:g}", f"tpot:{tpot:g}"]

    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="autopilot-sides-") as tmp, stopping() as procs:
        prefill = start_worker("prefill", "kv_producer", tmp, args.speed)
        procs.append(prefill)
        decode = start_worker("decode", "kv_consumer", tmp, args.speed)
        procs.append(decode)
        for rate in rates:
            for side in sides:
                gw = start_gateway(f"gw-{side}-{rate:g}", tmp, prefill.url, decode.url, side, (ttft, tpot))
                try:
                    run = bench(gw.url, rate, args.requests, goodput, Path(tmp) / f"{side}-{rate:g}.json",
                                args.seed)  # fmt: skip
                finally:
                    gw.stop()
                run["label"] = f"{side} @{rate:g}"
                runs.append(run)
                rows.append(row(side, rate, run))
                print("\n".join(markdown(rows[-1:])[2:]), flush=True)
    fields = {"speed": args.speed, "goodput": goodput, "rows": rows, "runs": runs}
    out = write_report(args.out, "benchmarks.autopilot_sides", argv, started, fields)
    print(f"\nh100 1P1D, --sim-speed {args.speed:g}, SLO {' '.join(goodput)} (wall ms):\n")
    print("\n".join(markdown(rows)))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
