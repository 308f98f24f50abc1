"""tests/real_engine.py: a real test without its engine skips, and fails instead under PDCTL_REQUIRE_REAL."""

from __future__ import annotations

import pytest

from tests.real_engine import engine_missing, require_engine

MISSING = ("pdctl-no-such-distribution",)


def test_an_installed_engine_is_not_missing() -> None:
    assert engine_missing(("pytest",), ("httpx",)) is None


@pytest.mark.parametrize(("dists", "modules", "named"), [
    (MISSING, (), "pdctl-no-such-distribution is not installed"),
    ((), ("pdctl_no_such_module",), "pdctl_no_such_module is not importable"),
])  # fmt: skip
def test_a_missing_engine_skips_and_fails_when_real_runs_are_required(
    dists: tuple[str, ...], modules: tuple[str, ...], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDCTL_REQUIRE_REAL", raising=False)
    with pytest.raises(pytest.skip.Exception, match=named):
        require_engine(dists, modules)
    monkeypatch.setenv("PDCTL_REQUIRE_REAL", "1")
    with pytest.raises(pytest.fail.Exception, match=f"PDCTL_REQUIRE_REAL is set but {named}"):
        require_engine(dists, modules)
