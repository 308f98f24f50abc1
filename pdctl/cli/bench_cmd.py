"""``pdctl bench``: measure TTFT/TPOT/ITL/goodput against the gateway (or any OpenAI-compatible server)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdctl import config
from pdctl.bench.arrivals import parse_rates
from pdctl.bench.metrics import SLO, Summary, parse_goodput
from pdctl.bench.report import compare, load_results, render_html, result_json, write_results
from pdctl.bench.runner import (
    BenchError,
    BenchTarget,
    LiveStats,
    LoadShape,
    PairResult,
    RunResult,
    SearchResult,
    kv_summary,
    run_ab,
    run_async,
    run_sweep,
    search_max_goodput_rate,
)
from pdctl.bench.workload import WorkloadSpec, make_workload
from pdctl.cli._app import app, console, err_console, handle_errors

__all__ = ["bench"]


@dataclass(frozen=True, slots=True)
class _Context:
    gateway_url: str | None
    model: str | None
    api_key_env: str
    slo: SLO | None
    metrics_urls: tuple[str, ...]


def _load_context(config_path: Path | None, settings_path: Path | None, attainment: float | None) -> _Context:
    cpath = config_path or Path(config.DEFAULT_CONFIG)
    spath = settings_path or Path(config.DEFAULT_SETTINGS)
    if cpath.exists() and spath.exists():
        dep = config.load(cpath, spath)
        slo = dep.slo
        urls = (*(f"{w.url}/metrics" for w in dep.workers), f"{dep.gateway.url}/metrics")
        return _Context(
            dep.gateway.url,
            dep.decode[0].model_name,
            dep.gateway.api_key_env,
            SLO(slo.ttft_ms, slo.tpot_ms, None, attainment or (0.9 if slo.p90 else 0.99)),
            urls,
        )
    if config_path is not None and not cpath.exists():
        raise BenchError(f"{cpath}: no such file", hint="give -c config.toml, or --gateway URL alone")
    if spath.exists():
        gateway, _routing, slo, _logging = config.load_settings(spath)
        return _Context(
            gateway.url,
            None,
            gateway.api_key_env,
            SLO(slo.ttft_ms, slo.tpot_ms, None, attainment or (0.9 if slo.p90 else 0.99)),
            (f"{gateway.url}/metrics",),
        )
    if settings_path is not None:
        raise BenchError(f"{spath}: no such file", hint="give -s settings.json, or --gateway URL alone")
    return _Context(None, None, "PDCTL_API_KEY", None, ())


def _discover_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=10.0)
        data = resp.json().get("data") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        data = None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return str(data[0]["id"])
    raise BenchError(f"cannot tell which model {url} serves", hint="pass --model NAME (or -c config.toml)")


def _workload_spec(name: str, seed: int, unique: bool, **params: Any) -> WorkloadSpec:
    path: str | None = None
    kind, sep, rest = name.partition(":")
    if kind in ("sharegpt", "trace"):
        if not sep or not rest:
            raise BenchError(f"--workload {kind} needs a file", hint=f"use --workload {kind}:PATH")
        path = rest
    elif sep:
        raise BenchError(f"--workload {name!r}: only sharegpt and trace take a file")
    return WorkloadSpec(name=kind, path=path, seed=seed, unique=unique, **params)


def _goodput(items: Sequence[str], extra: Sequence[str], attainment: float | None) -> SLO | None:
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


def _percentiles(text: str) -> tuple[float, ...]:
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


class _Progress:
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
    if run.shape.concurrency:
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
        rows.append(
            (f"[{kind}] TPOT p50 / p90 (ms)", f"{_fmt(d['tpot'].median)} / {_fmt(d['tpot'].percentiles.get(90.0))}")
        )
    return rows


def render_runs(runs: Sequence[RunResult]) -> None:
    """The final table: metrics as rows, one column per run."""
    table = Table(title="pdctl bench", title_justify="left", show_lines=False)
    table.add_column("metric")
    for run in runs:
        table.add_column(Text(_run_name(run)), justify="right")
    rows_per_run = [dict(_summary_rows(run.summary)) for run in runs]
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
        for warning in run.warnings:
            err_console.print(Text(f"warning: {warning}", style="yellow"))


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


# --------------------------------------------------------------------------------------------- command


@app.command(context_settings={"allow_extra_args": True})
@handle_errors
def bench(
    ctx: typer.Context,
    gateway: Annotated[
        str | None, typer.Option("--gateway", "--url", help="Base URL to load (default: the config's gateway).")
    ] = None,
    config_path: Annotated[Path | None, typer.Option("-c", "--config", help="config.toml (model, workers).")] = None,
    settings_path: Annotated[
        Path | None, typer.Option("-s", "--settings", help="settings.json (gateway, slo).")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model name (default: from the config).")] = None,
    endpoint: Annotated[str, typer.Option("--endpoint", help="chat or completions.")] = "chat",
    workload: Annotated[
        str, typer.Option("--workload", "-w", help="doc | random | mixed | sharegpt:FILE | trace:FILE.")
    ] = "doc",
    input_len: Annotated[int, typer.Option("--input-len", help="random: mean input tokens.")] = 1024,
    output_len: Annotated[int, typer.Option("--output-len", help="random/mixed: mean output tokens.")] = 128,
    range_ratio: Annotated[float, typer.Option("--range-ratio", help="Lengths uniform in L(1±r).")] = 0.0,
    prefix_len: Annotated[int, typer.Option("--prefix-len", help="random: shared prefix tokens.")] = 0,
    short_len: Annotated[int, typer.Option("--short-len", help="mixed: short prompt tokens.")] = 128,
    long_len: Annotated[int, typer.Option("--long-len", help="mixed: long prompt tokens.")] = 4096,
    long_output_len: Annotated[int, typer.Option("--long-output-len", help="mixed: long prompts' output.")] = 16,
    long_fraction: Annotated[float, typer.Option("--long-fraction", help="mixed: share of long prompts.")] = 0.1,
    trace_speed: Annotated[float, typer.Option("--trace-speed", help="trace: replay speed factor.")] = 1.0,
    repeat_prompts: Annotated[
        bool, typer.Option("--repeat-prompts", help="Do not make prompts unique (lets prefix caching hit).")
    ] = False,
    rate: Annotated[str | None, typer.Option("--rate", "-r", help="Requests/s: 2 | 1,2,4 | 1:8:1 | inf.")] = None,
    burstiness: Annotated[float, typer.Option("--burstiness", help="Gamma shape: 1 Poisson, <1 burstier.")] = 1.0,
    concurrency: Annotated[int | None, typer.Option("--concurrency", help="Max requests in flight.")] = None,
    num_requests: Annotated[int | None, typer.Option("--num-requests", "-n", help="Requests per run.")] = None,
    duration: Annotated[float | None, typer.Option("--duration", help="Seconds per run (instead of -n).")] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up requests, excluded.", min=0)] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of workload and arrivals.")] = 0,
    goodput: Annotated[
        list[str] | None, typer.Option("--goodput", help="SLOs in ms: ttft:400 tpot:40 (also e2el:MS).")
    ] = None,
    attainment: Annotated[
        float | None, typer.Option("--slo-attainment", help="Share of requests that must meet the SLOs.")
    ] = None,
    no_slo: Annotated[bool, typer.Option("--no-slo", help="Ignore slo.* from settings.json.")] = False,
    percentiles: Annotated[str, typer.Option("--percentiles", help="e.g. 50,90,99.")] = "50,90,99",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write results JSON here.")] = None,
    html: Annotated[Path | None, typer.Option("--html", help="Write a self-contained HTML report here.")] = None,
    compare_files: Annotated[
        list[Path] | None, typer.Option("--compare", help="A results file (twice: compare two files, no run).")
    ] = None,
    ab: Annotated[bool, typer.Option("--ab", help="Also run against --ab-gateway (colocated) and compare.")] = False,
    ab_gateway: Annotated[
        str | None, typer.Option("--ab-gateway", help="Base URL of the colocated deployment for --ab.")
    ] = None,
    admission_off_gateway: Annotated[
        str | None,
        typer.Option("--admission-off-gateway", help="Gateway with slo.admission=false: compare goodput on/off."),
    ] = None,
    max_goodput: Annotated[
        bool, typer.Option("--max-goodput", help="Search the highest rate meeting the SLOs (DistServe).")
    ] = False,
    search_start: Annotated[float, typer.Option("--search-start", help="First rate of the search.")] = 1.0,
    search_max: Annotated[float, typer.Option("--search-max", help="Highest rate the search tries.")] = 256.0,
    metrics_url: Annotated[
        list[str] | None, typer.Option("--metrics-url", help="Extra /metrics URL to diff (repeatable).")
    ] = None,
    no_metrics: Annotated[bool, typer.Option("--no-metrics", help="Do not scrape /metrics.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds allowed per request.", min=0.1)] = 600.0,
    label: Annotated[str | None, typer.Option("--label", help="Name of this run in outputs.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Live progress line.")] = True,
) -> None:
    """Load a deployment and report TTFT, TPOT, ITL, throughput and goodput (vLLM's definitions).

    The API key is read from the variable named by gateway.api_key_env (never from the command line).
    Examples: `pdctl bench -w random --rate 1,2,4 -n 200 -o r.json --html r.html`;
    `pdctl bench --compare a.json --compare b.json`.
    """
    files = compare_files or []
    if len(files) > 2:
        raise BenchError("--compare takes one file (compare with this run) or two (compare them)")
    if len(files) == 2:
        a, b = load_results(files[0])[-1], load_results(files[1])[-1]
        render_compare(a, b, files[0].name, files[1].name)
        return

    cx = _load_context(config_path, settings_path, attainment)
    base_url = gateway or cx.gateway_url
    if base_url is None:
        raise BenchError("no target", hint="give --gateway URL, or run in the folder of config.toml/settings.json")
    api_key = os.environ.get(cx.api_key_env) or None
    if api_key is None and cx.gateway_url is not None and gateway is None:
        err_console.print(Text(f"warning: ${cx.api_key_env} is not set; the gateway will answer 401", style="yellow"))
    if endpoint not in ("chat", "completions"):
        raise BenchError(f"--endpoint: expected chat or completions, got {endpoint!r}")
    slo = _goodput(goodput or [], ctx.args, attainment)
    if slo is None and not no_slo:
        slo = cx.slo
    pcts = _percentiles(percentiles)
    spec = _workload_spec(
        workload,
        seed,
        not repeat_prompts,
        input_len=input_len,
        output_len=output_len,
        range_ratio=range_ratio,
        prefix_len=prefix_len,
        short_len=short_len,
        long_len=long_len,
        long_output_len=long_output_len,
        long_fraction=long_fraction,
        trace_speed=trace_speed,
    )
    wl = make_workload(spec)
    rates = parse_rates(rate) if rate is not None else [math.inf]
    if rate is None and concurrency is None and not wl.timed and not max_goodput:
        concurrency = 1
    if num_requests is None and duration is None:
        num_requests = None if wl.timed else 100
    shape = LoadShape(
        rate=rates[0],
        burstiness=burstiness,
        concurrency=concurrency,
        num_requests=num_requests,
        duration_s=duration,
        warmup=warmup,
        seed=seed,
        slo=slo,
        percentiles=pcts,
    )
    urls: tuple[str, ...] = () if no_metrics else tuple(dict.fromkeys([*cx.metrics_urls, *(metrics_url or [])]))
    if gateway is not None and cx.gateway_url is not None and gateway.rstrip("/") != cx.gateway_url:
        urls = tuple(u for u in urls if u != f"{cx.gateway_url}/metrics")

    def target_for(url: str, name: str, with_metrics: bool = True) -> BenchTarget:
        return BenchTarget(
            base_url=url.rstrip("/"),
            model=model or cx.model or _discover_model(url, api_key),
            workload=wl,
            api_key=api_key,
            endpoint="chat" if endpoint == "chat" else "completions",
            label=name,
            timeout_s=timeout,
            metrics_urls=urls if with_metrics else (),
        )

    prog = _Progress(progress)
    runs: list[RunResult] = []
    search: SearchResult | None = None
    main = target_for(base_url, label or ("pd" if ab else ""))
    with prog.show():
        if ab or admission_off_gateway:
            other_url = ab_gateway if ab else admission_off_gateway
            if other_url is None:
                raise BenchError(
                    "--ab needs the colocated deployment's URL",
                    hint='start one with routing.strategy = "colocated" (same workers) and pass --ab-gateway URL',
                )
            if ab:
                other = target_for(other_url, "colocated", with_metrics=False)
                names = ("colocated", main.label or "pd")
            else:
                main = replace(main, label=label or "admission on")
                other = target_for(other_url, "admission off", with_metrics=False)
                names = ("admission off", main.label)
            pair = run_async(run_ab(other, main, shape, rates, on_start=lambda lab, r: prog.start(lab, r)))
            runs = [x for pr in zip(pair.a, pair.b, strict=True) for x in pr]
        elif max_goodput:
            search = run_async(
                search_max_goodput_rate(
                    main, shape, start_rate=search_start, max_rate=search_max,
                    on_start=lambda r: prog.start(main.label or "search", r),
                )
            )  # fmt: skip
            runs = sorted(search.runs, key=lambda r: r.shape.rate)
        else:
            runs = run_async(run_sweep(main, shape, rates, on_start=lambda r: prog.start(main.label, r)))

    render_runs(runs)
    if ab or admission_off_gateway:
        names_t = names
        if admission_off_gateway and not ab:
            render_pairs(pair, names_t[0], names_t[1], "Admission control under load: goodput with SLO rejection")
        else:
            for ra, rb in zip(pair.a, pair.b, strict=True):
                render_compare(result_json(ra), result_json(rb), names_t[0], names_t[1])
    if search is not None:
        best = "none of the probed rates" if search.best_rate is None else f"{search.best_rate:.3g} req/s"
        console.print(
            Text(f"max goodput rate (≥ {100 * search.attainment_target:.0f}% within SLOs): {best}", style="bold")
        )
    if len(files) == 1:
        render_compare(load_results(files[0])[-1], result_json(runs[-1]), files[0].name, "this run")
    if output is not None:
        write_results(output, runs, search)
        console.print(f"wrote {output}")
    if html is not None:
        try:
            html.write_text(render_html(runs, search=search), encoding="utf-8")
        except OSError as exc:
            raise BenchError(f"{html}: cannot write the report: {exc.strerror or exc}") from None
        console.print(f"wrote {html}")
