"""The lint rules' registry (pdctl/check/rules.py): docs/config.md's table is its text, every code a rule reports
is registered with the severity it reports, and every registered rule is reported somewhere."""

from __future__ import annotations

import re

from pdctl.check.rules import RULES, by_code, table
from tests.conftest import REPO

CHECK = REPO / "pdctl" / "check"


def _reported() -> dict[str, set[str]]:
    """Code -> the severities the rule modules report it with (``c.at("PD0NN", "severity", ...)``)."""
    found: dict[str, set[str]] = {}
    for path in CHECK.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        for code, severity in re.findall(r'"(PD\d{3})",\s*(?:"(error|warning|info)")?', text):
            found.setdefault(code, set()).update({severity} if severity else set())
    return found


def test_docs_config_md_holds_the_registrys_table() -> None:
    doc = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    section = doc.split("## Lint rules (`pdctl check`)\n", 1)[1]
    rows = "\n".join(line for line in section.split("\n\n", 1)[0].splitlines() if line.startswith("|"))
    assert rows == table(), "docs/config.md's lint table differs from pdctl/check/rules.py: regenerate it from table()"


def test_every_reported_code_is_registered_with_its_severity() -> None:
    reported = _reported()
    registered = {r.code for r in RULES}
    assert set(reported) - {"PD000"} <= registered and "PD000" in registered
    for code, severities in reported.items():
        for severity in severities:
            assert severity in by_code(code).severity, (code, severity, by_code(code).severity)


def test_every_registered_rule_is_reported_and_each_code_is_declared_once() -> None:
    codes = [r.code for r in RULES]
    assert len(codes) == len(set(codes))
    assert set(codes) <= set(_reported()) | {"PD000"}  # PD000: a load error (findings.finding_from_error)


def test_a_rule_names_its_measurement_by_doc_section_not_in_its_text() -> None:
    for rule in RULES:
        assert not re.search(r"\d req/s|measured on|load average", rule.title + rule.fix), rule.code
        if rule.doc:
            path, _, section = rule.doc.partition(", ")
            text = (REPO / path).read_text(encoding="utf-8")
            assert re.search(rf"^#+ {re.escape(section.strip(chr(34)))}$", text, re.M), rule.doc
