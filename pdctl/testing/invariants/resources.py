"""N6, bounded resources: the gateway's fds, RSS, threads and asyncio tasks back near a warm baseline.

:func:`sample_resources` measures a process into a :class:`ResourceSample`; :func:`check_n6` compares two.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from pdctl.testing.invariants.result import InvariantResult, verdict
from pdctl.vllm.promtext import metric_value, samples

__all__ = ["ResourceSample", "check_n6", "sample_resources"]


@dataclass(frozen=True, slots=True)
class ResourceSample:
    """A process's open fds, RSS and threads, plus the gateway's asyncio task count when known."""

    fds: int
    rss_bytes: int
    threads: int
    tasks: int | None = None


def sample_resources(pid: int, metrics_text: str | None = None) -> ResourceSample:
    """Measure ``pid`` now; ``tasks`` from ``pdctl_asyncio_tasks`` in ``metrics_text`` when given."""
    p = psutil.Process(pid)
    with p.oneshot():
        fds, rss, threads = p.num_fds(), p.memory_info().rss, p.num_threads()
    tasks: int | None = None
    if metrics_text is not None:
        v = metric_value(samples(metrics_text, ("pdctl_asyncio_tasks",)), "pdctl_asyncio_tasks")
        tasks = int(v) if v is not None else None
    return ResourceSample(fds, rss, threads, tasks)


def check_n6(
    baseline: ResourceSample,
    after: ResourceSample,
    *,
    tolerance: float = 0.10,
    fd_slack: int = 4,
    rss_slack_bytes: int = 4 << 20,
    thread_slack: int = 2,
) -> InvariantResult:
    """``after`` within ``tolerance`` (+ a small absolute slack, for tiny baselines) of the warm ``baseline``.

    asyncio tasks must be back at (or below) the baseline exactly: a leaked task never finishes.
    """
    problems: list[str] = []

    def bound(what: str, base: int, now: int, slack: int) -> None:
        limit = base * (1 + tolerance) + slack
        if now > limit:
            problems.append(f"{what} {now} > {limit:.0f} (baseline {base})")

    bound("open fds", baseline.fds, after.fds, fd_slack)
    bound("RSS bytes", baseline.rss_bytes, after.rss_bytes, rss_slack_bytes)
    bound("threads", baseline.threads, after.threads, thread_slack)
    if baseline.tasks is not None and after.tasks is not None and after.tasks > baseline.tasks:
        problems.append(f"asyncio tasks {after.tasks} > baseline {baseline.tasks}")
    mib = 1 << 20
    detail = (
        f"fds {baseline.fds}->{after.fds}, RSS {baseline.rss_bytes / mib:.1f}->{after.rss_bytes / mib:.1f} MiB, "
        f"threads {baseline.threads}->{after.threads}, tasks {baseline.tasks}->{after.tasks}"
    )
    return verdict("N6", problems, detail)
