"""A request's prompt as vLLM renders it: the same rewrites, done on the gateway's own copy, before its prefix view.

The gateway's prefix views (:mod:`pdctl.gateway.routing.chooser`, the approximate text hashes and the exact token ids)
must
see the prompt the engine computes, not the bytes the client sent, or a prompt the engine serves from its prefix
cache looks new to the gateway (adaptive PD sends it over both legs, cache-aware routing loses the session). vLLM
0.32 rewrites an agent's request before rendering it; this module does the same rewrites, in the same order, and
never touches what is forwarded (the engine gets the client's body and rewrites it itself).

What vLLM does, and where (vllm-project/vllm v0.32.0):

- **Claude Code's billing line.** Claude Code sends ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli;
  cch=<changes every request>;`` as its first system block (anthropics/claude-code#24168, #40652). ``/v1/messages``
  drops every system block that starts with it (``vllm/entrypoints/anthropic/serving.py``
  ``_convert_system_message``, ``_extract_system_text``); a chat request's system message loses that first line
  (``vllm/renderers/chat_utils.py`` ``_strip_claude_code_billing_header``, for gateways that translate Anthropic to
  chat themselves).
- **/v1/messages → chat** (``AnthropicServingMessages.to_chat_completion_request``): the system blocks' texts joined
  with no separator into one leading system message; ``cache_control`` ignored; a message's text blocks kept as parts
  (one text block: a string), ``thinking`` as ``reasoning``, ``tool_use`` as ``tool_calls`` (``arguments`` = the
  input as JSON), a user's ``tool_result`` as a ``tool`` message placed before the rest of that user turn; inline
  system messages kept in place, or merged into the leading one when the template wants system first
  (:func:`~pdctl.gateway.conversation.merge_inline_system`: it renders [system, user, system, user] and raises);
  tools as chat function tools.
- **/v1/responses → chat** (``vllm/entrypoints/openai/responses/utils.py`` ``construct_input_messages``,
  ``construct_tool_dicts``): ``instructions`` as a leading system message, a string ``input`` as a user message,
  ``function_call`` items as the previous assistant message's ``tool_calls``, ``function_call_output`` as ``tool``
  messages, ``reasoning`` items as ``reasoning``, message items as they are; function tools flattened to chat tools.
- **Chat messages → the template's conversation** (:mod:`pdctl.gateway.conversation`;
  ``chat_utils._parse_chat_message_content``, ``_postprocess_messages``): text parts joined with a newline for a
  template that takes a string, kept as ``{"type": "text", "text"}`` parts for one that loops over them
  (:func:`~pdctl.gateway.conversation.content_format`); only ``role``, ``content``, ``name``, ``tool_calls``
  (arguments parsed to objects), ``reasoning`` (and ``reasoning_content``), ``tool_call_id`` kept; a tool
  message's text parts joined with a newline; ``developer`` turned into ``system`` (all system messages merged
  first) for a template that does not name the role (``vllm/renderers/hf.py``).

A request whose rewrite is not known exactly (images, an unknown item or block type, ``continue_final_message``,
invalid shapes that vLLM answers with a 400) gives None: the exact view then declines the request and the
approximate view reads the raw body (:func:`pdctl.gateway.routing.approx_view.prompt_text`).

Map: :func:`chat_request` (endpoint + body → :class:`ChatRequest`, the chat request vLLM renders),
:func:`strip_billing`; the last rewrite, chat messages → the template's conversation, and the prompt's parts and
canonical text are :mod:`pdctl.gateway.conversation`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdctl.vllm.protocol import BILLING_HEADER, MESSAGES_PATH, RESPONSES_PATH

__all__ = ["TEXT_PARTS", "ChatRequest", "NotExact", "chat_request", "strip_billing"]

CHAT = "/v1/chat/completions"
TEXT_PARTS = frozenset(("text", "input_text", "output_text"))


@dataclass(slots=True)
class ChatRequest:
    """The chat request vLLM renders for an agent route (or a chat request as sent), before content parsing."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)


class NotExact(Exception):
    """A rewrite this module does not know exactly (or a shape vLLM refuses): no view of the prompt."""


def strip_billing(parts: Sequence[Any]) -> list[Any]:
    """A chat system message's parts without Claude Code's billing line (vLLM's ``_strip_claude_code_billing_header``:
    a part starting with it loses its first line, and goes if nothing is left)."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _block_text(block: Any) -> str | None:
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise NotExact
    text = block.get("text")
    return text if block["type"] == "text" and isinstance(text, str) and text else None


def _system_text(content: Any) -> str | None:
    """An Anthropic system message's text without billing blocks (``_extract_system_text``)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        raise NotExact
    parts = [t for b in content if (t := _block_text(b)) is not None and not t.startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _tool_result(block: Mapping[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") in ("image", "tool_reference"):
                raise NotExact
        text = "\n".join(texts)
    elif content is not None:
        raise NotExact
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text}


def _anthropic_message(msg: Any, out: list[dict[str, Any]], merge: bool) -> None:
    if not isinstance(msg, Mapping) or msg.get("role") not in ("user", "assistant", "system"):
        raise NotExact
    role = msg["role"]
    content = msg.get("content")
    if role == "system":
        text = None if merge else _system_text(content)
        if text:
            out.append({"role": "system", "content": text})
        return
    chat: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        chat["content"] = content
        out.append(chat)
        return
    if not isinstance(content, list):
        raise NotExact
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        if not isinstance(block, Mapping):
            raise NotExact
        kind = block.get("type")
        if kind == "text":
            if isinstance(block.get("text"), str) and block["text"]:
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif kind == "tool_use":
            if block.get("id") in (None, "") or not isinstance(block.get("name"), str):
                raise NotExact  # vLLM would invent an id from the clock
            fn = {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}
            calls.append({"id": block["id"], "type": "function", "function": fn})
        elif kind == "tool_result":
            if role != "user":
                raise NotExact
            out.append(_tool_result(block))
        elif kind not in ("redacted_thinking", "tool_reference"):
            raise NotExact  # images, tool additions and removals (vLLM resolves the tools in effect), anything newer
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 else parts
    if not (role == "user" and "content" not in chat):
        out.append(chat)


def _function_tool(name: Any, description: Any, parameters: Any, strict: Any = None) -> dict[str, Any]:
    """A chat function tool as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives it (None fields omitted)."""
    if not isinstance(name, str):
        raise NotExact
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def _from_messages(body: Mapping[str, Any], merge: bool) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise NotExact
    out: list[dict[str, Any]] = []
    system = body.get("system")
    texts: list[str] = []
    if isinstance(system, str):
        if system:
            texts.append(system)
    elif isinstance(system, list):
        texts = [t for b in system if (t := _block_text(b)) is not None and not t.startswith(BILLING_HEADER)]
    elif system is not None:
        raise NotExact
    if merge:
        texts += [t for m in messages if isinstance(m, Mapping) and m.get("role") == "system"
                  if (t := _system_text(m.get("content")))]  # fmt: skip
    if texts:
        out.append({"role": "system", "content": "".join(texts)})
    for msg in messages:
        _anthropic_message(msg, out, merge)
    tools = None
    raw_tools = body.get("tools")
    if isinstance(raw_tools, list):
        tools = []
        for t in raw_tools:
            if not isinstance(t, Mapping) or t.get("type") not in (None, "custom") or t.get("defer_loading"):
                raise NotExact  # server tools (web search...) and deferred tools are rendered otherwise
            tools.append(_function_tool(t.get("name"), t.get("description"), t.get("input_schema"), t.get("strict")))
    elif raw_tools is not None:
        raise NotExact
    return ChatRequest(out, tools, True, _kwargs(body))


def _responses_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise NotExact
    tools = []
    for t in raw:
        if not isinstance(t, Mapping) or t.get("type") != "function":
            raise NotExact  # built-in and namespace tools: rendered otherwise, or run by vLLM itself
        tools.append(_function_tool(t.get("name"), t.get("description"), t.get("parameters"), t.get("strict")))
    return tools


def _responses_item(item: Any, out: list[dict[str, Any]]) -> None:
    if not isinstance(item, Mapping):
        raise NotExact
    prev = out[-1] if out and out[-1].get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str) or item.get("namespace"):
            raise NotExact
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "")}}  # fmt: skip
        if prev is not None and isinstance(prev.get("tool_calls", []), list):
            prev.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise NotExact
        out.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
    elif kind == "reasoning":
        raise NotExact  # encrypted content is refused, summaries are taken with a warning: not followed here
    elif item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else None
        if isinstance(content, list) and content:
            first = content[0]
            text = first.get("text") if isinstance(first, Mapping) else None
        if not isinstance(text, str):
            raise NotExact
        if prev is not None and prev.get("content") is None:
            prev["content"] = text
        else:
            out.append({"role": "assistant", "content": text})
    elif isinstance(item.get("role"), str) and kind in (None, "message"):
        if item.get("status") in ("in_progress", "incomplete"):
            raise NotExact  # a partial message is continued, not answered
        out.append({k: v for k, v in item.items() if k not in ("type", "status", "id")})
    else:
        raise NotExact


def _from_responses(body: Mapping[str, Any]) -> ChatRequest:
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise NotExact  # the history lives in the engine's store
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise NotExact
        out.append({"role": "system", "content": instructions})
    data = body.get("input")
    if isinstance(data, str):
        out.append({"role": "user", "content": data})
    elif isinstance(data, list):
        for item in data:
            _responses_item(item, out)
    else:
        raise NotExact
    tools = _responses_tools(body.get("tools"))
    return ChatRequest(out, tools, True, _kwargs(body))


def _kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise NotExact
    return dict(kwargs)


def _from_chat(body: Mapping[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or body.get("continue_final_message") or body.get("documents"):
        raise NotExact
    tools = None
    raw_tools = body.get("tools")
    if raw_tools is not None:
        if not isinstance(raw_tools, list):
            raise NotExact
        tools = []
        for t in raw_tools:
            fn = t.get("function") if isinstance(t, Mapping) and t.get("type", "function") == "function" else None
            if not isinstance(fn, Mapping):
                raise NotExact
            tools.append(_function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), fn.get("strict")))
    return ChatRequest([dict(m) if isinstance(m, Mapping) else m for m in messages], tools,
                       bool(body.get("add_generation_prompt", True)), _kwargs(body))  # fmt: skip


def chat_request(endpoint: str, body: Mapping[str, Any], merge_system: bool = False) -> ChatRequest | None:
    """The chat request vLLM renders for ``body`` sent to ``endpoint`` (None: not a chat route, or a rewrite not
    known exactly); ``merge_system``: the template wants every system message first (:func:`merge_inline_system`)."""
    try:
        if endpoint == MESSAGES_PATH:
            return _from_messages(body, merge_system)
        if endpoint == RESPONSES_PATH:
            return _from_responses(body)
        if endpoint == CHAT:
            return _from_chat(body)
    except NotExact:
        return None
    return None
