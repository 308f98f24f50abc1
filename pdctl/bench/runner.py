"""Running benchmarks: one run, rate sweeps, the max-goodput-rate search, A/B and admission comparisons.

One run = warm-up requests (sent one by one, excluded), then the measured requests under one load shape:

* open loop: Poisson/gamma arrivals at ``rate`` (``inf``: all at once), optionally capped by ``concurrency``
  (the wait for a slot is reported as queue time, as vLLM's ``client_queue_time``);
* closed loop: ``rate = inf`` with ``concurrency`` N keeps N requests in flight;
* a trace replays its own timestamps;
* ``agent`` conversations (and ``claude-code`` / ``codex`` sessions, :mod:`pdctl.bench.agent_clients`) start at the
  arrival times (or all at once) and send their turns one after another (:mod:`pdctl.bench.conversation`);
  ``concurrency`` caps the conversations in flight.

A run is bounded by ``num_requests`` or ``duration_s``. Around it, the workers' and the gateway's ``/metrics``
are scraped before and after, and the engines' batch gauges sampled while it runs (:mod:`pdctl.bench.engine_metrics`).
Model discovery (:func:`discover_model`): the first model a target lists, for a target given without a model.

Every run (each rate of a sweep, each side of an A/B, each probe of the search) draws a fresh run id for its
prompt tags (:func:`pdctl.bench.workload.new_run_id`), so no run finds an earlier run's prompts in a prefix
cache. ``vllm bench sweep`` gets the same effect by calling ``POST /reset_prefix_cache`` between runs, but
vLLM serves that route only with ``VLLM_SERVER_DEV_MODE=1``, which also opens ``/collective_rpc``, ``/sleep``
and the RL routes to anyone who can reach the port; pdctl does not start workers that way.

Max goodput rate (DistServe): the highest rate at which at least ``slo.attainment`` (90 %) of the requests meet
every SLO, found by doubling the rate until a run misses, then bisecting until the bracket is within
``rel_tol``.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx

from pdctl.bench.agent_clients import CLIENTS, plan_clients
from pdctl.bench.arrivals import arrival_offsets
from pdctl.bench.client import BenchClient, Endpoint, RequestResult, raise_if_cancelled
from pdctl.bench.conversation import TurnSource, plan_conversations, run_conversations
from pdctl.bench.engine_metrics import GaugeSeries, kv_summary, metric_deltas, sample_gauges, scrape
from pdctl.bench.metrics import SLO, Summary, percentile, summarize, tpot_s
from pdctl.bench.workload import Workload, new_run_id
from pdctl.errors import PdctlError

__all__ = [
    "BenchError",
    "BenchTarget",
    "LiveStats",
    "LoadShape",
    "PairResult",
    "RunResult",
    "SearchResult",
    "discover_model",
    "plan_turns",
    "run_ab",
    "run_async",
    "run_once",
    "run_sweep",
    "search_each",
    "search_max_goodput_rate",
]

T = TypeVar("T")

LAG_WARN_MS = 20.0


class BenchError(PdctlError):
    """A benchmark that cannot run as asked (the message says which option to change)."""


@dataclass(frozen=True, slots=True)
class BenchTarget:
    """Where and what to send: a base URL (gateway or worker), the model, the API key, the workload."""

    base_url: str
    model: str
    workload: Workload
    api_key: str | None = field(default=None, repr=False)
    endpoint: Endpoint = "chat"
    label: str = ""
    timeout_s: float = 600.0
    metrics_urls: tuple[str, ...] = ()
    # What each metrics URL is, for the report (``prefill``, ``decode``, ``gateway``); unnamed ones show host:port.
    metrics_names: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    # A test seam (httpx.MockTransport); None = real network.
    transport: httpx.AsyncBaseTransport | None = field(default=None, compare=False, repr=False)


def discover_model(url: str, api_key: str | None, transport: httpx.BaseTransport | None = None) -> str:
    """The first model id that ``GET {url}/v1/models`` lists (for a target given without ``--model``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(transport=transport, timeout=10.0) as client:
            resp = client.get(f"{url.rstrip('/')}/v1/models", headers=headers)
        body = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        body = None
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return str(data[0]["id"])
    raise BenchError(f"cannot tell which model {url} serves", hint="pass --model NAME (or -c config.toml)")


@dataclass(frozen=True, slots=True)
class LoadShape:
    """How hard and how long: arrivals, concurrency, bounds, warm-up, seed, SLOs and percentiles."""

    rate: float = math.inf
    burstiness: float = 1.0
    concurrency: int | None = None
    num_requests: int | None = 100
    duration_s: float | None = None
    warmup: int = 1
    seed: int = 0
    slo: SLO | None = None
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(slots=True)
class LiveStats:
    """Counters a progress display reads while a run is going (the runner only appends)."""

    label: str = ""
    total: int | None = None
    sent: int = 0
    completed: int = 0
    failed: int = 0
    ttfts_ms: list[float] = field(default_factory=list)
    tpots_ms: list[float] = field(default_factory=list)
    phase: str = "starting"

    def p50(self, values: list[float]) -> float | None:
        """The running median of a sample (None before the first value)."""
        snapshot = list(values)
        return percentile(snapshot, 50.0) if snapshot else None


@dataclass(slots=True)
class RunResult:
    """One run's inputs, per-request results, summary, metric deltas and warnings."""

    target: BenchTarget
    shape: LoadShape
    results: list[RequestResult]
    summary: Summary
    date: str
    run_id: str = ""
    warmups: int = 0
    metric_deltas: dict[str, dict[str, float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    gauges: dict[str, GaugeSeries] = field(default_factory=dict)


@dataclass(slots=True)
class SearchResult:
    """The outcome of :func:`search_max_goodput_rate`: the best rate meeting the SLOs and every probe run."""

    best_rate: float | None
    runs: list[RunResult]
    attainment_target: float


@dataclass(slots=True)
class PairResult:
    """Runs of the same load against two targets (A/B, or admission control on/off), and any further sides."""

    a: list[RunResult]
    b: list[RunResult]
    more: dict[str, list[RunResult]] = field(default_factory=dict)
    """Further sides by label (``pdctl bench --ab --ab-side NAME=URL``), run after ``b`` at each rate."""

    def by_rate(self) -> list[RunResult]:
        """Every run, rate by rate, in the order they ran."""
        sides = [self.a, self.b, *self.more.values()]
        return [run for i in range(len(self.a)) for side in sides for run in side[i : i + 1]]


# ----------------------------------------------------------------------------------------------- run


def run_async(coro: Awaitable[T]) -> T:
    """Run a coroutine on uvloop when available (a faster loop keeps the client's own lag down)."""

    async def main() -> T:
        return await coro

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    result: T = uvloop.run(main())
    return result


def _plan(target: BenchTarget, shape: LoadShape) -> tuple[int | None, list[float] | None]:
    """(request count or None for duration-bound closed loops, send offsets or None for closed loops)."""
    wl = target.workload
    if shape.num_requests is not None and shape.num_requests < 1:
        raise BenchError(f"--num-requests must be >= 1, got {shape.num_requests}")
    if shape.concurrency is not None and shape.concurrency < 1:
        raise BenchError(f"--concurrency must be >= 1, got {shape.concurrency}")
    if shape.duration_s is not None and not shape.duration_s > 0:
        raise BenchError(f"--duration must be > 0, got {shape.duration_s}")
    if wl.conversational:
        if shape.num_requests is not None:
            raise BenchError(
                f"-n/--num-requests does not apply to -w {wl.name}",
                hint="its requests are --conversations x --turns; bound the run with --duration S instead",
            )
        return plan_turns(wl, "").total, None
    if wl.timed:
        n = shape.num_requests or wl.size or 0
        offsets = [wl.request(i).arrival_s or 0.0 for i in range(n)]
        if shape.duration_s is not None:
            offsets = [t for t in offsets if t < shape.duration_s]
        return len(offsets), offsets
    if math.isinf(shape.rate):
        if shape.concurrency is not None:
            if shape.duration_s is not None and shape.num_requests is None:
                return None, None
            return shape.num_requests or 100, None
        if shape.num_requests is None:
            raise BenchError(
                "a duration needs a finite --rate or a --concurrency",
                hint="add --rate R (requests/s) or --concurrency N",
            )
        return shape.num_requests, [0.0] * shape.num_requests
    if shape.num_requests is not None:
        n = shape.num_requests
    else:
        n = max(1, round(shape.rate * (shape.duration_s or 0.0)))
    return n, arrival_offsets(n, shape.rate, shape.burstiness, shape.seed)


def plan_turns(wl: Workload, run_id: str) -> TurnSource:
    """A conversational workload's turns for the run ``run_id``."""
    if wl.name in CLIENTS:
        return plan_clients(wl.spec, run_id)
    return plan_conversations(wl.spec, run_id)


async def run_once(
    target: BenchTarget,
    shape: LoadShape,
    live: LiveStats | None = None,
    *,
    request_id_prefix: str = "bench",
    run_id: str | None = None,
) -> RunResult:
    """One measured run (warm-up first) against ``target`` under ``shape``, with prompts of its own.

    ``run_id`` names the run in its prompt tags and request ids; None draws a fresh one (the module docstring
    says why every run needs its own).
    """
    n, offsets = _plan(target, shape)
    live = live if live is not None else LiveStats()
    live.label, live.total = target.label or target.base_url, n
    pool = shape.concurrency if shape.concurrency is not None else None
    date = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    run_id = new_run_id() if run_id is None else run_id
    plan = plan_turns(target.workload, run_id) if target.workload.conversational else None
    run_tag = f"{request_id_prefix}-{date}-{run_id.replace(' ', '-')}-{shape.seed}"
    wl = target.workload
    async with (
        BenchClient(
            target.base_url,
            model=target.model,
            api_key=target.api_key,
            endpoint=target.endpoint,
            max_connections=pool,
            timeout_s=target.timeout_s,
            extra_body=target.extra_body,
            transport=target.transport,
        ) as client,
        httpx.AsyncClient(transport=target.transport) as scraper,
    ):
        live.phase = "warm-up"
        warm_failures: list[str] = []
        for k in range(shape.warmup):
            wres = await client.send(
                wl.warmup_request(k, run_id), t0=time.perf_counter(), request_id=f"{run_tag}-warmup-{k}"
            )
            if not wres.success:
                warm_failures.append(wres.error)
        before = await scrape(scraper, target.metrics_urls, target.base_url, target.api_key)

        results: list[RequestResult] = []
        live.phase = "running"
        sem = asyncio.Semaphore(shape.concurrency) if shape.concurrency else None
        t0 = time.perf_counter()
        gauges: dict[str, GaugeSeries] = {}
        sampler = asyncio.create_task(sample_gauges(scraper, target.metrics_urls, t0, gauges))

        def sending() -> None:
            live.sent += 1

        def record(res: RequestResult) -> None:
            results.append(res)
            if res.success:
                live.completed += 1
                live.ttfts_ms.append(res.ttft_s * 1000.0)
                tp = tpot_s(res)
                if tp is not None:
                    live.tpots_ms.append(tp * 1000.0)
            else:
                live.failed += 1

        async def one(index: int, scheduled: float) -> None:
            req = wl.request(index, run_id)
            waited = 0.0
            sending()
            if sem is not None:
                before_wait = time.perf_counter()
                async with sem:
                    waited = time.perf_counter() - before_wait
                    res = await client.send(
                        req, t0=t0, scheduled_s=scheduled, request_id=f"{run_tag}-{index}", queue_s=waited
                    )
            else:
                res = await client.send(req, t0=t0, scheduled_s=scheduled, request_id=f"{run_tag}-{index}")
            record(res)

        if plan is not None:
            await run_conversations(
                plan, client, t0=t0, rate=shape.rate, burstiness=shape.burstiness, seed=shape.seed,
                concurrency=shape.concurrency, duration_s=shape.duration_s, request_id_prefix=run_tag,
                on_send=sending, record=record,
            )  # fmt: skip
        elif offsets is not None:
            tasks: list[asyncio.Task[None]] = []
            for i, off in enumerate(offsets):
                # The event loop's timer may wake up to a millisecond early: never send before the schedule.
                while (delay := t0 + off - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, off)))
            await asyncio.gather(*tasks)
        else:
            counter = iter(range(n if n is not None else 1 << 62))
            deadline = t0 + shape.duration_s if shape.duration_s is not None else math.inf

            async def worker() -> None:
                for i in counter:
                    now = time.perf_counter()
                    if now >= deadline:
                        return
                    await one(i, now - t0)
                    raise_if_cancelled()

            await asyncio.gather(*(worker() for _ in range(shape.concurrency or 1)))
        duration = time.perf_counter() - t0
        sampler.cancel()
        # asyncio.wait, not `suppress(CancelledError): await sampler`: that would also swallow a Ctrl-C
        # cancelling this task right here, and the sweep would go on to its next run.
        await asyncio.wait([sampler])
        live.phase = "collecting"
        after = await scrape(scraper, target.metrics_urls, target.base_url, target.api_key)

    results.sort(key=lambda r: r.index)
    summary = summarize(results, duration, percentiles=shape.percentiles, slo=shape.slo)
    deltas: dict[str, dict[str, float]] = {}
    warnings: list[str] = []
    for url in target.metrics_urls:
        b, a = before.get(url), after.get(url)
        if a is None:
            warnings.append(f"could not read {url} after the run; no KV-transfer deltas from it")
            continue
        deltas[url] = metric_deltas(b or {}, a)
    if warm_failures:
        warnings.append(f"{len(warm_failures)} of {shape.warmup} warm-up request(s) failed: {warm_failures[0]}")
    warnings.extend(_warnings(summary, deltas))
    live.phase = "done"
    return RunResult(target, shape, results, summary, date, run_id, shape.warmup, deltas, warnings, gauges)


def _warnings(summary: Summary, deltas: dict[str, dict[str, float]]) -> list[str]:
    out: list[str] = []
    fallbacks = summary.paths.get("fallback", 0)
    kv = kv_summary(deltas) if deltas else {}
    if fallbacks or kv.get("gateway_fallbacks"):
        count = fallbacks or int(kv.get("gateway_fallbacks", 0))
        out.append(
            f"{count} request(s) took the PD fallback path (decode recomputed the prompt): "
            "these TTFTs are not disaggregated; see `pdctl logs --kv`"
        )
    if kv.get("kv_failed_transfers"):
        out.append(f"{int(kv['kv_failed_transfers'])} KV transfer(s) failed during the run")
    if summary.failed:
        top = ", ".join(f"{k} x{v}" for k, v in sorted(summary.errors.items(), key=lambda e: -e[1])[:3])
        out.append(f"{summary.failed} request(s) failed ({top}); they count against SLO attainment")
    p99_lag = percentile_of(summary, 99.0)
    worst = p99_lag if summary.lag.count >= 100 else summary.lag.max
    if worst > LAG_WARN_MS:
        out.append(
            f"the client sent requests up to {summary.lag.max:.0f} ms late (p99 {p99_lag:.1f} ms): "
            "the load generator itself was busy, so the offered load was lower than asked"
        )
    return out


def percentile_of(summary: Summary, p: float) -> float:
    """The client's scheduling lag at percentile ``p`` (ms), from the summary when it has it."""
    return summary.lag.percentiles.get(p, summary.lag.max)


async def run_sweep(
    target: BenchTarget,
    shape: LoadShape,
    rates: Sequence[float],
    on_start: Callable[[float], LiveStats] | None = None,
) -> list[RunResult]:
    """One run per rate, in order: the same requests (same seed) behind each run's own tag."""
    runs: list[RunResult] = []
    for rate in rates:
        live = on_start(rate) if on_start else None
        runs.append(await run_once(target, replace(shape, rate=rate), live))
    return runs


async def search_max_goodput_rate(
    target: BenchTarget,
    shape: LoadShape,
    *,
    start_rate: float = 1.0,
    max_rate: float = 1024.0,
    rel_tol: float = 0.1,
    max_runs: int = 12,
    on_start: Callable[[float], LiveStats] | None = None,
) -> SearchResult:
    """The highest rate whose run meets the SLO attainment target (see the module docstring)."""
    slo = shape.slo
    if slo is None or slo.empty:
        raise BenchError("the max-goodput search needs SLOs", hint="set slo in settings.json or --goodput ttft:400")
    if not 0 < start_rate <= max_rate:
        raise BenchError(f"--search-start must be in (0, {max_rate:g}], got {start_rate}")
    runs: list[RunResult] = []

    async def ok(rate: float) -> bool:
        live = on_start(rate) if on_start else None
        run = await run_once(target, replace(shape, rate=rate), live)
        runs.append(run)
        return bool(run.summary.slo_met)

    lo: float | None = None
    hi: float | None = None
    rate = start_rate
    while len(runs) < max_runs:
        if await ok(rate):
            lo = rate
            if hi is not None or rate >= max_rate:
                break
            rate = min(rate * 2.0, max_rate)
        else:
            hi = rate
            if lo is not None:
                break
            rate = rate / 2.0
            if rate < start_rate / 64:
                break
    while lo is not None and hi is not None and hi / lo - 1.0 > rel_tol and len(runs) < max_runs:
        mid = math.sqrt(lo * hi)
        if await ok(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(lo, runs, slo.attainment)


async def search_each(
    targets: Sequence[BenchTarget],
    shape: LoadShape,
    *,
    start_rate: float = 1.0,
    max_rate: float = 1024.0,
    on_start: Callable[[str, float], LiveStats] | None = None,
) -> dict[str, SearchResult]:
    """:func:`search_max_goodput_rate` on each target in turn (``--ab --max-goodput``), by the targets' labels."""
    out: dict[str, SearchResult] = {}
    for target in targets:
        started = functools.partial(on_start, target.label) if on_start is not None else None
        out[target.label] = await search_max_goodput_rate(
            target, shape, start_rate=start_rate, max_rate=max_rate, on_start=started
        )
    return out


async def run_ab(
    a: BenchTarget,
    b: BenchTarget,
    shape: LoadShape,
    rates: Sequence[float],
    on_start: Callable[[str, float], LiveStats] | None = None,
    more: Sequence[BenchTarget] = (),
) -> PairResult:
    """The same workload and arrivals against ``a``, ``b`` and then each of ``more``, rate by rate (A/B,
    admission on/off, or a three-sided comparison such as colocated / always-PD / adaptive PD).

    Each side's run has its own prompt tags: when the deployments share workers, B must not find A's prompts
    in the prefix cache.
    """
    out = PairResult([], [], {t.label: [] for t in more})
    for rate in rates:
        for target, sink in ((a, out.a), (b, out.b), *((t, out.more[t.label]) for t in more)):
            live = on_start(target.label, rate) if on_start else None
            sink.append(await run_once(target, replace(shape, rate=rate), live))
    return out
