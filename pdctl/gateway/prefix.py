"""Adaptive PD (``routing.pd_mode = "adaptive"``): what each instance holds, and the per-request decision.

**The view.** Per instance the gateway keeps an LRU set of *block hashes* of the prompts it sent there: the
approximate view of llm-d's ``approx-prefix-cache-producer`` and SGLang's ``cache_aware``, built from the gateway's
own traffic with no engine feedback. A request's prompt becomes one canonical string (:func:`prompt_text`: every
message's fields and text in order, a completion's prompt, token ids as numbers), cut into blocks of
:data:`BLOCK_CHARS` characters, each block's hash chained to the previous one's, so a block matches only when
everything before it matches too. Turn k+1 of a conversation begins with turn k's prompt, so its first blocks
match on the instance that served turn k, until that instance is seen down (a restarted engine starts with an
empty cache, so its view starts empty too). The hashes are Python's own (per process, never on the wire): each
gateway process (``gateway.workers``) keeps its own view.

Characters become tokens by the prompt's own ratio: cached tokens = prompt tokens × matched characters / prompt
characters. vLLM also caches the answer's full blocks, which the view leaves out, so it under-counts what a
decode holds after a turn: the decision errs towards the prefill leg.

**The decision** (:meth:`PrefixRouter.decide`), following llm-d's ``prefix-based-pd-decider`` and Dynamo's
conditional disaggregation (``../shared/reference/routing-peers.md`` §1):

1. the decode first: most cached blocks, ties to the least loaded, and the least loaded outright when the pool
   is imbalanced (:data:`IMBALANCE_ABS` and :data:`IMBALANCE_REL`, the cache-aware routers' defaults);
2. the prompt's tokens not cached there (``uncached``);
3. local (that decode alone computes the rest, ``x-pd-path: local``) when ``uncached <=
   routing.local_max_uncached_tokens`` and ``uncached / prompt <= routing.local_max_uncached_share`` and the
   decode has fewer than ``routing.local_max_decode_requests`` requests in flight; otherwise P→D, with the
   prefill chosen the same way by its own cached prefix (vLLM's prefill computes the whole prompt except its own
   cache hits; decode pulls only the blocks it lacks).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pdctl.config import RoutingConfig
from pdctl.gateway.routing import Instance, Pool, Role

__all__ = ["BLOCK_CHARS", "Decision", "PrefixIndex", "PrefixRouter", "block_hashes", "prompt_text"]

#: Characters per block: about 64 tokens of English (llm-d clamps its approximate blocks to at least 64 tokens).
BLOCK_CHARS = 256
#: The pool is imbalanced when the busiest and the idlest instance differ by more than this many requests ...
IMBALANCE_ABS = 64
#: ... and the busiest has more than this many times the idlest's (SGLang / vllm-router ``cache_aware``).
IMBALANCE_REL = 1.5
#: The body's fields that make up the prompt, in the order a chat template renders them.
_PROMPT_FIELDS = ("tools", "system", "instructions", "messages", "input", "prompt")

Reason = Literal["cached", "uncached_tokens", "uncached_share", "decode_busy"]


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


def prompt_text(body: Mapping[str, Any]) -> str:
    """The prompt of a request body as one string, the same for the same history (order kept, fields separated)."""
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
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

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


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes under ``pd_mode = "adaptive"``, and why."""

    local: bool
    reason: Reason
    decode: Instance | None
    """The decode chosen first (None: no decode available)."""
    cached_tokens: int
    uncached_tokens: int
    hashes: tuple[int, ...]

    def log_fields(self) -> str:
        """The decision as access-log fields."""
        return f"decision={self.reason} cached_tokens={self.cached_tokens} uncached_tokens={self.uncached_tokens}"


class PrefixRouter:
    """The per-instance views and the decision, for one gateway process."""

    def __init__(self, routing: RoutingConfig) -> None:
        self.routing = routing
        self._views: weakref.WeakKeyDictionary[Instance, tuple[int, PrefixIndex]] = weakref.WeakKeyDictionary()

    def view(self, inst: Instance) -> PrefixIndex:
        """``inst``'s view: created empty on first use, emptied when the instance came back from being down (a
        restarted engine's prefix cache is empty; :attr:`~pdctl.gateway.routing.Instance.epoch`)."""
        held = self._views.get(inst)
        if held is None or held[0] != inst.epoch:
            held = self._views[inst] = (inst.epoch, PrefixIndex(self.routing.prefix_cache_blocks))
        return held[1]

    def pick(self, pool: Pool, role: Role, hashes: Sequence[int]) -> tuple[Instance | None, int]:
        """The instance of ``role`` holding most of ``hashes`` (ties and an imbalanced pool: least loaded), and how
        many leading blocks it holds."""
        candidates = [i for i in pool.instances if i.role == role and i.available()]
        if not candidates:
            return None, 0
        matched = {i: self.view(i).match(hashes) for i in candidates}
        loads = [i.in_flight for i in candidates]
        lo, hi = min(loads), max(loads)
        if hi - lo > IMBALANCE_ABS and hi > lo * IMBALANCE_REL:
            best = [i for i in candidates if i.in_flight == lo]
        else:
            top = max(matched.values())
            best = [i for i in candidates if matched[i] == top]
        inst = pool.choose((role,), among=best)
        return inst, matched[inst] if inst is not None else 0

    def decide(self, pool: Pool, body: Mapping[str, Any], prompt_tokens: int) -> Decision:
        """Choose the decode, count the prompt's uncached tokens on it, and decide local or P→D."""
        text = prompt_text(body)
        hashes = tuple(block_hashes(text))
        decode, blocks = self.pick(pool, "decode", hashes)
        chars = max(1, len(text))
        cached = min(prompt_tokens, prompt_tokens * blocks * BLOCK_CHARS // chars)
        uncached = prompt_tokens - cached
        r = self.routing
        reason: Reason = "cached"
        if uncached > r.local_max_uncached_tokens:
            reason = "uncached_tokens"
        elif uncached > r.local_max_uncached_share * prompt_tokens:
            reason = "uncached_share"
        elif decode is not None and r.local_max_decode_requests is not None:
            if decode.in_flight >= r.local_max_decode_requests:
                reason = "decode_busy"
        return Decision(reason == "cached" and decode is not None, reason, decode, cached, uncached, hashes)
