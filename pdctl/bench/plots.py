"""The report's plots: inline SVG (:mod:`pdctl.bench.svg`) for the HTML page, or files (``pdctl bench --plots DIR``).

* :func:`plot_groups` -- goodput, SLO attainment and p90 latencies against the rate; latency CDFs for every load
  (A/B sides overlaid); TPOT (and, on an A/B, the gaps between tokens) over time with long-prompt arrivals
  marked; the requests running on each engine (its batch gauge sampled during the run); for the agent workload,
  TTFT p50 and p90 by turn.
* :func:`write_plots` -- each of them as ``STEM.svg`` in a folder.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pdctl.bench import svg
from pdctl.bench.metrics import Stats, percentile, tpot_s
from pdctl.bench.report import ReportError, engine_name, run_load, run_name
from pdctl.bench.runner import RunResult

__all__ = ["plot_groups", "write_plots"]

_CDF_SIZE = (320, 240)
_TIME_SIZE = (660, 260)
_RATE_SIZE = (560, 300)
_LATENCIES = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("itl", "ITL (ms)"), ("e2el", "E2EL (ms)"))


def _latencies_ms(run: RunResult, metric: str) -> list[float]:
    done = [r for r in run.results if r.success and not r.warmup]
    if metric == "ttft":
        return [r.ttft_s * 1000 for r in done]
    if metric == "tpot":
        return [t * 1000 for r in done if (t := tpot_s(r)) is not None]
    if metric == "itl":
        return [g * 1000 for r in done for g in r.itl_s]
    return [r.latency_s * 1000 for r in done]


def _colours(names: Sequence[str]) -> dict[str, str]:
    return {name: svg.PALETTE[i % len(svg.PALETTE)] for i, name in enumerate(names)}


def _over_time(run_by_name: Mapping[str, RunResult], colours: Mapping[str, str], title: str) -> str:
    series: dict[str, list[tuple[float, float, float]]] = {}
    for name, run in run_by_name.items():
        series[name] = [
            (r.sent_s + r.ttft_s, r.sent_s + r.latency_s, t * 1000)
            for r in run.results
            if (t := tpot_s(r)) is not None and r.kind != "long"
        ]
    first = next(iter(run_by_name.values()))
    markers = [r.sent_s for r in first.results if r.kind == "long"]
    ylabel = "TPOT of the other requests (ms)" if markers else "TPOT (ms)"
    return svg.spans(title, ylabel, series, colours, markers, size=_TIME_SIZE)


def _itl_over_time(run_by_name: Mapping[str, RunResult], colours: Mapping[str, str], title: str) -> str:
    """Every gap between two tokens of the short requests, drawn where it happened at its length: a decode stalled
    by a long prefill shows as one long, high segment right after a long-prompt arrival. Not clipped: the
    stalls are the point."""
    series: dict[str, list[tuple[float, float, float]]] = {}
    for name, run in run_by_name.items():
        pts: list[tuple[float, float, float]] = []
        for r in run.results:
            if not r.success or r.kind == "long":
                continue
            t = r.sent_s + r.ttft_s
            for gap in r.itl_s:
                pts.append((t, t + gap, gap * 1000))
                t += gap
        series[name] = pts
    first = next(iter(run_by_name.values()))
    markers = [r.sent_s for r in first.results if r.kind == "long"]
    return svg.spans(title, "gap between tokens of the short requests (ms)" if markers else "gap between tokens (ms)",
                     series, colours, markers, y_percentile=100.0, size=_TIME_SIZE)  # fmt: skip


def _against_rate(runs: Sequence[RunResult], sides: Sequence[str], colours: Mapping[str, str]) -> list[tuple[str, str]]:
    rated = [r for r in runs if math.isfinite(r.shape.rate) and not r.target.workload.timed]
    if len({r.shape.rate for r in rated}) < 2:
        return []
    name = {side: side or "this deployment" for side in sides}
    named = {name[s]: c for s, c in colours.items()}

    def per_side(value: Callable[[RunResult], float]) -> dict[str, list[tuple[float, float]]]:
        return {name[s]: [(r.shape.rate, value(r)) for r in rated if r.target.label == s] for s in sides}

    def p90(st: Stats) -> float:
        return st.percentiles.get(90.0, st.median)

    plots = []
    if any(r.summary.slo is not None for r in rated):
        plots.append(("goodput-vs-rate", svg.lines("Goodput vs request rate", "request rate (req/s)",
                      "goodput (req/s)", per_side(lambda r: r.summary.request_goodput or 0.0), named,
                      diagonal="goodput = rate", size=_RATE_SIZE)))  # fmt: skip
        plots.append(("attainment-vs-rate", svg.lines("SLO attainment vs request rate", "request rate (req/s)",
                      "attainment (%)", per_side(lambda r: 100 * (r.summary.slo_attainment or 0.0)), named,
                      ymax=100.0, size=_RATE_SIZE)))  # fmt: skip
    else:
        plots.append(("throughput-vs-rate", svg.lines("Throughput vs request rate", "request rate (req/s)",
                      "completed (req/s)", per_side(lambda r: r.summary.request_throughput), named,
                      diagonal="throughput = rate", size=_RATE_SIZE)))  # fmt: skip
    plots.append(("ttft-p90-vs-rate", svg.lines("TTFT p90 vs request rate", "request rate (req/s)",
                  "TTFT p90 (ms)", per_side(lambda r: p90(r.summary.ttft)), named, size=_RATE_SIZE)))  # fmt: skip
    plots.append(("tpot-p90-vs-rate", svg.lines("TPOT p90 vs request rate", "request rate (req/s)",
                  "TPOT p90 (ms)", per_side(lambda r: p90(r.summary.tpot)), named, size=_RATE_SIZE)))  # fmt: skip
    return plots


def _by_turn(runs: Sequence[RunResult], colours: Mapping[str, str]) -> list[tuple[str, str]]:
    """The agent workload: TTFT p50 and p90 against the turn index, one line per run (side and load). Later turns
    carry longer histories: whether their TTFT grows, or falls as a prefix cache serves them, is the point."""
    series: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        for res in r.results:
            if res.turn is not None and res.success:
                name = f"{r.target.label or 'this deployment'}, {run_load(r)}"
                series.setdefault(name, {}).setdefault(res.turn, []).append(res.ttft_s * 1000)
    if not series:
        return []

    def at(q: float) -> dict[str, list[tuple[float, float]]]:
        return {name: [(float(t), percentile(sorted(v), q)) for t, v in sorted(turns.items())]
                for name, turns in series.items()}  # fmt: skip

    return [(f"ttft-{q:g}-by-turn", svg.lines(f"TTFT p{q:g} by turn", "turn", f"TTFT p{q:g} (ms)", at(q), colours,
                                              size=_RATE_SIZE)) for q in (50.0, 90.0)]  # fmt: skip


def _slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() or c == "." else " " for c in text.lower()).split())


def plot_groups(runs: Sequence[RunResult]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The report's plots as ``(heading, [(file stem, svg)])``: against the rate, then latency CDFs and TPOT over
    time for every load of every side. The stems name the files of ``pdctl bench --plots DIR``."""
    sides = list(dict.fromkeys(r.target.label for r in runs))
    loads = list(dict.fromkeys(run_load(r) for r in runs))
    out: list[tuple[str, list[tuple[str, str]]]] = []
    rate_plots = _against_rate(runs, sides, _colours(sides))
    if rate_plots:
        out.append(("Against the request rate", rate_plots))
    turn_plots = _by_turn(runs, _colours([f"{r.target.label or 'this deployment'}, {run_load(r)}" for r in runs]))
    if turn_plots:
        out.append(("Agent conversations: by turn", turn_plots))
    if len(sides) > 1:
        # A/B: one row per load, the sides overlaid in each plot, each side in the same colour everywhere.
        colours = _colours(sides)
        for load in loads:
            by_side = {r.target.label: r for r in runs if run_load(r) == load}
            cdfs = [(f"{metric}-cdf-{_slug(load)}", svg.cdf(f"{metric.upper()} CDF, {load}", label,
                     {side: _latencies_ms(run, metric) for side, run in by_side.items()}, colours,
                     ylabel="fraction of gaps" if metric == "itl" else "fraction of requests",
                     size=_CDF_SIZE)) for metric, label in _LATENCIES]  # fmt: skip
            out.append((f"Latency CDFs at {load}, sides overlaid", cdfs))
        times = [(f"tpot-over-time-{_slug(load)}",
                  _over_time({r.target.label: r for r in runs if run_load(r) == load}, colours,
                             f"TPOT over time, {load}")) for load in loads]  # fmt: skip
        out.append(("TPOT over time", times))
        times = [(f"itl-over-time-{_slug(load)}",
                  _itl_over_time({r.target.label: r for r in runs if run_load(r) == load}, colours,
                                 f"Gaps between tokens over time, {load}")) for load in loads]  # fmt: skip
        out.append(("Gaps between tokens over time (decode stalls)", times))
    else:
        # One deployment: every load overlaid in each CDF.
        colours = _colours(loads)
        cdfs = [(f"{metric}-cdf", svg.cdf(f"{metric.upper()} CDF", label,
                 {run_load(r): _latencies_ms(r, metric) for r in runs}, colours,
                 ylabel="fraction of gaps" if metric == "itl" else "fraction of requests",
                 size=_CDF_SIZE)) for metric, label in _LATENCIES]  # fmt: skip
        out.append(("Latency CDFs, one curve per load", cdfs))
        times = [(f"tpot-over-time-{_slug(run_name(r))}", _over_time({run_load(r): r}, colours,
                  f"TPOT over time, {run_load(r)}")) for r in runs]  # fmt: skip
        out.append(("TPOT over time", times))
    running = [_running(group, f"Requests running on each engine, {load}", f"running-{_slug(load)}")
               for load in loads if (group := [r for r in runs if run_load(r) == load and r.gauges])]  # fmt: skip
    if running:
        out.append(("Requests running on each engine (vllm:num_requests_running, sampled every second)", running))
    return out


def _running(runs: Sequence[RunResult], title: str, stem: str) -> tuple[str, str]:
    """One line per side and engine: the requests in its batch over the run (the gauges sampled while it ran)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        for url, g in run.gauges.items():
            engine = engine_name(run, url)
            name = f"{run.target.label} · {engine}" if run.target.label else engine
            series[name] = [(t, r) for t, r, _ in g.samples]
    colours = _colours(list(series))
    return stem, svg.lines(title, "time since the run started (s)", "requests running", series, colours,
                           size=_TIME_SIZE)  # fmt: skip


def write_plots(folder: str | Path, runs: Sequence[RunResult]) -> list[Path]:
    """Every plot of the report as ``folder/STEM.svg`` (the folder is created); returns the paths written."""
    root = Path(folder)
    written: list[Path] = []
    try:
        root.mkdir(parents=True, exist_ok=True)
        for _, plots in plot_groups(runs):
            for stem, image in plots:
                path = root / f"{stem}.svg"
                path.write_text(image, encoding="utf-8")
                written.append(path)
    except OSError as exc:
        raise ReportError(f"{root}: cannot write the plots: {exc.strerror or exc}") from None
    return written
