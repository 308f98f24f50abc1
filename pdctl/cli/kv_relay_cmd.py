"""``pdctl kv-relay``: one worker's KV events relay, plain on loopback in, CURVE out to the gateway
(:mod:`pdctl.vllm.kv_relay`); ``pdctl up`` starts one per worker under ``routing.kv_events_curve``."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Annotated

import typer

from pdctl.cli._app import app, console, handle_errors


@app.command("kv-relay")
@handle_errors
def kv_relay(
    listen: Annotated[str, typer.Option("--listen", help="Where the worker publishes: HOST:PORT, loopback.")],
    to: Annotated[str, typer.Option("--to", help="The gateway's KV events address: tcp://HOST:PORT.")],
) -> None:
    """Forward a worker's KV cache events to the gateway over ZMQ CURVE (keys from the environment only:
    PDCTL_KV_EVENTS_CLIENT_SECRET and PDCTL_KV_EVENTS_SERVER_PUBLIC; `pdctl keys kv-events` makes them)."""
    from pdctl.config.schema import parse_listen
    from pdctl.errors import ConfigError
    from pdctl.vllm.kv_curve import client_keys
    from pdctl.vllm.kv_relay import WorkerRelay

    try:
        host, port = parse_listen(listen)
    except ValueError:
        raise ConfigError("argv", "--listen", f"{listen!r} is not HOST:PORT", hint="e.g. 127.0.0.1:5558") from None
    if not to.startswith("tcp://"):
        raise ConfigError("argv", "--to", f"{to!r} is not tcp://HOST:PORT", hint="e.g. tcp://10.0.0.5:5557")
    relay = WorkerRelay(f"tcp://{host}:{port}", to, client_keys())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    relay.run(stop)
    console.print(f"pdctl kv-relay: stopped after forwarding {relay.forwarded} message(s)", markup=False)
