"""Which threads of an idle engine spin (``[supervisor] idle_spinning_threads``, docs/cpu.md): two looks at each
thread's CPU time, and the engine's own word that it has nothing to do. The supervisor puts the threads hot in two
looks in a row, while the engine is idle, at SCHED_IDLE (NIXL's progress thread spins on a CPU engine).

Then, for ``[supervisor] idle_group``, whether the engine serves, every :data:`FOLLOW_S`: the CPU time its
processes' main threads ran (:class:`ActivityWatch`). A request makes the engine's busy loop and its worker's
forward pass run within milliseconds of arriving, long before ``/metrics`` would say so, and reading ``schedstat``
costs no request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from pdctl.vllm.promtext import metric_value, samples

__all__ = [
    "ACTIVE_NS",
    "FOLLOW_S",
    "HOLD_S",
    "SPIN_SHARE",
    "ActivityWatch",
    "SpinWatch",
    "engine_idle",
    "hot_threads",
    "watched_pids",
]

#: A thread of an idle engine busier than this share of a core, in two looks in a row, spins (docs/cpu.md).
SPIN_SHARE = 0.25

#: How often the engines' activity is looked at while ``idle_group`` holds a thread out: a look reads two small
#: /proc files per engine (35 µs for a 1P1D pair), so the supervisor spends well under 1 % of a core on it.
FOLLOW_S = 0.02
#: CPU time the engine's main threads must run between two looks to count as serving: idle, they block (0 ms
#: measured); a step of even the tiny model runs for milliseconds.
ACTIVE_NS = 500_000
#: How long an engine counts as serving after its last busy look: the gaps between a request's steps and between
#: an agent's turns do not take the spinning thread away from a transfer about to start.
HOLD_S = 2.0

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


def _run_ns(pid: int, tid: int | str) -> int:
    """Nanoseconds thread ``tid`` of ``pid`` has run on a CPU (``schedstat``; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split(maxsplit=1)[0])
    except (OSError, ValueError, IndexError):
        return 0


def watched_pids(spinning: list[tuple[int, int]], parent_of: Mapping[int, int], top: int) -> tuple[int, ...]:
    """The engine processes whose threads show it serving: each spinning thread's process (vLLM CPU: the worker,
    whose main thread runs the forward pass) and that process's parent inside the engine's tree (the engine core's
    busy loop), never ``top``, the API server, which answers every ``/metrics`` scrape and health check."""
    pids = {pid for pid, _ in spinning}
    pids |= {parent_of[p] for p in pids if parent_of.get(p, top) != top and parent_of[p] in parent_of}
    return tuple(sorted(pids))


@dataclass(slots=True)
class ActivityWatch:
    """Whether an engine is serving, from the CPU time the main threads of ``pids`` ran: vLLM's engine core runs its
    busy loop there, its worker the forward pass; idle, both block and run nothing (measured: 0 ms of 50, against 45
    to 75 ms of 50 for the pair while the tiny model serves, 2026-12-07)."""

    pids: tuple[int, ...]
    ran_ns: int | None = None
    busy_at: float = -math.inf

    @classmethod
    def of(cls, spinning: list[tuple[int, int]], parent_of: Mapping[int, int], top: int) -> ActivityWatch:
        """The watch of an engine whose ``(pid, tid)`` threads spin (:func:`watched_pids`)."""
        return cls(watched_pids(spinning, parent_of, top))

    def serving(self, now: float) -> bool:
        """One look at ``now`` (monotonic seconds): busy since the last look, or within :data:`HOLD_S` of it."""
        ran, self.ran_ns = self.ran_ns, sum(_run_ns(pid, pid) for pid in self.pids)
        if ran is not None and self.ran_ns - ran >= ACTIVE_NS:
            self.busy_at = now
        return now - self.busy_at < HOLD_S
