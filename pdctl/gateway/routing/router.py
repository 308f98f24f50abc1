"""The router: the one place the gateway's request paths ask which instance takes a request.

The PD flow (:mod:`pdctl.gateway.pd` and its worker calls, :mod:`pdctl.gateway.legs`), the app
(:mod:`pdctl.gateway.app`) and a stream's migration (:mod:`pdctl.gateway.migration`) choose instances only through
a :class:`Router` (``tests/gateway/test_layout.py`` holds them to it); the pool
(:mod:`~pdctl.gateway.routing.pool`) keeps membership and health and chooses nothing. What the router asks of its
parts:

================================ ==================================================================================
call                             answer
================================ ==================================================================================
:meth:`Router.plan`              a request's plan (its decode, local or P→D), or None when the gateway does not
                                 route by request (``routing.routes_by_request``)
:meth:`Router.steer`             the SLO autopilot's path for a plan (``routing.pd_mode = "auto"``); then
                                 :meth:`Router.finish`
:meth:`Router.load_ahead`        what admission weighs: the tokens to compute, the tokens ahead, the decode's
                                 concurrency
:meth:`Router.take_prefill`      leg 1's prefill: through the prefill queue until a deadline, by the plan's
                                 policy, or by load
:meth:`Router.retry_prefill`     a retried leg 1's prefill: another one than those that failed, by load
:meth:`Router.prefill_done`      leg 1 ended (once): the views learn a computed prompt, the queue gets the room back
:meth:`Router.take_decode`       leg 2's decode (the plan's, while available), or a colocated request's instance
:meth:`Router.decode_done`       leg 2 served: the decode's views hold the prompt
:meth:`Router.release_target`    the decode of a release leg (the client left during leg 1)
:meth:`Router.migration_target`  where a broken stream continues: another decode, a prefill, the restarted one
================================ ==================================================================================
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdctl.errors import ConfigError
from pdctl.gateway import agent_sessions
from pdctl.gateway.metrics import GatewayMetrics
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.routing.autopilot import Autopilot, Choice
from pdctl.gateway.routing.chooser import Chooser
from pdctl.gateway.routing.kv_events import KvEventSubscriber
from pdctl.gateway.routing.plan import RoutePlan
from pdctl.gateway.routing.pool import Instance, Pool, Role
from pdctl.gateway.routing.prefill_queue import PrefillQueue
from pdctl.gateway.settings import GatewaySettings
from pdctl.vllm.kv_curve import server_keys
from pdctl.vllm.kv_events import bind_endpoint

__all__ = ["PROBE_EVERY_S", "Router"]

#: How often a migration with no other worker probes the dead decode, waiting for its restart.
PROBE_EVERY_S = 0.5


class Router:
    """Every choice of instance for one gateway process. ``sec_per_token``: the prefill seconds per prompt token
    measured so far (None: not yet), for ``routing.local_max_stall_ms``. A ``kv_aware`` policy without the workers'
    KV cache events is a :class:`~pdctl.errors.ConfigError`."""

    def __init__(
        self, settings: GatewaySettings, pool: Pool, metrics: GatewayMetrics,
        sec_per_token: Callable[[], float | None] = lambda: None,
    ) -> None:  # fmt: skip
        r = settings.routing
        self.pool = pool
        self.metrics = metrics
        self.by_request = r.routes_by_request
        """Whether each request gets a plan (adaptive PD, a request-aware policy, the prefill queue)."""
        self.events: KvEventSubscriber | None = None
        """The workers' KV cache events (``routing.prefix_view = "exact"``), which the caller runs; None: the
        approximate view alone."""
        if self.by_request and r.reads_kv_events:
            relay = settings.kv_events_connect  # the parent's relay, on ipc, holds the CURVE server then
            self.events = KvEventSubscriber(
                relay or bind_endpoint(r.kv_events_host, r.kv_events_port), self._count_event,
                connect=relay is not None, allowed=self._known, max_blocks=r.kv_events_max_blocks,
                curve=server_keys() if r.kv_events_curve and relay is None else None,
                capacity=self._kv_blocks,
            )  # fmt: skip
        if self.by_request and self.events is None and "kv_aware" in r.policies:
            which = "prefill_policy" if r.prefill_policy == "kv_aware" else "decode_policy"
            raise ConfigError("settings.json", f"routing.{which}",
                              "kv_aware reads the workers' KV cache events, which this gateway does not receive",
                              hint='set "prefix_view": "exact" in routing (the plan then starts the workers with '
                              '--kv-events-config), or choose cache_aware')  # fmt: skip
        self.chooser = Chooser(r, self.events, sec_per_token)
        limit = r.prefill_queue_tokens
        self.queue = PrefillQueue(self.chooser, limit, metrics) if self.by_request and limit is not None else None
        """The gateway's prefill queue (``routing.prefill_queue_tokens``); None: leg 1's prefill is chosen at once."""
        self.autopilot = (
            Autopilot(settings.slo, self.chooser, metrics, self.queue)
            if self.by_request and r.pd_mode == "auto"
            else None
        )
        """``routing.pd_mode = "auto"``: each request's path from the SLO and the learned costs."""

    def _known(self, name: str) -> bool:
        """Whether ``name`` is one of this deployment's workers, configured or discovered (a KV events topic)."""
        return any(i.name == name for i in self.pool.instances)

    def _kv_blocks(self, name: str) -> int | None:
        """The blocks worker ``name``'s KV cache holds, as its ``/metrics`` reported (None: not known)."""
        return next((i.kv_blocks for i in self.pool.instances if i.name == name), None)

    def _count_event(self, instance: str, event: str) -> None:
        self.metrics.child(self.metrics.kv_events, instance, event).inc()

    # ------------------------------------------------------------------------------------- a request's plan

    def plan(
        self, body: Mapping[str, Any], prompt_tokens: int, token_ids: Sequence[int] | None = None,
        endpoint: str | None = None, identity: agent_sessions.Identity | None = None,
    ) -> RoutePlan | None:  # fmt: skip
        """The request's plan (:meth:`Chooser.decide` for the arguments); None when the gateway does not route by
        request."""
        if not self.by_request:
            return None
        return self.chooser.decide(self.pool, body, prompt_tokens, token_ids, endpoint, identity)

    def steer(self, plan: RoutePlan) -> tuple[RoutePlan, Choice | None]:
        """Under ``pd_mode = "auto"``, the SLO autopilot's path for ``plan``'s request: the plan it changed and its
        choice, which the caller ends with :meth:`finish`; else ``plan`` unchanged and None."""
        choice = self.autopilot.choose(self.pool, plan) if self.autopilot is not None else None
        return (choice.plan if choice is not None else plan), choice

    def finish(self, choice: Choice, ex: RequestRecord) -> None:
        """The request of an autopilot ``choice`` ended (:meth:`pdctl.gateway.routing.autopilot.Autopilot.finish`)."""
        if self.autopilot is not None:
            self.autopilot.finish(choice, ex)

    def load_ahead(self, plan: RoutePlan | None, prompt_tokens: int) -> tuple[int, int, int]:
        """What admission weighs, as ``(tokens to compute, tokens ahead, decode concurrency)``. When ``plan`` serves
        the request on its decode alone, no prefill queue is ahead of it and that decode computes only the prompt's
        uncached tokens; otherwise the least loaded prefill's tokens are ahead, and a share of those waiting in the
        gateway's prefill queue."""
        if plan is not None and plan.local and plan.decode is not None:
            return plan.uncached_tokens, 0, plan.decode.in_flight
        prefill = self.least_loaded(("prefill",))
        ahead = prefill.in_flight_tokens if prefill is not None else 0
        if self.queue is not None and len(self.queue):  # waiting in the gateway: ahead of it too
            serving = sum(i.available() for i in self.pool.by_role("prefill"))  # (those down take none)
            ahead += self.queue.waiting_tokens() // max(1, serving)
        concurrency = min((i.in_flight for i in self.pool.by_role("decode") if i.available()), default=0)
        return prompt_tokens, ahead, concurrency

    def least_loaded(self, roles: tuple[Role, ...]) -> Instance | None:
        """The available instance of ``roles`` a load choice would favour, without taking it (None: none)."""
        candidates = [i for i in self.pool.instances if i.role in roles and i.available()]
        return min(candidates, key=lambda i: (i.in_flight, i.in_flight_tokens), default=None)

    # ------------------------------------------------------------------------------------- the legs

    async def take_prefill(self, plan: RoutePlan | None, timeout_s: float) -> Instance | None:
        """Leg 1's prefill (None: none available): bound through the prefill queue within ``timeout_s`` (a 503
        after it), else by the plan's policy, else by load. The caller ends the leg with :meth:`prefill_done`."""
        if plan is not None and self.queue is not None:
            return await self.queue.pick(self.pool, plan, timeout_s)
        if plan is not None and self.by_request:
            return self.chooser.pick(self.pool, "prefill", plan)
        return self.chooser.by_load(self.pool, ("prefill",))

    def retry_prefill(self, failed: Sequence[Instance]) -> Instance | None:
        """A retried leg 1's prefill: the least loaded available one whose leg 1 did not fail (None: none other)."""
        others = [i for i in self.pool.by_role("prefill") if i.available() and i not in failed]
        return self.chooser.by_load(self.pool, ("prefill",), among=others) if others else None

    def prefill_done(self, inst: Instance, plan: RoutePlan | None, computed: bool) -> None:
        """``plan``'s leg 1 on ``inst`` ended, once (``computed``: it succeeded, and the views learn the prompt)."""
        if plan is None or not self.by_request:
            return
        if computed:
            self.chooser.record(inst, plan)
        if self.queue is not None:
            self.queue.release(self.pool, inst, plan)
        else:
            self.chooser.leg1_done(inst, plan)

    def take_decode(self, roles: tuple[Role, ...], plan: RoutePlan | None = None) -> Instance | None:
        """Leg 2's decode (or a whole request's instance among ``roles``): the plan's decode while it is available,
        else by the decode policy with the request at hand, else by load (None: none available)."""
        inst = plan.decode if plan is not None and plan.decode is not None and plan.decode.available() else None
        inst = inst if inst is not None and inst.role in roles else None
        if inst is None and plan is not None and self.by_request:  # routing.decode_policy, with the request
            inst = self.chooser.pick(self.pool, "decode", plan)
        return inst or self.chooser.by_load(self.pool, roles)

    def decode_done(self, inst: Instance, plan: RoutePlan | None) -> None:
        """``inst`` served ``plan``'s request: its view holds the prompt now."""
        if plan is not None and self.by_request:
            self.chooser.record(inst, plan)

    def release_target(self) -> Instance | None:
        """The decode that pulls (and so frees) the blocks of a leg 1 whose client left (None: none available)."""
        return self.chooser.by_load(self.pool, ("decode",))

    async def migration_target(self, failed: Sequence[Instance], deadline: float) -> tuple[Instance | None, str]:
        """Where a broken stream continues, and which kind of target that is: another decode; else a prefill
        serving the rest whole; else a decode (the dead one, restarted) once it answers ``/health`` before the
        monotonic ``deadline``. ``failed``: the workers this stream already broke on."""
        pool = self.pool
        others = [i for i in pool.by_role("decode") if i not in failed and i.available()]
        if others:
            return self.chooser.by_load(pool, ("decode",), among=others), "decode"
        prefills = [i for i in pool.by_role("prefill") if i not in failed and i.available()]
        if prefills:
            return self.chooser.by_load(pool, ("prefill",), among=prefills), "prefill"
        while time.monotonic() < deadline:
            decodes = pool.by_role("decode")
            await asyncio.gather(*(pool.probe(i) for i in decodes))
            back = [i for i in decodes if i.healthy and i.available()]
            if back:
                return self.chooser.by_load(pool, ("decode",), among=back), "restarted"
            await asyncio.sleep(PROBE_EVERY_S)
        return None, "-"
