"""The Markdown tables of docs/bench.md's real A/Bs, from the files `scripts/ab-demo.sh` writes.

    python -m benchmarks.ab_summary results/ab-DATE/ab.json              # the mixed workload, per rate and side
    python -m benchmarks.ab_summary results/ab-DATE/agent-4.json         # the agent workload: turn 1 against 2+

Mixed: per rate and side, the short requests' TTFT and TPOT percentiles, their longest gap between two tokens
and its gaps over the TPOT SLO, the long prompts' TTFT, the paths taken, KV moved, goodput and SLO attainment at the
run's own SLOs. Agent: per side, TTFT p50 / p90 of turn 1 and of turns 2+, TPOT p50, the paths, KV moved and each
engine's prefix-cache hit rate. Both: for a side run with ``routing.prefix_view = "exact"`` (``ab-demo.sh --exact``),
a line of the views' drift: the prompt tokens each view counted as cached on the decodes chosen, and the decisions
the approximate view would have made the other way. Numbers are the runs' own (``pdctl bench``'s JSON); nothing is
recomputed but those ratios.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pdctl.bench.report import ReportError, load_results


def _ms(stats: Mapping[str, Any] | None, key: str) -> str:
    value = (stats or {}).get(key)
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _paths(run: Mapping[str, Any]) -> str:
    paths = run["pdctl"].get("paths") or {}
    return ", ".join(f"{k} {v}" for k, v in sorted(paths.items()))


def _kv_mb(run: Mapping[str, Any]) -> str:
    kv = run["pdctl"].get("kv_transfer") or {}
    return f"{kv.get('kv_bytes', 0) / 1e6:.1f}"


def mixed_rows(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [
        "| rate | side | short TTFT p50 / p99 | short TPOT p50 / p90 / p99 | short gap max | short gaps > TPOT SLO "
        "| long TTFT p50 / p99 "
        "| paths | KV MB | goodput (req/s) | SLO attainment |",
        "|---:|---|---|---|---:|---:|---|---|---:|---:|---:|",
    ]
    for run in runs:
        kinds = run["pdctl"]["by_kind"]
        short, long = kinds.get("short", {}), kinds.get("long", {})
        st, sp, lt = short.get("ttft"), short.get("tpot"), long.get("ttft")
        out.append(
            f"| {run['request_rate']:g}/s | {run['label']} | {_ms(st, 'p50')} / {_ms(st, 'p99')} | "
            f"{_ms(sp, 'p50')} / {_ms(sp, 'p90')} / {_ms(sp, 'p99')} | {_ms(short.get('itl'), 'max')} | "
            f"{(short.get('itl_spikes') or {}).get('gaps', 0)} | "
            f"{_ms(lt, 'p50')} / {_ms(lt, 'p99')} | {_paths(run)} | {_kv_mb(run)} | "
            f"{run.get('request_goodput') or 0:.2f} | {100 * (run['pdctl'].get('slo_attainment') or 0):.1f} % |"
        )
    return out


def agent_rows(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [
        "| side | turn 1 TTFT p50 / p90 | turns 2+ TTFT p50 / p90 | TPOT p50 | paths | KV MB | prefix-cache hits "
        "prefill / decode |",
        "|---|---|---|---:|---|---:|---|",
    ]
    for run in runs:
        groups = run["pdctl"].get("turn_groups") or {}
        first, later = (groups.get(k, {}).get("ttft") for k in ("1", "2+"))
        hits = {e.get("name"): e.get("hit_rate") for e in (run["pdctl"].get("prefix_cache") or {}).values()}
        rates = " / ".join(f"{100 * hits[n]:.0f} %" if hits.get(n) is not None else "-" for n in ("prefill", "decode"))
        out.append(
            f"| {run['label']} | {_ms(first, 'p50')} / {_ms(first, 'p90')} | {_ms(later, 'p50')} / "
            f"{_ms(later, 'p90')} | {run.get('median_tpot_ms') or 0:.1f} | {_paths(run)} | {_kv_mb(run)} | {rates} |"
        )
    return out


def drift_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per run whose gateway judged by the exact view: the two views' cached tokens and disagreements."""
    out = []
    for run in runs:
        kv = run["pdctl"].get("kv_transfer") or {}
        exact, approx = kv.get("view_exact_cached_tokens") or 0, kv.get("view_approx_cached_tokens") or 0
        if not exact and not approx:
            continue
        decisions = sum((run["pdctl"].get("paths") or {}).get(p, 0) for p in ("local", "disagg"))
        rate = f" at {run['request_rate']:g}/s" if isinstance(run.get("request_rate"), (int, float)) else ""
        out.append(
            f"{run['label']}{rate}: cached tokens on the chosen decodes, exact view {exact:,.0f}, approximate view "
            f"{approx:,.0f} ({approx / exact if exact else float('inf'):.3f}x); the approximate view would have "
            f"decided {kv.get('view_disagreements') or 0:.0f} of {decisions} requests the other way"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="ab.json or agent-N.json from scripts/ab-demo.sh")
    args = ap.parse_args(argv)
    try:
        runs = load_results(args.results)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    agent = any(r["pdctl"].get("turn_groups") for r in runs)
    print("\n".join(agent_rows(runs) if agent else mixed_rows(runs)))
    drift = drift_lines(runs)
    if drift:
        print("\n" + "\n".join(drift))
    return 0


if __name__ == "__main__":
    sys.exit(main())
