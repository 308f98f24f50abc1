"""The exact view (``routing.prefix_view = "exact"``, read by adaptive PD and the ``kv_aware`` and ``cache_aware``
routing policies): what each worker's prefix cache holds, rebuilt from the worker's own vLLM KV cache events
(:mod:`pdctl.gateway.routing.kv_events` receives them).

- :func:`token_block_hashes`: a prompt's token ids -> chained hashes of its full blocks, the keys of the view.
- :class:`ExactIndex`: one worker's cached blocks. vLLM's block hashes depend on its hash algorithm and seed, so
  each ``BlockStored`` is re-hashed here from its ``token_ids``, chained from the parent's (llm-d does the same);
  the engine's hashes are kept only to find a parent and to apply ``BlockRemoved``. A stored block whose parent
  is unknown (published before the gateway listened, or lost) cannot be chained and is left out: the view then
  under-counts, and the decision errs towards the prefill leg. Blocks stored with ``extra_keys`` (a LoRA, a
  ``cache_salt``, multimodal inputs) hash with them and never match a plain prompt, as in the engine. Each view
  holds at most ``routing.kv_events_max_blocks`` blocks, and at most twice what its engine's KV cache holds once
  the engine reported it (more than the engine can hold: the view starts over).

The chooser (:mod:`pdctl.gateway.routing.chooser`) reads the views, for the plan and for the policies' scores
(:mod:`pdctl.gateway.routing.policies`); a worker with no events yet, or a request whose exact token ids are
unknown (:meth:`pdctl.gateway.tokens.TokenCounter.prompt_ids`), is judged by the approximate view
(:mod:`pdctl.gateway.routing.approx_view`) instead.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from pdctl.config.settings import DEFAULT_KV_EVENTS_MAX_BLOCKS
from pdctl.vllm.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored

__all__ = ["ExactIndex", "leading", "token_block_hashes"]


def _frozen(x: object) -> object:
    """A hashable form of an ``extra_keys`` entry: msgpack has no tuples, so nested ones arrive as lists."""
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(y) for y in x)
    if isinstance(x, dict):
        return tuple((_frozen(k), _frozen(v)) for k, v in x.items())
    return x


def _chain(parent: int, block: Sequence[int], extra: object = None) -> int:
    return hash((parent, tuple(block), extra))


def leading(hashes: Sequence[int], held: Container[int]) -> int:
    """How many of ``hashes``, from the first, are in ``held`` (a chained block matches only after its prefix)."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


def token_block_hashes(ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full ``block_size`` blocks of ``ids`` (vLLM caches full blocks only)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = _chain(parent, ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class ExactIndex:
    """One worker's prefix cache, as its events describe it (module docstring)."""

    __slots__ = ("_held", "_ours", "block_size", "max_blocks", "orphans", "overflows")

    def __init__(self, max_blocks: int = DEFAULT_KV_EVENTS_MAX_BLOCKS) -> None:
        self.block_size: int | None = None
        """The engine's block size, from its latest ``BlockStored`` (None: no event yet)."""
        self.max_blocks = max_blocks
        """At most this many blocks are held; one more empties the view (an engine holds fewer: the events lie)."""
        self._ours: dict[BlockHash, int] = {}
        self._held: dict[int, int] = {}
        self.orphans = 0
        """Stored blocks left out because their parent was unknown."""
        self.overflows = 0
        """How often the view started over because it would have held more than ``max_blocks``."""

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        """Apply one event."""
        if isinstance(event, AllBlocksCleared):
            self.clear()
        elif isinstance(event, BlockRemoved):
            for eh in event.block_hashes:
                ours = self._ours.pop(eh, None)
                if ours is not None:
                    left = self._held[ours] - 1
                    if left:
                        self._held[ours] = left
                    else:
                        del self._held[ours]
        else:
            self._store(event)

    def _store(self, ev: BlockStored) -> None:
        if ev.group_idx not in (None, 0):  # hybrid models' other KV groups (sliding window): not the prefix's
            return
        bs = ev.block_size
        if bs < 1:
            raise ValueError(f"block_size {bs}")
        if bs != self.block_size:  # the latest size wins: a first message cannot pin a wrong one
            self.clear()
            self.block_size = bs
        if ev.parent_block_hash is None:
            parent: int | None = 0
        else:
            parent = self._ours.get(ev.parent_block_hash)
        if parent is None:
            self.orphans += len(ev.block_hashes)
            return
        extras = ev.extra_keys or ()
        for i, eh in enumerate(ev.block_hashes):
            block = ev.token_ids[i * bs : (i + 1) * bs]
            if len(block) != bs:
                return
            extra = extras[i] if i < len(extras) else None
            parent = _chain(parent, block, _frozen(extra) if extra is not None else None)
            if eh not in self._ours:
                if len(self._ours) >= self.max_blocks:
                    self.clear()
                    self.overflows += 1
                    return
                self._ours[eh] = parent
                self._held[parent] = self._held.get(parent, 0) + 1

    def match(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``' leading blocks (:func:`token_block_hashes`, this index's block size) are held."""
        return leading(hashes, self._held)

    def clear(self) -> None:
        """Forget every block (the block size stays: it is the engine's)."""
        self._ours.clear()
        self._held.clear()
