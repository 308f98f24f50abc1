"""The simulator's agent-facing routes, ``/v1/responses`` and Anthropic ``/v1/messages``, in vLLM's shapes.

As vLLM does (``AnthropicServingMessages`` translates to an internal chat request), each request becomes a chat
request for the engine (:func:`chat_request`); the output is written back in the route's own shape: a whole JSON
answer (:func:`responses_reply`, :func:`messages_reply`, both with ``kv_transfer_params``) or its event stream
(:class:`AgentStream`; no ``kv_transfer_params`` in a stream, as vLLM). Event order and fields follow vLLM's
(vllm-project/vllm ``vllm/entrypoints/openai/responses/`` and ``vllm/entrypoints/anthropic/``), OpenAI's Responses
streaming reference and Anthropic's Messages streaming reference. A Responses reply cut by
``max_output_tokens`` is as vLLM 0.33 writes it: the output item's and the response's ``status`` are
``"incomplete"`` (``incomplete_details.reason`` ``"max_output_tokens"``) and a stream ends with
``response.incomplete`` (0.32 ended every stream with ``response.completed`` and its items ``"completed"``).

Tool calls are faked when the request forces one (Anthropic ``tool_choice`` ``{"type": "tool", "name": ...}``
or ``{"type": "any"}``; Responses ``{"type": "function", "name": ...}`` or ``"required"``): the generated text
becomes the call's arguments ``{"text": "..."}``, streamed as argument fragments one token at a time. As vLLM,
a non-streamed Anthropic reply whose forced call was cut by ``max_tokens`` is a 400 (vLLM parses the cut JSON).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdctl.sim.text import content_text
from pdctl.vllm.protocol import BILLING_HEADER, COUNT_TOKENS_PATH, MESSAGES_PATH, RESPONSES_PATH

__all__ = ["COUNT_TOKENS", "MESSAGES", "RESPONSES", "AgentStream", "ForcedTool", "chat_request", "messages_reply",
           "responses_reply"]  # fmt: skip

RESPONSES, MESSAGES, COUNT_TOKENS = RESPONSES_PATH, MESSAGES_PATH, COUNT_TOKENS_PATH

SendBytes = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ForcedTool:
    """The tool a request forces the model to call."""

    name: str


def _block_text(content: Any) -> str:
    """Text of an Anthropic or Responses ``content`` (a string or a list of blocks of any text-bearing type)."""
    if isinstance(content, str) or content is None:
        return content_text(content)
    out: list[str] = []
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, Mapping):
            continue
        if isinstance(block.get("text"), str):
            out.append(block["text"])
        elif block.get("type") == "tool_use":
            out.append(json.dumps(block.get("input", {})))
        elif block.get("type") == "tool_result":
            out.append(_block_text(block.get("content")))
    return "".join(out)


def chat_request(body: Mapping[str, Any], route: str) -> tuple[list[dict[str, Any]], Any, ForcedTool | None]:
    """The chat ``messages``, the ``max_tokens`` value and the forced tool of an agent request.

    Raises ``ValueError`` (the server answers 400) for a body the route's vLLM request class would refuse.
    """
    messages: list[dict[str, Any]] = []
    if route in (MESSAGES, COUNT_TOKENS):  # count_tokens: a Messages body without max_tokens
        system = body.get("system")
        if isinstance(system, list):  # vLLM 0.32 drops Claude Code's per-request billing block before rendering
            system = [
                b for b in system if not (isinstance(b, Mapping) and str(b.get("text", "")).startswith(BILLING_HEADER))
            ]
        if system is not None and system != []:
            messages.append({"role": "system", "content": _block_text(system)})
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise ValueError("messages: Field required (a non-empty list)")
        for m in raw:
            if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant", "system"):
                raise ValueError("messages: each message needs a role of user, assistant or system")
            text = _block_text(m.get("content"))
            if m["role"] == "system" and (not text or text.startswith(BILLING_HEADER)):
                continue  # vLLM 0.32 keeps a system message in place (Claude Code's trailing one), without the line
            messages.append({"role": m["role"], "content": text})
        if "max_tokens" not in body and route == MESSAGES:
            raise ValueError("max_tokens: Field required")
        choice = body.get("tool_choice")
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        forced = None
        if isinstance(choice, Mapping) and tools:
            if choice.get("type") == "tool" and isinstance(choice.get("name"), str):
                forced = ForcedTool(choice["name"])
            elif choice.get("type") == "any" and isinstance(tools[0], Mapping):
                forced = ForcedTool(str(tools[0].get("name", "tool")))
        return messages, body.get("max_tokens"), forced
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    data = body.get("input")
    if isinstance(data, str):
        messages.append({"role": "user", "content": data})
    elif isinstance(data, list) and data:
        for item in data:
            if not isinstance(item, Mapping):
                raise ValueError("input: each item must be an object")
            if item.get("type") == "function_call_output":
                messages.append({"role": "tool", "content": str(item.get("output", ""))})
            elif item.get("type") == "function_call":
                messages.append({"role": "assistant", "content": str(item.get("arguments", ""))})
            else:
                messages.append({"role": str(item.get("role", "user")), "content": _block_text(item.get("content"))})
    else:
        raise ValueError("input: a string or a non-empty list of items is required")
    choice = body.get("tool_choice")
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    forced = None
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        forced = ForcedTool(choice["name"])
    elif choice == "required" and tools and isinstance(tools[0], Mapping):
        forced = ForcedTool(str(tools[0].get("name", "tool")))
    return messages, body.get("max_output_tokens"), forced


def _stop_reason(finish_reason: str | None, forced: ForcedTool | None) -> str:
    if forced is not None:
        return "tool_use"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def _anthropic_usage(prompt_len: int, output: int) -> dict[str, Any]:
    return {"input_tokens": prompt_len, "output_tokens": output, "cache_creation_input_tokens": None,
            "cache_read_input_tokens": None}  # fmt: skip


def _responses_usage(prompt_len: int, output: int) -> dict[str, Any]:
    return {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt_len + output}  # fmt: skip


def _args(text: str) -> str:
    return json.dumps({"text": text})


def messages_reply(
    msg_id: str, model: str, text: str, finish_reason: str | None, forced: ForcedTool | None,
    prompt_len: int, output: int, kv_params: Mapping[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """vLLM's non-streaming ``AnthropicMessagesResponse`` (``id`` is the chat id, as vLLM's)."""
    block: dict[str, Any] = (
        {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": forced.name, "input": {"text": text}}
        if forced is not None
        else {"type": "text", "text": text}
    )
    return {
        "id": msg_id, "type": "message", "role": "assistant", "content": [block], "model": model,
        "stop_reason": _stop_reason(finish_reason, forced), "stop_sequence": None,
        "usage": _anthropic_usage(prompt_len, output), "kv_transfer_params": kv_params,
    }  # fmt: skip


def _response_object(
    resp_id: str, model: str, body: Mapping[str, Any], status: str, output: list[dict[str, Any]],
    usage: dict[str, Any] | None, kv_params: Mapping[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    return {
        "id": resp_id, "object": "response", "created_at": int(time.time()), "model": model, "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None, "instructions": body.get("instructions"), "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []), "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0), "store": False,
        "background": False, "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
        "user": None, "metadata": body.get("metadata"), "kv_transfer_params": kv_params,
    }  # fmt: skip


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if status != "in_progress":
        content.append({"type": "output_text", "text": text, "annotations": [], "logprobs": None})
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def _status(finish_reason: str | None) -> str:
    """A Responses item's and response's status (vLLM 0.33's ``response_item_status``)."""
    return "incomplete" if finish_reason == "length" else "completed"


def responses_reply(
    resp_id: str, model: str, body: Mapping[str, Any], text: str, finish_reason: str | None,
    forced: ForcedTool | None, prompt_len: int, output: int, kv_params: Mapping[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """vLLM's non-streaming ``ResponsesResponse``; a max-token stop is ``status: "incomplete"``, its item's too."""
    status = _status(finish_reason)
    item = (
        _call_item(f"fc_{secrets.token_hex(8)}", f"call_{secrets.token_hex(8)}", forced.name, _args(text), status)
        if forced is not None
        else _message_item(f"msg_{secrets.token_hex(8)}", text, status)
    )
    usage = _responses_usage(prompt_len, output)
    return _response_object(resp_id, model, body, status, [item], usage, kv_params)


@dataclass(slots=True, eq=False)
class AgentStream:
    """One agent stream: :meth:`start`, :meth:`token` per generated token, then :meth:`finish` or :meth:`fail`."""

    route: str
    send: SendBytes
    resp_id: str
    model: str
    body: Mapping[str, Any]
    forced: ForcedTool | None
    prompt_len: int
    _seq: int = field(default=0, init=False)
    _text: list[str] = field(default_factory=list, init=False)
    _item_id: str = field(default="", init=False)
    _call_id: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self._item_id = f"{'fc' if self.forced else 'msg'}_{secrets.token_hex(8)}"
        self._call_id = f"call_{secrets.token_hex(8)}"

    async def _event(self, kind: str, data: dict[str, Any]) -> None:
        if self.route == RESPONSES:
            data = {"type": kind, **data, "sequence_number": self._seq}
            self._seq += 1
        else:
            data = {"type": kind, **data}
        await self.send(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())

    async def start(self) -> None:
        """The opening events, up to an empty text block or tool call."""
        if self.route == MESSAGES:
            message: dict[str, Any] = {
                "id": self.resp_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
                "stop_reason": None, "stop_sequence": None, "usage": _anthropic_usage(self.prompt_len, 0),
            }  # fmt: skip
            await self._event("message_start", {"message": message})
            block: dict[str, Any] = (
                {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": self.forced.name, "input": {}}
                if self.forced is not None
                else {"type": "text", "text": ""}
            )
            await self._event("content_block_start", {"index": 0, "content_block": block})
            if self.forced is not None:
                await self._event("content_block_delta", {"index": 0, "delta": {
                    "type": "input_json_delta", "partial_json": '{"text": "'}})  # fmt: skip
            return
        pending = _response_object(self.resp_id, self.model, self.body, "in_progress", [], None, None)
        pending.pop("kv_transfer_params")
        await self._event("response.created", {"response": pending})
        await self._event("response.in_progress", {"response": pending})
        if self.forced is not None:
            item = _call_item(self._item_id, self._call_id, self.forced.name, "", "in_progress")
            await self._event("response.output_item.added", {"output_index": 0, "item": item})
            await self._event("response.function_call_arguments.delta", {
                "item_id": self._item_id, "output_index": 0, "delta": '{"text": "'})  # fmt: skip
            return
        await self._event("response.output_item.added", {"output_index": 0,
                          "item": _message_item(self._item_id, "", "in_progress")})  # fmt: skip
        empty = {"type": "output_text", "text": "", "annotations": []}
        await self._event("response.content_part.added", {"item_id": self._item_id, "output_index": 0,
                          "content_index": 0, "part": empty})  # fmt: skip

    async def token(self, text: str) -> None:
        """One generated token: a text delta, or an argument fragment of the forced tool call."""
        self._text.append(text)
        if self.forced is not None:
            fragment = json.dumps(text)[1:-1]
            if self.route == MESSAGES:
                delta = {"type": "input_json_delta", "partial_json": fragment}
                await self._event("content_block_delta", {"index": 0, "delta": delta})
            else:
                await self._event("response.function_call_arguments.delta", {
                    "item_id": self._item_id, "output_index": 0, "delta": fragment})  # fmt: skip
        elif self.route == MESSAGES:
            await self._event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
        else:
            await self._event("response.output_text.delta", {"item_id": self._item_id, "output_index": 0,
                              "content_index": 0, "delta": text, "logprobs": []})  # fmt: skip

    async def finish(self, finish_reason: str | None, output: int) -> None:
        """The closing events: ``message_stop``, or ``response.completed`` / ``response.incomplete`` (a reply cut by
        ``max_output_tokens``), with usage."""
        text = "".join(self._text)
        if self.route == MESSAGES:
            if self.forced is not None:
                await self._event("content_block_delta", {"index": 0, "delta": {
                    "type": "input_json_delta", "partial_json": '"}'}})  # fmt: skip
            await self._event("content_block_stop", {"index": 0})
            await self._event("message_delta", {
                "delta": {"stop_reason": _stop_reason(finish_reason, self.forced), "stop_sequence": None},
                "usage": _anthropic_usage(self.prompt_len, output)})  # fmt: skip
            await self._event("message_stop", {})
            return
        status = _status(finish_reason)
        if self.forced is not None:
            args = _args(text)
            await self._event("response.function_call_arguments.delta", {
                "item_id": self._item_id, "output_index": 0, "delta": '"}'})  # fmt: skip
            await self._event("response.function_call_arguments.done", {
                "item_id": self._item_id, "output_index": 0, "arguments": args, "name": self.forced.name})  # fmt: skip
            item = _call_item(self._item_id, self._call_id, self.forced.name, args, status)
        else:
            await self._event("response.output_text.done", {"item_id": self._item_id, "output_index": 0,
                              "content_index": 0, "text": text, "logprobs": []})  # fmt: skip
            part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
            await self._event("response.content_part.done", {"item_id": self._item_id, "output_index": 0,
                              "content_index": 0, "part": part})  # fmt: skip
            item = _message_item(self._item_id, text, status)
        await self._event("response.output_item.done", {"output_index": 0, "item": item})
        done = _response_object(self.resp_id, self.model, self.body, status, [item],
                                _responses_usage(self.prompt_len, output), None)  # fmt: skip
        await self._event(f"response.{status}", {"response": done})

    async def fail(self, message: str) -> None:
        """A failure after the first event: Anthropic's ``event: error``; a Responses stream is cut (as vLLM)."""
        if self.route == MESSAGES:
            await self._event("error", {"error": {"type": "internal_error", "message": message}})
