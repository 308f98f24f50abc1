"""The gateway package's import graph is one-way: no module imports one that imports it back (TYPE_CHECKING too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pdctl.gateway

PACKAGE = Path(pdctl.gateway.__file__).parent
PREFIX = "pdctl.gateway."


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out.update(n.removeprefix(PREFIX).split(".")[0] for n in names if n.startswith(PREFIX))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []

    def walk(path: list[str]) -> None:
        for dep in sorted(graph.get(path[-1], ())):
            if dep in path:
                found.append([*path[path.index(dep) :], dep])
            else:
                walk([*path, dep])

    for name in sorted(graph):
        walk([name])
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"app": {"pd"}, "pd": {"routing", "app"}, "routing": set()}) == [
        ["app", "pd", "app"],
        ["pd", "app", "pd"],
    ]


def test_gateway_package_has_no_import_cycle() -> None:
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py")}
    assert "pd" in graph["app"] and "routing" in graph["pd"]  # the graph was read
    assert _cycles(graph) == []
