"""Results people can read and tools can parse.

* :func:`result_json` -- one run as a ``vllm bench serve`` result object (same key names and units: latencies
  in ms in the statistics, seconds in the per-request arrays ``ttfts``/``itls``/``latencies``), with pdctl's
  extras under the ``"pdctl"`` key. Several runs are written as a JSON list of such objects.
* :func:`load_results` / :func:`compare` -- two result files side by side with ratios (B / A).
* :func:`run_name` / :func:`run_load` / :func:`engine_name` -- runs named by side and load, never by URL, and their
  engines by role or host:port; :func:`best_swept_rate` -- per side, the highest swept rate within the SLOs.

The HTML report is :mod:`pdctl.bench.html`; its plots, also written as SVG files, :mod:`pdctl.bench.plots`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl import __version__
from pdctl.bench.engine_metrics import engine_summary, kv_summary, prefix_cache_summary
from pdctl.bench.metrics import Spikes, Stats, Summary, tpot_s
from pdctl.bench.runner import RunResult, SearchResult
from pdctl.errors import PdctlError

__all__ = [
    "COMPARE_KEYS",
    "CompareRow",
    "ReportError",
    "best_swept_rate",
    "compare",
    "engine_name",
    "load_results",
    "percentile_key",
    "result_json",
    "run_load",
    "run_name",
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


#: The API an agent client's workload speaks (``endpoint_type`` / ``backend`` in the results).
_API = {"claude-code": "anthropic-messages", "codex": "openai-responses"}


def result_json(run: RunResult) -> dict[str, Any]:
    """One run as a ``vllm bench serve`` result object plus ``"pdctl"`` extras."""
    s: Summary = run.summary
    t, shape = run.target, run.shape
    api = _API.get(t.workload.name) or ("openai-chat" if t.endpoint == "chat" else "openai")
    measured = [r for r in run.results if not r.warmup]
    out: dict[str, Any] = {
        "date": run.date,
        "endpoint_type": api,
        "backend": api,
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
        "by_turn": {k: {m: _stats_dict(v) for m, v in d.items()} for k, d in s.by_turn.items()},
        "turn_groups": {k: {m: _stats_dict(v) for m, v in d.items()} for k, d in s.turn_groups.items()},
        "kv_transfer": kv,
        "prefix_cache": {
            url: {"name": engine_name(run, url), **v} for url, v in prefix_cache_summary(run.metric_deltas).items()
        },
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
    if any(r.turn is not None for r in measured):
        out["pdctl"]["requests"]["conversation"] = [r.conversation for r in measured]
        out["pdctl"]["requests"]["turn"] = [r.turn for r in measured]
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
    if name in ("agent", "claude-code", "codex"):
        return {"conversations": spec.conversations, "turns": list(spec.turns), "system_len": spec.system_len,
                "context_len": spec.context_len, "user_len": list(spec.user_len),
                "answer_len": list(spec.answer_len)}  # fmt: skip
    if name == "shared-prefix":
        return {"groups": spec.groups, "prompts_per_group": spec.prompts_per_group, "system_len": spec.system_len,
                "question_len": spec.question_len, "output_len": spec.output_len}  # fmt: skip
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


def run_load(run: RunResult) -> str:
    """What load a run was under, in words: ``8 req/s``, ``4 req/s, ≤ 16 in flight``, ``closed loop, 8 in flight``."""
    shape = run.shape
    wl = run.target.workload
    if wl.conversational:
        n = wl.spec.conversations
        if math.isfinite(shape.rate):
            text = f"{shape.rate:g} conversations/s"
        else:
            text = f"{n} conversations at once" if not shape.concurrency else f"{n} conversations"
        if shape.concurrency:
            text += f", ≤ {shape.concurrency} in flight"
    elif wl.timed:
        text = f"trace at {wl.spec.trace_speed:g}x"
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


def engine_name(run: RunResult, url: str) -> str:
    """One of a run's metrics URLs as a reader knows it: its name in the target (``prefill``, ``decode``,
    ``gateway``), else which worker without the scheme and path (``http://127.0.0.1:8100/metrics`` ->
    ``127.0.0.1:8100``)."""
    return run.target.metrics_names.get(url) or url.split("://", 1)[-1].removesuffix("/metrics")


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
