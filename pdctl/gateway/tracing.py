"""W3C trace context through the gateway, and the gateway's spans exported over OTLP/HTTP.

A client's ``traceparent`` (and ``tracestate``) is read once per request (:func:`parse_traceparent`; a malformed
one is ignored, as the W3C recommendation says). What the workers receive depends on ``logging.otlp_traces_endpoint``:

- unset: the client's headers, unchanged, on every worker call; none when the client sent none;
- set: one server span per request, a child span per worker call (``prefill``, ``decode``, ``local``,
  ``fallback``, ``colocated``, ``release``), and each call carries its own span's ``traceparent``, so the spans
  vLLM records (``--otlp-traces-endpoint``, set by the plan) join the same trace. Without a client
  ``traceparent`` the gateway starts the trace.

Spans hold names, ids, counts and statuses only: never a key, and a prompt or a completion only when
``logging.trace_content`` asks for them (:meth:`RequestTrace.prompt`, :meth:`RequestTrace.answer`; OpenTelemetry's
GenAI attribute names). They start and end with the request and with each worker call, never per streamed
chunk. The OpenTelemetry SDK is imported only when an endpoint is set; without it the gateway logs one warning and
runs without spans.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Leg", "RequestTrace", "TraceParent", "Tracing", "answer_text", "parse_traceparent"]

log = logging.getLogger("pdctl.gateway")

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SERVICE = "pdctl-gateway"
#: The request fields that hold what the user wrote, in each route's dialect (chat, completions, Anthropic's
#: messages, OpenAI's responses).
_PROMPT_FIELDS = ("system", "instructions", "messages", "prompt", "input")


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A valid W3C ``traceparent``: trace id, parent span id and flags (``01``: sampled)."""

    trace_id: int
    span_id: int
    flags: int

    def header(self) -> str:
        """The header value, in version 00 form."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}"


def parse_traceparent(value: bytes | str | None) -> TraceParent | None:
    """The ``traceparent`` header's fields, or None when it is absent or malformed (W3C Trace Context §3.2:
    lowercase hex, version ``ff`` invalid, all-zero ids invalid, version 00 exactly 55 characters; a later
    version may append fields)."""
    if not value:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip(" \t")
    m = _TRACEPARENT.fullmatch(text)
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or (rest and not rest.startswith("-")):
        return None
    tid, sid = int(trace_id, 16), int(span_id, 16)
    if tid == 0 or sid == 0:
        return None
    return TraceParent(tid, sid, int(flags, 16))


def _tracestate(value: bytes | None) -> str | None:
    if not value:
        return None
    text = value.decode("latin-1").strip()
    return text if text and len(text) <= 512 else None


class Leg:
    """One worker call: the trace headers it sends (:attr:`headers`) and, when tracing, its span."""

    __slots__ = ("_span", "headers")

    def __init__(self, headers: dict[str, str], span: Any = None) -> None:
        self.headers = headers
        self._span = span

    def end(self, status: int | None, error: str | None = None) -> None:
        """End the call's span: the worker's HTTP status (None: no answer) and the error code, if any."""
        span = self._span
        if span is None:
            return
        self._span = None
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None or status is None or status >= 500:
            span.set_attribute("error.type", error or (str(status) if status is not None else "no_answer"))
            span.set_status(_error_status())
        span.end()


class RequestTrace:
    """One client request's trace context: the client's headers, passed on, or the gateway's server span."""

    __slots__ = ("_content", "_passthrough", "_span", "_tracer")

    def __init__(
        self, passthrough: dict[str, str], tracer: Any = None, span: Any = None, content: bool = False
    ) -> None:
        self._passthrough = passthrough
        self._tracer = tracer
        self._span = span
        self._content = content

    @property
    def wants_content(self) -> bool:
        """Whether the server span takes the prompt and the answer (``logging.trace_content``)."""
        return self._content and self._span is not None

    def prompt(self, body: Mapping[str, Any]) -> None:
        """The request's prompt fields as ``gen_ai.input.messages`` (JSON), when :attr:`wants_content`."""
        if self.wants_content:
            fields = {k: body[k] for k in _PROMPT_FIELDS if k in body}
            self._span.set_attribute("gen_ai.input.messages", json.dumps(fields, ensure_ascii=False))

    def answer(self, text: str) -> None:
        """The answer's text as ``gen_ai.output.messages``, when :attr:`wants_content`."""
        if self.wants_content:
            self._span.set_attribute("gen_ai.output.messages", text)

    @property
    def recording(self) -> bool:
        """Whether the gateway makes spans for this request (an endpoint is set and the SDK loaded)."""
        return self._span is not None

    def leg(self, name: str, instance: str, request_id: str) -> Leg:
        """A worker call named ``name`` (``prefill``, ``decode``, ...) to ``instance`` with ``request_id``."""
        if self._span is None:
            return Leg(self._passthrough)
        from opentelemetry.trace import SpanKind, set_span_in_context

        span = self._tracer.start_span(
            name,
            context=set_span_in_context(self._span),
            kind=SpanKind.CLIENT,
            attributes={"pdctl.leg": name, "pdctl.instance": instance, "pdctl.request_id": request_id},
        )
        return Leg(_context_headers(span), span)

    def end(self, attributes: dict[str, str | int | float | bool], failed: bool) -> None:
        """End the server span with the request's outcome (``failed``: a 5xx or a stream that ended in error)."""
        span = self._span
        if span is None:
            return
        self._span = None
        span.set_attributes(attributes)
        if failed:
            span.set_status(_error_status())
        span.end()


def _text_of(obj: Any) -> str:
    """The text one response object or stream event adds, in any route's dialect."""
    if not isinstance(obj, dict):
        return ""
    out = []
    for c in obj.get("choices") or ():  # chat (message or delta), completions (text)
        if isinstance(c, dict):
            part = c.get("text") or (c.get("delta") or c.get("message") or {}).get("content")
            out.append(part if isinstance(part, str) else "")
    kind = obj.get("type")
    if kind == "content_block_delta":  # Anthropic messages, streamed
        out.append(str((obj.get("delta") or {}).get("text") or ""))
    elif kind == "response.output_text.delta":  # OpenAI Responses, streamed
        out.append(str(obj.get("delta") or ""))
    elif kind == "message" and not obj.get("choices"):  # Anthropic messages, whole
        out += [str(b.get("text") or "") for b in obj.get("content") or () if isinstance(b, dict)]
    elif obj.get("object") == "response":  # OpenAI Responses, whole
        for item in obj.get("output") or ():
            for b in (item.get("content") or ()) if isinstance(item, dict) else ():
                if isinstance(b, dict) and b.get("type") == "output_text":
                    out.append(str(b.get("text") or ""))
    return "".join(out)


def answer_text(data: bytes, stream: bool) -> str:
    """The answer's text in a response body (``stream``: an SSE body's events joined), for ``trace_content``."""
    if not stream:
        try:
            return _text_of(json.loads(data))
        except ValueError:
            return ""
    from pdctl.vllm.sse import sse_events

    out = []
    for payload in sse_events(data):
        try:
            out.append(_text_of(json.loads(payload)))
        except ValueError:
            continue  # [DONE]
    return "".join(out)


def _context_headers(span: Any) -> dict[str, str]:
    ctx = span.get_span_context()
    headers = {"traceparent": TraceParent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags)).header()}
    state = ctx.trace_state.to_header() if ctx.trace_state else ""
    if state:
        headers["tracestate"] = state
    return headers


def _error_status() -> Any:
    from opentelemetry.trace import Status, StatusCode

    return Status(StatusCode.ERROR)


class Tracing:
    """The gateway's tracing: off (client headers passed through) or an OTLP/HTTP exporter to ``endpoint``.

    ``endpoint``: the collector's OTLP/HTTP traces URL (``http://collector:4318/v1/traces``); None: off.
    ``content``: server spans also take the prompt and the answer (``logging.trace_content``).
    """

    def __init__(self, endpoint: str | None, content: bool = False) -> None:
        self.endpoint = endpoint
        self.content = content
        self._provider: Any = None
        self._tracer: Any = None
        if endpoint:
            self._start(endpoint)

    @property
    def enabled(self) -> bool:
        """Whether spans are made and exported."""
        return self._tracer is not None

    def _start(self, endpoint: str) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            log.warning(
                "logging.otlp_traces_endpoint is set but the OpenTelemetry SDK cannot be imported (%s); install "
                "pdctl[tracing] (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http). The gateway runs "
                "without tracing and passes clients' traceparent headers through",
                exc,
            )
            return
        # A provider of its own, not the global one: one per gateway, shut down with it.
        provider = TracerProvider(resource=Resource.create({"service.name": _SERVICE}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._provider = provider
        self._tracer = provider.get_tracer("pdctl.gateway")
        log.info("tracing: exporting spans to %s (OTLP/HTTP)", endpoint)

    def start(
        self, method: str, route: str, traceparent: bytes | None, tracestate: bytes | None
    ) -> RequestTrace | None:
        """The request's trace: None when tracing is off and the client sent no valid ``traceparent``."""
        parent = parse_traceparent(traceparent)
        state = _tracestate(tracestate) if parent is not None else None
        if self._tracer is None:
            if parent is None:
                return None
            headers = {"traceparent": _clean(traceparent or b"")}
            if state:
                headers["tracestate"] = state
            return RequestTrace(headers)
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, set_span_in_context
        from opentelemetry.trace.span import TraceState

        context = None
        if parent is not None:
            remote = SpanContext(
                parent.trace_id, parent.span_id, is_remote=True, trace_flags=TraceFlags(parent.flags & 0xFF),
                trace_state=TraceState.from_header([state]) if state else None,
            )  # fmt: skip
            context = set_span_in_context(NonRecordingSpan(remote))
        span = self._tracer.start_span(
            f"{method} {route}",
            context=context,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route},
        )
        return RequestTrace({}, self._tracer, span, self.content)

    def shutdown(self) -> None:
        """Export what is left and stop the exporter (blocking: call it off the event loop)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self._tracer = None


def _clean(value: bytes) -> str:
    return value.decode("latin-1").strip(" \t")
