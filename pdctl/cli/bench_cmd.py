"""``pdctl bench``: measure TTFT/TPOT/ITL/goodput against the gateway (or any OpenAI-compatible server)."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from pdctl.cli._app import app, console, err_console, handle_errors

__all__ = ["bench"]


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
        str,
        typer.Option(
            "--workload",
            "-w",
            help="doc | random | mixed | sharegpt:FILE | trace:FILE | shared-prefix | agent | claude-code | codex.",
        ),
    ] = "doc",
    input_len: Annotated[int, typer.Option("--input-len", help="random: mean input tokens.")] = 1024,
    output_len: Annotated[
        int | None,
        typer.Option("--output-len", help="random/mixed: mean output tokens (128); shared-prefix: output (256)."),
    ] = None,
    range_ratio: Annotated[float, typer.Option("--range-ratio", help="Lengths uniform in L(1±r).")] = 0.0,
    prefix_len: Annotated[int, typer.Option("--prefix-len", help="random: shared prefix tokens.")] = 0,
    short_len: Annotated[int, typer.Option("--short-len", help="mixed: short prompt tokens.")] = 128,
    long_len: Annotated[int, typer.Option("--long-len", help="mixed: long prompt tokens.")] = 4096,
    long_output_len: Annotated[int, typer.Option("--long-output-len", help="mixed: long prompts' output.")] = 16,
    long_fraction: Annotated[float, typer.Option("--long-fraction", help="mixed: share of long prompts.")] = 0.1,
    trace_speed: Annotated[float, typer.Option("--trace-speed", help="trace: replay speed factor.")] = 1.0,
    conversations: Annotated[
        int, typer.Option("--conversations", help="agent, claude-code, codex: sessions per run.")
    ] = 24,
    turns: Annotated[
        str,
        typer.Option(
            "--turns", help="agent, codex: requests per conversation (claude-code: main-agent turns), N or MIN:MAX."
        ),
    ] = "6:9",
    system_len: Annotated[
        int | None,
        typer.Option("--system-len", help="agent: shared system prompt (500); shared-prefix: per group (2048)."),
    ] = None,
    context_len: Annotated[
        int, typer.Option("--context-len", help="agent: mean per-conversation context tokens (lognormal).")
    ] = 1000,
    user_len: Annotated[
        str, typer.Option("--user-len", help="agent: user turn tokens (claude-code, codex: tool output), N or MIN:MAX.")
    ] = "120:160",
    answer_len: Annotated[str, typer.Option("--answer-len", help="agent: answer tokens, N or MIN:MAX.")] = "80:120",
    groups: Annotated[int, typer.Option("--groups", help="shared-prefix: groups (system prompts).")] = 64,
    prompts_per_group: Annotated[
        int, typer.Option("--prompts-per-group", help="shared-prefix: prompts per group.")
    ] = 16,
    question_len: Annotated[int, typer.Option("--question-len", help="shared-prefix: question tokens.")] = 128,
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
    plots: Annotated[
        Path | None, typer.Option("--plots", help="Write the report's plots as SVG files into this folder.")
    ] = None,
    compare_files: Annotated[
        list[Path] | None, typer.Option("--compare", help="A results file (twice: compare two files, no run).")
    ] = None,
    ab: Annotated[bool, typer.Option("--ab", help="Also run against --ab-gateway (colocated) and compare.")] = False,
    ab_gateway: Annotated[
        str | None, typer.Option("--ab-gateway", help="Base URL of the colocated deployment for --ab.")
    ] = None,
    ab_side: Annotated[
        list[str] | None,
        typer.Option(
            "--ab-side",
            help="NAME=URL: a further side for --ab, run after the other two at each rate (e.g. adaptive PD).",
        ),
    ] = None,
    admission_off_gateway: Annotated[
        str | None,
        typer.Option("--admission-off-gateway", help="Gateway with slo.admission=false: compare goodput on/off."),
    ] = None,
    max_goodput: Annotated[
        bool,
        typer.Option(
            "--max-goodput", help="Search the highest rate meeting the SLOs (DistServe); each side with --ab."
        ),
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
    # The bench machinery (aiohttp, httpx) is imported here, not at the top: every other command pays nothing for it.
    from pdctl.bench.arrivals import parse_rates
    from pdctl.bench.html import render_html
    from pdctl.bench.plots import write_plots
    from pdctl.bench.report import load_results, result_json, write_results
    from pdctl.bench.runner import (
        BenchError,
        BenchTarget,
        LoadShape,
        RunResult,
        SearchResult,
        discover_model,
        run_ab,
        run_async,
        run_sweep,
        search_each,
        search_max_goodput_rate,
    )
    from pdctl.bench.workload import make_workload
    from pdctl.cli.bench_view import (
        Progress,
        goodput_slo,
        load_context,
        parse_percentiles,
        parse_range,
        parse_sides,
        render_compare,
        render_pairs,
        render_runs,
        workload_spec,
    )

    if ab_side and not ab:
        raise BenchError("--ab-side needs --ab", hint="add --ab --ab-gateway URL (the colocated side)")
    sides = parse_sides(ab_side or [], ("colocated", label or "pd"))
    files = compare_files or []
    if len(files) > 2:
        raise BenchError("--compare takes one file (compare with this run) or two (compare them)")
    if len(files) == 2:
        a, b = load_results(files[0])[-1], load_results(files[1])[-1]
        render_compare(a, b, files[0].name, files[1].name)
        return

    cx = load_context(config_path, settings_path, attainment)
    base_url = gateway or cx.gateway_url
    if base_url is None:
        raise BenchError("no target", hint="give --gateway URL, or run in the folder of config.toml/settings.json")
    api_key = os.environ.get(cx.api_key_env) or None
    if api_key is None and cx.gateway_url is not None and gateway is None:
        err_console.print(Text(f"warning: ${cx.api_key_env} is not set; the gateway will answer 401", style="yellow"))
    if endpoint not in ("chat", "completions"):
        raise BenchError(f"--endpoint: expected chat or completions, got {endpoint!r}")
    if endpoint != "chat" and workload in ("claude-code", "codex"):
        api = "/v1/messages" if workload == "claude-code" else "/v1/responses"
        raise BenchError(f"--endpoint {endpoint} does not apply to -w {workload}: it sends {api}, as the client does",
                         hint="drop --endpoint")  # fmt: skip
    slo = goodput_slo(goodput or [], ctx.args, attainment)
    if slo is None and not no_slo:
        slo = cx.slo
    pcts = parse_percentiles(percentiles)
    gsp = workload == "shared-prefix"
    spec = workload_spec(
        workload,
        seed,
        not repeat_prompts,
        input_len=input_len,
        output_len=output_len if output_len is not None else (256 if gsp else 128),
        range_ratio=range_ratio,
        prefix_len=prefix_len,
        short_len=short_len,
        long_len=long_len,
        long_output_len=long_output_len,
        long_fraction=long_fraction,
        trace_speed=trace_speed,
        conversations=conversations,
        turns=parse_range("--turns", turns),
        system_len=system_len if system_len is not None else (2048 if gsp else 500),
        context_len=context_len,
        user_len=parse_range("--user-len", user_len),
        answer_len=parse_range("--answer-len", answer_len),
        groups=groups,
        prompts_per_group=prompts_per_group,
        question_len=question_len,
    )
    wl = make_workload(spec)
    rates = parse_rates(rate) if rate is not None else [math.inf]
    if rate is None and concurrency is None and not wl.timed and not wl.conversational and not max_goodput:
        concurrency = 1
    if num_requests is None and duration is None and not wl.conversational:
        num_requests = wl.size if wl.timed or gsp else 100
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
        own = (f"{url.rstrip('/')}/metrics",) if not with_metrics and not no_metrics else ()
        return BenchTarget(
            base_url=url.rstrip("/"),
            model=model or cx.model or discover_model(url, api_key),
            workload=wl,
            api_key=api_key,
            endpoint="chat" if endpoint == "chat" else "completions",
            label=name,
            timeout_s=timeout,
            # The other side of a comparison: the same workers (shared, or not: then their deltas are 0) and its
            # own gateway's /metrics instead of this one's.
            metrics_urls=urls if with_metrics else tuple(dict.fromkeys([*(u for u in urls if u != main_gw), *own])),
            metrics_names={u: n for u, n in cx.metrics_names.items() if u != main_gw or with_metrics}
            | dict.fromkeys(own, f"{name} gateway"),
        )

    main_gw = f"{base_url.rstrip('/')}/metrics"
    prog = Progress(progress)
    runs: list[RunResult] = []
    search: SearchResult | None = None
    searches: dict[str, SearchResult] = {}
    main = target_for(base_url, label or ("pd" if ab else ""))
    with prog.show():
        if ab or admission_off_gateway:
            other_url = ab_gateway if ab else admission_off_gateway
            if other_url is None:
                raise BenchError(
                    "--ab needs the colocated deployment's URL",
                    hint='start one with routing.strategy = "colocated" (same workers) and pass --ab-gateway URL',
                )
            more: list[BenchTarget] = []
            if ab:
                other = target_for(other_url, "colocated", with_metrics=False)
                names = ("colocated", main.label or "pd")
                more = [target_for(url, name, with_metrics=False) for name, url in sides]
            else:
                main = replace(main, label=label or "admission on")
                other = target_for(other_url, "admission off", with_metrics=False)
                names = ("admission off", main.label)
            if ab and max_goodput:
                searches = run_async(
                    search_each([other, main, *more], shape, start_rate=search_start, max_rate=search_max,
                                on_start=lambda lab, r: prog.start(lab, r))
                )  # fmt: skip
                runs = sorted((r for found in searches.values() for r in found.runs), key=lambda r: r.shape.rate)
            else:
                pair = run_async(
                    run_ab(other, main, shape, rates, on_start=lambda lab, r: prog.start(lab, r), more=more)
                )
                runs = pair.by_rate()
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

    render_runs(runs, per_table=2 + len(sides) if ab and not searches else 4)
    if (ab or admission_off_gateway) and not searches:
        names_t = names
        if admission_off_gateway and not ab:
            render_pairs(pair, names_t[0], names_t[1], "Admission control under load: goodput with SLO rejection")
        else:
            for ra, rb in zip(pair.a, pair.b, strict=True):
                render_compare(result_json(ra), result_json(rb), names_t[0], names_t[1])
            for side, side_runs in pair.more.items():
                for ra, rc in zip(pair.a, side_runs, strict=True):
                    render_compare(result_json(ra), result_json(rc), names_t[0], side)
    for side_name, found in ([("", search)] if search is not None else []) + list(searches.items()):
        best = "none of the probed rates" if found.best_rate is None else f"{found.best_rate:.3g} req/s"
        console.print(
            Text(
                f"max goodput rate{' of ' + side_name if side_name else ''} "
                f"(≥ {100 * found.attainment_target:.0f}% within SLOs): {best}",
                style="bold",
            )
        )
    if len(files) == 1:
        render_compare(load_results(files[0])[-1], result_json(runs[-1]), files[0].name, "this run")
    if output is not None:
        write_results(output, runs, search, searches)
        console.print(f"wrote {output}")
    if html is not None:
        try:
            html.write_text(render_html(runs, search=search, searches=searches), encoding="utf-8")
        except OSError as exc:
            raise BenchError(f"{html}: cannot write the report: {exc.strerror or exc}") from None
        console.print(f"wrote {html}")
    if plots is not None:
        written = write_plots(plots, runs)
        console.print(f"wrote {len(written)} plots (SVG) into {plots}")
