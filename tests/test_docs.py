from __future__ import annotations

import dataclasses
import re

from pdctl import config
from pdctl.check import RULES  # noqa: F401  (the rules exist)
from tests.conftest import REPO

DOC = (REPO / "docs" / "config.md").read_text(encoding="utf-8")


def _documented() -> set[str]:
    return set(re.findall(r"^\| `([\w.]+)`", DOC, flags=re.M))


def test_every_worker_key_is_documented() -> None:
    missing = set(config.WORKER_KEYS) - _documented()
    assert not missing


def test_every_section_key_is_documented() -> None:
    keys = _documented()
    sections = {
        config.ClusterConfig: ("name", "gateway_host", "gateway_port"),
        config.KVTransferConfig: None,
        config.SupervisorConfig: None,
        config.SimConfig: None,
        config.SLOConfig: None,
        config.LoggingConfig: None,
        config.RoutingConfig: None,
    }
    for cls, names in sections.items():
        fields = names or tuple(f.name for f in dataclasses.fields(cls))
        for name in fields:
            doc_name = {"prefill_endpoints": "prefill_endpoint", "decode_endpoints": "decode_endpoint"}.get(name, name)
            assert doc_name in keys, (cls.__name__, name)


def test_every_lint_code_is_documented() -> None:
    src = "".join(f.read_text(encoding="utf-8") for f in sorted((REPO / "pdctl" / "check").glob("*.py")))
    codes = set(re.findall(r'"(PD\d{3})"', src))
    documented = set(re.findall(r"^\| (PD\d{3}) \|", DOC, flags=re.M))
    assert codes == documented
