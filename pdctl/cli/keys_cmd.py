"""``pdctl keys add/list/revoke``: edit the gateway's keys file (digests only; a new key is printed once).
``pdctl keys kv-events``: a CURVE key set for the KV events port."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from pdctl.cli._app import app, console, fail, handle_errors
from pdctl.config import DEFAULT_SETTINGS, RateLimitConfig, load_settings

keys_app = typer.Typer(
    help="Per-user API keys for the gateway (gateway.keys_file); CURVE keys for the KV events port.",
    no_args_is_help=True,
)
app.add_typer(keys_app, name="keys")

FileOpt = Annotated[
    Path | None,
    typer.Option("-f", "--file", help="The keys file (default: gateway.keys_file of settings.json, else keys.json)."),
]
SettingsOpt = Annotated[Path, typer.Option("-s", "--settings", help="settings.json, to find gateway.keys_file.")]


def _keys_file(file: Path | None, settings: Path) -> Path:
    if file is not None:
        return file
    if settings.exists():
        g = load_settings(settings).gateway
        if g.keys_file:
            return Path(g.keys_file)
    return Path("keys.json")


@keys_app.command("add")
@handle_errors
def add(
    name: Annotated[str, typer.Argument(help="The key's name: labels its metrics and log lines.")],
    file: FileOpt = None,
    settings: SettingsOpt = Path(DEFAULT_SETTINGS),
    rpm: Annotated[int | None, typer.Option("--rpm", min=1, help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option("--tpm", min=1, help="Tokens (prompt + max_tokens) per minute.")] = None,
    max_concurrency: Annotated[int | None, typer.Option(min=1, help="Requests in flight at once.")] = None,
    model: Annotated[
        list[str] | None, typer.Option("--model", help="A model it may use (repeat; default: all).")
    ] = None,
    upstream: Annotated[bool, typer.Option(help="Whether it may use the upstream channel.")] = True,
) -> None:
    """Create a key, store its SHA-256 digest, and print the key (this one time only)."""
    from pdctl.gateway.keys import add_key

    path = _keys_file(file, settings)
    key = add_key(path, name, RateLimitConfig(rpm, tpm, max_concurrency), tuple(model) if model else None, upstream)
    console.print(f"added key {name!r} to {path}; give it to its user now, it is not shown again:", markup=False)
    console.print(key, markup=False, soft_wrap=True)
    console.print(f'a running gateway picks it up within a second (settings.json: "keys_file": "{path}")', markup=False)


@keys_app.command("list")
@handle_errors
def list_(file: FileOpt = None, settings: SettingsOpt = Path(DEFAULT_SETTINGS)) -> None:
    """Names, limits and permissions of the keys (never a key)."""
    from pdctl.gateway.keys import load_keys

    path = _keys_file(file, settings)
    table = Table("name", "rpm", "tpm", "concurrency", "models", "upstream")
    for e in load_keys(path, need_env=False):
        lim = e.limits
        table.add_row(
            e.name,
            *(str(v) if v is not None else "-" for v in (lim.requests_per_minute, lim.tokens_per_minute,
                                                       lim.max_concurrency)),
            ", ".join(e.models) if e.models is not None else "all",
            "yes" if e.upstream else "no",
        )  # fmt: skip
    console.print(table)


@keys_app.command("revoke")
@handle_errors
def revoke(
    name: Annotated[str, typer.Argument(help="The key's name.")],
    file: FileOpt = None,
    settings: SettingsOpt = Path(DEFAULT_SETTINGS),
) -> None:
    """Remove a key; a running gateway refuses it (401) within a second, or at once on SIGHUP."""
    from pdctl.gateway.keys import revoke_key

    path = _keys_file(file, settings)
    revoke_key(path, name)
    console.print(f"revoked key {name!r} in {path}", markup=False)


@keys_app.command("kv-events")
@handle_errors
def kv_events(
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write them to this file (mode 0600; default: stdout).")
    ] = None,
    format_: Annotated[
        str, typer.Option("--format", help="env (NAME=value lines) or k8s (a Secret manifest).")
    ] = "env",
    namespace: Annotated[str | None, typer.Option("--namespace", help="The Secret's namespace (k8s).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --output file.")] = False,
) -> None:
    """A fresh CURVE key set for the KV events port (routing.kv_events_curve): the gateway's and the relays'."""
    from pdctl.vllm.kv_curve import env_file, new_keys, secret_manifest

    if format_ not in ("env", "k8s"):
        raise fail(f"--format {format_}: expected env or k8s", code=2)
    keys = new_keys()
    text = env_file(keys) if format_ == "env" else secret_manifest(keys, namespace)
    if output is None:
        console.print(text, markup=False, end="")
        return
    try:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL), 0o600)
    except FileExistsError:
        raise fail(f"{output} exists", hint="pass --force to replace it (the old keys stop working)") from None
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
    use = f"kubectl apply -f {output}" if format_ == "k8s" else f"set -a; . {output}; set +a"
    console.print(f"wrote a CURVE key set for the KV events port to {output} (mode 0600); load it with `{use}`",
                  markup=False)  # fmt: skip
