"""examples/cpu-ab: the PD and colocated gateways of the real-engine A/B load cleanly and share one engine pair."""

from __future__ import annotations

import pytest

from pdctl.check import run_checks
from pdctl.config import load
from pdctl.vllm.tiny_model import SIZES
from tests.conftest import REPO

AB = REPO / "examples" / "cpu-ab"


@pytest.mark.parametrize("settings", ["settings.json", "settings-colocated.json"])
def test_cpu_ab_example_checks_clean(settings: str) -> None:
    dep = load(AB / "config.toml", AB / settings)
    findings = run_checks(dep, env={"PDCTL_API_KEY": "k"})
    # Only what depends on this machine may be worse than info: the model folder the user generates (PD006), ports
    # another deployment holds right now (PD018: the CPU demo uses the same ports) and a missing vLLM (PD016, in the
    # fast suite's venv without it).
    assert [f.code for f in findings if f.severity != "info" and f.code not in {"PD006", "PD016", "PD018"}] == []
    assert [list(w.cpu_ids or ()) for w in dep.workers] == [[0], [1]]  # one core each


def test_cpu_ab_gateways_route_the_same_workers_on_two_ports() -> None:
    pd, colocated = (load(AB / "config.toml", AB / name) for name in ("settings.json", "settings-colocated.json"))
    assert (pd.routing.strategy, colocated.routing.strategy) == ("pd_disagg", "colocated")
    assert [w.url for w in pd.workers] == [w.url for w in colocated.workers]
    assert pd.gateway.url != colocated.gateway.url
    # The example serves the `small` preset, whose context fits the long prompts it benches.
    assert "small-qwen3" in pd.workers[0].model
    assert all(w.max_model_len == SIZES["small"].max_position_embeddings for w in pd.workers)
