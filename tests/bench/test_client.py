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


def run(
    handler: Callable[[httpx.Request], Any], endpoint: str = "chat", timeout_s: float = 10.0, req: BenchRequest = REQ
) -> RequestResult:
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
            return await client.send(req, t0=time.perf_counter(), request_id="rid-7", keep_text=True)

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


def event(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


AGENT = {"max_tokens": 16, "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=00000;"}],
         "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
MESSAGES = BenchRequest(3, "hi", 16, 1, "claude-code", route="messages", body=AGENT,
                        headers=(("x-claude-code-session-id", "s-1"),))  # fmt: skip


def test_anthropic_stream_is_timed_from_its_first_content_delta() -> None:
    usage = {"input_tokens": 5, "cache_read_input_tokens": 100, "output_tokens": 0}
    start = event({"type": "message_start", "message": {"id": "m", "role": "assistant", "content": [], "usage": usage}})
    body = (
        start
        + event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        + b": ping\n\n"
        + event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}})
        + event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}})
        + event({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{"}})
        + event({"type": "content_block_stop", "index": 0})
        + event({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}})
        + event({"type": "message_stop"})
    )
    res = run(lambda req: httpx.Response(200, content=body), req=MESSAGES)
    sent = run.last_request  # type: ignore[attr-defined]
    assert sent.url.path == "/v1/messages" and sent.headers["x-claude-code-session-id"] == "s-1"
    assert json.loads(sent.content) == {"model": "m", **AGENT, "stream": True}
    assert res.success, res.error
    assert (res.prompt_tokens, res.output_tokens, res.text) == (105, 3, "Hello")  # cache reads count in the prompt
    assert res.ttft_s > 0 and len(res.itl_s) == 2  # the tool-call fragment is content too, not the answer's text
    cut = run(lambda req: httpx.Response(200, content=body.rsplit(b"event: message_stop", 1)[0]), req=MESSAGES)
    assert not cut.success and cut.error == "stream ended without message_stop"
    failed = event({"type": "error", "error": {"type": "overloaded_error", "message": "decode died"}})
    res = run(lambda req: httpx.Response(200, content=start + failed), req=MESSAGES)
    assert not res.success and "decode died" in res.error


def test_responses_stream_ends_at_completed_or_incomplete_and_fails_on_failed() -> None:
    req = BenchRequest(4, "hi", 16, 1, "codex", route="responses", body={"input": "hi", "max_output_tokens": 16},
                       headers=(("session-id", "s-2"),))  # fmt: skip

    def delta(text: str, n: int) -> bytes:
        return event({"type": "response.output_text.delta", "delta": text, "sequence_number": n})

    usage = {"input_tokens": 9, "output_tokens": 2}
    for end in ("response.completed", "response.incomplete"):
        body = (event({"type": "response.created", "response": {"status": "in_progress"}}) + delta("a", 1)
                + delta("b", 2) + event({"type": end, "response": {"usage": usage}}))  # fmt: skip
        res = run(lambda r, body=body: httpx.Response(200, content=body), req=req)  # type: ignore[misc]
        assert run.last_request.url.path == "/v1/responses"  # type: ignore[attr-defined]
        assert run.last_request.headers["session-id"] == "s-2"  # type: ignore[attr-defined]
        assert res.success and (res.prompt_tokens, res.output_tokens, res.text) == (9, 2, "ab"), res.error
    failed = event({"type": "response.failed", "response": {"error": {"message": "no KV"}}})
    res = run(lambda r: httpx.Response(200, content=delta("a", 1) + failed), req=req)
    assert not res.success and "no KV" in res.error
    res = run(lambda r: httpx.Response(200, content=delta("a", 1)), req=req)
    assert not res.success and res.error == "stream ended without response.completed"
