"""The gateway's sizing advice for the traffic it just served: pure functions the gateway's advisor calls.

Map:

* :func:`histogram_from_buckets`: a Prometheus histogram's bucket counts over a window -> a :class:`Histogram`
  whose mean is the window's exact mean (the ``_sum`` over the ``_count``), its shape the buckets';
* :func:`advise_counts`: a profile, the window's workload and rate, the SLO and the prefill / decode counts that
  served it -> an :class:`Advisory`: the fewest P/D engines that meet the SLO (:func:`pdctl.capacity.model.best_pd`),
  the prediction at the current counts, and a :data:`Status` with its reason in words.

The model is ``pdctl advise``'s (:mod:`pdctl.capacity.model`), so the gateway's advice and ``pdctl advise`` on a
bench file of the same traffic agree; it shares the model's blind spots (docs/multi-node.md, "Sizing").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pdctl.capacity.model import AdviceError, Histogram, Prediction, Slo, Workload, best_pd, predict_pd
from pdctl.capacity.profile import DeploymentProfile

__all__ = ["MIN_REQUESTS", "STATUSES", "Advisory", "Status", "advise_counts", "histogram_from_buckets"]

#: Fewer finished requests than this in a window give no advice (status ``idle``): a rate from a handful of
#: requests says little.
MIN_REQUESTS = 20

Status = Literal["ok", "over", "under_prefill", "under_decode", "under_both", "unreachable", "idle"]
STATUSES: tuple[Status, ...] = ("ok", "over", "under_prefill", "under_decode", "under_both", "unreachable", "idle")


@dataclass(frozen=True, slots=True)
class Advisory:
    """What the gateway recommends for one window: counts, the predictions either side, and why."""

    status: Status
    rate: float
    current_prefill: int
    current_decode: int
    current: Prediction | None  # None: idle, or a role with no instance
    recommended: Prediction | None  # None: idle
    reason: str

    @property
    def recommended_prefill(self) -> int:
        return self.recommended.prefill if self.recommended is not None else self.current_prefill

    @property
    def recommended_decode(self) -> int:
        return self.recommended.decode if self.recommended is not None else self.current_decode


def histogram_from_buckets(cumulative: Mapping[float, float], total: float) -> Histogram | None:
    """``cumulative``: upper bound (``inf`` included) -> observations at or below it, over a window; ``total``:
    the window's sum of the observed values. Each bucket stands at the geometric middle of its bounds (the first at
    half its upper bound, the ``+Inf`` one at 1.5× the last finite bound), then every value is scaled so that the
    mean is ``total`` / count. None when the window holds no observation."""
    bounds = sorted(cumulative)
    bins: list[tuple[float, float]] = []
    below, lower = 0.0, 0.0
    for upper in bounds:
        count = cumulative[upper] - below
        below = cumulative[upper]
        if count > 0:
            if math.isinf(upper):
                value = lower * 1.5 if lower > 0 else 1.0
            elif lower > 0:
                value = math.sqrt(lower * upper)
            else:
                value = upper / 2
            bins.append((value, count))
        if not math.isinf(upper):
            lower = upper
    n = sum(w for _, w in bins)
    if n <= 0:
        return None
    mean = sum(v * w for v, w in bins) / n
    scale = (total / n) / mean if mean > 0 and total > 0 else 1.0
    return Histogram(tuple((v * scale, w) for v, w in bins))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if math.isfinite(seconds) else "unbounded"


def advise_counts(
    profile: DeploymentProfile, workload: Workload | None, slo: Slo, rate: float, requests: float, prefill: int,
    decode: int, limit: int = 64,
) -> Advisory:  # fmt: skip
    """The advice for a window in which ``requests`` finished at ``rate`` requests/s on ``prefill`` + ``decode``
    serving instances (see the module docstring for the statuses); ``workload`` None: nothing measured."""
    if workload is None or requests < MIN_REQUESTS or rate <= 0:
        why = f"{requests:.0f} requests in the window (advice needs {MIN_REQUESTS})"
        return Advisory("idle", rate, prefill, decode, None, None, why)
    current = predict_pd(profile, workload, slo, rate, prefill, decode) if prefill and decode else None
    try:
        best = best_pd(profile, workload, slo, rate, limit)
    except AdviceError as exc:
        return Advisory("unreachable", rate, prefill, decode, current, None, str(exc))
    at = f"{rate:.3g} req/s"
    if not best.meets:
        return Advisory("unreachable", rate, prefill, decode, current, best,
                        f"no split of up to {limit} engines meets the SLO at {at}: {best.reason}")  # fmt: skip
    here = f"{prefill}P{decode}D"
    there = f"{best.prefill}P{best.decode}D"
    if current is not None and current.meets:
        if best.engines < current.engines:
            return Advisory("over", rate, prefill, decode, current, best,
                            f"{there} also meets the SLO at {at} (TTFT p90 {_ms(best.ttft_p90_s)}, "
                            f"TPOT p90 {_ms(best.tpot_p90_s)})")  # fmt: skip
        return Advisory("ok", rate, prefill, decode, current, current,
                        f"{here} meets the SLO at {at}: TTFT p90 {_ms(current.ttft_p90_s)}, "
                        f"TPOT p90 {_ms(current.tpot_p90_s)}, attainment {current.attainment:.0%}")  # fmt: skip
    short_p, short_d = best.prefill > prefill, best.decode > decode
    if not short_p and not short_d:  # sampling noise between two near-equal splits: name the target it misses
        short_p = current is not None and current.ttft_p90_s > slo.ttft_s
        short_d = not short_p
    status: Status = "under_both" if short_p and short_d else "under_prefill" if short_p else "under_decode"
    slo_part = {"under_prefill": "the TTFT SLO", "under_decode": "the TPOT SLO", "under_both": "the SLO"}[status]
    now = "" if current is None else f" (TTFT p90 {_ms(current.ttft_p90_s)}, TPOT p90 {_ms(current.tpot_p90_s)})"
    return Advisory(status, rate, prefill, decode, current, best,
                    f"{here} misses {slo_part} at {at}{now}; {there} meets it (TTFT p90 {_ms(best.ttft_p90_s)}, "
                    f"TPOT p90 {_ms(best.tpot_p90_s)})")  # fmt: skip
