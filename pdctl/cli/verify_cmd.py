"""``pdctl verify``: the recipe's requests and the KV-link proof, as a checklist with an exit code."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from pdctl import config
from pdctl.cli._app import app, console, handle_errors

if TYPE_CHECKING:
    from pdctl.verify import CheckResult, VerifyReport

_MARK = {True: ("✓", "green"), False: ("✗", "bold red"), None: ("-", "yellow")}


@app.command()
@handle_errors
def verify(
    config_path: Annotated[Path, typer.Option("-c", "--config", help="The cluster/worker file.")] = Path(
        config.DEFAULT_CONFIG
    ),
    settings_path: Annotated[Path, typer.Option("-s", "--settings", help="The gateway/routing file.")] = Path(
        config.DEFAULT_SETTINGS
    ),
    gateway: Annotated[
        str | None, typer.Option("--gateway", help="Gateway base URL (default: settings.json gateway.listen).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"ok", "checks": [...]} only.')] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds allowed for each request.", min=1)] = 120.0,
    compare_colocated: Annotated[
        bool,
        typer.Option("--compare-colocated", help="Also measure the stream's TTFT on one worker without PD."),
    ] = False,
) -> None:
    """Send the recipe's test requests and prove the KV moved from prefill to decode intact.

    Exit 0: every check passed; 1: a check failed; 2: the deployment could not be reached.
    The key is read from the variable named by gateway.api_key_env (never from the command line).
    """
    from pdctl.verify import run_verify  # httpx and the KV checks: only this command pays for them

    dep = config.load(config_path, settings_path)
    key = os.environ.get(dep.gateway.api_key_env) or None
    logs = dep.run_dir / "logs"
    report = run_verify(
        dep,
        gateway_url=gateway,
        api_key=key,
        logs_dir=logs if logs.is_dir() else None,
        timeout_s=timeout,
        compare_colocated=compare_colocated,
    )
    if as_json:
        typer.echo(json.dumps(report.to_json(), ensure_ascii=False, indent=2))
    else:
        render_report(report)
    raise typer.Exit(report.exit_code)


def render_report(report: VerifyReport) -> None:
    """The checklist: mark, name, time, detail; failures add their cause and next step."""
    width = max((len(c.name) for c in report.checks), default=10)
    for c in report.checks:
        console.print(_line(c, width), soft_wrap=True)
        if c.ok is False:
            if c.cause:
                console.print(Text("    cause: ", style="dim") + Text(c.cause), soft_wrap=True)
            if c.next_step:
                console.print(Text("    next:  ", style="dim") + Text(c.next_step), soft_wrap=True)
    passed = sum(c.ok is True for c in report.checks)
    failed = sum(c.ok is False for c in report.checks)
    skipped = sum(c.ok is None for c in report.checks)
    if not report.reachable:
        console.print(Text("cannot reach the deployment: nothing answered (is it up? `pdctl status`)", "bold red"))
    verdict = Text("PASS" if report.ok else "FAIL", style="bold green" if report.ok else "bold red")
    console.print(Text("verify: ") + verdict + Text(f"  {passed} passed, {failed} failed, {skipped} skipped"))


def _line(c: CheckResult, width: int) -> Text:
    mark, style = _MARK[c.ok]
    text = Text(f"{mark} ", style=style)
    text.append(c.name.ljust(width), style="bold")
    text.append(f" {c.duration_ms:>7.0f} ms  ", style="dim")
    text.append(c.detail)
    return text
