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


def test_tests_mirror_the_packages() -> None:
    """A package's tests live in tests/<package>/ (docs/architecture.md, Tests), each folder a package itself."""
    packages = sorted(p.parent.name for p in (REPO / "pdctl").glob("*/__init__.py"))
    assert "gateway" in packages
    top = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    misplaced = [n for n in top for pkg in packages if n == f"test_{pkg}.py" or n.startswith(f"test_{pkg}_")]
    assert not misplaced, f"move {misplaced} to tests/<package>/ (docs/architecture.md, Tests)"
    folders = [p.parent for p in (REPO / "tests").glob("*/test_*.py")]
    assert folders and all((f / "__init__.py").is_file() and f.name in packages for f in folders), folders
