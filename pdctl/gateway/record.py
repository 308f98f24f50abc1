"""The record of one client request (:class:`RequestRecord`): what the gateway learns of it as it goes (ids,
deadline, the path, the instances, timings, tokens, the outcome) and the channel its response goes out through.

The request paths write it (:mod:`pdctl.gateway.app`, :mod:`pdctl.gateway.pd`, :mod:`pdctl.gateway.migration`,
:mod:`pdctl.gateway.upstream`, the relay, :mod:`pdctl.gateway.relay`); the access log
(:meth:`RequestRecord.access_line`), the trace's server span (:meth:`RequestRecord.span_attributes`) and the
response headers (``x-pd-*``) read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdctl.gateway.errors import ApiError, Wire, error_event

if TYPE_CHECKING:
    from pdctl.gateway.tracing import RequestTrace

__all__ = ["RequestRecord"]

ASGISend = Any


@dataclass(slots=True)
class RequestRecord:
    """One client request as it goes through the gateway: ids, timings, the path it took and what was answered;
    its response goes out through it (headers, body, an error in the route's shape)."""

    send: ASGISend
    request_id: str
    started: float
    deadline: float
    model: str = "-"
    path: str = "-"
    stream: bool = False
    prefill: str | None = None
    decode: str | None = None
    prefill_ms: float | None = None
    status: int = 0
    headers_sent: bool = False
    finished: bool = False
    client_gone: bool = False
    in_leg1: bool = False
    """While leg 1 runs a client disconnect only sets ``client_gone``; leg 1 finishes and its KV is released."""
    ttft_s: float | None = None
    tokens: int | None = None
    prompt_tokens: int | None = None
    error_code: str | None = None
    fallback_reason: str | None = None
    decision: str | None = None
    """``routing.pd_mode = "adaptive"``: the decision's access-log fields (``RoutePlan.log_fields``)."""
    kv: dict[str, Any] = field(default_factory=dict)
    migrations: int = 0
    """Times the stream was continued on another worker (:mod:`pdctl.gateway.migration`)."""
    migrated_to: str | None = None
    """The last continuation's ``target:instance`` (target ``decode``, ``prefill`` or ``restarted``)."""
    trace: RequestTrace | None = None
    """The request's trace context (:mod:`pdctl.gateway.tracing`): the headers each worker call carries, and
    spans when tracing; None: no trace headers at all."""
    wire: Wire = "openai"
    """The route's dialect: error bodies, mid-stream error events and the end of a stream follow it."""
    transcript: list[bytes] | None = None
    """The response body's bytes as the client got them, kept only for ``logging.trace_content``
    (:meth:`pdctl.gateway.tracing.RequestTrace.answer`)."""
    upstream_allowed: bool = True
    """Whether the client's key may use the upstream channel (``gateway.fallback = "upstream"`` asks it too)."""

    def remaining(self) -> float:
        """Seconds left before the request's first-byte deadline."""
        return self.deadline - time.monotonic()

    def outcome(self) -> str:
        """The status as metrics and the access log name it: the HTTP status, or ``stream_error`` for a 200 stream
        that ended with an error event."""
        status = self.status or 500
        return "stream_error" if self.error_code and self.headers_sent and status == 200 else str(status)

    def access_line(self, outcome: str, duration_s: float) -> str:
        """The request's one access-log line (``key=value`` pairs; no request or response content)."""
        parts = [
            f"request_id={self.request_id}", f"model={self.model}", f"path={self.path}",
            f"prefill={self.prefill or '-'}", f"decode={self.decode or '-'}", f"status={outcome}",
            f"ttft_ms={self.ttft_s * 1000:.1f}" if self.ttft_s is not None else "ttft_ms=-",
            f"prefill_ms={self.prefill_ms:.1f}" if self.prefill_ms is not None else "prefill_ms=-",
            f"prompt_tokens={self.prompt_tokens if self.prompt_tokens is not None else '-'}",
            f"tokens={self.tokens if self.tokens is not None else '-'}", f"duration_ms={duration_s * 1000:.1f}",
        ]  # fmt: skip
        if self.error_code:
            parts.append(f"error={self.error_code}")
        if self.fallback_reason:
            parts.append(f"fallback={self.fallback_reason}")
        if self.decision:
            parts.append(self.decision)
        if self.migrations:
            parts.append(f"migrations={self.migrations} migrated={self.migrated_to}")
        if self.kv:
            parts.append(f"kv_engine={self.kv['engine']} kv_blocks={self.kv['blocks']} kv_remote={self.kv['remote']}")
        return " ".join(parts)

    def span_attributes(self, outcome: str) -> dict[str, str | int | float | bool]:
        """The server span's outcome attributes: names, counts and statuses, never request or response content."""
        attrs: dict[str, str | int | float | bool] = {
            "pdctl.request_id": self.request_id, "gen_ai.request.model": self.model, "pdctl.pd_path": self.path,
            "http.response.status_code": self.status or 500, "pdctl.outcome": outcome, "pdctl.stream": self.stream,
        }  # fmt: skip
        if self.prefill:
            attrs["pdctl.prefill"] = self.prefill
        if self.decode:
            attrs["pdctl.decode"] = self.decode
        if self.error_code:
            attrs["error.type"] = self.error_code
        if self.fallback_reason:
            attrs["pdctl.fallback_reason"] = self.fallback_reason
        if self.ttft_s is not None:
            attrs["pdctl.ttft_ms"] = round(self.ttft_s * 1000.0, 3)
        if self.prompt_tokens is not None:
            attrs["gen_ai.usage.input_tokens"] = self.prompt_tokens
        if self.tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = self.tokens
        return attrs

    def _headers(self, content_type: bytes, extra: list[tuple[bytes, bytes]] | None) -> list[tuple[bytes, bytes]]:
        h = [(b"content-type", content_type), (b"x-request-id", self.request_id.encode())]
        if self.path in ("disagg", "local", "fallback", "upstream", "colocated"):
            h.append((b"x-pd-path", self.path.encode()))
        if self.prefill:
            h.append((b"x-pd-prefill", self.prefill.encode()))
        if self.decode:
            h.append((b"x-pd-decode", self.decode.encode()))
        if self.prefill_ms is not None:
            h.append((b"x-pd-prefill-ms", f"{self.prefill_ms:.2f}".encode()))
        if extra:
            h.extend(extra)
        return h

    async def start(self, status: int, content_type: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Send the response headers."""
        headers = self._headers(content_type, extra)
        if content_type.startswith(b"text/event-stream"):
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self.status = status
        self.headers_sent = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = False) -> None:
        """Send body bytes."""
        if not more:
            self.finished = True
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def respond(self, status: int, data: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """A whole JSON response."""
        await self.start(status, b"application/json", [(b"content-length", str(len(data)).encode()), *(extra or [])])
        await self.body(data)

    async def fail(self, err: ApiError) -> None:
        """Answer an error: a JSON error before headers, one SSE error event after them."""
        self.error_code = err.code or err.type
        if not self.headers_sent:
            await self.respond(err.status, err.body(self.wire), err.headers())
        elif not self.finished:
            await self.body(error_event(err, self.wire))
