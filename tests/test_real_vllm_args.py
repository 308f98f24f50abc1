"""Every planned vLLM command line goes through the installed vLLM's own parser and config classes (PD028).

Marked ``real`` because it needs vLLM importable; it starts no engine (no GPU, no weights). Covers every
example, `pdctl init`'s files, and generated TP=2, 2P2D and two-host plans.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tomlkit

from pdctl.check import Finding, run_checks
from pdctl.config import Deployment, load
from pdctl.config.templates import write_templates
from pdctl.runtime.plan import build_plan, detect_vllm
from pdctl.vllm.args import Command, validate_commands
from tests.conftest import REPO
from tests.real_engine import require_engine

pytestmark = pytest.mark.real


@pytest.fixture(autouse=True)
def _require_vllm() -> None:
    require_engine(dists=(), modules=("vllm",))


ENV = {"TAOTOKEN_API_KEY": "sk-parser-test-0123456789", "PDCTL_API_KEY": "dev-key"}


def _deployments(tmp: Path) -> dict[str, Deployment]:
    out = {p.name: load(p / "config.toml", p / "settings.json") for p in sorted((REPO / "examples").iterdir())}
    write_templates(tmp / "init")
    out["init"] = load(tmp / "init" / "config.toml", tmp / "init" / "settings.json")
    # Two hosts: each worker binds every interface and advertises its own address to the other.
    two = tmp / "two-host"
    two.mkdir()
    doc = tomlkit.parse((tmp / "init" / "config.toml").read_text())
    doc["prefill"]["host"] = "0.0.0.0"  # type: ignore[index]
    doc["decode"]["host"] = "0.0.0.0"  # type: ignore[index]
    (two / "config.toml").write_text(tomlkit.dumps(doc))
    settings = json.loads((tmp / "init" / "settings.json").read_text())
    settings["routing"]["prefill_endpoint"] = "http://10.0.0.1:8100"
    settings["routing"]["decode_endpoint"] = "http://10.0.0.2:8200"
    (two / "settings.json").write_text(json.dumps(settings))
    out["two-host"] = load(two / "config.toml", two / "settings.json")
    return out


def test_every_planned_command_line_parses(tmp_path: Path) -> None:
    vllm = detect_vllm()
    commands = []
    for name, dep in _deployments(tmp_path).items():
        plan = build_plan(dep, vllm)
        for spec in plan.workers:
            commands.append(Command(f"{name}/{spec.name}", spec.argv[len(vllm.launch) :], 8192))
    assert {"gpu-tp2/prefill", "gpu-2p2d/decode-1", "two-host/decode", "init/prefill"} <= {c.worker for c in commands}
    assert validate_commands(commands) == []


def _init_errors(tmp: Path, old: str, new: str) -> list[Finding]:
    """Errors of `pdctl init`'s files with one edit, vLLM's parser included."""
    write_templates(tmp)
    cfg = tmp / "config.toml"
    cfg.write_text(cfg.read_text().replace(old, new))
    dep = load(cfg, tmp / "settings.json")
    return [f for f in run_checks(dep, env=dict(os.environ) | ENV, parse_with_vllm=True) if f.severity == "error"]


def test_a_refused_flag_is_an_error_naming_worker_and_key(tmp_path: Path) -> None:
    found = _init_errors(tmp_path, "max_num_seqs = 64", 'max_num_seqs = 64\nextra_args = ["--no-such-flag"]')
    assert [(f.code, f.key) for f in found] == [("PD028", "decode.extra_args")]
    assert "decode's command line (--no-such-flag)" in found[0].message
    assert "unrecognized arguments: --no-such-flag" in found[0].message


def test_scheduler_refusal_comes_from_vllm_when_pdctl_has_no_rule_for_it(tmp_path: Path) -> None:
    """vLLM's SchedulerConfig also refuses max_num_batched_tokens < max_num_seqs; pdctl has no rule of its own."""
    found = _init_errors(tmp_path, "max_num_batched_tokens = 2048", "max_num_batched_tokens = 32")
    assert [(f.code, f.key) for f in found] == [("PD028", "decode.max_num_batched_tokens")]
    assert "must be greater than or equal to max_num_seqs (64)" in found[0].message


def test_init_then_check_has_no_errors(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """Issue 14's first 'done when': `pdctl init` followed by `pdctl check` (vLLM's parser included) gives 0 errors."""
    assert cli("init", str(tmp_path)).exit_code == 0
    res = cli("check", "-c", str(tmp_path / "config.toml"), "-s", str(tmp_path / "settings.json"), "--json", env=ENV)
    findings = json.loads(res.stdout)["findings"]
    assert res.exit_code == 0 and [f for f in findings if f["severity"] == "error"] == []
    assert not [f for f in findings if f["code"] == "PD028"]  # it ran, and vLLM accepted both command lines


def test_up_refuses_a_flag_vllm_refuses_before_starting_anything(tmp_path: Path) -> None:
    """Issue 14: `up` runs vLLM's parser over its vLLM workers' command lines (PD028) before anything starts."""
    from tests.check.test_check_fixes import make_case, pdctl

    edits: dict[str, object] = {"prefill.engine": "vllm", "decode.engine": "vllm", "prefill.model": "Qwen/Qwen3-0.6B",
                                "decode.model": "Qwen/Qwen3-0.6B", "decode.extra_args": ["--no-such-flag"]}  # fmt: skip
    d = make_case(tmp_path / "case", edits, REPO / "examples" / "cpu")
    r = pdctl(d, "up", "-d", env=dict(os.environ) | ENV)
    assert r.returncode == 1, r.stdout + r.stderr
    line = (d / "config.toml").read_text().splitlines().index('extra_args = ["--no-such-flag"]') + 1
    assert f"error PD028 config.toml:{line}: decode.extra_args: vLLM" in r.stderr
    assert "refuses decode's command line (--no-such-flag)" in r.stderr
    assert "nothing was started" in r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error ")] == [
        ln for ln in r.stderr.splitlines() if ln.startswith("error PD028")
    ]
    assert not (d / ".pdctl").exists()  # no run directory: no process, no log
