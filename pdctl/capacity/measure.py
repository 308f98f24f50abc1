"""Measure a :class:`~pdctl.capacity.profile.DeploymentProfile` by sending probes through the real P/D path.

* :func:`measure` runs the probe schedule against any :data:`Send` (an async function that serves one request
  and reports its TTFT, its prefill leg and its inter-token times) and fits the profile;
* :func:`http_sender` is the :data:`Send` of a running gateway (``pdctl profile``): streamed completions with
  ``ignore_eos``, the prefill leg read from the gateway's ``x-pd-prefill-ms`` header;
* :func:`served_traffic` reads, before the probes, what the deployment's traffic so far did: the prefill engines'
  prefix-cache hit rate (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``) and the share of
  P/D requests the gateway served on decode alone (``pdctl_requests_total``, paths ``local`` and ``disagg``).

The schedule (:class:`Schedule`): each prompt length ``repeats`` times, one at a time, a few output tokens (prefill
and KV points); then for each decode context, ``n`` concurrent streams for each ``n`` in ``running``, each long
enough to outlast the prefill of all ``n`` prompts (up to ``max_output_len``). A decode point is the most streams
seen running at once and the median of the token gaps (after each stream's first ``skip_itl``) while that many ran:
the count actually observed, not the count sent. Every prompt starts with a fresh random tag, so no probe hits the
prefix cache.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import math
import random
import secrets
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdctl.bench.client import BenchClient
from pdctl.bench.workload import BenchRequest, random_words
from pdctl.capacity.profile import DecodePoint, DeploymentProfile, KVPoint, PrefillPoint, fit_decode, fit_line
from pdctl.errors import PdctlError
from pdctl.vllm.promtext import metric_value, samples

__all__ = [
    "MeasureError",
    "ProbeResult",
    "Schedule",
    "Send",
    "ServedTraffic",
    "http_sender",
    "measure",
    "served_traffic",
]


class MeasureError(PdctlError):
    """A probe failed, or the target is not a P/D deployment."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One served probe: seconds from send, the prefill leg (None if not disaggregated), the token gaps."""

    ttft_s: float
    prefill_s: float | None
    itl_s: tuple[float, ...]
    prompt_tokens: int
    sent_s: float = 0.0  # on the sender's own clock: lines concurrent probes up

    def token_times(self) -> list[float]:
        """Each token's time on the sender's clock."""
        out = [self.sent_s + self.ttft_s]
        for gap in self.itl_s:
            out.append(out[-1] + gap)
        return out


Send = Callable[[int, int], Awaitable[ProbeResult]]
"""``send(prompt_tokens, max_tokens)``: serve one request through the deployment."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """What to probe (defaults: about 40 requests)."""

    prompt_lens: tuple[int, ...] = (128, 512, 1024, 2048)
    repeats: int = 3
    running: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (128, 1024)
    output_len: int = 32
    skip_itl: int = 2
    max_output_len: int = 2048

    def __post_init__(self) -> None:
        if not self.prompt_lens or min(self.prompt_lens) < 1 or not self.running or min(self.running) < 1:
            raise MeasureError("profile: prompt lengths and running counts must be positive and not empty")
        if not self.contexts or min(self.contexts) < 1 or self.repeats < 1 or self.output_len <= self.skip_itl + 1:
            raise MeasureError("profile: contexts >= 1, repeats >= 1 and output_len > skip_itl + 1 are needed")


async def measure(
    send: Send,
    schedule: Schedule,
    *,
    source: str,
    model: str,
    prefill_max_batched_tokens: int = 8192,
    decode_max_num_seqs: int = 256,
) -> DeploymentProfile:
    """Run ``schedule`` through ``send`` and fit the profile (raises :class:`MeasureError` on a non-PD target)."""
    prefill_points: list[PrefillPoint] = []
    for n in schedule.prompt_lens:
        results = [await send(n, 1) for _ in range(schedule.repeats)]
        legs = [r.prefill_s for r in results]
        if any(leg is None for leg in legs):
            raise MeasureError(
                "the target served a probe without a prefill leg (no x-pd-prefill-ms)",
                hint="profile a P/D gateway (routing.strategy = pd_disagg, pd_mode = always)",
            )
        tokens = int(statistics.median(r.prompt_tokens for r in results))
        prefill_points.append(
            PrefillPoint(tokens, statistics.median(leg for leg in legs if leg is not None),
                         statistics.median(r.ttft_s for r in results))
        )  # fmt: skip
    decode_points: list[DecodePoint] = []
    for ctx in schedule.contexts:
        step1 = 0.0
        for n in schedule.running:
            # The n streams only run together once the prefill has served all n prompts: make them long enough
            # to outlast that (from the prefill time just measured and the 1-stream step).
            leg = min(
                (p.prefill_s for p in prefill_points if p.prompt_tokens >= ctx), default=prefill_points[-1].prefill_s
            )
            need = math.ceil(1.5 * n * leg / step1) + schedule.skip_itl + 2 if step1 > 0 else 0
            out_len = min(max(schedule.output_len, need), schedule.max_output_len)
            results = await asyncio.gather(*(send(ctx, out_len) for _ in range(n)))
            running, step = _together(results, schedule.skip_itl)
            if step is None:
                raise MeasureError(f"decode probe at {n} streams returned no inter-token times")
            context = int(statistics.median(r.prompt_tokens for r in results)) + out_len // 2
            decode_points.append(DecodePoint(running, context, step))
            if n == min(schedule.running):
                step1 = step
    pf_fixed, pf_slope = fit_line([p.prompt_tokens for p in prefill_points], [p.prefill_s for p in prefill_points])
    # One decode step (the cheapest one probed) is part of every TTFT; the rest after the leg is the hand-off.
    one_step = min(p.step_s for p in decode_points)
    kv_points = [KVPoint(p.prompt_tokens, max(0.0, p.ttft_s - p.prefill_s - one_step)) for p in prefill_points]
    kv_fixed, kv_slope = fit_line([p.tokens for p in kv_points], [p.transfer_s for p in kv_points])
    d_fixed, d_seq, d_kv = fit_decode(decode_points)
    return DeploymentProfile(
        source=source,
        model=model,
        measured_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        prefill=prefill_points,
        decode=decode_points,
        kv=kv_points,
        prefill_fixed_s=pf_fixed,
        prefill_s_per_token=max(pf_slope, 1e-12),
        kv_fixed_s=kv_fixed,
        kv_s_per_token=max(kv_slope, 0.0),
        decode_fixed_s=d_fixed,
        decode_per_seq_s=d_seq,
        decode_per_kv_token_s=d_kv,
        prefill_max_batched_tokens=prefill_max_batched_tokens,
        decode_max_num_seqs=decode_max_num_seqs,
    )


def _together(results: list[ProbeResult], skip: int) -> tuple[int, float | None]:
    """The most streams seen running at once and the median token gap while that many ran."""
    spans = []
    gaps: list[tuple[float, float]] = []  # (midpoint, gap)
    for r in results:
        times = r.token_times()
        spans.append((times[0], times[-1]))
        gaps.extend(((a + b) / 2, b - a) for a, b in itertools.pairwise(times[skip:]))
    if not gaps:
        return len(results), None
    counted = [(sum(1 for lo, hi in spans if lo <= mid <= hi), gap) for mid, gap in gaps]
    most = max(c for c, _ in counted)
    return most, statistics.median(g for c, g in counted if c == most)


def http_sender(client: BenchClient, seed: int = 0) -> Send:
    """A :data:`Send` over a gateway: each prompt a fresh tag plus random words, as many as the server's tokenizer
    turns into about the asked number of tokens (learnt from two short requests' usage)."""
    rng = random.Random(seed)
    counter = [0]
    fit: list[float] = []

    async def once(words: int, max_tokens: int, prompt_tokens: int) -> ProbeResult:
        counter[0] += 1
        text = f"probe {secrets.token_hex(4)} {random_words(rng, words)}"
        # At least 4 tokens: a token can decode to no text (a partial UTF-8 sequence; common with the tiny random
        # models), and TTFT is the first chunk with text.
        req = BenchRequest(counter[0], text, max(max_tokens, 4), prompt_tokens, "random", ignore_eos=True)
        res = await client.send(req, t0=0.0)
        if not res.success:
            raise MeasureError(f"probe of {prompt_tokens} tokens failed: {res.error or res.status}")
        leg = None if res.pd_prefill_ms is None else res.pd_prefill_ms / 1000.0
        return ProbeResult(res.ttft_s, leg, tuple(res.itl_s), res.prompt_tokens or prompt_tokens, res.sent_s)

    async def send(prompt_tokens: int, max_tokens: int) -> ProbeResult:
        if not fit:
            # Tokens per word and the tag's tokens, from two short requests (the server's own usage counts).
            a, b = await once(16, 1, 16), await once(80, 1, 80)
            per_word = max((b.prompt_tokens - a.prompt_tokens) / 64, 0.05)
            fit.extend((per_word, max(a.prompt_tokens - 16 * per_word, 0.0)))
        per_word, overhead = fit
        return await once(max(1, round((prompt_tokens - overhead) / per_word)), max_tokens, prompt_tokens)

    return send


@dataclass(frozen=True, slots=True)
class ServedTraffic:
    """What the traffic before the probes did: the prefill engines' prefix-cache hit rate and the share of P/D
    requests served locally (adaptive PD); None where nothing was counted."""

    prefix_cache_hit_rate: float | None
    local_share: float | None


def served_traffic(prefill_metrics: list[str], gateway_metrics: str | None) -> ServedTraffic:
    """From the prefill workers' and the gateway's ``/metrics`` bodies (the ones that could be read)."""
    hits = queries = 0.0
    for text in prefill_metrics:
        parsed = samples(text, ("vllm:prefix_cache_",))
        hits += metric_value(parsed, "vllm:prefix_cache_hits_total") or 0.0
        queries += metric_value(parsed, "vllm:prefix_cache_queries_total") or 0.0
    local_share = None
    if gateway_metrics is not None:
        parsed = samples(gateway_metrics, ("pdctl_requests_total",))
        local = metric_value(parsed, "pdctl_requests_total", path="local") or 0.0
        disagg = metric_value(parsed, "pdctl_requests_total", path="disagg") or 0.0
        local_share = local / (local + disagg) if local + disagg > 0 else None
    return ServedTraffic(min(hits / queries, 0.99) if queries > 0 else None, local_share)
