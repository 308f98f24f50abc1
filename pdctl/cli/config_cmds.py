"""``pdctl init`` / ``check`` / ``plan``: the configuration commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from pdctl import config
from pdctl.check import Finding, finding_from_error, run_checks
from pdctl.cli._app import app, console, handle_errors
from pdctl.config.templates import write_templates
from pdctl.errors import ConfigError
from pdctl.runtime.plan import VllmInstall, build_plan, detect_vllm, render_sh

ConfigOpt = Annotated[Path, typer.Option("-c", "--config", help="The cluster/worker file.")]
SettingsOpt = Annotated[Path, typer.Option("-s", "--settings", help="The gateway/routing file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


@app.command()
@handle_errors
def init(
    folder: Annotated[Path, typer.Argument(help="Where to write config.toml and settings.json.")] = Path("."),
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files.")] = False,
) -> None:
    """Write the recipe's config.toml and settings.json (with comments)."""
    for path in write_templates(folder, force=force):
        console.print(f"wrote {path}")
    console.print("next: [bold]pdctl check[/] then [bold]pdctl plan[/]")


def render_findings(findings: list[Finding]) -> None:
    """Print findings as a table (one shared renderer for check and up)."""
    if not findings:
        console.print("[green]no findings[/]")
        return
    table = Table(show_lines=False, pad_edge=False, expand=False)
    for col in ("code", "severity", "where", "message"):
        table.add_column(col, overflow="fold")
    for f in findings:
        where = f.file + (f":{f.line}" if f.line else "") + (f" {f.key}" if f.key else "")
        message = Text(f.message)
        if f.hint:
            message.append(f"\nfix: {f.hint}", style="dim")
        table.add_row(f.code, Text(f.severity, style=_STYLE[f.severity]), Text(where), message)
    console.print(table)
    errors = sum(f.severity == "error" for f in findings)
    warnings = sum(f.severity == "warning" for f in findings)
    console.print(f"{errors} error(s), {warnings} warning(s)")


@app.command()
def check(
    config_path: ConfigOpt = Path(config.DEFAULT_CONFIG),
    settings_path: SettingsOpt = Path(config.DEFAULT_SETTINGS),
    as_json: JsonOpt = False,
    vllm_parse: Annotated[
        bool, typer.Option("--vllm-parse/--no-vllm-parse", help="Run the command lines through vLLM's parser.")
    ] = True,
) -> None:
    """Validate both files and lint them against the recipe's pitfalls (exit 1 on errors).

    With vLLM installed, each worker's planned command line also goes through vLLM's own argument parser and
    config classes (a few seconds; no GPU, no weights).
    """
    vllm: VllmInstall | None = None
    try:
        dep = config.load(config_path, settings_path)
        vllm = detect_vllm(dep.engine_python)
        findings = run_checks(dep, vllm=vllm, parse_with_vllm=vllm_parse)
    except ConfigError as err:
        findings = [finding_from_error(err)]
    if as_json:
        out: dict[str, object] = {"findings": [f.to_json() for f in findings]}
        if vllm is not None:
            out["vllm"] = vllm.to_json()
        typer.echo(json.dumps(out, ensure_ascii=False, indent=2))
    else:
        render_findings(findings)
        if vllm is not None:
            console.print(Text(f"vLLM: {vllm.describe()}", style="dim"))
    if any(f.severity == "error" for f in findings):
        raise typer.Exit(1)


@app.command()
@handle_errors
def plan(
    config_path: ConfigOpt = Path(config.DEFAULT_CONFIG),
    settings_path: SettingsOpt = Path(config.DEFAULT_SETTINGS),
    as_json: JsonOpt = False,
    fmt: Annotated[str, typer.Option("--format", help="`table` (default) or `sh`.")] = "table",
) -> None:
    """Show the exact processes `pdctl up` starts, in start order."""
    if fmt not in ("table", "sh"):
        raise typer.BadParameter("expected table or sh", param_hint="--format")
    dep = config.load(config_path, settings_path)
    p = build_plan(dep)
    if as_json:
        out = {"cluster": dep.cluster.name, "processes": [s.to_json() for s in p.processes], "vllm": p.vllm.to_json()}
        typer.echo(json.dumps(out, ensure_ascii=False, indent=2))
        return
    if fmt == "sh":
        typer.echo(render_sh(p), nl=False)
        return
    console.print(Text(f"deployment {dep.cluster.name}", style="bold underline"))
    for spec in p.processes:
        console.print(Text(f"{spec.name} ({spec.role}, wave {spec.wave})", style="bold"))
        console.print(Text(f"  url:   {spec.url}   ready: {spec.ready_url}"))
        if spec.env:
            console.print(Text("  env:   " + " ".join(f"{k}={v}" for k, v in spec.env.items())))
        if spec.unset_env:
            console.print(Text("  unset: " + " ".join(spec.unset_env)))
        if spec.ipc_dir:
            console.print(Text(f"  mkdir: {spec.ipc_dir}   (its IPC sockets; emptied at each start)"))
        console.print(Text("  argv:  " + " ".join(_quote(a) for a in spec.argv)))
    console.print(Text(f"vLLM: {p.vllm.describe()}", style="dim"))


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
