"""`pdctl profile` and `pdctl advise` end to end on real vLLM CPU engines (examples/cpu: 1P1D, NIXL, two cores).

Slow (two engines start) and needs the CPU engine; skips without it, as tests/test_real_e2e.py. Run it under
``flock /tmp/pdctl-real.lock``. A short schedule (about 20 requests): it proves the probes measure the real P/D
path and that advise reads what they wrote, not the model's accuracy (docs/performance.md has that)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdctl.capacity.profile import load
from pdctl.testing import free_port
from pdctl.testing.procs import stop_group, wait_until_ready
from pdctl.vllm.promtext import samples
from tests.conftest import REPO
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
    _the_gateway_advises_from_the_profile(cpu_up, out, tmp_path)


def _the_gateway_advises_from_the_profile(dep: Deployment, profile: Path, tmp_path: Path) -> None:
    """A second gateway on the same engines with ``slo.capacity_profile``: after 24 requests its advice gauges hold
    the serving counts (1P1D) and a status from the model, not ``idle``."""
    settings = json.loads((dep.dir / "settings.json").read_text(encoding="utf-8"))
    port = free_port()
    settings["gateway"]["listen"] = f"127.0.0.1:{port}"
    settings["slo"] |= {"capacity_profile": str(profile), "advise_window_s": 40}
    path = tmp_path / "settings-advice.json"
    path.write_text(json.dumps(settings), encoding="utf-8")
    log = tmp_path / "gateway-advice.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdctl", "gateway", "-c", str(dep.dir / "config.toml"), "-s",
                                 str(path)], stdout=out, stderr=subprocess.STDOUT, env=dep.env, cwd=REPO,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {dep.api_key}"}
    try:
        wait_until_ready(proc, f"{url}/ready", 120, name="the advising gateway", log=log)
        for i in range(24):
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 8}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120, trust_env=False)
            assert r.status_code == 200, r.text
        status: list[str] = []
        deadline = time.monotonic() + 60  # the advisor looks every advise_window_s / 4 = 10 s
        while time.monotonic() < deadline and not status:
            text = httpx.get(f"{url}/metrics", headers=headers, timeout=10, trust_env=False).text
            parsed = samples(text, ("pdctl_advice_",))
            status = [lab["status"] for n, lab, v in parsed if n == "pdctl_advice_status" and v == 1]
            time.sleep(1)
        assert status and status[0] != "idle", log.read_text(errors="replace")[-2000:]
        replicas = {(lab["role"], lab["of"]): v for n, lab, v in parsed if n == "pdctl_advice_replicas"}
        assert replicas[("prefill", "current")] == 1 and replicas[("decode", "current")] == 1
        assert replicas[("prefill", "recommended")] >= 1 and replicas[("decode", "recommended")] >= 1
    finally:
        stop_group(proc)
