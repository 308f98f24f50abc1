"""The rendered worker containers, run as local processes with loopback addresses as pod IPs (simulator).

Each container's command, args and environment are taken from the manifests as kubectl would read them;
``status.podIP`` becomes 127.0.0.2 (prefill) or 127.0.0.3 (decode). This proves the rendered commands start,
that prefill advertises its pod IP as the NIXL side-channel host, and that decode pulls from there.
(The gateway's Service names need a DNS server: that part belongs to the discovery work, issue #16 item 2.)
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdctl import config
from pdctl.k8s import dump_yaml, render
from pdctl.protocol import build_decode_body, build_prefill_body, check_kv_params
from pdctl.sim.testing import SimProcess

REPO = Path(__file__).resolve().parent.parent
POD_IPS = {"prefill": "127.0.0.2", "decode": "127.0.0.3"}


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_config(folder: Path) -> tuple[Path, Path]:
    ports = {role: (free_port(ip), free_port(ip)) for role, ip in POD_IPS.items()}
    cpath, spath = folder / "config.toml", folder / "settings.json"
    cpath.write_text(
        '[cluster]\nname = "pods"\n'
        + "".join(
            f'[{role}]\nmodel = "sim-model"\nengine = "sim"\nside_channel_port = {ports[role][1]}\n' for role in POD_IPS
        )
        + '[sim]\nprofile = "fast"\nspeed = 20\n',
        encoding="utf-8",
    )
    spath.write_text(
        '{"routing": {'
        f'"prefill_endpoint": "http://{POD_IPS["prefill"]}:{ports["prefill"][0]}", '
        f'"decode_endpoint": "http://{POD_IPS["decode"]}:{ports["decode"][0]}"'
        "}}",
        encoding="utf-8",
    )
    return cpath, spath


def start_pod(container: dict[str, Any], pod_ip: str, log: Path) -> SimProcess:
    """Run a container as a process: its command with this interpreter as the image's `python`."""
    argv = [sys.executable if a == "python" else a for a in container["command"][:1]]
    argv += container["command"][1:] + container["args"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, e
            env[e["name"]] = pod_ip
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    side = next(p["containerPort"] for p in container["ports"] if p["name"] == "nixl")
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return SimProcess(proc, port, side, str(log), argv)


def wait_healthy(pod: SimProcess, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert pod.alive(), pod.output()[-2000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    pytest.fail(f"{url} not healthy within {timeout_s} s:\n{pod.output()[-2000:]}")


def test_rendered_sim_pods_serve_pd_with_the_pod_ip_as_side_channel_host(tmp_path: Path) -> None:
    dep = config.load(*write_config(tmp_path))
    rendered = render(dep)
    docs = [d for d in yaml.safe_load_all(dump_yaml(rendered.manifests)) if d]
    pods: dict[str, SimProcess] = {}
    try:
        for w in dep.workers:
            (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == w.name]
            (container,) = sts["spec"]["template"]["spec"]["containers"]
            assert container["args"][container["args"].index("--host") + 1] == "0.0.0.0"
            pods[w.role] = start_pod(container, POD_IPS[w.role], tmp_path / f"{w.name}.log")
        p_url, d_url = (f"http://{POD_IPS[r]}:{pods[r].port}" for r in ("prefill", "decode"))
        for role, url in (("prefill", p_url), ("decode", d_url)):
            wait_healthy(pods[role], url)
        body = {"model": "sim-model", "prompt": "pods on loopback " * 20, "max_tokens": 4, "temperature": 0}
        headers = {"X-Request-Id": "render-pods-1"}
        with httpx.Client(timeout=30.0) as client:
            r1 = client.post(f"{p_url}/v1/completions", json=build_prefill_body(body), headers=headers)
            assert r1.status_code == 200, r1.text
            chk = check_kv_params(r1.json())
            assert chk.usable, chk
            assert chk.params is not None
            assert (chk.params["remote_host"], chk.params["remote_port"]) == ("127.0.0.2", pods["prefill"].side_port)
            r2 = client.post(f"{d_url}/v1/completions", json=build_decode_body(body, chk.params), headers=headers)
            assert r2.status_code == 200, r2.text
            assert r2.json()["choices"][0]["text"]
            metrics = client.get(f"{d_url}/metrics").text
        external = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="external_kv_transfer"' in line
        ]
        assert external and sum(external) > 0, metrics
    finally:
        for pod in pods.values():
            pod.stop()
        for pod in pods.values():
            assert not pod.alive()
