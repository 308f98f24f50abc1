"""Mid-stream migration: a stream whose worker died after its first byte continues on another worker.

The first leg asks vLLM for ``return_token_ids`` (:func:`first_leg_body`): its first event then carries the
prompt's token ids (stripped from what the client sees unless it asked for them) and every event the ids of its
tokens. The relay keeps the events it forwarded (:func:`pdctl.gateway.relay.relay`'s ``keep``); only when the stream
breaks are they read (:func:`read_sent`), so an unbroken stream costs one list append per piece.

:func:`resume` then re-issues the request, at most ``gateway.migration_limit`` times, as a ``/v1/completions``
call whose prompt is the prompt's token ids plus the tokens already sent, with the rest of ``max_tokens``: vLLM
0.32 takes token-id prompts on completions, and greedy decoding from the same tokens continues with the same
tokens, which ``continue_final_message`` (re-tokenising the answer's text) does not promise. Each continuation
event is rewritten into the client's stream: the first leg's response id, ``created`` and model, chat's
``chat.completion.chunk`` shape for a chat request, and one final usage block counting the prompt and the
whole answer. The target, in order: another available decode; else an available prefill, serving the rest
whole (``migrated=prefill`` in the access log); else a decode (the dead one, restarted) once a ``/health``
probe passes, within ``gateway.request_timeout_s``.

What is not migrated (the stream ends with one error event, as without migration): the agent routes
(``/v1/messages``, ``/v1/responses``: vLLM returns no token ids there), ``n > 1``, ``echo``, chat's logprobs
(completions' pass through, their ``text_offset`` shifted to the whole answer), tools,
structured output (the grammar would restart from the answer's start), and a stream whose events stopped
carrying token ids (a reasoning parser hides them). docs/reliability.md ("Migration") lists what holds.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdctl.gateway import codec
from pdctl.gateway.errors import ApiError, translate_worker_error
from pdctl.gateway.metrics import GatewayMetrics
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.routing import Instance, Pool, Router
from pdctl.gateway.settings import GatewaySettings
from pdctl.vllm.transport import TransportError

__all__ = ["MIGRATABLE", "Context", "Sent", "eligible", "first_leg_body", "read_sent", "resume", "summary_event"]

log = logging.getLogger("pdctl.gateway")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
#: The routes whose streams can be continued elsewhere.
MIGRATABLE = (CHAT, COMPLETIONS)
#: The request's keys a continuation keeps: sampling and stopping, none of chat's own (messages, tools, template).
_KEEP = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias", "bad_words", "allowed_token_ids",
    "cache_salt", "priority", "user", "length_penalty", "return_tokens_as_token_ids", "logprob_token_ids",
)  # fmt: skip
#: Keys that make a request's stream unfit to continue (module docstring).
_NOT_MIGRATED = (
    "tools", "functions", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "echo", "suffix", "best_of", "prompt_embeds",
)  # fmt: skip
#: Chat's logprobs have their own shape, which a completions continuation does not give.
_NOT_MIGRATED_CHAT = ("logprobs", "top_logprobs")


class Context(Protocol):
    """What a migration uses of the gateway (:class:`pdctl.gateway.legs.PdContext` has it)."""

    @property
    def settings(self) -> GatewaySettings: ...
    @property
    def pool(self) -> Pool: ...
    @property
    def router(self) -> Router: ...
    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def secrets(self) -> tuple[str, ...]: ...


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def eligible(endpoint: str, body: Mapping[str, Any], stream: bool, limit: int) -> bool:
    """Whether this request's stream may be continued elsewhere (module docstring)."""
    if limit <= 0 or not stream or endpoint not in MIGRATABLE:
        return False
    if body.get("n") not in (None, 1):
        return False
    for k in _NOT_MIGRATED + (_NOT_MIGRATED_CHAT if endpoint == CHAT else ()):
        v = body.get(k)
        if v not in (None, False, [], {}) and not (k == "response_format" and v == {"type": "text"}):
            return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1)


def first_leg_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The first leg's body: vLLM's ``return_token_ids`` on, so the tokens sent can be re-issued."""
    return {**body, "return_token_ids": True}


@dataclass(slots=True)
class Sent:
    """What the client has received of a stream: read back from the forwarded events when it broke."""

    response_id: str | None = None
    created: int | None = None
    model: str | None = None
    prompt_ids: list[int] | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage_sent: bool = False
    text_end: int = 0
    """Completions with logprobs: the text offset after the last token sent (a continuation's offsets start there)."""
    done: bool = False
    complete: bool = True
    """False when an event with output carried no token ids: the tokens sent are not known."""


def _events(data: bytes) -> list[Any]:
    out: list[Any] = []
    for raw in _EVENT_END.split(data):
        for line in raw.splitlines():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                out.append("[DONE]")
                continue
            try:
                out.append(json.loads(payload))
            except ValueError:
                continue
    return out


def read_sent(kept: list[bytes], prompt_ids: list[int] | None) -> Sent:
    """The forwarded events' ids, token ids, finish and usage; ``prompt_ids``: those the relay took out of the
    first event (see :func:`pdctl.gateway.relay.relay`)."""
    sent = Sent(prompt_ids=prompt_ids)
    for ev in _events(b"".join(kept)):
        _note(sent, ev)
    return sent


def summary_event(kept: list[bytes], prompt_ids: list[int] | None) -> bytes:
    """One event that :func:`read_sent` reads as it reads ``kept`` (:class:`pdctl.gateway.relay.Kept` folds a long
    stream's older pieces into it, so a migratable stream keeps its token ids, not every event)."""
    sent = read_sent(kept, prompt_ids)
    choice: dict[str, Any] = {"index": 0, "token_ids": sent.tokens, "finish_reason": sent.finish_reason}
    if sent.text_end:
        choice["logprobs"] = {"text_offset": [sent.text_end], "tokens": [""]}
    first: dict[str, Any] = {"id": sent.response_id, "created": sent.created, "model": sent.model,
                             "choices": [choice]}  # fmt: skip
    if sent.prompt_ids is not None and prompt_ids is None:
        first["prompt_token_ids"] = sent.prompt_ids
    events = [first]
    if not sent.complete:
        events.append({"choices": [{"index": 0, "text": "?"}]})  # output whose token ids were not sent
    if sent.usage_sent:
        events.append({"usage": {"folded": True}, "choices": []})
    out = b"".join(b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n" for ev in events)
    return out + (b"data: [DONE]\n\n" if sent.done else b"")


def _note(sent: Sent, ev: Any) -> None:
    if ev == "[DONE]":
        sent.done = True
        return
    if not isinstance(ev, dict):
        return
    sent.response_id = sent.response_id or ev.get("id")
    sent.created = sent.created or ev.get("created")
    sent.model = sent.model or ev.get("model")
    if sent.prompt_ids is None and isinstance(ev.get("prompt_token_ids"), list):
        sent.prompt_ids = ev["prompt_token_ids"]
    if ev.get("usage") and not ev.get("choices"):
        sent.usage_sent = True
    for choice in ev.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if sent.prompt_ids is None and isinstance(choice.get("prompt_token_ids"), list):
            sent.prompt_ids = choice["prompt_token_ids"]
        ids = choice.get("token_ids")
        _note_offset(sent, choice.get("logprobs"))
        if isinstance(ids, list):
            sent.tokens.extend(ids)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            sent.complete = False
        if choice.get("finish_reason"):
            sent.finish_reason = choice["finish_reason"]


def _note_offset(sent: Sent, logprobs: Any) -> None:
    if isinstance(logprobs, dict):
        offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
        if isinstance(offsets, list) and isinstance(tokens, list) and offsets and tokens:
            sent.text_end = int(offsets[-1]) + len(str(tokens[-1]))


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for k in ("max_completion_tokens", "max_tokens"):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def continuation_body(body: Mapping[str, Any], sent: Sent) -> dict[str, Any]:
    """The ``/v1/completions`` body that continues ``body`` after ``sent``'s tokens."""
    assert sent.prompt_ids is not None
    out: dict[str, Any] = {k: body[k] for k in _KEEP if k in body}
    out.update(prompt=[*sent.prompt_ids, *sent.tokens], stream=True, return_token_ids=True,
               stream_options={"include_usage": True})  # fmt: skip
    limit = _max_tokens(body)
    if limit is not None:  # no limit given: vLLM's default (the rest of max_model_len) is the same either way
        out["max_tokens"] = limit - len(sent.tokens)
    logprobs = body.get("logprobs")
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):
        out["logprobs"] = logprobs
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        out["min_tokens"] = max(0, min_tokens - len(sent.tokens))
    return out


def _frame(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class _Rewriter:
    """Continuation events -> the client's stream (same id, created and model; chat's shape for chat)."""

    def __init__(self, sent: Sent, chat: bool, with_ids: bool) -> None:
        self.sent = sent
        self.chat = chat
        self.with_ids = with_ids
        self.base = 0
        """Where this continuation's text offsets start in the whole answer (completions logprobs)."""

    def head(self) -> dict[str, Any]:
        s = self.sent
        return {"id": s.response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": s.created, "model": s.model}  # fmt: skip

    def choice(
        self, text: str, ids: list[int], finish: str | None, stop_reason: Any, logprobs: Any = None
    ) -> dict[str, Any]:
        if self.chat:
            c: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                c["stop_reason"] = stop_reason
        else:
            if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
                logprobs = {**logprobs, "text_offset": [int(o) + self.base for o in logprobs["text_offset"]]}
                _note_offset(self.sent, logprobs)
            c = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}
        if self.with_ids:
            c["token_ids"] = ids
        return c

    def usage(self) -> bytes:
        s = self.sent
        prompt = len(s.prompt_ids or ())
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + len(s.tokens), "completion_tokens": len(s.tokens)}
        return _frame({**self.head(), "choices": [], "usage": usage})

    def event(self, ev: Mapping[str, Any]) -> bytes:
        """One continuation event, rewritten; ``b""`` for its usage event (the gateway writes its own)."""
        out = b""
        for choice in ev.get("choices") or ():
            ids = choice.get("token_ids") if isinstance(choice.get("token_ids"), list) else []
            self.sent.tokens.extend(ids)
            finish = choice.get("finish_reason")
            if finish:
                self.sent.finish_reason = finish
            text = choice.get("text") or ""
            c = self.choice(text, ids, finish, choice.get("stop_reason"), choice.get("logprobs"))
            out += _frame({**self.head(), "choices": [c]})
        return out


def _wants_usage(body: Mapping[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, Mapping) and bool(opts.get("include_usage"))


async def resume(
    ctx: Context, ex: RequestRecord, endpoint: str, body: Mapping[str, Any], sent: Sent, failed: Instance,
    err: ApiError, with_ids: bool,
) -> None:  # fmt: skip
    """Continue a broken stream (module docstring); raises the last error when it cannot. ``body``: the first
    leg's (:func:`first_leg_body`); ``with_ids``: whether the client itself asked for ``return_token_ids``."""
    wants_usage = _wants_usage(body)
    rw = _Rewriter(sent, endpoint == CHAT, with_ids)
    limit = ctx.settings.gateway.migration_limit
    deadline = time.monotonic() + ctx.settings.gateway.request_timeout_s
    broken = [failed]
    while True:
        if sent.finish_reason is not None:  # the answer was complete: only its end was lost
            await _end(ex, rw, wants_usage and not sent.usage_sent)
            return
        if sent.prompt_ids is None or not sent.complete or sent.response_id is None:
            _count(ctx, "-", "unknown_tokens")
            raise err
        if ex.migrations >= limit:
            _count(ctx, "-", "limit")
            raise err
        remaining = _max_tokens(body)
        if remaining is not None and len(sent.tokens) >= remaining:
            await ex.body(_frame({**rw.head(), "choices": [rw.choice("", [], "length", None)]}), more=True)
            sent.finish_reason = "length"
            continue
        target, kind = await ctx.router.migration_target(broken, deadline)
        if target is None:
            _count(ctx, "-", "no_target")
            raise err
        ex.migrations += 1
        ex.migrated_to = f"{kind}:{target.name}"
        log.warning("request %s: %s; continuing on %s %s after %d tokens (migration %d of %d)", ex.request_id,
                    err.message, kind, target.name, len(sent.tokens), ex.migrations, limit)  # fmt: skip
        rw.base = sent.text_end
        try:
            await _continue(ctx, ex, target, continuation_body(body, sent), rw)
        except ApiError as again:
            _count(ctx, kind, "failed")
            err = again
            broken.append(target)
            continue
        _count(ctx, kind, "ok")
        await _end(ex, rw, wants_usage)
        return


def _count(ctx: Context, target: str, outcome: str) -> None:
    ctx.metrics.child(ctx.metrics.migrations, target, outcome).inc()


async def _end(ex: RequestRecord, rw: _Rewriter, usage: bool) -> None:
    # A worker killed between its [DONE] and the body's end breaks after the client has everything: nothing to add.
    if not rw.sent.done:
        await ex.body((rw.usage() if usage else b"") + b"data: [DONE]\n\n")
    ex.tokens = len(rw.sent.tokens)


async def _continue(ctx: Context, ex: RequestRecord, inst: Instance, body: dict[str, Any], rw: _Rewriter) -> None:
    """One continuation call, its events rewritten into the client's stream; ApiError when it breaks."""
    rid = f"{ex.request_id}-migrated{ex.migrations}"
    headers = {"content-type": "application/json", "x-request-id": rid}
    leg = ex.trace.leg("migration", inst.name, rid) if ex.trace is not None else None
    if leg is not None:
        headers.update(leg.headers)
    status: int | None = None
    try:
        with inst.track(len(body["prompt"])):
            status = await _call(ctx, ex, inst, body, headers, rw)
    except ApiError as err:
        if leg is not None:
            leg.end(status, err.code or err.type)
        raise
    if leg is not None:
        leg.end(status)
    ctx.pool.record_success(inst)


async def _call(
    ctx: Context, ex: RequestRecord, inst: Instance, body: dict[str, Any], headers: dict[str, str], rw: _Rewriter
) -> int:
    try:
        resp = await inst.client.request("POST", COMPLETIONS, body=codec.encode(body), headers=headers)
    except TransportError as exc:
        ctx.pool.record_failure(inst)
        if exc.kind == "connect":
            inst.set_healthy(False)
        raise ApiError(502, f"{inst.name} failed: {exc.kind}", code="upstream_error") from None
    try:
        if resp.status != 200:
            try:
                payload = await resp.read()
            except TransportError:
                payload = b""
            ctx.pool.record_failure(inst)
            raise translate_worker_error(resp.status, payload[:65536], ctx.secrets)
        resp.stall_timeout(ctx.settings.gateway.stall_timeout_s)
        await _relay_continuation(ctx, ex, inst, resp, rw)
    finally:
        resp.close()
    return resp.status


async def _relay_continuation(ctx: Context, ex: RequestRecord, inst: Instance, resp: Any, rw: _Rewriter) -> None:
    pending = b""
    while True:
        try:
            chunk = await resp.chunk()
        except TransportError as exc:
            ctx.pool.record_failure(inst)
            raise ApiError(502, f"{inst.name}'s stream broke ({exc.kind})", code="upstream_error") from None
        if not chunk:
            raise ApiError(502, f"{inst.name}'s stream ended before its final event", code="upstream_error")
        data = pending + chunk
        cut = max((m.end() for m in _EVENT_END.finditer(data)), default=0)
        data, pending = data[:cut], data[cut:]
        out = b""
        for ev in _events(data):
            if ev == "[DONE]":
                if out:
                    if ex.transcript is not None:
                        ex.transcript.append(out)
                    await ex.body(out, more=True)
                return
            if isinstance(ev, dict) and "error" in ev and "choices" not in ev:
                raise ApiError(502, f"{inst.name} failed mid-stream", code="upstream_error")
            if isinstance(ev, dict):
                out += rw.event(ev)
        if out:
            if ex.transcript is not None:
                ex.transcript.append(out)
            await ex.body(out, more=True)
