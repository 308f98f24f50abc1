"""The simulated engine's automatic prefix cache: full blocks, keyed by a hash chain, in LRU order, and its KV events.

Mirrors vLLM 0.32's ``BlockPool`` (vllm/v1/core/block_pool.py: ``cache_full_blocks``, ``reset_prefix_cache``,
``_maybe_evict_cached_block``, ``take_events``) as far as the simulator needs it:

- Keys. A block's key is ``blake2b(previous key + its token ids)``, the chain seeded by the request's
  ``cache_salt``, so a key stands for the whole prefix up to its block (as vLLM's block hashes do) and salted
  requests share nothing with unsalted ones. Only full blocks of ``block_size`` tokens are keyed.
- :meth:`PrefixCache.hits`: the leading blocks already cached, in tokens (the engine still computes at least the
  prompt's last token).
- :meth:`PrefixCache.store`: a request's full blocks past those it already has enter the cache, the prompt's
  and (as the decode fills them) the generated tokens'; beyond ``capacity_blocks`` the least recently used go.
- :meth:`PrefixCache.reset`: ``/reset_prefix_cache``, everything dropped.
- Events, when ``record_events``: :class:`~pdctl.vllm.kv_events.BlockStored` per store, one
  :class:`~pdctl.vllm.kv_events.BlockRemoved` per evicted block, :class:`~pdctl.vllm.kv_events.AllBlocksCleared`
  per reset, queued until the engine's step ends and takes them (:meth:`PrefixCache.take_events`).
  The events' 64-bit block hashes are the keys' low 64 bits, as vLLM's ``maybe_convert_block_hash`` makes them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pdctl.vllm.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["MEDIUM", "PrefixCache", "event_hash"]

MEDIUM = "GPU"
"""The ``medium`` of every event: vLLM's device cache says ``"GPU"`` (even on CPU)."""

Event = BlockStored | BlockRemoved | AllBlocksCleared


def event_hash(key: bytes) -> int:
    """A block key -> the 64-bit int its events carry (vLLM: the hash as a big-endian int, masked to 64 bits)."""
    return int.from_bytes(key[-8:], "big")


class PrefixCache:
    """Block keys of the tokens an engine computed; ``enabled`` False (``--no-enable-prefix-caching``) keeps none."""

    def __init__(
        self, block_size: int, capacity_blocks: int, *, enabled: bool = True, record_events: bool = False
    ) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.enabled = enabled
        self.record_events = record_events and enabled
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[Event] = []

    def __len__(self) -> int:
        return len(self._keys)

    def block_keys(
        self, token_ids: Sequence[int], cache_salt: str | None, keys: list[bytes] | None = None
    ) -> list[bytes]:
        """One key per full block of ``token_ids``, each covering the prefix up to that block.

        With ``keys`` (the keys of a prefix of ``token_ids``), that list is extended in place and returned."""
        bs = self.block_size
        out = [] if keys is None else keys
        h = out[-1] if out else hashlib.blake2b((cache_salt or "").encode(), digest_size=16).digest()
        first = len(out)
        last = len(token_ids) // bs
        if last <= first:
            return out
        raw = array("Q", token_ids[first * bs : last * bs]).tobytes()
        step = bs * 8
        for b in range(last - first):
            h = hashlib.blake2b(h + raw[b * step : (b + 1) * step], digest_size=16).digest()
            out.append(h)
        return out

    def hits(self, prompt_ids: Sequence[int], cache_salt: str | None, keys: Sequence[bytes] | None = None) -> int:
        """Prompt tokens already cached (leading full blocks), marking those blocks recently used.

        ``keys``: the prompt's :meth:`block_keys`, when the caller has them already."""
        if not self.enabled:
            return 0
        n = 0
        for key in self.block_keys(prompt_ids, cache_salt) if keys is None else keys:
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            n += 1
        # vLLM always computes at least the last prompt token.
        return min(n * self.block_size, max(0, len(prompt_ids) - 1))

    def store(
        self, token_ids: Sequence[int], keys: Sequence[bytes], num_cached: int, cache_salt: str | None = None
    ) -> int:
        """Cache the blocks ``keys[num_cached:]`` (of ``token_ids``, the request's tokens so far); returns
        ``len(keys)``, the request's new count of cached blocks.

        As vLLM's ``cache_full_blocks``, one BlockStored announces them all, its parent the block before the
        first (None at the start), even if another request stored the same blocks meanwhile."""
        if not self.enabled or num_cached >= len(keys):
            return max(num_cached, len(keys))
        new = keys[num_cached:]
        for key in new:
            if key in self._keys:
                self._keys.move_to_end(key)
        fresh = sum(key not in self._keys for key in new)
        own = set(new)
        evicted: list[bytes] = []
        while self._keys and len(self._keys) + fresh > self.capacity_blocks:
            oldest = next(iter(self._keys))
            if oldest in own:
                break
            del self._keys[oldest]
            evicted.append(oldest)
        for key in new:
            self._keys[key] = None
        late: list[bytes] = []
        while len(self._keys) > self.capacity_blocks:  # only when one request holds more than the whole cache
            late.append(self._keys.popitem(last=False)[0])
        if self.record_events:
            self._removed(evicted)
            self._events.append(self._stored(token_ids, keys, num_cached, cache_salt))
            self._removed(late)
        return len(keys)

    def _stored(
        self, token_ids: Sequence[int], keys: Sequence[bytes], num_cached: int, cache_salt: str | None
    ) -> BlockStored:
        bs = self.block_size
        # vLLM's extra keys: the cache salt, on the first block only (generate_block_hash_extra_keys).
        extra: list[tuple[Any, ...] | None] = [None] * (len(keys) - num_cached)
        if num_cached == 0 and cache_salt:
            extra[0] = (cache_salt,)
        return BlockStored(
            block_hashes=[event_hash(k) for k in keys[num_cached:]],
            parent_block_hash=event_hash(keys[num_cached - 1]) if num_cached else None,
            token_ids=list(token_ids[num_cached * bs : len(keys) * bs]),
            block_size=bs,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
            extra_keys=extra,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def _removed(self, keys: Sequence[bytes]) -> None:
        self._events.extend(BlockRemoved(block_hashes=[event_hash(k)], medium=MEDIUM, group_idx=0) for k in keys)

    def reset(self) -> None:
        """Drop every block (``/reset_prefix_cache``): one AllBlocksCleared, no BlockRemoved."""
        self._keys.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list[Event]:
        """The events since the last call, oldest first (vLLM's ``BlockPool.take_events``)."""
        events, self._events = self._events, []
        return events
