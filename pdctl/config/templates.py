"""``pdctl init``: write the recipe's config.toml and settings.json into a folder."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import tomlkit

from pdctl.errors import PdctlError

__all__ = ["TEMPLATES", "write_templates"]

TEMPLATES = ("config.toml", "settings.json")


def template_text(name: str) -> str:
    """The packaged recipe file ``name`` (comments included)."""
    return resources.files("pdctl").joinpath("data", name).read_text(encoding="utf-8")


def write_templates(folder: Path, force: bool = False) -> list[Path]:
    """Write both files into ``folder``; refuse to overwrite an existing one unless ``force``."""
    targets = [folder / name for name in TEMPLATES]
    existing = [p for p in targets if p.exists()]
    if existing and not force:
        names = ", ".join(str(p) for p in existing)
        raise PdctlError(f"{names} already exists; nothing was written", hint="pass --force to overwrite")
    folder.mkdir(parents=True, exist_ok=True)
    for path in targets:
        text = template_text(path.name)
        if path.suffix == ".toml":
            # Round-trip through tomlkit: comments and layout are kept exactly.
            text = tomlkit.dumps(tomlkit.parse(text))
        path.write_text(text, encoding="utf-8")
    return targets
