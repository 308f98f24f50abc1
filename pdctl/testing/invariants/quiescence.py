"""N2, upstream quiescence: each worker's /metrics back at idle (running and waiting 0, KV usage at baseline).

:func:`worker_load` reads vLLM's names (or the fake worker's ``held_blocks``) into a :class:`WorkerLoad`,
:func:`sample_workers` polls every worker once, :func:`check_n2` waits a bounded time for all to be quiet.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from pdctl.testing.invariants.result import InvariantResult, verdict
from pdctl.vllm.promtext import metric_value, samples

__all__ = ["WorkerLoad", "check_n2", "sample_workers", "worker_load"]


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker's load from its /metrics (vLLM names, or the fake worker's ``held_blocks``)."""

    running: float
    waiting: float
    kv_usage: float | None = None
    held_blocks: float | None = None

    @property
    def idle(self) -> bool:
        """No request running or waiting."""
        return self.running == 0 and self.waiting == 0


_LOAD_METRICS = (
    "vllm:num_requests_running", "num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "held_blocks",
)  # fmt: skip


def worker_load(metrics_text: str) -> WorkerLoad:
    """Read ``vllm:num_requests_running/waiting`` and ``vllm:kv_cache_usage_perc`` (or the fake's names)."""
    s = samples(metrics_text, _LOAD_METRICS)
    running = metric_value(s, "vllm:num_requests_running")
    if running is None:
        running = metric_value(s, "num_requests_running")
    return WorkerLoad(
        running=running or 0.0,
        waiting=metric_value(s, "vllm:num_requests_waiting") or 0.0,
        kv_usage=metric_value(s, "vllm:kv_cache_usage_perc"),
        held_blocks=metric_value(s, "held_blocks"),
    )


def sample_workers(urls: Mapping[str, str], timeout_s: float = 5.0) -> dict[str, WorkerLoad | None]:
    """Each worker's current load (None when its /metrics does not answer)."""
    out: dict[str, WorkerLoad | None] = {}
    with httpx.Client(timeout=timeout_s) as client:
        for name, url in urls.items():
            try:
                r = client.get(url.rstrip("/") + "/metrics")
                out[name] = worker_load(r.text) if r.status_code == 200 else None
            except httpx.HTTPError:
                out[name] = None
    return out


def _quiet(load: WorkerLoad | None, base: WorkerLoad | None, tol: float) -> str | None:
    if load is None:
        return "/metrics unreachable"
    if not load.idle:
        return f"running {load.running:g}, waiting {load.waiting:g}"
    base_kv = base.kv_usage if base is not None and base.kv_usage is not None else 0.0
    if load.kv_usage is not None and load.kv_usage > base_kv + tol:
        return f"kv_cache_usage_perc {load.kv_usage:.4f} > baseline {base_kv:.4f}"
    base_held = base.held_blocks if base is not None and base.held_blocks is not None else 0.0
    if load.held_blocks is not None and load.held_blocks > base_held:
        return f"held_blocks {load.held_blocks:g} > baseline {base_held:g}"
    return None


def check_n2(
    urls: Mapping[str, str],
    baseline: Mapping[str, WorkerLoad | None] | None = None,
    *,
    timeout_s: float = 35.0,
    kv_tolerance: float = 1e-6,
    poll_s: float = 0.25,
) -> InvariantResult:
    """Wait (at most ``timeout_s``, e.g. ``kv_lease_duration + 5``) for every worker to be idle at baseline."""
    start = time.monotonic()
    problems: dict[str, str] = {}
    while True:
        loads = sample_workers(urls)
        problems = {}
        for name, load in loads.items():
            why = _quiet(load, (baseline or {}).get(name), kv_tolerance)
            if why is not None:
                problems[name] = why
        if not problems or time.monotonic() - start >= timeout_s:
            break
        time.sleep(poll_s)
    waited = time.monotonic() - start
    return verdict(
        "N2",
        [f"{n}: {why} after {waited:.1f}s" for n, why in problems.items()],
        f"{len(urls)} worker(s) idle at KV baseline after {waited:.1f}s",
    )
