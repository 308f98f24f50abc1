"""``pdctl gateway``: run the gateway in the foreground (the process ``up`` starts)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from pdctl.cli._app import app, console, handle_errors
from pdctl.config import DEFAULT_SETTINGS, load, load_settings
from pdctl.plan import GATEWAY_HOLD_ENV


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
    before it listens.
    """
    from pdctl.gateway.app import create_app
    from pdctl.gateway.auth import read_key
    from pdctl.gateway.server import configure_logging, make_server, run, wait_for_release
    from pdctl.gateway.settings import from_deployment, from_settings

    if config is not None:
        gw_settings = from_deployment(load(config, settings))
    else:
        gw_settings = from_settings(load_settings(settings))
    if host is not None:
        gw_settings = replace(gw_settings, gateway=replace(gw_settings.gateway, listen_host=host))
    g = gw_settings.gateway
    # With a keys file, $api_key_env is optional: the operator's key (verify, bench), named "default".
    key = os.environ.get(g.api_key_env) or None if g.keys_file else read_key(g.api_key_env, "gateway.api_key_env")
    upstream_key = None
    if g.upstream_api_key_env:
        upstream_key = read_key(g.upstream_api_key_env, "gateway.upstream_api_key_env")
    configure_logging(gw_settings.logging.level)
    listen_host = host or g.listen_host
    listen_port = port if port is not None else g.listen_port
    server = make_server(create_app(gw_settings, key, upstream_key), listen_host, listen_port)
    where = f"{'https' if g.tls_certfile else 'http'}://{listen_host}:{listen_port}"
    hold = os.environ.get(GATEWAY_HOLD_ENV)
    if hold and not Path(hold).exists():  # a restart under `up` finds the file: it must not hold
        console.print(f"pdctl gateway: set up; held until {hold} exists before listening on {where}", markup=False)
        if not wait_for_release(Path(hold)):
            console.print("pdctl gateway: stopped while held (never listened)")
            return
    console.print(
        f"pdctl gateway on {where} ({gw_settings.routing.strategy}, "
        f"{len(gw_settings.prefill)} prefill, {len(gw_settings.decode)} decode"
        + (f", upstream {g.upstream_base_url}" if g.upstream_base_url else "")
        + ")"
    )
    run(server)
