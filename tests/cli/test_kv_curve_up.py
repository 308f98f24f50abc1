"""`pdctl up` with routing.kv_events_curve, end to end: simulator workers publish their KV cache events to a relay
each, the relays carry them over CURVE to the real gateway, `down` stops the relays with the rest."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdctl.testing import alive, free_port, kill_groups, port_free
from pdctl.vllm import kv_curve
from tests.cli.test_run_cmds import KEY, all_tree_pids, recorded_pids, state, wait_for, write_deployment
from tests.cli.test_run_cmds import env as base_env


@pytest.fixture
def deploy_dir(tmp_path: Path):  # type: ignore[no-untyped-def]
    yield tmp_path
    kill_groups(recorded_pids(tmp_path))


def _events_port() -> int:
    """A port whose next two (the relays') are free too."""
    while True:
        port = free_port()
        if port + 2 < 65536 and port_free(port + 1) and port_free(port + 2):
            return port


def _stored(gateway: str, instance: str) -> float:
    text = httpx.get(f"{gateway}/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=10).text
    rows = re.findall(r"^pdctl_kv_events_total\{([^}]*)\} (\S+)$", text, re.M)
    return sum(float(v) for labels, v in rows if f'instance="{instance}"' in labels and 'event="BlockStored"' in labels)


def test_up_runs_a_relay_per_worker_and_the_events_arrive_over_curve(deploy_dir: Path) -> None:
    d = deploy_dir
    ports = write_deployment(d)
    events = _events_port()
    settings = json.loads((d / "settings.json").read_text())
    settings["routing"] |= {"pd_mode": "adaptive", "prefix_view": "exact", "kv_events_port": events,
                            "kv_events_curve": True}  # fmt: skip
    (d / "settings.json").write_text(json.dumps(settings))
    keys = kv_curve.new_keys()
    env = {k: v for k, v in base_env().items() if k not in kv_curve.ENV_NAMES}
    run = lambda *a: subprocess.run([sys.executable, "-m", "pdctl", *a], cwd=d, env=env | keys,  # noqa: E731
                                    capture_output=True, text=True, timeout=300)  # fmt: skip

    # Without the keys: one error naming the variable, nothing started.
    r = subprocess.run([sys.executable, "-m", "pdctl", "up", "-d"], cwd=d, env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode != 0 and "PD040" in r.stdout + r.stderr and "Traceback" not in r.stderr

    r = run("up", "-d")
    assert r.returncode == 0, r.stdout + r.stderr
    procs = {p["name"]: p for p in state(d)["processes"]}
    assert set(procs) == {"prefill", "decode", "prefill-kv-relay", "decode-kv-relay", "gateway"}
    gw = f"http://127.0.0.1:{ports['gateway']}"
    prompt = "the relays carry every stored block to the gateway " * 8
    resp = httpx.post(f"{gw}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "sim-model", "prompt": prompt, "max_tokens": 3}, timeout=60)  # fmt: skip
    assert resp.status_code == 200, resp.text
    wait_for(lambda: _stored(gw, "decode") > 0, 30, "decode's events at the gateway, through its relay")

    # The keys: in no argv, no log; each process holds only those it needs.
    for pid in all_tree_pids(d):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert not any(v.encode() in cmdline for v in keys.values())
    for name, needs in (("prefill", set()), ("decode", set()),
                        ("decode-kv-relay", {kv_curve.CLIENT_SECRET_ENV, kv_curve.SERVER_PUBLIC_ENV}),
                        ("gateway", {kv_curve.SERVER_SECRET_ENV, kv_curve.CLIENT_PUBLIC_ENV})):  # fmt: skip
        environ = Path(f"/proc/{procs[name]['pid']}/environ").read_bytes().split(b"\0")
        held = {k for k in kv_curve.ENV_NAMES if any(line.startswith(k.encode() + b"=") for line in environ)}
        assert held == needs, name
    logs = "".join(p.read_text() for p in (d / ".pdctl" / "logs").glob("*.log"))
    assert not any(v in logs for v in keys.values())
    assert "forwarding the KV cache events published to tcp://127.0.0.1:" in logs and "(CURVE)" in logs
    rows = {p["name"]: p for p in json.loads(run("status", "--json").stdout)["processes"]}
    assert rows["decode-kv-relay"]["health"] == "ok"

    tree = all_tree_pids(d)
    r = run("down")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: not any(alive(p) for p in tree), 30, "every process of the run to exit")
    assert port_free(events) and port_free(events + 1) and port_free(events + 2)
    stops = re.findall(r"sending SIGTERM to (\S+) ", (d / ".pdctl" / "logs" / "pdctl.log").read_text())
    assert stops[:3] == ["gateway", "decode", "prefill"] and set(stops[3:]) == {"prefill-kv-relay", "decode-kv-relay"}
