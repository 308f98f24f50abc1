"""Agent sessions (pdctl.gateway.agent_sessions): the session from the agents' own headers, and where a session's
prompt cache breaks; through the gateway, Claude-Code-shaped turns on ``/v1/messages`` under adaptive PD."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from prometheus_client import generate_latest

from pdctl.gateway.agent_sessions import MAX_ID, CacheBreaks, Identity, cap_id, identify
from pdctl.gateway.app import Gateway
from pdctl.gateway.conversation import prompt_parts
from pdctl.gateway.memory import MemoryWorkers
from pdctl.gateway.prompt_view import chat_request
from tests.agent_corpus import claude_code, codex
from tests.fakes.gateway_harness import AsgiReply, asgi_request
from tests.gateway.test_adaptive import _prefill, _run

MESSAGES = "/v1/messages"


def _p(body: dict[str, Any], endpoint: str = MESSAGES) -> list[tuple[str, str, str]]:
    req = chat_request(endpoint, body)
    parts = prompt_parts(req) if req is not None else None
    assert parts is not None
    return parts


def _headers(**h: str) -> Any:
    raw = {k.replace("_", "-").encode(): v.encode() for k, v in h.items()}
    return raw.get


def test_session_ids_are_capped_and_safe_for_a_log_field() -> None:
    assert cap_id("abc-123") == "abc-123"
    assert cap_id("a b=c\n") == "a_b_c_" and cap_id("") is None and cap_id(None) is None
    long_a, long_b = "s" * 500 + "a", "s" * 500 + "b"
    assert len(cap_id(long_a) or "") == MAX_ID and cap_id(long_a) != cap_id(long_b)


def test_the_agents_own_headers_name_the_session() -> None:
    body: dict[str, Any] = {"metadata": {"user_id": "user_1_session_9"}}
    claude = identify(_headers(x_claude_code_session_id="cc-1", x_claude_code_agent_id="sub-2",
                               x_claude_code_parent_agent_id="main-1"), body)  # fmt: skip
    assert claude == Identity("cc-1", "sub-2", "main-1")
    assert claude.log_fields() == "session=cc-1 agent=sub-2 parent=main-1"
    assert identify(_headers(session_id="codex-7"), {}) == Identity("codex-7")  # Codex's session-id header
    assert identify(_headers(x_session_id="oc-3", x_parent_session_id="oc-1"), {}) == Identity("oc-3", None, "oc-1")
    assert identify(_headers(x_session_id="mine", x_claude_code_session_id="cc"), {}) == Identity("mine")  # first wins
    assert identify(_headers(), {"session_id": "vllm-field"}) == Identity("vllm-field")
    assert identify(_headers(), {"conversation_id": "conv-1"}) == Identity("conv-1")
    assert identify(_headers(), body) == Identity("user_1_session_9")  # Claude Code's metadata.user_id
    assert identify(_headers(), {}) is None


def test_a_sessions_turns_extend_its_prompt_whatever_the_billing_line_says() -> None:
    breaks = CacheBreaks()
    turns = claude_code(4, seed=1, trailing_system=False)
    seen = [breaks.observe("s", _p(t), 1000) for t in turns]
    assert seen[0] is None and [b.location if b else None for b in seen[1:]] == ["none"] * 3
    assert all(b is not None and b.reused_tokens > 0 and b.log_fields().startswith("cache_break=- ") for b in seen[1:])
    for t in codex(3, seed=1):
        last = breaks.observe("codex", _p(t, "/v1/responses"), 500)
    assert last is not None and last.location == "none"


def test_the_first_part_that_differs_is_where_the_cache_breaks() -> None:
    base = claude_code(3, seed=2, trailing_system=False)
    edits: list[tuple[str, str, Any]] = [
        ("system", "system", lambda b: b["system"][1].update(text="You are another agent.")),
        ("tools", "tools", lambda b: b["tools"][0].update(description="changed")),
        ("message", "message[2]", lambda b: b["messages"][1]["content"][1].update(text="Edited history.")),
    ]
    for location, where, edit in edits:
        breaks = CacheBreaks()
        breaks.observe("s", _p(base[1]), 1000)
        nxt = json.loads(json.dumps(base[2]))
        edit(nxt)
        got = breaks.observe("s", _p(nxt), 1000)
        assert got is not None and (got.location, got.where) == (location, where)
        assert got.reused_tokens < 1000
    trailing = claude_code(4, seed=2, trailing_system=True)
    breaks = CacheBreaks()
    got = None
    for t in trailing[2:]:
        got = breaks.observe("s", _p(t), 1000)
    assert got is not None and got.location == "trailing_system"  # the previous turn's reminder is history no more


def test_the_session_map_is_bounded() -> None:
    breaks = CacheBreaks(capacity=2)
    for s in ("a", "b", "c"):
        breaks.observe(s, _p(claude_code(1, seed=3)[0]), 100)
    assert len(breaks) == 2
    assert breaks.observe("a", _p(claude_code(2, seed=3)[1]), 100) is None  # "a" was forgotten


def _anthropic() -> Any:
    from pdctl.gateway.memory import MemoryReply

    return MemoryReply.json({"id": "msg-d", "type": "message", "role": "assistant", "content": [
        {"type": "text", "text": "done"}], "usage": {"input_tokens": 5, "output_tokens": 1}})  # fmt: skip


def test_claude_code_turns_go_local_and_the_log_says_where_the_cache_broke(caplog: pytest.LogCaptureFixture) -> None:
    """Turn 2 of a Claude Code session (a new billing line) is judged cached on turn 1's decode; a turn whose system
    prompt changed is logged and counted as a break at ``system``."""
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill(), _prefill(), _prefill())
    for i in range(2):
        workers[f"decode-{i}"].default = _anthropic()
    replies: list[AsgiReply] = []
    turns = [{**t, "stream": False} for t in claude_code(3, seed=4, trailing_system=False)]
    changed = json.loads(json.dumps(turns[2]))
    changed["system"][1]["text"] = "You are a different agent now."
    caplog.set_level(logging.INFO, logger="pdctl.gateway.access")

    async def test(app: Gateway) -> None:
        for i, body in enumerate([turns[0], turns[1], changed]):
            replies.append(await asgi_request(app, MESSAGES, body, request_id=f"t{i}",
                                              extra_headers={"x-claude-code-session-id": "cc-session-1"}))  # fmt: skip

    app = _run(workers, 2, test, local_max_uncached_tokens=150, local_max_uncached_share=0.5)
    assert [r.status for r in replies] == [200, 200, 200], [r.body for r in replies]
    assert [r.headers["x-pd-path"] for r in replies[:2]] == ["disagg", "local"]
    assert replies[1].headers["x-pd-decode"] == replies[0].headers["x-pd-decode"]
    lines = [r.getMessage() for r in caplog.records if r.name == "pdctl.gateway.access"]
    assert all("session=cc-session-1" in ln for ln in lines) and len(lines) == 3
    assert "cache_break=- " in lines[1] and "cache_break=system reused_tokens=" in lines[2]
    value = app.metrics.registry.get_sample_value("pdctl_session_cache_breaks_total", {"at": "system"})
    assert value == 1.0
    assert b"cc-session-1" not in generate_latest(app.metrics.registry)  # never a label
