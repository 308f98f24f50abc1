"""Errors in each API's own shape, chosen by the route's :data:`Wire`.

- OpenAI routes (chat, completions, responses, embeddings, tokenize): ``{"error": {"message", "type", "param",
  "code"}}`` with string codes; mid-stream one ``data:`` event (chat, completions) or an ``event: error`` with
  ``{"type": "error", "code", "message", "param"}`` (Responses).
- Anthropic ``/v1/messages``: ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's types
  (``invalid_request_error``, ``request_too_large``, ``overloaded_error``, ...); mid-stream ``event: error``.

vLLM's own errors use an int ``code`` and the HTTP phrase as ``type``; the gateway translates them so every
client sees one shape (see docs/gateway.md, "Errors").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["ApiError", "Wire", "anthropic_type", "error_body", "error_event", "sanitize", "translate_worker_error"]

Wire = Literal["openai", "responses", "anthropic"]
"""The response dialect of a route: OpenAI chat/completions SSE, OpenAI Responses events, Anthropic Messages."""

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (https://docs.anthropic.com/en/api/errors)."""
    return _ANTHROPIC_TYPES.get(status, "api_error")


_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error answered to the client as an OpenAI error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after_s: float | None = None,
        should_retry: bool | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "upstream_error" if status in (502, 504) else "server_error")
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.reason = reason or code

    def body(self, wire: Wire = "openai") -> bytes:
        """The JSON body in ``wire``'s shape."""
        if wire == "anthropic":
            return json.dumps({"type": "error", "error": {"type": anthropic_type(self.status),
                                                           "message": self.message}}).encode()  # fmt: skip
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Extra response headers (``retry-after``, ``x-should-retry``)."""
        out: list[tuple[bytes, bytes]] = []
        if self.retry_after_s is not None:
            out.append((b"retry-after", str(max(1, int(-(-self.retry_after_s // 1)))).encode()))
        if self.should_retry is not None:
            out.append((b"x-should-retry", b"true" if self.should_retry else b"false"))
        return out


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    """``{"error": {...}}`` as bytes."""
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


def error_event(err: ApiError, wire: Wire = "openai") -> bytes:
    """The one SSE event that ends a stream whose headers were already sent (no ``[DONE]`` after it)."""
    if wire == "anthropic":
        return b"event: error\ndata: " + err.body("anthropic") + b"\n\n"
    if wire == "responses":
        data = {"type": "error", "code": err.code, "message": err.message, "param": err.param}
        return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"
    return b"data: " + err.body() + b"\n\n"


_BEARER = re.compile(r"(?i)(bearer\s+)\S+")
_KEYLIKE = re.compile(r"\bsk-[A-Za-z0-9_\-]{6,}")


def sanitize(text: str, secrets: tuple[str, ...] = ()) -> str:
    """Remove secrets and bearer tokens from text that is echoed to a client or a log."""
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    text = _BEARER.sub(r"\1***", text)
    return _KEYLIKE.sub("sk-***", text)[:2000]


def translate_worker_error(status: int, payload: bytes, secrets: tuple[str, ...] = ()) -> ApiError:
    """A worker's (vLLM's) error reply -> the error the client gets.

    4xx stay 4xx with the worker's message (a bad request stays the client's problem); 5xx become 502,
    except vLLM's 500 for a too-long prompt, which is the client's 400 (vllm-router PR #148).
    """
    message = ""
    try:
        data: Any = json.loads(payload)
        err = data.get("error") if isinstance(data, Mapping) else None
        if isinstance(err, Mapping):
            message = str(err.get("message") or "")
        elif isinstance(err, str):
            message = err
        elif isinstance(data, Mapping) and "message" in data:
            message = str(data["message"])
    except (ValueError, UnicodeDecodeError):
        message = payload[:300].decode("utf-8", "replace")
    message = sanitize(message, secrets)
    lowered = message.lower()
    if "maximum context length" in lowered or "max_model_len" in lowered or "too long" in lowered:
        return ApiError(400, message or "prompt too long", code="context_length_exceeded", param="messages")
    if status in (400, 404, 422):
        return ApiError(400, message or f"worker rejected the request ({status})", code="invalid_request")
    if status == 401:
        return ApiError(502, "a worker rejected the gateway's credentials", code="upstream_auth_error")
    if status == 429:
        return ApiError(429, message or "worker is rate limiting", code="rate_limit_exceeded", retry_after_s=1)
    return ApiError(
        502, f"worker error {status}: {message}" if message else f"worker error {status}", code="upstream_error"
    )
