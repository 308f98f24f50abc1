"""A completion request from bytes to a checked :class:`CompletionRequest`: pure functions, no I/O.

Four generating routes are checked here (:data:`COMPLETION_PATHS`): chat, completions, OpenAI Responses and
Anthropic Messages (:data:`AGENT_PATHS`); :data:`PASSTHROUGH_PATHS` (embeddings, tokenize, Anthropic's count_tokens)
only need a model.

The steps, in the order the gateway runs them (each raises :class:`~pdctl.gateway.errors.ApiError` 400/404)::

    body_limit(configured, lens, ...)     the bytes a body may have (before reading it)
    value_limit(configured, lens, ...)    the JSON values it may have (counted while reading: parsing costs per value)
    parse_body(raw, max_nesting)          UTF-8, strict JSON (no NaN, no 1e999, no duplicate keys), an object, nesting;
                                          the fields pdctl sets for the engines removed (:data:`ENGINE_FIELDS`)
    read_model(body)                      `model` (read first: the access log names it even when a later check fails)
    validate(body, endpoint, model)       stream, messages | prompt, max_tokens, n; the prompt-token estimate
    route_model(model, local, upstream)   "local" | "upstream" | 404
    check_lists(request, max_model_len)   lists no longer than the context (before counting and hashing)
    check_fits(request, route, ...)       one prompt per PD request; max_tokens, prompt and lists within the context

:func:`parse_body_off_loop` runs ``parse_body`` on a thread for a body above :data:`OFF_LOOP_BYTES`.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdctl.gateway.errors import ApiError, Wire
from pdctl.vllm.protocol import COUNT_TOKENS_PATH, MESSAGES_PATH, RESPONSES_PATH

__all__ = [
    "AGENT_PATHS",
    "CHAT_PATH",
    "COMPLETION_PATHS",
    "COUNT_TOKENS_PATH",
    "ENGINE_FIELDS",
    "MAX_N",
    "MESSAGES_PATH",
    "PASSTHROUGH_PATHS",
    "RESPONSES_PATH",
    "CompletionRequest",
    "Route",
    "body_limit",
    "check_fits",
    "check_lists",
    "parse_body",
    "parse_body_off_loop",
    "read_model",
    "route_model",
    "validate",
    "value_limit",
    "wire_of",
]

CHAT_PATH = "/v1/chat/completions"
AGENT_PATHS = (RESPONSES_PATH, MESSAGES_PATH)
COMPLETION_PATHS = (CHAT_PATH, "/v1/completions", *AGENT_PATHS)
PASSTHROUGH_PATHS = ("/v1/embeddings", "/tokenize", COUNT_TOKENS_PATH)
#: Responses tool types that vLLM runs itself in a loop of sub-requests sharing one kv_transfer_params: only
#: the first could pull KV, so such requests run colocated on decode (vllm-agent-apis.md §3).
_CLIENT_TOOLS = frozenset({"function", "custom"})
#: Fields only pdctl sets for the engines, never taken from a client: ``kv_transfer_params`` tells a NIXL decode
#: which host to hand-shake with and which blocks to pull. vLLM 0.32 also reads them from ``vllm_xargs``
#: (``to_sampling_params`` merges it into the same ``extra_args``), so they are removed from there too.
ENGINE_FIELDS = ("kv_transfer_params", "ec_transfer_params")
MAX_N = 64
# A conservative estimate: only clearly too-long requests are refused here; vLLM's exact check stays behind it.
CHARS_PER_TOKEN = 6
#: The JSON bytes one prompt token can take, at most in practice: an id and its comma are up to 8, a token of text
#: up to ~16 characters, each up to 6 bytes escaped (``\\uXXXX``) in the worst case.
BODY_BYTES_PER_TOKEN = 32
#: What a body holds besides its prompt's tokens: tool schemas, an image or two in base64, the JSON around them.
BODY_MARGIN_BYTES = 8 << 20
#: The limit where a model's context length is unknown (an upstream's models, or before the workers answered).
UNSIZED_BODY_BYTES = 32 << 20
#: The JSON values (counted as the commas between them) a body may hold per token of the largest context served:
#: a token id is one, a message two (its role and content), a token of text at most one comma.
BODY_VALUES_PER_TOKEN = 4
#: Values besides the prompt's: a coding agent's tool schemas are a few thousand. Each value admitted costs parse
#: time on the gateway (docs/reliability.md), so the margin stays a few times what agents send.
BODY_MARGIN_VALUES = 1 << 14
#: Bodies larger than this are parsed on a thread (:func:`parse_body_off_loop`), not on the event loop.
OFF_LOOP_BYTES = 1 << 20
#: ``max_tokens`` where the model's context length is unknown (an upstream's): larger is no model's.
MAX_TOKENS_UNSIZED = 1 << 24

Route = Literal["local", "upstream"]


@dataclass(slots=True)
class CompletionRequest:
    """What the gateway reads from a valid request body (not frozen: that is on every request's path, see
    docs/performance.md, "History")."""

    model: str
    stream: bool
    prompt_tokens: int
    """Estimated from the text (:data:`CHARS_PER_TOKEN` characters a token, at least 1)."""
    max_tokens: int | None
    chat: bool
    multi_prompt: bool
    """A ``/v1/completions`` prompt that is a list of several prompts (a batch)."""
    colocated_only: bool = False
    """The PD legs cannot serve it (a Responses request with server-side tools): decode runs it whole."""
    items: int = 0
    """The longest list the prompt is made of (token ids, messages, input items): each is at least a token."""


def wire_of(endpoint: str) -> Wire:
    """The response dialect of ``endpoint`` (errors and stream ends follow it)."""
    if endpoint in (MESSAGES_PATH, COUNT_TOKENS_PATH):
        return "anthropic"
    return "responses" if endpoint == RESPONSES_PATH else "openai"


class _BadJSON(ValueError):
    pass


def _no_constants(name: str) -> Any:
    raise _BadJSON(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):  # what a number beyond a float's range reads as (a number is never NaN)
        raise _BadJSON(f"the number {text[:40]} is out of range")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _BadJSON(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _depth_ok(value: Any, limit: int) -> bool:
    """Whether no container in ``value`` (what ``json.loads`` made: exact dicts and lists) lies deeper than
    ``limit``; one level at a time, so a request's body costs a loop per container and no tuple per value."""
    level = [value]
    depth = 1
    while level:
        if depth > limit:
            return False
        below = []
        for v in level:
            for x in v.values() if type(v) is dict else v:
                if type(x) is dict or type(x) is list:
                    below.append(x)
        level = below
        depth += 1
    return True


def _text_len(value: Any) -> int:
    """Characters of text in a prompt or messages list (token ids count as one each)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return 4
    if isinstance(value, list):
        if value and type(value[0]) is int:  # token ids (a mixed list is vLLM's to refuse): no walk of a long list
            return 4 * len(value)
        return sum(_text_len(v) for v in value)
    if isinstance(value, dict):
        return sum(_text_len(v) for k, v in value.items() if k in ("content", "text", "prompt"))
    return 0


def _sizing_context(configured: int | None, lens: Iterable[int | None], upstream: bool) -> int | None:
    """The context the default limits are sized from: the largest ``max_model_len`` served, or None where a limit is
    configured, a context length is unknown or an upstream serves other models."""
    known = list(lens)
    if configured is not None or upstream or not known or None in known:
        return None
    return max(n for n in known if n is not None)


def body_limit(configured: int | None, lens: Iterable[int | None], upstream: bool) -> int:
    """The bytes a request body may have: ``gateway.max_body_bytes`` when set, else sized from the largest context
    the served models accept (``lens``; :data:`UNSIZED_BODY_BYTES` where one is unknown or an upstream serves
    others)."""
    context = _sizing_context(configured, lens, upstream)
    if context is None:
        return configured if configured is not None else UNSIZED_BODY_BYTES
    return context * BODY_BYTES_PER_TOKEN + BODY_MARGIN_BYTES


def value_limit(configured: int | None, lens: Iterable[int | None], upstream: bool) -> int | None:
    """The commas a body may have where :func:`body_limit` is sized from the served models (None otherwise).

    Parsing costs per value, not per byte, and the JSON parser holds the GIL even on a thread (8 MiB of token ids
    hold it for ~220 ms): a body that could be no served model's prompt is refused while it arrives, before any
    parse, so it cannot stall the other streams.
    """
    context = _sizing_context(configured, lens, upstream)
    return None if context is None else context * BODY_VALUES_PER_TOKEN + BODY_MARGIN_VALUES


async def parse_body_off_loop(raw: bytes, max_nesting: int) -> dict[str, Any]:
    """:func:`parse_body`, on a thread for a body above :data:`OFF_LOOP_BYTES` (other streams go on meanwhile)."""
    if len(raw) <= OFF_LOOP_BYTES:
        return parse_body(raw, max_nesting)
    return await asyncio.to_thread(parse_body, raw, max_nesting)


def _longest(value: Any) -> int:
    """The longest list in a prompt, messages or input (one level of nesting: a batch of token-id prompts)."""
    if not isinstance(value, list):
        return 0
    if value and type(value[0]) is int:  # token ids: no walk of a long list
        return len(value)
    inner = max((len(v) for v in value if isinstance(v, list)), default=0)
    return max(len(value), inner)


def parse_body(raw: bytes, max_nesting: int) -> dict[str, Any]:
    """The request body as a JSON object; 400 ``invalid_json``/``invalid_request`` otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_no_constants, parse_float=_finite, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:
        raise ApiError(400, f"invalid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_request")
    # A body can only be as deep as its brackets are many: a token-id prompt needs no walk.
    if raw.count(b"[") + raw.count(b"{") > max_nesting and not _depth_ok(body, max_nesting):
        raise ApiError(400, f"request body is nested deeper than {max_nesting} levels", code="invalid_json")
    for name in ENGINE_FIELDS:
        body.pop(name, None)
    xargs = body.get("vllm_xargs")
    if type(xargs) is dict:
        for name in ENGINE_FIELDS:
            xargs.pop(name, None)
    return body


def read_model(body: Mapping[str, Any]) -> str:
    """The ``model`` field."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "`model` is required and must be a string", param="model", code="invalid_value")
    return model


def validate(body: Mapping[str, Any], endpoint: str, model: str) -> CompletionRequest:
    """The OpenAI fields the gateway relies on, checked; ``model`` from :func:`read_model`."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "`stream` must be true or false", param="stream", code="invalid_type")
    if endpoint in AGENT_PATHS:
        return _validate_agent(body, endpoint, model, stream)
    chat = endpoint == CHAT_PATH
    multi = False
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "`messages` must be a non-empty list", param="messages", code="invalid_value")
        chars = _text_len(messages)
        items = len(messages)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list) or prompt == [] or prompt == "":
            raise ApiError(400, "`prompt` must be a string or a list", param="prompt", code="invalid_value")
        multi = isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt)
        chars = _text_len(prompt)
        items = _longest(prompt)
    max_tokens: int | None = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ApiError(400, f"`{name}` must be a positive integer, got {json.dumps(value)}", param=name,
                           code="invalid_value")  # fmt: skip
        max_tokens = value
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N):
        raise ApiError(400, f"`n` must be an integer 1-{MAX_N}", param="n", code="invalid_value")
    return CompletionRequest(model, stream, max(1, chars // CHARS_PER_TOKEN), max_tokens, chat, multi, items=items)


def _positive(body: Mapping[str, Any], name: str, required: bool = False) -> int | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"`{name}` is required: a positive integer", param=name, code="invalid_value")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ApiError(400, f"`{name}` must be a positive integer, got {json.dumps(value)}", param=name,
                       code="invalid_value")  # fmt: skip
    return value


def _validate_agent(body: Mapping[str, Any], endpoint: str, model: str, stream: bool) -> CompletionRequest:
    """``/v1/responses`` (``input``, ``max_output_tokens``) and ``/v1/messages`` (``messages``, ``max_tokens``)."""
    colocated = False
    if endpoint == MESSAGES_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "`messages` must be a non-empty list of message objects", param="messages",
                           code="invalid_value")  # fmt: skip
        system = body.get("system")
        if system is not None and not isinstance(system, str | list):
            raise ApiError(400, "`system` must be a string or a list of text blocks", param="system",
                           code="invalid_value")  # fmt: skip
        chars = _text_len(messages) + _text_len(system)
        items = len(messages)
        max_tokens = _positive(body, "max_tokens", required=True)
    else:
        data = body.get("input")
        if not isinstance(data, str | list) or data in ("", []):
            raise ApiError(400, "`input` must be a string or a non-empty list of items", param="input",
                           code="invalid_value")  # fmt: skip
        chars = _text_len(data) + _text_len(body.get("instructions"))
        items = _longest(data)
        max_tokens = _positive(body, "max_output_tokens")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "`tools` must be a list", param="tools", code="invalid_value")
        colocated = any(isinstance(t, dict) and t.get("type") not in _CLIENT_TOOLS for t in tools or ())
    return CompletionRequest(model, stream, max(1, chars // CHARS_PER_TOKEN), max_tokens, True, False, colocated,
                             items)  # fmt: skip


def route_model(model: str, local: Mapping[str, int | None], has_upstream: bool) -> Route:
    """Local when the workers serve ``model`` (or no model is known yet and there is no upstream), else upstream."""
    if model in local or (not local and not has_upstream):
        return "local"
    if has_upstream:
        return "upstream"
    known = ", ".join(sorted(local)) or "none yet"
    raise ApiError(404, f"model {model!r} is not served here (local models: {known})", param="model",
                   code="model_not_found")  # fmt: skip


def check_lists(req: CompletionRequest, max_model_len: int | None) -> None:
    """A prompt, messages or input list longer than the context (each item is at least a token) is a 400: checked
    before the prompt is counted or hashed, whose cost grows with it."""
    if max_model_len is not None and req.items > max_model_len:
        where = "messages" if req.chat else "prompt"
        raise ApiError(400, f"this request's {where} holds a list of {req.items} items, more than the model's "
                       f"context length {max_model_len} (each is at least one token)", param=where,
                       code="context_length_exceeded")  # fmt: skip


def check_fits(req: CompletionRequest, route: Route, pd_disagg: bool, max_model_len: int | None) -> None:
    """Refuse what the local path cannot serve: a list longer than the context (:func:`check_lists`), a batch of
    prompts on the PD path, a request beyond the context; where the context is unknown, a ``max_tokens`` no model
    has."""
    mlen, max_tokens = max_model_len, req.max_tokens
    where = "messages" if req.chat else "prompt"
    check_lists(req, mlen)
    if req.multi_prompt and pd_disagg and route == "local":
        raise ApiError(400, "send one prompt per request: the PD path prefills one prompt at a time",
                       param="prompt", code="invalid_value")  # fmt: skip
    if mlen is None:
        if max_tokens is not None and max_tokens > MAX_TOKENS_UNSIZED:
            raise ApiError(400, f"`max_tokens` = {max_tokens} is larger than any model's context "
                           f"({MAX_TOKENS_UNSIZED} at most here)", param="max_tokens",
                           code="invalid_value")  # fmt: skip
        return
    if max_tokens is None:
        return
    if max_tokens >= mlen:
        raise ApiError(400, f"`max_tokens` = {max_tokens} is not below the model's context length {mlen}",
                       param="max_tokens", code="context_length_exceeded")  # fmt: skip
    if req.prompt_tokens + max_tokens > mlen:
        raise ApiError(
            400, f"this request (prompt of at least ~{req.prompt_tokens} tokens + max_tokens {max_tokens}) "
            f"exceeds the model's context length {mlen}; shorten the prompt or lower max_tokens",
            param=where, code="context_length_exceeded",
        )  # fmt: skip
