"""The approximate view: what each instance holds as the gateway saw it, from its own traffic, with no engine feedback.

Per instance the gateway keeps an LRU set of *block hashes* of the prompts it sent there: the approximate view of
llm-d's ``approx-prefix-cache-producer`` and SGLang's ``cache_aware``. A request's prompt becomes one canonical
string (:func:`prompt_text`: the chat vLLM renders, after its own rewrites such as dropping Claude Code's billing
line (:mod:`pdctl.gateway.prompt_view`), every message's fields and text in order, a completion's prompt, token ids
as numbers), cut into blocks of :data:`BLOCK_CHARS` characters, each block's hash chained to the previous one's,
so a block matches only when everything before it matches too. Turn k+1 of a conversation begins with turn k's
prompt, so its first blocks match on the instance that served turn k, until that instance is seen down (a
restarted engine starts with an empty cache, so its view starts empty too). The hashes are Python's own (per
process, never on the wire): each gateway process (``gateway.workers``) keeps its own view.

Characters become tokens by the prompt's own ratio: cached tokens = prompt tokens × matched characters / prompt
characters. vLLM also caches the answer's full blocks, which the view leaves out, so it under-counts what a
decode holds after a turn: the plan errs towards the prefill leg.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pdctl.gateway import conversation, prompt_view
from pdctl.gateway.routing.exact_view import leading

__all__ = ["BLOCK_CHARS", "PrefixIndex", "block_hashes", "prompt_text"]

#: Characters per block: about 64 tokens of English (llm-d clamps its approximate blocks to at least 64 tokens).
BLOCK_CHARS = 256
#: The body's fields that make up the prompt, in the order a chat template renders them.
_PROMPT_FIELDS = ("tools", "system", "instructions", "messages", "input", "prompt")


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
        text = conversation.canonical_text(req) if req is not None else None
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
