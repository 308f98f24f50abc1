"""The simulated engine's automatic prefix cache: full prompt blocks, keyed by a hash chain, in LRU order.

A block's key is ``blake2b(previous key + its token ids)``, the chain seeded by the request's ``cache_salt``, so a
key stands for the whole prefix up to its block (as vLLM's block hashes do) and salted requests share nothing
with unsalted ones. Only full blocks of ``block_size`` tokens are cached; a lookup counts the leading blocks
already known, and the engine still computes at least the prompt's last token. The cache holds at most
``capacity_blocks`` keys, evicting the least recently used.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PrefixCache"]


class PrefixCache:
    """Block keys of the prompts an engine computed; ``enabled`` False (``--no-enable-prefix-caching``) keeps none."""

    def __init__(self, block_size: int, capacity_blocks: int, *, enabled: bool = True) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.enabled = enabled
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def block_keys(self, prompt_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """One key per full block of ``prompt_ids``, each covering the prefix up to that block."""
        bs = self.block_size
        h = hashlib.blake2b((cache_salt or "").encode(), digest_size=16).digest()
        keys = []
        raw = array("Q", prompt_ids).tobytes()
        step = bs * 8
        for b in range(len(prompt_ids) // bs):
            h = hashlib.blake2b(h + raw[b * step : (b + 1) * step], digest_size=16).digest()
            keys.append(h)
        return keys

    def hits(self, prompt_ids: Sequence[int], cache_salt: str | None) -> int:
        """Prompt tokens already cached (leading full blocks), marking those blocks recently used."""
        if not self.enabled:
            return 0
        n = 0
        for key in self.block_keys(prompt_ids, cache_salt):
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            n += 1
        # vLLM always computes at least the last prompt token.
        return min(n * self.block_size, max(0, len(prompt_ids) - 1))

    def remember(self, prompt_ids: Sequence[int], cache_salt: str | None) -> None:
        """Cache every full block of a computed prompt, evicting the least recently used beyond capacity."""
        if not self.enabled:
            return
        for key in self.block_keys(prompt_ids, cache_salt):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity_blocks:
            self._keys.popitem(last=False)
