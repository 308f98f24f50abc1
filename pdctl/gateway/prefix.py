"""Adaptive PD (``routing.pd_mode = "adaptive"``): what each instance holds, and the per-request decision.

**The view.** Per instance the gateway keeps an LRU set of *block hashes* of the prompts it sent there: the
approximate view of llm-d's ``approx-prefix-cache-producer`` and SGLang's ``cache_aware``, built from the gateway's
own traffic with no engine feedback. A request's prompt becomes one canonical string (:func:`prompt_text`: the chat
vLLM renders, after its own rewrites such as dropping Claude Code's billing line (:mod:`pdctl.gateway.prompt_view`),
every message's fields and text in order, a completion's prompt, token ids as numbers), cut into blocks of
:data:`BLOCK_CHARS` characters, each block's hash chained to the previous one's, so a block matches only when
everything before it matches too. Turn k+1 of a conversation begins with turn k's prompt, so its first blocks
match on the instance that served turn k, until that instance is seen down (a restarted engine starts with an
empty cache, so its view starts empty too). The hashes are Python's own (per process, never on the wire): each
gateway process (``gateway.workers``) keeps its own view.

Characters become tokens by the prompt's own ratio: cached tokens = prompt tokens × matched characters / prompt
characters. vLLM also caches the answer's full blocks, which the view leaves out, so it under-counts what a
decode holds after a turn: the decision errs towards the prefill leg.

**The exact view** (``routing.prefix_view = "exact"``, :mod:`pdctl.gateway.kv_view`): each worker's own KV cache
events, matched against the prompt's exact token ids (:meth:`pdctl.gateway.tokens.TokenCounter.prompt_ids`) in
the engine's blocks. It sees what the engine really holds: the answers' blocks, evictions, a cache reset. A
request whose ids are not known exactly (images, an unknown block type, a model without a local tokenizer) and a worker
that has published nothing yet are judged by the approximate view, which is kept in either mode; each exact
decision also counts what the approximate view would have said (``pdctl_pd_view_cached_tokens_total``,
``pdctl_pd_view_disagreements_total``), the drift between the two.

**The decision** (:meth:`PrefixRouter.decide`), following llm-d's ``prefix-based-pd-decider`` and Dynamo's
conditional disaggregation (llm-d/llm-d PR #2109; ai-dynamo/dynamo
``docs/components/router/router-disaggregated-serving.md``):

1. the decode first, by ``routing.decode_policy`` (:mod:`pdctl.gateway.policy`; its default ``least_loaded`` takes
   the instance with most cached blocks, ties to the least loaded, and the least loaded outright when the pool is
   imbalanced by ``routing.balance_abs_threshold`` and ``balance_rel_threshold``, the cache-aware routers' defaults);
2. the prompt's tokens not cached there (``uncached``);
3. local (that decode alone computes the rest, ``x-pd-path: local``) when ``uncached <=
   routing.local_max_uncached_tokens`` and ``uncached / prompt <= routing.local_max_uncached_share`` and the
   decode has fewer than ``routing.local_max_decode_requests`` requests in flight and, with streams in flight,
   the prefill would stall them at most ``routing.local_max_stall_ms`` (uncached tokens × the prefill seconds per
   token the admission predictor measured on leg 1s: the same cores compute it); otherwise P→D, with the
   prefill chosen by ``routing.prefill_policy`` (vLLM's prefill computes the whole prompt except its own cache
   hits; decode pulls only the blocks it lacks).

**Per-pool policies without adaptive PD** (``pd_mode = "always"`` with a ``prefill_policy`` or ``decode_policy``
other than ``least_loaded``): :meth:`PrefixRouter.decide` only reads the prompt (``decision=always``); the prefill
is picked for leg 1 and the decode for leg 2, each when its leg starts (:meth:`PrefixRouter.pick`), so the loads
they read are current. Every pick appends its policy, rule and the candidates' scores to the decision's log fields
(:attr:`Decision.picks`).
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdctl.config import RoutingConfig
from pdctl.errors import ConfigError
from pdctl.gateway import agent_sessions, policy, prompt_view
from pdctl.gateway.kv_view import ExactIndex, KvEventSubscriber, leading, token_block_hashes
from pdctl.gateway.routing import Instance, Pool, Role

__all__ = ["BLOCK_CHARS", "Decision", "PrefixIndex", "PrefixRouter", "block_hashes", "prompt_text"]

#: Characters per block: about 64 tokens of English (llm-d clamps its approximate blocks to at least 64 tokens).
BLOCK_CHARS = 256
#: ``kv_aware``'s block size for an instance with no events yet (vLLM's default ``--block-size``).
DEFAULT_BLOCK_TOKENS = 16
#: ``kv_aware`` counts a prompt as held where it was routed this recently, before that engine's events can say so
#: (llm-d's ``speculativeIndexing`` TTL; Dynamo's ``--router-predicted-ttl-secs``).
ROUTED_TTL_S = 2.0
#: The body's fields that make up the prompt, in the order a chat template renders them.
_PROMPT_FIELDS = ("tools", "system", "instructions", "messages", "input", "prompt")

Reason = Literal["cached", "uncached_tokens", "uncached_share", "decode_busy", "decode_stall", "always", "auto"]
"""Why a request goes local (``cached``) or over both legs; ``always``: ``pd_mode = "always"``, no decision;
``auto``: the SLO autopilot chose (:mod:`pdctl.gateway.autopilot`)."""
View = Literal["approx", "exact"]


def _walk(value: Any, out: list[str]) -> None:
    if isinstance(value, list):
        for v in value:
            _walk(v, out)
    elif isinstance(value, dict):
        for k, v in value.items():
            out.append(k)
            _walk(v, out)
    else:  # a string, number, bool or null
        out.append(value if isinstance(value, str) else str(value))


def prompt_text(body: Mapping[str, Any], endpoint: str | None = None) -> str:
    """The prompt of a request body as one string, the same for the same history (order kept, fields separated):
    for a chat, Messages or Responses request, the chat vLLM renders for it (:mod:`pdctl.gateway.prompt_view`:
    Claude Code's billing line dropped, ``cache_control`` ignored, agent routes converted to chat), else (another
    ``endpoint``, None, or a rewrite not known exactly) every prompt field of the raw body in order."""
    if endpoint is not None:
        req = prompt_view.chat_request(endpoint, body)
        text = prompt_view.canonical_text(req) if req is not None else None
        if text is not None:
            return text
    out: list[str] = []
    for name in _PROMPT_FIELDS:
        value = body.get(name)
        if value is not None:
            out.append(name)
            _walk(value, out)
    return "\x1f".join(out)


def block_hashes(text: str) -> list[int]:
    """Chained hashes of ``text``'s full :data:`BLOCK_CHARS` blocks (a partial last block is not cached by vLLM)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        parent = hash((parent, text[start : start + BLOCK_CHARS]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """One instance's blocks as the gateway saw them: an LRU set of chained block hashes, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``' leading blocks are held."""
        return leading(hashes, self._blocks)

    def insert(self, hashes: Iterable[int]) -> None:
        """Record ``hashes`` as held (most recently used), evicting the least recently used beyond capacity."""
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (the instance restarted, or its cache was reset)."""
        self._blocks.clear()


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Decision:
    """Where one request goes, and why (one object per request: compared and hashed by identity)."""

    local: bool
    reason: Reason
    decode: Instance | None
    """The decode chosen first (None: no decode available)."""
    cached_tokens: int
    uncached_tokens: int
    hashes: tuple[int, ...]
    """The approximate view's block hashes of the prompt (recorded on the instances that serve it)."""
    view: View = "approx"
    """The view the decision was made with: ``exact`` when the prompt's token ids and the decode's events were
    known (``routing.prefix_view = "exact"``)."""
    token_ids: tuple[int, ...] | None = None
    """The prompt's exact token ids (``prefix_view = "exact"`` only)."""
    approx_cached_tokens: int | None = None
    """Under the exact view, what the approximate view would have counted as cached on the same decode."""
    chars: int = 0
    """The length of the prompt's text (:func:`prompt_text`), to turn approximate blocks into tokens."""
    approx_local: bool | None = None
    """Under the exact view, whether the approximate view would have gone local (the views' drift)."""
    session: str | None = None
    """The request's session hint (:func:`pdctl.gateway.policy.session_hint`), for tie-breaks."""
    picks: list[str] = field(default_factory=list, compare=False, hash=False)
    """Each pick's access-log fields so far (:meth:`pdctl.gateway.policy.Pick.log_fields`), in order."""
    identity: agent_sessions.Identity | None = None
    """The request's agent session (:func:`pdctl.gateway.agent_sessions.identify`)."""
    cache_break: agent_sessions.Break | None = None
    """How the prompt compares with its session's previous turn (None: no session, or its first turn)."""

    def log_fields(self) -> str:
        """The decision as access-log fields, with every pick made so far and its candidates' scores."""
        if self.reason == "always":
            fields = "decision=always"
        else:
            fields = f"decision={self.reason} cached_tokens={self.cached_tokens} uncached_tokens={self.uncached_tokens}"
        if self.view == "exact":
            fields += f" view=exact approx_cached_tokens={self.approx_cached_tokens}"
        if self.identity is not None:
            fields += " " + self.identity.log_fields()
        if self.cache_break is not None:
            fields += " " + self.cache_break.log_fields()
        return " ".join([fields, *self.picks])


class PrefixRouter:
    """The per-instance views, the per-pool policies and the decision, for one gateway process; ``events``: the
    workers' KV cache events (``prefix_view = "exact"``, :mod:`pdctl.gateway.kv_view`), None for the approximate
    view alone. A ``kv_aware`` policy without events is a :class:`~pdctl.errors.ConfigError`."""

    def __init__(
        self, routing: RoutingConfig, events: KvEventSubscriber | None = None,
        sec_per_token: Callable[[], float | None] = lambda: None,
    ) -> None:  # fmt: skip
        if events is None and "kv_aware" in routing.policies:
            which = "prefill_policy" if routing.prefill_policy == "kv_aware" else "decode_policy"
            raise ConfigError("settings.json", f"routing.{which}",
                              "kv_aware reads the workers' KV cache events, which this gateway does not receive",
                              hint='set "prefix_view": "exact" in routing (the plan then starts the workers with '
                              '--kv-events-config), or choose cache_aware')  # fmt: skip
        self.routing = routing
        self.events = events
        self.sec_per_token = sec_per_token
        """The prefill seconds per prompt token measured so far (None: not yet), for ``local_max_stall_ms``."""
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
        self._prefilling: weakref.WeakKeyDictionary[Instance, weakref.WeakKeyDictionary[Decision, int]] = (
            weakref.WeakKeyDictionary()
        )
        """Per prefill, the uncached tokens of each request picked for it whose leg 1 has not succeeded yet (a
        request that ends otherwise drops out with its decision)."""
        self._exact_epoch: weakref.WeakKeyDictionary[Instance, int] = weakref.WeakKeyDictionary()

    def view(self, inst: Instance) -> PrefixIndex:
        """``inst``'s approximate view: created empty on first use, emptied when the instance came back from being
        down (a restarted engine's prefix cache is empty; :attr:`~pdctl.gateway.routing.Instance.epoch`)."""
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

    def record(self, inst: Instance, plan: Decision) -> None:
        """``inst`` computed (or pulled) ``plan``'s prompt: the approximate view holds its blocks now. A leg 1's
        end is the caller's to say, once (:meth:`leg1_done`)."""
        self.view(inst).insert(plan.hashes)

    def leg1_done(self, inst: Instance, plan: Decision) -> None:
        """``plan``'s leg 1 on ``inst`` ended, however: its tokens no longer count as ``inst``'s to compute."""
        pending = self._prefilling.get(inst)
        if pending is not None:
            pending.pop(plan, None)

    def prefilling_tokens(self, inst: Instance) -> int:
        """Prompt tokens ``inst`` still has to compute for the requests picked for it (their leg 1 not done)."""
        pending = self._prefilling.get(inst)
        return sum(pending.values()) if pending is not None else 0

    def cached(self, inst: Instance, plan: Decision, memo: dict[int, list[int]] | None = None) -> int:
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

    def pick(self, pool: Pool, role: Role, plan: Decision, among: Sequence[Instance] | None = None) -> Instance | None:
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
        turn = pool.turn((role,))
        memo = {} if memo is None else memo

        def cached(i: Instance) -> float:
            return self._cached(i, hashes, ids, prompt_tokens, chars, memo)[0]

        if name == "least_loaded" and r.pd_mode != "always":
            pick = policy.prefix_first(cands, cached, r, turn, sticky)
        elif name in policy.LOAD_POLICIES:
            pick = policy.by_load(name, cands, turn, pool.rng, sticky)
        elif name == "cache_aware":
            queued = self.prefilling_tokens if role == "prefill" else None
            pick = policy.cache_aware(cands, lambda i: cached(i) / max(1, prompt_tokens),
                                      lambda i: len(self.view(i)), r, turn, sticky, queued)  # fmt: skip
        else:

            def held(i: Instance) -> float:  # what the events say, or what was routed there a moment ago
                routed = prompt_tokens * self._routed_blocks(i, hashes) * BLOCK_CHARS // max(1, chars)
                return max(cached(i), min(prompt_tokens, routed))

            pick = policy.kv_aware(cands, lambda i: self._cost(i, role, prompt_tokens, held(i)), pool.rng, sticky)
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
        session: str | None = None, endpoint: str | None = None, identity: agent_sessions.Identity | None = None,
    ) -> Decision:  # fmt: skip
        """Choose the decode, count the prompt's uncached tokens on it, and decide local or P→D. ``token_ids``: the
        prompt's exact ids (the exact view is used where the decode has published events); ``session``: the
        ``x-session-id`` header (else the body's session, :func:`~pdctl.gateway.policy.session_hint`); ``endpoint``: the
        route, for the prompt as vLLM renders it (:func:`prompt_text`); ``identity``: the request's agent session
        (its id then breaks ties, and the turn is compared with the session's previous one,
        :class:`~pdctl.gateway.agent_sessions.CacheBreaks`). Under
        ``pd_mode = "always"`` nothing is chosen yet (``decision=always``; :meth:`pick` chooses per leg)."""
        chat = prompt_view.chat_request(endpoint, body) if endpoint is not None else None
        parts = prompt_view.prompt_parts(chat) if chat is not None else None
        text = ""
        if self._indexed:
            text = "\x1f".join(t for _, _, t in parts) if parts is not None else prompt_text(body)
        hashes = tuple(block_hashes(text))
        ids = tuple(token_ids) if token_ids is not None and self.events is not None else None
        if ids is not None:
            prompt_tokens = len(ids)
        chars = len(text)
        session = identity.session if identity is not None else policy.session_hint(body, session)
        brk = None
        if identity is not None and parts is not None:
            brk = self.breaks.observe(identity.session, parts, prompt_tokens, token_ids)
        if self.routing.pd_mode == "always":
            return Decision(False, "always", None, 0, prompt_tokens, hashes, token_ids=ids, chars=chars,
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
        reason = self._reason(decode, prompt_tokens - cached, prompt_tokens)
        approx_local = None
        if approx is not None:
            approx_local = self._reason(decode, prompt_tokens - approx, prompt_tokens) == "cached"
        exact_ids = ids if view == "exact" else None
        return Decision(reason == "cached" and decode is not None, reason, decode, cached, prompt_tokens - cached,
                        hashes, view, exact_ids, approx, chars, approx_local, session,
                        [pick.log_fields("decode")], identity, brk)  # fmt: skip

    def _reason(self, decode: Instance | None, uncached: int, prompt_tokens: int) -> Reason:
        r = self.routing
        if uncached > r.local_max_uncached_tokens:
            return "uncached_tokens"
        if uncached > r.local_max_uncached_share * prompt_tokens:
            return "uncached_share"
        if decode is not None and r.local_max_decode_requests is not None:
            if decode.in_flight >= r.local_max_decode_requests:
                return "decode_busy"
        if decode is not None and decode.in_flight > 0 and r.local_max_stall_ms is not None:
            spt = self.sec_per_token()
            if spt is not None and uncached * spt * 1000.0 > r.local_max_stall_ms:
                return "decode_stall"
        return "cached"
