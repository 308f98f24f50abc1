"""`pdctl profile` and `pdctl advise` end to end on real vLLM CPU engines (examples/cpu: 1P1D, NIXL, two cores).

Slow (two engines start) and needs the CPU engine; skips without it, as tests/test_real_e2e.py. Run it under
``flock /tmp/pdctl-real.lock``. A short schedule (about 20 requests): it proves the probes measure the real P/D
path and that advise reads what they wrote, not the model's accuracy (docs/performance.md has that)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdctl.capacity.profile import load
from tests.test_real_e2e import Deployment, _pdctl, _require_engine, cpu_up, root

__all__ = ["_require_engine", "cpu_up", "root"]  # the fixtures this module borrows

pytestmark = [pytest.mark.real, pytest.mark.timeout(2400)]


def test_profile_and_advise_on_real_engines(cpu_up: Deployment, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    proc = cpu_up.pdctl("profile", "-o", str(out), "--prompt-lens", "64,800", "--repeats", "3", "--running", "1,4",
                     "--contexts", "64", "--output-len", "16", timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr + cpu_up.log_tails()
    prof = load(out)
    short, long = prof.prefill
    assert long.prompt_tokens > short.prompt_tokens and long.prefill_s > short.prefill_s
    assert long.ttft_s > long.prefill_s  # the KV hand-off and the decode's first step come after the leg
    assert prof.prefill_s_per_token > 0 and prof.decode_max_num_seqs == 8 and prof.prefill_max_batched_tokens > 0
    assert all(p.step_s > 0.002 for p in prof.decode)  # a CPU decode step is milliseconds, not microseconds
    settings = str(cpu_up.dir / "settings.json")
    proc = _pdctl("advise", str(out), "-s", settings, "--isl", "64:0.8,512:0.2", "--osl", "32", "--engines", "2",
                  "--json", env=cpu_up.env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    advice = json.loads(proc.stdout)
    assert advice["verdict"] in ("pd", "colocated") and advice["capacity_rate"] > 0
    assert advice["pd"]["prefill"] == 1 and advice["pd"]["decode"] == 1
