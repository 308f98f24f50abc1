"""The SLO autopilot (``routing.pd_mode = "auto"``): each request's path, chosen from ``slo.ttft_ms`` / ``tpot_ms``.

For each request :meth:`Autopilot.choose` takes the decode that ``routing.decode_policy`` chose
(:meth:`pdctl.gateway.routing.chooser.Chooser.decide`) and the prompt's cached tokens on each engine, asks the
learned cost model (:mod:`pdctl.gateway.routing.costs`) what each path would give, and takes one::

    local    the whole request on that decode (its uncached tokens prefilled there, stalling its streams)
    whole    the whole request on a prefill engine (as colocated does: no prefill leg, no KV moved)
    disagg   leg 1 on the least busy prefill (its queue, the prefill queue's share), KV to the decode, leg 2

The choice, in order:

1. *safety*: a path whose prediction breaks the TPOT SLO of streams already running (the stall of its prefill on
   them, or one stream too many) is left out, unless every path does;
2. of the paths predicted to meet both SLOs for this request and the others, the one that uses least: ``local``
   (no prefill leg, no KV moved), then ``disagg`` (the prefill engine for the prefill only), then ``whole`` (the
   prefill engine for the whole stream, which every later leg 1 there stalls: taken when the decode cannot meet
   the SLOs); ties between engines to the smallest share;
3. when none meets them, the path with the smallest share of its worst SLO (:meth:`Prediction.worst`).

A ``whole`` request is served like a ``local`` one (:func:`pdctl.gateway.pd.serve_pd` with the decision's decode
set to the prefill engine; ``x-pd-path: colocated``). After the request :meth:`Autopilot.finish` teaches the cost
model what it saw (leg 1's time, TTFT, the mean TPOT, the output length) and observes the predictor's error:
``pdctl_autopilot_ttft_ratio`` and ``pdctl_autopilot_tpot_ratio`` (observed / predicted, by path; ``pdctl top``
and the dashboard show them). Each candidate's prediction goes to the
access log, with the chosen path (:func:`log_fields`): ``auto=whole auto_local=decode-0:<ttft ms>/<tpot ms>/<others'
tpot ms> auto_whole=prefill-0:... auto_disagg=prefill-0:...``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Literal

from pdctl.config import SLOConfig
from pdctl.gateway.metrics import GatewayMetrics
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.routing.chooser import Chooser
from pdctl.gateway.routing.costs import CostModel, Path, Prediction
from pdctl.gateway.routing.plan import RoutePlan
from pdctl.gateway.routing.pool import Instance, Pool
from pdctl.gateway.routing.prefill_queue import PrefillQueue

__all__ = ["RANK", "Autopilot", "Candidate", "Choice", "Kind", "log_fields"]

Kind = Literal["local", "whole", "disagg"]
#: What each path uses, least first: the tie-break among paths that meet the SLOs. A whole request holds a prefill
#: engine for its whole stream, and every later leg 1 there stalls it; a P→D request holds it for its prefill only.
RANK: dict[Kind, int] = {"local": 0, "disagg": 1, "whole": 2}


@dataclass(frozen=True, slots=True)
class Candidate:
    """One path for one request, with its engines and prediction."""

    kind: Kind
    prefill: Instance
    decode: Instance
    path: Path
    prediction: Prediction

    def shown(self) -> str:
        """``<engine>:<ttft ms>/<tpot ms>/<others' tpot ms, or - with no stream running there>``; the engine is
        the prefill for ``disagg``."""
        p = self.prediction
        others = f"{p.others_tpot_s * 1000:.1f}" if p.others_tpot_s is not None else "-"
        return f"{self.prefill.name}:{p.ttft_s * 1000:.1f}/{p.tpot_s * 1000:.1f}/{others}"


def log_fields(best: Candidate, cands: list[Candidate]) -> str:
    """``auto=<kind> auto_local=... auto_whole=...,... auto_disagg=...``: the choice and each candidate."""
    fields = [f"auto={best.kind}"]
    for kind in ("local", "whole", "disagg"):
        shown = [c.shown() for c in cands if c.kind == kind]
        if shown:
            fields.append(f"auto_{kind}={','.join(shown)}")
    return " ".join(fields)


@dataclass(slots=True)
class Choice:
    """The autopilot's decision for one request: the plan handed to the PD flow, and what was predicted."""

    plan: RoutePlan
    chosen: Candidate
    candidates: list[Candidate] = field(default_factory=list)
    at: float = 0.0
    done: bool = False


class Autopilot:
    """The per-request path choice and the learned costs, for one gateway process."""

    def __init__(
        self, slo: SLOConfig, router: Chooser, metrics: GatewayMetrics, queue: PrefillQueue | None = None,
        model: CostModel | None = None,
    ) -> None:  # fmt: skip
        self.slo = slo
        self.router = router
        self.metrics = metrics
        self.queue = queue
        self.model = model or CostModel(p90=slo.p90)
        self._streams: dict[str, int] = {}
        """Whole requests in flight on each prefill engine (its other calls are leg 1s, not streams)."""

    def streams(self, inst: Instance) -> int:
        """Streams decoding on ``inst`` now: a decode's calls in flight; a prefill's whole requests."""
        return inst.in_flight if inst.role == "decode" else self._streams.get(inst.name, 0)

    def candidates(self, pool: Pool, plan: RoutePlan, now: float) -> list[Candidate]:
        """Every path ``plan``'s request can take now, each with its prediction."""
        prompt = plan.cached_tokens + plan.uncached_tokens
        out: list[Candidate] = []
        d = plan.decode if plan.decode is not None and plan.decode.available() else None
        prefills = [i for i in pool.by_role("prefill") if i.available()]
        queued = self.queue.waiting_tokens() // max(1, len(prefills)) if self.queue is not None else 0

        def add(kind: Kind, p: Instance, dec: Instance, ahead: int, uncached: int, kv: int) -> None:
            there = self.streams(p) if p is not dec else 0
            path = Path(kind, p.name, dec.name, ahead, uncached, kv, self.streams(dec), prefill_streams=there)
            self._epochs(p, dec)
            out.append(Candidate(kind, p, dec, path, self.model.predict(path, now)))

        if d is not None:
            add("local", d, d, 0, plan.uncached_tokens, 0)
        held = {p: prompt - self.router.cached(p, plan) for p in prefills}
        for p in prefills:
            add("whole", p, p, self.router.prefilling_tokens(p), held[p], 0)
        if d is not None and prefills:
            p = min(prefills, key=lambda i: (self.router.prefilling_tokens(i) + held[i], i.in_flight))
            add("disagg", p, d, self.router.prefilling_tokens(p) + queued, held[p], plan.uncached_tokens)
        return out

    def _epochs(self, *insts: Instance) -> None:
        for i in insts:
            self.model.observe_epoch(i.name, i.epoch)

    def choose(self, pool: Pool, plan: RoutePlan) -> Choice | None:
        """The path for ``plan``'s request (module docstring); None when no path is open (no instance available:
        the PD flow then answers as it would). The returned plan is ``local`` for ``local`` and ``whole`` (its
        decode set to the engine), and carries every candidate's prediction in its log fields."""
        now = time.monotonic()
        cands = self.candidates(pool, plan, now)
        if not cands:
            return None
        ttft, tpot = self.slo.ttft_ms / 1000.0, self.slo.tpot_ms / 1000.0
        safe = [c for c in cands if not c.prediction.breaks_others(tpot)] or cands
        meeting = [c for c in safe if c.prediction.worst(ttft, tpot) <= 1.0]
        if meeting:
            best = min(meeting, key=lambda c: (RANK[c.kind], c.prediction.worst(ttft, tpot)))
        else:
            best = min(safe, key=lambda c: (c.prediction.worst(ttft, tpot), RANK[c.kind]))
        local = best.kind != "disagg"
        chosen = dataclasses.replace(plan, local=local, decode=best.decode if local else plan.decode,
                                     reason="auto", picks=plan.picks)  # fmt: skip
        chosen.picks.append(log_fields(best, cands))
        if best.kind == "whole":
            self._streams[best.decode.name] = self._streams.get(best.decode.name, 0) + 1
        return Choice(chosen, best, cands, now)

    def finish(self, choice: Choice, ex: RequestRecord) -> None:
        """The request ended: learn from what it took, observe the predictor's error (once per choice)."""
        if choice.done:
            return
        choice.done = True
        best = choice.chosen
        if best.kind == "whole":
            self._streams[best.decode.name] = max(0, self._streams.get(best.decode.name, 0) - 1)
        m = self.model
        now = time.monotonic()
        path = ex.path
        taken: Kind | None = {"local": "local", "colocated": "whole", "disagg": "disagg"}.get(path)  # type: ignore[assignment]
        if taken is None or (taken == "disagg") != (best.kind == "disagg"):
            return  # it ended elsewhere (a failed local attempt, a fallback, the upstream): nothing to compare
        d = best.decode
        step = m.step_s(d.name, best.path.streams + 1)
        if taken == "disagg" and ex.prefill_ms is not None:
            p = next((c.prefill for c in choice.candidates if c.prefill.name == ex.prefill), best.prefill)
            m.observe_epoch(p.name, p.epoch)
            leg_s = ex.prefill_ms / 1000.0
            m.observe_prefill(p.name, p.epoch, leg_s, best.path.ahead + best.path.uncached, now)
            if ex.ttft_s is not None and self.queue is None and best.path.kv_tokens > 0:
                m.observe_kv(d.name, d.epoch, max(0.0, ex.ttft_s - leg_s - step), best.path.kv_tokens)
        elif taken != "disagg" and ex.ttft_s is not None:
            m.observe_prefill(d.name, d.epoch, max(0.0, ex.ttft_s - step), best.path.ahead + best.path.uncached, now)
        if ex.ttft_s is not None:
            predicted = best.prediction.ttft_s
            if predicted > 0:
                self.metrics.child(self.metrics.autopilot_ttft_ratio, best.kind).observe(ex.ttft_s / predicted)
            n = ex.tokens
            if n is not None and n > 1:
                tpot = max(0.0, (now - ex.started - ex.ttft_s) / (n - 1))
                if best.prediction.tpot_s > 0:
                    self.metrics.child(self.metrics.autopilot_tpot_ratio, best.kind).observe(
                        tpot / best.prediction.tpot_s
                    )
                m.observe_stream(d.name, d.epoch, tpot, best.path.streams + 1, now)
        if ex.tokens:
            m.observe_output(ex.tokens)
