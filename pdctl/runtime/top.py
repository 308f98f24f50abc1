"""``pdctl top``'s data: each worker's and the gateway's ``/metrics``, scraped once a tick, turned into rates
and last-minute quantiles.

* :func:`targets`        -- the deployment's workers and gateway, as the URLs ``top`` scrapes
* :class:`Scraper`       -- one :class:`Frame` per call: every endpoint read in parallel, an unreadable one
  recorded as :class:`Unreachable` (never an exception)
* :func:`parse_worker` / :func:`parse_gateway` -- a ``/metrics`` body -> :class:`WorkerSample` / :class:`GatewaySample`
* :class:`Watch`         -- the frames of the last :data:`GATEWAY_WINDOW_S`; :meth:`Watch.view` gives the
  :class:`TopView` the CLI draws

Counters become rates from the deltas between consecutive frames (a counter that went down counts from zero: the
process restarted), summed over the frames of a window: the workers' rates over the last :data:`RATE_WINDOW_S`,
the gateway's requests, errors and TTFT/TPOT histograms over the last :data:`GATEWAY_WINDOW_S`. Quantiles are read
from the summed bucket deltas the way Prometheus' ``histogram_quantile`` does (:func:`bucket_quantile`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import httpx

from pdctl.vllm.promtext import Sample, metric_value, samples

if TYPE_CHECKING:
    from pdctl.config import Deployment

__all__ = [
    "GATEWAY_WINDOW_S",
    "QUANTILES",
    "RATE_WINDOW_S",
    "Advice",
    "Frame",
    "GatewaySample",
    "GatewayView",
    "PathRow",
    "Scraper",
    "Target",
    "TopView",
    "Unreachable",
    "Watch",
    "WorkerRow",
    "WorkerSample",
    "bucket_quantile",
    "parse_gateway",
    "parse_worker",
    "targets",
]

RATE_WINDOW_S = 5.0
GATEWAY_WINDOW_S = 60.0
QUANTILES = (0.5, 0.9)

# A worker's counters, by what top calls them.
_WORKER_COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "transfers": "vllm:nixl_xfer_time_seconds_count",
}
_RUNNING, _WAITING, _KV_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
_WORKER_NAMES = (_RUNNING, _WAITING, _KV_USAGE, *_WORKER_COUNTERS.values())
_GW_REQUESTS, _GW_FALLBACKS = "pdctl_requests_total", "pdctl_pd_fallback_total"
_GW_IN_FLIGHT = "pdctl_gateway_in_flight"
_GW_TTFT, _GW_TPOT = "pdctl_ttft_seconds_bucket", "pdctl_tpot_seconds_bucket"
_GW_BREAKS = "pdctl_session_cache_breaks_total"  # agent sessions' turns that broke their prompt cache, by where
# routing.pd_mode = "auto": observed / predicted TTFT and TPOT per request (the predictor's error).
_GW_RATIOS = {"TTFT": "pdctl_autopilot_ttft_ratio_bucket", "TPOT": "pdctl_autopilot_tpot_ratio_bucket"}
# slo.capacity_profile: the gateway's sizing advice for its last window (pdctl.gateway.advisor).
_GW_ADVICE = ("pdctl_advice_status", "pdctl_advice_replicas", "pdctl_advice_ttft_seconds", "pdctl_advice_tpot_seconds",
              "pdctl_advice_rate")  # fmt: skip
_GATEWAY_NAMES = (_GW_REQUESTS, _GW_FALLBACKS, _GW_IN_FLIGHT, _GW_TTFT, _GW_TPOT, _GW_BREAKS, *_GW_RATIOS.values(),
                  *_GW_ADVICE)  # fmt: skip
# pdctl_requests_total's status for a client that left: not the deployment's error.
_CLIENT_LEFT = "499"

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Target:
    """One endpoint ``top`` scrapes: a worker (``prefill``/``decode``) or the gateway."""

    name: str
    role: str
    url: str  # base URL, no trailing slash


@dataclass(frozen=True, slots=True)
class Unreachable:
    """An endpoint whose ``/metrics`` could not be read this tick: ``down``, ``timeout`` or ``HTTP <status>``."""

    reason: str


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One worker's ``/metrics`` at one instant: its gauges (None: not exposed) and counters (absent: not exposed,
    e.g. no NIXL transfers with another connector)."""

    running: float | None
    waiting: float | None
    kv_usage: float | None  # 0..1
    counters: dict[str, float]


# A histogram's cumulative buckets: (path, upper bound) -> observations at or below it.
Buckets = dict[tuple[str, float], float]


@dataclass(frozen=True, slots=True)
class Advice:
    """The gateway's sizing advice (``slo.capacity_profile``): its status, the prefill and decode counts serving now
    and recommended, the predicted TTFT / TPOT p90 at each (seconds; inf: cannot keep up), the window's rate."""

    status: str
    window: str
    rate: float
    current: tuple[int, int]
    recommended: tuple[int, int]
    ttft_p90: tuple[float | None, float | None]  # current, recommended
    tpot_p90: tuple[float | None, float | None]


@dataclass(frozen=True, slots=True)
class GatewaySample:
    """The gateway's ``/metrics`` at one instant."""

    requests: dict[tuple[str, str], float]  # (path, status) -> answered
    ttft: Buckets
    tpot: Buckets
    fallbacks: float
    in_flight: float | None
    cache_breaks: dict[str, float] = field(default_factory=dict)  # where -> agent-session turns that broke there
    ratios: dict[str, Buckets] = field(default_factory=dict)  # TTFT / TPOT -> observed / predicted, by path
    advice: Advice | None = None


@dataclass(frozen=True, slots=True)
class Frame:
    """Every endpoint read at one tick (``at``: :func:`time.monotonic`)."""

    at: float
    workers: dict[str, WorkerSample | Unreachable]
    gateway: GatewaySample | Unreachable


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """One worker's line: None where not known (down, a metric it does not expose, or a single frame so far)."""

    name: str
    role: str
    url: str
    down: str | None  # the reason it is unreachable now; None when its /metrics answered
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prompt_tps: float | None = None
    generation_tps: float | None = None
    transfers_ps: float | None = None


@dataclass(frozen=True, slots=True)
class PathRow:
    """The gateway's requests on one path (or ``all``) over the window; latency quantiles in seconds."""

    path: str
    requests: float
    errors: float
    ttft: dict[float, float | None]  # quantile -> seconds
    tpot: dict[float, float | None]


@dataclass(frozen=True, slots=True)
class GatewayView:
    """The gateway over the last ``window_s`` (shorter until a minute of frames is kept)."""

    url: str
    down: str | None
    window_s: float
    paths: list[PathRow] = field(default_factory=list)
    total: PathRow | None = None
    fallbacks: float | None = None
    in_flight: float | None = None
    cache_breaks: dict[str, float] = field(default_factory=dict)
    """Agent sessions' prompt-cache breaks in the window, by where the prompt first differed
    (``pdctl.gateway.agent_sessions``)."""
    predictor: dict[str, float | None] = field(default_factory=dict)
    """``routing.pd_mode = "auto"``: the median observed / predicted TTFT and TPOT in the window, all paths
    together (None: no request measured; empty: the gateway exports no predictor)."""
    advice: Advice | None = None
    """``slo.capacity_profile``: the gateway's latest sizing advice (None: it computes none)."""


@dataclass(frozen=True, slots=True)
class TopView:
    """What one screen of ``pdctl top`` shows."""

    workers: list[WorkerRow]
    gateway: GatewayView


def targets(dep: Deployment) -> tuple[list[Target], Target]:
    """The deployment's workers (prefill then decode, as configured) and its gateway."""
    workers = [Target(w.name, w.role, w.url.rstrip("/")) for w in dep.workers]
    return workers, Target("gateway", "gateway", dep.gateway.url.rstrip("/"))


# ---------------------------------------------------------------------------------------------- parsing


def parse_worker(text: str) -> WorkerSample:
    """A vLLM ``/metrics`` body -> :class:`WorkerSample` (``engine``/``model_name`` labels summed; KV usage averaged
    over the engines)."""
    parsed = samples(text, _WORKER_NAMES)
    usage = [v for n, _, v in parsed if n == _KV_USAGE]
    counters = {short: v for short, name in _WORKER_COUNTERS.items() if (v := metric_value(parsed, name)) is not None}
    return WorkerSample(
        running=metric_value(parsed, _RUNNING),
        waiting=metric_value(parsed, _WAITING),
        kv_usage=sum(usage) / len(usage) if usage else None,
        counters=counters,
    )


def _buckets(parsed: Iterable[Sample], name: str) -> Buckets:
    out: Buckets = {}
    for n, labels, v in parsed:
        if n == name and "le" in labels:
            key = (labels.get("path", ""), float(labels["le"]))
            out[key] = out.get(key, 0.0) + v
    return out


def parse_gateway(text: str) -> GatewaySample:
    """The gateway's ``/metrics`` body -> :class:`GatewaySample`."""
    parsed = samples(text, _GATEWAY_NAMES)
    requests: dict[tuple[str, str], float] = {}
    breaks: dict[str, float] = {}
    for n, labels, v in parsed:
        if n == _GW_REQUESTS:
            key = (labels.get("path", "?"), labels.get("status", "?"))
            requests[key] = requests.get(key, 0.0) + v
        elif n == _GW_BREAKS:
            breaks[labels.get("at", "?")] = breaks.get(labels.get("at", "?"), 0.0) + v
    return GatewaySample(
        requests=requests,
        ttft=_buckets(parsed, _GW_TTFT),
        tpot=_buckets(parsed, _GW_TPOT),
        fallbacks=metric_value(parsed, _GW_FALLBACKS) or 0.0,
        in_flight=metric_value(parsed, _GW_IN_FLIGHT),
        cache_breaks=breaks,
        ratios={what: _buckets(parsed, name) for what, name in _GW_RATIOS.items()},
        advice=_advice(parsed),
    )


def _advice(parsed: Sequence[Sample]) -> Advice | None:
    """The advice gauges (None: the gateway computes no advice)."""
    status = next((lab.get("status", "?") for n, lab, v in parsed if n == "pdctl_advice_status" and v == 1), None)
    if status is None:
        return None

    def gauge(name: str, **labels: str) -> float | None:
        value = metric_value(parsed, name, **labels)
        return None if value is None or math.isnan(value) else value

    def count(role: str, of: str) -> int:
        return int(gauge("pdctl_advice_replicas", role=role, of=of) or 0)

    def p90(name: str) -> tuple[float | None, float | None]:
        return gauge(name, of="current", quantile="0.9"), gauge(name, of="recommended", quantile="0.9")

    window, rate = next(((lab.get("window", "?"), v) for n, lab, v in parsed if n == "pdctl_advice_rate"), ("?", 0.0))
    return Advice(
        status, window, rate, (count("prefill", "current"), count("decode", "current")),
        (count("prefill", "recommended"), count("decode", "recommended")),
        p90("pdctl_advice_ttft_seconds"), p90("pdctl_advice_tpot_seconds"),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------- scraping


class Scraper:
    """Reads every target's ``/metrics`` in parallel, one :class:`Frame` per :meth:`scrape`.

    ``api_key`` goes to the gateway only (a gateway listening beyond loopback asks for one on ``/metrics``);
    ``transport`` is for tests. Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        workers: Sequence[Target],
        gateway: Target,
        api_key: str | None = None,
        timeout_s: float = 2.0,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workers, self.gateway, self._clock = list(workers), gateway, clock
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout_s, transport=transport)
        self._pool = ThreadPoolExecutor(max_workers=len(self.workers) + 1, thread_name_prefix="pdctl-top")

    def _read(self, target: Target) -> str | Unreachable:
        headers = self._auth if target is self.gateway else {}
        try:
            resp = self._client.get(f"{target.url}/metrics", headers=headers)
        except httpx.TimeoutException:
            return Unreachable("timeout")
        except httpx.HTTPError:
            return Unreachable("down")
        if resp.status_code != 200:
            return Unreachable(f"HTTP {resp.status_code}")
        return resp.text

    def scrape(self) -> Frame:
        """Every endpoint now; an unreachable one is recorded as such."""
        at = self._clock()
        bodies = list(self._pool.map(self._read, [*self.workers, self.gateway]))
        workers: dict[str, WorkerSample | Unreachable] = {
            t.name: b if isinstance(b, Unreachable) else parse_worker(b)
            for t, b in zip(self.workers, bodies, strict=False)
        }
        gw = bodies[-1]
        return Frame(at, workers, gw if isinstance(gw, Unreachable) else parse_gateway(gw))

    def close(self) -> None:
        """Stop the threads (without waiting for a read still in flight) and the HTTP client."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> Scraper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ maths


def counter_delta(before: Mapping[K, float], after: Mapping[K, float]) -> dict[K, float]:
    """Per series, how much it grew from ``before`` to ``after``; a series that went down counts from zero (its
    process restarted) and one that is new counts from zero too."""
    out: dict[K, float] = {}
    for k, v in after.items():
        prev = before.get(k, 0.0)
        out[k] = v - prev if v >= prev else v
    return out


def _add(into: dict[K, float], more: Mapping[K, float]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + v


def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of a histogram's cumulative bucket counts (upper bound -> count), interpolated linearly
    within the bucket as Prometheus' ``histogram_quantile``; in the ``+Inf`` bucket, the highest finite bound.
    None without observations."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            in_bucket = count - below
            return lower + (upper - lower) * ((rank - below) / in_bucket if in_bucket > 0 else 1.0)
        lower, below = upper, count
    return lower


# ------------------------------------------------------------------------------------------------ watch


class Watch:
    """The frames of the last ``keep_s`` seconds and what they say (:meth:`view`)."""

    def __init__(
        self,
        workers: Sequence[Target],
        gateway: Target,
        rate_window_s: float = RATE_WINDOW_S,
        keep_s: float = GATEWAY_WINDOW_S,
        quantiles: Sequence[float] = QUANTILES,
    ) -> None:
        self.workers, self.gateway = list(workers), gateway
        self.rate_window_s, self.keep_s, self.quantiles = rate_window_s, keep_s, tuple(quantiles)
        self.frames: deque[Frame] = deque()

    def add(self, frame: Frame) -> None:
        """Keep ``frame``; drop those no pair within ``keep_s`` of it needs any more."""
        self.frames.append(frame)
        while len(self.frames) > 1 and self.frames[1].at <= frame.at - self.keep_s:
            self.frames.popleft()

    def _pairs(self, window_s: float) -> list[tuple[Frame, Frame]]:
        """Consecutive frames, both within ``window_s`` of the newest."""
        if len(self.frames) < 2:
            return []
        start = self.frames[-1].at - window_s
        return [(a, b) for a, b in itertools.pairwise(self.frames) if a.at >= start - 1e-9]

    def view(self) -> TopView:
        """The rows of the newest frame, with rates and quantiles over their windows."""
        return TopView([self._worker_row(t) for t in self.workers], self._gateway_view())

    def _worker_row(self, target: Target) -> WorkerRow:
        now = self.frames[-1].workers.get(target.name) if self.frames else None
        if now is None:
            return WorkerRow(target.name, target.role, target.url, down="-")
        if isinstance(now, Unreachable):
            return WorkerRow(target.name, target.role, target.url, down=now.reason)
        grown: dict[str, float] = {}
        seconds = 0.0
        seen: set[str] = set()
        for a, b in self._pairs(self.rate_window_s):
            wa, wb = a.workers.get(target.name), b.workers.get(target.name)
            if isinstance(wa, WorkerSample) and isinstance(wb, WorkerSample):
                _add(grown, counter_delta(wa.counters, wb.counters))
                seen.update(k for k in wb.counters if k in wa.counters)
                seconds += b.at - a.at

        def rate(name: str) -> float | None:
            return grown.get(name, 0.0) / seconds if seconds > 0 and name in seen else None

        return WorkerRow(
            target.name, target.role, target.url, down=None, running=now.running, waiting=now.waiting,
            kv_usage=now.kv_usage, prompt_tps=rate("prompt_tokens"), generation_tps=rate("generation_tokens"),
            transfers_ps=rate("transfers"),
        )  # fmt: skip

    def _gateway_view(self) -> GatewayView:
        url = self.gateway.url
        if not self.frames:
            return GatewayView(url, down="-", window_s=0.0)
        now = self.frames[-1].gateway
        if isinstance(now, Unreachable):
            return GatewayView(url, down=now.reason, window_s=0.0)
        requests: dict[tuple[str, str], float] = {}
        ttft: Buckets = {}
        tpot: Buckets = {}
        fallbacks, seconds = 0.0, 0.0
        breaks: dict[str, float] = {}
        ratios: dict[str, Buckets] = {}
        for a, b in self._pairs(self.keep_s):
            ga, gb = a.gateway, b.gateway
            if isinstance(ga, GatewaySample) and isinstance(gb, GatewaySample):
                _add(requests, counter_delta(ga.requests, gb.requests))
                _add(ttft, counter_delta(ga.ttft, gb.ttft))
                _add(tpot, counter_delta(ga.tpot, gb.tpot))
                fallbacks += counter_delta({"": ga.fallbacks}, {"": gb.fallbacks})[""]
                _add(breaks, counter_delta(ga.cache_breaks, gb.cache_breaks))
                for what, now_buckets in gb.ratios.items():
                    _add(ratios.setdefault(what, {}), counter_delta(ga.ratios.get(what, {}), now_buckets))
                seconds += b.at - a.at
        paths = sorted({p for p, _ in requests} | {p for p, _ in ttft}, key=lambda p: (-_total(requests, p), p))
        rows = [self._path_row(p, requests, ttft, tpot) for p in paths]
        rows = [r for r in rows if r.requests > 0 or any(v is not None for v in r.ttft.values())]
        total = self._path_row(None, requests, ttft, tpot)
        predictor = {what: bucket_quantile(0.5, _by_bound(buckets)) for what, buckets in ratios.items() if buckets}
        return GatewayView(url, None, seconds, rows, total, fallbacks, now.in_flight, breaks, predictor, now.advice)

    def _path_row(
        self, path: str | None, requests: Mapping[tuple[str, str], float], ttft: Buckets, tpot: Buckets
    ) -> PathRow:
        mine = {k: v for k, v in requests.items() if path is None or k[0] == path}
        errors = sum(v for (_, status), v in mine.items() if not status.startswith("2") and status != _CLIENT_LEFT)

        def quantiles(buckets: Buckets) -> dict[float, float | None]:
            merged: dict[float, float] = {}
            for (p, le), v in buckets.items():
                if path is None or p == path:
                    merged[le] = merged.get(le, 0.0) + v
            return {q: bucket_quantile(q, merged) for q in self.quantiles}

        return PathRow(path or "all", sum(mine.values()), errors, quantiles(ttft), quantiles(tpot))


def _by_bound(buckets: Buckets) -> dict[float, float]:
    """Cumulative bucket counts summed over every path, by upper bound."""
    merged: dict[float, float] = {}
    for (_, le), v in buckets.items():
        merged[le] = merged.get(le, 0.0) + v
    return merged


def _total(requests: Mapping[tuple[str, str], float], path: str) -> float:
    return sum(v for (p, _), v in requests.items() if p == path)
