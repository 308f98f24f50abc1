"""Tracing (:mod:`pdctl.gateway.tracing`): W3C trace context to both legs, and spans exported over OTLP/HTTP.

The gateway runs in the test's event loop over :class:`~pdctl.gateway.memory.MemoryWorker` scripts, so the headers
each leg received are read back from the workers' calls; the spans arrive at an OTLP/HTTP receiver the test
starts on a free loopback port, decoded with OpenTelemetry's own protobuf messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pdctl.config import LoggingConfig
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from pdctl.gateway.tracing import answer_text, parse_traceparent
from pdctl.testing import free_port
from pdctl.testing.asgi import one_body
from pdctl.vllm.protocol import REQUIRED_DECODE_FIELDS
from tests.conftest import REPO
from tests.fakes.gateway_harness import KEY, AsgiReply, make_settings, run_app

CHAT = "/v1/chat/completions"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
PROMPT = "the secret prompt text 7c1e"
ANSWER = "the secret completion text 9a4f"


def _prefill() -> MemoryReply:
    params: dict[str, Any] = {f: f"p-{f}" for f in REQUIRED_DECODE_FIELDS}
    params.update(remote_block_ids=[1, 2], remote_port=5600, do_remote_prefill=True, do_remote_decode=False)
    return MemoryReply.json({"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params})


def _decoded() -> MemoryReply:
    return MemoryReply.json({"id": "cmpl-d", "choices": [{"index": 0, "message": {"content": ANSWER}}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 1}})  # fmt: skip


def _streamed() -> MemoryReply:
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": ANSWER}}]}
    return MemoryReply.sse([f"data: {json.dumps(chunk)}\n\n".encode(), 0.01, b"data: [DONE]\n\n"])


def _workers() -> MemoryWorkers:
    workers = MemoryWorkers()
    workers["prefill"].default = _prefill()
    workers["decode"].default = _decoded()
    return workers


async def _post(app: Gateway, body: dict[str, Any], headers: dict[str, str]) -> AsgiReply:
    """POST ``body`` to the app with extra request ``headers`` (the ASGI call, no socket)."""
    raw = json.dumps(body).encode()
    scope_headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json"),
                     (b"content-length", str(len(raw)).encode())]  # fmt: skip
    scope_headers += [(k.encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": scope_headers}
    out = AsgiReply()
    done = asyncio.Event()
    receive = one_body(raw, done)

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out.status = message["status"]
            out.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        else:
            out.body += message.get("body", b"")

    await app(scope, receive, send)
    done.set()
    return out


def _chat(stream: bool = False) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "stream": stream}


def _gateway(workers: MemoryWorkers, endpoint: str | None = None, content: bool = False, **routing: Any) -> Gateway:
    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"])
    settings = dataclasses.replace(
        settings, logging=LoggingConfig(otlp_traces_endpoint=endpoint, trace_content=content)
    )
    if routing:
        settings = dataclasses.replace(settings, routing=dataclasses.replace(settings.routing, **routing))
    return create_app(settings, KEY, clients=workers)


def _leg_headers(workers: MemoryWorkers, name: str) -> list[dict[str, str]]:
    return [c.headers for c in workers[name].completions()]


# ------------------------------------------------------------------------------------ the header itself


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        f"00-{TRACE_ID}-00f067aa0ba902b7-1",  # flags: two hex digits
        f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01",  # uppercase
        f"ff-{TRACE_ID}-00f067aa0ba902b7-01",  # version ff
        f"00-{'0' * 32}-00f067aa0ba902b7-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE_ID}-00f067aa0ba902b7-01-extra",  # version 00 has exactly four fields
        f"01-{TRACE_ID}-00f067aa0ba902b7-01x",  # a later version's extra fields follow a dash
    ],
)
def test_a_malformed_traceparent_is_none(value: str) -> None:
    assert parse_traceparent(value) is None


def test_a_valid_traceparent_parses_and_a_later_version_may_add_fields() -> None:
    tp = parse_traceparent(CLIENT_PARENT.encode())
    assert tp is not None and f"{tp.trace_id:032x}" == TRACE_ID and tp.flags == 1
    assert tp.header() == CLIENT_PARENT
    later = parse_traceparent(f"cc-{TRACE_ID}-00f067aa0ba902b7-01-what-follows")
    assert later is not None and later.header() == CLIENT_PARENT


# ------------------------------------------------------------------------------------ tracing off


def test_tracing_off_passes_the_clients_trace_context_to_both_legs_unchanged() -> None:
    workers = _workers()
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await _post(app, _chat(), {"traceparent": CLIENT_PARENT, "tracestate": "vendor=abc"}))
        replies.append(await _post(app, _chat(), {}))
        replies.append(await _post(app, _chat(), {"traceparent": "00-zz-bad"}))

    run_app(_gateway(workers), test)
    assert [r.status for r in replies] == [200, 200, 200]
    for leg in ("prefill", "decode"):
        first, second, third = _leg_headers(workers, leg)
        assert first["traceparent"] == CLIENT_PARENT and first["tracestate"] == "vendor=abc"
        assert "traceparent" not in second and "tracestate" not in second  # none sent, none made up
        assert "traceparent" not in third  # malformed: ignored, never an error


# ------------------------------------------------------------------------------------ tracing on


class _Receiver:
    """An OTLP/HTTP traces receiver on a free loopback port: every POST /v1/traces, decoded."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.requests: list[Any] = []
        self.paths: list[str] = []
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                received.paths.append(self.path)
                msg = ExportTraceServiceRequest()
                msg.ParseFromString(body)
                received.requests.append(msg)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[dict[str, Any]]:
        """Every span received: name, ids (hex), kind, status code and attributes."""
        out = []
        for req in self.requests:
            for rs in req.resource_spans:
                service = {a.key: _value(a.value) for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append({
                            "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "kind": s.kind, "status": s.status.code,
                            "attrs": {a.key: _value(a.value) for a in s.attributes}, "service": service,
                        })  # fmt: skip
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed (pdctl[tracing])")
    pytest.importorskip(
        "opentelemetry.exporter.otlp.proto.http", reason="opentelemetry-exporter-otlp-proto-http is not installed"
    )
    r = _Receiver()
    yield r
    r.close()


def _ids(traceparent: str) -> tuple[str, str]:
    tp = parse_traceparent(traceparent)
    assert tp is not None, traceparent
    return f"{tp.trace_id:032x}", f"{tp.span_id:016x}"


def test_the_clients_trace_reaches_both_legs_and_the_spans_nest_under_it(receiver: _Receiver) -> None:
    workers = _workers()
    workers["decode"].default = _streamed()
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        assert app.tracing.enabled
        headers = {"traceparent": CLIENT_PARENT, "tracestate": "vendor=abc", "x-request-id": "req-1"}
        replies.append(await _post(app, _chat(stream=True), headers))

    run_app(_gateway(workers, receiver.url), test)  # shutdown flushes the exporter
    assert replies[0].status == 200 and ANSWER in replies[0].body.decode()
    (prefill_call,) = _leg_headers(workers, "prefill")
    (decode_call,) = _leg_headers(workers, "decode")
    prefill_trace, prefill_span = _ids(prefill_call["traceparent"])
    decode_trace, decode_span = _ids(decode_call["traceparent"])
    assert prefill_trace == decode_trace == TRACE_ID
    assert prefill_call["tracestate"] == decode_call["tracestate"] == "vendor=abc"
    assert prefill_span != decode_span  # each leg carries its own span, not the client's
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}

    spans = {s["name"]: s for s in receiver.spans()}
    assert set(spans) == {"POST /v1/chat/completions", "prefill", "decode"}
    server = spans["POST /v1/chat/completions"]
    assert server["trace_id"] == TRACE_ID and server["parent"] == "00f067aa0ba902b7"  # the client's span
    assert server["service"] == "pdctl-gateway"
    attrs = server["attrs"]
    assert attrs["http.route"] == CHAT and attrs["gen_ai.request.model"] == "tiny"
    assert attrs["pdctl.pd_path"] == "disagg" and attrs["http.response.status_code"] == 200
    assert attrs["pdctl.request_id"] == "req-1" and attrs["pdctl.stream"] is True
    for name, span_id, instance in (("prefill", prefill_span, "prefill"), ("decode", decode_span, "decode")):
        leg = spans[name]
        assert leg["trace_id"] == TRACE_ID and leg["parent"] == server["span_id"]
        assert leg["span_id"] == span_id  # the span whose traceparent the worker got: vLLM's spans nest under it
        assert leg["attrs"]["pdctl.request_id"] == "req-1" and leg["attrs"]["pdctl.instance"] == instance
        assert leg["attrs"]["http.response.status_code"] == 200
    _assert_no_secrets(receiver)


def test_without_a_client_traceparent_the_gateway_starts_the_trace(receiver: _Receiver) -> None:
    workers = _workers()

    async def test(app: Gateway) -> None:
        await _post(app, _chat(), {})
        await _post(app, _chat(), {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-zz"})  # malformed: ignored

    run_app(_gateway(workers, receiver.url), test)
    traces = [_ids(h["traceparent"])[0] for h in _leg_headers(workers, "prefill")]
    assert traces == [_ids(h["traceparent"])[0] for h in _leg_headers(workers, "decode")]
    assert len(set(traces)) == 2 and TRACE_ID not in traces  # a new trace per request
    servers = [s for s in receiver.spans() if s["name"].startswith("POST ")]
    assert sorted(s["trace_id"] for s in servers) == sorted(traces)
    assert all(s["parent"] == "" for s in servers)  # roots
    _assert_no_secrets(receiver)


def test_the_local_path_of_adaptive_pd_is_one_local_span(receiver: _Receiver) -> None:
    workers = _workers()
    history = [{"role": "system", "content": "You are a coding agent. " * 200}, {"role": "user", "content": PROMPT}]
    turn1 = {"model": "tiny", "messages": history, "max_tokens": 4}
    turn2 = {**turn1, "messages": [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]}
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await _post(app, turn1, {"x-request-id": "t1"}))
        replies.append(await _post(app, turn2, {"x-request-id": "t2", "traceparent": CLIENT_PARENT}))

    run_app(_gateway(workers, receiver.url, pd_mode="adaptive"), test)
    assert [r.headers["x-pd-path"] for r in replies] == ["disagg", "local"]
    local_call = _leg_headers(workers, "decode")[1]
    assert _ids(local_call["traceparent"])[0] == TRACE_ID
    in_trace = [s for s in receiver.spans() if s["trace_id"] == TRACE_ID]
    assert sorted(s["name"] for s in in_trace) == ["POST /v1/chat/completions", "local"]
    server = next(s for s in in_trace if s["name"].startswith("POST "))
    local = next(s for s in in_trace if s["name"] == "local")
    assert local["parent"] == server["span_id"] and local["span_id"] == _ids(local_call["traceparent"])[1]
    assert server["attrs"]["pdctl.pd_path"] == "local" and local["attrs"]["pdctl.request_id"] == "t2"


def test_a_failed_prefill_attempt_is_an_error_span_and_the_retry_its_own(receiver: _Receiver) -> None:
    workers = _workers()
    workers["prefill"].script(MemoryReply(503, (b'{"error": {"message": "busy"}}',)))

    async def test(app: Gateway) -> None:
        await _post(app, _chat(), {"x-request-id": "r"})

    run_app(_gateway(workers, receiver.url), test)
    prefills = sorted(
        (s for s in receiver.spans() if s["name"] == "prefill"), key=lambda s: s["attrs"]["pdctl.request_id"]
    )
    assert [s["attrs"]["pdctl.request_id"] for s in prefills] == ["r", "r-retry1"]
    assert prefills[0]["status"] == 2 and "error.type" in prefills[0]["attrs"]  # STATUS_CODE_ERROR
    assert prefills[1]["status"] != 2


def _assert_no_secrets(receiver: _Receiver) -> None:
    text = repr(receiver.requests)
    for secret in (KEY, PROMPT, ANSWER, "Bearer"):
        assert secret not in text, f"{secret!r} in an exported span"


@pytest.mark.parametrize("stream", [False, True])
def test_trace_content_puts_the_prompt_and_the_answer_in_the_server_span_only(
    receiver: _Receiver, stream: bool
) -> None:
    workers = _workers()
    if stream:
        workers["decode"].default = _streamed()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]

    async def test(app: Gateway) -> None:
        await _post(app, {**_chat(stream), "messages": messages}, {"x-request-id": "c"})

    run_app(_gateway(workers, receiver.url, content=True), test)
    spans = {s["name"]: s for s in receiver.spans()}
    server = spans["POST /v1/chat/completions"]
    assert json.loads(server["attrs"]["gen_ai.input.messages"]) == {"messages": messages}
    assert server["attrs"]["gen_ai.output.messages"] == ANSWER
    for leg in ("prefill", "decode"):
        assert PROMPT not in repr(spans[leg]["attrs"]) and ANSWER not in repr(spans[leg]["attrs"])
    assert KEY not in repr(receiver.requests) and "Bearer" not in repr(receiver.requests)


@pytest.mark.parametrize(
    ("body", "stream", "text"),
    [
        (b'{"choices": [{"index": 0, "text": "ab"}]}', False, "ab"),
        (
            b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\ndata: {"choices": [{"delta": {"content": "a"}}]}'
            b'\n\ndata: {"choices": [{"delta": {"content": "b"}}]}\n\ndata: [DONE]\n\n',
            True,
            "ab",
        ),
        (
            b'event: content_block_delta\ndata: {"type": "content_block_delta", "delta": {"type": "text_delta", '
            b'"text": "ab"}}\n\n',
            True,
            "ab",
        ),
        (b'{"type": "message", "content": [{"type": "text", "text": "ab"}]}', False, "ab"),
        (b'data: {"type": "response.output_text.delta", "delta": "ab"}\n\n', True, "ab"),
        (
            b'{"object": "response", "output": [{"type": "message", "content": [{"type": "output_text", "text": "ab"}]}]}',
            False,
            "ab",
        ),
    ],
    ids=["completions", "chat-stream", "messages-stream", "messages", "responses-stream", "responses"],
)
def test_answer_text_reads_every_routes_dialect(body: bytes, stream: bool, text: str) -> None:
    assert answer_text(body, stream) == text


def test_a_sampled_out_request_exports_no_span_and_tells_the_workers_not_to_record(
    receiver: _Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    workers = _workers()
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await _post(app, _chat(), {}))

    run_app(_gateway(workers, receiver.url), test)
    assert replies[0].status == 200
    assert receiver.spans() == []
    (decode_call,) = _leg_headers(workers, "decode")
    assert int(decode_call["traceparent"][-2:], 16) & 1 == 0  # not sampled: vLLM records no span either


def test_a_collector_that_is_down_costs_spans_not_requests() -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="opentelemetry is not installed")
    workers = _workers()
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        assert app.tracing.enabled
        replies.append(await _post(app, _chat(), {"traceparent": CLIENT_PARENT}))

    run_app(_gateway(workers, f"http://127.0.0.1:{free_port()}/v1/traces"), test)  # nothing listens there
    assert replies[0].status == 200
    assert _ids(_leg_headers(workers, "decode")[0]["traceparent"])[0] == TRACE_ID


@pytest.mark.parametrize(("example", "engine"), [("examples/cpu", "vllm"), ("tests/configs/k8s-sim", "sim")])
def test_the_plan_gives_vllm_workers_the_endpoint_and_sim_workers_nothing(
    tmp_path: Path, example: str, engine: str
) -> None:
    from pdctl.config.loader import load
    from pdctl.runtime.plan import build_plan

    src = REPO / example
    (tmp_path / "config.toml").write_text((src / "config.toml").read_text())
    settings_src = src / "settings.json" if (src / "settings.json").exists() else REPO / "examples/cpu/settings.json"
    settings = json.loads(settings_src.read_text())
    settings.setdefault("logging", {})["otlp_traces_endpoint"] = "http://127.0.0.1:4318/v1/traces"
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    workers = [p for p in build_plan(load(tmp_path / "config.toml", tmp_path / "settings.json")).processes
               if p.engine == engine]  # fmt: skip
    assert workers
    for p in workers:
        argv = list(p.argv)
        if engine == "vllm":
            assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4318/v1/traces"
            assert p.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
            assert "--collect-detailed-traces" not in argv
        else:
            assert "--otlp-traces-endpoint" not in argv and not any(k.startswith("OTEL_") for k in p.env)


def test_collect_detailed_traces_reaches_vllm_workers_with_the_endpoint_only(tmp_path: Path) -> None:
    from pdctl.config.loader import load
    from pdctl.runtime.plan import build_plan

    src = REPO / "examples/cpu"
    (tmp_path / "config.toml").write_text((src / "config.toml").read_text())
    settings = json.loads((src / "settings.json").read_text())
    settings.setdefault("logging", {})["collect_detailed_traces"] = "all"
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    argvs = [list(p.argv) for p in build_plan(load(tmp_path / "config.toml", tmp_path / "settings.json")).processes
             if p.engine == "vllm"]  # fmt: skip
    assert argvs and all("--collect-detailed-traces" not in a for a in argvs)  # no endpoint: no spans to detail
    settings["logging"]["otlp_traces_endpoint"] = "http://127.0.0.1:4318/v1/traces"
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    argvs = [list(p.argv) for p in build_plan(load(tmp_path / "config.toml", tmp_path / "settings.json")).processes
             if p.engine == "vllm"]  # fmt: skip
    assert all(a[a.index("--collect-detailed-traces") + 1] == "all" for a in argvs)
