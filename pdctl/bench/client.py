"""The benchmark's HTTP client: one async httpx client, streamed requests, timings like ``vllm bench serve``.

Timing (``time.perf_counter``, seconds; ``t0`` is the run's start):

* ``ttft_s``    send -> the first SSE chunk carrying generated content (text, delta content or reasoning)
* ``itl_s``     the gaps between consecutive content chunks (one sample per chunk after the first)
* ``latency_s`` (E2EL) send -> the last chunk that carried ``choices``
* ``output_tokens`` from the usage chunk (``stream_options.include_usage``), else the count of content chunks

An agent client's request (``BenchRequest.route``) goes to its own API with its own headers, streamed:
``/v1/messages`` (Anthropic events: content is a ``content_block_delta``; usage from ``message_start`` and
``message_delta``; the end is ``message_stop``) or ``/v1/responses`` (content is ``response.output_text.delta``,
``response.function_call_arguments.delta`` or ``response.reasoning_text.delta``; the end, with usage, is
``response.completed`` or ``response.incomplete``). Their prompt tokens are the input tokens plus any the server
reports as cache reads or writes (Anthropic's usage counts them apart).

"send" is the moment the built body is handed to the HTTP client (which encodes and writes it), as in
``vllm bench serve``. A chunk's time is when its bytes are read, before its JSON is parsed; vLLM takes it
after parsing the event, a few microseconds later (docs/performance.md, section 3).

Events are split as bytes arrive by :class:`pdctl.vllm.sse.SSEParser` (``:`` comments, vLLM's and
proxies' keep-alive pings, skipped); the stream stops at ``data: [DONE]``. A stream that ends without ``[DONE]``, an SSE
``error`` event, an HTTP error and a timeout are all failures with a reason; none is dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from pdctl.bench.aiohttp_transport import AiohttpTransport
from pdctl.bench.workload import BenchRequest, Route
from pdctl.vllm.sse import SSEParser

__all__ = ["BenchClient", "Endpoint", "RequestResult", "raise_if_cancelled"]

Endpoint = Literal["chat", "completions"]


@dataclass(slots=True)
class RequestResult:
    """What happened to one request (vLLM's ``RequestFuncOutput`` plus PD headers and scheduling)."""

    index: int
    kind: str
    max_tokens: int
    prompt_len: int
    scheduled_s: float = 0.0
    sent_s: float = 0.0
    queue_s: float = 0.0
    success: bool = False
    error: str = ""
    status: int | None = None
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    elapsed_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    request_id: str = ""
    pd_path: str = ""
    pd_prefill_ms: float | None = None
    pd_prefill: str = ""
    pd_decode: str = ""
    warmup: bool = False
    # agent: which conversation and turn (1-based), and the answer's text (sent back as the next turn's history)
    conversation: int | None = None
    turn: int | None = None
    text: str = ""

    @property
    def lag_s(self) -> float:
        """How late the client sent this request after its scheduled time, beyond any concurrency wait.

        This is the client's own scheduling delay (a busy event loop); it should stay near zero.
        """
        return max(0.0, self.sent_s - self.scheduled_s - self.queue_s)

    @property
    def rejected(self) -> bool:
        """Turned away by the gateway's admission control or a rate limit (503 overloaded / 429)."""
        return self.pd_path == "rejected"


def raise_if_cancelled() -> None:
    """Raise CancelledError when this task was cancelled (Ctrl-C) but a callee swallowed it: Python 3.11's
    ``asyncio.wait_for`` can return the result of a call that finished just as the cancellation came, and a
    closed loop would then go on sending requests."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _content(choice: dict[str, Any]) -> str:
    text = choice.get("text")
    if isinstance(text, str):
        return text
    delta = choice.get("delta")
    if isinstance(delta, dict):
        parts = [delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning")]
        joined = "".join(p for p in parts if isinstance(p, str))
        if joined:
            return joined
        if delta.get("tool_calls"):
            return "<tool_call>"
    return ""


_ROUTES = {"messages": "/v1/messages", "responses": "/v1/responses"}
#: Each route's end of stream, as the failure message names it.
_ENDS = {"": "data: [DONE]", "messages": "message_stop", "responses": "response.completed"}
#: Anthropic's usage counts cache reads and writes apart from ``input_tokens``: the prompt is their sum.
_ANTHROPIC_INPUT = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
_DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta", "response.reasoning_text.delta")


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _error_message(body: bytes) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", errors="replace").strip()
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("code") or err)[:300]
        return str(err)[:300]
    return str(obj)[:300]


def _is_rejection(status: int, body: bytes) -> bool:
    if status == 429:
        return True
    return status == 503 and b"overloaded" in body


class BenchClient:
    """One pooled async client for a whole run; :meth:`send` streams one request and times it."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        api_key: str | None = None,
        endpoint: Endpoint = "chat",
        max_connections: int | None = None,
        timeout_s: float = 600.0,
        extra_body: dict[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint: Endpoint = endpoint
        self.timeout_s = timeout_s
        self.extra_body = dict(extra_body or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            limits=limits,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
            # httpx's own transport cannot read streams fast enough at a few hundred requests/s on 2 cores:
            # aiohttp underneath keeps the client ahead of the server (docs/performance.md, section 3).
            transport=transport if transport is not None else AiohttpTransport(max_connections=max_connections),
        )

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    def body(self, req: BenchRequest) -> dict[str, Any]:
        """The JSON body sent for ``req``."""
        if req.body is not None:
            return {"model": self.model, **req.body, "stream": True, **self.extra_body}
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.max_tokens, "stream": True}
        if self.endpoint == "chat" and req.messages:
            body["messages"] = [{"role": role, "content": content} for role, content in req.messages]
        elif self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        body["stream_options"] = {"include_usage": True}
        if req.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    @property
    def path(self) -> str:
        """The API path requests go to (an agent client's requests: :meth:`path_for`)."""
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def path_for(self, req: BenchRequest) -> str:
        """The API path ``req`` goes to: its own route's, else the client's endpoint's."""
        return _ROUTES[req.route] if req.route else self.path

    async def send(
        self,
        req: BenchRequest,
        *,
        t0: float,
        scheduled_s: float = 0.0,
        request_id: str = "",
        queue_s: float = 0.0,
        keep_text: bool = False,
    ) -> RequestResult:
        """Send ``req`` now, stream the answer, and return its timings (never raises for request failures);
        ``keep_text`` keeps the answer's text in ``text``."""
        res = RequestResult(req.index, req.kind, req.max_tokens, req.prompt_len, scheduled_s=scheduled_s)
        res.queue_s = queue_s
        res.request_id = request_id
        res.conversation, res.turn = req.conversation, req.turn
        begin = time.perf_counter()
        res.sent_s = begin - t0
        state = _StreamState(res, begin, keep_text, req.route)
        try:
            await asyncio.wait_for(self._stream(req, state, t0), timeout=self.timeout_s)
        except TimeoutError:
            if state.done and not res.error:
                # The answer was complete; only the server's end of stream after [DONE] never came.
                state.finish()
            else:
                res.success, res.error = False, f"timed out after {self.timeout_s:g} s"
        except httpx.HTTPError as exc:
            res.success, res.error = False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        res.elapsed_s = time.perf_counter() - t0 - res.sent_s
        return res

    async def _stream(self, req: BenchRequest, state: _StreamState, t0: float) -> None:
        res = state.res
        headers = dict(req.headers)
        if res.request_id:
            headers["x-request-id"] = res.request_id
        request_body = self.body(req)
        # The clock starts once the body is built and before the HTTP call encodes and sends it, as in
        # vllm bench serve (its payload dict is built before ``st``; aiohttp encodes it inside ``post``).
        start = time.perf_counter()
        res.sent_s = start - t0
        state.start = start
        async with self._client.stream("POST", self.path_for(req), json=request_body, headers=headers) as resp:
            res.status = resp.status_code
            h = resp.headers
            res.request_id = h.get("x-request-id", res.request_id)
            res.pd_path = h.get("x-pd-path", "")
            res.pd_prefill, res.pd_decode = h.get("x-pd-prefill", ""), h.get("x-pd-decode", "")
            prefill_ms = h.get("x-pd-prefill-ms")
            if prefill_ms:
                try:
                    res.pd_prefill_ms = float(prefill_ms)
                except ValueError:
                    res.pd_prefill_ms = None
            if resp.status_code != 200:
                body = await resp.aread()
                if _is_rejection(resp.status_code, body):
                    res.pd_path = "rejected"
                res.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                return
            parser = SSEParser()
            async for chunk in resp.aiter_bytes():
                if state.done:
                    # Read the stream to its end after [DONE] (only the chunked terminator is left), so
                    # the connection goes back to the pool instead of being closed and reopened.
                    continue
                now = time.perf_counter()
                for payload in parser.feed(chunk):
                    state.handle(payload, now)
                    if state.done or res.error:
                        break
                if res.error:
                    break
            else:
                for payload in parser.close():
                    if not (state.done or res.error):
                        state.handle(payload, time.perf_counter())
            state.finish()


class _StreamState:
    """Per-request bookkeeping while its SSE events arrive."""

    def __init__(self, res: RequestResult, start: float, keep_text: bool = False, route: Route = "") -> None:
        self.res = res
        self.route: Route = route
        self.start = start
        self.done = False
        self.last_content = 0.0
        self.content_chunks = 0
        self.pieces: list[str] | None = [] if keep_text else None

    def handle(self, payload: str, now: float) -> None:
        res = self.res
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            res.error = f"invalid JSON in the stream: {payload[:80]!r}"
            return
        if not isinstance(obj, dict):
            return
        if self.route:
            self._event(obj, now)
            return
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            res.error = f"stream error: {msg}"
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
            if isinstance(completion, int):
                res.output_tokens = completion
            if isinstance(prompt, int):
                res.prompt_tokens = prompt
        choices = obj.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return
        self._piece(_content(choices[0]), now, True)

    def _piece(self, content: str, now: float, text: bool) -> None:
        """A chunk that carries the answer (``content`` may be empty); ``text``: part of the answer's text."""
        res = self.res
        res.latency_s = now - self.start
        if not content:
            return
        if self.pieces is not None and text:
            self.pieces.append(content)
        if self.content_chunks == 0:
            res.ttft_s = now - self.start
        else:
            res.itl_s.append(now - self.last_content)
        self.last_content = now
        self.content_chunks += 1

    def _event(self, obj: dict[str, Any], now: float) -> None:
        """One event of an Anthropic or Responses stream (the ``type`` field names it, as the ``event:`` line)."""
        res, kind = self.res, obj.get("type")
        if kind == "error" or kind == "response.failed":
            err = obj.get("error") or (obj.get("response") or {}).get("error") or obj
            msg = err.get("message", err) if isinstance(err, dict) else err
            res.error = f"stream error: {msg}"
        elif kind == "message_start":
            usage = (obj.get("message") or {}).get("usage") or {}
            res.prompt_tokens = sum(_int(usage.get(k)) for k in _ANTHROPIC_INPUT)
        elif kind == "content_block_delta":
            delta = obj.get("delta") or {}
            piece = delta.get("text") or delta.get("partial_json") or delta.get("thinking") or ""
            self._piece(piece if isinstance(piece, str) else "", now, delta.get("type") == "text_delta")
        elif kind == "message_delta":
            res.latency_s = now - self.start
            out = _int((obj.get("usage") or {}).get("output_tokens"))
            res.output_tokens = out or res.output_tokens
        elif kind == "message_stop":
            self.done = True
        elif kind in _DELTAS:
            delta = obj.get("delta")
            self._piece(delta if isinstance(delta, str) else "", now, kind == _DELTAS[0])
        elif kind in ("response.completed", "response.incomplete"):
            usage = (obj.get("response") or {}).get("usage") or {}
            res.prompt_tokens = _int(usage.get("input_tokens")) or res.prompt_tokens
            res.output_tokens = _int(usage.get("output_tokens")) or res.output_tokens
            self.done = True

    def finish(self) -> None:
        res = self.res
        if res.error:
            return
        if not self.done:
            res.error = f"stream ended without {_ENDS[self.route]}"
        elif self.content_chunks == 0:
            res.error = "no content in the stream"
        else:
            if res.output_tokens <= 0:
                res.output_tokens = self.content_chunks
            if self.pieces is not None:
                res.text = "".join(self.pieces)
            res.success = True
