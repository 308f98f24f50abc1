"""Why did a worker die? Known causes recognised in the tail of its log.

Each rule is a regular expression over the last lines a process printed and a message/hint for a person.
Rules are ordered from most to least specific; the first match wins.

:func:`dead_end` is the live counterpart: one line after which a process that still runs can never become
ready (the supervisor fails the start on it instead of waiting ``ready_timeout_s``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Diagnosis", "dead_end", "diagnose"]


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """A known cause of a crash: a short code, what happened, how to fix it, the line that says so and, for a
    port in use, the port when the line names it."""

    code: str
    message: str
    hint: str
    line: str = ""
    port: int | None = None


_RULES: tuple[tuple[str, re.Pattern[str], str, str], ...] = (
    (
        "port_in_use",
        re.compile(r"Errno 98|[Aa]ddress already in use"),
        "its port is already in use",
        "stop whatever listens there (`ss -ltnp`) or change the port in settings.json / config.toml; "
        "`pdctl check` lists port conflicts",
    ),
    (
        "cpu_memory_utilization",
        re.compile(r"Available memory on node .* less than desired CPU memory utilization"),
        "--gpu-memory-utilization is too high for this machine's CPU memory (on the CPU backend it is a "
        "fraction of the NUMA node's memory)",
        "set gpu_memory_utilization = 0.2 on the worker and VLLM_CPU_KVCACHE_SPACE=1 in its env",
    ),
    (
        "cuda_oom",
        re.compile(r"CUDA out of memory|torch\.OutOfMemoryError|OutOfMemoryError: CUDA"),
        "the GPU ran out of memory",
        "lower gpu_memory_utilization / max_model_len / max_num_seqs, or give the worker its own GPU "
        "(gpu_ids); check nothing else holds GPU memory (nvidia-smi)",
    ),
    (
        "cpu_oom",
        re.compile(r"Cannot allocate memory|\bMemoryError\b|std::bad_alloc"),
        "the process ran out of memory",
        "lower VLLM_CPU_KVCACHE_SPACE, max_model_len or max_num_seqs, or free memory on the machine",
    ),
    (
        "unknown_connector",
        re.compile(r"Unsupported connector type"),
        "vLLM does not know this kv_connector",
        "use a connector this vLLM version registers (NixlConnector, ExampleConnector, ...); "
        "SharedStorageConnector was renamed ExampleConnector and P2pNcclConnector was removed",
    ),
    (
        "nixl_version",
        # vllm.distributed.nixl_utils.check_nixl_version (vLLM 0.33: NixlConnector's worker asks for 1.5.0).
        re.compile(r"NIXL >= [\w.]+ is required"),
        "this vLLM refuses the installed NIXL as too old (the line names the version it needs and the one found)",
        "upgrade NIXL next to vLLM (`pip install -U nixl`; on the CPU build nixl-cu12==1.5.1, see docs/cpu.md)",
    ),
    (
        "nixl_missing",
        re.compile(r"NIXL is not available|No module named ['\"]?nixl|nixl.*not (?:installed|available)", re.I),
        "NixlConnector needs the nixl package, which is not installed",
        "pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1 (see docs/cpu.md)",
    ),
    (
        "cpu_attention",
        re.compile(r"Unsupported CPU attention configuration"),
        "the CPU attention backend does not support this model's head size",
        "use a model with head_dim 64 or 128 on the CPU backend",
    ),
    (
        "model_not_found",
        re.compile(
            r"is not a local folder and is not a valid model identifier|Repository Not Found|"
            r"RepositoryNotFoundError|Can't load the configuration of|No such file or directory: .*config\.json|"
            r"We couldn't connect to 'https://huggingface\.co'|LocalEntryNotFoundError"
        ),
        "the model was not found (no such folder, or the hub is not reachable)",
        "point `model` at a local folder (e.g. one written by `pdctl model tiny DIR`) or a reachable hub id",
    ),
)


#: The last line of an exception that ended a bind while the process lives on: vLLM's NIXL handshake listener
#: thread dies on a taken side-channel port (``zmq.error.ZMQError: Address already in use (addr='tcp://…')``)
#: and its engine then waits for it until ``VLLM_ENGINE_READY_TIMEOUT_S``; an ``OSError: [Errno 98]`` of the
#: HTTP socket.
_DEAD_END = re.compile(r"\bZMQError: Address already in use|\bOSError: \[Errno 98\]")
#: The port in ZMQ's ``(addr='tcp://127.0.0.1:5700')`` and in asyncio's / uvicorn's ``('127.0.0.1', 8100)``.
_PORT = re.compile(r"addr='\w+://[^']*:(\d+)'|\('[^']*', (\d+)\)")


def diagnose(lines: Sequence[str]) -> Diagnosis | None:
    """The first known cause found in ``lines`` (a log tail), or None."""
    for code, pattern, message, hint in _RULES:
        for line in reversed(lines):
            if pattern.search(line):
                port = _port(line) if code == "port_in_use" else None
                return Diagnosis(code, f"port {port} is already in use" if port else message, hint, line.strip(), port)
    return None


def dead_end(line: str) -> Diagnosis | None:
    """The diagnosis of ``line`` when, printed by a process that still runs, it means the process can never
    become ready (a port it must bind is taken), else None."""
    return diagnose([line]) if _DEAD_END.search(line) else None


def _port(line: str) -> int | None:
    found = _PORT.search(line)
    return int(found.group(1) or found.group(2)) if found else None
