"""Requests shaped like the coding agents' own: Claude Code (``/v1/messages``), Codex (``/v1/responses``) and
OpenCode (``/v1/chat/completions``), each turn of a session as the client sends it.

Claude Code: a billing line as ``system[0]`` whose ``cch=`` changes every request (anthropics/claude-code#40652),
system blocks with ``cache_control``, long tool definitions, ``<system-reminder>`` text blocks in user turns,
``tool_use`` / ``tool_result`` turns, the rolling ``cache_control`` breakpoint on the newest block and, from some
turn on, a trailing system message. Codex: ``instructions``, ``input`` items (``input_text`` messages,
``function_call``, ``function_call_output``), function tools. OpenCode: chat with a system message, tools,
``tool_calls`` and ``tool`` messages, multi-part text content.
"""

from __future__ import annotations

import json
import random
from typing import Any

TOOLS = [
    {"name": "Bash", "description": "Executes a given bash command in a persistent shell session. " * 6,
     "input_schema": {"type": "object", "properties": {"command": {"type": "string", "description": "The command"},
                                                       "timeout": {"type": "number"}}, "required": ["command"]}},
    {"name": "Read", "description": "Reads a file from the local filesystem. " * 5,
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}},
]  # fmt: skip


def billing(rng: random.Random) -> str:
    """Claude Code's attribution line, with a ``cch`` of its own."""
    return f"x-anthropic-billing-header: cc_version=2.1.177.{rng.randrange(16**3):03x}; cc_entrypoint=cli; cch={rng.randrange(16**5):05x};"


def claude_code(turns: int, seed: int, trailing_system: bool = True, context_words: int = 0) -> list[dict[str, Any]]:
    """``turns`` requests of one Claude Code session, in order (``context_words``: a file's worth of words read into
    the first user turn)."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = []
    out = []
    for t in range(turns):
        user: list[dict[str, Any]] = []
        if t == 0:
            user.append({"type": "text", "text": "<system-reminder>\nAs you answer, use the context below.\n"
                                                 "# claudeMd\nRun the tests with pytest.\n</system-reminder>"})  # fmt: skip
            user.append({"type": "text", "text": f"Fix the failing test number {seed}."})
            if context_words:
                words = " ".join(
                    rng.choice(("def", "return", "self", "value", "import", "test")) for _ in range(context_words)
                )
                user.append({"type": "text", "text": f"<file path='src/app_{seed}.py'>\n{words}\n</file>"})
        else:
            user.append({"type": "tool_result", "tool_use_id": f"toolu_{seed}_{t - 1}",
                         "content": [{"type": "text", "text": f"exit 1\nFAILED tests/test_{t}.py::test_x"}]})  # fmt: skip
            user.append({"type": "text", "text": "<system-reminder>\nThe TodoWrite tool hasn't been used.\n"
                                                 "</system-reminder>"})  # fmt: skip
        history.append({"role": "user", "content": user})
        msgs = json.loads(json.dumps(history))
        last = msgs[-1]["content"][-1]
        last["cache_control"] = {"type": "ephemeral"}  # the rolling breakpoint: the newest block only
        if trailing_system and t >= 2:
            msgs.append({"role": "system", "content": f"Token budget: {100000 - 1000 * t} tokens left."})
        out.append({
            "model": "tiny", "max_tokens": 32, "stream": True,
            "system": [{"type": "text", "text": billing(rng)},
                       {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                        "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "You are an interactive CLI tool. " * 8,
                        "cache_control": {"type": "ephemeral"}}],
            "tools": TOOLS, "messages": msgs, "metadata": {"user_id": f"user_x_session_{seed}"},
        })  # fmt: skip
        history.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"I should run the test {t}.", "signature": "sig"},
            {"type": "text", "text": f"Running the tests ({t})."},
            {"type": "tool_use", "id": f"toolu_{seed}_{t}", "name": "Bash", "input": {"command": f"pytest -k t{t}"}},
        ]})  # fmt: skip
    return out


def codex(turns: int, seed: int) -> list[dict[str, Any]]:
    """``turns`` Responses requests of one Codex session (full ``input`` every turn)."""
    items: list[dict[str, Any]] = []
    out = []
    tools = [{"type": "function", "name": "shell", "description": "Runs a shell command. " * 6,
              "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                             "required": ["command"]}, "strict": False}]  # fmt: skip
    for t in range(turns):
        if t == 0:
            items.append({"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>"},
                {"type": "input_text", "text": f"Make test {seed} pass."}]})  # fmt: skip
        else:
            items.append({"type": "function_call_output", "call_id": f"call_{seed}_{t - 1}", "output": f"exit 0 ({t})"})
        out.append({"model": "tiny", "max_output_tokens": 32, "stream": True, "store": False,
                    "instructions": "You are Codex, a coding agent. " * 10, "input": json.loads(json.dumps(items)),
                    "tools": tools, "tool_choice": "auto", "parallel_tool_calls": False})  # fmt: skip
        items.append({"type": "function_call", "call_id": f"call_{seed}_{t}", "name": "shell",
                      "arguments": json.dumps({"command": ["pytest", f"-k{t}"]})})  # fmt: skip
    return out


def opencode(turns: int, seed: int) -> list[dict[str, Any]]:
    """``turns`` chat requests of one OpenCode session."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": [
        {"type": "text", "text": "You are opencode, an interactive CLI agent. " * 6},
        {"type": "text", "text": f"Working directory: /repo/{seed}"}]}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "read", "description": "Read a file. " * 5,
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
    out = []
    for t in range(turns):
        if t == 0:
            msgs.append({"role": "user", "content": [{"type": "text", "text": "Read the README"},
                                                     {"type": "text", "text": "and summarise it."}]})  # fmt: skip
        else:
            msgs.append({"role": "tool", "tool_call_id": f"c{seed}_{t - 1}", "content": f"# README {t}\nHello."})
        out.append({"model": "tiny", "max_tokens": 32, "stream": True, "messages": json.loads(json.dumps(msgs)),
                    "tools": tools})  # fmt: skip
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{seed}_{t}", "type": "function", "function": {"name": "read", "arguments": '{"path": "README"}'}}]})  # fmt: skip
    return out


#: Qwen-style template with tools (rendered as JSON in the system turn), tool calls with object arguments and tool
#: results: a template that reads content as a string (vLLM's "string" format).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{%- endif %}# Tools\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' and not loop.first %}"
    "<|im_start|>system\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{%- endif %}"
    "{{ message.content }}{%- for tc in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def corpus(sessions: int = 4, turns: int = 4) -> list[tuple[str, dict[str, Any]]]:
    """``(endpoint, body)`` for ``sessions`` sessions of each client, ``turns`` turns each."""
    out: list[tuple[str, dict[str, Any]]] = []
    for s in range(sessions):
        out += [("/v1/messages", b) for b in claude_code(turns, s)]
        out += [("/v1/responses", b) for b in codex(turns, s)]
        out += [("/v1/chat/completions", b) for b in opencode(turns, s)]
    return out
