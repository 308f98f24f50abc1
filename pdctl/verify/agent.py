"""``agent_session``: two turns of a Claude-Code-shaped session through ``/v1/messages``; the second is judged cached.

Claude Code sends a billing line as its first system block, ``x-anthropic-billing-header: ...; cch=<new every
request>;`` (anthropics/claude-code#40652), which vLLM 0.32 drops before rendering, so the engine's prefix cache
hits while a gateway hashing the raw request would judge every turn new. The check sends turn 1 (the billing line,
a system prompt of about twice ``routing.local_max_uncached_tokens`` tokens with ``cache_control``, a user turn with
a ``<system-reminder>`` block; no tools, which vLLM refuses without ``--enable-auto-tool-choice``), then turn 2 (a
new ``cch``, turn 1's answer and a short user turn) with the same ``x-claude-code-session-id``:

- under adaptive PD, turn 2 must take the local path (``x-pd-path: local``) on turn 1's decode: its prompt is longer
  than the threshold, so only the gateway's view of what that decode holds can send it there;
- the decode's own prefix-cache hits (``vllm:prefix_cache_hits_total``) must rise on turn 2 under adaptive PD (it
  computed turn 2 itself); under always-PD, where there is no decision to judge, they are shown, and a decode whose
  hits do not rise (a connector that loads every block) makes the check inconclusive, not failed.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from pdctl.verify.gateway_checks import Target
from pdctl.verify.link import probe_prompt
from pdctl.verify.report import CheckResult, Timer
from pdctl.verify.wire import metric_total

__all__ = ["check_agent"]

_HITS = "vllm:prefix_cache_hits_total"
#: Whole words (a token each in the models' vocabularies, more than one by a gateway's four-characters estimate), so a
#: gateway without the model's tokenizer still counts the system prompt past its threshold; digits would not be.
_WORDS = "read write edit search list build test lint format commit branch merge review deploy debug trace".split()


def _word(i: int) -> str:
    return _WORDS[i % len(_WORDS)]


def _billing() -> dict[str, str]:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.177.{secrets.token_hex(2)[:3]}; "
                                    f"cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};"}  # fmt: skip


def _hits(t: Target) -> float | None:
    d = t.dep.decode[0]
    r = t.http.call("GET", f"{d.url}/metrics")
    return metric_total(r.text, _HITS) if r.ok else None


def _answer(body: Any) -> str:
    blocks = body.get("content") if isinstance(body, dict) else None
    texts = [b.get("text", "") for b in blocks or () if isinstance(b, dict) and b.get("type") == "text"]
    return "".join(texts) or "ok"


def check_agent(t: Target) -> CheckResult:
    """``agent_session`` (module docstring)."""
    timer = Timer()
    name = "agent_session"
    r, d = t.dep.routing, t.dep.decode[0]
    adaptive = r.pd_mode == "adaptive"
    nonce = uuid.uuid4().hex[:8]
    target = 2 * r.local_max_uncached_tokens + 64
    limit = (d.max_model_len or 2048) - 128
    if target > limit:
        if adaptive:
            return CheckResult(name, None, f"skipped: a prompt of {target} tokens (twice local_max_uncached_tokens) "
                               f"does not fit max_model_len", timer.ms)  # fmt: skip
        target = limit // 2  # always-PD: any size shows the decode's own prefix-cache hits
    system, n_system = probe_prompt(t.http, d, f"You are Claude Code, session {nonce}.", "long", target, _word)
    session = f"pdctl-verify-{nonce}"
    headers = t.auth(t.api_key) | {"x-claude-code-session-id": session, "anthropic-version": "2023-06-01"}
    reminder = {"type": "text", "text": "<system-reminder>\nBe brief.\n</system-reminder>"}
    ask = {"type": "text", "text": "List the files.", "cache_control": {"type": "ephemeral"}}
    user1: dict[str, Any] = {"role": "user", "content": [reminder, ask]}

    def turn(messages: list[dict[str, Any]], i: int) -> Any:
        blocks = [_billing(), {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
        body = {"model": t.model, "max_tokens": 8, "temperature": 0, "messages": messages, "system": blocks}
        return t.http.call("POST", f"{t.gateway_url}/v1/messages", body=body,
                           headers=headers | {"X-Request-Id": f"verify-agent-{nonce}-{i}"})  # fmt: skip

    first = turn([user1], 1)
    if not first.ok:
        return CheckResult(name, False, f"turn 1: HTTP {first.status} {first.text[:200]}", timer.ms,
                           "the gateway or the decode refused a Claude-Code-shaped /v1/messages request",
                           "`pdctl logs gateway | grep verify-agent`")  # fmt: skip
    user2 = {"role": "user", "content": [{"type": "text", "text": "And the tests?",
                                          "cache_control": {"type": "ephemeral"}}]}  # fmt: skip
    history: list[dict[str, Any]] = [{"role": "user", "content": [dict(b) for b in user1["content"]]},
               {"role": "assistant", "content": [{"type": "text", "text": _answer(first.body)}]}, user2]  # fmt: skip
    history[0]["content"][-1].pop("cache_control", None)  # the rolling breakpoint moved to the newest block
    before = _hits(t)
    second = turn(history, 2)
    after = _hits(t)
    if not second.ok:
        return CheckResult(name, False, f"turn 2: HTTP {second.status} {second.text[:200]}", timer.ms)
    p1, p2 = first.headers.get("x-pd-path"), second.headers.get("x-pd-path")
    hits = None if before is None or after is None else after - before
    shown = (f"turn 1 ({n_system}-token system prompt): x-pd-path {p1}; turn 2 (new billing line): x-pd-path {p2}"
             + ("" if hits is None else f", decode prefix-cache hits +{hits:.0f} tokens"))  # fmt: skip
    if adaptive:
        same = second.headers.get("x-pd-decode") == first.headers.get("x-pd-decode")
        if p2 != "local" or not same:
            return CheckResult(
                name, False, shown, timer.ms,
                "the gateway judged turn 2 uncached: its prefix view differs from the prompt the engine renders "
                "(a billing line or a client rewrite it does not normalise), or another decode was chosen",
                "`pdctl logs gateway | grep verify-agent` shows decision=, cached_tokens= and cache_break=",
            )  # fmt: skip
    if hits is not None and hits <= 0 and not adaptive:
        return CheckResult(name, None, shown + " (inconclusive: the decode's connector may load every block)",
                           timer.ms)  # fmt: skip
    if hits is not None and hits <= 0:
        return CheckResult(name, False, shown, timer.ms,
                           "the decode's prefix cache did not hit on turn 2: the engine rendered a different prefix",
                           "check the decode's --enable-prefix-caching and its vLLM version (>= 0.32 drops the "
                           "billing line)")  # fmt: skip
    if hits is None and not adaptive:
        return CheckResult(name, None, shown + "; the decode exposes no prefix-cache metrics: nothing to judge",
                           timer.ms)  # fmt: skip
    return CheckResult(name, True, shown, timer.ms)
