"""The pdctl image, built from the Dockerfile (scripts/build-image.sh) and run, every container on the host's network,
as UID 65532 on a read-only root filesystem with a /tmp tmpfs:

1. ``pdctl --help``;
2. ``render k8s``'s gateway container (its command, arguments and environment) in front of simulated workers on
   the host, then the rendered verify Job's two containers (wait for the gateway, ``pdctl verify``) against it,
   ``gateway`` resolving to the host as the Service name would;
3. a ``render compose`` deployment of simulated workers: ``up -d`` (workers healthy, then the gateway), the verify
   service, a request from the host, ``down`` with nothing left.

Needs a docker daemon, and either the base image ``pdctl-base:bookworm`` or debootstrap to make it; skipped
otherwise, with the reason. About 1.5 minutes on a two-core machine with the base made (docs/multi-node.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdctl import __version__, config
from pdctl.render.compose import ComposeOptions, render, write
from pdctl.render.k8s import CONFIG_MOUNT, K8sOptions
from pdctl.render.k8s import render as render_k8s
from pdctl.testing import free_port
from pdctl.testing.sim import SimProcess, start_sim
from tests.conftest import REPO

IMAGE = f"pdctl:{__version__}"
BASE = "pdctl-base:bookworm"
KEY_VAR = "PDCTL_IMAGE_TEST_KEY"
KEY = "sk-image-test-never-in-argv-0123"
#: How the k8s manifests run pdctl's containers, as `docker run` flags.
POD = ["--network", "host", "--user", "65532", "--read-only", "--tmpfs", "/tmp"]


def _docker_problem() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not installed (apt-get install docker.io)"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30, check=False)
    if info.returncode != 0:
        return "no docker daemon answers (start one: dockerd --bridge=none)"
    base = subprocess.run(["docker", "image", "inspect", BASE], capture_output=True, timeout=30, check=False)
    if base.returncode != 0 and shutil.which("debootstrap") is None:
        return f"neither the base image {BASE} nor debootstrap to make it (apt-get install debootstrap)"
    return None


_PROBLEM = _docker_problem()
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=str(_PROBLEM))


@pytest.fixture(scope="module")
def image() -> str:
    """The image, built once per run from this checkout (its build time is printed)."""
    start = time.monotonic()
    proc = subprocess.run([str(REPO / "scripts" / "build-image.sh"), IMAGE], capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"image {IMAGE} built in {time.monotonic() - start:.0f} s")
    return IMAGE


@pytest.fixture
def containers() -> Iterator[list[str]]:
    """Names of containers a test starts; removed at teardown."""
    names: list[str] = []
    yield names
    for name in names:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60, check=False)


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``docker ARGS`` with the key in the environment only (``-e NAME`` passes it on without a value)."""
    env = {**os.environ, KEY_VAR: KEY, "NO_COLOR": "1"}
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False)


def test_pdctl_help_runs_in_the_image(image: str) -> None:
    proc = docker("run", "--rm", *POD, image, "pdctl", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage: pdctl" in proc.stdout and "gateway" in proc.stdout
    who = docker("run", "--rm", *POD, image, "sh", "-c", "id -u; command -v python; command -v pdctl")
    assert who.stdout.split() == ["65532", "/opt/pdctl/bin/python", "/opt/pdctl/bin/pdctl"]


def _sim_workers(tmp_path: Path, sims: list[SimProcess]) -> tuple[Path, Path, int]:
    """A prefill and a decode simulator on the host, and the two files naming them; returns the files and the
    gateway's port."""
    prefill = start_sim([], str(tmp_path), name="prefill", role="kv_producer")
    sims.append(prefill)
    decode = start_sim([], str(tmp_path), name="decode", role="kv_consumer")
    sims.append(decode)
    port = free_port()
    cfg, settings = tmp_path / "config.toml", tmp_path / "settings.json"
    cfg.write_text(
        '[cluster]\nname = "pd-image"\n'
        f'[prefill]\nmodel = "sim-model"\nengine = "sim"\nside_channel_port = {prefill.side_port}\n'
        f'[decode]\nmodel = "sim-model"\nengine = "sim"\nside_channel_port = {decode.side_port}\n',
        encoding="utf-8",
    )
    doc = {"gateway": {"listen": f"127.0.0.1:{port}", "api_key_env": KEY_VAR, "drain_timeout_s": 2},
           "routing": {"prefill_endpoint": prefill.url, "decode_endpoint": decode.url}}  # fmt: skip
    settings.write_text(json.dumps(doc), encoding="utf-8")
    return cfg, settings, port


def _run_flags(container: dict[str, Any]) -> list[str]:
    """A k8s container's environment as ``docker run`` flags: values as written, Secret entries by name only."""
    flags: list[str] = []
    for e in container.get("env", []):
        flags += ["-e", e["name"] if "valueFrom" in e else f"{e['name']}={e['value']}"]
    return flags


def test_the_k8s_gateway_container_serves_simulated_workers_and_the_verify_job_passes(
    image: str, tmp_path: Path, sim_procs: list[SimProcess], containers: list[str]
) -> None:
    cfg, settings, port = _sim_workers(tmp_path, sim_procs)
    dep = config.load(cfg, settings)
    rendered = render_k8s(dep, K8sOptions(pdctl_image=image))
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered.manifests}
    gateway = docs[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"][0]
    job = docs[("Job", "pdctl-verify")]["spec"]["template"]["spec"]
    # The ConfigMap's mount, with this host's settings.json (the workers on the host, not behind Services).
    mounts = ["-v", f"{cfg}:{CONFIG_MOUNT}/config.toml:ro", "-v", f"{settings}:{CONFIG_MOUNT}/settings.json:ro"]
    name = f"pdctl-test-gateway-{uuid.uuid4().hex[:8]}"
    containers.append(name)
    started = docker("run", "-d", "--name", name, *POD, *mounts, *_run_flags(gateway), gateway["image"],
                     *gateway["command"], *gateway["args"])  # fmt: skip
    assert started.returncode == 0, started.stderr
    # the Service name `gateway` is this host
    svc = ["--add-host", "gateway:127.0.0.1"]
    (wait,) = job["initContainers"]
    waited = docker("run", "--rm", *POD, *svc, wait["image"], *wait["command"], timeout=180)
    assert waited.returncode == 0, waited.stderr + docker("logs", name).stderr
    (verify,) = job["containers"]
    proc = docker("run", "--rm", *POD, *svc, *mounts, *_run_flags(verify), verify["image"], *verify["command"],
                  *verify["args"], timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: PASS" in proc.stdout and f"http://gateway:{port}" in " ".join(verify["args"])
    # the key went in by name: the manifest refers to the Secret's entry (no value), and the container ran with it
    (key_env,) = [e for e in gateway["env"] if e["name"] == KEY_VAR]
    assert key_env["valueFrom"]["secretKeyRef"]["key"] == KEY_VAR and "value" not in key_env
    env = json.loads(docker("inspect", name).stdout)[0]["Config"]["Env"]
    assert f"{KEY_VAR}={KEY}" in env  # (`-e NAME` took it from this process's environment, not from argv)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_a_rendered_compose_deployment_of_simulated_workers_starts_verifies_and_stops(
    image: str, tmp_path: Path
) -> None:
    ports = [free_port() for _ in range(5)]
    cfg, settings = tmp_path / "config.toml", tmp_path / "settings.json"
    cfg.write_text(
        '[cluster]\nname = "pd-compose"\n'
        f'[prefill]\nmodel = "sim-model"\nengine = "sim"\nside_channel_port = {ports[3]}\n'
        f'[decode]\nmodel = "sim-model"\nengine = "sim"\nside_channel_port = {ports[4]}\n'
        "[supervisor]\nready_timeout_s = 60\nwarmup_timeout_s = 30\nstop_timeout_s = 5\n",
        encoding="utf-8",
    )
    doc = {"gateway": {"listen": f"127.0.0.1:{ports[2]}", "api_key_env": KEY_VAR, "drain_timeout_s": 2},
           "routing": {"prefill_endpoint": f"http://127.0.0.1:{ports[0]}",
                       "decode_endpoint": f"http://127.0.0.1:{ports[1]}"}}  # fmt: skip
    settings.write_text(json.dumps(doc), encoding="utf-8")
    out = tmp_path / "compose"
    write(render(config.load(cfg, settings), ComposeOptions(pdctl_image=image), out), out)
    env_file = out / "pdctl.env"
    env_file.write_text(f"{KEY_VAR}={KEY}\n", encoding="utf-8")
    env_file.chmod(0o600)
    # (that no key reaches a rendered file is tests/render/test_compose.py's check: here the key is never given)
    project = f"pdctl-test-{uuid.uuid4().hex[:8]}"
    compose = ["docker-compose", "-p", project, "-f", str(out / "compose.yaml")]

    def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*compose, *args], capture_output=True, text=True, timeout=timeout, check=False)

    start = time.monotonic()
    try:
        up = run("up", "-d")
        assert up.returncode == 0, up.stdout + up.stderr
        verify = run("run", "--rm", "verify", timeout=300)
        assert verify.returncode == 0, verify.stdout + verify.stderr + run("logs").stdout
        assert "verify: PASS" in verify.stdout
        reply = httpx.post(f"http://127.0.0.1:{ports[2]}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "sim-model", "prompt": "hello", "max_tokens": 4}, timeout=30)  # fmt: skip
        assert reply.status_code == 200 and reply.headers["x-pd-path"] == "disagg"
        states = yaml.safe_load(run("ps", "--services", "--filter", "status=running").stdout or "") or ""
        assert set(str(states).split()) == {"prefill", "decode", "gateway"}
    finally:
        down = run("down", "-t", "5", "--remove-orphans")
    assert down.returncode == 0, down.stderr
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert left.stdout.strip() == ""
    print(f"compose up, verify, down: {time.monotonic() - start:.0f} s")
