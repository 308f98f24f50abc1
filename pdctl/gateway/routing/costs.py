"""The autopilot's cost model: per engine, what a request costs there, learned online from what the gateway sees.

A pure model (no I/O, no clock of its own: every call takes ``now``), so ``pdctl advise`` and benchmarks can feed
it recorded observations and ask it the same questions the gateway does.

**What it learns, per engine** (an engine is a name plus its *epoch*: an engine that comes back after being down
starts again from the seeds, :meth:`CostModel.observe_epoch`)::

    prefill_s_per_token   seconds per prompt token it computes       leg 1: leg seconds / (tokens ahead + own)
                                                                       local / whole request: (TTFT - one step) / tokens
    step_s(streams)       one decode step with n streams running     a + b·n, least squares over the last
                                                                       :data:`WINDOW` streams' TPOT at their n
    kv_s_per_token        KV transfer into this decode, per token     P→D: (TTFT - queue - leg 1 - one step) / prompt
    busy                  share of the last :data:`BUSY_WINDOW_S`     every prefill it computed (leg 1s, local and
                          seconds it spent prefilling                  whole requests), from the same observations

and, for the whole deployment, the mean stream length in output tokens (``output_tokens``). Each scalar is an
EWMA with its mean absolute deviation (:class:`pdctl.gateway.admission.Ewma`; ``p90`` adds 1.28 deviations);
the first observation replaces the seed, so the model follows a change of load within a few requests.

**What it predicts** (:meth:`CostModel.predict`, one :class:`Path` in, one :class:`Prediction` out)::

    TTFT        = queue_wait + (tokens ahead + uncached) · prefill_s_per_token[prefill engine]
                  + kv_tokens · kv_s_per_token[decode engine] + step_s[decode engine](streams + 1)
    own TPOT    = step_s[decode engine](streams + 1) / (1 - busy[decode engine])
    others TPOT = (step_s(streams + 1) + stall / output_tokens) / (1 - busy)      with streams already running
                  stall = the prefill this path computes on the decode engine itself (0 when another engine does);
                  on a P→D path, the same for the streams of whole requests on the prefill engine (the worse)

A stream's TPOT is a mean over its output: a prefill on its engine adds its whole duration to one gap, that is
``stall / output_tokens`` to the mean; prefills that keep arriving on an engine (``busy``) stretch every step.

**Seeds** (:class:`Seed`): used until an engine's first observation of each kind (a caller that knows the hardware,
say from a simulator profile, passes its own). The defaults are a small GPU's; the first requests replace them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdctl.gateway.admission import Ewma

__all__ = ["BUSY_WINDOW_S", "WINDOW", "CostModel", "EngineCosts", "Path", "Prediction", "Seed"]

#: Stream samples the step-time regression keeps per engine: a few seconds of traffic under load.
WINDOW = 32
#: Seconds over which an engine's prefill busy share is measured.
BUSY_WINDOW_S = 5.0
#: The busy share is capped: an engine busy all the time still makes progress on its streams.
_MAX_BUSY = 0.9
_ALPHA = 0.3


@dataclass(frozen=True, slots=True)
class Seed:
    """Costs assumed before an engine has been observed."""

    prefill_s_per_token: float = 2e-4
    step_s: float = 0.01
    step_s_per_stream: float = 2e-4
    kv_s_per_token: float = 1e-5
    output_tokens: float = 128.0


@dataclass(slots=True)
class EngineCosts:
    """One engine's learned costs (since its last restart)."""

    epoch: int
    prefill: Ewma = field(default_factory=lambda: Ewma(_ALPHA))
    kv: Ewma = field(default_factory=lambda: Ewma(_ALPHA))
    steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    prefills: deque[tuple[float, float]] = field(default_factory=deque)
    """``(end, seconds)`` of each prefill it computed in the last :data:`BUSY_WINDOW_S`."""


@dataclass(frozen=True, slots=True)
class Path:
    """One way to serve a request, as the model needs it.

    ``prefill``/``decode``: the engines that compute the prompt and the output (the same one for a whole request);
    ``ahead``: prompt tokens queued before this one on ``prefill``; ``uncached``: prompt tokens ``prefill`` must
    compute; ``kv_tokens``: tokens moved into ``decode`` (0 on one engine); ``streams``: streams running on
    ``decode``; ``queue_wait_s``: seconds in the gateway's prefill queue; ``prefill_streams``: streams running on
    ``prefill`` when it is another engine (whole requests there, which its prefill stalls)."""

    kind: str
    prefill: str
    decode: str
    ahead: int
    uncached: int
    kv_tokens: int
    streams: int
    queue_wait_s: float = 0.0
    prefill_streams: int = 0


@dataclass(frozen=True, slots=True)
class Prediction:
    """A path's predicted TTFT, its own TPOT, and the TPOT of the streams already running on its decode engine
    (None: no stream there)."""

    ttft_s: float
    tpot_s: float
    others_tpot_s: float | None

    def worst(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """The largest share of an SLO this path uses (<= 1: it meets both, for itself and the others)."""
        others = self.others_tpot_s / tpot_slo_s if self.others_tpot_s is not None else 0.0
        return max(self.ttft_s / ttft_slo_s, self.tpot_s / tpot_slo_s, others)

    def breaks_others(self, tpot_slo_s: float) -> bool:
        """Whether the streams already running would miss the TPOT SLO."""
        return self.others_tpot_s is not None and self.others_tpot_s > tpot_slo_s


class CostModel:
    """Per-engine learned costs: ``observe_*`` to learn, :meth:`predict` to ask; ``p90``: predict the p90."""

    def __init__(self, seed: Seed | None = None, p90: bool = False) -> None:
        self.seed = seed or Seed()
        self.p90 = p90
        self.engines: dict[str, EngineCosts] = {}
        self.output = Ewma(_ALPHA)

    # ------------------------------------------------------------------------------------------ observation

    def observe_epoch(self, engine: str, epoch: int) -> EngineCosts:
        """``engine``'s costs at ``epoch``; a new epoch (the engine restarted) starts again from the seeds."""
        held = self.engines.get(engine)
        if held is None or held.epoch != epoch:
            held = self.engines[engine] = EngineCosts(epoch)
        return held

    def reset(self, engine: str) -> None:
        """Forget what was learned of ``engine``."""
        self.engines.pop(engine, None)

    def observe_prefill(self, engine: str, epoch: int, seconds: float, tokens: int, now: float) -> None:
        """``engine`` computed ``tokens`` prompt tokens (its own and those queued ahead) in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        costs = self.observe_epoch(engine, epoch)
        costs.prefill.add(seconds / tokens)
        costs.prefills.append((now, seconds))

    def observe_stream(self, engine: str, epoch: int, tpot_s: float, streams: int, now: float) -> None:
        """A stream on ``engine`` had a mean TPOT of ``tpot_s`` with ``streams`` streams running (itself included).
        The prefill share of the time (:meth:`busy`) is taken out: it is predicted on its own."""
        if tpot_s <= 0:
            return
        costs = self.observe_epoch(engine, epoch)
        costs.steps.append((max(1, streams), tpot_s * (1.0 - self._busy(costs, now))))

    def observe_kv(self, engine: str, epoch: int, seconds: float, tokens: int) -> None:
        """``tokens`` of KV reached ``engine`` in ``seconds``."""
        if tokens > 0 and seconds >= 0:
            self.observe_epoch(engine, epoch).kv.add(seconds / tokens)

    def observe_output(self, tokens: int) -> None:
        """A stream ended after ``tokens`` output tokens."""
        if tokens > 0:
            self.output.add(float(tokens))

    # ----------------------------------------------------------------------------------------- the costs

    def prefill_s_per_token(self, engine: str) -> float:
        """Seconds per prompt token ``engine`` computes."""
        costs = self.engines.get(engine)
        v = costs.prefill.value(self.p90) if costs is not None else None
        return v if v is not None else self.seed.prefill_s_per_token

    def kv_s_per_token(self, engine: str) -> float:
        """Seconds per KV token moved into ``engine``."""
        costs = self.engines.get(engine)
        v = costs.kv.value(self.p90) if costs is not None else None
        return v if v is not None else self.seed.kv_s_per_token

    def step_s(self, engine: str, streams: int) -> float:
        """One decode step on ``engine`` with ``streams`` streams running: ``a + b·streams`` fitted by least squares
        (slope >= 0) over the recent samples; the seed's slope through their mean when they are all at one level."""
        costs = self.engines.get(engine)
        pts = list(costs.steps) if costs is not None else []
        s = self.seed
        if not pts:
            return s.step_s + s.step_s_per_stream * streams
        n = len(pts)
        mx = sum(c for c, _ in pts) / n
        my = sum(v for _, v in pts) / n
        sxx = sum((c - mx) ** 2 for c, _ in pts)
        slope = max(0.0, sum((c - mx) * (v - my) for c, v in pts) / sxx) if sxx else s.step_s_per_stream
        value = my + slope * (streams - mx)
        if self.p90:
            value += 1.28 * sum(abs(v - (my + slope * (c - mx))) for c, v in pts) / n
        return max(min(v for _, v in pts) * 0.5, value)

    def busy(self, engine: str, now: float) -> float:
        """The share of the last :data:`BUSY_WINDOW_S` seconds ``engine`` spent prefilling (at most 0.9)."""
        costs = self.engines.get(engine)
        return self._busy(costs, now) if costs is not None else 0.0

    def _busy(self, costs: EngineCosts, now: float) -> float:
        q = costs.prefills
        while q and q[0][0] < now - BUSY_WINDOW_S:
            q.popleft()
        return min(_MAX_BUSY, sum(s for _, s in q) / BUSY_WINDOW_S)

    def output_tokens(self) -> float:
        """The mean stream length, in output tokens."""
        return self.output.mean if self.output.mean is not None else self.seed.output_tokens

    # -------------------------------------------------------------------------------------------- predict

    def predict(self, path: Path, now: float) -> Prediction:
        """``path``'s TTFT, own TPOT and the running streams' TPOT (module docstring)."""
        prefill_s = (path.ahead + path.uncached) * self.prefill_s_per_token(path.prefill)
        step = self.step_s(path.decode, path.streams + 1)
        ttft = path.queue_wait_s + prefill_s + path.kv_tokens * self.kv_s_per_token(path.decode) + step
        slow = 1.0 / (1.0 - self.busy(path.decode, now))
        others = None
        if path.streams > 0:
            stall = path.uncached * self.prefill_s_per_token(path.decode) if path.prefill == path.decode else 0.0
            others = (step + stall / max(1.0, self.output_tokens())) * slow
        if path.prefill != path.decode and path.prefill_streams > 0:
            p = path.prefill
            stall = path.uncached * self.prefill_s_per_token(p)
            there = self.step_s(p, path.prefill_streams) + stall / max(1.0, self.output_tokens())
            there /= 1.0 - self.busy(p, now)
            others = max(others or 0.0, there)
        return Prediction(ttft, step * slow, others)
