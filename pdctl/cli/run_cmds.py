"""``pdctl up`` / ``down`` / ``status`` / ``logs``: launch, supervise, inspect and stop a deployment."""

from __future__ import annotations

import json
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from pdctl.cli._app import app, console, err_console, exit_without_teardown, handle_errors
from pdctl.config import DEFAULT_CONFIG, DEFAULT_SETTINGS, Deployment, load
from pdctl.config.recipe import RECIPE_REQUESTS
from pdctl.errors import ConfigError, LaunchError, PdctlError
from pdctl.runtime.logs import PDCTL_NAME, LogLine, Printer, follow_logs, read_logs
from pdctl.runtime.plan import Plan, build_plan
from pdctl.runtime.rundir import RunState

if TYPE_CHECKING:
    from rich.table import Table

    from pdctl.runtime.supervisor import Event

ConfigOpt = Annotated[Path, typer.Option("-c", "--config", help="config.toml of the deployment.")]
SettingsOpt = Annotated[Path, typer.Option("-s", "--settings", help="settings.json of the deployment.")]
RunDirOpt = Annotated[
    Path | None, typer.Option("--run-dir", help="Run directory (default: supervisor.run_dir of the config).")
]
OnlyOpt = Annotated[
    list[str] | None,
    typer.Option("--only", help="This host's part: process names or roles (prefill, decode, gateway), "
                 "comma-separated or repeated; its own run directory (docs/multi-node.md)."),
]  # fmt: skip

Item = LogLine | Callable[[], None] | None


# ------------------------------------------------------------------------------------------- shared


def _run_dir(config: Path, settings: Path, run_dir: Path | None, only: list[str] | None = None) -> Path:
    from pdctl.runtime.control import split_only
    from pdctl.runtime.rundir import part_dir

    if run_dir is not None:
        return part_dir(run_dir, split_only(only))
    try:
        base = load(config, settings).run_dir
    except ConfigError:
        # down/status/logs must work even if the files were edited into an invalid state since `up`.
        base = config.resolve().parent / ".pdctl"
    return part_dir(base, split_only(only))


def _checks(dep: Deployment, local: Plan | None = None, vllm_parse: bool = True) -> None:
    from pdctl.check import run_checks

    names = {p.name for p in local.processes} if local is not None else {w.name for w in dep.workers}
    parse = vllm_parse and any(w.engine == "vllm" and w.name in names for w in dep.workers)
    if parse:
        err_console.print("[dim]checking each vLLM command line with vLLM's own parser (--no-vllm-parse skips it)[/]")
    findings = run_checks(dep, for_up=True, parse_with_vllm=parse)
    if local is not None:
        findings = [f for f in findings if not _elsewhere(f.code, f.message, local)]
    errors = [f for f in findings if f.severity == "error"]
    for f in findings:
        if f.severity == "info":
            continue
        colour = "red" if f.severity == "error" else "yellow"
        err_console.print(f"[{colour}]{f.severity}[/] {escape(f.text)}")
        if f.hint:
            err_console.print(f"  [dim]hint:[/] {escape(f.hint)}")
    if errors:
        raise LaunchError(
            f"`pdctl check` found {len(errors)} error(s); nothing was started",
            hint="fix the findings above (`pdctl check` shows them all)",
        )


def _elsewhere(code: str, message: str, local: Plan) -> bool:
    """A busy port (PD018) or a refused command line (PD028) of a process another host runs: not this host's
    concern."""
    names = [p.name for p in local.processes]
    if code == "PD028":
        return "'s command line" in message and not any(f"refuses {n}'s command line" in message for n in names)
    return code == "PD018" and not any(f"({n})" in message or f"({n} side channel)" in message for n in names)


def summary_table(state: RunState) -> Table:
    """process, pid, role, URL, GPUs/cores, state."""
    from rich.table import Table

    table = Table(title="pdctl deployment", title_justify="left")
    for col in ("process", "pid", "role", "URL", "GPUs/cores", "state"):
        table.add_column(col)
    for rec in state.processes:
        gpus = ",".join(map(str, rec.get("gpu_ids", [])))
        cores = ",".join(map(str, rec.get("cpu_ids", [])))
        binding = " ".join(x for x in (f"gpu {gpus}" if gpus else "", f"cpu {cores}" if cores else "") if x) or "-"
        table.add_row(rec["name"], str(rec.get("pid", "")), rec.get("role", ""), rec.get("url", ""), binding,
                      rec.get("state", ""))  # fmt: skip
    return table


def curl_commands(dep: Deployment) -> list[str]:
    """The recipe's two verification requests through the gateway (the key stays a shell variable)."""
    url = dep.gateway.url
    model = dep.decode[0].model_name if dep.decode else "MODEL"
    var = dep.gateway.api_key_env
    auth = f'-H "Authorization: Bearer ${var}" -H "Content-Type: application/json"'
    return [
        f"curl {'-N' if r.stream else '-s'} {url}/v1/chat/completions {auth} "
        f"-d '{json.dumps(r.body(model), ensure_ascii=False, separators=(',', ':'))}'"
        for r in RECIPE_REQUESTS
    ]


def _print_ready(dep: Deployment, state: RunState, only: list[str] | None = None) -> None:
    stop = "pdctl down" + (f" --only {','.join(only)}" if only else "")
    console.print(summary_table(state))
    if not any(p.get("role") == "gateway" for p in state.processes):
        console.print(f"logs: {dep.run_dir / 'logs'}   stop: {stop}")
        return
    console.print(f"gateway: {dep.gateway.url}   logs: {dep.run_dir / 'logs'}   stop: {stop}")
    console.print("verify (non-streaming, then streaming):")
    for cmd in curl_commands(dep):
        console.print(cmd, markup=False, highlight=False)


# ------------------------------------------------------------------------------------------------ up


@app.command("up")
@handle_errors
def up(
    config: ConfigOpt = Path(DEFAULT_CONFIG),
    settings: SettingsOpt = Path(DEFAULT_SETTINGS),
    detach: Annotated[
        bool, typer.Option("-d", "--detach", help="Return once ready; supervise in the background.")
    ] = False,
    no_check: Annotated[bool, typer.Option("--no-check", help="Skip `pdctl check` (not recommended).")] = False,
    only: OnlyOpt = None,
    vllm_parse: Annotated[
        bool,
        typer.Option(
            "--vllm-parse/--no-vllm-parse",
            help="Run each vLLM command line through vLLM's own parser first (PD028; vLLM's import time).",
        ),
    ] = True,
) -> None:
    """Check, start prefill/decode (and the gateway, held), probe the KV link, release the gateway, supervise.

    Nothing starts while `check` finds an error, including what vLLM's own parser refuses in the planned
    command lines of this host's vLLM workers (PD028). With ``--only``, just this host's part; where the gateway
    runs it first waits for the other hosts' workers.
    """
    from pdctl.runtime.control import host_part, split_only
    from pdctl.runtime.rundir import ensure_not_running, prepare_run_dir

    selected = split_only(only)
    if not selected:
        dep = load(config, settings)
        ensure_not_running(dep)
        if not no_check:
            _checks(dep, vllm_parse=vllm_parse)
        part = host_part(dep, (), build_plan(dep))
    else:
        part = host_part(load(config, settings), selected)
        ensure_not_running(part.dep)
        if not no_check:
            _checks(part.dep, part.plan, vllm_parse)
    prepare_run_dir(part.dep)
    if detach:
        _up_detached(part.dep, part.plan, list(selected))
    else:
        _up_foreground(part.dep, part.plan, part.remote, list(selected))


def _up_foreground(dep: Deployment, plan: Plan, remote: tuple[tuple[str, str], ...], only: list[str]) -> None:
    from pdctl.check import port_taken_error
    from pdctl.runtime.daemon import Runner

    q: queue.Queue[Item] = queue.Queue()
    printer = Printer(sys.stdout, [p.name for p in plan.processes])

    def pump() -> None:
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, LogLine):
                printer.write(item)
            else:
                item()

    def on_event(ev: Event) -> None:
        q.put(LogLine(PDCTL_NAME, ev.message, ev.ts))

    runner = Runner(dep, plan, detached=False, on_line=q.put, on_event=on_event, remote=remote,
                    explain=lambda exc: port_taken_error(dep, exc))  # fmt: skip
    thread = threading.Thread(target=pump, name="pdctl-printer", daemon=True)
    thread.start()

    def handle(signum: int, frame: FrameType | None) -> None:
        if runner.request_stop():
            q.put(LogLine(PDCTL_NAME, f"{signal.Signals(signum).name}: stopping (Ctrl-C again to force)", time.time()))
        else:
            q.put(LogLine(PDCTL_NAME, "forcing: SIGKILL to every process", time.time()))

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    reason: str | None = None
    try:
        try:
            runner.start()
        except PdctlError:
            q.put(None)
            thread.join(timeout=5)
            raise
        q.put(lambda: _print_ready(dep, runner.state, only))
        reason = runner.serve()
        runner.stop(reason)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        q.put(None)
        thread.join(timeout=5)
    if reason:
        raise LaunchError(reason, hint=f"see `pdctl logs` ({dep.run_dir / 'logs'})")


def _up_detached(dep: Deployment, plan: Plan, only: list[str]) -> None:
    from pdctl.runtime.control import start_detached

    printer = Printer(sys.stdout, [p.name for p in plan.processes])
    state = start_detached(dep, plan, lambda msg: printer.write(LogLine(PDCTL_NAME, msg, time.time())), only)
    _print_ready(dep, state, only)
    exit_without_teardown()


# ---------------------------------------------------------------------------------------------- down


@app.command("down")
@handle_errors
def down(
    config: ConfigOpt = Path(DEFAULT_CONFIG),
    settings: SettingsOpt = Path(DEFAULT_SETTINGS),
    run_dir: RunDirOpt = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the ordered stop before SIGKILL.")] = 120.0,
    only: OnlyOpt = None,
) -> None:
    """Stop a running deployment (from any shell): gateway, decode, prefill; nothing survives."""
    from pdctl.runtime.control import stop_deployment

    stop_deployment(_run_dir(config, settings, run_dir, only), timeout, say=console.print, warn=err_console.print)
    console.print("stopped")


# -------------------------------------------------------------------------------------------- status


def _fmt_uptime(s: float | None) -> str:
    if s is None:
        return "-"
    return str(timedelta(seconds=int(s)))


def _fmt_mem(b: int | None) -> str:
    return "-" if b is None else f"{b / (1 << 20):.0f} MiB"


@app.command("status")
@handle_errors
def status(
    config: ConfigOpt = Path(DEFAULT_CONFIG),
    settings: SettingsOpt = Path(DEFAULT_SETTINGS),
    run_dir: RunDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    only: OnlyOpt = None,
) -> None:
    """Per process: state, pid, uptime, restarts, health, CPU/RSS of its tree, GPU memory; gateway counters.

    ``--json`` prints one JSON object in every state (no deployment, a damaged run directory included); the
    exit code is 1 when there is no readable state.json, with or without ``--json``.
    """
    from rich.table import Table

    from pdctl.runtime.control import deployment_status

    rd = _run_dir(config, settings, run_dir, only)
    st = deployment_status(rd)
    if as_json:
        console.print_json(json.dumps(st.to_json()))
        if st.problem is not None:
            raise typer.Exit(st.problem.exit_code)
        return
    if st.problem is not None:
        raise st.problem
    rows, counters, overall = st.processes, st.gateway_requests, st.status
    table = Table(title=f"pdctl {overall} ({rd})", title_justify="left")
    for col in ("process", "role", "state", "pid", "uptime", "restarts", "health", "CPU %", "RSS", "GPU mem"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.name, r.role, r.state, str(r.pid) if r.alive else "-", _fmt_uptime(r.uptime_s),
                      str(r.restarts), r.health, "-" if r.cpu_percent is None else f"{r.cpu_percent:.0f}",
                      _fmt_mem(r.rss_bytes), "-" if r.gpu_mem_mib is None else f"{r.gpu_mem_mib:.0f} MiB")  # fmt: skip
    console.print(table)
    if counters is not None:
        total = sum(counters.values())
        parts = ", ".join(f"{k}={v:g}" for k, v in sorted(counters.items())) or "none yet"
        console.print(f"gateway requests: {total:g} ({parts})")
    if st.state is not None and st.state.error:
        console.print(f"last error: {st.state.error}", markup=False)


# ---------------------------------------------------------------------------------------------- logs

_SINCE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_since(text: str) -> float:
    """``30s`` / ``10m`` / ``2h`` / ``1d`` ago, or an ISO time, as a Unix time."""
    m = _SINCE.match(text.strip())
    if m:
        mult = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return time.time() - float(m.group(1)) * mult
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise PdctlError(
            f"--since: cannot read {text!r}", hint="use a duration (30s, 10m, 2h) or an ISO time (2026-11-30T14:05)"
        ) from None


@app.command("logs")
@handle_errors
def logs(
    names: Annotated[list[str] | None, typer.Argument(help="Processes to show (default: all).")] = None,
    config: ConfigOpt = Path(DEFAULT_CONFIG),
    settings: SettingsOpt = Path(DEFAULT_SETTINGS),
    run_dir: RunDirOpt = None,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing new lines.")] = False,
    since: Annotated[str | None, typer.Option(help="Only lines since 30s / 10m / 2h ago or an ISO time.")] = None,
    kv: Annotated[bool, typer.Option("--kv", help="Only KV-transfer events, classified.")] = False,
    request: Annotated[str | None, typer.Option("--request", help="Follow one request id across processes.")] = None,
    tail: Annotated[int | None, typer.Option("-n", "--tail", help="Only the last N lines.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    only: OnlyOpt = None,
) -> None:
    """Show the per-process log files of the deployment, merged by time."""
    from pdctl.runtime.control import log_files

    rd = _run_dir(config, settings, run_dir, only)
    files = log_files(rd, list(names or []))
    since_ts = parse_since(since) if since else None
    lines = read_logs(files, since=since_ts, request_id=request, tail=None if kv else tail)
    if kv:
        _print_kv(lines, as_json, tail)
    else:
        printer = Printer(sys.stdout, list(files))
        for ln in lines:
            _emit_line(ln, printer, as_json)
    if not follow:
        return
    printer = Printer(sys.stdout, list(files))
    for ln in follow_logs(files):
        if request and request not in ln.text:
            continue
        if kv:
            _print_kv([ln], as_json, None)
        else:
            _emit_line(ln, printer, as_json)


def _emit_line(ln: LogLine, printer: Printer, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(ln.to_json(), ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(printer.format(ln) + "\n")
    sys.stdout.flush()


def _print_kv(lines: list[LogLine], as_json: bool, tail: int | None) -> None:
    from pdctl.vllm.kvlog import scan

    events = []
    for ln in lines:
        for ev in scan([ln.text], ln.name):
            events.append((ln, ev))
    if tail is not None:
        events = events[-tail:] if tail > 0 else []
    for ln, ev in events:
        if as_json:
            obj = {
                "time": ev.time or ln.to_json()["time"],
                "process": ln.name,
                "phase": ev.phase,
                "detail": ev.detail,
                "request_id": ev.request_id,
                "line": ev.line,
            }
            sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
        else:
            when = ev.time or (time.strftime("%H:%M:%S", time.localtime(ln.ts)) if ln.ts else "-")
            rid = ev.request_id or "-"
            sys.stdout.write(f"{when} {ln.name} {ev.phase} {rid} {ev.detail}\n    {ev.line}\n")
    sys.stdout.flush()
