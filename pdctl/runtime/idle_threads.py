"""Which threads of an idle engine spin (``[supervisor] idle_spinning_threads``, docs/cpu.md): two looks at each
thread's CPU time, and the engine's own word that it has nothing to do. The supervisor puts the threads hot in two
looks in a row, while the engine is idle, at SCHED_IDLE (NIXL's progress thread spins on a CPU engine).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from pdctl.vllm.promtext import metric_value, samples

__all__ = ["SPIN_SHARE", "SpinWatch", "engine_idle", "hot_threads"]

#: A thread of an idle engine busier than this share of a core, in two looks in a row, spins (docs/cpu.md).
SPIN_SHARE = 0.25

Look = tuple[float, Mapping[tuple[int, int], float]]
"""``(time.monotonic(), {thread key: its CPU seconds})``: one look at a process's threads."""


def hot_threads(before: Look, now: Look) -> frozenset[tuple[int, int]]:
    """The threads busier than :data:`SPIN_SHARE` of a core between two looks (none when no time passed)."""
    (then, was), (at, cpu) = before, now
    if at <= then:
        return frozenset()
    return frozenset(k for k, v in cpu.items() if k in was and (v - was[k]) / (at - then) >= SPIN_SHARE)


def engine_idle(http: httpx.Client, url: str) -> bool:
    """No request running or waiting in the engine at ``url``, by its ``/metrics`` (False when it does not answer)."""
    try:
        r = http.get(url + "/metrics", timeout=1.0)
        parsed = samples(r.text, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    except (httpx.HTTPError, ValueError):
        return False
    running = metric_value(parsed, "vllm:num_requests_running")
    waiting = metric_value(parsed, "vllm:num_requests_waiting") or 0.0
    return r.status_code == 200 and running is not None and running + waiting == 0


@dataclass(slots=True)
class SpinWatch:
    """One run of one engine: the last look at its threads, those hot in it, and whether they were idled."""

    look: Look | None = None
    hot: frozenset[tuple[int, int]] = frozenset()
    idled: bool = False
    """Its spinning threads were put at SCHED_IDLE (this run)."""

    def spinning(self, now: float, cpu: Mapping[tuple[int, int], float]) -> list[tuple[int, int]]:
        """The threads hot in this look and the one before (sorted), given this look's CPU times."""
        last, self.look = self.look, (now, cpu)
        if last is None:
            return []
        hot = hot_threads(last, (now, cpu))
        twice, self.hot = hot & self.hot, hot
        return sorted(twice)
