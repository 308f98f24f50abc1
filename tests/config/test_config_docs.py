"""docs/config.md's key tables against the declarations in pdctl/config/ (:func:`pdctl.config.schema.key`)."""

from __future__ import annotations

import re

import pytest

from pdctl import config
from tests.conftest import REPO

DOC = (REPO / "docs" / "config.md").read_text(encoding="utf-8")


def _table(heading: str) -> dict[str, str]:
    """The rows of the table under ``heading`` (a ``### `` line starting with it), by key."""
    start = DOC.index("\n### " + heading)
    body = DOC[start:].split("\n### ", 2)[1]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    return {re.match(r"\| `([\w.]+)`", row).group(1): row for row in rows}  # type: ignore[union-attr]


def _row(name: str, spec: config.Key, columns: int) -> str:
    cells = [f"`{name}`", spec.type, spec.default, spec.doc] if columns == 4 else [f"`{name}`", spec.default, spec.doc]
    return "| " + " | ".join(cells) + " |"


SECTIONS = [
    ("`[cluster]`", config.ClusterConfig, 4),
    ("`[kv_transfer]`", config.KVTransferConfig, 4),
    ("`[connector]`", config.ConnectorConfig, 4),
    ("`gateway`", config.GatewayConfig, 4),
    ("`routing`", config.RoutingConfig, 4),
    ("`[prefill]` and `[decode]`", config.WorkerConfig, 4),
    ("`[supervisor]`", config.SupervisorConfig, 3),
    ("`[engine]`", config.EngineConfig, 3),
    ("`[sim]`", config.SimConfig, 3),
    ("`slo`", config.SLOConfig, 4),
    ("`logging`", config.LoggingConfig, 4),
]


@pytest.mark.parametrize(("heading", "cls", "columns"), SECTIONS, ids=[s[1].__name__ for s in SECTIONS])
def test_docs_table_is_the_declaration(heading: str, cls: type, columns: int) -> None:
    documented = _table(heading)
    declared = {name: _row(name, spec, columns) for name, spec in config.file_keys(cls).items()}
    assert sorted(documented) == sorted(declared), "docs/config.md lists other keys than the declarations"
    for name, row in declared.items():
        assert documented[name] == row, f"docs/config.md's row of {name!r} differs from its declaration"


def test_check_describes_every_declared_key() -> None:
    """`check`'s key table reads the declarations: every declared key has a use (none "not_applicable")."""
    from pdctl.check import describe_key

    keys = [f"{table}.{name}" for table, cls in config.DECLARED_SECTIONS.items() for name in config.file_keys(cls)]
    keys += [f"decode[1].{name}" for name in config.WORKER_KEYS]
    for key in keys:
        use = describe_key(key)
        assert use.kind != "not_applicable", key
    assert describe_key("prefill.dtype").detail == "--dtype"
