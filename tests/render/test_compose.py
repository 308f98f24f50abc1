"""`pdctl render compose`: services that run `pdctl plan`'s command lines on the host's network, GPU reservations,
healthchecks from the supervisor's timeouts, keys only from the user's env file; `docker-compose config` accepts
every rendered file. Running them (image built, simulated workers) is tests/test_container.py."""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdctl import config
from pdctl.render.compose import ComposeOptions, RenderedCompose, render, write
from pdctl.render.k8s import image_argv
from pdctl.runtime.plan import IPC_ENV, VllmInstall, build_plan
from pdctl.sim.server import VLLM_VERSION
from tests.conftest import REPO
from tests.test_only_hosts import HOSTS, write_two_hosts

CONFIGS = {
    "seed": REPO / "tests" / "fixtures" / "recipe",
    "tp2": REPO / "tests" / "configs" / "k8s-tp2",
    "2p2d": REPO / "tests" / "configs" / "k8s-2p2d",
    "sim": REPO / "tests" / "configs" / "k8s-sim",
}


def load(name: str, tmp_path: Path) -> config.Deployment:
    """The render k8s test configs; 2P2D without its `replicas = 2` (one host runs one instance per entry)."""
    src = CONFIGS[name]
    for f in ("config.toml", "settings.json"):
        text = (src / f).read_text(encoding="utf-8")
        (tmp_path / f).write_text(text.replace("replicas = 2\n", ""), encoding="utf-8")
    return config.load(tmp_path / "config.toml", tmp_path / "settings.json")


def services(rendered: RenderedCompose, name: str = "compose.yaml") -> dict[str, Any]:
    """One file's services as docker compose reads them: through the YAML text."""
    out = yaml.safe_load(yaml.safe_dump(dict(rendered.files[name])))
    svcs: dict[str, Any] = out["services"]
    return svcs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_workers_run_the_plans_command_and_environment_on_the_host_network(name: str, tmp_path: Path) -> None:
    dep = load(name, tmp_path)
    svcs = services(render(dep, folder=tmp_path))
    plan = build_plan(dep, VllmInstall("vllm", VLLM_VERSION))
    assert set(svcs) == {w.name for w in dep.workers} | {"gateway", "verify"}
    for w in dep.workers:
        spec, svc = plan.get(w.name), svcs[w.name]
        assert svc["network_mode"] == "host"
        assert [*svc["entrypoint"], *svc["command"]] == image_argv(spec)
        if w.engine == "vllm":
            assert svc["entrypoint"] == ["vllm"] and svc["command"][:2] == ["serve", w.model]
            assert svc["image"] == f"docker.io/vllm/vllm-openai:v{VLLM_VERSION}"
        else:
            assert svc["entrypoint"] == ["python"] and svc["image"] == "pdctl:0.1.0"
        # the plan's environment, less what a container replaces: its GPUs (a reservation) and its IPC folder
        want = {k: v for k, v in spec.env.items() if k not in ("CUDA_VISIBLE_DEVICES", IPC_ENV)}
        assert svc["environment"] == want
        assert svc["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(w.side_channel_port)
        assert svc["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        for path in spec.files:  # vLLM's logging config: written beside the compose file, mounted where planned
            assert f"./{Path(path).name}:{path}:ro" in svc["volumes"]
    for path in {p for spec in plan.workers for p in spec.files}:
        assert Path(path).name in render(dep, folder=tmp_path).extra


@pytest.mark.parametrize(("name", "want"), [("seed", [["0"], ["1"]]), ("tp2", [["0", "1"], ["2", "3"]])])
def test_gpu_ids_become_device_reservations(name: str, want: list[list[str]], tmp_path: Path) -> None:
    dep = load(name, tmp_path)
    svcs = services(render(dep, folder=tmp_path))
    for w, ids in zip(dep.workers, want, strict=True):
        (device,) = svcs[w.name]["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "capabilities": ["gpu"], "device_ids": ids}
        assert svcs[w.name]["ipc"] == "host"
        assert "CUDA_VISIBLE_DEVICES" not in svcs[w.name]["environment"]


def test_without_gpu_ids_a_worker_reserves_tensor_parallel_size_gpus(recipe_files: Any, tmp_path: Path) -> None:
    c, s = recipe_files(
        config_edits={
            "gpu_ids = [0]\n": "",
            "gpu_ids = [1]\n": "",
            "tensor_parallel_size = 1\nenable": "tensor_parallel_size = 2\nenable",
        }
    )
    dep = config.load(c, s)
    svcs = services(render(dep, folder=tmp_path))
    (device,) = svcs["prefill"]["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "capabilities": ["gpu"], "count": 2}
    (device,) = svcs["decode"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == 1


def test_sim_and_cpu_workers_reserve_no_gpu(tmp_path: Path) -> None:
    svcs = services(render(load("sim", tmp_path), folder=tmp_path))
    assert not any("deploy" in svc for svc in svcs.values())


def test_healthchecks_and_order_follow_the_supervisor(recipe_files: Any, tmp_path: Path) -> None:
    c, s = recipe_files(config_append="\n[supervisor]\nready_timeout_s = 321.5\nwarmup_timeout_s = 45\n"
                                      "stop_timeout_s = 7\nmax_restarts = 4\n")  # fmt: skip
    dep = config.load(c, s)
    svcs = services(render(dep, folder=tmp_path))
    for w in dep.workers:
        check = svcs[w.name]["healthcheck"]
        assert check["start_period"] == f"{math.ceil(321.5)}s" and check["retries"] == 3
        assert check["test"][:3] == ["CMD", "python3", "-c"] and f"{w.url}/health" in check["test"][3]
        assert svcs[w.name]["stop_grace_period"] == "7s"
        assert svcs[w.name]["restart"] == "on-failure:4"
    gateway = svcs["gateway"]
    assert gateway["healthcheck"]["start_period"] == "45s"
    assert f"{dep.gateway.url}/ready" in gateway["healthcheck"]["test"][3]
    assert gateway["depends_on"] == {w.name: {"condition": "service_healthy"} for w in dep.workers}
    assert svcs["verify"]["depends_on"] == {"gateway": {"condition": "service_healthy"}}
    assert svcs["verify"]["profiles"] == ["verify"] and svcs["verify"]["restart"] == "no"


def test_gateway_and_verify_run_the_plans_pdctl_on_the_mounted_files(tmp_path: Path) -> None:
    dep = load("seed", tmp_path)
    svcs = services(render(dep, folder=tmp_path / "out"))
    plan = build_plan(dep, VllmInstall("vllm", VLLM_VERSION))
    gateway, verify = svcs["gateway"], svcs["verify"]
    assert [*gateway["entrypoint"], *gateway["command"]] == ["pdctl", *plan.get("gateway").argv[3:]]
    assert verify["command"] == ["verify", "-c", dep.config_path, "-s", dep.settings_path,
                                 "--gateway", dep.gateway.url]  # fmt: skip
    for svc in (gateway, verify):
        assert svc["user"] == "65532:65532" and svc["read_only"] is True and svc["tmpfs"] == ["/tmp"]
        assert svc["network_mode"] == "host" and svc["image"] == "pdctl:0.1.0"
        assert f"{dep.config_path}:{dep.config_path}:ro" in svc["volumes"]
        assert f"{dep.settings_path}:{dep.settings_path}:ro" in svc["volumes"]
    assert "PDCTL_GATEWAY_HOLD" not in gateway["environment"]
    # files in the compose file's folder are mounted relative to it, so the folder can move with them
    beside = services(render(dep, folder=tmp_path))["gateway"]["volumes"]
    assert f"./config.toml:{dep.config_path}:ro" in beside
    # the gateway's own files, the sizing profile included, are mounted where settings.json names them
    profile = tmp_path / "profile.json"
    profile.write_text("{}", encoding="utf-8")
    dep = dataclasses.replace(dep, slo=dataclasses.replace(dep.slo, capacity_profile=str(profile)))
    assert f"{profile}:{profile}:ro" in services(render(dep, folder=tmp_path / "out"))["gateway"]["volumes"]


def test_no_key_reaches_a_file_and_the_gateway_reads_them_from_the_env_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PDCTL_API_KEY", "sk-client-secret-value-123")
    monkeypatch.setenv("UPSTREAM_KEY", "sk-upstream-secret-value-456")
    rendered = render(load("2p2d", tmp_path), ComposeOptions(env_file="keys.env"), tmp_path)
    out = tmp_path / "out"
    text = "".join(p.read_text(encoding="utf-8") for p in write(rendered, out))
    assert "secret-value" not in text
    svcs = services(rendered)
    assert svcs["gateway"]["env_file"] == ["keys.env"] and svcs["verify"]["env_file"] == ["keys.env"]
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert "env_file" not in svcs[name]
        assert not {"PDCTL_API_KEY", "UPSTREAM_KEY"} & set(svcs[name]["environment"])


def test_ucx_knobs_reach_every_worker_but_a_workers_own_setting_wins(recipe_files: Any, tmp_path: Path) -> None:
    c, s = recipe_files(config_edits={"gpu_ids = [1]": 'gpu_ids = [1]\nenv = { UCX_TLS = "tcp" }'})
    svcs = services(render(config.load(c, s), ComposeOptions(ucx_tls="rc,cuda_copy", ucx_net_devices="mlx5_0:1"),
                           tmp_path))  # fmt: skip
    assert svcs["prefill"]["environment"]["UCX_TLS"] == "rc,cuda_copy"
    assert svcs["decode"]["environment"]["UCX_TLS"] == "tcp"
    assert {svcs[n]["environment"]["UCX_NET_DEVICES"] for n in ("prefill", "decode")} == {"mlx5_0:1"}


def test_two_hosts_get_one_file_each_with_their_own_services(tmp_path: Path) -> None:
    write_two_hosts(tmp_path)
    dep = config.load(tmp_path / "config.toml", tmp_path / "settings.json")
    rendered = render(dep, folder=tmp_path)
    a, b = (f"compose.{HOSTS[r]}.yaml" for r in ("prefill", "decode"))
    assert set(rendered.files) == {a, b}
    assert set(services(rendered, a)) == {"prefill"}
    assert set(services(rendered, b)) == {"decode", "gateway", "verify"}
    # each host waits only for its own services; the gateway's /ready covers the other host's
    assert services(rendered, b)["gateway"]["depends_on"] == {"decode": {"condition": "service_healthy"}}
    # NIXL's side channel binds and is advertised on each worker's own host
    assert services(rendered, a)["prefill"]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == HOSTS["prefill"]
    assert services(rendered, b)["decode"]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == HOSTS["decode"]


def test_replicas_and_reserved_names_cannot_render_and_the_cli_exits_2(cli: Any, tmp_path: Path) -> None:
    folder = CONFIGS["2p2d"]
    result = cli("render", "compose", "-c", str(folder / "config.toml"), "-s", str(folder / "settings.json"),
                 "-o", str(tmp_path / "out"))  # fmt: skip
    assert result.exit_code == 2
    assert "DC001" in result.output and "decode[1].replicas" in result.output and "config.toml:27" in result.output
    assert not (tmp_path / "out").exists()


def test_the_cli_writes_the_files_and_prints_how_to_start_them(cli: Any, tmp_path: Path) -> None:
    folder = CONFIGS["seed"]
    out = tmp_path / "out"
    result = cli("render", "compose", "-c", str(folder / "config.toml"), "-s", str(folder / "settings.json"),
                 "-o", str(out), "--pdctl-image", "registry.example/pdctl:1")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["compose.yaml", "vllm-logging.json"]
    assert f"printf 'TAOTOKEN_API_KEY=%s\\n' \"$TAOTOKEN_API_KEY\" > {out}/pdctl.env" in result.output
    assert f"docker compose -f {out}/compose.yaml run --rm verify" in result.output
    svcs = yaml.safe_load((out / "compose.yaml").read_text(encoding="utf-8"))["services"]
    assert svcs["gateway"]["image"] == "registry.example/pdctl:1"


def _compose_config(folder: Path, name: str) -> dict[str, Any]:
    proc = subprocess.run(["docker-compose", "-f", str(folder / name), "config"], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = yaml.safe_load(proc.stdout)
    return out


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed "
                    "(apt-get install docker-compose); the files are checked without it above")  # fmt: skip
@pytest.mark.parametrize("name", ["seed", "tp2", "2p2d", "sim", "two-hosts"])
def test_docker_compose_config_accepts_every_rendered_file(name: str, tmp_path: Path) -> None:
    if name == "two-hosts":
        write_two_hosts(tmp_path)
        dep = config.load(tmp_path / "config.toml", tmp_path / "settings.json")
    else:
        dep = load(name, tmp_path)
    out = tmp_path / "out"
    rendered = render(dep, folder=out)
    write(rendered, out)
    (out / "pdctl.env").write_text("", encoding="utf-8")  # the user's file; compose needs it to exist
    for file_name in rendered.files:
        got = _compose_config(out, file_name)["services"]
        assert set(got) == set(rendered.files[file_name]["services"])
        for svc_name, svc in got.items():
            assert svc["network_mode"] == "host", svc_name
        # compose resolves the relative mounts against the compose file's folder
        for w in (w for w in dep.workers if w.name in got and w.engine == "vllm"):
            sources = {v.split(":")[0] for v in got[w.name]["volumes"]}  # docker-compose 1.x: short syntax
            assert str(out / "vllm-logging.json") in sources


def test_shared_storage_is_mounted_on_one_host_and_refused_across_hosts(recipe_files: Any, tmp_path: Path) -> None:
    c, s = recipe_files(
        config_edits={
            'kv_connector = "NixlConnector"': 'kv_connector = "ExampleConnector"',
            'backend = "nixl"': 'backend = "shared_storage"\nshared_storage_path = "/tmp/pd-kv"',
        }
    )
    dep = config.load(c, s)
    svcs = services(render(dep, folder=tmp_path))
    assert (
        "/tmp/pd-kv:/tmp/pd-kv" in svcs["prefill"]["volumes"] and "/tmp/pd-kv:/tmp/pd-kv" in svcs["decode"]["volumes"]
    )
    two = tmp_path / "two"
    two.mkdir()
    write_two_hosts(two, connector="")
    cfg = two / "config.toml"
    cfg.write_text(cfg.read_text(encoding="utf-8").replace('"NixlConnector"', '"ExampleConnector"'), encoding="utf-8")
    rendered = render(config.load(cfg, two / "settings.json"), folder=two)
    assert not rendered.files
    assert [(f.code, f.severity, f.key) for f in rendered.findings] == [("DC002", "error", "connector.kv_connector")]


def test_a_cpu_deployment_with_the_default_image_warns(tmp_path: Path) -> None:
    for f in ("config.toml", "settings.json"):
        shutil.copy(REPO / "examples" / "cpu" / f, tmp_path / f)
    dep = config.load(tmp_path / "config.toml", tmp_path / "settings.json")
    assert [f.code for f in render(dep, folder=tmp_path).findings] == ["DC003"]
    rendered = render(dep, ComposeOptions(image="registry.example/vllm-cpu:0.32.0"), tmp_path)
    assert not rendered.findings
    svcs = services(rendered)
    assert svcs["prefill"]["image"] == "registry.example/vllm-cpu:0.32.0" and svcs["prefill"]["cpuset"] == "0"
    assert svcs["prefill"]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # the host's cores, as under up
    model = dep.resolve_path(dep.prefill[0].model)
    assert f"{model}:{model}:ro" in svcs["prefill"]["volumes"]


def test_every_compose_rule_is_documented() -> None:
    src = (REPO / "pdctl" / "render" / "compose.py").read_text(encoding="utf-8")
    doc = (REPO / "docs" / "multi-node.md").read_text(encoding="utf-8")
    assert set(re.findall(r'"(DC\d{3})"', src)) == set(re.findall(r"^\| (DC\d{3}) \|", doc, flags=re.M))


def test_kv_events_curve_is_refused_until_compose_runs_the_relays(tmp_path: Path) -> None:
    for f in ("config.toml", "settings.json"):
        shutil.copy(REPO / "examples" / "cpu" / f, tmp_path / f)
    dep = config.load(tmp_path / "config.toml", tmp_path / "settings.json")
    routing = dataclasses.replace(dep.routing, pd_mode="adaptive", prefix_view="exact", kv_events_curve=True)
    rendered = render(dataclasses.replace(dep, routing=routing), ComposeOptions(image="vllm-cpu"), tmp_path)
    assert not rendered.files
    assert [(f.code, f.severity) for f in rendered.findings] == [("DC004", "error")]
