"""``pdctl trace REQUEST_ID``: one request's timeline through gateway, prefill and decode
(data: :mod:`pdctl.runtime.trace`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from pdctl.cli._app import app, handle_errors
from pdctl.cli.run_cmds import ConfigOpt, OnlyOpt, RunDirOpt, SettingsOpt, _run_dir
from pdctl.config import DEFAULT_CONFIG, DEFAULT_SETTINGS, load
from pdctl.errors import ConfigError


@app.command("trace")
@handle_errors
def trace(
    request_id: Annotated[str, typer.Argument(help="The request's id (the gateway's x-request-id).")],
    config: ConfigOpt = Path(DEFAULT_CONFIG),
    settings: SettingsOpt = Path(DEFAULT_SETTINGS),
    run_dir: RunDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="The timeline as one JSON document.")] = False,
    only: OnlyOpt = None,
) -> None:
    """One request's journey: arrival, decision, prefill, KV transfer, decode, end, from the deployment's logs."""
    from pdctl.runtime.control import log_files
    from pdctl.runtime.trace import trace_request

    slo_ttft: float | None = None
    slo_tpot: float | None = None
    try:
        dep = load(config, settings)
        slo_ttft, slo_tpot = dep.slo.ttft_ms, dep.slo.tpot_ms
    except ConfigError:
        pass  # the logs are still readable; the SLO comparison is left out
    files = log_files(_run_dir(config, settings, run_dir, only), [])
    t = trace_request(files, request_id, slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot)
    out = sys.stdout
    if as_json:
        out.write(json.dumps(t.to_json(), ensure_ascii=False, indent=2) + "\n")
        return
    acc = t.access or {}
    head = f"request {t.request_id}"
    if acc:
        head += (
            f": path={acc.get('path', '-')} status={acc.get('status', '-')} duration_ms={acc.get('duration_ms', '-')}"
        )
    else:
        head += ": no gateway access line (worker logs only)"
    out.write(head + "\n")
    if t.access_lines > 1:
        out.write(f"note: {t.access_lines} access lines carry this id; the last one is shown\n")
    if t.worker_ids:
        out.write(f"worker ids: {', '.join(t.worker_ids)}\n")
    width = max(len(r.event) for r in t.rows)
    pwidth = max(len(r.process) for r in t.rows)
    for r in t.rows:
        if r.at_ms is None:
            when = "-"
        elif r.exact:
            when = f"+{r.at_ms:.1f} ms"
        else:
            when = f"~+{r.at_ms / 1000:.0f} s"
        out.write(f"{when:>12}  {r.stage:<8} {r.event:<{width}}  {r.process:<{pwidth}}  {r.detail}\n")
    out.write("(+ms: the gateway's timings; ~+s: a log line's one-second clock)\n")
