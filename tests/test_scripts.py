"""scripts/demo.sh and scripts/test.sh, run in a copy of the repository's layout with stub tools.

The stubs stand in for the installer, ``pdctl``, ruff, mypy and pytest, so each test runs in a second and
checks only the scripts' own logic: demo.sh never shows a traceback whatever ``status --json`` prints, and
test.sh runs every stage even when one fails, then exits non-zero naming the failed ones.
"""

from __future__ import annotations

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


def test_demo_stops_with_a_pointer_when_verify_fails(tmp_path: Path) -> None:
    root = _tree(tmp_path, "demo.sh")
    _tool(root / ".venv" / "bin" / "pdctl", '[[ "$1" == verify ]] && exit 1\nexit 0')
    env = {**os.environ, "PDCTL_API_KEY": "k", "VENV": str(root / ".venv")}
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "demo.sh")], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "verify failed" in proc.stderr and "logs --kv" in proc.stderr and "Traceback" not in proc.stderr


def _test_sh(tmp_path: Path, fast_rc: int, real_rc: int) -> subprocess.CompletedProcess[str]:
    root = _tree(tmp_path, "test.sh")
    log = root / "calls.log"
    for tool in ("ruff", "mypy"):
        _tool(root / ".venv" / "bin" / tool, f'echo "{tool} $*" >> {log}')
    # pytest through the stub python: the fast suite and the real suite answer with the given codes.
    (root / ".venv" / "bin" / "python").unlink()
    _tool(
        root / ".venv" / "bin" / "python",
        f'echo "python $*" >> {log}\n'
        f'[[ "$*" == *"not real"* ]] && exit {fast_rc}\n[[ "$*" == *"-m real"* ]] && exit {real_rc}\nexit 0',
    )
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
