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
  (:func:`merge_inline_system`: it renders [system, user, system, user] and raises); tools as chat function tools.
- **/v1/responses → chat** (``vllm/entrypoints/openai/responses/utils.py`` ``construct_input_messages``,
  ``construct_tool_dicts``): ``instructions`` as a leading system message, a string ``input`` as a user message,
  ``function_call`` items as the previous assistant message's ``tool_calls``, ``function_call_output`` as ``tool``
  messages, ``reasoning`` items as ``reasoning``, message items as they are; function tools flattened to chat tools.
- **Chat messages → the template's conversation** (``chat_utils._parse_chat_message_content``,
  ``_postprocess_messages``): text parts joined with a newline for a template that takes a string, kept as
  ``{"type": "text", "text"}`` parts for one that loops over them (:func:`content_format`); only ``role``,
  ``content``, ``name``, ``tool_calls`` (arguments parsed to objects), ``reasoning`` (and ``reasoning_content``),
  ``tool_call_id`` kept; a tool message's text parts joined with a newline; ``developer`` turned into ``system`` (all
  system messages merged first) for a template that does not name the role (``vllm/renderers/hf.py``).

A request whose rewrite is not known exactly (images, an unknown item or block type, ``continue_final_message``,
invalid shapes that vLLM answers with a 400) gives None: the exact view then declines the request and the
approximate view reads the raw body (:func:`pdctl.gateway.routing.approx_view.prompt_text`).

Map: :func:`chat_request` (endpoint + body → :class:`ChatRequest`, the chat request vLLM renders),
:func:`conversation` (→ the messages the template sees), :func:`strip_billing`, :func:`canonical_text` (the
approximate view's string).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdctl.vllm.protocol import BILLING_HEADER, MESSAGES_PATH, RESPONSES_PATH

__all__ = [
    "ChatRequest",
    "ContentFormat",
    "canonical_text",
    "chat_request",
    "content_format",
    "conversation",
    "merge_inline_system",
    "prompt_parts",
    "strip_billing",
]

CHAT = "/v1/chat/completions"
_TEXT_PARTS = frozenset(("text", "input_text", "output_text"))

ContentFormat = Literal["string", "openai"]
"""How a chat template reads a message's content: one string, or a list of typed parts (vLLM's
``--chat-template-content-format``, detected from the template)."""


@dataclass(slots=True)
class ChatRequest:
    """The chat request vLLM renders for an agent route (or a chat request as sent), before content parsing."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)


class _Unknown(Exception):
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
        raise _Unknown
    text = block.get("text")
    return text if block["type"] == "text" and isinstance(text, str) and text else None


def _system_text(content: Any) -> str | None:
    """An Anthropic system message's text without billing blocks (``_extract_system_text``)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        raise _Unknown
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
                raise _Unknown
        text = "\n".join(texts)
    elif content is not None:
        raise _Unknown
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text}


def _anthropic_message(msg: Any, out: list[dict[str, Any]], merge: bool) -> None:
    if not isinstance(msg, Mapping) or msg.get("role") not in ("user", "assistant", "system"):
        raise _Unknown
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
        raise _Unknown
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        if not isinstance(block, Mapping):
            raise _Unknown
        kind = block.get("type")
        if kind == "text":
            if isinstance(block.get("text"), str) and block["text"]:
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif kind == "tool_use":
            if block.get("id") in (None, "") or not isinstance(block.get("name"), str):
                raise _Unknown  # vLLM would invent an id from the clock
            fn = {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}
            calls.append({"id": block["id"], "type": "function", "function": fn})
        elif kind == "tool_result":
            if role != "user":
                raise _Unknown
            out.append(_tool_result(block))
        elif kind not in ("redacted_thinking", "tool_reference"):
            raise _Unknown  # images, tool additions and removals (vLLM resolves the tools in effect), anything newer
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
        raise _Unknown
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
        raise _Unknown
    out: list[dict[str, Any]] = []
    system = body.get("system")
    texts: list[str] = []
    if isinstance(system, str):
        if system:
            texts.append(system)
    elif isinstance(system, list):
        texts = [t for b in system if (t := _block_text(b)) is not None and not t.startswith(BILLING_HEADER)]
    elif system is not None:
        raise _Unknown
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
                raise _Unknown  # server tools (web search...) and deferred tools are rendered otherwise
            tools.append(_function_tool(t.get("name"), t.get("description"), t.get("input_schema"), t.get("strict")))
    elif raw_tools is not None:
        raise _Unknown
    return ChatRequest(out, tools, True, _kwargs(body))


def _responses_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise _Unknown
    tools = []
    for t in raw:
        if not isinstance(t, Mapping) or t.get("type") != "function":
            raise _Unknown  # built-in and namespace tools: rendered otherwise, or run by vLLM itself
        tools.append(_function_tool(t.get("name"), t.get("description"), t.get("parameters"), t.get("strict")))
    return tools


def _responses_item(item: Any, out: list[dict[str, Any]]) -> None:
    if not isinstance(item, Mapping):
        raise _Unknown
    prev = out[-1] if out and out[-1].get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str) or item.get("namespace"):
            raise _Unknown
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "")}}  # fmt: skip
        if prev is not None and isinstance(prev.get("tool_calls", []), list):
            prev.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise _Unknown
        out.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
    elif kind == "reasoning":
        raise _Unknown  # encrypted content is refused, summaries are taken with a warning: not followed here
    elif item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else None
        if isinstance(content, list) and content:
            first = content[0]
            text = first.get("text") if isinstance(first, Mapping) else None
        if not isinstance(text, str):
            raise _Unknown
        if prev is not None and prev.get("content") is None:
            prev["content"] = text
        else:
            out.append({"role": "assistant", "content": text})
    elif isinstance(item.get("role"), str) and kind in (None, "message"):
        if item.get("status") in ("in_progress", "incomplete"):
            raise _Unknown  # a partial message is continued, not answered
        out.append({k: v for k, v in item.items() if k not in ("type", "status", "id")})
    else:
        raise _Unknown


def _from_responses(body: Mapping[str, Any]) -> ChatRequest:
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise _Unknown  # the history lives in the engine's store
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise _Unknown
        out.append({"role": "system", "content": instructions})
    data = body.get("input")
    if isinstance(data, str):
        out.append({"role": "user", "content": data})
    elif isinstance(data, list):
        for item in data:
            _responses_item(item, out)
    else:
        raise _Unknown
    tools = _responses_tools(body.get("tools"))
    return ChatRequest(out, tools, True, _kwargs(body))


def _kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise _Unknown
    return dict(kwargs)


def _from_chat(body: Mapping[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or body.get("continue_final_message") or body.get("documents"):
        raise _Unknown
    tools = None
    raw_tools = body.get("tools")
    if raw_tools is not None:
        if not isinstance(raw_tools, list):
            raise _Unknown
        tools = []
        for t in raw_tools:
            fn = t.get("function") if isinstance(t, Mapping) and t.get("type", "function") == "function" else None
            if not isinstance(fn, Mapping):
                raise _Unknown
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
    except _Unknown:
        return None
    return None


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise _Unknown
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, Mapping) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise _Unknown  # images, audio, tool references: the engine's own placeholders
    return texts


def _arguments(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping) or call.get("type", "function") != "function":
        raise _Unknown
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise _Unknown
    args = fn.get("arguments")
    parsed: Any = {}
    if isinstance(args, dict):
        parsed = args
    elif isinstance(args, str) and args:
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = {}
    elif args:
        raise _Unknown
    if not isinstance(parsed, dict):
        parsed = {}
    return {**call, "function": {**fn, "arguments": parsed}}


def conversation(
    messages: Sequence[Any], fmt: ContentFormat, developer_role: bool = True
) -> list[dict[str, Any]] | None:
    """The messages the chat template sees (module docstring); ``developer_role``: the template names the
    ``developer`` role (else it becomes ``system``, all system messages merged first). None: not known exactly."""
    try:
        return _conversation(messages, fmt, developer_role)
    except _Unknown:
        return None


def _conversation(messages: Sequence[Any], fmt: ContentFormat, developer_role: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise _Unknown
        role = m["role"]
        raw = m.get("content")
        parts: list[Any] = [raw] if isinstance(raw, str) else [] if raw is None else raw
        if not isinstance(parts, list):
            raise _Unknown
        if role == "system":
            parts = strip_billing(parts)
        texts = _texts(parts)
        msg: dict[str, Any] = {"role": role,
                               "content": [{"type": "text", "text": t} for t in texts] if fmt == "openai"
                               else "\n".join(texts)}  # fmt: skip
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise _Unknown
                if calls:
                    msg["tool_calls"] = [_arguments(c) for c in calls]
            reasoning = m.get("reasoning", m.get("reasoning_content"))
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(msg["content"], list):
                msg["content"] = "\n".join(texts)
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    if not developer_role and any(x["role"] == "developer" for x in out):
        out = _developer_to_system(out)
    return out


def _developer_to_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``_convert_developer_to_system`` then ``_consolidate_system_messages`` (vllm/renderers/hf.py)."""
    conv = [{k: v for k, v in {**m, "role": "system"}.items() if k != "tools"} if m["role"] == "developer" else m
            for m in conv]  # fmt: skip
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))  # fmt: skip
        if content:
            systems.append(content)
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest] if merge else conv


def content_format(source: str) -> ContentFormat:
    """``openai`` when the template loops over a message's content (``{% for part in message['content'] %}`` or
    over a variable named ``content``), else ``string``: vLLM's detection (``vllm/renderers/hf.py``
    ``_detect_content_format``), simplified to the loops themselves."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes

    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    try:
        ast = env.parse(source)
    except Exception:
        return "string"
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Name) and it.name == "content":
            return "openai"
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return "openai"
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return "openai"
    return "string"


def merge_inline_system(render: Any) -> bool:
    """Whether ``/v1/messages`` merges inline system messages into the leading one for a template: ``render`` (the
    compiled template) raises on [system, user, system, user] (vLLM's ``_detect_merge_inline_system``)."""
    import jinja2

    try:
        render.render(messages=[{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                                {"role": "system", "content": "t"}, {"role": "user", "content": "t"}],
                      add_generation_prompt=False)  # fmt: skip
    except jinja2.TemplateError:
        return True
    except Exception:
        return False
    return False


def prompt_parts(req: ChatRequest) -> list[tuple[str, str, str]] | None:
    """``req``'s prompt as parts in the order a template renders them, each ``(name, role, text)``: ``("tools",
    "tools", their JSON)``, then ``("message[i]", role, its role, reasoning, text, tool calls and tool-call id,
    fields separated)`` (None: a message whose content is not known exactly)."""
    conv = conversation(req.messages, "string")
    if conv is None:
        return None
    out: list[tuple[str, str, str]] = []
    if req.tools:
        out.append(("tools", "tools", json.dumps(req.tools, ensure_ascii=False, sort_keys=True)))
    for i, m in enumerate(conv):
        fields = [m["role"]]
        if m.get("reasoning") is not None:
            fields.append(str(m["reasoning"]))
        fields.append(m["content"])
        for call in m.get("tool_calls", ()):
            fields.append(json.dumps(call.get("function"), ensure_ascii=False, sort_keys=True))
        if m.get("tool_call_id") is not None:
            fields.append(str(m["tool_call_id"]))
        out.append((f"message[{i}]", m["role"], "\x1f".join(fields)))
    return out


def canonical_text(req: ChatRequest) -> str | None:
    """The approximate view's string for ``req``: its :func:`prompt_parts`' texts in order, separated (None: a
    message whose content is not known exactly)."""
    parts = prompt_parts(req)
    return None if parts is None else "\x1f".join(text for _, _, text in parts)
