"""The chooser: which instance of a pool takes a request, by the pool's policy (:mod:`pdctl.gateway.routing.policies`),
and the plan of one request under adaptive PD (:class:`pdctl.gateway.routing.plan.RoutePlan`).

**By load** (:meth:`Chooser.by_load`): ``routing.prefill_policy`` / ``routing.decode_policy`` when it reads only the
load (:data:`~pdctl.gateway.routing.policies.LOAD_POLICIES`); a request-aware policy, a choice over both roles
(``colocated``) and a choice among given instances (a retry, a migration) fall back to ``least_loaded``. The tie
rotation per pool and the random source live here (:meth:`Chooser.turn`, :attr:`Chooser.rng`), shared with the
request-aware picks.

**The views** per instance: the approximate one (:mod:`pdctl.gateway.routing.approx_view`) in every mode, and, with
``routing.prefix_view = "exact"``, each worker's own KV cache events (:mod:`pdctl.gateway.routing.exact_view`)
matched against the prompt's exact token ids (:meth:`pdctl.gateway.tokens.TokenCounter.prompt_ids`) in the
engine's blocks. The exact view sees what the engine really holds: the answers' blocks, evictions, a cache reset. A
request whose ids are not known exactly (images, an unknown block type, a model without a local tokenizer) and a
worker that has published nothing yet are judged by the approximate view; each exact plan also counts what the
approximate view would have said (``pdctl_pd_view_cached_tokens_total``, ``pdctl_pd_view_disagreements_total``),
the drift between the two.

**The plan** (:meth:`Chooser.decide`, ``routing.pd_mode = "adaptive"``):

1. the decode first, by ``routing.decode_policy`` (its default ``least_loaded`` takes the instance with most cached
   blocks, ties to the least loaded, and the least loaded outright when the pool is imbalanced by
   ``routing.balance_abs_threshold`` and ``balance_rel_threshold``, the cache-aware routers' defaults);
2. the prompt's tokens not cached there (``uncached``);
3. local or P→D by :func:`pdctl.gateway.routing.plan.local_rule`, with the prefill of P→D chosen by
   ``routing.prefill_policy`` (vLLM's prefill computes the whole prompt except its own cache hits; decode pulls
   only the blocks it lacks).

**Per-pool policies without adaptive PD** (``pd_mode = "always"`` with a ``prefill_policy`` or ``decode_policy``
other than ``least_loaded``): :meth:`Chooser.decide` only reads the prompt (``decision=always``); the prefill is
picked for leg 1 and the decode for leg 2, each when its leg starts (:meth:`Chooser.pick`), so the loads they read
are current. Every pick appends its policy, rule and the candidates' scores to the plan's log fields
(:attr:`RoutePlan.picks`).
"""

from __future__ import annotations

import itertools
import random
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdctl.config import RoutingConfig
from pdctl.gateway import agent_sessions, conversation, prompt_view
from pdctl.gateway.routing import policies as policy
from pdctl.gateway.routing.approx_view import BLOCK_CHARS, PrefixIndex, block_hashes, prompt_text
from pdctl.gateway.routing.exact_view import ExactIndex, token_block_hashes
from pdctl.gateway.routing.kv_events import KvEventSubscriber
from pdctl.gateway.routing.plan import RoutePlan, View, local_rule
from pdctl.gateway.routing.pool import Instance, Pool, Role

__all__ = ["DEFAULT_BLOCK_TOKENS", "ROUTED_TTL_S", "Chooser"]

#: ``kv_aware``'s block size for an instance with no events yet (vLLM's default ``--block-size``).
DEFAULT_BLOCK_TOKENS = 16
#: ``kv_aware`` counts a prompt as held where it was routed this recently, before that engine's events can say so
#: (llm-d's ``speculativeIndexing`` TTL; Dynamo's ``--router-predicted-ttl-secs``).
ROUTED_TTL_S = 2.0


class Chooser:
    """The per-instance views, the per-pool policies and the plan, for one gateway process; ``events``: the
    workers' KV cache events (``prefix_view = "exact"``, :mod:`pdctl.gateway.routing.exact_view`), None for the
    approximate view alone."""

    def __init__(
        self, routing: RoutingConfig, events: KvEventSubscriber | None = None,
        sec_per_token: Callable[[], float | None] = lambda: None, rng: random.Random | None = None,
    ) -> None:  # fmt: skip
        self.routing = routing
        self.events = events
        self.sec_per_token = sec_per_token
        """The prefill seconds per prompt token measured so far (None: not yet), for ``local_max_stall_ms``."""
        self.rng = rng or random.Random()
        """The random tie-breaks' source (seeded in tests)."""
        self._rr: dict[tuple[Role, ...], itertools.count[int]] = {}
        self.sessions = policy.Sessions()
        self.breaks = agent_sessions.CacheBreaks()
        """Per agent session, where its prompt cache breaks from turn to turn."""
        self._indexed = (
            routing.pd_mode != "always" or any(p in ("cache_aware", "kv_aware") for p in routing.policies)
            or routing.prefill_queue_tokens is not None
        )  # fmt: skip
        self._views: weakref.WeakKeyDictionary[Instance, tuple[int, PrefixIndex]] = weakref.WeakKeyDictionary()
        self._routed: weakref.WeakKeyDictionary[Instance, OrderedDict[int, float]] = weakref.WeakKeyDictionary()
        """Per instance, the approximate blocks of the prompts routed there in the last :data:`ROUTED_TTL_S`."""
        self._prefilling: weakref.WeakKeyDictionary[Instance, weakref.WeakKeyDictionary[RoutePlan, int]] = (
            weakref.WeakKeyDictionary()
        )
        """Per prefill, the uncached tokens of each request picked for it whose leg 1 has not succeeded yet (a
        request that ends otherwise drops out with its decision)."""
        self._exact_epoch: weakref.WeakKeyDictionary[Instance, int] = weakref.WeakKeyDictionary()

    def turn(self, roles: tuple[Role, ...]) -> int:
        """The next turn of ``roles``' rotation (ties under ``least_loaded``, the order under ``round_robin``)."""
        return next(self._rr.setdefault(roles, itertools.count()))

    def by_load(self, pool: Pool, roles: tuple[Role, ...], among: Sequence[Instance] | None = None) -> Instance | None:
        """The pool's load policy (least in-flight requests then tokens, ties rotating; ``power_of_two``;
        ``round_robin``); a request-aware policy, and a choice over both roles (``colocated``), fall back to least
        loaded. None when no instance is available. ``among``: the least loaded of these."""
        candidates = list(among) if among is not None else [
            i for i in pool.instances if i.role in roles and i.available()
        ]  # fmt: skip
        if not candidates:
            return None
        r = self.routing
        name = r.prefill_policy if roles == ("prefill",) else r.decode_policy if roles == ("decode",) else None
        turn = self.turn(roles)
        if among is not None or name is None or name not in policy.LOAD_POLICIES:
            return policy.least_loaded(candidates, turn).instance
        return policy.by_load(name, candidates, turn, self.rng).instance

    def view(self, inst: Instance) -> PrefixIndex:
        """``inst``'s approximate view: created empty on first use, emptied when the instance came back from being
        down (a restarted engine's prefix cache is empty; :attr:`~pdctl.gateway.routing.pool.Instance.epoch`)."""
        held = self._views.get(inst)
        if held is None or held[0] != inst.epoch:
            held = self._views[inst] = (inst.epoch, PrefixIndex(self.routing.prefix_cache_blocks))
        return held[1]

    def exact_view(self, inst: Instance) -> ExactIndex | None:
        """``inst``'s exact view (None: no events from it yet, or no exact view); emptied, as the approximate one,
        when the instance came back from being down."""
        if self.events is None:
            return None
        ev = self.events.view(inst.name)
        if ev is not None and self._exact_epoch.setdefault(inst, inst.epoch) != inst.epoch:
            self._exact_epoch[inst] = inst.epoch
            ev.clear()
        return ev if ev is not None and ev.block_size is not None else None

    def record(self, inst: Instance, plan: RoutePlan) -> None:
        """``inst`` computed (or pulled) ``plan``'s prompt: the approximate view holds its blocks now. A leg 1's
        end is the caller's to say, once (:meth:`leg1_done`)."""
        self.view(inst).insert(plan.hashes)

    def leg1_done(self, inst: Instance, plan: RoutePlan) -> None:
        """``plan``'s leg 1 on ``inst`` ended, however: its tokens no longer count as ``inst``'s to compute."""
        pending = self._prefilling.get(inst)
        if pending is not None:
            pending.pop(plan, None)

    def prefilling_tokens(self, inst: Instance) -> int:
        """Prompt tokens ``inst`` still has to compute for the requests picked for it (their leg 1 not done)."""
        pending = self._prefilling.get(inst)
        return sum(pending.values()) if pending is not None else 0

    def cached(self, inst: Instance, plan: RoutePlan, memo: dict[int, list[int]] | None = None) -> int:
        """Prompt tokens of ``plan`` cached on ``inst``, by the plan's view (``memo``: the prompt's token block
        hashes per block size, filled on first use, for a caller that asks of many instances)."""
        prompt_tokens = plan.cached_tokens + plan.uncached_tokens
        return self._cached(inst, plan.hashes, plan.token_ids, prompt_tokens, plan.chars, memo)[0]

    def computing(self, inst: Instance) -> set[int]:
        """The approximate block hashes of the prompts ``inst`` is computing (their leg 1 not done)."""
        pending = self._prefilling.get(inst)
        return {h for plan in pending for h in plan.hashes} if pending else set()

    def _cached(
        self, inst: Instance, hashes: Sequence[int], ids: Sequence[int] | None, prompt_tokens: int, text_chars: int,
        memo: dict[int, list[int]] | None = None,
    ) -> tuple[int, View]:  # fmt: skip
        if ids is not None:
            ev = self.exact_view(inst)
            if ev is not None and ev.block_size is not None:
                bs = ev.block_size
                own = memo.get(bs) if memo is not None else None
                if own is None:
                    own = token_block_hashes(ids, bs)
                    if memo is not None:
                        memo[bs] = own
                return min(prompt_tokens, ev.match(own) * bs), "exact"
        blocks = self.view(inst).match(hashes)
        return min(prompt_tokens, prompt_tokens * blocks * BLOCK_CHARS // max(1, text_chars)), "approx"

    def pick(self, pool: Pool, role: Role, plan: RoutePlan, among: Sequence[Instance] | None = None) -> Instance | None:
        """The instance of ``role`` for ``plan``'s request, by the role's policy (``among``: only those, else every
        available one); the pick's fields join ``plan.picks``. A prefill counts the prompt's uncached tokens as its
        to compute until :meth:`leg1_done`."""
        prompt_tokens = plan.cached_tokens + plan.uncached_tokens
        memo: dict[int, list[int]] = {}
        pick = self._choose(pool, role, plan.hashes, plan.token_ids, prompt_tokens, plan.chars, plan.session,
                            among, memo)  # fmt: skip
        plan.picks.append(pick.log_fields(role))
        if role == "prefill" and pick.instance is not None:
            new = prompt_tokens - self.cached(pick.instance, plan, memo)
            self._prefilling.setdefault(pick.instance, weakref.WeakKeyDictionary())[plan] = new
        self._learn(pick.instance, role, plan.hashes)
        return pick.instance

    def _learn(self, inst: Instance | None, role: Role, hashes: Sequence[int]) -> None:
        """``cache_aware``'s tree learns a request when it is routed, as the peers' trees do (a burst of one prefix
        follows its first request), once the caller has read what the instance held before it; not on prefill
        behind the prefill queue, whose views hold only what was computed."""
        r = self.routing
        if role == "prefill" and r.prefill_queue_tokens is not None:
            return  # the prefill queue holds a burst's followers until their leader's prompt is computed
        if inst is not None and (r.prefill_policy if role == "prefill" else r.decode_policy) == "cache_aware":
            self.view(inst).insert(hashes)

    def _choose(
        self, pool: Pool, role: Role, hashes: Sequence[int], ids: Sequence[int] | None, prompt_tokens: int,
        chars: int, session: str | None, among: Sequence[Instance] | None = None,
        memo: dict[int, list[int]] | None = None,
    ) -> policy.Pick[Instance]:  # fmt: skip
        """``role``'s pick by its policy (the caller reads what the instance holds, then :meth:`_learn`)."""
        r = self.routing
        name = r.prefill_policy if role == "prefill" else r.decode_policy
        pool_cands = pool.instances if among is None else among
        cands = [i for i in pool_cands if i.role == role and i.available()]
        if not cands:
            return policy.Pick(None, name, "none")
        sticky = self.sessions.last(role, session)
        turn = self.turn((role,))
        memo = {} if memo is None else memo

        def cached(i: Instance) -> float:
            return self._cached(i, hashes, ids, prompt_tokens, chars, memo)[0]

        if name == "least_loaded" and r.pd_mode != "always":
            pick = policy.prefix_first(cands, cached, r, turn, sticky)
        elif name in policy.LOAD_POLICIES:
            pick = policy.by_load(name, cands, turn, self.rng, sticky)
        elif name == "cache_aware":
            queued = self.prefilling_tokens if role == "prefill" else None
            pick = policy.cache_aware(cands, lambda i: cached(i) / max(1, prompt_tokens),
                                      lambda i: len(self.view(i)), r, turn, sticky, queued)  # fmt: skip
        else:

            def held(i: Instance) -> float:  # what the events say, or what was routed there a moment ago
                routed = prompt_tokens * self._routed_blocks(i, hashes) * BLOCK_CHARS // max(1, chars)
                return max(cached(i), min(prompt_tokens, routed))

            pick = policy.kv_aware(cands, lambda i: self._cost(i, role, prompt_tokens, held(i)), self.rng, sticky)
            if pick.instance is not None:
                self._route(pick.instance, hashes)
        if pick.instance is not None:
            self.sessions.remember(role, session, pick.instance.name)
        return pick

    def _cost(self, inst: Instance, role: Role, prompt_tokens: int, cached: float) -> float:
        """``kv_aware``'s Dynamo cost in blocks: a prefill's ``max(prefilling + new - overlap, 0)`` (prefilling: the
        uncached tokens of its requests not yet through leg 1); a decode's ``max(new - overlap, 0) + in-flight``
        (its in-flight prompts hold its KV; it computes only what it lacks). ``overlap``: the cached blocks times
        ``routing.kv_overlap_credit``."""
        ev = self.exact_view(inst)
        bs = ev.block_size if ev is not None and ev.block_size else DEFAULT_BLOCK_TOKENS
        new = prompt_tokens - self.routing.kv_overlap_credit * cached
        if role == "prefill":
            return -(-max(self.prefilling_tokens(inst) + new, 0) // bs)
        return -(-max(new, 0) // bs) + -(-inst.in_flight_tokens // bs)

    def _route(self, inst: Instance, hashes: Sequence[int]) -> None:
        routed = self._routed.setdefault(inst, OrderedDict())
        until = time.monotonic() + ROUTED_TTL_S
        for h in hashes:
            routed[h] = until
            routed.move_to_end(h)
        now = time.monotonic()
        while routed and next(iter(routed.values())) < now:
            routed.popitem(last=False)

    def _routed_blocks(self, inst: Instance, hashes: Sequence[int]) -> int:
        routed = self._routed.get(inst)
        if not routed:
            return 0
        now = time.monotonic()
        n = 0
        for h in hashes:
            if routed.get(h, 0.0) < now:
                break
            n += 1
        return n

    def decide(
        self, pool: Pool, body: Mapping[str, Any], prompt_tokens: int, token_ids: Sequence[int] | None = None,
        endpoint: str | None = None, identity: agent_sessions.Identity | None = None,
    ) -> RoutePlan:  # fmt: skip
        """Choose the decode, count the prompt's uncached tokens on it, and decide local or P→D. ``token_ids``: the
        prompt's exact ids (the exact view is used where the decode has published events); ``endpoint``: the
        route, for the prompt as vLLM renders it (:func:`prompt_text`); ``identity``: the request's session from its
        headers or body (:func:`~pdctl.gateway.agent_sessions.identify`: its id then breaks ties, and the turn is
        compared with the session's previous one, :class:`~pdctl.gateway.agent_sessions.CacheBreaks`; None: the
        body's hint alone, :func:`~pdctl.gateway.agent_sessions.session_hint`). Under
        ``pd_mode = "always"`` nothing is chosen yet (``decision=always``; :meth:`pick` chooses per leg)."""
        chat = prompt_view.chat_request(endpoint, body) if endpoint is not None else None
        parts = conversation.prompt_parts(chat) if chat is not None else None
        text = ""
        if self._indexed:
            text = "\x1f".join(t for _, _, t in parts) if parts is not None else prompt_text(body)
        hashes = tuple(block_hashes(text))
        ids = tuple(token_ids) if token_ids is not None and self.events is not None else None
        if ids is not None:
            prompt_tokens = len(ids)
        chars = len(text)
        session = identity.session if identity is not None else agent_sessions.session_hint(body)
        brk = None
        if identity is not None and parts is not None:
            brk = self.breaks.observe(identity.session, parts, prompt_tokens, token_ids)
        if self.routing.pd_mode == "always":
            return RoutePlan(False, "always", None, 0, prompt_tokens, hashes, token_ids=ids, chars=chars,
                            session=session, identity=identity, cache_break=brk)  # fmt: skip
        pick = self._choose(pool, "decode", hashes, ids, prompt_tokens, chars, session)
        decode = pick.instance
        cached = self._cached(decode, hashes, ids, prompt_tokens, chars)[0] if decode is not None else 0
        self._learn(decode, "decode", hashes)
        view: View = "approx"
        approx: int | None = None
        if decode is not None and ids is not None:
            view = self._cached(decode, hashes, ids, prompt_tokens, chars)[1]
            if view == "exact":
                approx = self._cached(decode, hashes, None, prompt_tokens, chars)[0]
        reason = local_rule(self.routing, decode, prompt_tokens - cached, prompt_tokens, self.sec_per_token)
        approx_local = None
        if approx is not None:
            approx_local = (
                local_rule(self.routing, decode, prompt_tokens - approx, prompt_tokens, self.sec_per_token) == "cached"
            )
        exact_ids = ids if view == "exact" else None
        return RoutePlan(reason == "cached" and decode is not None, reason, decode, cached, prompt_tokens - cached,
                        hashes, view, exact_ids, approx, chars, approx_local, session,
                        [pick.log_fields("decode")], identity, brk)  # fmt: skip
