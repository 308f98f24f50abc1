"""`pdctl render k8s`: manifests valid against Kubernetes' schemas, commands equal to `pdctl plan`'s, no key."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdctl import config
from pdctl.gateway.settings import from_deployment
from pdctl.render.k8s import CONFIG_MOUNT, KUBERNETES_VERSION, K8sOptions, Rendered, dump_yaml, render
from pdctl.runtime.plan import VllmInstall, build_plan
from pdctl.sim.server import VLLM_VERSION
from tests.conftest import REPO

CONFIGS = {
    "seed": REPO / "tests" / "fixtures" / "recipe",
    "tp2": REPO / "tests" / "configs" / "k8s-tp2",
    "2p2d": REPO / "tests" / "configs" / "k8s-2p2d",
    "sim": REPO / "tests" / "configs" / "k8s-sim",
}
#: The newest Kubernetes minor the pinned kubernetes-validate ships schemas for.
NEWEST = "1.37"


def load(name: str) -> config.Deployment:
    folder = CONFIGS[name]
    return config.load(folder / "config.toml", folder / "settings.json")


def objects(rendered: Rendered) -> list[dict[str, Any]]:
    """Every rendered object as kubectl would read it: through the YAML text."""
    return [d for d in yaml.safe_load_all(dump_yaml(rendered.manifests)) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (c,) = statefulset["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("version", [KUBERNETES_VERSION, NEWEST])
def test_every_manifest_passes_the_kubernetes_schema(name: str, version: str) -> None:
    rendered = render(load(name))
    docs = objects(rendered)
    kinds = {d["kind"] for d in docs}
    assert kinds == {"Namespace", "ConfigMap", "Service", "StatefulSet", "Deployment", "Job"}
    for doc in docs:
        # strict: the -local-strict schemas reject unknown fields, so a misspelt key fails here.
        assert kubernetes_validate.validate(doc, version, strict=True) == version


def test_the_validator_catches_a_misspelt_field() -> None:
    sts = find(objects(render(load("seed"))), "StatefulSet", "prefill")
    bad = copy.deepcopy(sts)
    c = container(bad)
    c["resource"] = c.pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", ["seed", "tp2", "2p2d", "sim"])
def test_worker_containers_run_the_plans_command_and_environment(name: str) -> None:
    dep = load(name)
    docs = objects(render(dep))
    plan = build_plan(dep, VllmInstall("vllm", VLLM_VERSION))
    for w in dep.workers:
        spec = plan.get(w.name)
        c = container(find(docs, "StatefulSet", w.name))
        argv = c["command"] + c["args"]
        expected = list(spec.argv)
        expected[expected.index("--host") + 1] = "0.0.0.0"
        if w.engine == "vllm":  # the image's own `vllm serve` instead of this machine's interpreter
            expected = ["vllm", "serve", *expected[len(plan.vllm.launch) :]]
        if w.engine == "sim":
            assert c["image"] == K8sOptions().pdctl_image
            expected[0] = "python"
        else:
            assert c["image"] == f"docker.io/vllm/vllm-openai:v{VLLM_VERSION}"
            assert argv[:3] == ["vllm", "serve", w.model]
        assert argv == expected
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_role"] == ("kv_producer" if w.role == "prefill" else "kv_consumer")
        env = {e["name"]: e for e in c["env"]}
        # The IPC folder is a path on the machine that rendered: a pod has a /tmp of its own.
        host_only = ("CUDA_VISIBLE_DEVICES", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_RPC_BASE_PATH")
        plain = {k: v for k, v in spec.env.items() if k not in host_only}
        # A file the plan writes on a host (vLLM's logging config) is the ConfigMap's copy, mounted in the pod.
        moved = {k: f"{CONFIG_MOUNT}/{Path(v).name}" for k, v in plain.items() if v in spec.files}
        assert {k: e["value"] for k, e in env.items() if "value" in e} == {**plain, **moved}
        configmap = find(docs, "ConfigMap", "pdctl-config")["data"]
        for path, text in spec.files.items():
            assert configmap[Path(path).name] == text
            assert {"name": "pdctl-config", "mountPath": CONFIG_MOUNT, "readOnly": True} in c["volumeMounts"]
        if name == "seed":  # the recipe logs KV transfers at info: vLLM's logging config must reach the pod
            assert env["VLLM_LOGGING_CONFIG_PATH"]["value"] == f"{CONFIG_MOUNT}/vllm-logging.json"
        assert "CUDA_VISIBLE_DEVICES" not in env
        assert "VLLM_RPC_BASE_PATH" not in env and (w.engine == "sim") == (spec.ipc_dir is None)
        if "VLLM_NIXL_SIDE_CHANNEL_HOST" in spec.env:
            assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports == {"http": w.port, "nixl": w.side_channel_port}


def test_gpus_and_shared_memory_follow_tensor_parallel_size() -> None:
    tp2 = objects(render(load("tp2")))
    for name in ("prefill", "decode"):
        sts = find(tp2, "StatefulSet", name)
        c = container(sts)
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"} == c["resources"]["requests"]
        assert c["volumeMounts"][0] == {"name": "shm", "mountPath": "/dev/shm"}
        assert sts["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]["medium"] == "Memory"
    seed = container(find(objects(render(load("seed"))), "StatefulSet", "prefill"))
    assert seed["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert all(m["name"] != "shm" for m in seed.get("volumeMounts", []))  # TP = 1: no shared memory


def test_each_group_gets_a_statefulset_with_its_replicas_and_a_headless_service() -> None:
    dep = load("2p2d")
    docs = objects(render(dep))
    assert [w.replicas for w in dep.workers] == [1, 1, 1, 2]
    for w in dep.workers:
        sts = find(docs, "StatefulSet", w.name)
        svc = find(docs, "Service", w.name)
        assert sts["spec"]["replicas"] == w.replicas
        assert sts["spec"]["serviceName"] == w.name
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
        assert labels["llm-d.ai/role"] == w.role


def test_probes_and_grace_follow_the_supervisor_and_gateway_timeouts(recipe_files: Any) -> None:
    cpath, spath = recipe_files(
        settings_edits={'"request_timeout_s": 120': '"request_timeout_s": 60'},
        config_append="\n[supervisor]\nready_timeout_s = 1800\nstop_timeout_s = 30\n",
    )
    dep = config.load(cpath, spath)
    docs = objects(render(dep))
    sts = find(docs, "StatefulSet", "decode")
    c = container(sts)
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800
    # The preStop drain may last request_timeout_s (after a short pause), then vLLM gets stop_timeout_s.
    script = c["lifecycle"]["preStop"]["exec"]["command"][2]
    assert "end = time.monotonic() + 60" in script and "127.0.0.1:8200/metrics" in script
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= 60 + 30 + 5
    gw = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]
    assert gw["terminationGracePeriodSeconds"] > dep.gateway.drain_timeout_s


def test_no_key_reaches_a_manifest_and_the_gateway_reads_them_from_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDCTL_API_KEY", "sk-client-secret-value-123")
    monkeypatch.setenv("UPSTREAM_KEY", "sk-upstream-secret-value-456")
    rendered = render(load("2p2d"), K8sOptions(secret="my-keys"))
    text = "".join(dump_yaml(docs) for docs in rendered.files.values())
    assert "secret-value" not in text
    docs = objects(rendered)
    refs = {"PDCTL_API_KEY": {"name": "my-keys", "key": "PDCTL_API_KEY"}}
    refs["UPSTREAM_KEY"] = {"name": "my-keys", "key": "UPSTREAM_KEY"}
    gateway = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    verify = find(docs, "Job", "pdctl-verify")["spec"]["template"]["spec"]["containers"][0]
    for c in (gateway, verify):
        got = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
        assert got == refs
    for w in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        names = {e["name"] for e in container(find(docs, "StatefulSet", w))["env"]}
        assert not names & set(refs)


def test_the_configmap_files_load_and_name_the_workers_by_service(tmp_path: Path) -> None:
    dep = load("2p2d")
    data = find(objects(render(dep)), "ConfigMap", "pdctl-config")["data"]
    assert data["config.toml"] == (CONFIGS["2p2d"] / "config.toml").read_text(encoding="utf-8")
    (tmp_path / "config.toml").write_text(data["config.toml"], encoding="utf-8")
    (tmp_path / "settings.json").write_text(data["settings.json"], encoding="utf-8")
    pod_dep = config.load(tmp_path / "config.toml", tmp_path / "settings.json")
    assert [w.url for w in pod_dep.workers] == [
        "http://prefill-0:8100", "http://prefill-1:8101", "http://decode-0:8200", "http://decode-1:8201",
    ]  # fmt: skip
    assert pod_dep.gateway == dep.gateway  # only the routing endpoints change
    gw = from_deployment(pod_dep)
    assert [i.url for i in gw.prefill + gw.decode] == [w.url for w in pod_dep.workers]


def test_the_capacity_profile_travels_in_the_configmap_and_the_pods_gateway_advises_from_it(tmp_path: Path) -> None:
    """slo.capacity_profile is a file beside settings.json on this machine: the ConfigMap holds its text and the
    pods' settings.json names it beside itself, so the gateway in the pod loads the same profile."""
    from pdctl.capacity.profile import dump
    from pdctl.gateway.app import create_app
    from tests.capacity.conftest import timing_profile

    src = tmp_path / "src"
    shutil.copytree(CONFIGS["2p2d"], src)
    (src / "profiles").mkdir()
    (src / "profiles" / "h100.json").write_bytes(dump(timing_profile()))
    settings = json.loads((src / "settings.json").read_text(encoding="utf-8"))
    settings.setdefault("slo", {})["capacity_profile"] = "profiles/h100.json"
    (src / "settings.json").write_text(json.dumps(settings), encoding="utf-8")
    data = find(objects(render(config.load(src / "config.toml", src / "settings.json"))), "ConfigMap",
                "pdctl-config")["data"]  # fmt: skip
    pod = tmp_path / "pod"
    pod.mkdir()
    for name, text in data.items():
        (pod / name).write_text(text, encoding="utf-8")
    assert json.loads(data["settings.json"])["slo"]["capacity_profile"] == "capacity-profile.json"
    pod_dep = config.load(pod / "config.toml", pod / "settings.json")
    assert pod_dep.slo.capacity_profile == str(pod / "capacity-profile.json")
    advisor = create_app(from_deployment(pod_dep), "sk-test").advisor
    assert advisor is not None and advisor.profile == timing_profile()


def test_gateway_and_verify_run_pdctl_on_the_mounted_files() -> None:
    dep = load("seed")
    docs = objects(render(dep))
    files = ["-c", f"{CONFIG_MOUNT}/config.toml", "-s", f"{CONFIG_MOUNT}/settings.json"]
    gw = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]
    c = gw["containers"][0]
    assert c["command"] + c["args"] == ["pdctl", "gateway", *files, "--host", "0.0.0.0"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "PDCTL_GATEWAY_HOLD" not in {e["name"] for e in c["env"]}
    assert gw["volumes"][0]["configMap"]["name"] == "pdctl-config"
    svc = find(docs, "Service", "gateway")
    assert svc["spec"]["ports"][0]["port"] == dep.gateway.listen_port == 8000
    job = find(docs, "Job", "pdctl-verify")["spec"]["template"]["spec"]
    v = job["containers"][0]
    assert v["command"] + v["args"] == ["pdctl", "verify", *files, "--gateway", "http://gateway:8000"]
    assert "http://gateway:8000/ready" in job["initContainers"][0]["command"][2]


def test_the_exact_prefix_view_sends_every_workers_kv_events_to_the_gateway_service() -> None:
    dep = load("seed")
    dep = dataclasses.replace(dep, routing=dataclasses.replace(dep.routing, pd_mode="adaptive", prefix_view="exact",
                                                               kv_events_port=5557))  # fmt: skip
    docs = objects(render(dep))
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
    gw = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "kv-events", "containerPort": 5557} in gw["ports"]
    svc = find(docs, "Service", "gateway")["spec"]["ports"]
    assert {"name": "kv-events", "port": 5557, "targetPort": "kv-events"} in svc
    for w in dep.workers:
        args = container(find(docs, "StatefulSet", w.name))["args"]
        events = json.loads(args[args.index("--kv-events-config") + 1])
        # vLLM's PUB socket connects to a tcp://host:port address; the gateway binds it on the pod IP (kv_events_host).
        # The topic is the name the gateway's discovery gives the pod, <worker>@<pod IP>: Kubernetes expands $(VAR).
        assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://gateway:5557",
                          "topic": f"{w.name}@$(PDCTL_POD_IP)"}  # fmt: skip
        env = container(find(docs, "StatefulSet", w.name))["env"]
        assert {"name": "PDCTL_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env
    # Without the exact view no topic, and no variable for it.
    plain = container(find(objects(render(load("seed"))), "StatefulSet", "decode"))
    assert "--kv-events-config" not in plain["args"] and "PDCTL_POD_IP" not in {e["name"] for e in plain["env"]}


def test_kv_events_curve_adds_a_relay_sidecar_and_reads_every_key_from_the_secret() -> None:
    """routing.kv_events_curve: each engine publishes to a kv-relay container on its pod's loopback; the relay and
    the gateway get their keys by secretKeyRef from the Secret `pdctl keys kv-events --format k8s` makes; no
    manifest holds a key, and the NetworkPolicy still admits only the worker pods."""
    from pdctl.render.netpol import NAME
    from pdctl.vllm import kv_curve

    dep = load("seed")
    dep = dataclasses.replace(dep, routing=dataclasses.replace(dep.routing, pd_mode="adaptive", prefix_view="exact",
                                                               kv_events_port=5557, kv_events_curve=True))  # fmt: skip
    docs = objects(render(dep))
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
        assert doc["kind"] != "Secret"

    def ref(name: str) -> dict[str, object]:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": kv_curve.SECRET_NAME, "key": name}}}

    for w in dep.workers:
        pod = find(docs, "StatefulSet", w.name)["spec"]["template"]["spec"]
        engine, relay = pod["containers"]
        events = json.loads(engine["args"][engine["args"].index("--kv-events-config") + 1])
        assert events["endpoint"].startswith("tcp://127.0.0.1:") and events["topic"] == f"{w.name}@$(PDCTL_POD_IP)"
        listen = events["endpoint"].removeprefix("tcp://")
        assert relay["name"] == "kv-relay" and relay["command"] == ["pdctl"]
        assert relay["args"] == ["kv-relay", "--listen", listen, "--to", "tcp://gateway:5557"]
        assert ref(kv_curve.CLIENT_SECRET_ENV) in relay["env"] and ref(kv_curve.SERVER_PUBLIC_ENV) in relay["env"]
        assert not {e["name"] for e in engine["env"]} & set(kv_curve.ENV_NAMES)
        assert len([e for e in relay["env"] if e["name"] in kv_curve.ENV_NAMES]) == 2
    gw = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert ref(kv_curve.SERVER_SECRET_ENV) in gw["env"] and ref(kv_curve.CLIENT_PUBLIC_ENV) in gw["env"]
    assert kv_curve.CLIENT_SECRET_ENV not in {e["name"] for e in gw["env"]}
    assert find(docs, "NetworkPolicy", NAME)
    # Off: one container per worker pod, no key variable anywhere.
    off = objects(render(dataclasses.replace(dep, routing=dataclasses.replace(dep.routing, kv_events_curve=False))))
    assert len(find(off, "StatefulSet", "decode")["spec"]["template"]["spec"]["containers"]) == 1
    assert not any(name in json.dumps(off) for name in kv_curve.ENV_NAMES)


def test_ucx_and_rdma_knobs_reach_every_worker_pod() -> None:
    opts = K8sOptions(ucx_tls="rc,cuda_copy", ucx_net_devices="mlx5_0:1", rdma_resources=("rdma/ib=1",))
    for w in ("prefill", "decode"):
        c = container(find(objects(render(load("seed"), opts)), "StatefulSet", w))
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "1", "rdma/ib": "1"}
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_the_cli_writes_a_kustomization_and_a_plain_stream(cli: Any, tmp_path: Path) -> None:
    folder = CONFIGS["2p2d"]
    out = tmp_path / "k8s"
    args = ["render", "k8s", "-c", str(folder / "config.toml"), "-s", str(folder / "settings.json")]
    result = cli(*args, "-o", str(out))
    assert result.exit_code == 0, result.output
    assert f"kubectl apply -k {out}" in result.output
    assert "create secret generic pdctl-keys --from-literal=PDCTL_API_KEY=" in result.output
    kust = yaml.safe_load((out / "kustomization.yaml").read_text(encoding="utf-8"))
    on_disk = {p.name for p in out.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kust["resources"]) == sorted(on_disk)
    assert yaml.safe_load((out / "verify" / "kustomization.yaml").read_text())["resources"] == ["job.yaml"]
    written = [d for p in sorted(out.rglob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    stream = cli(*args, "-o", "-")
    assert stream.exit_code == 0
    streamed = [d for d in yaml.safe_load_all(stream.stdout) if d]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, streamed)) == sorted(key(d) for d in written if d["kind"] != "Kustomization")


@pytest.mark.skipif(
    shutil.which("kubectl") is None and os.environ.get("CI") != "true",  # CI installs it: there, missing fails
    reason="kubectl (its built-in kustomize) is not installed",
)
def test_kubectl_kustomize_builds_the_rendered_folder(cli: Any, tmp_path: Path) -> None:
    """`kubectl apply -k DIR` reads the folder through kustomize: the build holds every rendered object, unchanged
    but for the namespace kustomize stamps on, and the verify Job builds from its own kustomization."""
    folder = CONFIGS["2p2d"]
    out = tmp_path / "k8s"
    files = ["-c", str(folder / "config.toml"), "-s", str(folder / "settings.json")]
    result = cli("render", "k8s", *files, "--pod-monitor", "-o", str(out))
    assert result.exit_code == 0, result.output

    def build(path: Path) -> list[dict[str, Any]]:
        proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return [d for d in yaml.safe_load_all(proc.stdout) if d]

    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    written = {key(d): d for p in sorted(out.glob("*.yaml")) if p.name != "kustomization.yaml"
               for d in yaml.safe_load_all(p.read_text(encoding="utf-8")) if d}  # fmt: skip
    built = {key(d): d for d in build(out)}
    assert built.keys() == written.keys()
    for k, doc in written.items():
        assert built[k]["spec" if "spec" in doc else "metadata"] == doc["spec" if "spec" in doc else "metadata"], k
        assert built[k]["metadata"].get("namespace") == doc["metadata"].get("namespace"), k
    (job,) = build(out / "verify")
    assert job["kind"] == "Job" and job["metadata"]["name"] == "pdctl-verify"
    # --pod-monitor: the Prometheus Operator's PodMonitors, labelled as `render monitoring`'s rules select, and the
    # gateway's key (from the Secret) sent to the gateway's pods only
    workers, gateway = (built[("PodMonitor", n)]["spec"] for n in ("pdctl-workers", "pdctl-gateway"))
    assert workers["selector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    assert "authorization" not in workers["podMetricsEndpoints"][0]
    assert gateway["podMetricsEndpoints"][0]["authorization"]["credentials"] == {"name": "pdctl-keys",
                                                                                 "key": "PDCTL_API_KEY"}  # fmt: skip
    labels = {r["targetLabel"] for r in gateway["podMetricsEndpoints"][0]["relabelings"]}
    assert labels == {"deployment", "role", "instance"}


def test_a_config_that_cannot_render_says_where_and_exits_2(cli: Any, recipe_files: Any, tmp_path: Path) -> None:
    cpath, spath = recipe_files(
        config_edits={'kv_connector = "NixlConnector"': 'kv_connector = "ExampleConnector"', 'backend = "nixl"':
                      'backend = "shared_storage"', 'role = "decode"': 'role = "decode"\nname = "gateway"'}
    )  # fmt: skip
    result = cli("render", "k8s", "-c", str(cpath), "-s", str(spath), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert "K8S002" in result.output and "connector.kv_connector" in result.output
    assert "K8S001" in result.output and "decode.name" in result.output
    assert not (tmp_path / "out").exists()


def test_findings_say_what_happens_to_host_only_settings(recipe_files: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cpath, _ = recipe_files(
        config_edits={'model = "Qwen/Qwen3-8B"\ngpu_ids = [0]': 'model = "./models/q"\ngpu_ids = [0]',
                      'kv_buffer_device = "cuda"': 'kv_buffer_device = "cpu"'}
    )  # fmt: skip
    monkeypatch.chdir(cpath.parent)
    rendered = render(config.load("config.toml", "settings.json"))
    by_code = {(f.code, f.key): f for f in rendered.findings}
    gpu = by_code[("K8S004", "prefill.gpu_ids")]
    assert gpu.severity == "info" and gpu.line == 19 and "nvidia.com/gpu" in gpu.message
    model = by_code[("K8S003", "prefill.model")]
    assert model.severity == "warning" and str(cpath.parent / "models" / "q") in model.message
    assert by_code[("K8S005", "connector.kv_buffer_device")].severity == "warning"
    assert rendered.files  # warnings do not stop the render
    c = container(find(objects(rendered), "StatefulSet", "prefill"))
    assert "resources" not in c  # kv_buffer_device = "cpu": no GPU requested


def test_replicas_must_be_a_positive_integer(recipe_files: Any) -> None:
    cpath, spath = recipe_files(config_edits={'role = "decode"': 'role = "decode"\nreplicas = 0'})
    with pytest.raises(config.ConfigError) as err:
        config.load(cpath, spath)
    assert str(err.value) == "config.toml:29: decode.replicas: expected an integer 1-1000, got 0"


def test_every_render_rule_is_documented() -> None:
    src = (REPO / "pdctl" / "render" / "k8s.py").read_text(encoding="utf-8")
    doc = (REPO / "docs" / "multi-node.md").read_text(encoding="utf-8")
    assert set(re.findall(r'"(K8S\d{3})"', src)) == set(re.findall(r"^\| (K8S\d{3}) \|", doc, flags=re.M))


def test_a_cluster_name_that_cannot_be_a_label_is_an_error_even_with_a_namespace(recipe_files: Any) -> None:
    cpath, spath = recipe_files(config_edits={'name = "pd-disagg-demo"': 'name = "PD demo"'})
    rendered = render(config.load(cpath, spath), K8sOptions(namespace="pd"))
    assert not rendered.files
    (err,) = [f for f in rendered.findings if f.severity == "error"]
    assert (err.code, err.key, err.line) == ("K8S001", "cluster.name", 3)
    assert "label value" in err.message


def test_the_yaml_stream_keeps_findings_off_stdout(cli: Any) -> None:
    folder = CONFIGS["seed"]
    result = cli("render", "k8s", "-c", str(folder / "config.toml"), "-s", str(folder / "settings.json"), "-o", "-")
    assert result.exit_code == 0
    assert "K8S004" in result.stderr and "K8S004" not in result.stdout
    assert [d["kind"] for d in yaml.safe_load_all(result.stdout)][:2] == ["Namespace", "ConfigMap"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes' label selector semantics (matchLabels and In expressions, the two the policy uses)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(
        labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []) if e["operator"] == "In"
    )


def test_a_network_policy_lets_only_the_worker_pods_reach_the_kv_events_port() -> None:
    dep = load("2p2d")
    dep = dataclasses.replace(dep, routing=dataclasses.replace(dep.routing, pd_mode="adaptive", prefix_view="exact",
                                                               kv_events_port=5557))  # fmt: skip
    rendered = render(dep)
    docs = objects(rendered)
    policy = find(docs, "NetworkPolicy", "gateway-kv-events")
    for version in (KUBERNETES_VERSION, NEWEST):
        assert kubernetes_validate.validate(policy, version, strict=True) == version
    every = [d for docs_ in rendered.files.values() for d in docs_]  # the verify Job too
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for d in every if d["kind"] in ("StatefulSet", "Deployment", "Job")}  # fmt: skip
    spec = policy["spec"]
    assert [n for n, labels in pods.items() if _selects(spec["podSelector"], labels)] == ["gateway"]
    assert spec["policyTypes"] == ["Ingress"]
    http, events = spec["ingress"]
    assert http == {"ports": [{"protocol": "TCP", "port": dep.gateway.listen_port}]}  # every client, as before
    assert events["ports"] == [{"protocol": "TCP", "port": 5557}]
    (peer,) = events["from"]
    assert set(peer) == {"podSelector"}  # this namespace's pods only, and of those the workers
    admitted = sorted(n for n, labels in pods.items() if _selects(peer["podSelector"], labels))
    assert admitted == sorted(w.name for w in dep.workers) and "pdctl-verify" in pods
    settings = json.loads(find(docs, "ConfigMap", "pdctl-config")["data"]["settings.json"])
    assert settings["routing"]["kv_events_host"] == "0.0.0.0"  # the pod IP, behind the policy
    # No events port, no policy, and the settings keep the loopback default.
    plain = objects(render(load("2p2d")))
    assert not [d for d in plain if d["kind"] == "NetworkPolicy"]
    assert (
        "kv_events_host" not in json.loads(find(plain, "ConfigMap", "pdctl-config")["data"]["settings.json"])["routing"]
    )
