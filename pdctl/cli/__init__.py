"""pdctl's command line: the only package that touches typer/rich output or exits.

Each command group lives in its own module and registers on the shared ``app`` (:mod:`pdctl.cli._app`).
The command modules are imported by :func:`main` (and on first use of ``app``), not when this package is: a
Ctrl-C that lands while a loaded machine is still importing them ends pdctl with 130, not a traceback.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["app", "main"]

_COMMAND_MODULES = ("bench_cmd", "capacity_cmd", "config_cmds", "gateway_cmd", "keys_cmd", "kv_relay_cmd", "model_cmd",
                    "render_cmd", "run_cmds", "top_cmd", "trace_cmd", "verify_cmd")  # fmt: skip


def _load() -> Any:
    """Import every command module (each registers its commands on ``app``); the typer app."""
    for name in _COMMAND_MODULES:
        importlib.import_module(f"pdctl.cli.{name}")
    return importlib.import_module("pdctl.cli._app")


def __getattr__(name: str) -> Any:
    if name == "app":
        return _load().app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Console-script entry point."""
    # Click turns a Ctrl-C inside a command into "Aborted!"; one that lands while the modules import or typer
    # builds the command (seconds on a loaded machine) would otherwise print a traceback.
    try:
        _load().run()
    except KeyboardInterrupt:
        sys.exit(130)
