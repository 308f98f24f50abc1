"""``slo.capacity_profile``: the gateway's sizing advice for the traffic it just served (docs/multi-node.md,
"Advice from the gateway").

Every :attr:`Advisor.interval_s` the advisor snapshots the gateway's prompt and output token histograms
(``pdctl_request_prompt_tokens`` / ``pdctl_request_generation_tokens``, every gateway process's values) and keeps the
snapshots of the last ``slo.advise_window_s``. The difference between the newest and the oldest is the window's
traffic: its ISL and OSL distributions (:func:`pdctl.capacity.advisory.histogram_from_buckets`) and its rate. With
the instances serving now per role and the profile, :func:`pdctl.capacity.advisory.advise_counts` (``pdctl advise``'s
model) runs on a thread, and the result goes to the ``pdctl_advice_*`` gauges that ``pdctl top``, the dashboard
and the alerts read. One gateway process (index 0 of ``gateway.workers``) computes it.

The prefix-cache hit rate is the profile's (``prefix_cache_hit_rate``, 0 when it has none): the gateway does not
see the engines' hits, so without it the advice sizes prefill for every prompt token computed.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdctl.capacity.advisory import STATUSES, Advisory, advise_counts, histogram_from_buckets
from pdctl.capacity.model import Slo, Workload
from pdctl.capacity.profile import DeploymentProfile
from pdctl.capacity.profile import load as load_profile
from pdctl.config import SLOConfig
from pdctl.gateway.metrics import GatewayMetrics
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.routing import Pool
from pdctl.gateway.settings import GatewaySettings

__all__ = ["Advisor", "Snapshot", "observe_tokens"]

_QUANTILES = (("0.5", "p50"), ("0.9", "p90"))
_LOCAL_PATHS = frozenset(("disagg", "local", "colocated", "fallback"))
"""Paths the deployment's own workers answered: the traffic its sizing advice is for."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The token histograms' cumulative state at ``at`` (:func:`time.monotonic`)."""

    at: float
    prompt: dict[float, float]
    prompt_sum: float
    output: dict[float, float]
    output_sum: float

    @property
    def requests(self) -> float:
        return max(self.output.values(), default=0.0)


class Advisor:
    """Windows of finished requests -> :class:`~pdctl.capacity.advisory.Advisory` -> the ``pdctl_advice_*`` gauges.

    ``counts()``: the prefill and decode instances serving now. :meth:`tick` is one step (snapshot, advise,
    publish); :meth:`run` repeats it."""

    def __init__(
        self,
        profile: DeploymentProfile,
        slo: SLOConfig,
        metrics: GatewayMetrics,
        counts: Callable[[], tuple[int, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.profile = profile
        self.slo = Slo.of(slo.ttft_ms, slo.tpot_ms, slo.p90)
        self.window_s = slo.advise_window_s
        self.interval_s = min(30.0, self.window_s / 4)
        self.metrics = metrics
        self.counts = counts
        self.clock = clock
        self.hit_rate = min(max(profile.prefix_cache_hit_rate or 0.0, 0.0), 0.99)
        self.snapshots: collections.deque[Snapshot] = collections.deque()
        self.latest: Advisory | None = None

    @classmethod
    def of(cls, settings: GatewaySettings, metrics: GatewayMetrics, pool: Pool) -> Advisor | None:
        """The advisor of a P/D gateway with ``slo.capacity_profile``, in its first process (ProfileError naming the
        file when it does not load); None otherwise."""
        path = settings.slo.capacity_profile
        if not path or settings.process[0] != 0 or settings.routing.strategy == "colocated":
            return None

        def serving() -> tuple[int, int]:
            prefill, decode = (sum(1 for i in pool.by_role(r) if i.available()) for r in ("prefill", "decode"))
            return prefill, decode

        return cls(load_profile(Path(path)), settings.slo, metrics, serving)

    def snapshot(self) -> Snapshot:
        m = self.metrics
        prompt, prompt_sum = m.histogram("pdctl_request_prompt_tokens")
        output, output_sum = m.histogram("pdctl_request_generation_tokens")
        return Snapshot(self.clock(), prompt, prompt_sum, output, output_sum)

    def _window(self, now: Snapshot) -> Snapshot:
        """Keep ``now`` and the snapshots of the last ``window_s`` (at least one before ``now``); the oldest kept is
        the window's start."""
        self.snapshots.append(now)
        while len(self.snapshots) > 2 and now.at - self.snapshots[0].at > self.window_s:
            self.snapshots.popleft()
        return self.snapshots[0]

    def advise(self, start: Snapshot, end: Snapshot, prefill: int, decode: int) -> Advisory:
        """The advice for the requests finished between ``start`` and ``end`` (pure: no gauges)."""
        requests = end.requests - start.requests
        seconds = end.at - start.at
        rate = requests / seconds if seconds > 0 else 0.0
        isl = histogram_from_buckets(_delta(start.prompt, end.prompt), end.prompt_sum - start.prompt_sum)
        osl = histogram_from_buckets(_delta(start.output, end.output), end.output_sum - start.output_sum)
        workload = None if isl is None or osl is None or osl.mean < 1 else Workload(isl, osl, rate, self.hit_rate)
        return advise_counts(self.profile, workload, self.slo, rate, requests, prefill, decode)

    def publish(self, advice: Advisory) -> None:
        m = self.metrics
        self.latest = advice
        for role, now, best in (("prefill", advice.current_prefill, advice.recommended_prefill),
                                ("decode", advice.current_decode, advice.recommended_decode)):  # fmt: skip
            m.advice_replicas.labels(role, "current").set(now)
            m.advice_replicas.labels(role, "recommended").set(best)
        for of, pred in (("current", advice.current), ("recommended", advice.recommended)):
            for label, attr in _QUANTILES:
                nan = float("nan")
                m.advice_ttft.labels(of, label).set(getattr(pred, f"ttft_{attr}_s") if pred is not None else nan)
                m.advice_tpot.labels(of, label).set(getattr(pred, f"tpot_{attr}_s") if pred is not None else nan)
        m.advice_rate.labels(f"{self.window_s:g}s").set(advice.rate)
        for status in STATUSES:
            m.advice_status.labels(status).set(1.0 if status == advice.status else 0.0)

    async def tick(self) -> Advisory:
        """One step: snapshot on the loop, the model on a thread, the gauges on the loop."""
        now = self.snapshot()
        start = self._window(now)
        prefill, decode = self.counts()
        advice = await asyncio.to_thread(self.advise, start, now, prefill, decode)
        self.publish(advice)
        return advice

    async def run(self) -> None:
        self.snapshots.append(self.snapshot())
        while True:
            await asyncio.sleep(self.interval_s)
            await self.tick()


def observe_tokens(metrics: GatewayMetrics, ex: RequestRecord) -> None:
    """Count a finished request's prompt and output tokens when the deployment's own workers answered it."""
    if ex.status == 200 and ex.path in _LOCAL_PATHS and ex.prompt_tokens is not None and ex.tokens:
        metrics.prompt_tokens.observe(ex.prompt_tokens)
        metrics.generation_tokens.observe(ex.tokens)


def _delta(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    return {le: v - before.get(le, 0.0) for le, v in after.items()}
