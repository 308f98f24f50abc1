"""The gateway package's import graph is one-way: no module imports one that imports it back (TYPE_CHECKING too);
a subpackage (``routing``) is one node, and the request paths reach routing only through its facade."""

from __future__ import annotations

import ast
from pathlib import Path

import pdctl.gateway

PACKAGE = Path(pdctl.gateway.__file__).parent
PREFIX = "pdctl.gateway."
#: The modules whose choice of instance goes through :class:`pdctl.gateway.routing.Router` alone.
ROUTED = ("pd", "legs", "app", "migration")


def _modules(path: Path) -> list[str]:
    """Every ``pdctl.*`` module ``path`` imports, dotted in full (``from pdctl.gateway import x`` names ``x``)."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            out.extend(f"{node.module}.{a.name}" for a in node.names if node.module in ("pdctl.gateway",))
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return [n for n in out if n.startswith("pdctl.")]


def _imports(path: Path) -> set[str]:
    return {n.removeprefix(PREFIX).split(".")[0] for n in _modules(path) if n.startswith(PREFIX)}


def _graph() -> dict[str, set[str]]:
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py")}
    for sub in (d for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()):
        graph[sub.name] = set().union(*(_imports(p) for p in sub.glob("*.py"))) - {sub.name}
    return graph


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
    graph = _graph()
    assert "pd" in graph["app"] and "routing" in graph["pd"] and "record" in graph["routing"]  # the graph was read
    assert _cycles(graph) == []


def test_request_paths_choose_instances_only_through_the_router() -> None:
    """pd, legs, app and migration import the routing package itself (its facade), never its modules."""
    for name in ROUTED:
        deep = [m for m in _modules(PACKAGE / f"{name}.py") if m.startswith(f"{PREFIX}routing.")]
        assert deep == [], f"{name}.py imports routing internals {deep}: use pdctl.gateway.routing.Router"
    assert _modules(PACKAGE / "pd.py").count(f"{PREFIX}routing") == 1  # the check reads the imports


def test_the_routing_facade_is_the_only_chooser() -> None:
    """No module outside the routing package picks by policy, and the pool chooses nothing."""
    pool = (PACKAGE / "routing" / "pool.py").read_text()
    assert "def choose" not in pool and "least_loaded" not in pool and "policies" not in pool
    for path in PACKAGE.glob("*.py"):
        text = path.read_text().replace("admission.decide(", "")  # the SLO predictor's verdict, not a choice
        for call in (".by_load(", ".pick(", ".decide(", ".choose("):
            assert call not in text, f"{path.name} calls {call}: choose through pdctl.gateway.routing.Router"
