"""``adaptive_decision``: under ``routing.pd_mode = "adaptive"``, the gateway's per-request decision, seen and judged.

Two fresh greedy probes through the gateway: a short one, which the thresholds send to decode alone when a fresh
prompt may go local (``local_max_uncached_share`` 1), and a long one, twice ``local_max_uncached_tokens``, which
must take both legs. Each path is read from ``x-pd-path`` and each output is compared, token for token with
verify's tie rule (:func:`pdctl.verify.proof.first_divergence`), with the same prompt computed whole on a decode
(the colocated reference, with a ``cache_salt`` so it computes every token). The KV link itself is proven by the
pair probes, which call the workers directly and so always take both legs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pdctl.verify.gateway_checks import Target
from pdctl.verify.link import PROBE_MAX_TOKENS, greedy_body, probe_prompt
from pdctl.verify.proof import Sample, first_divergence, parse_sample
from pdctl.verify.report import CheckResult, Timer

__all__ = ["check_adaptive"]


#: Whole words: a token each in the models' vocabularies, more than one by the gateway's estimate (four characters a
#: token), so a gateway without the model's tokenizer still counts the long probe past its threshold. Digits, one
#: token each, would be under-counted.
_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _word(i: int) -> str:
    return _WORDS[i % len(_WORDS)]


@dataclass(frozen=True, slots=True)
class _Seen:
    size: str
    tokens: int
    want: str
    path: str | None
    verdict: str  # "identical", "tie", "diverged", or why there is nothing to compare


def _judge(got: Sample | None, ref: Sample | None) -> str:
    if got is None or ref is None:
        return "no output" if got is None else "no reference"
    div = first_divergence(ref, got)
    return "identical" if div is None else ("tie" if div.verdict == "tie" else "diverged")


def _probe(t: Target, size: str, prompt: str, tokens: int, want: str) -> _Seen:
    d = t.dep.decode[0]
    body = greedy_body(t.model, prompt)
    headers = t.auth(t.api_key) | {"X-Request-Id": f"verify-adaptive-{size}-{uuid.uuid4().hex[:8]}"}
    r = t.http.call("POST", f"{t.gateway_url}/v1/completions", body=body, headers=headers)
    got = parse_sample(r.body) if r.ok else None
    ref_body = {**greedy_body(d.model_name, prompt), "cache_salt": uuid.uuid4().hex}
    ref = t.http.call("POST", f"{d.url}/v1/completions", body=ref_body)
    verdict = _judge(got, parse_sample(ref.body) if ref.ok else None) if r.ok else f"HTTP {r.status}"
    return _Seen(size, tokens, want, r.headers.get("x-pd-path"), verdict)


def check_adaptive(t: Target) -> CheckResult:
    """``adaptive_decision``: a short fresh probe local (when the thresholds allow it), a long one on both legs,
    both token-identical to the colocated reference."""
    timer = Timer()
    name = "adaptive_decision"
    r, d = t.dep.routing, t.dep.decode[0]
    limit = (d.max_model_len or 2048) - PROBE_MAX_TOKENS - 8
    nonce = uuid.uuid4().hex[:8]
    seen: list[_Seen] = []
    short, n_short = probe_prompt(t.http, d, f"pdctl verify {nonce} adaptive short.", "short", 0)
    local_ok = n_short <= r.local_max_uncached_tokens and r.local_max_uncached_share >= 1.0
    seen.append(_probe(t, "short", short, n_short, "local" if local_ok else "disagg"))
    # Twice the threshold: the gateway may only estimate token counts (no local tokenizer), and must still see
    # more than the threshold.
    target = 2 * r.local_max_uncached_tokens + 64
    if target <= limit:
        long, n_long = probe_prompt(t.http, d, f"pdctl verify {nonce} adaptive long.", "long", target, _word)
        if n_long > r.local_max_uncached_tokens:
            seen.append(_probe(t, "long", long, n_long, "disagg"))
    shown = "; ".join(f"{s.size} ({s.tokens} tokens): x-pd-path {s.path} (expected {s.want}), {s.verdict}"
                      for s in seen)  # fmt: skip
    wrong = [s for s in seen if s.path != s.want]
    diverged = [s for s in seen if s.verdict not in ("identical", "tie")]
    if wrong or diverged:
        return CheckResult(
            name, False, shown, timer.ms,
            "the gateway's adaptive decision or its output is not what routing.pd_mode = \"adaptive\" promises",
            "`pdctl logs gateway` shows each request's decision= and cached_tokens=; "
            "`curl -s $GATEWAY/metrics | grep pdctl_pd_decisions_total`",
        )  # fmt: skip
    if len(seen) < 2:
        shown += f"; no long probe: local_max_uncached_tokens ({r.local_max_uncached_tokens}) reaches max_model_len"
    if any(s.verdict == "tie" for s in seen):
        return CheckResult(name, None, shown + " (a numerical tie: inconclusive, not a failure)", timer.ms)
    return CheckResult(name, True, shown + " (greedy, vs colocated reference)", timer.ms)
