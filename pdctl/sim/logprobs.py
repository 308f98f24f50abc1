"""Top-k logprobs in vLLM's shapes for the simulator's generated tokens.

Each generated token comes from a 64-bit hash ``v`` (``SimEngine._token``); the same ``v`` fixes the
candidates and their logprobs, so a reply and its reference agree exactly when their tokens do. The chosen
token leads its runner-up by 0.5-2.5 nats, so a difference it shows is a clear one (the corrupted-KV fault),
except where the ``near-tie`` fault puts a runner-up 0.01 nats behind (and swaps the two for a request whose
KV came from prefill): the numerical tie of bf16 kernels in different batch shapes.

``completion_logprobs``: ``choices[0].logprobs`` of ``/v1/completions`` (``logprobs: k``), keys
``"token_id:N"`` with ``return_tokens_as_token_ids``. ``chat_logprobs``: ``choices[0].logprobs`` of
``/v1/chat/completions`` (``logprobs: true, top_logprobs: k``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdctl.sim.text import Tokenizer

__all__ = ["MAX_LOGPROBS", "chat_logprobs", "completion_logprobs", "runner_up", "top_candidates"]

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def runner_up(tok: Tokenizer, tid: int, v: int) -> int:
    """The second candidate after ``tid`` for hash ``v``."""
    return _alternatives(tok, tid, v)[0]


def _alternatives(tok: Tokenizer, tid: int, v: int) -> list[int]:
    words = tok.word_ids
    seen = {tid}
    out = []
    for j in range(len(words)):
        cand = words[((v >> 24) + 13 * j) % len(words)]
        if cand not in seen:
            seen.add(cand)
            out.append(cand)
    return out


def top_candidates(tok: Tokenizer, tid: int, v: int, k: int, tie_with: int | None = None) -> list[tuple[int, float]]:
    """The chosen token and ``k - 1`` others, best first, with their logprobs (the chosen one is included).

    ``tie_with``: a runner-up only 0.01 nats behind (the ``near-tie`` fault), before the usual margin.
    """
    best = -(0.2 + (v % 1000) / 1000.0)
    margin = 0.5 + ((v >> 12) % 1000) / 500.0
    out = [(tid, best)]
    if tie_with is not None:
        out.append((tie_with, best - 0.01))
    for cand in _alternatives(tok, tid, v):
        if len(out) >= max(k, 1):
            break
        if cand != tie_with:
            out.append((cand, best - margin - 0.3 * (len(out) - 1)))
    return out


def _name(tok: Tokenizer, tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else tok.token_text(tid)


def completion_logprobs(
    tok: Tokenizer, ids: Sequence[int], scores: Sequence[int], k: int, as_ids: bool, ties: Mapping[int, int]
) -> dict[str, Any]:
    """vLLM's ``CompletionLogProbs``: text_offset, token_logprobs, tokens, top_logprobs."""
    offsets: list[int] = []
    lps: list[float] = []
    tokens: list[str] = []
    tops: list[dict[str, float]] = []
    pos = 0
    for i, (tid, v) in enumerate(zip(ids, scores, strict=True)):
        cands = top_candidates(tok, tid, v, k, ties.get(i))
        offsets.append(pos)
        pos += len(tok.token_text(tid))
        lps.append(cands[0][1])
        tokens.append(_name(tok, tid, as_ids))
        tops.append({_name(tok, c, as_ids): lp for c, lp in cands})
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(
    tok: Tokenizer, ids: Sequence[int], scores: Sequence[int], k: int, as_ids: bool, ties: Mapping[int, int]
) -> dict[str, Any]:
    """vLLM's ``ChatCompletionLogProbs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for i, (tid, v) in enumerate(zip(ids, scores, strict=True)):
        cands = top_candidates(tok, tid, v, max(k, 1), ties.get(i))
        top = [
            {"token": _name(tok, c, as_ids), "logprob": lp, "bytes": list(tok.token_text(c).encode())}
            for c, lp in cands[:k]
        ]
        name = _name(tok, tid, as_ids)
        content.append({"token": name, "logprob": cands[0][1], "bytes": list(name.encode()), "top_logprobs": top})
    return {"content": content}
