"""verify's HTTP: one request with its failure as data (:class:`Reply`), an SSE stream read with its timing
(:func:`read_stream`), and Prometheus counters read from ``/metrics`` (:func:`metric_total`)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from pdctl.runtime.probe import describe_http_error
from pdctl.vllm.promtext import metric_value, samples
from pdctl.vllm.sse import SSEParser

__all__ = ["Http", "Reply", "StreamResult", "block_size", "error_message", "metric_total", "read_stream", "short"]


@dataclass(frozen=True, slots=True)
class Reply:
    """One HTTP answer (``status`` 0 and ``error`` set when no answer came)."""

    status: int
    body: Any
    headers: Mapping[str, str]
    text: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        """A 2xx answer."""
        return self.error is None and 200 <= self.status < 300


class Http:
    """An httpx client and the per-request timeout; :meth:`call` never raises."""

    def __init__(self, client: httpx.Client, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s

    def call(
        self,
        method: str,
        url: str,
        *,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Reply:
        """Send one request; a transport failure comes back as ``Reply(0, ..., error=...)``."""
        try:
            r = self.client.request(
                method, url, json=body, headers=dict(headers or {}), timeout=timeout_s or self.timeout_s
            )
        except httpx.HTTPError as exc:
            return Reply(0, None, {}, "", describe_http_error(exc))
        try:
            parsed: Any = r.json()
        except ValueError:
            parsed = None
        return Reply(r.status_code, parsed, dict(r.headers), r.text)


def metric_total(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """Sum of the samples called ``name`` (whose labels include ``labels``); ``None`` if there is none."""
    return metric_value(samples(text, (name,)), name, **dict(labels or {}))


def block_size(text: str) -> int | None:
    """The KV block size from ``vllm:cache_config_info``."""
    m = re.search(r'vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', text)
    return int(m.group(1)) if m else None


def error_message(reply: Reply) -> str:
    """The server's own error message (OpenAI or FastAPI shape), else the start of the body."""
    if reply.error:
        return reply.error
    body = reply.body
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            return f"HTTP {reply.status}: {err['message']}"
        if isinstance(err, str):
            return f"HTTP {reply.status}: {err}"
        if body.get("message"):
            return f"HTTP {reply.status}: {body['message']}"
    return f"HTTP {reply.status}: {reply.text[:160]}"


def short(text: str, n: int = 60) -> str:
    """``text`` on one line, cut to ``n`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


@dataclass(frozen=True, slots=True)
class StreamResult:
    """One SSE stream read to ``[DONE]``: chunks, tokens, TTFT and TPOT, or the error."""

    status: int
    error: str | None
    headers: Mapping[str, str]
    chunks: int = 0
    tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None


def read_stream(http: Http, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> StreamResult:
    """POST ``body`` and read the OpenAI SSE stream, timing the first chunk and the content chunks."""
    start = time.perf_counter()
    first: float | None = None
    first_content: float | None = None
    last_content: float | None = None
    chunks = content_chunks = 0
    usage_tokens: int | None = None
    done = False
    try:
        with http.client.stream("POST", url, json=dict(body), headers=dict(headers), timeout=http.timeout_s) as r:
            if r.status_code != 200:
                r.read()
                return StreamResult(r.status_code, f"HTTP {r.status_code}: {r.text[:160]}", dict(r.headers))
            ctype = r.headers.get("content-type", "")
            for data in _payloads(r.iter_bytes()):
                if data.strip() == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(data)
                except ValueError:
                    return StreamResult(r.status_code, f"not JSON in an SSE chunk: {data[:80]}", dict(r.headers))
                if isinstance(obj, Mapping) and isinstance(obj.get("error"), Mapping):
                    return StreamResult(
                        r.status_code, f"error in the stream: {obj['error'].get('message')}", dict(r.headers)
                    )
                choices = obj.get("choices") if isinstance(obj, Mapping) else None
                usage = obj.get("usage") if isinstance(obj, Mapping) else None
                if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
                    usage_tokens = usage["completion_tokens"]
                if not choices:
                    continue
                chunks += 1
                if first is None:
                    first = now
                delta = choices[0].get("delta", {}) if isinstance(choices[0], Mapping) else {}
                if isinstance(delta, Mapping) and delta.get("content"):
                    content_chunks += 1
                    first_content = first_content or now
                    last_content = now
            resp_headers = dict(r.headers)
    except httpx.HTTPError as exc:
        return StreamResult(0, describe_http_error(exc), {})
    if "text/event-stream" not in ctype:
        return StreamResult(200, f"Content-Type is {ctype!r}, expected text/event-stream", resp_headers)
    if not done:
        return StreamResult(200, f"the stream ended without [DONE] after {chunks} chunks", resp_headers)
    if first is None or content_chunks == 0:
        return StreamResult(200, "the stream carried no content", resp_headers)
    tokens = usage_tokens if usage_tokens is not None else content_chunks
    tpot = None
    if first_content is not None and last_content is not None and tokens > 1:
        tpot = (last_content - first_content) * 1000.0 / (tokens - 1)
    return StreamResult(200, None, resp_headers, chunks, tokens, (first - start) * 1000.0, tpot)


def _payloads(chunks: Iterator[bytes]) -> Iterator[str]:
    """The ``data`` of each event of an SSE body as it arrives (:class:`pdctl.vllm.sse.SSEParser`)."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.close()
