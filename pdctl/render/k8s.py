"""Deployment -> Kubernetes manifests (``pdctl render k8s``), built from the plan ``pdctl up`` runs.

Every vLLM container's command line and environment come from :func:`pdctl.runtime.plan.build_plan` (launch form
``vllm serve``, as in the official image), so they cannot drift from ``pdctl plan``. The only differences,
all forced by pods, are made here and listed in docs/multi-node.md:

* ``--host 0.0.0.0`` (a pod is reached on its pod IP);
* ``VLLM_NIXL_SIDE_CHANNEL_HOST`` from the pod IP (downward API): NIXL binds and advertises that address;
* ``CUDA_VISIBLE_DEVICES`` / ``VLLM_CPU_OMP_THREADS_BIND`` from ``gpu_ids`` / ``cpu_ids`` are left out (the
  device plugin hands the pod ``nvidia.com/gpu`` = TP GPUs);
* a ``sim`` worker runs ``python -m pdctl.sim`` in the pdctl image;
* with ``routing.kv_events_curve`` an engine publishes to its pod's relay (:mod:`pdctl.render.kv_sidecar`).

Map::

    render(dep, options) -> Rendered(files: {relative path: [manifest, ...]}, findings)
      namespace.yaml      Namespace
      configmap.yaml      ConfigMap: config.toml as written, settings.json with workers as headless Services (and
                          slo.capacity_profile's file)
      <worker>.yaml       per [[prefill]]/[[decode]] group: headless Service + StatefulSet (replicas)
      gateway.yaml        Deployment running `pdctl gateway` + its Service (+ the NetworkPolicy of its KV events
                          port, :mod:`pdctl.render.netpol`)
      kustomization.yaml  the files above (`kubectl apply -k DIR`)
      verify/             Job running `pdctl verify` against the gateway, with its own kustomization.yaml
    findings(dep)         what cannot render (errors) or runs differently in pods (warnings, infos)

Keys never appear: the gateway, the verify Job and the relays read them from Secrets the user creates.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl import __version__
from pdctl.check import Finding, Severity
from pdctl.config import Deployment, WorkerConfig
from pdctl.render.kv_sidecar import GATEWAY_KEYS, relay_sidecars, secret_env
from pdctl.render.netpol import gateway_policy
from pdctl.render.yamltext import dump_yaml
from pdctl.runtime.plan import GATEWAY_HOLD_ENV, IPC_ENV, ProcessSpec, VllmInstall, build_plan
from pdctl.vllm.kv_events import connect_endpoint
from pdctl.vllm.protocol import connector_kind

__all__ = [
    "CONFIG_MOUNT",
    "KUBERNETES_VERSION",
    "K8sOptions",
    "Rendered",
    "cluster_settings",
    "dump_yaml",
    "findings",
    "image_argv",
    "namespace_of",
    "next_steps",
    "render",
    "service_url",
    "uses_gpu",
    "write",
]

#: The oldest Kubernetes minor the manifests are written for (and validated against, with the newest known).
KUBERNETES_VERSION = "1.33"
#: Where the ConfigMap's two files are mounted in the gateway and verify pods.
CONFIG_MOUNT = "/etc/pdctl"
_PROFILE_FILE = "capacity-profile.json"  # slo.capacity_profile, in the ConfigMap
_FILES_ARGS = ("-c", f"{CONFIG_MOUNT}/config.toml", "-s", f"{CONFIG_MOUNT}/settings.json")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_RESOURCE = re.compile(r"^[A-Za-z0-9.\-/]+=\d+$")
_GATEWAY = "gateway"
#: The worker container's variable holding its pod IP, for the KV cache events' topic (:func:`_worker_argv`).
POD_IP_ENV = "PDCTL_POD_IP"
_VERIFY = "pdctl-verify"
#: Seconds a terminating pod keeps serving before SIGTERM, so the gateway and Services stop picking it.
_PRESTOP_S = 5
#: Probe periods (seconds); the startup probe's budget is the supervisor's ``ready_timeout_s``.
_STARTUP_PERIOD_S = 10
_READY_PERIOD_S = 5


def _vllm_version() -> str:
    from pdctl.sim.server import VLLM_VERSION

    return VLLM_VERSION


@dataclass(frozen=True, slots=True)
class K8sOptions:
    """What the two files do not say about a cluster (``pdctl render k8s`` options)."""

    namespace: str | None = None
    image: str | None = None  # default: docker.io/vllm/vllm-openai:v<the vLLM version pdctl targets>
    pdctl_image: str = f"pdctl:{__version__}"
    secret: str = "pdctl-keys"
    ucx_tls: str | None = None
    ucx_net_devices: str | None = None
    rdma_resources: tuple[str, ...] = ()  # "rdma/ib=1": requested per pod, adds IPC_LOCK
    shm_size: str = "16Gi"
    pod_monitor: bool = False  # also podmonitor.yaml: the Prometheus Operator's PodMonitors (its CRDs must exist)

    @property
    def vllm_image(self) -> str:
        """The image of the vLLM containers."""
        return self.image or f"docker.io/vllm/vllm-openai:v{_vllm_version()}"


@dataclass(frozen=True, slots=True)
class Rendered:
    """The manifests by relative file path, and what was found on the way."""

    files: Mapping[str, Sequence[Mapping[str, Any]]]
    findings: tuple[Finding, ...] = ()
    namespace: str = ""

    @property
    def manifests(self) -> list[Mapping[str, Any]]:
        """Every object, in apply order (what ``-o -`` prints; a file that is not a manifest has no ``kind``)."""
        return [doc for docs in self.files.values() for doc in docs if doc.get("kind") not in (None, "Kustomization")]


# ------------------------------------------------------------------------------------------ findings


def _at(dep: Deployment, code: str, severity: Severity, key: str | None, message: str, hint: str | None) -> Finding:
    line = dep.sources.line(dep.config_path, key) if key else None
    return Finding(code, severity, Path(dep.config_path).name, line, key, message, hint)


def findings(dep: Deployment, options: K8sOptions | None = None) -> list[Finding]:
    """What stops ``render k8s`` (errors) and what runs differently in pods than under ``up`` (warning, info)."""
    opts = options or K8sOptions()
    out: list[Finding] = []

    def add(code: str, severity: Severity, key: str | None, message: str, hint: str | None = None) -> None:
        out.append(_at(dep, code, severity, key, message, hint))

    ns = namespace_of(dep, opts)
    if not _NAME.match(ns) or len(ns) > 63:
        add("K8S001", "error", "cluster.name", f"namespace {ns!r} is not a DNS label",
            "use lowercase letters, digits and '-' (or pass --namespace)")  # fmt: skip
    if not _LABEL.match(dep.cluster.name):
        add("K8S001", "error", "cluster.name",
            f"{dep.cluster.name!r} cannot be a label value (app.kubernetes.io/part-of)",
            "at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit")  # fmt: skip
    names = [w.name for w in dep.workers]
    for w in dep.workers:
        t = w.table
        if not _NAME.match(w.name) or len(w.name) > 52 or w.name in (_GATEWAY, _VERIFY) or names.count(w.name) > 1:
            add("K8S001", "error", f"{t}.name", f"{w.name!r} cannot name a StatefulSet and its Service",
                "a unique DNS label of at most 52 characters (lowercase, digits, '-'), not 'gateway'")  # fmt: skip
        if connector_kind(dep.connector_for(w)) == "shared_storage":
            add("K8S002", "error", "connector.kv_connector",
                f"{dep.connector_for(w)} needs a volume shared by prefill and decode pods, which render k8s "
                "does not create", 'use kv_connector = "NixlConnector" (KV over the pod network)')  # fmt: skip
        if w.model.startswith((".", "/", "~")):
            add("K8S003", "warning", f"{t}.model",
                f"the pods get --model {dep.resolve_path(w.model)}, a path on this machine",
                "use a Hugging Face id, or mount the model at that path with a kustomize patch")  # fmt: skip
        if w.gpu_ids:
            add("K8S004", "info", f"{t}.gpu_ids",
                f"not used in pods: each {w.name} pod requests nvidia.com/gpu: {w.tensor_parallel_size} "
                "(tensor_parallel_size) and the device plugin picks the GPUs")  # fmt: skip
        if w.cpu_ids:
            add("K8S004", "info", f"{t}.cpu_ids", "not used in pods: VLLM_CPU_OMP_THREADS_BIND is left to vLLM")
        if w.replicas > 1:
            add("K8S006", "info", f"{t}.replicas",
                f"{w.replicas} {w.name} pods behind one headless Service: the gateway reaches them by that "
                "name, re-resolved; a new pod gets traffic after its warm-up, a leaving one is drained")  # fmt: skip
    if not uses_gpu(dep) and opts.image is None and any(w.engine == "vllm" for w in dep.workers):
        add("K8S005", "warning", "connector.kv_buffer_device",
            f"the pods request no GPU (kv_buffer_device = {dep.connector.kv_buffer_device!r}), but the default "
            "image is vLLM's CUDA build", "pass --image with a vLLM CPU image")  # fmt: skip
    for spec in opts.rdma_resources:
        if not _RESOURCE.match(spec):
            add("K8S007", "error", None, f"--rdma-resource {spec!r} is not NAME=COUNT",
                "for example --rdma-resource rdma/ib=1")  # fmt: skip
    return list(dict.fromkeys(out))  # a rule met by several workers of one group is said once


def uses_gpu(dep: Deployment) -> bool:
    """Whether the workers need GPUs: the KV buffer on CUDA (``kv_buffer_device`` unset or ``"cuda"``)."""
    return dep.connector.kv_buffer_device in (None, "cuda")


def namespace_of(dep: Deployment, options: K8sOptions) -> str:
    """``--namespace``, else ``[cluster] name``."""
    return options.namespace or dep.cluster.name


# ------------------------------------------------------------------------------------------- render


def service_url(w: WorkerConfig) -> str:
    """The worker group's URL inside the namespace: its headless Service's name (resolves to its pods' IPs)."""
    return f"http://{w.name}:{w.port}"


def cluster_settings(dep: Deployment) -> str:
    """settings.json for the pods: each worker endpoint names its group's headless Service, and the KV events port
    listens on the pod IP (:mod:`pdctl.render.netpol` admits only the worker pods); nothing else changes."""
    data: dict[str, Any] = json.loads(Path(dep.settings_path).read_text(encoding="utf-8"))
    routing = data.setdefault("routing", {})
    for role, workers in (("prefill", dep.prefill), ("decode", dep.decode)):
        urls = [service_url(w) for w in workers]
        routing[f"{role}_endpoint"] = urls[0] if len(urls) == 1 else urls
    if dep.routing.prefix_view == "exact":  # the worker pods dial the pod IP; the NetworkPolicy admits only them
        routing["kv_events_host"] = "0.0.0.0"
    if dep.slo.capacity_profile:  # the ConfigMap holds it beside settings.json
        data.setdefault("slo", {})["capacity_profile"] = _PROFILE_FILE
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def render(dep: Deployment, options: K8sOptions | None = None) -> Rendered:
    """The manifests for ``dep``; an error finding leaves ``files`` empty."""
    opts = options or K8sOptions()
    found = tuple(findings(dep, opts))
    ns = namespace_of(dep, opts)
    if any(f.severity == "error" for f in found):
        return Rendered({}, found, ns)
    plan = build_plan(dep, VllmInstall("vllm", _vllm_version()))
    files: dict[str, list[dict[str, Any]]] = {
        "namespace.yaml": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": _labels(dep)}}],
        "configmap.yaml": [_configmap(dep, ns, plan.workers)],
    }
    for w in dep.workers:
        files[f"{w.name}.yaml"] = _worker_objects(dep, w, plan.get(w.name), ns, opts)
    files[f"{_GATEWAY}.yaml"] = _gateway_objects(dep, plan.get(_GATEWAY), ns, opts)
    if opts.pod_monitor:
        files["podmonitor.yaml"] = _pod_monitors(dep, ns, opts)
    files["kustomization.yaml"] = [_kustomization(list(files))]
    files["verify/job.yaml"] = [_verify_job(dep, ns, opts)]
    files["verify/kustomization.yaml"] = [_kustomization(["job.yaml"])]
    return Rendered(files, found, ns)


def _labels(dep: Deployment, **extra: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": dep.cluster.name, "app.kubernetes.io/managed-by": "pdctl", **extra}


def _meta(dep: Deployment, name: str, ns: str, **labels: str) -> dict[str, Any]:
    return {"name": name, "namespace": ns, "labels": _labels(dep, **labels)}


def _pod_monitors(dep: Deployment, ns: str, opts: K8sOptions) -> list[dict[str, Any]]:
    """The Prometheus Operator's PodMonitors: the workers' /metrics, and the gateway's (with its key from the Secret
    unless ``gateway.metrics_public``, and only to the gateway: a key never goes to a worker). Each series gets the
    labels ``pdctl render monitoring``'s rules select on: ``deployment``, ``role`` and ``instance`` (the pod)."""
    pod = "__meta_kubernetes_pod_"
    relabel = [
        {"targetLabel": "deployment", "replacement": dep.cluster.name},
        {"sourceLabels": [f"{pod}label_pdctl_io_role"], "targetLabel": "role"},
        {"sourceLabels": [f"{pod}name"], "targetLabel": "instance"},
    ]

    def monitor(name: str, roles: list[str], endpoint: dict[str, Any]) -> dict[str, Any]:
        selector = {"matchLabels": {"app.kubernetes.io/part-of": dep.cluster.name},
                    "matchExpressions": [{"key": "pdctl.io/role", "operator": "In", "values": roles}]}  # fmt: skip
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": _meta(dep, name, ns),
            "spec": {"selector": selector, "podMetricsEndpoints": [{**endpoint, "relabelings": relabel}]},
        }

    gateway: dict[str, Any] = {"port": "http", "path": "/metrics"}
    if not dep.gateway.metrics_public and dep.gateway.api_key_env:
        key = {"name": opts.secret, "key": dep.gateway.api_key_env}
        gateway["authorization"] = {"type": "Bearer", "credentials": key}
    return [
        monitor("pdctl-workers", ["prefill", "decode"], {"port": "http", "path": "/metrics"}),
        monitor("pdctl-gateway", [_GATEWAY], gateway),
    ]


def _kustomization(resources: list[str]) -> dict[str, Any]:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": resources}


def _configmap(dep: Deployment, ns: str, workers: Sequence[ProcessSpec]) -> dict[str, Any]:
    """The two files, plus the files the plan writes for the workers (vLLM's logging config) under their names."""
    data = {"config.toml": Path(dep.config_path).read_text(encoding="utf-8"), "settings.json": cluster_settings(dep)}
    if dep.slo.capacity_profile:
        data[_PROFILE_FILE] = Path(dep.slo.capacity_profile).read_text(encoding="utf-8")
    for spec in workers:
        for path, text in spec.files.items():
            data[Path(path).name] = text
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(dep, "pdctl-config", ns), "data": data}


def image_argv(spec: ProcessSpec) -> list[str]:
    """A worker's planned command line as an image runs it: the vLLM image's own ``vllm serve``, the pdctl image's
    ``python`` for a simulated worker (``render k8s`` and ``render compose``)."""
    argv = list(spec.argv)
    launch = VllmInstall("vllm", None).launch  # how `render` planned it: this interpreter's module form
    if spec.engine == "vllm" and tuple(argv[: len(launch)]) == launch:
        argv = ["vllm", "serve", *argv[len(launch) :]]
    if spec.engine == "sim":
        argv[0] = "python"  # the pdctl image's interpreter, not this machine's
    return argv


def _worker_argv(spec: ProcessSpec, dep: Deployment) -> list[str]:
    """The plan's command line as the container runs it (:func:`image_argv`), the pod IP bound, and KV cache events
    (``routing.prefix_view = "exact"``) sent to the gateway's Service under the name the gateway gives the pod
    (``<worker>@<pod IP>``, :mod:`pdctl.gateway.discovery`): Kubernetes expands ``$(PDCTL_POD_IP)`` in args."""
    argv = image_argv(spec)
    if "--kv-events-config" in argv:
        i = argv.index("--kv-events-config") + 1
        events = json.loads(argv[i])
        if not dep.routing.kv_events_curve:  # with CURVE it dials its relay sidecar on the pod's loopback
            events["endpoint"] = connect_endpoint(_GATEWAY, dep.routing.kv_events_port)
        events["topic"] = f"{events['topic']}@$({POD_IP_ENV})"
        argv[i] = json.dumps(events, separators=(",", ":"))
    i = argv.index("--host")
    argv[i + 1] = "0.0.0.0"  # pods are reached on their pod IP; the key never reaches a worker anyway
    return argv


def _worker_env(w: WorkerConfig, spec: ProcessSpec, opts: K8sOptions) -> list[dict[str, Any]]:
    # A pod has its own /tmp, and the IPC folder is a path on the machine that rendered (pdctl.runtime.plan.IPC_ENV).
    dropped = {"CUDA_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND", IPC_ENV} - set(w.env)
    env: list[dict[str, Any]] = []
    for name, value in spec.env.items():
        if name in dropped:
            continue
        if name == "VLLM_NIXL_SIDE_CHANNEL_HOST" and name not in w.env:
            env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        elif value in spec.files:  # a file the plan writes on a host: the pod reads the ConfigMap's copy
            env.append({"name": name, "value": f"{CONFIG_MOUNT}/{Path(value).name}"})
        else:
            env.append({"name": name, "value": value})
    for knob, setting in (("UCX_TLS", opts.ucx_tls), ("UCX_NET_DEVICES", opts.ucx_net_devices)):
        if setting and knob not in w.env:
            env.append({"name": knob, "value": setting})
    if "--kv-events-config" in spec.argv:  # the events' topic names the pod
        env.append({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return env


def _probe(path: str, period_s: int, failures: int, timeout_s: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failures,
    }


def _drain_hook(port: int, limit_s: float) -> list[str]:
    """preStop: wait until the engine has no running or waiting request (at most ``limit_s``), then SIGTERM."""
    script = (
        "import re, time, urllib.request as u\n"
        f"time.sleep({_PRESTOP_S}); end = time.monotonic() + {limit_s:g}\n"
        "while time.monotonic() < end:\n"
        "    try:\n"
        f"        m = u.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read().decode()\n"
        "    except OSError as e:\n"
        # Only an engine that is gone ends the wait early; a slow /metrics reply (a busy engine) is asked again.
        "        if isinstance(getattr(e, 'reason', e), ConnectionRefusedError):\n"
        "            break\n"
        "        time.sleep(1)\n"
        "        continue\n"
        r"    busy = re.findall(r'^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.e+]+)$', m, re.M)"
        "\n"
        "    if not any(float(x) for x in busy):\n"
        "        break\n"
        "    time.sleep(1)\n"
    )
    return ["python3", "-c", script]


def _worker_objects(
    dep: Deployment, w: WorkerConfig, spec: ProcessSpec, ns: str, opts: K8sOptions
) -> list[dict[str, Any]]:
    select = {"app.kubernetes.io/part-of": dep.cluster.name, "pdctl.io/worker": w.name}
    labels = {"app.kubernetes.io/component": w.role, "pdctl.io/worker": w.name, "pdctl.io/role": w.role,
              "llm-d.ai/role": w.role}  # fmt: skip
    ports = [{"name": "http", "containerPort": w.port}]
    if w.side_channel_port in spec.ports:
        ports.append({"name": "nixl", "containerPort": w.side_channel_port})
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(dep, w.name, ns, **labels),
        "spec": {
            "clusterIP": "None",
            "selector": select,
            "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports],
        },
    }
    resources: dict[str, Any] = {"nvidia.com/gpu": str(w.tensor_parallel_size)} if uses_gpu(dep) else {}
    resources |= dict(item.split("=", 1) for item in opts.rdma_resources)
    drain_s = dep.gateway.request_timeout_s
    container: dict[str, Any] = {
        "name": "vllm" if w.engine == "vllm" else "sim",
        "image": opts.vllm_image if w.engine == "vllm" else opts.pdctl_image,
        "command": _worker_argv(spec, dep)[:1],
        "args": _worker_argv(spec, dep)[1:],
        "env": _worker_env(w, spec, opts),
        "ports": ports,
        "startupProbe": _probe("/health", _STARTUP_PERIOD_S,
                               max(1, math.ceil(dep.supervisor.ready_timeout_s / _STARTUP_PERIOD_S))),
        "readinessProbe": _probe("/health", _READY_PERIOD_S, 3),
        "livenessProbe": _probe("/health", 10, 3),
        "lifecycle": {"preStop": {"exec": {"command": _drain_hook(w.port, drain_s)}}},
    }  # fmt: skip
    if resources:
        container["resources"] = {"requests": dict(resources), "limits": dict(resources)}
    if opts.rdma_resources:
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod: dict[str, Any] = {
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": _PRESTOP_S + math.ceil(drain_s + dep.supervisor.stop_timeout_s) + 5,
        "containers": [container, *relay_sidecars(dep, spec, opts.pdctl_image, _GATEWAY)],
    }
    if w.tensor_parallel_size > 1:
        container["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
        pod["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}}]
    if spec.files:
        volume, mount = _config_volume()
        container.setdefault("volumeMounts", []).append(mount)
        pod.setdefault("volumes", []).append(volume)
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(dep, w.name, ns, **labels),
        "spec": {
            "serviceName": w.name,
            "replicas": w.replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": select},
            "template": {"metadata": {"labels": _labels(dep, **labels)}, "spec": pod},
        },
    }
    return [service, statefulset]


def _config_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {"name": "pdctl-config", "configMap": {"name": "pdctl-config"}}
    return volume, {"name": "pdctl-config", "mountPath": CONFIG_MOUNT, "readOnly": True}


def _key_names(dep: Deployment) -> list[str]:
    """The variables holding keys; each is an entry of the Secret with the same name."""
    names = [dep.gateway.api_key_env, dep.gateway.upstream_api_key_env]
    return list(dict.fromkeys(n for n in names if n))


def _key_env(dep: Deployment, opts: K8sOptions) -> list[dict[str, Any]]:
    return [{"name": n, "valueFrom": {"secretKeyRef": {"name": opts.secret, "key": n}}} for n in _key_names(dep)]


def _gateway_objects(dep: Deployment, spec: ProcessSpec, ns: str, opts: K8sOptions) -> list[dict[str, Any]]:
    g = dep.gateway
    labels = {"app.kubernetes.io/component": _GATEWAY, "pdctl.io/role": _GATEWAY}
    select = {"app.kubernetes.io/part-of": dep.cluster.name, "pdctl.io/role": _GATEWAY}
    # The plan's `python -m pdctl gateway -c PATH -s PATH` with the image's entry point and the mounted files.
    argv = ["pdctl", *spec.argv[3 : spec.argv.index("-c")], *_FILES_ARGS, "--host", "0.0.0.0"]
    env = [{"name": k, "value": v} for k, v in spec.env.items() if k != GATEWAY_HOLD_ENV] + _key_env(dep, opts)
    env += secret_env(dep, GATEWAY_KEYS)
    volume, mount = _config_volume()
    container = {
        "name": _GATEWAY,
        "image": opts.pdctl_image,
        "command": argv[:1],
        "args": argv[1:],
        "env": env,
        "ports": _gateway_ports(dep),
        "readinessProbe": _probe("/ready", _READY_PERIOD_S, 3),
        "livenessProbe": _probe("/health", 10, 3),
        "volumeMounts": [mount],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(dep, _GATEWAY, ns, **labels),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": select},
            "template": {
                "metadata": {"labels": _labels(dep, **labels)},
                "spec": {
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": math.ceil(g.drain_timeout_s) + 10,
                    "containers": [container],
                    "volumes": [volume],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(dep, _GATEWAY, ns, **labels),
        "spec": {
            "selector": select,
            "ports": [
                {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in _gateway_ports(dep)
            ],
        },
    }
    policy = gateway_policy(dep, ns, _labels(dep, **labels), select)
    return [deployment, service] + ([policy] if policy is not None else [])


def _gateway_ports(dep: Deployment) -> list[dict[str, Any]]:
    """The gateway's HTTP port, and the port its workers' KV cache events dial (``prefix_view = "exact"``)."""
    ports: list[dict[str, Any]] = [{"name": "http", "containerPort": dep.gateway.listen_port}]
    r = dep.routing
    if r.prefix_view == "exact" and r.strategy == "pd_disagg":
        ports.append({"name": "kv-events", "containerPort": r.kv_events_port})
    return ports


def _verify_job(dep: Deployment, ns: str, opts: K8sOptions) -> dict[str, Any]:
    url = f"http://{_GATEWAY}:{dep.gateway.listen_port}"
    wait_s = math.ceil(dep.supervisor.ready_timeout_s)
    wait = (
        "import time, urllib.request as u\n"
        f"end = time.monotonic() + {wait_s}\n"
        "while True:\n"
        "    try:\n"
        f"        if u.urlopen('{url}/ready', timeout=5).status == 200:\n"
        "            break\n"
        "    except Exception:\n"
        "        if time.monotonic() > end:\n"
        f"            raise SystemExit('gateway not ready within {wait_s} s')\n"
        "    time.sleep(5)\n"
    )
    volume, mount = _config_volume()
    labels = {"app.kubernetes.io/component": "verify"}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(dep, _VERIFY, ns, **labels),
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": _labels(dep, **labels)},
                "spec": {
                    "enableServiceLinks": False,
                    "restartPolicy": "Never",
                    "initContainers": [
                        {"name": "wait-gateway", "image": opts.pdctl_image, "command": ["python", "-c", wait]}
                    ],
                    "containers": [
                        {
                            "name": "verify",
                            "image": opts.pdctl_image,
                            "command": ["pdctl"],
                            "args": ["verify", *_FILES_ARGS, "--gateway", url],
                            "env": [{"name": "NO_COLOR", "value": "1"}, *_key_env(dep, opts)],
                            "volumeMounts": [mount],
                        }
                    ],
                    "volumes": [volume],
                },
            },
        },
    }


# -------------------------------------------------------------------------------------------- output


def write(rendered: Rendered, folder: Path) -> list[Path]:
    """Write each file under ``folder`` (created); returns the paths written."""
    out: list[Path] = []
    for rel, docs in rendered.files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_yaml(docs), encoding="utf-8")
        out.append(path)
    return out


def next_steps(dep: Deployment, rendered: Rendered, folder: str, options: K8sOptions | None = None) -> list[str]:
    """The commands that deploy and verify what was rendered (printed by the CLI, shown in the docs)."""
    opts = options or K8sOptions()
    ns = rendered.namespace
    literals = " ".join(f'--from-literal={n}="${n}"' for n in _key_names(dep))
    steps = [
        f"kubectl apply -f {folder}/namespace.yaml",
        f"kubectl -n {ns} create secret generic {opts.secret} {literals}",
        f"kubectl apply -k {folder}",
    ]
    steps += [f"kubectl -n {ns} rollout status statefulset/{w.name} --timeout=30m" for w in dep.workers]
    steps += [
        f"kubectl apply -k {folder}/verify",
        f"kubectl -n {ns} wait --for=condition=complete job/{_VERIFY} --timeout=30m",
        f"kubectl -n {ns} logs job/{_VERIFY}",
    ]
    return steps
