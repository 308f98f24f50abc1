"""scripts/demo.sh and scripts/test.sh, run in a copy of the repository's layout with stub tools.

The stubs stand in for the installer, ``pdctl``, ruff, mypy and pytest, so each test runs in a second and
checks only the scripts' own logic: demo.sh never shows a traceback whatever ``status --json`` prints, and
test.sh runs every stage even when one fails, then exits non-zero naming the failed ones.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tool(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body + "\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _tree(tmp_path: Path, script: str) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / script, tmp_path / "scripts" / script)
    _tool(tmp_path / "scripts" / "install-cpu-engine.sh", "exit 0")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / ".venv" / "bin" / "python")
    return tmp_path


@pytest.mark.parametrize("status_output", ["", "error: the run directory is damaged", '{"unexpected": 1}', "[1, 2"])
def test_demo_never_shows_a_traceback(tmp_path: Path, status_output: str) -> None:
    root = _tree(tmp_path, "demo.sh")
    log = root / "calls.log"
    # `pdctl status --json` prints whatever this case says (and fails); every other command succeeds.
    _tool(
        root / ".venv" / "bin" / "pdctl",
        f'echo "$*" >> {log}\n'
        f'if [[ "$1 $2" == "status --json" ]]; then printf %s {status_output!r}; exit 1; fi\nexit 0',
    )
    env = {**os.environ, "PDCTL_API_KEY": "k", "VENV": str(root / ".venv")}
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "demo.sh"), "--down"], cwd=root, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "JSONDecodeError" not in out
    calls = log.read_text().splitlines()
    assert any(c.startswith("up -d") for c in calls)  # not running: the demo started it
    assert any(c.startswith("verify") for c in calls) and any(c.startswith("down") for c in calls)


@pytest.mark.parametrize("status", ["ready", "starting"])
def test_demo_rerun_beside_its_running_deployment(tmp_path: Path, status: str) -> None:
    """Re-run while its deployment is up: a ready one is reused, one not ready yet is named; never a second up."""
    root = _tree(tmp_path, "demo.sh")
    log = root / "calls.log"
    answer = json.dumps({"status": status, "supervisor_running": True, "processes": []})
    _tool(
        root / ".venv" / "bin" / "pdctl",
        f'echo "$*" >> {log}\nif [[ "$1 $2" == "status --json" ]]; then printf %s {answer!r}; fi\nexit 0',
    )
    env = {**os.environ, "PDCTL_API_KEY": "k", "VENV": str(root / ".venv")}
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "demo.sh")], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    calls = log.read_text().splitlines()
    assert not any(c.startswith("up") for c in calls) and "Traceback" not in proc.stdout + proc.stderr
    if status == "ready":
        assert proc.returncode == 0 and "already running: reusing it" in proc.stdout
        assert any(c.startswith("verify") for c in calls) and not any(c.startswith("down") for c in calls)
    else:
        assert proc.returncode == 1 and "not ready (status: starting)" in proc.stderr and "down" in proc.stderr
        assert not any(c.startswith("verify") for c in calls)


def test_demo_stops_with_a_pointer_when_verify_fails(tmp_path: Path) -> None:
    root = _tree(tmp_path, "demo.sh")
    _tool(root / ".venv" / "bin" / "pdctl", '[[ "$1" == verify ]] && exit 1\nexit 0')
    env = {**os.environ, "PDCTL_API_KEY": "k", "VENV": str(root / ".venv")}
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "demo.sh")], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "verify failed" in proc.stderr and "logs --kv" in proc.stderr and "Traceback" not in proc.stderr


def _test_sh(tmp_path: Path, fast_rc: int, real_rc: int, demo: str | None = None) -> subprocess.CompletedProcess[str]:
    """test.sh with stub tools; ``demo``: what ``pdctl status --json`` of examples/cpu prints (no pdctl if None)."""
    root = _tree(tmp_path, "test.sh")
    log = root / "calls.log"
    if demo is not None:
        _tool(root / ".venv" / "bin" / "pdctl", f'echo "pdctl $*" >> {log}\nprintf %s {demo!r}')
    for tool in ("ruff", "mypy"):
        _tool(root / ".venv" / "bin" / tool, f'echo "{tool} $*" >> {log}')
    # pytest through the stub python: the fast suite and the real suite answer with the given codes.
    (root / ".venv" / "bin" / "python").unlink()
    stub = (
        f'echo "python $*" >> {log}\n'
        f'[[ "$*" == *"not real"* ]] && exit {fast_rc}\n[[ "$*" == *"-m real"* ]] && exit {real_rc}\nexit 0'
    )
    if demo is not None:  # the real interpreter answers test.sh's JSON question; pytest stays stubbed
        _tool(root / ".venv" / "bin" / "python", f'[[ "$1" == -c ]] && exec {sys.executable} "$@"\n' + stub)
    else:
        _tool(root / ".venv" / "bin" / "python", stub)
    return subprocess.run(["bash", "scripts/test.sh"], cwd=root, capture_output=True, text=True, timeout=60)


def test_test_sh_runs_the_real_stage_after_a_failing_fast_stage(tmp_path: Path) -> None:
    proc = _test_sh(tmp_path, fast_rc=1, real_rc=0)
    assert proc.returncode == 1
    calls = (tmp_path / "calls.log").read_text()
    assert "-m real" in calls  # the real stage ran anyway
    assert "FAILED stage: fast suite" in proc.stderr and "real vLLM" not in proc.stderr


def test_test_sh_names_every_failed_stage_and_passes_when_all_pass(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    proc = _test_sh(tmp_path / "a", fast_rc=1, real_rc=2)
    assert proc.returncode == 1
    assert "FAILED stage: fast suite" in proc.stderr and "FAILED stage: real vLLM CPU end to end" in proc.stderr
    (tmp_path / "b").mkdir()
    ok = _test_sh(tmp_path / "b", fast_rc=0, real_rc=0)
    assert ok.returncode == 0 and "all stages passed" in ok.stdout


def test_test_sh_says_the_demo_may_stay_up_and_runs_every_stage(tmp_path: Path) -> None:
    up = json.dumps({"status": "ready", "supervisor_running": True})
    (tmp_path / "up").mkdir()
    proc = _test_sh(tmp_path / "up", fast_rc=0, real_rc=0, demo=up)
    assert proc.returncode == 0 and "all stages passed" in proc.stdout, proc.stdout + proc.stderr
    assert "demo's deployment (examples/cpu) is up; the tests run beside it" in proc.stdout
    calls = (tmp_path / "up" / "calls.log").read_text()
    assert "pdctl status --json -c examples/cpu/config.toml" in calls and "-m real" in calls
    assert "pdctl down" not in calls  # the note only says how; test.sh never stops the demo
    for state in (json.dumps({"status": "stopped", "supervisor_running": False}), "error: damaged"):
        (tmp_path / "x").mkdir()
        quiet = _test_sh(tmp_path / "x", fast_rc=0, real_rc=0, demo=state)
        assert quiet.returncode == 0 and "demo's deployment" not in quiet.stdout + quiet.stderr
        shutil.rmtree(tmp_path / "x")
