"""The single API key and the upstream key, read from the environment at start (:mod:`pdctl.gateway.keys` checks)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from pdctl.errors import PdctlError

__all__ = ["MissingKeyError", "looks_like_key", "read_key"]


class MissingKeyError(PdctlError):
    """The environment variable that should hold the API key is not set."""


_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def looks_like_key(name: str) -> bool:
    """Whether an ``*_env`` setting holds a key instead of a variable name (the recipe's §5.2 mistake)."""
    if name.startswith(("sk-", "sk_", "pk-", "Bearer ")):
        return True
    if _ENV_NAME.match(name):
        return False
    has_lower = any(c.islower() for c in name)
    has_digit = any(c.isdigit() for c in name)
    return (len(name) >= 16 and has_lower and has_digit) or ("-" in name and len(name) >= 20)


def read_key(env_name: str, setting: str, environ: Mapping[str, str] | None = None) -> str:
    """The value of ``$env_name``; raises :class:`MissingKeyError` explaining how to fix it."""
    env = os.environ if environ is None else environ
    value = env.get(env_name, "")
    if value:
        return value
    if looks_like_key(env_name):
        raise MissingKeyError(
            f"settings.json: {setting}: this looks like an API key, not the name of an environment variable",
            hint=(
                f"{setting} names the variable that holds the key (the recipe's §5.2 mistake puts the key "
                f'itself there). Set "{setting.split(".")[-1]}": "PDCTL_API_KEY" and run '
                "`export PDCTL_API_KEY=...` before starting; remove the key from settings.json and rotate it."
            ),
        )
    raise MissingKeyError(
        f"settings.json: {setting}: environment variable {env_name} is not set",
        hint=f"export {env_name}=<your key> in the gateway's environment (never on a command line)",
    )
