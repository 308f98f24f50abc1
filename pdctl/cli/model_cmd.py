"""``pdctl model tiny DIR``: generate the tiny random model the CPU demo and the real e2e test serve."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from pdctl.cli._app import app, console, handle_errors

__all__ = ["model_app"]

model_app = typer.Typer(
    help="Generate local models for demos and tests.", no_args_is_help=True, rich_markup_mode="rich"
)
app.add_typer(model_app, name="model")


@model_app.command("tiny")
@handle_errors
def tiny(
    directory: Annotated[Path, typer.Argument(help="Folder to write the model into (created if missing).")],
    seed: Annotated[int, typer.Option("--seed", help="Random seed; the same seed gives identical files.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing model in DIR.")] = False,
    size: Annotated[
        str, typer.Option("--size", help="tiny (0.4M parameters), small (13M) or medium (40M): docs/cpu.md.")
    ] = "tiny",
) -> None:
    """Write a small random Qwen3 (head_dim 64, byte-level BPE, ChatML template) to DIR.

    Needs torch + transformers (they come with vLLM: scripts/install-cpu-engine.sh). Reuses DIR when it
    already holds the model for the same seed and size.
    """
    from pdctl.errors import PdctlError
    from pdctl.vllm.tiny_model import SIZES, generate_tiny_model

    if size not in SIZES:
        raise PdctlError(f"--size: unknown size {size!r}", hint=f"use one of {', '.join(SIZES)}")
    started = time.monotonic()
    model = generate_tiny_model(directory, seed=seed, force=force, spec=SIZES[size])
    if model.created:
        console.print(
            f"wrote {model.path}: Qwen3ForCausalLM ({size}), {model.num_parameters:,} parameters, "
            f"vocab {model.vocab_size}, seed {model.seed} ({time.monotonic() - started:.1f} s)"
        )
    else:
        console.print(f"reusing {model.path}: the {size} model with seed {model.seed} is already there")
