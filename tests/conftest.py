from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdctl.testing import SimProcess

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "tests" / "fixtures" / "recipe"


@pytest.fixture
def recipe_files(tmp_path: Path) -> Callable[..., tuple[Path, Path]]:
    """Copy the recipe's two files into tmp_path, with optional text replacements, and return their paths."""

    def make(
        config_edits: dict[str, str] | None = None,
        settings_edits: dict[str, str] | None = None,
        config_append: str = "",
    ) -> tuple[Path, Path]:
        ctext = (RECIPE / "config.toml").read_text(encoding="utf-8")
        stext = (RECIPE / "settings.json").read_text(encoding="utf-8")
        for old, new in (config_edits or {}).items():
            assert old in ctext, old
            ctext = ctext.replace(old, new)
        for old, new in (settings_edits or {}).items():
            assert old in stext, old
            stext = stext.replace(old, new)
        cpath, spath = tmp_path / "config.toml", tmp_path / "settings.json"
        cpath.write_text(ctext + config_append, encoding="utf-8")
        spath.write_text(stext, encoding="utf-8")
        return cpath, spath

    return make


@pytest.fixture
def cli() -> Callable[..., object]:
    from pdctl.cli import app

    runner = CliRunner()

    def invoke(*args: str, env: dict[str, str] | None = None) -> object:
        return runner.invoke(app, list(args), env=env, catch_exceptions=False)

    return invoke


@pytest.fixture
def sim_procs() -> Iterator[list[SimProcess]]:
    """Simulator processes a test starts (append them); stopped at teardown."""
    started: list[SimProcess] = []
    yield started
    for s in started:
        s.stop()
