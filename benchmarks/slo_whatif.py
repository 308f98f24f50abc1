"""Saved `pdctl bench` results scored under other SLOs: which side of an A/B wins depends on the SLO you hold.

    python -m benchmarks.slo_whatif results/ab-DATE/ab.json --goodput ttft:300 tpot:24 --goodput ttft:1500 tpot:20

Reads each run's per-request arrays in vLLM's keys (``ttfts``, ``latencies``, ``output_lens``, ``errors``),
rebuilds :class:`pdctl.bench.client.RequestResult` and applies :func:`pdctl.bench.metrics.meets_slo`, the rule
``pdctl bench``'s own goodput uses, so no request is scored differently from a live run. Prints one Markdown row
per run: side, rate, then SLO attainment and goodput (req/s) for each ``--goodput`` set. docs/bench.md, "PD vs
colocated on real vLLM", uses it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pdctl.bench.client import RequestResult
from pdctl.bench.metrics import SLO, meets_slo, parse_goodput
from pdctl.bench.report import ReportError, load_results


def requests_of(run: Mapping[str, Any]) -> list[RequestResult]:
    """The run's requests from vLLM's per-request arrays (a request with an error string failed)."""
    errors = run.get("errors") or [""] * len(run["ttfts"])
    return [
        RequestResult(index=i, kind="", max_tokens=n, prompt_len=0, success=not err, ttft_s=ttft or 0.0,
                      latency_s=lat or 0.0, output_tokens=n)
        for i, (ttft, lat, n, err) in enumerate(zip(run["ttfts"], run["latencies"], run["output_lens"], errors,
                                                    strict=True))
    ]  # fmt: skip


def score(run: Mapping[str, Any], slo: SLO) -> tuple[float, float]:
    """(attainment in %, goodput in req/s) of one run under ``slo``; failed requests count as misses."""
    reqs = requests_of(run)
    good = sum(meets_slo(r, slo) for r in reqs)
    duration = float(run.get("duration") or 0.0)
    return (100.0 * good / len(reqs) if reqs else 0.0), (good / duration if duration > 0 else 0.0)


def table(runs: Sequence[Mapping[str, Any]], slos: Sequence[SLO]) -> list[str]:
    """Markdown lines: a header, then one row per run."""
    names = [" ".join(f"{k} ≤ {v:g} ms" for k, v in slo.as_dict().items()) for slo in slos]
    head = ["side", "rate", *(f"{n}: attainment / goodput" for n in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        rate = run.get("request_rate", 0)  # "inf" (vLLM's key) for a closed loop, such as the agent workload
        cells = [str(run.get("label") or "-"), f"{rate:g}/s" if isinstance(rate, int | float) else str(rate)]
        for slo in slos:
            att, goodput = score(run, slo)
            cells.append(f"{att:.1f} % / {goodput:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a pdctl bench (or vllm bench serve) results JSON file")
    p.add_argument("--goodput", nargs="+", action="append", required=True, metavar="KEY:MS",
                   help="one SLO set, e.g. --goodput ttft:300 tpot:24 (repeat for more sets)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        slos = [parse_goodput(items) for items in args.goodput]
        runs = load_results(args.results)
    except (ValueError, ReportError) as exc:
        hint = getattr(exc, "hint", "")
        print(f"error: {exc}" + (f"\nhint: {hint}" if hint else ""), file=sys.stderr)
        return 2
    print("\n".join(table(runs, slos)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
