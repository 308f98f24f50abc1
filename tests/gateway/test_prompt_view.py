"""The prompt as vLLM renders it (pdctl.gateway.prompt_view): the agent routes' conversion to chat, Claude Code's
billing line, ``cache_control``, tools and parts, and the prefix views computed on it.

The conversions are checked against vLLM's own functions in tests/test_real_prompt_view.py (``-m real``, it imports
vLLM), and the token ids against a real engine's ``/tokenize``; these tests need no vLLM.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from pdctl.gateway import conversation, prompt_view
from pdctl.gateway.chat_template import ChatTemplate
from pdctl.gateway.routing.approx_view import block_hashes, prompt_text
from tests.agent_corpus import TOOLS_TEMPLATE, claude_code, codex, opencode

LINE = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch=36ee5;"


def _leading(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_messages_become_the_chat_vllm_renders() -> None:
    body = claude_code(3, seed=1)[2]
    req = prompt_view.chat_request("/v1/messages", body)
    assert req is not None and req.tools is not None
    first = req.messages[0]
    assert first["role"] == "system" and "billing" not in first["content"]
    assert first["content"].startswith(
        "You are Claude Code, Anthropic's official CLI for Claude.You are an"
    )  # ""-joined
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool", "user", "assistant", "tool", "user", "system"]
    call = req.messages[2]["tool_calls"][0]
    assert call["id"] == "toolu_1_0" and json.loads(call["function"]["arguments"]) == {"command": "pytest -k t0"}
    assert req.messages[2]["reasoning"] == "I should run the test 0."
    assert req.tools[0] == {"type": "function", "function": {"name": "Bash", "description": body["tools"][0]["description"],
                                                             "parameters": body["tools"][0]["input_schema"]}}  # fmt: skip
    merged = prompt_view.chat_request("/v1/messages", body, merge_system=True)
    assert merged is not None and merged.messages[0]["content"].endswith("Token budget: 98000 tokens left.")
    assert [m["role"] for m in merged.messages].count("system") == 1


def test_responses_become_the_chat_vllm_renders() -> None:
    req = prompt_view.chat_request("/v1/responses", codex(3, seed=2)[2])
    assert req is not None and req.tools is not None and req.tools[0]["function"]["name"] == "shell"
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert req.messages[2]["tool_calls"][0]["id"] == "call_2_0"
    unknown: list[dict[str, Any]] = [{"model": "m", "input": [{"type": "image_generation_call"}]},
               {"model": "m", "input": "x", "previous_response_id": "resp_1"},
               {"model": "m", "input": "x", "tools": [{"type": "web_search"}]}]  # fmt: skip
    assert [prompt_view.chat_request("/v1/responses", b) for b in unknown] == [None] * 3


def test_the_billing_line_and_cache_control_do_not_change_the_view() -> None:
    """Two sends of one turn that differ only in ``cch`` and where ``cache_control`` sits: the same prompt text, the
    same approximate blocks; the raw body's text breaks at the billing line (after the tools)."""
    a = claude_code(2, seed=3)[1]
    b = json.loads(json.dumps(a))
    b["system"][0]["text"] = LINE
    for block in b["messages"][-1]["content"]:
        block.pop("cache_control", None)
    b["messages"][0]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    assert prompt_text(a, "/v1/messages") == prompt_text(b, "/v1/messages")
    raw_a, raw_b = block_hashes(prompt_text(a)), block_hashes(prompt_text(b))  # the raw body, as hashed before
    assert prompt_text(a).index("x-anthropic") // 256 == _leading(raw_a, raw_b) < len(raw_a)  # broken there


def test_a_sessions_next_turn_extends_its_view_on_every_agent_route() -> None:
    for endpoint, turns in (("/v1/messages", claude_code(4, 5, trailing_system=False)), ("/v1/responses", codex(4, 5)),
                            ("/v1/chat/completions", opencode(4, 5))):  # fmt: skip
        texts = [prompt_text(t, endpoint) for t in turns]
        for before, after in itertools.pairwise(texts):
            hb, ha = block_hashes(before), block_hashes(after)
            assert _leading(hb, ha) == len(hb), endpoint


def test_chat_system_messages_lose_the_billing_line_as_in_vllm() -> None:
    assert prompt_view.strip_billing([LINE]) == []
    assert prompt_view.strip_billing([LINE + "\nYou are Claude."]) == ["You are Claude."]
    assert prompt_view.strip_billing([{"type": "text", "text": LINE + "\nrest", "x": 1}]) == [
        {"type": "text", "text": "rest", "x": 1}
    ]
    assert prompt_view.strip_billing(["Hello\n" + LINE]) == ["Hello\n" + LINE]  # only a leading line
    conv = conversation.conversation([{"role": "system", "content": LINE + "\nBe brief."},
                                     {"role": "user", "content": LINE}], "string")  # fmt: skip
    assert conv == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LINE}]  # users' kept


def test_the_template_sees_what_vllm_hands_it(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    tpl = ChatTemplate.load(tmp_path)
    assert tpl is not None and tpl.content_format == "string" and not tpl.merge_system
    text = tpl.render(claude_code(2, seed=7)[1], "/v1/messages")
    assert text is not None and "billing" not in text
    assert '"name": "Bash", "arguments": {"command": "pytest -k t0"}' in text  # arguments parsed to an object
    assert "<tool_response>\nexit 1\nFAILED tests/test_1.py::test_x\n</tool_response>" in text
    assert '{"type": "function", "function": {"name": "Bash"' in text  # tools as vLLM dumps them
    parts_tpl = ChatTemplate("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}|{% endfor %}{% endfor %}",
                             {})  # fmt: skip
    assert parts_tpl.content_format == "openai"
    body: dict[str, Any] = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]}
    assert parts_tpl.render(body) == "a|b|"
    first = ChatTemplate("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                         "{{ raise_exception('System message must be at the beginning.') }}{% endif %}{% endfor %}",
                         {})  # fmt: skip
    assert first.merge_system


def test_agent_prompts_are_counted_whole() -> None:
    """An agent's system blocks, tool definitions, instructions and tool outputs are prompt tokens too (adaptive PD
    and the limits count them)."""
    from pdctl.gateway.tokens import prompt_parts

    claude = claude_code(2, seed=8)[1]
    texts, _ = prompt_parts(claude)
    joined = "".join(texts)
    assert "You are Claude Code" in joined and "Executes a given bash command" in joined and "FAILED" in joined
    texts, _ = prompt_parts(codex(2, seed=8)[1])
    joined = "".join(texts)
    assert "You are Codex" in joined and "exit 0 (1)" in joined and "Runs a shell command" in joined


def test_the_simulator_keeps_a_trailing_system_turn_in_place_as_vllm() -> None:
    from pdctl.sim.agentapi import chat_request as sim_chat

    body = claude_code(3, seed=9, trailing_system=True)[2]
    messages, _, _ = sim_chat(body, "/v1/messages")
    assert messages[0]["role"] == "system" and "billing" not in messages[0]["content"]
    assert messages[-1] == {"role": "system", "content": "Token budget: 98000 tokens left."}
