"""A chat request as its template receives it, the last of vLLM's rewrites (:mod:`pdctl.gateway.prompt_view` does
the others): the messages the template sees (:func:`conversation`, vLLM 0.32's
``chat_utils._parse_chat_message_content`` and ``_postprocess_messages``), how the template reads content
(:func:`content_format`) and whether it wants one system message first (:func:`merge_inline_system`); and the
prompt as the gateway's prefix views read it: its parts in order (:func:`prompt_parts`, which
:class:`pdctl.gateway.agent_sessions.CacheBreaks` compares turn to turn) and one canonical string
(:func:`canonical_text`, the approximate view's). None wherever the rewrite is not known exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pdctl.gateway.prompt_view import TEXT_PARTS, ChatRequest, NotExact, strip_billing

__all__ = ["ContentFormat", "canonical_text", "content_format", "conversation", "merge_inline_system", "prompt_parts"]

ContentFormat = Literal["string", "openai"]
"""How a chat template reads a message's content: one string, or a list of typed parts (vLLM's
``--chat-template-content-format``, detected from the template)."""


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise NotExact
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, Mapping) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise NotExact  # images, audio, tool references: the engine's own placeholders
    return texts


def _arguments(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping) or call.get("type", "function") != "function":
        raise NotExact
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise NotExact
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
        raise NotExact
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
    except NotExact:
        return None


def _conversation(messages: Sequence[Any], fmt: ContentFormat, developer_role: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise NotExact
        role = m["role"]
        raw = m.get("content")
        parts: list[Any] = [raw] if isinstance(raw, str) else [] if raw is None else raw
        if not isinstance(parts, list):
            raise NotExact
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
                    raise NotExact
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
