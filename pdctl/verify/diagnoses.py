"""The recipe's troubleshooting as data: each failure's likely ``cause`` and ``next_step``.

§5.1 connector mismatch / decode waiting, §5.2 401/403 and the key variable, §5.3 out of memory, §5.4 garbage
output / model or tokenizer mismatch, the silent fallbacks (no params, no external tokens), and a KV that
arrived altered. ``D_*`` are causes, ``NEXT_*`` next steps; the functions pick one from what was seen.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from pdctl.config import Deployment, WorkerConfig
from pdctl.verify.wire import Reply, error_message

__all__ = [
    "D_CORRUPT",
    "D_GARBAGE",
    "D_KEY",
    "D_SILENT_PARAMS",
    "D_SILENT_TOKENS",
    "NEXT_CONNECTOR",
    "NEXT_CORRUPT",
    "NEXT_GARBAGE",
    "NEXT_PARAMS",
    "NEXT_TOKENS",
    "connector_mismatch",
    "dead_worker_cause",
    "gateway_failure",
    "missing_key",
    "oom_sign",
]

_OOM = re.compile(
    r"out of memory|OutOfMemoryError|Cannot allocate memory|std::bad_alloc|\bMemoryError\b|oom-kill"
    r"|(?-i:^Killed\b)",
    re.IGNORECASE,
)


D_KEY = "§5.2: the gateway rejected the key"
D_SILENT_PARAMS = (
    "silent fallback: prefill answered without usable kv_transfer_params, so decode recomputes the whole "
    "prompt (no KV moved; answers stay correct but PD brings nothing)"
)
D_SILENT_TOKENS = (
    "silent fallback: decode's external_kv_transfer prompt tokens did not rise, so decode computed the prompt "
    "itself instead of loading prefill's KV"
)
D_GARBAGE = "§5.4: different model weights or tokenizer on the two sides (garbage output after a 'successful' transfer)"
D_CORRUPT = (
    "the KV arrived altered: identity matches, yet where the reference is sure of its token decode chose another, "
    "so the bytes were corrupted in transit or in the buffer (or decode loaded other weights under the same name)"
)


def connector_mismatch(p: str, d: str) -> str:
    """§5.1: the two sides run different connectors."""
    return (
        f"§5.1 connector mismatch: prefill uses {p}, decode uses {d}; decode cannot read prefill's KV and waits "
        "in wait_for_layer_load until the timeout, or recomputes"
    )


NEXT_CONNECTOR = (
    "give both workers the identical kv_connector ([connector] kv_connector, no per-worker override), "
    "then `pdctl down && pdctl up`; `pdctl check` reports the mismatch"
)
NEXT_PARAMS = (
    "check the prefill worker was started with a --kv-transfer-config (kv_role kv_producer) and that the "
    "gateway forwards kv_transfer_params; `pdctl plan` shows the flags, `pdctl logs --kv` the events"
)
NEXT_TOKENS = (
    "compare both --kv-transfer-config (`pdctl plan`), look for 'Got invalid KVTransferParams' or NIXL "
    "failures in `pdctl logs --kv`, and check the NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT) is "
    "reachable from decode"
)
NEXT_GARBAGE = (
    "give prefill and decode the identical --model string and the same vLLM version (not a local path on one "
    "side and a hub name on the other), then restart both"
)
NEXT_CORRUPT = (
    "look for NIXL transfer failures in `pdctl logs --kv`; check kv_buffer_device and the transport (UCX) on "
    "both sides; with kv_load_failure_policy=recompute decode hides broken transfers"
)


def oom_sign(logs_dir: Path | None, name: str) -> str | None:
    """The last out-of-memory line in the tail of ``name``'s log, if any."""
    if logs_dir is None:
        return None
    path = logs_dir / f"{name}.log"
    try:
        tail = path.read_text(encoding="utf-8", errors="replace").splitlines()[-200:]
    except OSError:
        return None
    for line in reversed(tail):
        if _OOM.search(line):
            return line.strip()[:200]
    return None


def dead_worker_cause(w: WorkerConfig, logs_dir: Path | None) -> tuple[str, str]:
    """Why ``w`` does not answer: §5.3 when its log shows an out-of-memory line, else "not answering"."""
    oom = oom_sign(logs_dir, w.name)
    if oom:
        return (
            f"§5.3 out of memory in {w.name}'s log: {oom}",
            "enable enable_chunked_prefill or lower max_num_batched_tokens (4096); keep decode's "
            "gpu_memory_utilization <= 0.95; then `pdctl up` again",
        )
    return (
        f"{w.role} instance {w.name} at {w.url} is not answering (process down, still loading, or a wrong "
        "endpoint in settings.json)",
        f"`pdctl status` and `pdctl logs {w.name}`; restart with `pdctl up`",
    )


def missing_key(key_env: str) -> tuple[str, str]:
    """§5.2 seen from verify's side: the key variable is not set in this shell."""
    return (
        f"§5.2: ${key_env} is not set in verify's environment, so requests carry no key",
        f"export {key_env}=<the gateway's key> in this shell, then run verify again",
    )


def gateway_failure(
    reply: Reply, dep: Deployment, gateway_url: str, worker_up: Mapping[str, bool], logs_dir: Path | None
) -> tuple[str, str]:
    """Why a request through the gateway failed: the key, the gateway down, a dead or OOM worker, else its answer."""
    key_env = dep.gateway.api_key_env
    if reply.status in (401, 403):
        return (
            f"{D_KEY}: verify sent ${key_env} but the gateway has a different key, or it reads another variable",
            f"`env | grep {key_env}` in both shells: the gateway must be started with {key_env} "
            "set to the same value; api_key_env holds the variable's name, never the key",
        )
    if reply.error:
        return (
            f"the gateway at {gateway_url} is not answering ({reply.error})",
            "start it (`pdctl up`, or `pdctl gateway -c config.toml -s settings.json`) or pass --gateway URL",
        )
    for w in dep.workers:
        if worker_up.get(w.name) is False:
            return dead_worker_cause(w, logs_dir)
    for w in dep.workers:
        if oom_sign(logs_dir, w.name):
            return dead_worker_cause(w, logs_dir)
    return (
        f"the gateway answered {error_message(reply)}",
        "`pdctl logs gateway` and `pdctl logs --kv` for the failing leg",
    )
