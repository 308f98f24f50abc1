"""The KV proof's judgement: is a PD completion the reference's, and if not, is it a tie or corruption?

Both sides are greedy completions of one prompt with their top-k logprobs (vLLM's ``logprobs: k`` on
``/v1/completions`` with ``return_tokens_as_token_ids``, so each candidate is keyed ``"token_id:N"``)::

    identical token ids                                   -> proven
    first difference at position i, where both sides put
      the two tokens within TIE_TOLERANCE_NATS of each
      other (each is in the other's top-k)                -> tie: CPU bf16 kernels are not batch-invariant,
                                                             so a near-tie may break either way (re-run)
    any other first difference                            -> corruption: the reference is sure of its token
                                                             and decode computed something else

The margins come from the top-k lists, so the verdict needs nothing but the two replies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "TIE_TOLERANCE_NATS",
    "TOP_K",
    "Divergence",
    "Sample",
    "Step",
    "drift",
    "first_divergence",
    "margins",
    "parse_sample",
    "show_token",
]

TOP_K = 5
# How far apart (in log-probability) two tokens may be and still count as tied. vLLM CPU computes logits in
# bf16: near the tiny model's logit sizes (8-32) neighbouring bf16 values are 0.0625-0.125 apart, so the
# prefill-computed KV and the colocated reference can round one logit a step differently. A different model
# or an altered KV moves logprobs by whole nats and brings tokens outside each other's top-k (docs/verify.md).
TIE_TOLERANCE_NATS = 0.15
_ID_PREFIX = "token_id:"

Verdict = Literal["tie", "corruption"]


@dataclass(frozen=True, slots=True)
class Step:
    """One generated position: the chosen token, its logprob and the top-k candidates (id -> logprob)."""

    token: int
    logprob: float | None
    top: Mapping[int, float]

    @property
    def margin(self) -> float | None:
        """Top-1 minus top-2 logprob at this position (None with fewer than two candidates)."""
        best = sorted(self.top.values(), reverse=True)
        return best[0] - best[1] if len(best) >= 2 else None


@dataclass(frozen=True, slots=True)
class Sample:
    """One greedy completion: its token ids, text, and per-position logprobs when the server sent them."""

    tokens: tuple[int, ...]
    text: str | None
    steps: tuple[Step, ...] | None = None


def _token_id(key: str) -> int | None:
    if key.startswith(_ID_PREFIX):
        try:
            return int(key[len(_ID_PREFIX) :])
        except ValueError:
            return None
    return None


def _steps(logprobs: Any, tokens: Sequence[int]) -> tuple[Step, ...] | None:
    if not isinstance(logprobs, Mapping):
        return None
    lps, tops = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if not isinstance(lps, list) or not isinstance(tops, list) or len(tops) < len(tokens):
        return None
    out = []
    for i, tid in enumerate(tokens):
        top: dict[int, float] = {}
        if isinstance(tops[i], Mapping):
            for key, value in tops[i].items():
                cid = _token_id(str(key))
                if cid is not None and isinstance(value, int | float):
                    top[cid] = float(value)
        lp = lps[i] if i < len(lps) and isinstance(lps[i], int | float) else None
        out.append(Step(tid, None if lp is None else float(lp), top))
    return tuple(out)


def parse_sample(body: Any) -> Sample | None:
    """The first choice of a ``/v1/completions`` reply (``return_token_ids``), or None without token ids."""
    if not isinstance(body, Mapping):
        return None
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    c = choices[0]
    ids = c.get("token_ids")
    if not isinstance(ids, list) or not ids:
        return None
    tokens = tuple(int(t) for t in ids)
    text = c.get("text")
    return Sample(tokens, text if isinstance(text, str) else None, _steps(c.get("logprobs"), tokens))


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first position where PD and the reference chose different tokens, and what the logprobs say.

    ``ref_margin`` / ``pd_margin``: each side's top-1 minus top-2 there. ``ref_gap``: how much the reference
    prefers its own token over PD's (None when PD's token is not in its top-k: at least its top-k spread);
    ``pd_gap`` the same from PD's side. ``drift``: the largest logprob difference of one token between the two
    sides over the identical prefix and this position (how much the two computations' numbers moved apart).
    """

    position: int
    ref_token: int | None
    pd_token: int | None
    ref_margin: float | None
    pd_margin: float | None
    ref_gap: float | None
    pd_gap: float | None
    drift: float | None
    verdict: Verdict

    def to_json(self) -> dict[str, Any]:
        """Plain data for the check's ``data`` and the benchmark."""
        return {
            "position": self.position,
            "ref_token": self.ref_token,
            "pd_token": self.pd_token,
            "ref_margin": _round(self.ref_margin),
            "pd_margin": _round(self.pd_margin),
            "ref_gap": _round(self.ref_gap),
            "pd_gap": _round(self.pd_gap),
            "drift": _round(self.drift),
            "verdict": self.verdict,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


def _gap(step: Step | None, own: int | None, other: int | None) -> float | None:
    if step is None or own is None or other is None or own not in step.top or other not in step.top:
        return None
    return step.top[own] - step.top[other]


def _drift(ref: Sequence[Step], pd: Sequence[Step], upto: int) -> float | None:
    diffs = [
        abs(r.top[t] - p.top[t])
        for r, p in zip(ref[: upto + 1], pd[: upto + 1], strict=False)
        for t in r.top.keys() & p.top.keys()
    ]
    return max(diffs) if diffs else None


def drift(ref: Sample, pd: Sample) -> float | None:
    """The largest logprob difference of one token between the two sides, up to their first difference."""
    if ref.steps is None or pd.steps is None:
        return None
    n = min(len(ref.tokens), len(pd.tokens))
    upto = next((k for k in range(n) if ref.tokens[k] != pd.tokens[k]), n - 1)
    return _drift(ref.steps, pd.steps, upto)


def margins(sample: Sample | None) -> list[float | None] | None:
    """Each position's top-1 minus top-2 logprob (None without logprobs)."""
    if sample is None or sample.steps is None:
        return None
    return [_round(s.margin) for s in sample.steps]


def first_divergence(ref: Sample, pd: Sample, tolerance: float = TIE_TOLERANCE_NATS) -> Divergence | None:
    """None when the token ids are identical; else the first difference, classified as tie or corruption."""
    if ref.tokens == pd.tokens:
        return None
    n = min(len(ref.tokens), len(pd.tokens))
    i = next((k for k in range(n) if ref.tokens[k] != pd.tokens[k]), n)
    rt = ref.tokens[i] if i < len(ref.tokens) else None
    pt = pd.tokens[i] if i < len(pd.tokens) else None
    rs = ref.steps[i] if ref.steps is not None and i < len(ref.steps) else None
    ps = pd.steps[i] if pd.steps is not None and i < len(pd.steps) else None
    ref_gap, pd_gap = _gap(rs, rt, pt), _gap(ps, pt, rt)
    tie = ref_gap is not None and pd_gap is not None and ref_gap < tolerance and pd_gap < tolerance
    drift = _drift(ref.steps, pd.steps, i) if ref.steps is not None and pd.steps is not None else None
    return Divergence(
        i,
        rt,
        pt,
        rs.margin if rs else None,
        ps.margin if ps else None,
        ref_gap,
        pd_gap,
        drift,
        "tie" if tie else "corruption",
    )


def show_token(token: int | None, text: str | None) -> str:
    """``id 1234 "ab"``: the id and its text as a JSON string (control characters and U+FFFD escaped)."""
    if token is None:
        return "no token (the output ended)"
    if text is None:
        return f"id {token}"
    shown = json.dumps(text, ensure_ascii=False).replace("\ufffd", "\\ufffd")
    return f"id {token} {shown}"
