"""Results people can read and tools can parse.

* :func:`result_json` -- one run as a ``vllm bench serve`` result object (same key names and units: latencies
  in ms in the statistics, seconds in the per-request arrays ``ttfts``/``itls``/``latencies``), with pdctl's
  extras under the ``"pdctl"`` key. Several runs are written as a JSON list of such objects.
* :func:`load_results` / :func:`compare` -- two result files side by side with ratios (B / A).
* :func:`render_html` -- a self-contained HTML page: tables (per run, per request kind, KV transfer), then
  inline SVG plots (:mod:`pdctl.bench.svg`): goodput, SLO attainment and p90 latencies against the rate, latency
  CDFs for every load (A/B sides overlaid), TPOT over time with long-prompt arrivals marked. Runs are named by
  side and load (:func:`run_name`), never by URL.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl import __version__
from pdctl.bench import svg
from pdctl.bench.metrics import SPIKE_FACTOR, Spikes, Stats, Summary, tpot_s
from pdctl.bench.runner import RunResult, SearchResult, engine_summary, kv_summary
from pdctl.errors import PdctlError

__all__ = [
    "COMPARE_KEYS",
    "CompareRow",
    "ReportError",
    "best_swept_rate",
    "compare",
    "load_results",
    "percentile_key",
    "plot_groups",
    "render_html",
    "result_json",
    "run_load",
    "run_name",
    "write_plots",
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


def _spikes_dict(s: Spikes) -> dict[str, Any]:
    return {"threshold_ms": s.threshold_ms, "gaps": s.gaps, "share": s.share, "requests": s.requests}


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
        "by_kind": {
            k: {**{m: _stats_dict(v) for m, v in d.items()}, "itl_spikes": _spikes_dict(s.spikes_by_kind[k])}
            for k, d in s.by_kind.items()
        },
        "itl_spikes": _spikes_dict(s.itl_spikes),
        "kv_transfer": kv,
        "engine": engine_summary(run.metric_deltas),
        "engine_gauges": {url: {**g.stats(), "series": [list(x) for x in g.samples]} for url, g in run.gauges.items()},
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


def write_results(
    path: str | Path,
    runs: Sequence[RunResult],
    search: SearchResult | None = None,
    searches: Mapping[str, SearchResult] | None = None,
) -> None:
    """Write one result object (one run) or a list of them (several runs) as JSON; a search's best rate goes
    into every run's ``pdctl.max_goodput_rate`` (with ``searches``, one per side: that side's)."""
    objs = [result_json(r) for r in runs]
    for run, obj in zip(runs, objs, strict=True):
        found = (searches or {}).get(run.target.label, search)
        if found is not None:
            obj["pdctl"]["max_goodput_rate"] = found.best_rate
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

_CDF_SIZE = (320, 240)
_TIME_SIZE = (660, 260)
_RATE_SIZE = (560, 300)
_LATENCIES = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("itl", "ITL (ms)"), ("e2el", "E2EL (ms)"))


def run_load(run: RunResult) -> str:
    """What load a run was under, in words: ``8 req/s``, ``4 req/s, ≤ 16 in flight``, ``closed loop, 8 in flight``."""
    shape = run.shape
    if run.target.workload.timed:
        text = f"trace at {run.target.workload.spec.trace_speed:g}x"
    elif math.isfinite(shape.rate):
        text = f"{shape.rate:g} req/s"
        if shape.burstiness != 1.0:
            text += f", burstiness {shape.burstiness:g}"
        if shape.concurrency:
            text += f", ≤ {shape.concurrency} in flight"
    elif shape.concurrency:
        text = f"closed loop, {shape.concurrency} in flight"
    else:
        text = "all at once"
    return text


def run_name(run: RunResult) -> str:
    """A run as a reader knows it: its side (the target's label, if any) and its load; never its URL."""
    side = run.target.label
    return f"{side} @ {run_load(run)}" if side else run_load(run)


def _latencies_ms(run: RunResult, metric: str) -> list[float]:
    done = [r for r in run.results if r.success and not r.warmup]
    if metric == "ttft":
        return [r.ttft_s * 1000 for r in done]
    if metric == "tpot":
        return [t * 1000 for r in done if (t := tpot_s(r)) is not None]
    if metric == "itl":
        return [g * 1000 for r in done for g in r.itl_s]
    return [r.latency_s * 1000 for r in done]


def _cell(st: Stats, q: float) -> str:
    if not st.count:
        return "-"
    return f"{st.percentiles.get(q, st.median if q == 50 else float('nan')):.1f}"


def _table(heads: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in heads) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _who(run: RunResult, with_side: bool) -> list[str]:
    return [run.target.label, run_load(run)] if with_side else [run_load(run)]


def _summary_table(runs: Sequence[RunResult], with_side: bool) -> str:
    heads = [*(["side"] if with_side else []), "load", "completed", "failed", "req/s", "goodput", "SLO att.",
             "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p90", "TPOT p99", "ITL p99", "ITL spikes",
             "paths"]  # fmt: skip
    rows = []
    for run in runs:
        s = run.summary
        rows.append([
            *_who(run, with_side), str(s.completed), str(s.failed), f"{s.request_throughput:.2f}",
            "-" if s.request_goodput is None else f"{s.request_goodput:.2f}",
            "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.0f}%",
            _cell(s.ttft, 50.0), _cell(s.ttft, 90.0), _cell(s.ttft, 99.0),
            _cell(s.tpot, 50.0), _cell(s.tpot, 90.0), _cell(s.tpot, 99.0), _cell(s.itl, 99.0),
            _spike_cell(s.itl_spikes), ", ".join(f"{k} {v}" for k, v in sorted(s.paths.items())),
        ])  # fmt: skip
    return _table(heads, rows)


def _spike_cell(sp: Spikes) -> str:
    return f"{sp.gaps} in {sp.requests} req" if sp.gaps else "0"


def _kind_table(runs: Sequence[RunResult], with_side: bool) -> str:
    """TTFT, TPOT and ITL per request kind (``short``/``long`` of ``mixed``), when a run has several kinds."""
    if not any(run.summary.by_kind for run in runs):
        return ""
    heads = [*(["side"] if with_side else []), "load", "kind", "requests", "TTFT p50", "TTFT p90", "TTFT p99",
             "TPOT p50", "TPOT p90", "TPOT p99", "ITL p99", "ITL max", "ITL spikes"]  # fmt: skip
    rows = []
    for run in runs:
        for kind, d in sorted(run.summary.by_kind.items(), key=lambda kv: kv[0] != "short"):
            ttft, tpot, itl = d["ttft"], d["tpot"], d["itl"]
            rows.append([
                *_who(run, with_side), kind, str(ttft.count), _cell(ttft, 50.0), _cell(ttft, 90.0),
                _cell(ttft, 99.0), _cell(tpot, 50.0), _cell(tpot, 90.0), _cell(tpot, 99.0), _cell(itl, 99.0),
                f"{itl.max:.1f}" if itl.count else "-", _spike_cell(run.summary.spikes_by_kind[kind]),
            ])  # fmt: skip
    threshold = next(r.summary.itl_spikes.threshold_ms for r in runs if r.summary.by_kind)
    return (
        "<h2>By request kind</h2>"
        f"<p>ITL spikes: gaps between chunks over {threshold:.0f} ms (the TPOT SLO, else {SPIKE_WORDS}), and in "
        "how many requests.</p>" + _table(heads, rows)
    )


SPIKE_WORDS = f"{SPIKE_FACTOR:g}× the run's ITL median"


def _engine_table(runs: Sequence[RunResult], with_side: bool) -> str:
    """vLLM's own view of each run, per endpoint: its latency histograms' means and its batch gauges, beside the
    client's means, so the two can be cross-checked."""
    rows = []
    for run in runs:
        engines = engine_summary(run.metric_deltas)
        s = run.summary
        client = ["client", f"{s.completed}", f"{s.ttft.mean:.1f}", f"{s.tpot.mean:.1f}", f"{s.itl.mean:.1f}",
                  f"{s.e2el.mean:.1f}", "-", "-", "-", "-"]  # fmt: skip
        if not engines and not run.gauges:
            continue
        rows.append([*_who(run, with_side), *client])
        for url in dict.fromkeys([*engines, *run.gauges]):
            e = engines.get(url, {})
            g = run.gauges[url].stats() if url in run.gauges else {}

            def ms(key: str, e: dict[str, float] = e) -> str:
                return f"{e[key]:.1f}" if key in e else "-"

            def gauge(key: str, g: dict[str, float] = g) -> str:
                return f"{g[key]:.1f}" if key in g else "-"

            seen_by = run.target.metrics_names.get(url) or _endpoint(url)
            rows.append([
                *_who(run, with_side), seen_by, f"{e.get('requests', 0):.0f}", ms("ttft_ms"), ms("tpot_ms"),
                ms("itl_ms"), ms("e2el_ms"), ms("queue_ms"), ms("prefill_ms"),
                gauge("running_mean") + " / " + gauge("running_max"), gauge("waiting_max"),
            ])  # fmt: skip
    if not rows:
        return ""
    heads = [*(["side"] if with_side else []), "load", "seen by", "requests", "TTFT mean", "TPOT mean", "ITL mean",
             "E2EL mean", "queue mean", "prefill mean", "running mean / max", "waiting max"]  # fmt: skip
    return (
        "<h2>The engines' own view (vLLM /metrics) against the client's</h2>"
        "<p>Means in ms from the deltas of vLLM's histograms over the run; running/waiting requests sampled "
        "every second while it ran. On PD, prefill's TTFT is its whole leg and decode's starts when decode "
        "received the request, so only the client's TTFT includes both. The workers keep their config names on a "
        "colocated side too, where each serves whole requests.</p>" + _table(heads, rows)
    )


def _endpoint(url: str) -> str:
    """``http://127.0.0.1:8100/metrics`` -> ``127.0.0.1:8100``: which worker, without the scheme and path."""
    return url.split("://", 1)[-1].removesuffix("/metrics")


def best_swept_rate(runs: Sequence[RunResult]) -> dict[str, float | None]:
    """Per side, the highest swept rate whose run met the SLO attainment target (None: none did).

    A lower bound of the max-goodput rate from a sweep; ``--max-goodput`` searches for the rate itself.
    """
    out: dict[str, float | None] = {}
    for run in runs:
        side = run.target.label
        if run.summary.slo_met is None or not math.isfinite(run.shape.rate):
            continue
        best = out.get(side)
        if run.summary.slo_met and (best is None or run.shape.rate > best):
            out[side] = run.shape.rate
        else:
            out.setdefault(side, None)
    return out


def _kv_table(runs: Sequence[RunResult], with_side: bool) -> str:
    rows = []
    for run in runs:
        if run.metric_deltas:
            kv = kv_summary(run.metric_deltas)
            done = run.summary.completed
            rows.append([
                *_who(run, with_side), f"{kv['kv_transfers']:.0f}", f"{kv['kv_bytes'] / 1e6:.2f}",
                f"{kv['kv_xfer_ms_mean']:.2f}", f"{kv['kv_failed_transfers']:.0f}", f"{kv['external_kv_tokens']:.0f}",
                f"{kv['external_kv_tokens'] / done:.1f}" if done else "-",
            ])  # fmt: skip
    if not rows:
        return ""
    heads = [*(["side"] if with_side else []), "load", "transfers", "MB", "mean ms", "failed", "external KV tokens",
             "per completed request"]  # fmt: skip
    return "<h2>KV transfer during the run (workers' /metrics deltas)</h2>" + _table(heads, rows)


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
            engine = run.target.metrics_names.get(url) or _endpoint(url)
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


def _sections(runs: Sequence[RunResult]) -> str:
    return "".join(
        f"<h2>{html.escape(head)}</h2><div class='plots'>{''.join(image for _, image in plots)}</div>"
        for head, plots in plot_groups(runs)
    )


def render_html(
    runs: Sequence[RunResult],
    *,
    title: str = "pdctl bench",
    search: SearchResult | None = None,
    searches: Mapping[str, SearchResult] | None = None,
) -> str:
    """A self-contained HTML report of ``runs``: tables, then the plots of :func:`plot_groups`. ``searches``: one
    max-goodput search per side (``--ab --max-goodput``)."""
    with_side = any(r.target.label for r in runs)
    notes: list[str] = []
    for side, found in ([("", search)] if search is not None else []) + list((searches or {}).items()):
        best = "none of the probed rates" if found.best_rate is None else f"{found.best_rate:.3g} req/s"
        notes.append(
            f"<p><b>Max goodput rate{html.escape(' of ' + side if side else '')}</b> "
            f"(≥ {100 * found.attainment_target:.0f}% of requests within every SLO): {html.escape(best)}</p>"
        )
    swept = best_swept_rate(runs) if len({r.shape.rate for r in runs}) > 1 else {}
    for side, rate in swept.items():
        text = "none of the swept rates" if rate is None else f"{rate:g} req/s"
        notes.append(
            f"<p><b>Highest swept rate within the SLOs</b>{' (' + html.escape(side) + ')' if side else ''}: "
            f"{html.escape(text)}</p>"
        )
    for run in runs:
        for w in run.warnings:
            notes.append(f'<p class="warn">{html.escape(run_name(run))}: {html.escape(w)}</p>')
    slo = next((r.summary.slo for r in runs if r.summary.slo is not None), None)
    slo_text = "no SLO given" if slo is None else ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.as_dict().items())
    style = (
        "body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}"
        "td:first-child,th:first-child{text-align:left}h2{font-size:18px;margin:20px 0 6px}"
        ".plots{display:flex;flex-wrap:wrap;gap:12px;margin-bottom:8px}.warn{color:#a40}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>SLOs: {html.escape(slo_text)}. Latencies in ms; TTFT = send → first content chunk, "
        "TPOT = (E2EL − TTFT)/(output tokens − 1), ITL = gaps between chunks (vLLM definitions).</p>"
        + "".join(notes)
        + _summary_table(runs, with_side)
        + _kind_table(runs, with_side)
        + _kv_table(runs, with_side)
        + _engine_table(runs, with_side)
        + _sections(runs)
        + f"<p style='color:#888'>pdctl {html.escape(__version__)}</p></body></html>"
    )
