"""``pdctl bench``'s inputs and tables: settings, workload and SLO arguments, the live line, the result tables.

Imported by the command only when it runs: it pulls in the bench client (aiohttp, httpx), which every other
command, the gateway process included, would otherwise pay for at start.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdctl import config
from pdctl.bench.engine_metrics import engine_summary, kv_summary, prefix_cache_summary
from pdctl.bench.metrics import SLO, Summary, parse_goodput
from pdctl.bench.report import best_swept_rate, compare, engine_name, run_load
from pdctl.bench.runner import BenchError, LiveStats, PairResult, RunResult
from pdctl.bench.workload import WorkloadSpec
from pdctl.cli._app import console, err_console

__all__ = [
    "BenchContext",
    "Progress",
    "goodput_slo",
    "load_context",
    "parse_percentiles",
    "parse_range",
    "parse_sides",
    "render_compare",
    "render_pairs",
    "render_runs",
    "workload_spec",
]


@dataclass(frozen=True, slots=True)
class BenchContext:
    gateway_url: str | None
    model: str | None
    api_key_env: str
    slo: SLO | None
    metrics_urls: tuple[str, ...]
    metrics_names: dict[str, str]


def load_context(config_path: Path | None, settings_path: Path | None, attainment: float | None) -> BenchContext:
    cpath = config_path or Path(config.DEFAULT_CONFIG)
    spath = settings_path or Path(config.DEFAULT_SETTINGS)
    if cpath.exists() and spath.exists():
        dep = config.load(cpath, spath)
        slo = dep.slo
        names = {f"{w.url}/metrics": w.name for w in dep.workers} | {f"{dep.gateway.url}/metrics": "gateway"}
        return BenchContext(
            dep.gateway.url,
            dep.decode[0].model_name,
            dep.gateway.api_key_env,
            SLO(slo.ttft_ms, slo.tpot_ms, None, attainment or (0.9 if slo.p90 else 0.99)),
            tuple(names),
            names,
        )
    if config_path is not None and not cpath.exists():
        raise BenchError(f"{cpath}: no such file", hint="give -c config.toml, or --gateway URL alone")
    if spath.exists():
        read = config.load_settings(spath)
        gateway, slo = read.gateway, read.slo
        return BenchContext(
            gateway.url,
            None,
            gateway.api_key_env,
            SLO(slo.ttft_ms, slo.tpot_ms, None, attainment or (0.9 if slo.p90 else 0.99)),
            (f"{gateway.url}/metrics",),
            {f"{gateway.url}/metrics": "gateway"},
        )
    if settings_path is not None:
        raise BenchError(f"{spath}: no such file", hint="give -s settings.json, or --gateway URL alone")
    return BenchContext(None, None, "PDCTL_API_KEY", None, (), {})


def workload_spec(name: str, seed: int, unique: bool, **params: Any) -> WorkloadSpec:
    path: str | None = None
    kind, sep, rest = name.partition(":")
    if kind in ("sharegpt", "trace"):
        if not sep or not rest:
            raise BenchError(f"--workload {kind} needs a file", hint=f"use --workload {kind}:PATH")
        path = rest
    elif sep:
        raise BenchError(f"--workload {name!r}: only sharegpt and trace take a file")
    return WorkloadSpec(name=kind, path=path, seed=seed, unique=unique, **params)


def goodput_slo(items: Sequence[str], extra: Sequence[str], attainment: float | None) -> SLO | None:
    leftovers = [a for a in extra if a.split(":", 1)[0].lower() not in ("ttft", "tpot", "e2el")]
    if leftovers:
        raise BenchError(f"unexpected argument(s): {' '.join(leftovers)}", hint="see pdctl bench --help")
    all_items = list(items) + list(extra)
    if not all_items:
        return None
    try:
        return parse_goodput(all_items, attainment if attainment is not None else 0.9)
    except ValueError as exc:
        raise BenchError(str(exc), hint="e.g. --goodput ttft:400 tpot:40 (milliseconds)") from None


def parse_range(flag: str, text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (integers) -> ``(MIN, MAX)``; the bounds themselves are checked by the workload."""
    lo, sep, hi = text.partition(":")
    try:
        low = int(lo)
        return (low, int(hi) if sep else low)
    except ValueError:
        raise BenchError(f"{flag}: cannot read {text!r}", hint=f"give N or MIN:MAX, e.g. {flag} 6:9") from None


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise BenchError(f"--percentiles: cannot read {text!r}", hint="e.g. --percentiles 50,90,99") from None
    if not values or any(not 0 < p < 100 for p in values):
        raise BenchError(f"--percentiles: values must be in (0, 100), got {text!r}")
    return tuple(sorted(set(values)))


# -------------------------------------------------------------------------------------------- render


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "inf"
    return f"{value:.{digits}f}"


def _live_view(live: LiveStats) -> RenderableType:
    p_ttft, p_tpot = live.p50(live.ttfts_ms), live.p50(live.tpots_ms)
    total = f"/{live.total}" if live.total else ""
    return Text(
        f"{live.phase}: sent {live.sent}{total} ok {live.completed} failed {live.failed} | "
        f"p50 TTFT {_fmt(p_ttft, 1)} ms, TPOT {_fmt(p_tpot, 1)} ms | {live.label}"
    )


class Progress:
    """One live line per run, shown while it runs (only on a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and console.is_terminal
        self.current = LiveStats()

    def start(self, label: str, rate: float) -> LiveStats:
        self.current = LiveStats(label=label)
        return self.current

    @contextlib.contextmanager
    def show(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with Live(
            get_renderable=lambda: _live_view(self.current), console=console, refresh_per_second=4, transient=True
        ):
            yield


def _run_name(run: RunResult) -> str:
    rate = run.shape.rate
    load = f"{rate:g}/s" if math.isfinite(rate) else "rate inf"
    if run.target.workload.conversational:
        load = run_load(run)
    elif run.shape.concurrency:
        load += f" c={run.shape.concurrency}"
    return f"{run.target.label}\n{load}" if run.target.label else load


def _summary_rows(s: Summary) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [
        ("completed / failed", f"{s.completed} / {s.failed}" + (f" ({s.rejected} rejected)" if s.rejected else "")),
        ("duration (s)", _fmt(s.duration_s)),
        ("request throughput (req/s)", _fmt(s.request_throughput)),
        ("output throughput (tok/s)", _fmt(s.output_throughput, 1)),
        ("total token throughput (tok/s)", _fmt(s.total_token_throughput, 1)),
    ]
    if s.slo is not None:
        rows.append(("request goodput (req/s)", _fmt(s.request_goodput)))
        met = "met" if s.slo_met else "missed"
        rows.append(
            (
                f"SLO attainment (target {100 * s.slo.attainment:.0f}%)",
                f"{100 * (s.slo_attainment or 0):.1f}% {met}",
            )
        )
    for name, st in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2EL", s.e2el)):
        rows.append((f"{name} mean / median (ms)", f"{_fmt(st.mean)} / {_fmt(st.median)}"))
        pct = "  ".join(f"p{p:g} {_fmt(v)}" for p, v in st.percentiles.items())
        rows.append((f"{name} percentiles (ms)", pct))
    if s.prefill_leg.count:
        rows.append(("prefill leg p50 (ms, x-pd-prefill-ms)", _fmt(s.prefill_leg.median)))
        rows.append(("TTFT after prefill p50 (ms)", _fmt(s.ttft_after_prefill.median)))
    if s.paths and set(s.paths) != {"unknown"}:
        rows.append(("paths", ", ".join(f"{k} {v}" for k, v in sorted(s.paths.items()))))
    rows.append(("client lag p99 / max (ms)", f"{_fmt(s.lag.percentiles.get(99.0, s.lag.max))} / {_fmt(s.lag.max)}"))
    for kind, d in sorted(s.by_kind.items()):
        for name in ("ttft", "tpot"):
            st = d[name]
            pct = " / ".join(_fmt(v) for v in (st.median, st.percentiles.get(90.0), st.percentiles.get(99.0)))
            rows.append((f"[{kind}] {name.upper()} p50 / p90 / p99 (ms)", pct))
        rows.append((f"[{kind}] ITL max (ms)", _fmt(d["itl"].max if d["itl"].count else None)))
        sp = s.spikes_by_kind[kind]
        rows.append((f"[{kind}] ITL spikes > {sp.threshold_ms:.0f} ms (gaps / requests)", f"{sp.gaps} / {sp.requests}"))
    sp = s.itl_spikes
    rows.append((f"ITL spikes > {sp.threshold_ms:.0f} ms (gaps / requests)", f"{sp.gaps} / {sp.requests}"))
    for group, d in s.turn_groups.items():
        name = "turn 1" if group == "1" else "turns 2+"
        for metric in ("ttft", "tpot"):
            st = d[metric]
            rows.append(
                (f"[{name}] {metric.upper()} p50 / p90 (ms)", f"{_fmt(st.median)} / {_fmt(st.percentiles.get(90.0))}")
            )
    for turn, d in s.by_turn.items():
        st = d["ttft"]
        rows.append(
            (
                f"[turn {turn}] TTFT p50 / p90 (ms), prompt tokens p50",
                f"{_fmt(st.median)} / {_fmt(st.percentiles.get(90.0))}, {_fmt(d['prompt_tokens'].median, 0)}",
            )
        )
    return rows


def _engine_rows(run: RunResult) -> list[tuple[str, str]]:
    """The engines' prefix-cache hit rates and the KV moved over the run, from the workers' counters."""
    rows: list[tuple[str, str]] = []
    for url, pc in prefix_cache_summary(run.metric_deltas).items():
        name = engine_name(run, url)
        value = f"{100 * pc['hit_rate']:.1f}% of {pc['queries']:.0f} tokens"
        if pc["external_hits"]:
            value += f" (+{pc['external_hits']:.0f} from KV transfer)"
        rows.append((f"prefix cache hits [{name}]", value))
    kv = kv_summary(run.metric_deltas) if run.metric_deltas else {}
    if kv.get("kv_transfers") or kv.get("kv_bytes"):
        rows.append(("KV moved (MB / transfers)", f"{kv['kv_bytes'] / 1e6:.2f} / {kv['kv_transfers']:.0f}"))
    return rows


def render_runs(runs: Sequence[RunResult], per_table: int = 4) -> None:
    """The final tables: metrics as rows, one column per run, at most ``per_table`` runs a table (an 80-column
    terminal keeps the metric names whole; an A/B passes its number of sides, so each table is one load)."""
    for start in range(0, len(runs), max(1, per_table)):
        chunk = runs[start : start + max(1, per_table)]
        table = Table(title="pdctl bench", title_justify="left", show_lines=False)
        table.add_column("metric")
        for run in chunk:
            table.add_column(Text(_run_name(run)), justify="right")
        rows_per_run = [dict(_summary_rows(run.summary) + _engine_rows(run)) for run in chunk]
        keys = list(dict.fromkeys(k for rows in rows_per_run for k in rows))
        for key in keys:
            table.add_row(Text(key), *(Text(rows.get(key, "-")) for rows in rows_per_run))
        console.print(table)
    for run in runs:
        if run.metric_deltas:
            kv = kv_summary(run.metric_deltas)
            if kv["kv_transfers"] or kv["external_kv_tokens"]:
                console.print(
                    Text(
                        f"KV ({_run_name(run).replace(chr(10), ' ')}): {kv['kv_transfers']:.0f} transfers, "
                        f"{kv['kv_bytes'] / 1e6:.2f} MB, mean {kv['kv_xfer_ms_mean']:.2f} ms, "
                        f"{kv['kv_failed_transfers']:.0f} failed, {kv['external_kv_tokens']:.0f} external KV tokens"
                    )
                )
        for url, e in engine_summary(run.metric_deltas).items():
            means = ", ".join(f"{k.removesuffix('_ms').upper()} {v:.1f}" for k, v in e.items() if k.endswith("_ms"))
            console.print(
                Text(
                    f"vLLM ({_run_name(run).replace(chr(10), ' ')}, {run.target.metrics_names.get(url, url)}): "
                    f"{e['requests']:.0f} requests, "
                    f"mean ms {means}"
                )
            )
        for warning in run.warnings:
            err_console.print(Text(f"warning: {warning}", style="yellow"))
    swept = best_swept_rate(runs) if len({r.shape.rate for r in runs}) > 1 else {}
    for side, rate in swept.items():
        best = "none of the swept rates" if rate is None else f"{rate:g} req/s"
        console.print(Text(f"highest swept rate within the SLOs{' (' + side + ')' if side else ''}: {best}"))


def render_compare(a: dict[str, Any], b: dict[str, Any], name_a: str, name_b: str) -> None:
    """Two results side by side with the ratio B / A and the better side."""
    table = Table(title=Text(f"{name_b} vs {name_a}"), title_justify="left")
    for col, justify in (
        ("metric", "left"),
        (name_a, "right"),
        (name_b, "right"),
        ("B/A", "right"),
        ("better", "left"),
    ):
        table.add_column(Text(col), justify=justify)  # type: ignore[arg-type]
    for row in compare(a, b):
        better = {"A": name_a, "B": name_b, "=": "="}.get(row.better, "")
        table.add_row(row.key, _fmt(row.a), _fmt(row.b), _fmt(row.ratio, 3), Text(better))
    console.print(table)


def render_pairs(pair: PairResult, name_a: str, name_b: str, title: str) -> None:
    """Admission on/off (or A/B) per rate, as one table."""
    table = Table(title=title, title_justify="left")
    for col in ("rate", "side", "goodput", "attainment", "completed", "failed", "rejected", "TTFT p90", "TPOT p90"):
        table.add_column(col, justify="right")
    for ra, rb in zip(pair.a, pair.b, strict=True):
        for name, run in ((name_a, ra), (name_b, rb)):
            s = run.summary
            table.add_row(
                _fmt(run.shape.rate, 2),
                Text(name),
                _fmt(s.request_goodput),
                "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.1f}%",
                str(s.completed),
                str(s.failed),
                str(s.rejected),
                _fmt(s.ttft.percentiles.get(90.0)),
                _fmt(s.tpot.percentiles.get(90.0)),
            )
    console.print(table)


def parse_sides(specs: list[str], taken: tuple[str, ...]) -> list[tuple[str, str]]:
    """``--ab-side NAME=URL`` values as (name, URL), each name new."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise BenchError(f"--ab-side {spec!r}: expected NAME=URL",
                             hint="e.g. --ab-side adaptive=http://127.0.0.1:8002")  # fmt: skip
        if name in taken or name in (n for n, _ in out):
            raise BenchError(f"--ab-side {spec!r}: the side name {name!r} is taken",
                             hint="give each side its own name")  # fmt: skip
        out.append((name, url))
    return out
