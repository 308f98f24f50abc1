"""docs/architecture.md names every module of pdctl (one row each), so the map stays the code's."""

from __future__ import annotations

from tests.conftest import REPO


def test_every_module_has_a_row() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    modules = sorted(
        p.relative_to(REPO / "pdctl").as_posix() for p in (REPO / "pdctl").rglob("*.py") if p.name != "__init__.py"
    )
    missing = [m for m in modules if f"| `{m}` |" not in doc]
    assert not missing, f"docs/architecture.md has no row for {missing}"
