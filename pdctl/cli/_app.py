"""The typer app, the one rich Console, and the single place errors become exit codes."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

from pdctl import __version__
from pdctl.errors import PdctlError

__all__ = ["app", "console", "err_console", "exit_without_teardown", "fail", "handle_errors"]

app = typer.Typer(
    name="pdctl",
    help="Run prefill/decode disaggregated vLLM serving: plan, launch, gateway, verify, bench.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    add_completion=False,
)

_no_color = bool(os.environ.get("NO_COLOR"))
# Rich falls back to 80 columns when output is not a terminal; tables in CI logs and pipes then fold
# every cell. Use a wide fixed width there unless COLUMNS says otherwise.
_width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
console = Console(highlight=False, no_color=_no_color, soft_wrap=True, width=_width)
err_console = Console(stderr=True, highlight=False, no_color=_no_color, soft_wrap=True, width=_width)

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, hint: str | None = None, code: int = 1) -> typer.Exit:
    """Print ``error: message`` (and a hint) to stderr; return the Exit to raise."""
    err_console.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    if hint:
        err_console.print(f"[dim]hint:[/] {hint}")
    return typer.Exit(code)


def handle_errors(func: F) -> F:
    """Map :class:`PdctlError` to ``error: ...`` + exit code; tracebacks only with PDCTL_DEBUG=1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except PdctlError as exc:
            if os.environ.get("PDCTL_DEBUG"):
                raise
            raise fail(_escape(str(exc)), _escape(exc.hint) if exc.hint else None, exc.exit_code) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _version(value: bool) -> None:
    if value:
        console.print(f"pdctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    """pdctl: prefill/decode disaggregated vLLM, as one tool."""


class _Exit:
    fast = False


def exit_without_teardown() -> None:
    """Have :func:`run` end the process as soon as the command returns, without the interpreter's teardown.

    For a command that leaves nothing of its own to clean up (``up -d``: the supervisor runs detached), whose
    return the teardown delays noticeably while vLLM CPU engines keep the cores busy (docs/performance.md,
    "Cutting pdctl's own share"). Only the console script honours it; an in-process caller (``CliRunner``) is
    unaffected.
    """
    _Exit.fast = True


def run() -> None:
    """Entry point used by the console script."""
    try:
        app()
    except BrokenPipeError:
        sys.exit(0)
    except SystemExit as exc:
        if not _Exit.fast:
            raise
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
