"""scripts/gpu-smoke.sh: the whole GPU path on a real GPU (``-m gpu``), and its file edits on any machine.

The ``gpu`` test runs only where ``nvidia-smi -L`` lists a GPU and vLLM's CUDA build (the ``vllm``
distribution) is installed; elsewhere it is skipped. The other test runs the script with ``--check-only``
and a stand-in ``nvidia-smi`` so the files it writes are checked on every machine that can build the tiny model.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu-smoke.sh"


def _gpu_missing() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no nvidia-smi"
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout
    if "GPU " not in listed:
        return "no NVIDIA GPU"
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "vLLM's CUDA build (the vllm distribution) is not installed"
    return None


def _run(args: list[str], path_prefix: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PDCTL_PYTHON=sys.executable, PYTHONPATH=str(REPO), NO_COLOR="1", COLUMNS="200")
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=1800)


@pytest.mark.gpu
@pytest.mark.timeout(1800)
def test_gpu_smoke_script(tmp_path: Path) -> None:
    if reason := _gpu_missing():
        pytest.skip(reason)
    r = _run([str(tmp_path)])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "== gpu-smoke passed" in r.stdout
    assert (tmp_path / "bench.json").is_file()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="`pdctl model tiny` needs transformers")
def test_gpu_smoke_files_check_clean(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: stand-in"\necho "GPU 1: stand-in"\n')
    (fake / "nvidia-smi").chmod(0o755)
    r = _run(["--check-only", str(tmp_path / "work")], str(fake))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "0 error(s)" in r.stdout and "check passed, stopping" in r.stdout
    config = (tmp_path / "work" / "config.toml").read_text()
    assert 'model = "./models/tiny-qwen3"' in config and "gpu_ids = [1]" in config
