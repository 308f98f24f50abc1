"""The PD legs' retry, fallback and cancellation logic on in-memory workers (``pdctl.gateway.memory``).

The whole gateway app runs in the test's event loop behind the ASGI interface; its workers are
:class:`~pdctl.gateway.memory.MemoryWorker` scripts, so no process or socket is started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from pdctl.gateway.pd import MAX_PD_RETRIES
from pdctl.vllm.protocol import REQUIRED_DECODE_FIELDS
from pdctl.vllm.transport import TransportError
from tests.fakes.gateway_harness import KEY, AsgiReply, asgi_request, make_settings, run_app

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
STREAM = {**BODY, "stream": True}


def _kv(engine: str) -> dict[str, Any]:
    params: dict[str, Any] = {f: f"{engine}-{f}" for f in REQUIRED_DECODE_FIELDS}
    params.update(remote_block_ids=[1, 2, 3], remote_port=5600, do_remote_prefill=True, do_remote_decode=False)
    return params


def _prefill(engine: str = "p0", delay_s: float = 0.0) -> MemoryReply:
    reply = {"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "usage": {"prompt_tokens": 5},
             "kv_transfer_params": _kv(engine)}  # fmt: skip
    return MemoryReply.json(reply, delay_s=delay_s)


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
DECODED = MemoryReply.json({"id": "cmpl-d", "choices": [{"index": 0, "message": {"content": "hi"}}],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 1}})  # fmt: skip


def _run(workers: MemoryWorkers, n_prefill: int, test: Callable[[Gateway], Awaitable[None]], **extra: Any) -> Gateway:
    """Start the app on ``workers`` (``make_settings`` keywords in ``extra``), run ``test``, shut it down."""
    prefill = [f"http://prefill-{i}.invalid" for i in range(n_prefill)]
    return run_app(create_app(make_settings(prefill, ["http://decode.invalid"], **extra), KEY, clients=workers), test)


def _metric(app: Gateway, name: str, **labels: str) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


def test_prefill_failure_is_retried_on_another_prefill() -> None:
    workers = MemoryWorkers()
    workers["prefill-0"].script(TransportError("connect", "refused"))
    workers["prefill-1"].script(_prefill("p1"))
    workers["decode"].script(DECODED)
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, BODY, request_id="r1"))

    app = _run(workers, 2, test)
    (reply,) = replies
    assert reply.status == 200 and reply.json()["id"] == "cmpl-d"
    assert reply.headers["x-pd-prefill"] == "prefill-1" and reply.headers["x-pd-path"] == "disagg"
    assert [c.request_id for c in workers["prefill-0"].completions()] == ["r1"]
    assert [c.request_id for c in workers["prefill-1"].completions()] == ["r1-retry1"]
    (leg2,) = workers["decode"].completions()
    assert leg2.request_id == "r1-retry1" and leg2.json()["kv_transfer_params"] == _kv("p1")
    assert _metric(app, "pdctl_retries_total", leg="prefill") == 1
    assert [i.failures for i in app.pool.instances] == [1, 0, 0]  # counted towards prefill-0's breaker


def test_prefill_client_error_is_not_retried() -> None:
    workers = MemoryWorkers()
    error = {"error": {"message": "bad logit_bias", "type": "BadRequestError", "code": 400}}
    workers["prefill-0"].script(MemoryReply.json(error, status=400))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, BODY))

    app = _run(workers, 2, test)
    assert replies[0].status == 400 and "bad logit_bias" in replies[0].body.decode()
    assert len(workers["prefill-0"].completions()) == 1 and not workers["prefill-1"].completions()
    assert not workers["decode"].completions()
    assert _metric(app, "pdctl_retries_total", leg="prefill") == 0


def test_decode_failure_before_the_first_byte_retries_the_whole_pipeline() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill("first"), _prefill("second"))
    handshake = MemoryReply(500, (b'{"error": {"message": "NIXL handshake failed", "code": 500}}',))
    workers["decode"].script(handshake, MemoryReply.sse([_event("hi"), DONE]))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, STREAM, request_id="r2"))

    app = _run(workers, 1, test)
    (reply,) = replies
    assert reply.status == 200 and reply.body == _event("hi") + DONE
    assert [c.request_id for c in workers["prefill"].completions()] == ["r2", "r2-retry1"]
    legs = workers["decode"].completions()
    # A fresh leg 1 for the retry: kv_transfer_params are single-use and never replayed.
    assert [c.json()["kv_transfer_params"] for c in legs] == [_kv("first"), _kv("second")]
    assert _metric(app, "pdctl_retries_total", leg="decode") == 1


def test_failure_after_the_first_byte_is_not_retried() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill(), _prefill())
    workers["decode"].script(MemoryReply.sse([_event("a"), TransportError("broken", "connection reset")]))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, STREAM))

    app = _run(workers, 1, test)
    (reply,) = replies
    assert reply.status == 200  # headers were out: the failure is one SSE error event, after the tokens sent
    events = [e for e in reply.body.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == _event("a") and len(events) == 2
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "upstream_error"
    assert b"[DONE]" not in reply.body
    assert len(workers["prefill"].completions()) == 1 and len(workers["decode"].completions()) == 1
    assert _metric(app, "pdctl_retries_total", leg="decode") == 0
    assert _metric(app, "pdctl_stream_errors_total", reason="upstream_error") == 1
    assert _metric(app, "pdctl_requests_total", path="disagg", status="stream_error") == 1


def test_a_decode_silent_past_the_stall_timeout_after_its_first_token_ends_the_stream() -> None:
    """``gateway.stall_timeout_s`` reaches the worker response through its protocol (in-memory workers too): a
    first token slower than it is waited for, a later silence as long ends the stream in a timeout event."""
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill())
    workers["decode"].script(MemoryReply.sse([0.4, _event("a"), 5.0, _event("b"), DONE]))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, STREAM))

    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"])
    gateway = dataclasses.replace(settings.gateway, stall_timeout_s=0.2, migration_limit=0)
    app = run_app(create_app(dataclasses.replace(settings, gateway=gateway), KEY, clients=workers), test)
    (reply,) = replies
    events = [e for e in reply.body.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == _event("a") and len(events) == 2
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "upstream_timeout"
    assert _metric(app, "pdctl_stream_errors_total", reason="upstream_timeout") == 1


def test_fallback_when_prefill_returns_no_kv_params() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(MemoryReply.json({"id": "cmpl-p", "choices": []}))
    workers["decode"].script(DECODED)
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, BODY))

    app = _run(workers, 1, test)
    assert replies[0].status == 200 and replies[0].headers["x-pd-path"] == "fallback"
    assert "kv_transfer_params" not in workers["decode"].completions()[0].json()  # decode recomputes the prompt
    assert _metric(app, "pdctl_pd_fallback_total", reason="missing") == 1


def test_client_disconnect_while_streaming_closes_the_decode_call() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill())
    workers["decode"].script(MemoryReply.sse([_event("a"), 30.0, _event("b"), DONE]))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        call = asgi_request(app, CHAT, STREAM, disconnect_after_chunks=1)
        replies.append(await asyncio.wait_for(call, timeout=10))

    start = time.monotonic()
    app = _run(workers, 1, test)
    assert time.monotonic() - start < 10  # not the 30 s the worker would still have taken
    assert replies[0].body == _event("a")
    (leg2,) = workers["decode"].completions()
    assert leg2.response is not None and leg2.response.closed_early is True  # vLLM aborts the request
    assert _metric(app, "pdctl_client_cancelled_total", phase="streaming") == 1
    assert _metric(app, "pdctl_requests_total", path="disagg", status="499") == 1


def _token(text: str, token: int, prompt: list[int] | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "token_ids": [token]}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return b"data: " + json.dumps({"id": "cmpl-d", "choices": [choice]}).encode() + b"\n\n"


def test_a_client_leaving_mid_continuation_closes_the_continuation_call() -> None:
    """decode-0 breaks after two tokens; the stream continues on decode-1 (a migration); the client leaves after
    the first token of the continuation: decode-1's call is closed before its end (vLLM aborts the request), the
    request ends as cancelled and nothing stays in flight."""
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill())
    workers["decode-0"].script(
        MemoryReply.sse([_token("a", 7, [1, 2, 3]), _token("b", 8), TransportError("broken", "cut")])
    )
    workers["decode-1"].script(MemoryReply.sse([_token("c", 9), 30.0, _token("d", 10), DONE]))
    replies: list[AsgiReply] = []
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}

    async def test(app: Gateway) -> None:
        call = asgi_request(app, "/v1/completions", body, disconnect_after_chunks=3)
        replies.append(await asyncio.wait_for(call, timeout=10))
        for _ in range(100):  # the request's own end runs after the client's
            if not app.in_flight:
                break
            await asyncio.sleep(0.01)
        assert app.in_flight == 0

    settings = make_settings(["http://prefill.invalid"], ["http://decode-0.invalid", "http://decode-1.invalid"])
    app = run_app(create_app(settings, KEY, clients=workers), test)
    [reply] = replies
    assert [json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in reply.body.split(b"\n\n") if e] == [
        "a", "b", "c"]  # fmt: skip
    [first] = workers["decode-0"].completions()
    [continuation] = workers["decode-1"].completions()
    assert continuation.json()["prompt"] == [1, 2, 3, 7, 8]  # the prompt and the tokens already sent
    assert continuation.response is not None and continuation.response.closed_early is True
    assert first.response is not None and first.response.closed_early is True
    assert _metric(app, "pdctl_client_cancelled_total", phase="streaming") == 1


def test_client_disconnect_during_prefill_sends_a_release_leg() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill("held", delay_s=0.3))
    workers["decode"].script(DECODED)

    async def test(app: Gateway) -> None:
        reply = await asgi_request(app, CHAT, STREAM, request_id="r5", disconnect_after_s=0.05)
        assert reply.status == 0  # nothing was sent: the client left first
        (leg1,) = workers["prefill"].completions()
        assert leg1.response is not None and leg1.response.closed_early is False  # leg 1 ran to its end
        end = time.monotonic() + 5
        while not workers["decode"].completions() and time.monotonic() < end:
            await asyncio.sleep(0.02)

    app = _run(workers, 1, test)
    (release,) = workers["decode"].completions()
    body = release.json()
    assert release.request_id == "r5-release" and body["kv_transfer_params"] == _kv("held")
    assert (body["max_tokens"], body["stream"]) == (1, False)  # decode pulls the blocks, frees them, stops
    assert _metric(app, "pdctl_kv_release_total", outcome="ok") == 1
    assert _metric(app, "pdctl_client_cancelled_total", phase="before_first_byte") == 1


def test_prefill_past_the_deadline_is_a_504_and_not_retried() -> None:
    workers = MemoryWorkers()
    workers["prefill-0"].script(_prefill("slow", delay_s=5.0))
    workers["prefill-1"].script(_prefill("fast"))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, BODY))

    start = time.monotonic()
    app = _run(workers, 2, test, request_timeout_s=0.5)
    assert time.monotonic() - start < 3  # the leg was bounded by the request's deadline, not the worker
    assert replies[0].status == 504 and replies[0].json()["error"]["code"] == "prefill_timeout"
    # A retry after the whole deadline went to leg 1 would answer after the client's timeout: none is sent.
    (call,) = workers["prefill-0"].completions()
    assert call.total_timeout_s is not None and call.total_timeout_s <= 0.5
    assert not workers["prefill-1"].completions() and not workers["decode"].completions()
    assert _metric(app, "pdctl_retries_total", leg="prefill") == 0


def test_decode_failure_while_its_prefill_is_down_is_counted_against_the_prefill() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill("dying"), TransportError("connect", "refused"))
    handshake = MemoryReply(500, (b'{"error": {"message": "KV pull failed", "code": 500}}',), delay_s=0.2)
    workers["decode"].script(handshake)
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        call = asyncio.ensure_future(asgi_request(app, CHAT, STREAM))
        while not workers["decode"].completions():  # leg 2 started: now the prefill goes down
            await asyncio.sleep(0.01)
        workers["prefill"].healthy = False
        replies.append(await call)
        prefill = app.pool.instances[0]
        end = time.monotonic() + 5
        while prefill.failures < 2 and time.monotonic() < end:  # the blame probe runs in the background
            await asyncio.sleep(0.02)

    app = _run(workers, 1, test, max_retries=1)
    assert replies[0].status == 502  # the retry's leg 1 found the prefill gone
    prefill, decode = app.pool.instances
    # One failure from the probe that found the KV source down, one from the retry's refused leg 1; none
    # against decode, which would otherwise be ejected for every request in flight when a prefill crashes.
    assert (prefill.failures, decode.failures) == (2, 0)


def test_n_choices_prefill_with_one_and_decode_with_n() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill("p0"))
    workers["decode"].script(DECODED)
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, {**BODY, "n": 3}))

    _run(workers, 1, test)
    assert replies[0].status == 200
    (leg1,) = workers["prefill"].completions()
    (leg2,) = workers["decode"].completions()
    assert leg1.json()["n"] == 1 and leg2.json()["n"] == 3


def test_max_retries_bounds_the_pd_retries() -> None:
    workers = MemoryWorkers()
    failure = MemoryReply(500, (b'{"error": {"message": "scripted failure"}}',))
    workers["prefill"].script(*[failure] * 20)
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, BODY))

    for max_retries, calls in ((0, 1), (2, 3), (10, 1 + MAX_PD_RETRIES)):
        workers["prefill"].calls.clear()
        app = _run(workers, 1, test, max_retries=max_retries, breaker_threshold=100)
        assert replies[-1].status == 502 and len(workers["prefill"].completions()) == calls
        assert _metric(app, "pdctl_retries_total", leg="prefill") == calls - 1


def test_decode_fallback_when_prefill_fails_or_is_missing() -> None:
    workers = MemoryWorkers()
    workers["prefill"].script(TransportError("connect", "refused"))
    workers["decode"].script(MemoryReply.sse([_event("a"), _event("b"), DONE]))
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, CHAT, STREAM))

    app = _run(workers, 1, test, max_retries=0, fallback="decode")
    (reply,) = replies
    assert reply.status == 200 and reply.headers["x-pd-path"] == "fallback" and reply.body.endswith(DONE)
    (leg,) = workers["decode"].completions()
    assert "kv_transfer_params" not in leg.json() and leg.json()["max_tokens"] == 8
    assert _metric(app, "pdctl_prefill_fallback_total", to="decode", reason="prefill_failed") == 1
    # Without a fallback the same outage is the client's error.
    workers["prefill"].script(TransportError("connect", "refused"))
    _run(workers, 1, test, max_retries=0)
    assert replies[-1].status == 502 and len(workers["decode"].completions()) == 1


def test_mid_stream_failures_end_in_each_apis_error_event() -> None:
    """A decode stream that breaks (Anthropic) or ends without its final event (Responses, as vLLM cuts it)."""
    workers = MemoryWorkers()
    start = b'event: message_start\ndata: {"type": "message_start", "message": {}}\n\n'
    workers["prefill"].script(_prefill("p0"), _prefill("p1"))
    workers["decode"].script(
        MemoryReply.sse([start, TransportError("broken", "cut")]),
        MemoryReply.sse([b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n']),
    )
    replies: list[AsgiReply] = []
    messages = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "x"}]}

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, "/v1/messages", messages))
        replies.append(await asgi_request(app, "/v1/responses", {"model": "tiny", "input": "x", "stream": True}))

    _run(workers, 1, test)
    anthropic_reply, responses_reply = replies
    assert anthropic_reply.status == 200 and anthropic_reply.body.startswith(start)
    event = anthropic_reply.body[len(start) :]
    assert event.startswith(b"event: error\ndata: ")
    err = json.loads(event.split(b"data: ", 1)[1])
    assert err["type"] == "error" and err["error"]["type"] == "api_error" and err["error"]["message"]
    tail = responses_reply.body.rsplit(b"\n\n", 2)[-2]
    assert tail.startswith(b"event: error\ndata: ")
    assert json.loads(tail.split(b"data: ", 1)[1])["type"] == "error"
    leg1 = [json.loads(c.body) for c in workers["prefill"].completions()]
    assert leg1[0]["max_tokens"] == 1 and leg1[1]["max_output_tokens"] == 1 and leg1[1]["store"] is False


def test_a_probe_timeout_keeps_a_busy_decode_and_ejects_a_silent_one() -> None:
    """Under a thousand streams ``/health`` can time out while decode streams on: a decode that answered a call
    since the last probe round stays in the pool; one that answered nothing is taken out; a refused
    connection takes it out at once."""
    workers = MemoryWorkers()
    workers["prefill"].default = _prefill()
    workers["decode"].default = MemoryReply.sse([_event("hi"), DONE])

    async def test(app: Gateway) -> None:
        decode = next(i for i in app.pool.instances if i.role == "decode")
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "stream": True}
        workers["decode"].health_times_out = True
        await app.pool.probe(decode)
        assert not decode.available()  # silent: no call answered yet
        workers["decode"].health_times_out = False
        await app.pool.probe(decode)
        assert decode.available()
        assert (await asgi_request(app, "/v1/completions", body)).status == 200
        workers["decode"].health_times_out = True
        await app.pool.probe(decode)
        assert decode.available()  # busy: it has just streamed a request
        workers["decode"].healthy = False
        workers["decode"].health_times_out = False
        await app.pool.probe(decode)
        assert not decode.available()  # refused: out at once, however recent its last answer

    _run(workers, 1, test)


def test_a_decode_that_breaks_after_its_done_ends_the_stream_once() -> None:
    """decode-0 sends the whole answer and its [DONE], then its connection breaks (a SIGKILL between the last
    event and the chunked body's end): the client's stream ends with one [DONE], not a second from the
    migration's end."""
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill())
    end = b'data: {"id":"cmpl-d","choices":[{"index":0,"text":"","token_ids":[],"finish_reason":"length"}]}\n\n'
    workers["decode-0"].script(
        MemoryReply.sse([_token("a", 7, [1, 2, 3]), _token("b", 8), end, DONE, TransportError("broken", "cut")])
    )
    replies: list[AsgiReply] = []
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "stream": True}

    async def test(app: Gateway) -> None:
        replies.append(await asyncio.wait_for(asgi_request(app, "/v1/completions", body), timeout=10))

    settings = make_settings(["http://prefill.invalid"], ["http://decode-0.invalid", "http://decode-1.invalid"])
    run_app(create_app(settings, KEY, clients=workers), test)
    [reply] = replies
    assert reply.body.count(b"[DONE]") == 1 and reply.body.endswith(DONE), reply.body
    assert workers["decode-1"].completions() == []
