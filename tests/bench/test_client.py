"""The bench client's SSE parsing and request recording (httpx.MockTransport stands in for the server)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from pdctl.bench.client import BenchClient, RequestResult
from pdctl.bench.workload import BenchRequest
from pdctl.vllm.sse import SSEParser

REQ = BenchRequest(7, "[bench 0-7] hello", 16, 4, "random", ignore_eos=True)


def chunk(text: str | None = None, *, usage: dict[str, int] | None = None, role: bool = False) -> bytes:
    obj: dict[str, Any] = {"id": "x", "object": "chat.completion.chunk"}
    if usage is not None:
        obj["choices"], obj["usage"] = [], usage
    elif role:
        obj["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    else:
        obj["choices"] = [{"index": 0, "delta": {"content": text}}]
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


GOOD = (
    b": ping\n\n"
    + chunk(role=True)
    + chunk("Hel")
    + chunk("lo")
    + b": keep-alive\r\n\r\n"
    + chunk(" you")
    + chunk(usage={"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12})
    + b"data: [DONE]\n\n"
)


class Trickle(httpx.AsyncByteStream):
    """Sends the body in pieces with pauses, like a real stream."""

    def __init__(self, parts: list[bytes], pause_s: float) -> None:
        self.parts, self.pause_s = parts, pause_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            await asyncio.sleep(self.pause_s)
            yield part


def run(handler: Callable[[httpx.Request], Any], endpoint: str = "chat", timeout_s: float = 10.0) -> RequestResult:
    seen: list[httpx.Request] = []

    async def app(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        out = handler(request)
        return await out if asyncio.iscoroutine(out) else out

    async def main() -> RequestResult:
        async with BenchClient(
            "http://gw",
            model="m",
            api_key="sk-test",
            endpoint=endpoint,  # type: ignore[arg-type]
            timeout_s=timeout_s,
            transport=httpx.MockTransport(app),
        ) as client:
            return await client.send(REQ, t0=time.perf_counter(), request_id="rid-7")

    res = asyncio.run(main())
    run.last_request = seen[-1] if seen else None  # type: ignore[attr-defined]
    return res


def test_sse_parser_handles_any_split() -> None:
    whole = SSEParser().feed(GOOD)
    bytewise: list[str] = []
    p = SSEParser()
    for i in range(len(GOOD)):
        bytewise.extend(p.feed(GOOD[i : i + 1]))
    bytewise.extend(p.close())
    assert whole == bytewise
    assert whole[-1] == "[DONE]"
    assert len(whole) == 6  # comments skipped, the 5 data events + [DONE]


def test_sse_parser_multiline_data_and_unterminated_tail() -> None:
    p = SSEParser()
    assert p.feed(b"data: a\ndata: b\n\nevent: x\ndata:c") == ["a\nb"]
    assert p.close() == ["c"]


def test_successful_stream_records_everything() -> None:
    headers = {
        "content-type": "text/event-stream",
        "x-pd-path": "disagg",
        "x-pd-prefill-ms": "12.5",
        "x-request-id": "rid-7",
        "x-pd-prefill": "prefill",
        "x-pd-decode": "decode",
    }
    parts = [
        GOOD[: GOOD.index(b"data: {", 20)],
        *[c + b"\n\n" for c in GOOD[GOOD.index(b"data: {", 20) :].split(b"\n\n") if c],
    ]
    res = run(lambda req: httpx.Response(200, headers=headers, stream=Trickle(parts, 0.02)))
    assert res.success, res.error
    assert res.output_tokens == 3 and res.prompt_tokens == 9
    assert len(res.itl_s) == 2  # three content chunks; the role chunk carries no content
    assert res.ttft_s >= 0.02
    assert res.latency_s >= res.ttft_s + sum(res.itl_s) - 1e-6
    assert all(g > 0.01 for g in res.itl_s)
    assert (res.pd_path, res.pd_prefill_ms, res.request_id) == ("disagg", 12.5, "rid-7")
    assert (res.pd_prefill, res.pd_decode) == ("prefill", "decode")
    sent = run.last_request  # type: ignore[attr-defined]
    body = json.loads(sent.content)
    assert sent.url.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == "Bearer sk-test"
    assert sent.headers["x-request-id"] == "rid-7"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": REQ.prompt}]
    assert body["max_tokens"] == 16 and body["ignore_eos"] is True and body["model"] == "m"


def test_completions_endpoint_and_token_count_without_usage() -> None:
    body = b"".join(
        b"data: " + json.dumps({"choices": [{"index": 0, "text": t}]}).encode() + b"\n\n" for t in ("a", "b", "c", "d")
    )
    res = run(lambda req: httpx.Response(200, content=body + b"data: [DONE]\n\n"), endpoint="completions")
    assert res.success and res.output_tokens == 4
    sent = run.last_request  # type: ignore[attr-defined]
    assert sent.url.path == "/v1/completions" and json.loads(sent.content)["prompt"] == REQ.prompt


@pytest.mark.parametrize(
    ("status", "body", "error", "rejected"),
    [
        (503, {"error": {"message": "predicted TTFT too high", "code": "server_overloaded"}}, "HTTP 503", True),
        (429, {"error": {"message": "rate limited", "code": "rate_limit_exceeded"}}, "HTTP 429", True),
        (401, {"error": {"message": "invalid api key", "code": "invalid_api_key"}}, "invalid api key", False),
        (502, {"error": {"message": "decode unreachable"}}, "HTTP 502", False),
    ],
)
def test_http_errors(status: int, body: dict[str, Any], error: str, rejected: bool) -> None:
    res = run(lambda req: httpx.Response(status, json=body))
    assert not res.success and res.status == status
    assert error in res.error
    assert res.rejected is rejected


def test_stream_error_event_is_a_failure() -> None:
    body = chunk("a") + b'data: {"error": {"message": "decode died", "code": 500}}\n\n'
    res = run(lambda req: httpx.Response(200, content=body))
    assert not res.success and "decode died" in res.error


def test_stream_without_done_is_a_failure() -> None:
    res = run(lambda req: httpx.Response(200, content=chunk("a") + chunk("b")))
    assert not res.success and "[DONE]" in res.error


def test_stream_without_content_is_a_failure() -> None:
    res = run(lambda req: httpx.Response(200, content=chunk(role=True) + b"data: [DONE]\n\n"))
    assert not res.success and "no content" in res.error


def test_connection_error_and_timeout() -> None:
    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    res = run(refuse)
    assert not res.success and "ConnectError" in res.error

    slow = run(lambda req: httpx.Response(200, stream=Trickle([chunk("a"), b"data: [DONE]\n\n"], 1.0)), timeout_s=0.3)
    assert not slow.success and "timed out" in slow.error


def test_stream_is_read_to_its_end_but_a_server_stuck_after_done_is_not_a_failure() -> None:
    parts = [chunk("a"), chunk("b") + b"data: [DONE]\n\n", b": lingering\n\n"]
    res = run(lambda req: httpx.Response(200, stream=Trickle(parts, 0.2)), timeout_s=0.5)
    assert res.success, res.error
    assert res.output_tokens == 2


def test_the_clock_starts_after_the_body_is_built() -> None:
    # vllm bench serve builds its payload before taking the send time; pdctl's "send" means the same moment.
    built_at: list[float] = []

    class Recording(BenchClient):
        def body(self, req: BenchRequest) -> dict[str, Any]:
            out = super().body(req)
            built_at.append(time.perf_counter())
            return out

    async def main() -> tuple[RequestResult, float]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=GOOD))
        async with Recording("http://gw", model="m", transport=transport) as client:
            t0 = time.perf_counter()
            return await client.send(REQ, t0=t0), t0

    res, t0 = asyncio.run(main())
    assert res.success, res.error
    assert len(built_at) == 1
    assert t0 + res.sent_s >= built_at[0]
