"""pdctl's command line: the only package that touches typer/rich output or exits.

Each command group lives in its own module and registers on the shared ``app``.
"""

from __future__ import annotations

from pdctl.cli import (  # noqa: F401  (imported for their command registrations)
    bench_cmd,
    config_cmds,
    gateway_cmd,
    keys_cmd,
    model_cmd,
    render_cmd,
    run_cmds,
    verify_cmd,
)
from pdctl.cli._app import app, run

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    run()
