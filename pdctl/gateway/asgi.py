"""The ASGI side of one request: the callables' types, its headers, its body read under a limit, its client leaving,
and the plain JSON answers sent before a :class:`~pdctl.gateway.record.RequestRecord` exists (no Starlette: its
middleware would hide client disconnects).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pdctl.gateway.errors import ApiError, Wire
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.request import COUNT_TOKENS_PATH, MESSAGES_PATH

__all__ = [
    "Message",
    "Receive",
    "Scope",
    "Send",
    "auth_error",
    "clean_id",
    "client_gone",
    "client_key",
    "header",
    "json_response",
    "plain_error",
    "read_body",
    "watch_disconnect",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = b"application/json"


async def read_body(scope: Scope, receive: Receive, ex: RequestRecord, limit: int, values: int | None = None) -> bytes:
    """The request's body, at most ``limit`` bytes (413 before reading when its ``Content-Length`` says more) and
    ``values`` commas (413 as soon as a chunk passes it); a client that leaves meanwhile cancels the request."""
    length = header(scope, b"content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise ApiError(400, "invalid Content-Length", code="invalid_request") from None
        if declared > limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes "
                           "(gateway.max_body_bytes)", code="request_too_large")  # fmt: skip
    chunks: list[bytes] = []
    size = 0
    commas = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            ex.client_gone = True
            raise asyncio.CancelledError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes (gateway.max_body_bytes)",
                           code="request_too_large")  # fmt: skip
        if values is not None:
            commas += chunk.count(b",")
            if commas > values:
                raise ApiError(413, f"request body holds more than {values} JSON values, more than any prompt of the "
                               "served models needs (gateway.max_body_bytes, when set, lifts this bound)",
                               code="request_too_large")  # fmt: skip
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def client_gone(ex: RequestRecord, task: asyncio.Task[Any] | None) -> Callable[[], None]:
    """What a client's disconnect does to its request: cancels the handler, or during leg 1 only marks it."""

    def gone() -> None:
        if not ex.finished and task is not None:
            ex.client_gone = True
            if not ex.in_leg1:  # leg 1 runs on and frees its KV after (pdctl.gateway.pd)
                task.cancel()

    return gone


async def watch_disconnect(receive: Receive, gone: Callable[[], None]) -> None:
    """The ASGI way, under a server without :func:`pdctl.gateway.direct.watch_disconnect`: a task per request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone()
            return


def client_key(scope: Scope, endpoint: str) -> bytes | None:
    """The client's ``Authorization``; on ``/v1/messages`` Anthropic's ``x-api-key`` too (the anthropic SDK's
    default, and Claude Code's with ``ANTHROPIC_API_KEY``), as the same bearer key."""
    auth = header(scope, b"authorization")
    if auth is None and endpoint in (MESSAGES_PATH, COUNT_TOKENS_PATH):
        key = header(scope, b"x-api-key")
        return b"Bearer " + key if key is not None else None
    return auth


def header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v)
    return None


def clean_id(value: bytes | None) -> str | None:
    if not value:
        return None
    text = value.decode("latin-1").strip()
    if not text or len(text) > 128 or not all(c.isalnum() or c in "-_.:" for c in text):
        return None
    return text


def auth_error() -> ApiError:
    return ApiError(401, "invalid or missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")


async def json_response(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def plain_error(send: Send, err: ApiError, wire: Wire = "openai") -> None:
    body = err.body(wire)
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode()), *err.headers()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
