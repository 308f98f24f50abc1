"""SLO early rejection: predict this request's TTFT and TPOT from what the gateway measured.

* TTFT = (prefill tokens queued ahead on the least-loaded prefill + this prompt) x seconds per prefill token
  + handoff (decode request sent -> first decode chunk). Seconds per token is learned from finished leg 1s
  as ``leg_s / (tokens ahead at dispatch + own prompt)``, so queueing is not counted twice.
* TPOT = inter-token latency measured at decode concurrency c, fitted as ``a + b*c``, evaluated at the
  decode concurrency this request would create.

With ``slo.p90`` the estimate is the EWMA plus 1.28 mean absolute deviations (a normal p90). Before any
measurement (cold start) every request is admitted, and so is a request that finds the deployment idle
(nothing queued on prefill, no decode stream): refusing it would relieve nothing, and it keeps the
measurements fresh, so one slow request (say, NIXL's lazy first handshake) cannot lock admission shut.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdctl.config import SLOConfig

__all__ = ["Admission", "AdmissionVerdict", "Ewma"]

_P90_Z = 1.28


class Ewma:
    """Exponentially weighted mean and mean absolute deviation."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.mean: float | None = None
        self.dev = 0.0
        self.count = 0

    def add(self, x: float) -> None:
        """Add one observation."""
        self.count += 1
        if self.mean is None:
            self.mean = x
            return
        self.dev += self.alpha * (abs(x - self.mean) - self.dev)
        self.mean += self.alpha * (x - self.mean)

    def value(self, p90: bool) -> float | None:
        """The mean, or the p90 estimate."""
        if self.mean is None:
            return None
        return self.mean + (_P90_Z * self.dev if p90 else 0.0)


@dataclass(frozen=True, slots=True)
class AdmissionVerdict:
    """The predictor's verdict for one request."""

    admit: bool
    reason: str  # "cold", "idle", "ok", "ttft", "tpot", "disabled"
    ttft_s: float | None
    tpot_s: float | None
    retry_after_s: float


class Admission:
    """Learns from finished requests and predicts whether the next one meets the SLO."""

    def __init__(self, slo: SLOConfig) -> None:
        self.slo = slo
        self.sec_per_token = Ewma()
        self.handoff = Ewma()
        self._itl: dict[int, Ewma] = {}

    def observe_prefill(self, leg_s: float, prompt_tokens: int, tokens_ahead: int) -> None:
        """A leg 1 finished: it took ``leg_s`` for its prompt plus what was queued ahead of it."""
        total = prompt_tokens + tokens_ahead
        if total > 0 and leg_s > 0:
            self.sec_per_token.add(leg_s / total)

    def observe_handoff(self, seconds: float) -> None:
        """Decode request sent -> first decode chunk."""
        self.handoff.add(seconds)

    def observe_itl(self, itl_s: float, concurrency: int) -> None:
        """Mean inter-token latency of one stream that ran with ``concurrency`` decode streams."""
        self._itl.setdefault(max(1, min(concurrency, 1024)), Ewma()).add(itl_s)

    def predict_tpot(self, concurrency: int) -> float | None:
        """TPOT at ``concurrency`` decode streams (least-squares line through the measured levels)."""
        points = [(c, e.value(self.slo.p90)) for c, e in self._itl.items()]
        pts = [(float(c), v) for c, v in points if v is not None]
        if not pts:
            return None
        if len(pts) == 1:
            return pts[0][1]
        n = len(pts)
        mx = sum(c for c, _ in pts) / n
        my = sum(v for _, v in pts) / n
        sxx = sum((c - mx) ** 2 for c, _ in pts)
        slope = max(0.0, sum((c - mx) * (v - my) for c, v in pts) / sxx) if sxx else 0.0
        return max(min(v for _, v in pts), my + slope * (concurrency - mx))

    def decide(self, prompt_tokens: int, tokens_ahead: int, decode_concurrency: int) -> AdmissionVerdict:
        """Predict TTFT/TPOT for a request of ``prompt_tokens`` and compare with the SLO."""
        if not self.slo.admission:
            return AdmissionVerdict(True, "disabled", None, None, 0.0)
        if tokens_ahead == 0 and decode_concurrency == 0:
            return AdmissionVerdict(True, "idle", None, None, 0.0)
        spt = self.sec_per_token.value(self.slo.p90)
        handoff = self.handoff.value(self.slo.p90) or 0.0
        ttft = None if spt is None else (tokens_ahead + prompt_tokens) * spt + handoff
        tpot = self.predict_tpot(decode_concurrency + 1)
        if ttft is None and tpot is None:
            return AdmissionVerdict(True, "cold", None, None, 0.0)
        if ttft is not None and ttft * 1000.0 > self.slo.ttft_ms:
            drain = tokens_ahead * (spt or 0.0)
            return AdmissionVerdict(False, "ttft", ttft, tpot, max(1.0, drain))
        if tpot is not None and tpot * 1000.0 > self.slo.tpot_ms:
            return AdmissionVerdict(False, "tpot", ttft, tpot, 1.0)
        return AdmissionVerdict(True, "ok", ttft, tpot, 0.0)
