"""Pure functions from per-request results to a run's metrics, with ``vllm bench serve``'s definitions.

* TTFT, E2EL: per completed request (see :mod:`pdctl.bench.client` for the clock points).
* TPOT: ``(E2EL - TTFT) / (output_tokens - 1)`` per completed request with more than one output token;
  one-token outputs have no TPOT sample (and pass a TPOT SLO, as in vLLM).
* ITL: every gap between content chunks, pooled over all completed requests before the statistics.
* Throughput: completed requests, output tokens, input + output tokens, each over the run's duration.
* ITL spikes: gaps between content chunks longer than a threshold (the TPOT SLO when there is one, the same
  on both sides of an A/B; else :data:`SPIKE_FACTOR` times the run's ITL median): decode stalls a reader sees,
  which a TPOT average spreads over the whole stream.
* Goodput: completed requests meeting every given SLO (``ttft``, ``tpot``, ``e2el``; ``<=``), over the duration.
* SLO attainment: good requests / all measured requests. Failed and rejected requests count against it: a
  request the server refused did not meet its SLO. ``slo_met`` is attainment >= the target (DistServe: 90 %).
* By turn (``agent``): TTFT, TPOT and ITL (ms) and the prompt tokens (the server's count) per turn index, and
  for turn 1 against every later turn (``2+``): later turns carry the history, so their prompts are mostly cached.
* Percentiles interpolate linearly between order statistics (numpy's default); ``std`` is the population
  standard deviation (numpy's default). An empty sample gives 0, as vLLM writes it.

All latencies are returned in milliseconds, throughputs per second.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdctl.bench.client import RequestResult

__all__ = [
    "SLO",
    "SPIKE_FACTOR",
    "Spikes",
    "Stats",
    "Summary",
    "by_turn",
    "meets_slo",
    "parse_goodput",
    "percentile",
    "spikes",
    "stats",
    "summarize",
    "tpot_s",
]

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
SPIKE_FACTOR = 5.0


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency targets in ms (None: not constrained) and the attainment a run must reach."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    attainment: float = 0.9

    @property
    def empty(self) -> bool:
        """True when no target is set (then goodput is not computed)."""
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def as_dict(self) -> dict[str, float]:
        """``{"ttft": 400, "tpot": 40}``: the form of vLLM's ``--goodput`` arguments."""
        out = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2el": self.e2el_ms}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary statistics of one sample, in the sample's unit (ms for latencies)."""

    count: int = 0
    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    min: float = 0.0
    max: float = 0.0
    percentiles: dict[float, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Spikes:
    """ITL gaps above ``threshold_ms``: how many, their share of all gaps, and the requests with at least one."""

    threshold_ms: float = 0.0
    gaps: int = 0
    share: float = 0.0
    requests: int = 0


@dataclass(frozen=True, slots=True)
class Summary:
    """The metrics of one run (one rate or concurrency level)."""

    completed: int
    failed: int
    rejected: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats
    lag: Stats
    queue: Stats
    slo: SLO | None
    good_requests: int | None
    request_goodput: float | None
    slo_attainment: float | None
    ttft_attainment: float | None
    tpot_attainment: float | None
    slo_met: bool | None
    paths: dict[str, int]
    errors: dict[str, int]
    prefill_leg: Stats
    ttft_after_prefill: Stats
    by_kind: dict[str, dict[str, Stats]]
    percentiles: tuple[float, ...]
    itl_spikes: Spikes = field(default_factory=Spikes)
    spikes_by_kind: dict[str, Spikes] = field(default_factory=dict)
    # agent: per turn index ("1", "2", ...) and per group ("1", "2+"): ttft, tpot, itl (ms), prompt_tokens
    by_turn: dict[str, dict[str, Stats]] = field(default_factory=dict)
    turn_groups: dict[str, dict[str, Stats]] = field(default_factory=dict)


def percentile(values: Sequence[float], p: float, empty: float = 0.0) -> float:
    """The ``p``-th percentile (0-100) with linear interpolation, like ``numpy.percentile``; ``empty`` if empty."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return empty
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    frac = rank - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def stats(values: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> Stats:
    """Mean, median, population std, min, max and the given percentiles of ``values``."""
    if not values:
        return Stats(percentiles={float(p): 0.0 for p in percentiles})
    n = len(values)
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / n
    return Stats(
        count=n,
        mean=mean,
        median=percentile(values, 50.0),
        std=math.sqrt(var),
        min=min(values),
        max=max(values),
        percentiles={float(p): percentile(values, float(p)) for p in percentiles},
    )


def tpot_s(result: RequestResult) -> float | None:
    """Time per output token after the first, in seconds; None for failures and one-token outputs."""
    if not result.success or result.output_tokens <= 1:
        return None
    return (result.latency_s - result.ttft_s) / (result.output_tokens - 1)


def meets_slo(result: RequestResult, slo: SLO) -> bool:
    """True when a completed request is within every target of ``slo`` (one-token outputs pass TPOT)."""
    if not result.success:
        return False
    if slo.ttft_ms is not None and result.ttft_s * 1000.0 > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None and (tpot_s(result) or 0.0) * 1000.0 > slo.tpot_ms:
        return False
    return not (slo.e2el_ms is not None and result.latency_s * 1000.0 > slo.e2el_ms)


def parse_goodput(items: Iterable[str], attainment: float = 0.9) -> SLO:
    """``["ttft:400", "tpot:40"]`` (vLLM's ``--goodput`` form, ms) -> :class:`SLO`; ValueError if malformed."""
    values: dict[str, float] = {}
    for item in items:
        for part in item.replace(",", " ").split():
            key, sep, value = part.partition(":")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput: expected KEY:MS with KEY ttft, tpot or e2el, got {part!r}")
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"--goodput: {key}: expected milliseconds, got {value!r}") from None
            if not number > 0:
                raise ValueError(f"--goodput: {key}: expected milliseconds > 0, got {value!r}")
            values[key] = number
    return SLO(values.get("ttft"), values.get("tpot"), values.get("e2el"), attainment)


def spikes(results: Sequence[RequestResult], threshold_ms: float) -> Spikes:
    """The ITL gaps of ``results`` (completed ones) longer than ``threshold_ms``."""
    done = [r for r in results if r.success]
    gaps = [g * 1000.0 for r in done for g in r.itl_s]
    over = sum(1 for g in gaps if g > threshold_ms)
    hit = sum(1 for r in done if any(g * 1000.0 > threshold_ms for g in r.itl_s))
    return Spikes(threshold_ms, over, over / len(gaps) if gaps else 0.0, hit)


def _max_tokens_per_s(done: Sequence[RequestResult]) -> float:
    buckets: Counter[int] = Counter()
    for r in done:
        t = r.sent_s + r.ttft_s
        buckets[int(t)] += 1
        for gap in r.itl_s:
            t += gap
            buckets[int(t)] += 1
    return float(max(buckets.values())) if buckets else 0.0


def _max_concurrency(results: Sequence[RequestResult]) -> int:
    events: list[tuple[float, int]] = []
    for r in results:
        end = r.sent_s + max(r.elapsed_s, r.latency_s)
        events.append((r.sent_s, 1))
        events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))
    best = cur = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


def _ms(values: Iterable[float]) -> list[float]:
    return [v * 1000.0 for v in values]


def _turn_stats(sub: Sequence[RequestResult], pcts: Sequence[float]) -> dict[str, Stats]:
    return {
        "ttft": stats(_ms(r.ttft_s for r in sub), pcts),
        "tpot": stats(_ms(t for r in sub if (t := tpot_s(r)) is not None), pcts),
        "itl": stats(_ms(g for r in sub for g in r.itl_s), pcts),
        "prompt_tokens": stats([float(r.prompt_tokens or r.prompt_len) for r in sub], pcts),
    }


def by_turn(done: Sequence[RequestResult], pcts: Sequence[float]) -> tuple[dict[str, dict[str, Stats]], ...]:
    """Completed requests' statistics per turn index and for turn 1 against later turns (empty without turns)."""
    turns = sorted({r.turn for r in done if r.turn is not None})
    per_turn = {str(k): _turn_stats([r for r in done if r.turn == k], pcts) for k in turns}
    groups: dict[str, dict[str, Stats]] = {}
    if turns:
        groups["1"] = _turn_stats([r for r in done if r.turn == 1], pcts)
        groups["2+"] = _turn_stats([r for r in done if r.turn is not None and r.turn > 1], pcts)
    return per_turn, groups


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    slo: SLO | None = None,
) -> Summary:
    """The metrics of one run; warm-up results are ignored, failures are counted."""
    measured = [r for r in results if not r.warmup]
    done = [r for r in measured if r.success]
    failed = len(measured) - len(done)
    pcts = tuple(float(p) for p in percentiles)

    def st(values: Sequence[float]) -> Stats:
        return stats(values, pcts)

    ttfts = [r.ttft_s for r in done]
    tpots = [t for r in done if (t := tpot_s(r)) is not None]
    itls = [g for r in done for g in r.itl_s]
    e2els = [r.latency_s for r in done]
    total_in = sum(r.prompt_tokens or r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    dur = duration_s if duration_s > 0 else float("nan")

    good: int | None = None
    goodput = attain = ttft_att = tpot_att = None
    met: bool | None = None
    if slo is not None and not slo.empty:
        good = sum(1 for r in done if meets_slo(r, slo))
        goodput = good / dur if duration_s > 0 else 0.0
        attain = good / len(measured) if measured else 0.0
        met = bool(measured) and attain >= slo.attainment
        if slo.ttft_ms is not None:
            ttft_att = sum(1 for r in done if r.ttft_s * 1000.0 <= slo.ttft_ms) / max(1, len(measured))
        if slo.tpot_ms is not None:
            ok = sum(1 for r in done if (tpot_s(r) or 0.0) * 1000.0 <= slo.tpot_ms)
            tpot_att = ok / max(1, len(measured))

    errors: Counter[str] = Counter(
        r.error.split(":", 1)[0] if r.error else "unknown" for r in measured if not r.success
    )
    paths: Counter[str] = Counter(r.pd_path or "unknown" for r in measured)
    with_prefill = [r for r in done if r.pd_prefill_ms is not None]
    itl_ms = st(_ms(itls))
    threshold = slo.tpot_ms if slo is not None and slo.tpot_ms is not None else SPIKE_FACTOR * itl_ms.median
    kinds = sorted({r.kind for r in done})
    by_kind: dict[str, dict[str, Stats]] = {}
    spikes_by_kind: dict[str, Spikes] = {}
    if len(kinds) > 1:
        for kind in kinds:
            sub = [r for r in done if r.kind == kind]
            by_kind[kind] = {
                "ttft": st(_ms(r.ttft_s for r in sub)),
                "tpot": st(_ms(t for r in sub if (t := tpot_s(r)) is not None)),
                "itl": st(_ms(g for r in sub for g in r.itl_s)),
            }
            spikes_by_kind[kind] = spikes(sub, threshold)
    per_turn, turn_groups = by_turn(done, pcts)

    return Summary(
        completed=len(done),
        failed=failed,
        rejected=sum(1 for r in measured if r.rejected),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / dur if duration_s > 0 else 0.0,
        output_throughput=total_out / dur if duration_s > 0 else 0.0,
        total_token_throughput=(total_in + total_out) / dur if duration_s > 0 else 0.0,
        max_output_tokens_per_s=_max_tokens_per_s(done),
        max_concurrent_requests=_max_concurrency(measured),
        ttft=st(_ms(ttfts)),
        tpot=st(_ms(tpots)),
        itl=itl_ms,
        e2el=st(_ms(e2els)),
        lag=st(_ms(r.lag_s for r in measured)),
        queue=st(_ms(r.queue_s for r in measured)),
        slo=slo if slo is not None and not slo.empty else None,
        good_requests=good,
        request_goodput=goodput,
        slo_attainment=attain,
        ttft_attainment=ttft_att,
        tpot_attainment=tpot_att,
        slo_met=met,
        paths=dict(paths),
        errors=dict(errors),
        prefill_leg=st([r.pd_prefill_ms for r in with_prefill if r.pd_prefill_ms is not None]),
        ttft_after_prefill=st(
            [r.ttft_s * 1000.0 - r.pd_prefill_ms for r in with_prefill if r.pd_prefill_ms is not None]
        ),
        by_kind=by_kind,
        percentiles=pcts,
        itl_spikes=spikes(done, threshold),
        spikes_by_kind=spikes_by_kind,
        by_turn=per_turn,
        turn_groups=turn_groups,
    )
