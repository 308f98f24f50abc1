"""``pdctl profile``: measure a running P/D deployment's profile; ``pdctl advise``: size prefill and decode from one.

``profile`` is its own command, not a ``bench`` flag: it sends a fixed probe schedule (one prompt at a time, then
groups of concurrent streams) rather than a workload, and writes a profile, not a results file; none of bench's
load or workload options applies to it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from pdctl import config
from pdctl.cli._app import app, console, err_console, handle_errors
from pdctl.cli.config_cmds import SettingsOpt
from pdctl.errors import PdctlError

__all__ = ["advise", "profile"]


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise PdctlError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise PdctlError(f"{flag} {text!r}: expected positive integers")
    return values


@app.command("profile")
@handle_errors
def profile(
    config_path: Annotated[Path, typer.Option("-c", "--config", help="config.toml (batch limits, gateway).")] = Path(
        config.DEFAULT_CONFIG
    ),
    settings_path: SettingsOpt = Path(config.DEFAULT_SETTINGS),
    gateway: Annotated[str | None, typer.Option("--gateway", help="Gateway URL (default: the config's).")] = None,
    out: Annotated[Path, typer.Option("-o", "--out", help="Profile JSON to write.")] = Path("profile.json"),
    prompt_lens: Annotated[str, typer.Option(help="Prompt lengths to probe (tokens).")] = "128,512,1024,2048",
    running: Annotated[str, typer.Option(help="Concurrent decode streams to probe.")] = "1,2,4,8,16",
    contexts: Annotated[str, typer.Option(help="Prompt lengths of the decode probes.")] = "128,1024",
    output_len: Annotated[int, typer.Option(help="Tokens per decode probe.")] = 32,
    repeats: Annotated[int, typer.Option(help="Probes per prompt length.")] = 3,
    model: Annotated[str | None, typer.Option(help="Model name (default: what the gateway lists).")] = None,
) -> None:
    """Measure prefill time against prompt length, decode step time against running streams and context, and the
    KV hand-off per token, through the gateway's real P/D path; write them as a profile for `pdctl advise`.

    Run it on an otherwise idle deployment (about 40 requests). The API key is read from gateway.api_key_env.
    """
    from pdctl.bench.client import BenchClient
    from pdctl.bench.runner import discover_model, run_async
    from pdctl.capacity.measure import Schedule, http_sender, measure, served_traffic
    from pdctl.capacity.profile import dump

    batched, seqs, url, key_env, tp, model_len = 8192, 256, gateway, "PDCTL_API_KEY", 1, None
    prefill_urls: tuple[str, ...] = ()
    if config_path.exists() and settings_path.exists():
        dep = config.load(config_path, settings_path)
        url = url or dep.gateway.url
        prefill_urls = tuple(w.url for w in dep.prefill)
        key_env = dep.gateway.api_key_env
        batched = dep.prefill[0].max_num_batched_tokens or batched
        seqs = dep.decode[0].max_num_seqs or seqs
        tp = dep.prefill[0].tensor_parallel_size
        model_len = dep.decode[0].max_model_len
        model = model or dep.decode[0].model_name
    elif settings_path.exists():
        read = config.load_settings(settings_path)
        url, key_env = url or read.gateway.url, read.gateway.api_key_env
        prefill_urls = read.routing.prefill_endpoints
    ctx_list = _ints("--contexts", contexts)
    longest = 2048 if model_len is None else max(output_len, model_len - max(ctx_list) - 8)
    schedule = Schedule(_ints("--prompt-lens", prompt_lens), repeats, _ints("--running", running), ctx_list,
                        output_len, max_output_len=longest)  # fmt: skip
    if url is None:
        raise PdctlError("no gateway", hint="give --gateway URL, or run in the folder of config.toml/settings.json")
    api_key = os.environ.get(key_env) or None
    name = model or discover_model(url, api_key)

    served = served_traffic([t for u in prefill_urls if (t := _metrics(u, None)) is not None], _metrics(url, api_key))

    async def run() -> bytes:
        async with BenchClient(url, model=name, api_key=api_key, endpoint="completions", timeout_s=300.0) as client:
            prof = await measure(http_sender(client), schedule, source=url, model=name,
                                 prefill_max_batched_tokens=batched, decode_max_num_seqs=seqs)  # fmt: skip
        import msgspec

        hits, local = served.prefix_cache_hit_rate, served.local_share
        return dump(msgspec.structs.replace(prof, gpus_per_engine=tp, prefix_cache_hit_rate=hits, local_share=local))

    err_console.print(f"profiling {url} ({name}) ...", markup=False)
    data = run_async(run())
    out.write_bytes(data)
    from pdctl.capacity.profile import load, prefill_tokens_per_s

    prof = load(out)
    console.print(
        f"prefill {prof.prefill_s_per_token * 1e6:.1f} µs/token + {prof.prefill_fixed_s * 1000:.1f} ms "
        f"(V_P {prefill_tokens_per_s(prof):,.0f} tokens/s); KV {prof.kv_s_per_token * 1e6:.2f} µs/token + "
        f"{prof.kv_fixed_s * 1000:.1f} ms",
        markup=False,
    )
    for p in prof.decode:
        console.print(f"decode {p.running:>4} streams at {p.context_tokens} tokens: {p.step_s * 1000:.2f} ms/step",
                      markup=False)  # fmt: skip
    for what, share in (("prefill prefix-cache hit rate", prof.prefix_cache_hit_rate),
                        ("requests served on decode alone (adaptive PD)", prof.local_share)):  # fmt: skip
        told = "not counted yet" if share is None else f"{share:.0%}"
        console.print(f"traffic before the probes: {what} {told}", markup=False)
    console.print(f"wrote {out}", markup=False)


def _metrics(base: str, key: str | None) -> str | None:
    """``base``'s /metrics body, None when it does not answer (the traffic's counts are then left out)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(f"{base.rstrip('/')}/metrics", headers=headers, timeout=5.0, trust_env=False)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def _histogram(flag: str, value: str) -> Any:
    from pdctl.capacity.model import parse_histogram

    if value.startswith("@"):
        path = Path(value[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PdctlError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
        return parse_histogram(text, str(path))
    return parse_histogram(value, flag)


@app.command("advise")
@handle_errors
def advise(
    profile_path: Annotated[Path, typer.Argument(help="Profile JSON written by `pdctl profile`.")],
    settings_path: SettingsOpt = Path(config.DEFAULT_SETTINGS),
    bench: Annotated[
        Path | None, typer.Option("--bench", help="Workload from a `pdctl bench -o` results file.")
    ] = None,
    isl: Annotated[str | None, typer.Option(help="Prompt lengths: 128:0.9,4096:0.1 or @FILE.")] = None,
    osl: Annotated[str | None, typer.Option(help="Output lengths: 128:0.9,8:0.1 or @FILE.")] = None,
    rate: Annotated[float | None, typer.Option(help="Target requests/s (default: the bench file's rate).")] = None,
    peak_rate: Annotated[
        float | None, typer.Option(help="Peak requests/s: sets the autoscaling maximum (default: 2 × rate).")
    ] = None,
    engines: Annotated[int | None, typer.Option(help="Instead: the rate this many engines sustain.")] = None,
    hit_rate: Annotated[float | None, typer.Option(help="Prefix-cache hit rate of prefill (0-1).")] = None,
    max_engines: Annotated[int, typer.Option(help="Largest deployment to consider.")] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="Print the advice as JSON.")] = False,
    write: Annotated[Path | None, typer.Option("--write", help="Set the groups' replicas in this config.toml.")] = None,
    pd: Annotated[bool, typer.Option("--pd", help="Recommend P/D even when colocated needs fewer engines.")] = False,
) -> None:
    """Colocated or P/D for this traffic, and how many prefill and decode engines meet the SLO in settings.json."""
    from pdctl.bench.report import load_results
    from pdctl.capacity import model as m
    from pdctl.capacity.profile import load

    prof = load(profile_path)
    if bench is not None:
        wl = m.workload_from_results(load_results(bench)[-1], str(bench))
    elif isl is not None and osl is not None:
        wl = m.Workload(_histogram("--isl", isl), _histogram("--osl", osl))
    else:
        raise PdctlError("no workload", hint="give --bench results.json, or --isl and --osl")
    if hit_rate is None and bench is None and prof.prefix_cache_hit_rate:
        hit_rate = prof.prefix_cache_hit_rate  # the served traffic's, as the profile counted it
        err_console.print(f"prefix-cache hit rate {hit_rate:.0%} from the profile (--hit-rate sets another)",
                          markup=False)  # fmt: skip
    if hit_rate is not None:
        wl = m.Workload(wl.isl, wl.osl, wl.rate, hit_rate)
    slo_cfg = config.load_settings(settings_path).slo
    slo = m.Slo.of(slo_cfg.ttft_ms, slo_cfg.tpot_ms, slo_cfg.p90)
    if engines is not None and rate is not None:
        raise PdctlError("give --rate or --engines, not both")
    plan = None
    if engines is not None:
        advice = m.size_for_engines(prof, wl, slo, engines)
    else:
        target = rate if rate is not None else wl.rate
        if target is None:
            raise PdctlError("no rate", hint="give --rate REQUESTS_PER_S (the workload has none)")
        advice = m.size_for_rate(prof, wl, slo, target, max_engines)
        if advice.pd is not None and advice.pd.meets:
            high = m.best_pd(prof, wl, slo, peak_rate or 2 * target, max_engines)
            plan = m.autoscale_plan(prof, wl, slo, advice.pd, high)
    if pd and advice.verdict == "colocated":
        if advice.pd is None:
            raise PdctlError("no P/D configuration to recommend", hint="P/D needs at least 2 engines")
        from dataclasses import replace

        advice = replace(advice, verdict="pd", chosen=advice.pd, notes=(*advice.notes, "P/D forced by --pd"))
    if as_json:
        typer.echo(json.dumps({"slo": {"ttft_ms": slo_cfg.ttft_ms, "tpot_ms": slo_cfg.tpot_ms,
                                       "attainment": slo.attainment}, **advice.as_dict(),
                           "autoscale": None if plan is None else plan.as_dict()}, indent=2))  # fmt: skip
    else:
        _show(advice, slo, rate is None and engines is None)
        if plan is not None:
            console.print(
                f"autoscaling (P/D): prefill {plan.prefill_min}-{plan.prefill_max} replicas at "
                f"{plan.threshold_s:.2f} s of queued prefill work each; decode {plan.decode_min}-{plan.decode_max} "
                f"at {plan.streams_per_replica:.0f} streams each (--json for `pdctl render k8s --autoscale`)",
                markup=False,
            )
    if write is not None:
        if advice.verdict != "pd":
            raise PdctlError(
                f"the verdict is colocated ({advice.chosen.decode} engines): there are no P/D groups to write",
                hint="add --pd to write the best P/D configuration anyway",
            )
        from pdctl.capacity.configfile import set_replicas

        set_replicas(write, advice.chosen.prefill, advice.chosen.decode)
        err_console.print(f"wrote {write}: prefill replicas {advice.chosen.prefill}, decode replicas "
                          f"{advice.chosen.decode}", markup=False)  # fmt: skip


def _ms(x: float) -> str:
    return f"{x * 1000:,.0f}" if math.isfinite(x) else "∞"


def _show(advice: Any, slo: Any, from_file: bool) -> None:
    c = advice.chosen
    shape = f"{c.prefill}P{c.decode}D" if c.mode == "pd" else f"{c.decode} colocated engines"
    console.print(f"verdict: {'P/D' if c.mode == 'pd' else 'colocated'} — {shape} ({advice.gpus} GPUs)", markup=False)
    console.print(
        f"at {c.rate:.3g} requests/s{' (the workload file rate)' if from_file else ''}: TTFT p50/p90 "
        f"{_ms(c.ttft_p50_s)}/{_ms(c.ttft_p90_s)} ms (SLO {slo.ttft_s * 1000:.0f}), TPOT p50/p90 "
        f"{c.tpot_p50_s * 1000:.1f}/{c.tpot_p90_s * 1000:.1f} ms (SLO {slo.tpot_s * 1000:.0f}), attainment "
        f"{c.attainment:.1%}, prefill busy {c.prefill_utilization:.0%}, {c.decode_running:.1f} streams per "
        f"{'decode' if c.mode == 'pd' else 'engine'}",
        markup=False,
    )
    if advice.headroom:
        console.print(f"capacity {advice.capacity_rate:.3g} requests/s: headroom {advice.headroom:+.0%}", markup=False)
    else:
        console.print(f"capacity {advice.capacity_rate:.3g} requests/s at the SLO", markup=False)
    console.print(f"why: {c.reason}", markup=False)
    for note in advice.notes:
        console.print(f"note: {note}", markup=False)
