"""The agent-facing routes through the gateway on simulator workers, with the official SDKs (issue 17, item 5).

``/v1/messages`` (anthropic SDK, Claude-Code-style: system, tools, streaming) and ``/v1/responses`` (openai SDK)
through the PD legs; tool calls and streaming tool-call deltas; a prefill outage under ``gateway.fallback``;
huge and malformed bodies answered in each API's own shape.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from pdctl.testing import SimProcess, start_sim
from pdctl.vllm.promtext import metric_value, samples
from pdctl.vllm.protocol import build_prefill_body
from tests.fakes.gateway_harness import KEY, UPSTREAM_KEY, FakeProc, GatewayThread, make_settings, wait_for

ARGS = ["--max-model-len", "2048", "--sim-profile", "fast"]
TOOLS = [
    {"name": "Read", "description": "Read a file", "input_schema": {"type": "object", "properties": {
        "file_path": {"type": "string"}}, "required": ["file_path"]}},
    {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {
        "command": {"type": "string"}}}},
]  # fmt: skip
SYSTEM = [{"type": "text", "text": "You are Claude Code, a coding agent. " * 20}]


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[SimProcess, SimProcess]]:
    p = start_sim(ARGS, str(tmp_path), name="prefill", model="sim-model", role="kv_producer")
    try:
        d = start_sim(ARGS, str(tmp_path), name="decode", model="sim-model", role="kv_consumer")
    except BaseException:
        p.stop()
        raise
    yield p, d
    for s in (p, d):
        s.stop()


def _pulled(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return metric_value(samples(text), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") or 0.0


@contextlib.contextmanager
def _gateway(p: SimProcess, d: SimProcess, **kw: object) -> Iterator[GatewayThread]:
    """A gateway in front of ``p`` and ``d`` (settings ``kw``), once ready; stopped at the end."""
    g = GatewayThread(make_settings([p.url], [d.url], models=(), **kw))  # type: ignore[arg-type]
    try:
        assert wait_for(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 200, timeout=20)
        yield g
    finally:
        g.stop()


def test_prefill_leg_caps_per_route() -> None:
    """Responses is capped by max_output_tokens (max_tokens is not its field), Messages by max_tokens; n = 1."""
    resp = build_prefill_body({"input": "x", "max_output_tokens": 50, "stream": True, "store": True}, "params",
                              "/v1/responses")  # fmt: skip
    assert resp["max_output_tokens"] == 1 and resp["store"] is False and resp["background"] is False
    assert resp["stream"] is False and "max_tokens" not in resp
    msg = build_prefill_body({"messages": [], "max_tokens": 4096, "stream": True}, "params", "/v1/messages")
    assert msg["max_tokens"] == 1 and msg["stream"] is False and msg["kv_transfer_params"]["do_remote_decode"]
    # A forced tool's one-token JSON would fail vLLM's non-streamed Anthropic reply: prefill runs it with "none".
    forced = {
        "messages": [],
        "max_tokens": 9,
        "tools": [{"name": "Bash"}],
        "tool_choice": {"type": "tool", "name": "Bash"},
    }
    assert build_prefill_body(forced, "params", "/v1/messages")["tool_choice"] == {"type": "none"}
    assert build_prefill_body(forced, "params", "/v1/chat/completions")["tool_choice"] == forced["tool_choice"]
    chat = build_prefill_body({"messages": [], "n": 4, "best_of": 4, "max_tokens": 9})
    assert chat["n"] == 1 and "best_of" not in chat


def test_claude_code_style_messages_stream_through_pd(pair: tuple[SimProcess, SimProcess]) -> None:
    p, d = pair
    with _gateway(p, d) as g:
        before = _pulled(d.url)
        client = anthropic.Anthropic(base_url=g.url, api_key=KEY, max_retries=0)
        with client.messages.stream(
            model="sim-model", max_tokens=12, system=SYSTEM, tools=TOOLS,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "list the files in this repository"}],
        ) as stream:  # fmt: skip
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text and final.content[0].type == "text" and final.content[0].text == text
        assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
        assert _pulled(d.url) > before  # decode pulled the prompt's KV from prefill
        raw = client.messages.with_raw_response.create(
            model="sim-model", max_tokens=5, messages=[{"role": "user", "content": "hi " * 30}]
        )
        assert raw.headers["x-pd-path"] == "disagg"
        assert raw.parse().usage.output_tokens == 5 and raw.parse().stop_reason == "max_tokens"


def test_messages_streaming_tool_use_deltas(pair: tuple[SimProcess, SimProcess]) -> None:
    p, d = pair
    with _gateway(p, d) as g:
        client = anthropic.Anthropic(base_url=g.url, api_key=KEY, max_retries=0)
        partial: list[str] = []
        with client.messages.stream(
            model="sim-model", max_tokens=6, tools=TOOLS, tool_choice={"type": "tool", "name": "Bash"},  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "run the tests"}],
        ) as stream:  # fmt: skip
            for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    partial.append(event.delta.partial_json)
            final = stream.get_final_message()
        assert len(partial) >= 3  # arguments arrived as fragments, joined by the SDK
        (block,) = final.content
        assert block.type == "tool_use" and block.name == "Bash"
        assert block.input == json.loads("".join(partial)) and final.stop_reason == "tool_use"


def test_responses_through_pd_with_openai_sdk(pair: tuple[SimProcess, SimProcess]) -> None:
    p, d = pair
    with _gateway(p, d) as g:
        before = _pulled(d.url)
        client = openai.OpenAI(base_url=g.url + "/v1", api_key=KEY, max_retries=0)
        raw = client.responses.with_raw_response.create(
            model="sim-model", input="explain prefill and decode " * 10, max_output_tokens=7
        )
        assert raw.headers["x-pd-path"] == "disagg"
        resp = raw.parse()
        assert resp.output_text and resp.usage is not None and resp.usage.output_tokens == 7
        assert resp.status == "incomplete"  # a max-token stop, as vLLM reports it
        assert _pulled(d.url) > before
        # Cut by max_output_tokens: the stream ends with response.incomplete (vLLM 0.33), relayed without an error.
        with client.responses.stream(
            model="sim-model", input=[{"role": "user", "content": "stream it"}], max_output_tokens=6
        ) as stream:
            events = list(stream)
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert [e.type for e in events if e.type in ("response.completed", "response.incomplete", "error")] == [
            "response.incomplete"
        ]
        cut = events[-1].response  # type: ignore[union-attr]
        assert cut.status == "incomplete" and cut.incomplete_details is not None
        assert cut.incomplete_details.reason == "max_output_tokens"
        assert len(deltas) == 6 and cut.output_text == "".join(deltas)
        # A forced function call, streamed as argument deltas.
        with client.responses.stream(
            model="sim-model", input="read README.md", max_output_tokens=5,
            tools=[{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}],
            tool_choice={"type": "function", "name": "read_file"},
        ) as stream:  # fmt: skip
            events = list(stream)
        args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert events[-1].type in ("response.completed", "response.incomplete")
        (call,) = events[-1].response.output  # type: ignore[union-attr]
        assert call.type == "function_call" and call.name == "read_file"
        assert json.loads(call.arguments) == json.loads("".join(args))


def test_prefill_outage_with_decode_fallback_loses_no_request(pair: tuple[SimProcess, SimProcess]) -> None:
    p, d = pair
    with _gateway(p, d, fallback="decode") as g:
        p.stop()  # the prefill is gone for good
        client = anthropic.Anthropic(base_url=g.url, api_key=KEY, max_retries=0)
        oai = openai.OpenAI(base_url=g.url + "/v1", api_key=KEY, max_retries=0)
        paths = []
        for _ in range(3):
            m = client.messages.with_raw_response.create(
                model="sim-model", max_tokens=4, messages=[{"role": "user", "content": "still there?"}]
            )
            paths.append(m.headers["x-pd-path"])
            assert m.parse().usage.output_tokens == 4
            r = oai.responses.with_raw_response.create(model="sim-model", input="and now?", max_output_tokens=3)
            paths.append(r.headers["x-pd-path"])
            c = oai.chat.completions.with_raw_response.create(
                model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            paths.append(c.headers["x-pd-path"])
        assert set(paths) == {"fallback"}
        text = httpx.get(g.url + "/metrics", timeout=10).text
        counted = sum(
            metric_value(samples(text), "pdctl_prefill_fallback_total", to="decode", reason=r) or 0.0
            for r in ("no_prefill", "prefill_failed")
        )
        assert counted == 9


def test_prefill_outage_without_fallback_is_an_error_in_each_shape(pair: tuple[SimProcess, SimProcess]) -> None:
    p, d = pair
    with _gateway(p, d, max_retries=0) as g:
        p.stop()
        with g.client() as c:
            r = c.post("/v1/messages", json={"model": "sim-model", "max_tokens": 3,
                                             "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
            assert r.status_code in (502, 503)
            assert r.json()["type"] == "error" and r.json()["error"]["type"] in ("api_error", "overloaded_error")
            r = c.post("/v1/responses", json={"model": "sim-model", "input": "x"})
            assert r.status_code in (502, 503) and "code" in r.json()["error"]


def _chunks(size: int) -> Iterator[bytes]:
    yield b'{"model": "sim-model", "input": "'
    for _ in range(size // 65536):
        yield b"a" * 65536
    yield b'"}'


def test_huge_and_malformed_bodies_in_each_apis_shape(pair: tuple[SimProcess, SimProcess]) -> None:
    p, d = pair
    with _gateway(p, d, max_body_bytes=256 * 1024) as g:
        with g.client() as c:
            # Streamed without a Content-Length: the limit holds while reading.
            r = c.post("/v1/responses", content=_chunks(1 << 20))
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = c.post("/v1/messages", content=_chunks(1 << 20))
            assert r.status_code == 413
            assert r.json() == {"type": "error", "error": {"type": "request_too_large", "message": r.json()[
                "error"]["message"]}}  # fmt: skip
            for bad in (
                b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}]}',  # no max_tokens
                b'{"model": "sim-model", "max_tokens": 5, "messages": []}',
                b'{"model": ',
                b"[1]",
            ):
                r = c.post("/v1/messages", content=bad)
                assert r.status_code == 400, bad
                body = r.json()
                assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", bad
                assert body["error"]["message"]
            r = c.post("/v1/responses", json={"model": "sim-model", "input": []})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        client = anthropic.Anthropic(base_url=g.url, api_key="sk-wrong-key-000000", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.create(model="sim-model", max_tokens=3, messages=[{"role": "user", "content": "x"}])
        assert "sk-wrong" not in str(info.value)
        assert info.value.body["type"] == "error"  # type: ignore[index]  # Anthropic's shape, not OpenAI's
        assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_tokenize_passes_through_to_a_worker(pair: tuple[SimProcess, SimProcess]) -> None:
    p, d = pair
    with _gateway(p, d) as g:
        with g.client() as c:
            r = c.post("/tokenize", json={"model": "sim-model", "prompt": "one two three"})
            assert r.status_code == 200 and r.json()["count"] >= 3
            r = c.post("/v1/embeddings", json={"model": "nope", "input": "x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_anthropic_count_tokens_passes_through_with_the_anthropic_sdk(pair: tuple[SimProcess, SimProcess]) -> None:
    p, d = pair
    with _gateway(p, d) as g:
        client = anthropic.Anthropic(base_url=g.url, api_key=KEY, max_retries=0)
        short = client.messages.count_tokens(model="sim-model", messages=[{"role": "user", "content": "hi"}])
        longer = client.messages.count_tokens(
            model="sim-model", system="You are a coding agent.", messages=[{"role": "user", "content": "hi " * 50}]
        )
        assert 1 <= short.input_tokens < longer.input_tokens
        with pytest.raises(anthropic.NotFoundError) as info:
            client.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "hi"}])
        assert info.value.body["type"] == "error"  # type: ignore[index]  # Anthropic's shape, not OpenAI's
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=g.url, api_key="sk-wrong-key-000000", max_retries=0).messages.count_tokens(
                model="sim-model", messages=[{"role": "user", "content": "hi"}]
            )


def test_prefill_outage_with_upstream_fallback(pair: tuple[SimProcess, SimProcess]) -> None:
    p, d = pair
    up = FakeProc("fake_upstream.py", {"key": UPSTREAM_KEY, "models": ["up-model"]})
    g = GatewayThread(
        make_settings([p.url], [d.url], models=(), upstream=up.url, fallback="upstream", max_retries=0),
        upstream_key=UPSTREAM_KEY,
    )
    try:
        assert wait_for(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 200, timeout=20)
        p.stop()
        with g.client() as c:
            r = c.post("/v1/chat/completions", json={"model": "sim-model", "max_tokens": 3,
                                                     "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
        assert r.status_code == 200 and r.headers["x-pd-path"] == "upstream", r.text
        (seen,) = up.completions()
        assert seen["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"  # never the client's key
        assert g.metric("pdctl_prefill_fallback_total", to="upstream") == 1
        # Embeddings for a model that is not local go to the upstream, with the upstream's key.
        with g.client() as c:
            r = c.post("/v1/embeddings", json={"model": "up-model", "input": "x"})
        (emb,) = [e for e in up.log() if e["path"] == "/v1/embeddings"]
        assert emb["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}" and emb["body"]["input"] == "x"
        assert r.status_code == 404 and r.json()["error"]["code"] == "upstream_rejected"  # the fake has no route
    finally:
        g.stop()
        up.kill()


def test_forced_tool_on_messages_prefill_leg_is_not_a_400(pair: tuple[SimProcess, SimProcess]) -> None:
    """vLLM (and the simulator) answer a non-streamed forced tool call cut by max_tokens with 400: the gateway's
    one-token prefill leg must not be one (tool_choice none on leg 1), while decode still forces the tool."""
    p, d = pair
    body = {"model": "sim-model", "max_tokens": 1, "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "Bash"}, "messages": [{"role": "user", "content": "run it"}]}  # fmt: skip
    direct = httpx.post(p.url + "/v1/messages", json=body, timeout=30)
    assert direct.status_code == 400 and direct.json()["type"] == "error"
    with _gateway(p, d) as g:
        with g.client() as c:
            r = c.post("/v1/messages", json={**body, "max_tokens": 6, "stream": True})
        assert r.status_code == 200 and r.headers["x-pd-path"] == "disagg", r.text
        assert '"tool_use"' in r.text and "event: message_stop" in r.text
