"""Write advise's counts into a config.toml: the ``replicas`` of the one ``[prefill]`` / ``[decode]`` group (or the
one ``[[prefill]]`` / ``[[decode]]`` entry), with tomlkit so comments and layout stay as they were."""

from __future__ import annotations

from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import AoT, Table

from pdctl.errors import ConfigError

__all__ = ["set_replicas"]


def set_replicas(path: Path, prefill: int, decode: int) -> None:
    """Set ``replicas`` of the prefill and decode groups in ``path`` (ConfigError naming the file otherwise)."""
    try:
        doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(str(path), None, f"cannot read: {exc.strerror or exc}") from None
    except TOMLKitError as exc:
        raise ConfigError(str(path), None, f"not TOML: {exc}") from None
    for role, count in (("prefill", prefill), ("decode", decode)):
        group = doc.get(role)
        if isinstance(group, AoT):
            if len(group) != 1:
                raise ConfigError(
                    str(path),
                    role,
                    f"[[{role}]] has {len(group)} entries; advise sets replicas on one group per role",
                    hint=f"keep one [[{role}]] entry per role and let replicas say how many pods it runs",
                )
            group = group[0]
        if not isinstance(group, Table):
            raise ConfigError(str(path), role, f"no [{role}] group to set replicas on")
        group["replicas"] = count
    path.write_text(tomlkit.dumps(doc), encoding="utf-8")
