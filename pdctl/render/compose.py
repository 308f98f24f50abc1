"""Deployment -> Docker Compose files (``pdctl render compose``), built from the plan ``pdctl up`` runs.

Every container runs on the host's network (``network_mode: host``), so each process binds and is reached on the
addresses of the two files, exactly as under ``pdctl up`` (``up --only`` for several hosts): the command lines
and environment are :func:`pdctl.runtime.plan.build_plan`'s, with the image's own launch form
(:func:`pdctl.render.k8s.image_argv`). What differs, all forced by containers, is made here and listed in
docs/multi-node.md:

* ``CUDA_VISIBLE_DEVICES`` becomes a GPU reservation (``deploy.resources.reservations.devices``: ``gpu_ids`` as
  ``device_ids``, else ``tensor_parallel_size`` as ``count``); the container sees only those GPUs;
* ``VLLM_RPC_BASE_PATH`` is left out (a container has its own /tmp);
* the files the plan writes on a host (vLLM's logging config) are written beside the compose file and mounted;
* config.toml, settings.json, a local model, shared storage and the gateway's key/TLS files are mounted at their
  paths on the host, read-only (shared storage read-write), so every path in the plan stays valid.

Map::

    render(dep, options, folder) -> RenderedCompose(files: {name: document}, extra: {name: text}, findings)
      compose.yaml           one host: every service
      compose.<host>.yaml    several hosts (worker URL hosts, the gateway's listen host): that host's services
      <plan files>           e.g. vllm-logging.json, mounted into the workers
    services: <worker> (vLLM or sim), gateway (`pdctl gateway`), verify (profile "verify": `pdctl verify`)
    findings(dep)            what cannot render (errors) or runs differently in containers (warnings)

Keys never appear: the gateway and verify read them from an env file the user creates (``--env-file``).
Healthchecks wait ``supervisor.ready_timeout_s`` (workers) or ``warmup_timeout_s`` (gateway) as their start
period; ``depends_on: service_healthy`` orders workers -> gateway -> verify on each host.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl import __version__
from pdctl.check import Finding, Severity
from pdctl.config import Deployment, WorkerConfig
from pdctl.config.schema import parse_endpoint
from pdctl.render.k8s import K8sOptions, image_argv, uses_gpu
from pdctl.render.yamltext import dump_yaml
from pdctl.runtime.plan import GATEWAY_HOLD_ENV, IPC_ENV, ProcessSpec, VllmInstall, build_plan, kv_transfer_config
from pdctl.sim.server import VLLM_VERSION
from pdctl.vllm.protocol import connector_kind

__all__ = [
    "GATEWAY",
    "VERIFY",
    "ComposeOptions",
    "RenderedCompose",
    "findings",
    "host_of",
    "hosts",
    "next_steps",
    "render",
    "write",
]

GATEWAY = "gateway"
VERIFY = "verify"
#: Seconds between two healthchecks; a container is unhealthy after ``_RETRIES`` failures past its start period.
_INTERVAL_S = 5
_RETRIES = 3
_WILDCARD = ("0.0.0.0", "", "::")


@dataclass(frozen=True, slots=True)
class ComposeOptions:
    """What the two files do not say about the hosts (``pdctl render compose`` options)."""

    image: str | None = None  # default: render k8s's, vllm/vllm-openai at the vLLM version pdctl targets
    pdctl_image: str = f"pdctl:{__version__}"
    env_file: str = "pdctl.env"  # relative to the compose file; the user creates it
    ucx_tls: str | None = None
    ucx_net_devices: str | None = None
    hf_cache: str = "~/.cache/huggingface"  # mounted into vLLM containers (their HOME is /root)

    @property
    def vllm_image(self) -> str:
        """The image of the vLLM containers."""
        return K8sOptions(image=self.image).vllm_image


@dataclass(frozen=True, slots=True)
class RenderedCompose:
    """Compose documents by file name, the plan's files to write beside them, and what was found on the way."""

    files: Mapping[str, Mapping[str, Any]]
    extra: Mapping[str, str]
    findings: tuple[Finding, ...] = ()


# ------------------------------------------------------------------------------------------ findings


def findings(dep: Deployment, options: ComposeOptions | None = None) -> list[Finding]:
    """What stops ``render compose`` (errors) and what runs differently in containers (warnings)."""
    opts = options or ComposeOptions()
    out: list[Finding] = []

    def add(code: str, severity: Severity, key: str | None, message: str, hint: str) -> None:
        line = dep.sources.line(dep.config_path, key) if key else None
        out.append(Finding(code, severity, Path(dep.config_path).name, line, key, message, hint))

    names = [w.name for w in dep.workers]
    for w in dep.workers:
        if w.replicas > 1:
            add("DC001", "error", f"{w.table}.replicas",
                f"{w.name}: {w.replicas} replicas cannot share one host's ports",
                "list each instance as its own [[prefill]]/[[decode]] entry, or use render k8s")  # fmt: skip
        if w.name in (GATEWAY, VERIFY) or names.count(w.name) > 1:
            add("DC001", "error", f"{w.table}.name", f"{w.name!r} cannot name a service",
                "a unique name other than 'gateway' and 'verify'")  # fmt: skip
    if len(hosts(dep)) > 1 and any(connector_kind(dep.connector_for(w)) == "shared_storage" for w in dep.workers):
        add("DC002", "error", "connector.kv_connector",
            f"shared storage across hosts ({', '.join(hosts(dep))}): each host would mount its own folder",
            'use kv_connector = "NixlConnector", or put every worker on one host')  # fmt: skip
    if not uses_gpu(dep) and opts.image is None and any(w.engine == "vllm" for w in dep.workers):
        add("DC003", "warning", "connector.kv_buffer_device",
            f"the containers reserve no GPU (kv_buffer_device = {dep.connector.kv_buffer_device!r}), but the "
            "default image is vLLM's CUDA build", "pass --image with a vLLM CPU image")  # fmt: skip
    r = dep.routing
    if r.kv_events_curve and r.prefix_view == "exact" and r.strategy == "pd_disagg":
        add("DC004", "error", None, "routing.kv_events_curve: render compose does not run the KV events relays yet",
            "run the deployment with `pdctl up` (`--only` per host) or `pdctl render k8s`, or set kv_events_curve "
            "to false and keep the events port on a network only the workers reach")  # fmt: skip
    return list(dict.fromkeys(out))


# -------------------------------------------------------------------------------------------- hosts


def host_of(dep: Deployment, name: str) -> str:
    """The host a service runs on: a worker's endpoint host; the gateway's (and verify's) listen host, or the first
    decode's host when it listens on every address."""
    if name in (GATEWAY, VERIFY):
        listen = dep.gateway.listen_host
        if listen not in _WILDCARD:
            return _normal(listen)
        name = dep.decode[0].name if dep.decode else dep.workers[0].name
    (w,) = [w for w in dep.workers if w.name == name]
    return _normal(parse_endpoint(w.url)[0])


def _normal(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else host


def hosts(dep: Deployment) -> list[str]:
    """Every host, in the order of the two files (workers, then the gateway's)."""
    names = [w.name for w in dep.workers] + [GATEWAY]
    return list(dict.fromkeys(host_of(dep, n) for n in names))


def _file_name(host: str, several: bool) -> str:
    return f"compose.{host.replace(':', '-')}.yaml" if several else "compose.yaml"


# ------------------------------------------------------------------------------------------- render


def render(dep: Deployment, options: ComposeOptions | None = None, folder: Path | None = None) -> RenderedCompose:
    """The compose files for ``dep``, to be written in ``folder`` (relative mounts start there; default: cwd).

    An error finding leaves ``files`` empty.
    """
    opts = options or ComposeOptions()
    found = tuple(findings(dep, opts))
    if any(f.severity == "error" for f in found):
        return RenderedCompose({}, {}, found)
    plan = build_plan(dep, VllmInstall("vllm", VLLM_VERSION))
    extra = {Path(path).name: text for spec in plan.workers for path, text in spec.files.items()}
    every = hosts(dep)
    services: dict[str, dict[str, dict[str, Any]]] = {h: {} for h in every}
    for w in dep.workers:
        services[host_of(dep, w.name)][w.name] = _worker(dep, w, plan.get(w.name), opts)
    gateway_host = host_of(dep, GATEWAY)
    local = [w.name for w in dep.workers if host_of(dep, w.name) == gateway_host]
    services[gateway_host][GATEWAY] = _gateway(dep, plan.get(GATEWAY), opts, local)
    services[gateway_host][VERIFY] = _verify(dep, opts)
    base = (folder or Path.cwd()).resolve()
    files = {_file_name(h, len(every) > 1): {"services": _relative(s, base)} for h, s in services.items()}
    return RenderedCompose(files, extra, found)


def _relative(services: dict[str, dict[str, Any]], base: Path) -> dict[str, dict[str, Any]]:
    """Mounts of files in or under the compose file's folder relative to it (``./vllm-logging.json``)."""
    for svc in services.values():
        mounts = []
        for m in svc.get("volumes", []):
            src, rest = m.split(":", 1)
            if src.startswith("./"):
                mounts.append(m)
                continue
            path = Path(src)
            if path.is_absolute() and path.is_relative_to(base):
                src = "./" + os.path.relpath(path, base)
            mounts.append(f"{src}:{rest}")
        if mounts:
            svc["volumes"] = mounts
    return services


def _restart(policy: str, dep: Deployment) -> str:
    return f"on-failure:{dep.supervisor.max_restarts}" if policy == "on-failure" else "no"


def _healthcheck(url: str, start_s: float) -> dict[str, Any]:
    probe = f"import urllib.request as u; u.urlopen({url!r}, timeout=5)"
    return {
        "test": ["CMD", "python3", "-c", probe],
        "interval": f"{_INTERVAL_S}s",
        "timeout": "5s",
        "retries": _RETRIES,
        "start_period": f"{math.ceil(start_s)}s",
    }


def _ro(path: str) -> str:
    return f"{path}:{path}:ro"


def _worker(dep: Deployment, w: WorkerConfig, spec: ProcessSpec, opts: ComposeOptions) -> dict[str, Any]:
    argv = image_argv(spec)
    dropped = {"CUDA_VISIBLE_DEVICES", IPC_ENV} - set(w.env)
    env: dict[str, str] = {}
    mounts: list[str] = []
    for name, value in spec.env.items():
        if name in dropped:
            continue
        if value in spec.files:  # a file the plan writes on a host: written beside the compose file
            mounts.append(f"./{Path(value).name}:{value}:ro")
        env[name] = value
    for knob, setting in (("UCX_TLS", opts.ucx_tls), ("UCX_NET_DEVICES", opts.ucx_net_devices)):
        if setting and knob not in w.env:
            env[knob] = setting
    svc: dict[str, Any] = {
        "image": opts.vllm_image if w.engine == "vllm" else opts.pdctl_image,
        "network_mode": "host",
        "entrypoint": argv[:1],
        "command": argv[1:],
        "environment": env,
        "restart": _restart(spec.restart, dep),
        "stop_grace_period": f"{math.ceil(dep.supervisor.stop_timeout_s)}s",
        "healthcheck": _healthcheck(spec.ready_url, dep.supervisor.ready_timeout_s),
    }
    if w.engine == "vllm":
        svc["ipc"] = "host"  # vLLM's docs: --ipc=host (shared memory between its processes and TP ranks)
        if w.model.startswith((".", "/", "~")):
            mounts.append(_ro(dep.resolve_path(w.model)))
        else:
            mounts.append(f"{opts.hf_cache}:/root/.cache/huggingface")
        if uses_gpu(dep):
            device: dict[str, Any] = {"driver": "nvidia", "capabilities": ["gpu"]}
            if w.gpu_ids:
                device["device_ids"] = [str(g) for g in w.gpu_ids]
            else:
                device["count"] = w.tensor_parallel_size
            svc["deploy"] = {"resources": {"reservations": {"devices": [device]}}}
    storage = kv_transfer_config(dep, w).get("kv_connector_extra_config", {}).get("shared_storage_path")
    if connector_kind(dep.connector_for(w)) == "shared_storage" and storage:
        mounts.append(f"{storage}:{storage}")
    if w.cpu_ids:
        svc["cpuset"] = ",".join(str(c) for c in w.cpu_ids)
    if mounts:
        svc["volumes"] = mounts
    return svc


def _pdctl_files(dep: Deployment) -> list[str]:
    """The two files and the gateway's own files, mounted read-only where the plan names them."""
    g = dep.gateway
    paths = [dep.config_path, dep.settings_path]
    paths += [dep.resolve_path(p) for p in (g.keys_file, g.tls_certfile, g.tls_keyfile, dep.slo.capacity_profile) if p]
    return [_ro(str(Path(p).resolve())) for p in dict.fromkeys(paths)]


def _pdctl_container(opts: ComposeOptions, dep: Deployment) -> dict[str, Any]:
    """What the gateway and verify share: the pdctl image as UID 65532, a read-only root with a /tmp, host network,
    the key variables from the env file, the files mounted."""
    svc: dict[str, Any] = {
        "image": opts.pdctl_image,
        "network_mode": "host",
        "user": "65532:65532",
        "read_only": True,
        "tmpfs": ["/tmp"],
        "working_dir": str(Path(dep.config_path).resolve().parent),
        "volumes": _pdctl_files(dep),
    }
    if dep.gateway.api_key_env or dep.gateway.upstream_api_key_env:
        svc["env_file"] = [opts.env_file]
    return svc


def _gateway(dep: Deployment, spec: ProcessSpec, opts: ComposeOptions, local: list[str]) -> dict[str, Any]:
    argv = ["pdctl", *spec.argv[3:]]  # the plan's `python -m pdctl gateway -c ... -s ...`, the image's entry point
    svc = _pdctl_container(opts, dep)
    svc.update(
        {
            "entrypoint": argv[:1],
            "command": argv[1:],
            "environment": {k: v for k, v in spec.env.items() if k != GATEWAY_HOLD_ENV},
            "restart": _restart(spec.restart, dep),
            "stop_grace_period": f"{math.ceil(dep.gateway.drain_timeout_s + dep.supervisor.stop_timeout_s)}s",
            "healthcheck": _healthcheck(f"{dep.gateway.url}/ready", dep.supervisor.warmup_timeout_s),
        }
    )
    if local:
        svc["depends_on"] = {name: {"condition": "service_healthy"} for name in local}
    return svc


def _verify(dep: Deployment, opts: ComposeOptions) -> dict[str, Any]:
    svc = _pdctl_container(opts, dep)
    svc.update(
        {
            "profiles": [VERIFY],
            "entrypoint": ["pdctl"],
            "command": ["verify", "-c", dep.config_path, "-s", dep.settings_path, "--gateway", dep.gateway.url],
            "environment": {"NO_COLOR": "1"},
            "restart": "no",
            "depends_on": {GATEWAY: {"condition": "service_healthy"}},
        }
    )
    return svc


# -------------------------------------------------------------------------------------------- output


def write(rendered: RenderedCompose, folder: Path) -> list[Path]:
    """Write the compose files and the plan's files under ``folder`` (created); returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    for name, doc in rendered.files.items():
        path = folder / name
        path.write_text(dump_yaml([doc]).removeprefix("---\n"), encoding="utf-8")
        out.append(path)
    for name, text in rendered.extra.items():
        path = folder / name
        path.write_text(text, encoding="utf-8")
        out.append(path)
    return out


def next_steps(
    dep: Deployment, rendered: RenderedCompose, folder: str, options: ComposeOptions | None = None
) -> list[str]:
    """The commands that create the env file, start each host's part and verify (printed by the CLI)."""
    opts = options or ComposeOptions()
    names = [n for n in (dep.gateway.api_key_env, dep.gateway.upstream_api_key_env) if n]
    env_file = f"{folder}/{opts.env_file}"
    lines = "\\n".join(f"{n}=%s" for n in names)
    args = " ".join(f'"${n}"' for n in names)
    steps = [f"umask 077; printf '{lines}\\n' {args} > {env_file}"] if names else []
    several = len(rendered.files) > 1
    for name, doc in rendered.files.items():
        where = f"on {name.removeprefix('compose.').removesuffix('.yaml')}: " if several else ""
        steps.append(f"{where}docker compose -f {folder}/{name} up -d")
        if VERIFY in doc["services"]:
            steps.append(f"{where}docker compose -f {folder}/{name} run --rm {VERIFY}")
    return steps
