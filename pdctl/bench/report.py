"""Results people can read and tools can parse.

* :func:`result_json` -- one run as a ``vllm bench serve`` result object (same key names and units: latencies
  in ms in the statistics, seconds in the per-request arrays ``ttfts``/``itls``/``latencies``), with pdctl's
  extras under the ``"pdctl"`` key. Several runs are written as a JSON list of such objects.
* :func:`load_results` / :func:`compare` -- two result files side by side with ratios (B / A).
* :func:`render_html` -- a self-contained HTML page with inline SVG plots: latency CDFs, TPOT over time with
  long-prompt arrivals marked, goodput and SLO attainment against the rate. No plotting library needed.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl import __version__
from pdctl.bench.metrics import Stats, Summary, tpot_s
from pdctl.bench.runner import RunResult, SearchResult, kv_summary
from pdctl.errors import PdctlError

__all__ = [
    "COMPARE_KEYS",
    "CompareRow",
    "ReportError",
    "compare",
    "load_results",
    "percentile_key",
    "render_html",
    "result_json",
    "write_results",
]

_METRICS = ("ttft", "tpot", "itl", "e2el")

# (key, higher is better)
COMPARE_KEYS: tuple[tuple[str, bool], ...] = (
    ("completed", True),
    ("failed", False),
    ("request_throughput", True),
    ("request_goodput", True),
    ("output_throughput", True),
    ("mean_ttft_ms", False),
    ("median_ttft_ms", False),
    ("p90_ttft_ms", False),
    ("p99_ttft_ms", False),
    ("mean_tpot_ms", False),
    ("median_tpot_ms", False),
    ("p90_tpot_ms", False),
    ("p99_tpot_ms", False),
    ("mean_itl_ms", False),
    ("p99_itl_ms", False),
    ("mean_e2el_ms", False),
    ("p99_e2el_ms", False),
    ("slo_attainment", True),
)


class ReportError(PdctlError):
    """A results file that cannot be read or compared."""


def percentile_key(p: float, metric: str) -> str:
    """vLLM's key for a percentile: ``p99_ttft_ms``, ``p99.9_itl_ms``."""
    word = str(int(p)) if float(p).is_integer() else f"{p:g}"
    return f"p{word}_{metric}_ms"


def _stats_keys(out: dict[str, Any], metric: str, s: Stats) -> None:
    out[f"mean_{metric}_ms"] = s.mean
    out[f"median_{metric}_ms"] = s.median
    out[f"std_{metric}_ms"] = s.std
    for p, v in s.percentiles.items():
        out[percentile_key(p, metric)] = v


def _stats_dict(s: Stats) -> dict[str, Any]:
    d: dict[str, Any] = {"count": s.count, "mean": s.mean, "median": s.median, "std": s.std, "min": s.min}
    d["max"] = s.max
    for p, v in s.percentiles.items():
        d[f"p{int(p) if float(p).is_integer() else p:g}"] = v
    return d


def _rate(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def result_json(run: RunResult) -> dict[str, Any]:
    """One run as a ``vllm bench serve`` result object plus ``"pdctl"`` extras."""
    s: Summary = run.summary
    t, shape = run.target, run.shape
    chat = t.endpoint == "chat"
    measured = [r for r in run.results if not r.warmup]
    out: dict[str, Any] = {
        "date": run.date,
        "endpoint_type": "openai-chat" if chat else "openai",
        "backend": "openai-chat" if chat else "openai",
        "label": t.label or None,
        "model_id": t.model,
        "tokenizer_id": t.model,
        "num_prompts": len(measured),
        "request_rate": _rate(shape.rate),
        "burstiness": shape.burstiness,
        "max_concurrency": shape.concurrency,
        "duration": s.duration_s,
        "completed": s.completed,
        "failed": s.failed,
        "total_input_tokens": s.total_input_tokens,
        "total_output_tokens": s.total_output_tokens,
        "request_throughput": s.request_throughput,
        "request_goodput": s.request_goodput,
        "output_throughput": s.output_throughput,
        "total_token_throughput": s.total_token_throughput,
        "max_output_tokens_per_s": s.max_output_tokens_per_s,
        "max_concurrent_requests": s.max_concurrent_requests,
        "input_lens": [r.prompt_tokens or r.prompt_len for r in measured],
        "output_lens": [r.output_tokens if r.success else 0 for r in measured],
        "ttfts": [r.ttft_s if r.success else 0.0 for r in measured],
        "itls": [list(r.itl_s) if r.success else [] for r in measured],
        "latencies": [r.latency_s if r.success else 0.0 for r in measured],
        "start_times": [r.sent_s for r in measured],
        "queue_times": [r.queue_s for r in measured],
        "errors": [r.error for r in measured],
    }
    for metric in _METRICS:
        _stats_keys(out, metric, getattr(s, metric))
    if s.slo is not None:
        out["goodput"] = s.slo.as_dict()
    kv = kv_summary(run.metric_deltas) if run.metric_deltas else {}
    out["pdctl"] = {
        "version": __version__,
        "base_url": t.base_url,
        "workload": {
            "name": t.workload.name,
            "seed": t.workload.spec.seed,
            "unique_prompts": t.workload.spec.unique,
            "run_id": run.run_id if t.workload.spec.unique else None,
            **_workload_params(run),
        },
        "load": {
            "rate": _rate(shape.rate),
            "burstiness": shape.burstiness,
            "concurrency": shape.concurrency,
            "num_requests": shape.num_requests,
            "duration_s": shape.duration_s,
            "warmup_requests": run.warmups,
            "seed": shape.seed,
        },
        "slo": None if s.slo is None else {**s.slo.as_dict(), "attainment_target": s.slo.attainment, "met": s.slo_met},
        "slo_attainment": s.slo_attainment,
        "ttft_attainment": s.ttft_attainment,
        "tpot_attainment": s.tpot_attainment,
        "good_requests": s.good_requests,
        "rejected": s.rejected,
        "paths": s.paths,
        "error_counts": s.errors,
        "client": {"scheduling_lag_ms": _stats_dict(s.lag), "queue_ms": _stats_dict(s.queue)},
        "ttft_decomposition": {
            "prefill_leg_ms": _stats_dict(s.prefill_leg),
            "after_prefill_ms": _stats_dict(s.ttft_after_prefill),
        },
        "by_kind": {k: {m: _stats_dict(v) for m, v in d.items()} for k, d in s.by_kind.items()},
        "kv_transfer": kv,
        "metric_deltas": run.metric_deltas,
        "warnings": run.warnings,
        "requests": {
            "index": [r.index for r in measured],
            "kind": [r.kind for r in measured],
            "scheduled_times": [r.scheduled_s for r in measured],
            "tpots": [tpot_s(r) for r in measured],
            "status": [r.status for r in measured],
            "request_id": [r.request_id for r in measured],
            "pd_path": [r.pd_path for r in measured],
            "pd_prefill_ms": [r.pd_prefill_ms for r in measured],
            "pd_prefill": [r.pd_prefill for r in measured],
            "pd_decode": [r.pd_decode for r in measured],
        },
    }
    return out


def _workload_params(run: RunResult) -> dict[str, Any]:
    spec = run.target.workload.spec
    name = spec.name
    if name == "random":
        return {"input_len": spec.input_len, "output_len": spec.output_len, "range_ratio": spec.range_ratio,
                "prefix_len": spec.prefix_len}  # fmt: skip
    if name == "mixed":
        return {"short_len": spec.short_len, "output_len": spec.output_len, "long_len": spec.long_len,
                "long_output_len": spec.long_output_len, "long_fraction": spec.long_fraction,
                "range_ratio": spec.range_ratio}  # fmt: skip
    if name in ("sharegpt", "trace"):
        return {"path": spec.path, "trace_speed": spec.trace_speed} if name == "trace" else {"path": spec.path}
    return {}


def write_results(path: str | Path, runs: Sequence[RunResult], search: SearchResult | None = None) -> None:
    """Write one result object (one run) or a list of them (several runs) as JSON."""
    objs = [result_json(r) for r in runs]
    if search is not None:
        for obj in objs:
            obj["pdctl"]["max_goodput_rate"] = search.best_rate
    data: Any = objs[0] if len(objs) == 1 else objs
    try:
        Path(path).write_text(json.dumps(data, indent=2, allow_nan=False, default=_json_default) + "\n")
    except OSError as exc:
        raise ReportError(f"{path}: cannot write the results: {exc.strerror or exc}") from None


def _json_default(value: Any) -> Any:
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """Read a results file written by pdctl or by ``vllm bench serve`` (an object, a list, or JSON lines)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    items = data if isinstance(data, list) else [data]
    if not items or not all(isinstance(i, dict) and "completed" in i for i in items):
        raise ReportError(
            f"{path}: not a benchmark result", hint="give a file written by `pdctl bench -o` or `vllm bench serve`"
        )
    return items


@dataclass(frozen=True, slots=True)
class CompareRow:
    """One metric of two results: values, ratio B / A, and which side is better."""

    key: str
    a: float | None
    b: float | None
    ratio: float | None
    better: str


def _value(obj: Mapping[str, Any], key: str) -> float | None:
    value = obj.get(key)
    if value is None and key == "slo_attainment":
        value = (obj.get("pdctl") or {}).get("slo_attainment")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[CompareRow]:
    """Rows of :data:`COMPARE_KEYS` present in either result; ``better`` is ``A``, ``B`` or ``=``."""
    rows: list[CompareRow] = []
    for key, higher in COMPARE_KEYS:
        va, vb = _value(a, key), _value(b, key)
        if va is None and vb is None:
            continue
        ratio = vb / va if va and vb is not None else None
        better = ""
        if va is not None and vb is not None:
            if math.isclose(va, vb, rel_tol=0.02, abs_tol=1e-9):
                better = "="
            else:
                better = "B" if (vb > va) == higher else "A"
        rows.append(CompareRow(key, va, vb, ratio, better))
    return rows


# ---------------------------------------------------------------------------------------------- HTML

_W, _H = 560, 300
_ML, _MR, _MT, _MB = 60, 16, 28, 40
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * exp:
            return float(m * exp)
    return float(10 * exp)


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _frame(
    title: str,
    xlabel: str,
    ylabel: str,
    xmax: float,
    ymax: float,
    body: list[str],
    legend: Sequence[str],
    legend_bottom: bool = False,
) -> str:
    pw, ph = _W - _ML - _MR, _H - _MT - _MB
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{_W / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">{html.escape(title)}</text>',
        f'<rect x="{_ML}" y="{_MT}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
    ]
    for i in range(5):
        fx, fy = i / 4, i / 4
        x = _ML + fx * pw
        y = _MT + ph - fy * ph
        parts.append(f'<line x1="{_ML}" y1="{y:.1f}" x2="{_ML + pw}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{_ML - 4}" y="{y + 4:.1f}" text-anchor="end">{_fmt(ymax * fy)}</text>')
        parts.append(f'<text x="{x:.1f}" y="{_MT + ph + 14}" text-anchor="middle">{_fmt(xmax * fx)}</text>')
    parts.append(f'<text x="{_ML + pw / 2}" y="{_H - 6}" text-anchor="middle">{html.escape(xlabel)}</text>')
    parts.append(
        f'<text x="14" y="{_MT + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {_MT + ph / 2})">'
        f"{html.escape(ylabel)}</text>"
    )
    parts.extend(body)
    # 6.2 px per character of the 11 px sans-serif font, roughly: keep the legend inside the plot.
    lx = max(_ML + 4, _ML + pw - 20 - 6.2 * max((len(n) for n in legend), default=0))
    for i, name in enumerate(legend):
        y = (_MT + ph - 8 - 14 * (len(legend) - 1 - i)) if legend_bottom else (_MT + 12 + 14 * i)
        colour = _COLOURS[i % len(_COLOURS)]
        parts.append(f'<rect x="{lx:.0f}" y="{y - 8}" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{lx + 14:.0f}" y="{y + 1}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _xy(x: float, y: float, xmax: float, ymax: float) -> tuple[float, float]:
    pw, ph = _W - _ML - _MR, _H - _MT - _MB
    return _ML + min(x / xmax, 1.0) * pw, _MT + ph - min(y / ymax, 1.0) * ph


def svg_cdf(title: str, xlabel: str, series: Mapping[str, Sequence[float]]) -> str:
    """Empirical CDFs of several samples (x clipped at the largest p99, so one outlier cannot flatten it)."""
    from pdctl.bench.metrics import percentile

    nonempty = {k: sorted(v) for k, v in series.items() if v}
    xmax = _nice_max(max((percentile(v, 99.0) for v in nonempty.values()), default=1.0) * 1.05)
    body: list[str] = []
    for i, (_, values) in enumerate(nonempty.items()):
        n = len(values)
        step = max(1, n // 400)
        pts = []
        for j in range(0, n, step):
            pts.append(_xy(values[j], (j + 1) / n, xmax, 1.0))
        pts.append(_xy(values[-1], 1.0, xmax, 1.0))
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        body.append(
            f'<polyline fill="none" stroke="{_COLOURS[i % len(_COLOURS)]}" stroke-width="1.5" points="{path}"/>'
        )
    return _frame(title, xlabel, "fraction of requests", xmax, 1.0, body, list(nonempty), legend_bottom=True)


def svg_over_time(
    title: str, ylabel: str, series: Mapping[str, Sequence[tuple[float, float]]], markers: Sequence[float]
) -> str:
    """Per-request points against their send time, with vertical lines where long prompts arrived."""
    all_pts = [p for pts in series.values() for p in pts]
    xmax = _nice_max(max([p[0] for p in all_pts] + list(markers) + [1e-9]) * 1.02)
    from pdctl.bench.metrics import percentile

    ymax = _nice_max(percentile([p[1] for p in all_pts], 99.5) * 1.1 if all_pts else 1.0)
    body: list[str] = []
    for t in markers:
        x, _ = _xy(t, 0, xmax, ymax)
        body.append(f'<line x1="{x:.1f}" y1="{_MT}" x2="{x:.1f}" y2="{_H - _MB}" stroke="#f4a" stroke-opacity="0.35"/>')
    for i, (_, pts) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        for px, py in pts:
            x, y = _xy(px, py, xmax, ymax)
            body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{colour}" fill-opacity="0.7"/>')
    legend = list(series) + (["long-prompt arrival (line)"] if markers else [])
    return _frame(title, "send time (s)", ylabel, xmax, ymax, body, legend)


def svg_lines(title: str, xlabel: str, ylabel: str, series: Mapping[str, Sequence[tuple[float, float]]]) -> str:
    """Lines with point markers, e.g. goodput against request rate."""
    pts_all = [p for pts in series.values() for p in pts if math.isfinite(p[0])]
    xmax = _nice_max(max((p[0] for p in pts_all), default=1.0) * 1.05)
    ymax = _nice_max(max((p[1] for p in pts_all), default=1.0) * 1.1)
    body: list[str] = []
    for i, (_, pts) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        xy = [_xy(x, y, xmax, ymax) for x, y in sorted(pts) if math.isfinite(x)]
        body.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
            f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in xy)}"/>'
        )
        body.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in xy)
    return _frame(title, xlabel, ylabel, xmax, ymax, body, list(series))


def _run_name(run: RunResult) -> str:
    shape = run.shape
    load = f"{shape.rate:g} req/s" if math.isfinite(shape.rate) else "rate inf"
    if shape.concurrency:
        load += f", concurrency {shape.concurrency}"
    return f"{run.label} @ {load}"


def _summary_table(runs: Sequence[RunResult]) -> str:
    heads = ["run", "completed", "failed", "req/s", "goodput", "SLO att.", "TTFT p50", "TTFT p90", "TTFT p99",
             "TPOT p50", "TPOT p90", "TPOT p99", "ITL p99", "paths"]  # fmt: skip
    rows = []
    for run in runs:
        s = run.summary

        def p(st: Stats, q: float) -> str:
            return f"{st.percentiles.get(q, st.median if q == 50 else float('nan')):.1f}"

        cells = [
            _run_name(run),
            str(s.completed),
            str(s.failed),
            f"{s.request_throughput:.2f}",
            "-" if s.request_goodput is None else f"{s.request_goodput:.2f}",
            "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.0f}%",
            f"{s.ttft.median:.1f}",
            p(s.ttft, 90.0),
            p(s.ttft, 99.0),
            f"{s.tpot.median:.1f}",
            p(s.tpot, 90.0),
            p(s.tpot, 99.0),
            p(s.itl, 99.0),
            ", ".join(f"{k} {v}" for k, v in sorted(s.paths.items())),
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in heads) + "</tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def render_html(runs: Sequence[RunResult], *, title: str = "pdctl bench", search: SearchResult | None = None) -> str:
    """A self-contained HTML report of ``runs`` (one or several labels and rates)."""
    plots: list[str] = []
    # CDFs for the highest-rate run of each label: where A/B differences show most.
    last_by_label: dict[str, RunResult] = {}
    for run in runs:
        last_by_label[run.label] = run
    for metric, label in (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("itl", "ITL (ms)"), ("e2el", "E2EL (ms)")):
        series: dict[str, list[float]] = {}
        for run in last_by_label.values():
            done = [r for r in run.results if r.success and not r.warmup]
            if metric == "ttft":
                values = [r.ttft_s * 1000 for r in done]
            elif metric == "tpot":
                values = [t * 1000 for r in done if (t := tpot_s(r)) is not None]
            elif metric == "itl":
                values = [g * 1000 for r in done for g in r.itl_s]
            else:
                values = [r.latency_s * 1000 for r in done]
            series[_run_name(run)] = values
        plots.append(svg_cdf(f"{metric.upper()} CDF", label, series))
    over: dict[str, list[tuple[float, float]]] = {}
    markers: list[float] = []
    for run in last_by_label.values():
        pts = []
        for r in run.results:
            t = tpot_s(r)
            if t is not None and r.kind != "long":
                pts.append((r.sent_s, t * 1000))
        over[_run_name(run)] = pts
        if not markers:
            markers = [r.sent_s for r in run.results if r.kind == "long"]
    plots.append(svg_over_time("TPOT over time", "TPOT (ms)", over, markers))
    labels = list(dict.fromkeys(r.label for r in runs))
    rated = [r for r in runs if math.isfinite(r.shape.rate)]
    if len({r.shape.rate for r in rated}) > 1:
        good = {
            lab: [(r.shape.rate, r.summary.request_goodput or 0.0) for r in rated if r.label == lab] for lab in labels
        }
        plots.append(svg_lines("Goodput vs request rate", "request rate (req/s)", "goodput (req/s)", good))
        att = {
            lab: [(r.shape.rate, 100 * (r.summary.slo_attainment or 0.0)) for r in rated if r.label == lab]
            for lab in labels
        }
        plots.append(svg_lines("SLO attainment vs request rate", "request rate (req/s)", "attainment (%)", att))
    notes: list[str] = []
    if search is not None:
        best = "none of the probed rates" if search.best_rate is None else f"{search.best_rate:.3g} req/s"
        notes.append(
            f"<p><b>Max goodput rate</b> (≥ {100 * search.attainment_target:.0f}% of requests within every SLO): "
            f"{html.escape(best)}</p>"
        )
    for run in runs:
        for w in run.warnings:
            notes.append(f'<p class="warn">{html.escape(_run_name(run))}: {html.escape(w)}</p>')
    slo = next((r.summary.slo for r in runs if r.summary.slo is not None), None)
    slo_text = "no SLO given" if slo is None else ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.as_dict().items())
    kv_rows = []
    for run in runs:
        if run.metric_deltas:
            kv = kv_summary(run.metric_deltas)
            kv_rows.append(
                f"<tr><td>{html.escape(_run_name(run))}</td><td>{kv['kv_transfers']:.0f}</td>"
                f"<td>{kv['kv_bytes'] / 1e6:.2f}</td><td>{kv['kv_xfer_ms_mean']:.2f}</td>"
                f"<td>{kv['kv_failed_transfers']:.0f}</td><td>{kv['external_kv_tokens']:.0f}</td></tr>"
            )
    kv_table = (
        "<h2>KV transfer during the run (workers' /metrics deltas)</h2><table><tr><th>run</th><th>transfers</th>"
        "<th>MB</th><th>mean ms</th><th>failed</th><th>external KV tokens</th></tr>" + "".join(kv_rows) + "</table>"
        if kv_rows
        else ""
    )
    style = (
        "body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}td:first-child{text-align:left}"
        ".plots{display:flex;flex-wrap:wrap;gap:12px}.warn{color:#a40}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>SLOs: {html.escape(slo_text)}. Latencies in ms; TTFT = send → first content chunk, "
        "TPOT = (E2EL − TTFT)/(output tokens − 1), ITL = gaps between chunks (vLLM definitions).</p>"
        + "".join(notes)
        + _summary_table(runs)
        + kv_table
        + f"<div class='plots'>{''.join(plots)}</div>"
        + f"<p style='color:#888'>pdctl {html.escape(__version__)}</p></body></html>"
    )
