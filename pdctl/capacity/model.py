"""The sizing model behind ``pdctl advise``: pure functions from a profile, a workload and an SLO to predictions.

Map:

* :class:`Histogram`, :func:`parse_histogram`, :func:`workload_from_results`: ISL/OSL distributions (histograms,
  not means: bimodal traffic is what a mean hides) from text or from a ``pdctl bench -o`` results file;
* :func:`predict_pd`: ``x`` prefill and ``y`` decode engines at ``rate`` requests/s. Prefill is a queue of work
  (NVIDIA Dynamo's planner, llm-d's "seconds of queued prefill work"): each request brings its uncached tokens,
  the ``x`` engines drain V_P tokens/s each; the wait is Allen-Cunneen's M/G/c approximation (Erlang C times
  (1 + Cs²)/2). Decode: by Little's law the running streams per engine are rate/y × OSL × step(running), solved
  as a fixed point on the profile's decode curve; requests beyond ``max_num_seqs`` wait for a slot (Erlang C
  again, that wait adding to TTFT). TTFT = prefill wait + prefill(ISL_uncached) + KV hand-off(ISL) + slot wait +
  one decode step; TPOT = the step at the running count a request meets;
* :func:`predict_colocated`: ``c`` engines that prefill and decode. Prefill queues as above, but every prefill
  stalls the engine's running streams for its duration (no chunked prefill, the recipe's setting): a stream's
  TPOT is its step plus the prefills that land during its life (a Poisson count of them) spread over its tokens;
* :func:`size_for_rate` / :func:`size_for_engines`: the fewest engines that meet the SLO at a rate, or the best
  rate a number of engines sustains, for both shapes, and the verdict (colocated unless PD needs fewer engines, or
  sustains more than 2 % higher rate on as many).

Percentiles and attainment come from a seeded sample of requests (:data:`SAMPLES`), so a prediction is a pure
function of its inputs. Not modelled: the KV cache's capacity (the slot limit stands for it), preemption, tensor
parallelism beyond the profile's own, prefix-cache hits on decode, and routing better than join-the-shortest-queue.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdctl.capacity.profile import DeploymentProfile, decode_curve, kv_s, prefill_s, prefill_tokens_per_s
from pdctl.errors import PdctlError

__all__ = [
    "SAMPLES",
    "Advice",
    "AdviceError",
    "AutoscalePlan",
    "Histogram",
    "Prediction",
    "Slo",
    "Workload",
    "autoscale_plan",
    "best_pd",
    "max_rate",
    "parse_histogram",
    "predict",
    "predict_colocated",
    "predict_pd",
    "size_for_engines",
    "size_for_rate",
    "workload_from_results",
]

SAMPLES = 1500
Mode = Literal["pd", "colocated"]


class AdviceError(PdctlError):
    """A workload or request the model cannot answer (the message says which input)."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """A distribution of token counts: ``(value, weight)`` bins, weights > 0."""

    bins: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.bins or any(v < 0 or w <= 0 for v, w in self.bins):
            raise AdviceError("a histogram needs at least one bin, values >= 0 and weights > 0")

    @classmethod
    def of(cls, values: Sequence[float]) -> Histogram:
        """The empirical distribution of ``values``."""
        counts: dict[float, float] = {}
        for v in values:
            counts[float(v)] = counts.get(float(v), 0.0) + 1.0
        return cls(tuple(sorted(counts.items())))

    @property
    def mean(self) -> float:
        total = sum(w for _, w in self.bins)
        return sum(v * w for v, w in self.bins) / total

    @property
    def scv(self) -> float:
        """Squared coefficient of variation (variance / mean²)."""
        m = self.mean
        total = sum(w for _, w in self.bins)
        var = sum(w * (v - m) ** 2 for v, w in self.bins) / total
        return var / (m * m) if m > 0 else 0.0

    def sampler(self, rng: random.Random) -> Callable[[], float]:
        values = [v for v, _ in self.bins]
        weights = [w for _, w in self.bins]
        return lambda: rng.choices(values, weights)[0]


def parse_histogram(text: str, where: str) -> Histogram:
    """``VALUE[:WEIGHT]`` items separated by commas, spaces or lines (``#`` starts a comment): ``128:0.9,4096:0.1``.

    ``where`` names the flag or file in errors (``--isl``, ``isl.txt:3``)."""
    bins: list[tuple[float, float]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for item in line.split("#", 1)[0].replace(",", " ").split():
            value, _, weight = item.partition(":")
            try:
                v, w = float(value), float(weight) if weight else 1.0
            except ValueError:
                raise AdviceError(f"{where}:{lineno}: {item!r} is not VALUE or VALUE:WEIGHT") from None
            if not (math.isfinite(v) and math.isfinite(w)) or v < 0 or w <= 0:
                raise AdviceError(f"{where}:{lineno}: {item!r}: value must be >= 0 and weight > 0")
            bins.append((v, w))
    if not bins:
        raise AdviceError(f"{where}: no values")
    return Histogram(tuple(bins))


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompt and output lengths, the arrival rate (requests/s, None = not known) and the prefix-cache hit rate."""

    isl: Histogram
    osl: Histogram
    rate: float | None = None
    hit_rate: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.hit_rate < 1.0:
            raise AdviceError(f"hit rate {self.hit_rate} must be in [0, 1)")
        if self.osl.mean < 1:
            raise AdviceError("output lengths must average at least 1 token")


def workload_from_results(result: Mapping[str, Any], where: str) -> Workload:
    """The workload of one ``pdctl bench`` / ``vllm bench serve`` result: its lengths, its achieved request rate and
    the prefill engines' prefix-cache hit rate (0 when the file has none)."""
    isl, osl = result.get("input_lens"), result.get("output_lens")
    if not isinstance(isl, list) or not isinstance(osl, list) or not isl:
        raise AdviceError(f"{where}: no input_lens/output_lens", hint="give a file written by `pdctl bench -o`")
    pairs = [(float(i), float(o)) for i, o in zip(isl, osl, strict=False)
             if isinstance(i, int | float) and isinstance(o, int | float) and o > 0]  # fmt: skip
    if not pairs:
        raise AdviceError(f"{where}: no completed request with its lengths")
    rate = result.get("request_throughput")
    hits = 0.0
    pc = result.get("pdctl", {}).get("prefix_cache", {}) if isinstance(result.get("pdctl"), dict) else {}
    rates: list[float] = []
    for v in pc.values():
        if isinstance(v, dict) and "prefill" in str(v.get("name", "")) and isinstance(v.get("hit_rate"), int | float):
            rates.append(float(v["hit_rate"]))
    if rates:
        hits = min(max(sum(rates) / len(rates), 0.0), 0.99)
    return Workload(
        Histogram.of([i for i, _ in pairs]), Histogram.of([o for _, o in pairs]),
        float(rate) if isinstance(rate, int | float) and rate > 0 else None, hits,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Slo:
    """Targets in seconds; a request meets the SLO when both hold; ``attainment`` = share that must."""

    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    @classmethod
    def of(cls, ttft_ms: float, tpot_ms: float, p90: bool) -> Slo:
        """settings.json's ``slo``: the targets in milliseconds, met by 90 % of requests with ``p90``, else 99 %."""
        return cls(ttft_ms / 1000, tpot_ms / 1000, 0.9 if p90 else 0.99)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the model expects of one configuration at one rate (seconds; ``inf`` when it cannot keep up)."""

    mode: Mode
    prefill: int  # colocated: 0
    decode: int  # colocated: the engines
    rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    attainment: float
    prefill_utilization: float
    decode_running: float
    meets: bool
    reason: str

    @property
    def engines(self) -> int:
        return self.prefill + self.decode

    def as_dict(self) -> dict[str, Any]:
        def ms(x: float) -> float | None:
            return round(x * 1000, 2) if math.isfinite(x) else None

        return {
            "mode": self.mode, "prefill": self.prefill, "decode": self.decode, "engines": self.engines,
            "rate": round(self.rate, 4), "ttft_ms": {"p50": ms(self.ttft_p50_s), "p90": ms(self.ttft_p90_s)},
            "tpot_ms": {"p50": ms(self.tpot_p50_s), "p90": ms(self.tpot_p90_s)},
            "attainment": round(self.attainment, 4), "prefill_utilization": round(self.prefill_utilization, 4),
            "decode_running": round(self.decode_running, 2), "meets_slo": self.meets, "reason": self.reason,
        }  # fmt: skip


def _erlang_c(servers: int, offered: float) -> float:
    """P(wait > 0) in an M/M/c queue with ``offered`` = λ/μ (1 when saturated)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1 - b))


def _wait_sampler(
    rng: random.Random, servers: int, arrival: float, service_mean: float, scv: float
) -> Callable[[], float]:
    """Allen-Cunneen's M/G/c: wait 0 with probability 1 - C, else exponential with the corrected mean."""
    offered = arrival * service_mean
    if offered >= servers:
        return lambda: math.inf
    pw = _erlang_c(servers, offered)
    mean = (1 + scv) / 2 * service_mean / (servers - offered)
    return lambda: rng.expovariate(1 / mean) if mean > 0 and rng.random() < pw else 0.0


def _poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, prod = math.exp(-mean), 0, rng.random()
    while prod > limit:
        k += 1
        prod *= rng.random()
    return k


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def _running(arrival: float, osl_mean: float, step: Callable[[float], float], stall: float = 0.0) -> float:
    """Streams running on one engine: the fixed point of n = arrival × OSL × step(n) / (1 - stall) (inf when it
    diverges past 100,000)."""
    n = arrival * osl_mean * step(1.0) / (1 - stall)
    for _ in range(200):
        nxt = arrival * osl_mean * step(max(n, 1.0)) / (1 - stall)
        if nxt > 1e5:
            return math.inf
        if abs(nxt - n) < 1e-6 * max(1.0, n):
            return nxt
        n = nxt
    return n


def _finish(
    mode: Mode, x: int, y: int, rate: float, ttfts: list[float], tpots: list[float], slo: Slo, util: float,
    running: float, why: str,
) -> Prediction:  # fmt: skip
    good = sum(1 for a, b in zip(ttfts, tpots, strict=True) if a <= slo.ttft_s and b <= slo.tpot_s) / len(ttfts)
    t50, t90, d50, d90 = _pct(ttfts, 50), _pct(ttfts, 90), _pct(tpots, 50), _pct(tpots, 90)
    meets = good >= slo.attainment and not why
    if not why and not meets:
        why = (
            f"attainment {good:.0%} < {slo.attainment:.0%}: TTFT p90 {t90 * 1000:.0f} ms (SLO "
            f"{slo.ttft_s * 1000:.0f}), TPOT p90 {d90 * 1000:.1f} ms (SLO {slo.tpot_s * 1000:.0f})"
        )
    return Prediction(mode, x, y, rate, t50, t90, d50, d90, good, util, running, meets, why or "meets the SLO")


def predict_pd(
    profile: DeploymentProfile, workload: Workload, slo: Slo, rate: float, prefill: int, decode: int, seed: int = 0
) -> Prediction:
    """``prefill`` + ``decode`` engines at ``rate`` requests/s (see the module docstring)."""
    if prefill < 1 or decode < 1 or rate <= 0:
        raise AdviceError("a P/D prediction needs >= 1 prefill, >= 1 decode and a rate > 0")
    rng = random.Random(seed)
    step = decode_curve(profile)
    vp = prefill_tokens_per_s(profile)
    keep = 1.0 - workload.hit_rate
    uncached = workload.isl.mean * keep
    util = rate * uncached / (prefill * vp)
    ctx = workload.isl.mean + workload.osl.mean / 2
    per_decode = rate / decode
    slots = profile.decode_max_num_seqs
    offered = _running(per_decode, workload.osl.mean, lambda n: step(min(n, slots), ctx))
    running = min(offered, float(slots))
    why = ""
    if util >= 1:
        why = f"prefill saturated: {util:.0%} of {prefill} × {vp:,.0f} tokens/s"
    elif offered >= slots:
        why = f"decode saturated: {offered:.0f} streams wanted per engine, max_num_seqs {slots}"
    if why:
        inf = [math.inf]
        return _finish("pd", prefill, decode, rate, inf, inf, slo, util, running, why)
    wait_p = _wait_sampler(rng, prefill, rate, uncached / vp, workload.isl.scv)
    d_service = workload.osl.mean * step(running, ctx)
    wait_d = _wait_sampler(rng, slots, per_decode, d_service, workload.osl.scv)
    isl, osl = workload.isl.sampler(rng), workload.osl.sampler(rng)
    ttfts, tpots = [], []
    for _ in range(SAMPLES):
        n_in, n_out = isl(), osl()
        meet = min(max(1, _poisson(rng, running)), slots)
        ttfts.append(wait_p() + prefill_s(profile, n_in * keep) + kv_s(profile, n_in) + wait_d() + step(meet, n_in))
        tpots.append(step(meet, n_in + n_out / 2))
    return _finish("pd", prefill, decode, rate, ttfts, tpots, slo, util, running, "")


def predict_colocated(
    profile: DeploymentProfile, workload: Workload, slo: Slo, rate: float, engines: int, seed: int = 0
) -> Prediction:
    """``engines`` engines that each prefill and decode (no chunked prefill), at ``rate`` requests/s."""
    if engines < 1 or rate <= 0:
        raise AdviceError("a colocated prediction needs >= 1 engine and a rate > 0")
    rng = random.Random(seed)
    step = decode_curve(profile)
    vp = prefill_tokens_per_s(profile)
    keep = 1.0 - workload.hit_rate
    uncached = workload.isl.mean * keep
    per_engine = rate / engines
    util = per_engine * uncached / vp
    slots = profile.decode_max_num_seqs
    ctx = workload.isl.mean + workload.osl.mean / 2
    why = ""
    offered = math.inf
    if util < 1:
        offered = _running(per_engine, workload.osl.mean, lambda n: step(min(n, slots), ctx), stall=util)
    running = min(offered, float(slots))
    if util >= 1:
        why = f"prefill saturated: {util:.0%} of each engine's {vp:,.0f} tokens/s"
    elif offered >= slots:
        why = f"decode saturated: {offered:.0f} streams wanted per engine, max_num_seqs {slots}"
    if why:
        inf = [math.inf]
        return _finish("colocated", 0, engines, rate, inf, inf, slo, util, running, why)
    tpot_mean = step(running, ctx) / (1 - util)
    wait_p = _wait_sampler(rng, engines, rate, uncached / vp, workload.isl.scv)
    wait_d = _wait_sampler(rng, slots, per_engine, workload.osl.mean * tpot_mean, workload.osl.scv)
    isl, osl = workload.isl.sampler(rng), workload.osl.sampler(rng)
    ttfts, tpots = [], []
    for _ in range(SAMPLES):
        n_in, n_out = isl(), osl()
        meet = min(max(1, _poisson(rng, running)), slots)
        base = step(meet, n_in + n_out / 2)
        ttfts.append(wait_p() + prefill_s(profile, n_in * keep) + wait_d() + base)
        others = _poisson(rng, per_engine * n_out * tpot_mean)
        stall = sum(prefill_s(profile, isl() * keep) for _ in range(min(others, 10_000)))
        tpots.append(base + stall / max(n_out - 1, 1))
    return _finish("colocated", 0, engines, rate, ttfts, tpots, slo, util, running, "")


def predict(
    profile: DeploymentProfile, workload: Workload, slo: Slo, rate: float, mode: Mode, prefill: int, decode: int
) -> Prediction:
    """:func:`predict_pd` or :func:`predict_colocated` (``decode`` = the engines) by ``mode``."""
    if mode == "pd":
        return predict_pd(profile, workload, slo, rate, prefill, decode)
    return predict_colocated(profile, workload, slo, rate, decode)


def max_rate(profile: DeploymentProfile, workload: Workload, slo: Slo, mode: Mode, prefill: int, decode: int) -> float:
    """The highest rate (requests/s, within 1 %) at which the configuration still meets the SLO (0 if none)."""
    vp = prefill_tokens_per_s(profile)
    engines_for_prefill = prefill if mode == "pd" else decode
    hi = engines_for_prefill * vp / max(workload.isl.mean * (1 - workload.hit_rate), 1.0)
    lo = 0.0
    probe = hi / 1000
    if not predict(profile, workload, slo, probe, mode, prefill, decode).meets:
        return 0.0
    lo = probe
    while hi - lo > 0.01 * lo:
        mid = (lo + hi) / 2
        if predict(profile, workload, slo, mid, mode, prefill, decode).meets:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True, slots=True)
class Advice:
    """The verdict, the chosen configuration's prediction, the best of each shape, capacity and headroom."""

    verdict: Mode
    chosen: Prediction
    pd: Prediction | None
    colocated: Prediction | None
    capacity_rate: float  # the chosen configuration's max rate at the SLO
    headroom: float  # capacity_rate / target rate - 1
    gpus_per_engine: int
    notes: tuple[str, ...] = field(default=())

    @property
    def gpus(self) -> int:
        return self.chosen.engines * self.gpus_per_engine

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "prefill": self.chosen.prefill,
            "decode": self.chosen.decode,
            "gpus": self.gpus,
            "capacity_rate": round(self.capacity_rate, 4),
            "headroom": round(self.headroom, 4),
            "predicted": self.chosen.as_dict(),
            "pd": None if self.pd is None else self.pd.as_dict(),
            "colocated": None if self.colocated is None else self.colocated.as_dict(),
            "notes": list(self.notes),
        }


def _best_pd_at(profile: DeploymentProfile, workload: Workload, slo: Slo, rate: float, limit: int) -> Prediction:
    last: Prediction | None = None
    for total in range(2, limit + 1):
        options = [predict_pd(profile, workload, slo, rate, x, total - x) for x in range(1, total)]
        good = [p for p in options if p.meets]
        if good:
            return max(good, key=lambda p: (p.attainment, -p.ttft_p90_s))
        last = max(options, key=lambda p: p.attainment)
    assert last is not None
    return last


def _best_colocated_at(profile: DeploymentProfile, workload: Workload, slo: Slo, rate: float, limit: int) -> Prediction:
    pred = predict_colocated(profile, workload, slo, rate, 1)
    for c in range(1, limit + 1):
        pred = predict_colocated(profile, workload, slo, rate, c)
        if pred.meets:
            return pred
    return pred


def size_for_rate(
    profile: DeploymentProfile, workload: Workload, slo: Slo, rate: float, max_engines: int = 64
) -> Advice:
    """The fewest engines meeting ``slo`` at ``rate`` as PD (x prefill + y decode) and colocated; the verdict."""
    if rate <= 0:
        raise AdviceError(f"--rate {rate:g}: must be > 0")
    pd = _best_pd_at(profile, workload, slo, rate, max_engines)
    co = _best_colocated_at(profile, workload, slo, rate, max_engines)
    notes: list[str] = []
    if not pd.meets and not co.meets:
        notes.append(f"no configuration of up to {max_engines} engines meets the SLO: {pd.reason}")
        chosen = pd if pd.attainment > co.attainment else co
    elif co.meets and (not pd.meets or co.engines <= pd.engines):
        chosen = co
        if pd.meets:
            notes.append(f"PD needs {pd.engines} engines ({pd.prefill}P{pd.decode}D) for the same SLO")
    else:
        chosen = pd
        if co.meets:
            notes.append(f"colocated needs {co.engines} engines")
    cap = max_rate(profile, workload, slo, chosen.mode, chosen.prefill, chosen.decode)
    return Advice(chosen.mode, chosen, pd, co, cap, cap / rate - 1, profile.gpus_per_engine, tuple(notes))


def size_for_engines(profile: DeploymentProfile, workload: Workload, slo: Slo, engines: int) -> Advice:
    """The rate ``engines`` engines sustain at ``slo``: the best PD split and colocated; the verdict at that rate."""
    if engines < 1:
        raise AdviceError(f"--engines {engines}: must be >= 1")
    co_rate = max_rate(profile, workload, slo, "colocated", 0, engines)
    best_pd: tuple[float, int] = (0.0, 0)
    for x in range(1, engines):
        r = max_rate(profile, workload, slo, "pd", x, engines - x)
        if r > best_pd[0]:
            best_pd = (r, x)
    notes: list[str] = []
    pd = None
    if best_pd[1]:
        pd = predict_pd(profile, workload, slo, best_pd[0], best_pd[1], engines - best_pd[1])
    co = predict_colocated(profile, workload, slo, co_rate, engines) if co_rate > 0 else None
    if engines < 2:
        notes.append("PD needs at least 2 engines")
    if pd is not None and best_pd[0] > co_rate * 1.02:
        chosen, cap = pd, best_pd[0]
        notes.append(f"colocated sustains {co_rate:.3g} requests/s")
    elif co is not None:
        chosen, cap = co, co_rate
        if pd is not None:
            notes.append(f"PD ({pd.prefill}P{pd.decode}D) sustains {best_pd[0]:.3g} requests/s")
    else:
        chosen, cap = predict_colocated(profile, workload, slo, 1e-3, engines), 0.0
        notes.append("no rate meets the SLO with this many engines")
    return Advice(chosen.mode, chosen, pd, co, cap, 0.0, profile.gpus_per_engine, tuple(notes))


@dataclass(frozen=True, slots=True)
class AutoscalePlan:
    """Per-role scaling for ``pdctl render k8s --autoscale`` (docs/multi-node.md, "Autoscaling").

    Prefill scales on seconds of queued prefill work, ``in-flight prefill legs × tokens_per_request / v_p``, at
    ``threshold_s`` per replica: the TTFT SLO less what one request's own prefill, KV hand-off and first decode
    step take. Decode scales on the streams it runs, at ``streams_per_replica``: the most streams whose step
    still leaves 20 % of the TPOT SLO and 20 % of ``max_num_seqs`` free (not on KV usage, which reads full while a
    decode only waits on KV hand-offs)."""

    prefill_min: int
    prefill_max: int
    decode_min: int
    decode_max: int
    tokens_per_request: float
    v_p: float
    threshold_s: float
    streams_per_replica: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefill": {"min": self.prefill_min, "max": self.prefill_max, "threshold_s": round(self.threshold_s, 4),
                        "tokens_per_request": round(self.tokens_per_request, 1), "v_p": round(self.v_p, 1)},
            "decode": {"min": self.decode_min, "max": self.decode_max,
                       "streams_per_replica": round(self.streams_per_replica, 1)},
        }  # fmt: skip


def best_pd(profile: DeploymentProfile, workload: Workload, slo: Slo, rate: float, limit: int = 64) -> Prediction:
    """The fewest P/D engines meeting ``slo`` at ``rate`` (the most attaining split at that count)."""
    return _best_pd_at(profile, workload, slo, rate, limit)


def autoscale_plan(
    profile: DeploymentProfile, workload: Workload, slo: Slo, low: Prediction, high: Prediction
) -> AutoscalePlan:
    """Thresholds from the profile and the SLO; min replicas from ``low`` (the P/D split at the usual rate), max
    from ``high`` (at the peak rate), never below min."""
    uncached = workload.isl.mean * (1 - workload.hit_rate)
    step = decode_curve(profile)
    ctx = workload.isl.mean + workload.osl.mean / 2
    own = prefill_s(profile, uncached) + kv_s(profile, workload.isl.mean) + step(1, workload.isl.mean)
    threshold = max(slo.ttft_s - own, 0.1 * slo.ttft_s)
    cap = 0.8 * profile.decode_max_num_seqs
    streams = 1.0
    while streams + 1 <= cap and step(streams + 1, ctx) <= 0.8 * slo.tpot_s:
        streams += 1
    return AutoscalePlan(
        low.prefill, max(low.prefill, high.prefill), low.decode, max(low.decode, high.decode),
        uncached, prefill_tokens_per_s(profile), threshold, streams,
    )  # fmt: skip
