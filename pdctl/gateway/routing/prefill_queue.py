"""The gateway's prefill queue (``routing.prefill_queue_tokens``): leg 1 bound late, to the prefill that holds it.

Without the queue a request's prefill is chosen when it arrives (``routing.prefill_policy``) and the request waits
in that engine's own queue. With it a request waits in the gateway while no prefill has *room* (room: fewer than
``prefill_queue_tokens`` uncached prompt tokens of requests still in leg 1,
:meth:`~pdctl.gateway.routing.chooser.Chooser.prefilling_tokens`), and is bound to a prefill only when one has: Dynamo's
``--router-queue-threshold``, with the choice turned around: the prefill with room takes the waiting request it
holds most of. At saturation the gateway holds requests of many prefixes, so a prefill with room mostly finds one
whose prefix it holds, and a prefix is computed where it is cached rather than where the load was lowest when its
request arrived.

Each time a request arrives or a leg 1 ends (:meth:`PrefillQueue.release`), :meth:`PrefillQueue._dispatch` binds
requests from the :data:`WINDOW` oldest waiting, until no prefill has room or nothing more can go:

1. ``match``: each prefill with room, the least busy first, takes a waiting request it holds more of than
   ``routing.cache_threshold`` and than any other prefill does (by the request's view: what the prefill computed,
   or what its KV events say it holds), the one it holds the largest share of; ties: the oldest;
2. ``policy``: the oldest request that no prefill holds above ``cache_threshold`` goes where
   ``routing.prefill_policy`` sends it among the prefills with room, unless a prefill is computing a prompt that
   shares that much with it: then it waits for that prompt to be computed, and matches there (vLLM caches a
   block once it is computed, so two requests of one new prefix sent together both compute it whole); a request
   held by a prefill without room waits for that prefill;
3. ``idle``: a prefill with nothing to compute takes the oldest request still waiting (it would idle otherwise).

A request waits at most until its deadline (``gateway.request_timeout_s``), then gets a 503 with ``Retry-After``;
a client that leaves stops waiting. Each process of ``gateway.workers`` has its own queue and counts only its own
requests against a prefill's room. The access log's
``prefill_queue=<rule>:<ms waited>`` says how each request was bound; ``pdctl_prefill_queue_waiting`` counts the
requests waiting and ``pdctl_prefill_queue_wait_seconds`` their wait, by rule.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdctl.gateway.errors import ApiError
from pdctl.gateway.metrics import GatewayMetrics
from pdctl.gateway.routing.approx_view import BLOCK_CHARS
from pdctl.gateway.routing.chooser import Chooser
from pdctl.gateway.routing.exact_view import leading
from pdctl.gateway.routing.plan import RoutePlan
from pdctl.gateway.routing.pool import Instance, Pool

__all__ = ["WINDOW", "PrefillQueue"]

#: How many of the oldest waiting requests a dispatch looks at (each costs a view lookup per prefill).
WINDOW = 32


@dataclass(eq=False, slots=True)
class _Waiter:
    plan: RoutePlan
    bound: asyncio.Future[Instance | None]
    since: float
    rule: str = ""
    memo: dict[int, list[int]] = field(default_factory=dict)
    """The prompt's token block hashes per block size (:meth:`Chooser.held` fills it)."""


class PrefillQueue:
    """The requests waiting for a prefill with room, in arrival order, for one gateway process."""

    def __init__(self, router: Chooser, limit: int, metrics: GatewayMetrics) -> None:
        self.router = router
        self.limit = limit
        """``routing.prefill_queue_tokens``."""
        self.metrics = metrics
        self.lookups = 0
        """View lookups made (one waiting prompt against one prefill's view): what the dispatches cost."""
        self._waiting: list[_Waiter] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting_tokens(self) -> int:
        """The prompt tokens of the requests waiting (for the SLO predictor: they are ahead of a new request)."""
        return sum(w.plan.cached_tokens + w.plan.uncached_tokens for w in self._waiting)

    async def pick(self, pool: Pool, plan: RoutePlan, timeout_s: float) -> Instance | None:
        """Wait until ``plan``'s request is bound to a prefill (None: no prefill is available at all); its rule and
        wait join ``plan.picks``. The caller ends the leg with :meth:`release`."""
        if not self._prefills(pool):
            return None
        w = _Waiter(plan, asyncio.get_running_loop().create_future(), time.monotonic())
        self._waiting.append(w)
        self.metrics.prefill_queue_waiting.inc()
        self._dispatch(pool)
        if not w.bound.done():
            try:  # (asyncio.wait, not wait_for: a deadline is a result here, the same on every Python)
                await asyncio.wait((w.bound,), timeout=timeout_s)
            except asyncio.CancelledError:  # the client left; if it was bound meanwhile, the room goes back
                self._forget(w)
                if w.bound.done() and not w.bound.cancelled() and (inst := w.bound.result()) is not None:
                    self.release(pool, inst, plan)
                raise
            if not w.bound.done():
                self._forget(w)
                raise ApiError(
                    503, f"no prefill had room for this request within {timeout_s:.3g} s (the gateway's prefill "
                    "queue, routing.prefill_queue_tokens); retry later", code="server_overloaded",
                    retry_after_s=pool.retry_after_s(("prefill",)),
                ) from None  # fmt: skip
        inst = w.bound.result()
        return self._bound(w, inst) if inst is not None else None

    def release(self, pool: Pool, inst: Instance, plan: RoutePlan) -> None:
        """``plan``'s leg 1 on ``inst`` ended (done, failed or abandoned): its room goes to the waiting requests."""
        self.router.leg1_done(inst, plan)
        self._dispatch(pool)

    def _bound(self, w: _Waiter, inst: Instance) -> Instance:
        waited = time.monotonic() - w.since
        self.metrics.child(self.metrics.prefill_queue_wait, w.rule).observe(waited)
        w.plan.picks.append(f"prefill_queue={w.rule}:{waited * 1000.0:.0f}")
        return inst

    def _forget(self, w: _Waiter) -> None:
        if w in self._waiting:
            self._waiting.remove(w)
            self.metrics.prefill_queue_waiting.dec()

    def _prefills(self, pool: Pool) -> list[Instance]:
        return [i for i in pool.by_role("prefill") if i.available()]

    def _bind(self, pool: Pool, w: _Waiter, among: list[Instance], rule: str) -> None:
        w.rule = rule
        self._forget(w)
        w.bound.set_result(self.router.pick(pool, "prefill", w.plan, among=among))

    def _dispatch(self, pool: Pool) -> None:
        """Bind what can be bound now (module docstring). Binding changes which prefill computes what, never what a
        view holds, so each waiting prompt is looked up in the views once a dispatch, however many it binds."""
        shares: dict[_Waiter, dict[Instance, float]] = {}
        while self._waiting:
            prefills = self._prefills(pool)
            if not prefills:  # none available: each waiting request gets the caller's "no prefill" error
                for w in list(self._waiting):
                    self._forget(w)
                    w.bound.set_result(None)
                return
            busy = {i: self.router.prefilling_tokens(i) for i in prefills}
            room = sorted((i for i in prefills if busy[i] < self.limit), key=lambda i: busy[i])
            if not room or not self._bind_one(pool, prefills, room, busy, shares):
                return

    def _bind_one(
        self, pool: Pool, prefills: list[Instance], room: list[Instance], busy: dict[Instance, int],
        shares: dict[_Waiter, dict[Instance, float]],
    ) -> bool:  # fmt: skip
        window = self._waiting[:WINDOW]
        threshold = self.router.routing.cache_threshold
        router = self.router

        def row(w: _Waiter) -> dict[Instance, float]:  # the share of w's prompt each prefill holds
            got = shares.get(w)
            if got is None:
                total = max(1, w.plan.cached_tokens + w.plan.uncached_tokens)
                got = shares[w] = {i: router.cached(i, w.plan, w.memo) / total for i in prefills}
                self.lookups += len(prefills)
            return got

        cached = {w: row(w) for w in window}
        top = {w: max(cached[w].values()) for w in window}
        for inst in room:  # 1. match: of the requests this prefill holds most of, the one it holds the most of
            mine = [w for w in window if cached[w][inst] == top[w] > threshold]
            if mine:
                self._bind(pool, max(mine, key=lambda w: cached[w][inst]), [inst], "match")  # ties: the oldest
                return True
        computing = [router.computing(i) for i in prefills]
        for w in window:  # 2. policy: the oldest request no prefill holds or computes
            if top[w] > threshold:
                continue  # held by a prefill without room: it waits for that one
            led = w.plan.hashes and any(
                leading(w.plan.hashes, c) * BLOCK_CHARS > threshold * w.plan.chars for c in computing
            )  # fmt: skip
            if not led:  # (a prompt another one is computing waits for it, then matches where it was computed)
                demand = {i: sum(cached[v][i] > threshold for v in window) for i in room}
                least = min(demand.values())
                self._bind(pool, w, [i for i in room if demand[i] == least], "policy")
                return True
        idle = [i for i in room if busy[i] == 0]
        if idle:  # 3. idle: every waiting request waits for a busy holder; an idle prefill takes the oldest
            self._bind(pool, window[0], idle, "idle")
            return True
        return False
