"""``pdctl gateway``: run the gateway in the foreground (the process ``up`` starts)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from pdctl.cli._app import app, console, handle_errors
from pdctl.config import DEFAULT_SETTINGS, load, load_settings
from pdctl.runtime.plan import GATEWAY_HOLD_ENV


@app.command("gateway")
@handle_errors
def gateway(
    config: Annotated[
        Path | None, typer.Option("-c", "--config", help="config.toml (instance names, models, max_model_len).")
    ] = None,
    settings: Annotated[Path, typer.Option("-s", "--settings", help="settings.json.")] = Path(DEFAULT_SETTINGS),
    host: Annotated[str | None, typer.Option(help="Listen address (default: gateway.listen).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (default: gateway.listen).")] = None,
) -> None:
    """Run the OpenAI-compatible gateway (keys: gateway.keys_file, else the variable named by gateway.api_key_env).

    With PDCTL_GATEWAY_HOLD=FILE set (as `pdctl up` does) it sets everything up, then waits for FILE to exist
    before it listens. With gateway.workers > 1 it starts that many gateway processes on the port and watches them.
    """
    from pdctl.gateway.app import create_app
    from pdctl.gateway.auth import read_key
    from pdctl.gateway.processes import (
        KV_EVENTS_RELAY_ENV,
        events_relay,
        listener_for,
        metrics_dir,
        process_slot,
        supervise,
    )
    from pdctl.gateway.server import configure_logging, make_server, run, stop_timeout_s, tls_files, wait_for_release
    from pdctl.gateway.settings import from_deployment, from_settings

    dep = load(config, settings) if config is not None else None
    gw_settings = from_deployment(dep) if dep is not None else from_settings(load_settings(settings))
    if host is not None:
        gw_settings = replace(gw_settings, gateway=replace(gw_settings.gateway, listen_host=host))
    g = gw_settings.gateway
    slot = process_slot(os.environ)
    # With a keys file, $api_key_env is optional: the operator's key (verify, bench), named "default".
    key = os.environ.get(g.api_key_env) or None if g.keys_file else read_key(g.api_key_env, "gateway.api_key_env")
    upstream_key = None
    if g.upstream_api_key_env:
        upstream_key = read_key(g.upstream_api_key_env, "gateway.upstream_api_key_env")
    listen_host = host or g.listen_host
    listen_port = port if port is not None else g.listen_port
    where = f"{'https' if g.tls_certfile else 'http'}://{listen_host}:{listen_port}"
    configure_logging(gw_settings.logging.level, with_pid=slot is not None)
    if g.workers > 1 and slot is None:
        tls_files(g)  # a bad TLS file is reported once, here, not by every process
        console.print(f"pdctl gateway on {where}: {g.workers} processes (gateway.workers)", markup=False)
        argv = [sys.executable, "-m", "pdctl", "gateway", "-s", str(settings)]
        argv += ["-c", str(config)] if config is not None else []
        argv += ["--host", host] if host is not None else []
        argv += ["--port", str(port)] if port is not None else []
        relay = events_relay(replace(gw_settings, gateway=replace(gw_settings.gateway, listen_host=listen_host)))
        try:
            extra = {KV_EVENTS_RELAY_ENV: relay.endpoint} if relay is not None else {}
            code = supervise(argv, g.workers, metrics_dir(dep.run_dir if dep else None), stop_timeout_s(g),
                             dep is None, extra)  # fmt: skip
        finally:
            if relay is not None:
                relay.close()
        if code:
            raise typer.Exit(code)
        return
    if slot is not None:
        gw_settings = replace(gw_settings, process=slot[:2], kv_events_connect=os.environ.get(KV_EVENTS_RELAY_ENV))
    app_ = create_app(gw_settings, key, upstream_key)
    server = make_server(app_, listen_host, listen_port, slot[2] if slot is not None else None)
    hold = os.environ.get(GATEWAY_HOLD_ENV)
    if hold and not Path(hold).exists():  # a restart under `up` finds the file: it must not hold

        def announce() -> None:
            console.print(f"pdctl gateway: set up; held until {hold} exists before listening on {where}", markup=False)

        if not wait_for_release(Path(hold), announce=announce):
            console.print("pdctl gateway: stopped while held (never listened)")
            return
    if slot is not None:
        run(server, listener_for(listen_host, listen_port))
        return
    console.print(
        f"pdctl gateway on {where} ({gw_settings.routing.strategy}, "
        f"{len(gw_settings.prefill)} prefill, {len(gw_settings.decode)} decode"
        + (f", upstream {g.upstream_base_url}" if g.upstream_base_url else "")
        + ")"
    )
    run(server)
