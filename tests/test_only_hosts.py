"""``pdctl up --only`` on two loopback "hosts": 127.0.0.2 runs prefill, 127.0.0.3 runs decode and the gateway.

Each part is its own ``pdctl up -d --only ...`` with its own run directory (``.pdctl/only-<selection>``). The
gateway's host is started first: it waits for the other host's prefill, runs the warm-up across the hosts,
then opens. ``status``, ``logs`` and ``down`` address one part each. Simulator engines; the real vLLM CPU
variant is marked ``real`` (run it under ``flock /tmp/pdctl-real.lock``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.config import load
from pdctl.testing import alive, free_port, kill_groups
from tests.cli.test_run_cmds import KEY, KEY_VAR, env, pdctl
from tests.real_engine import kv_counters, kv_moved, require_engine, tiny_model, two_legs_move_kv

HOSTS = {"prefill": "127.0.0.2", "decode": "127.0.0.3"}


def write_two_hosts(d: Path, workers: str | None = None, connector: str = "") -> str:
    """config.toml + settings.json with each worker bound to its "host"; returns the gateway URL."""
    ports = {n: free_port() for n in ("prefill", "decode", "gateway", "p_side", "d_side")}
    if workers is None:
        workers = "".join(
            f'[{role}]\nmodel = "sim-model"\nengine = "sim"\nhost = "{ip}"\nside_channel_port = {ports[side]}\n'
            for (role, ip), side in zip(HOSTS.items(), ("p_side", "d_side"), strict=True)
        )
    else:
        workers = workers.format(p_side=ports["p_side"], d_side=ports["d_side"])
    (d / "config.toml").write_text(
        workers + f'[connector]\nkv_connector = "NixlConnector"\n{connector}'
        "[supervisor]\nready_timeout_s = 900\nstop_timeout_s = 5\nwarmup_timeout_s = 120\n",
        encoding="utf-8",
    )
    gateway = f"{HOSTS['decode']}:{ports['gateway']}"
    settings = {
        "gateway": {"listen": gateway, "api_key_env": KEY_VAR, "drain_timeout_s": 2},
        "routing": {f"{r}_endpoint": f"http://{ip}:{ports[r]}" for r, ip in HOSTS.items()},
    }
    (d / "settings.json").write_text(json.dumps(settings), encoding="utf-8")
    return f"http://{gateway}"


def part_state(d: Path, selection: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((d / ".pdctl" / f"only-{selection}" / "state.json").read_text())
    return data


def part_pids(d: Path) -> list[int]:
    pids: list[int] = []
    for state_file in (d / ".pdctl").glob("only-*/state.json"):
        s = json.loads(state_file.read_text())
        pids += [s["supervisor_pid"], s.get("watchdog_pid") or 0]
        for p in s["processes"]:
            pids += [p["pid"], *(pid for pid, _ in p.get("descendants", []))]
    return [p for p in pids if p]


def run_two_hosts(d: Path, gateway: str, model: str, timeout_s: float) -> None:
    """Start the gateway host first (it waits), then the prefill host; check PD across them; stop both."""
    b = subprocess.Popen([sys.executable, "-m", "pdctl", "up", "-d", "--only", "decode,gateway"], cwd=d, env=env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        time.sleep(2.0)
        assert b.poll() is None, b.communicate()[0]  # still waiting for the other host's prefill
        a = pdctl(d, "up", "-d", "--only", "prefill", timeout=timeout_s)
        assert a.returncode == 0, a.stdout + a.stderr
        assert "stop: pdctl down --only prefill" in a.stdout and "curl" not in a.stdout
        out_b = b.communicate(timeout=timeout_s)[0]
        assert b.returncode == 0, out_b
        assert "prefill (another host) is ready" in out_b and "warm-up probe passed" in out_b, out_b
        assert "stop: pdctl down --only decode,gateway" in out_b

        assert [p["name"] for p in part_state(d, "prefill")["processes"]] == ["prefill"]
        assert sorted(p["name"] for p in part_state(d, "decode+gateway")["processes"]) == ["decode", "gateway"]
        p_url, d_url = (_endpoint(d, role) for role in ("prefill", "decode"))
        before = kv_counters(d_url)
        body = {"model": model, "prompt": "two hosts, one deployment " * 8, "max_tokens": 4}
        r = httpx.post(f"{gateway}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"},
                       timeout=300.0)  # fmt: skip
        assert r.status_code == 200, r.text
        assert (r.headers["x-pd-path"], r.headers["x-pd-prefill"], r.headers["x-pd-decode"]) == (
            "disagg", "prefill", "decode")  # fmt: skip
        rise = kv_moved(d_url, before)  # decode loaded the prompt's KV from the other host, not computed it
        assert rise.external > 0 and (rise.nixl is None or rise.nixl > 0), rise
        # Prefill's kv_transfer_params name its own host and side channel, where decode pulls from.
        remote = (HOSTS["prefill"], _prefill_side_port(d))
        rise = two_legs_move_kv(
            p_url, d_url, model, "two hosts, the legs by hand " * 8, remote, f"only-{time.time_ns()}"
        )
        assert rise.external > 0 and (rise.nixl is None or rise.nixl > 0), rise

        st = pdctl(d, "status", "--only", "prefill", "--json")
        assert st.returncode == 0, st.stderr
        assert [(p["name"], p["health"]) for p in json.loads(st.stdout)["processes"]] == [("prefill", "ok")]
        logs = pdctl(d, "logs", "--only", "decode,gateway", "--json")
        assert logs.returncode == 0, logs.stderr
        assert {json.loads(ln)["process"] for ln in logs.stdout.splitlines()} == {"pdctl", "decode", "gateway"}

        down_b = pdctl(d, "down", "--only", "gateway,decode")  # the same selection in another order
        assert down_b.returncode == 0, down_b.stderr
        assert httpx.get(_health(d, "prefill"), timeout=5.0).status_code == 200  # the other host's part runs on
        down_a = pdctl(d, "down", "--only", "prefill")
        assert down_a.returncode == 0, down_a.stderr
        deadline = time.monotonic() + 30
        while any(alive(p) for p in part_pids(d)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in part_pids(d))
    finally:
        if b.poll() is None:
            b.kill()
            b.wait()
        kill_groups(part_pids(d))


def _endpoint(d: Path, role: str) -> str:
    settings = json.loads((d / "settings.json").read_text())
    endpoint: str = settings["routing"][f"{role}_endpoint"]
    return endpoint


def _health(d: Path, role: str) -> str:
    return f"{_endpoint(d, role)}/health"


def _prefill_side_port(d: Path) -> int:
    (prefill,) = [w for w in load(d / "config.toml", d / "settings.json").workers if w.role == "prefill"]
    return prefill.side_channel_port


def test_only_runs_each_hosts_part_and_the_gateway_host_waits_and_warms_up(tmp_path: Path) -> None:
    gateway = write_two_hosts(tmp_path)
    run_two_hosts(tmp_path, gateway, "sim-model", 300.0)


def test_only_names_an_unknown_process(tmp_path: Path) -> None:
    write_two_hosts(tmp_path)
    r = pdctl(tmp_path, "up", "--only", "prefil")
    assert r.returncode == 2
    assert "--only prefil: no process or role of that name" in r.stderr and "prefill, decode, gateway" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.real
@pytest.mark.timeout(1800)
def test_only_on_two_hosts_with_real_vllm_cpu(tmp_path: Path) -> None:
    require_engine()
    model = tiny_model(tmp_path / "tiny-qwen3")
    workers = "".join(
        f"""[{role}]
model = "{model}"
served_model_name = "tiny"
host = "{ip}"
max_model_len = 1024
max_num_seqs = 8
dtype = "bfloat16"
gpu_memory_utilization = 0.2
side_channel_port = {{{side}}}
env = {{{{ VLLM_CPU_KVCACHE_SPACE = "1", VLLM_CPU_OMP_THREADS_BIND = "{core}" }}}}
"""
        for core, ((role, ip), side) in enumerate(zip(HOSTS.items(), ("p_side", "d_side"), strict=True))
    )
    gateway = write_two_hosts(tmp_path, workers, 'kv_buffer_device = "cpu"\n')
    run_two_hosts(tmp_path, gateway, "tiny", 1500.0)
