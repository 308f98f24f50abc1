"""Fields only pdctl sets for the engines (``kv_transfer_params``, :data:`pdctl.gateway.request.ENGINE_FIELDS`) never
come from a client, on any route: each test sends them, at the top level and inside ``vllm_xargs`` (which vLLM 0.32
merges into the same place), and reads what every in-memory worker received (docs/reliability.md, Hostile clients
and hostile networks).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from pdctl.vllm.protocol import REQUIRED_DECODE_FIELDS
from tests.fakes.gateway_harness import KEY, AsgiReply, asgi_request, make_settings, run_app

HOSTILE = {"remote_host": "attacker.invalid", "remote_port": 1, "remote_block_ids": [0, 1, 2],
           "remote_engine_id": "attacker", "do_remote_prefill": True}  # fmt: skip
INJECTED = {"kv_transfer_params": HOSTILE, "ec_transfer_params": HOSTILE,
            "vllm_xargs": {"kv_transfer_params": "x", "ec_transfer_params": "x", "kept": 1}}  # fmt: skip


def _kv() -> dict[str, Any]:
    params: dict[str, Any] = {f: f"engine-{f}" for f in REQUIRED_DECODE_FIELDS}
    params.update(remote_block_ids=[7], remote_port=5600, do_remote_prefill=True, do_remote_decode=False)
    return params


PREFILLED = MemoryReply.json({"id": "p", "choices": [{"index": 0, "text": "x"}], "usage": {"prompt_tokens": 5},
                              "kv_transfer_params": _kv()})  # fmt: skip
CHAT = MemoryReply.json({"id": "d", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hi"}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 1}})  # fmt: skip
TEXT = MemoryReply.json({"id": "d", "object": "text_completion", "choices": [{"index": 0, "text": "hi",
                         "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})  # fmt: skip
RESPONSE = MemoryReply.json({"id": "resp", "object": "response", "status": "completed", "output": [],
                             "usage": {"input_tokens": 5, "output_tokens": 1}})  # fmt: skip
MESSAGE = MemoryReply.json({"id": "msg", "type": "message", "role": "assistant", "content": [{"type": "text",
                            "text": "hi"}], "stop_reason": "end_turn",
                            "usage": {"input_tokens": 5, "output_tokens": 1}})  # fmt: skip
PREFILLED_MESSAGE = MemoryReply.json({"id": "msg-p", "type": "message", "role": "assistant", "content": [],
                                      "usage": {"input_tokens": 5, "output_tokens": 1},
                                      "kv_transfer_params": _kv()})  # fmt: skip
EMBEDDED = MemoryReply.json({"object": "list", "data": [{"index": 0, "embedding": [0.0]}], "model": "tiny"})


def _send(path: str, body: dict[str, Any], prefill: list[MemoryReply], decode: list[MemoryReply],
          strategy: str = "pd_disagg") -> tuple[AsgiReply, MemoryWorkers]:  # fmt: skip
    workers = MemoryWorkers()
    workers["prefill"].script(*prefill)
    workers["decode"].script(*decode)
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        replies.append(await asgi_request(app, path, {**body, **INJECTED}))

    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"], strategy=strategy)
    run_app(create_app(settings, KEY, clients=workers), test)
    return replies[0], workers


def _assert_clean(workers: MemoryWorkers, pd: bool) -> None:
    calls = [c for name in ("prefill", "decode") for c in workers[name].completions()]
    assert calls, "no worker was called"
    for call in calls:
        sent = call.json()
        assert "attacker" not in json.dumps(sent) and "ec_transfer_params" not in sent
        assert sent["vllm_xargs"] == {"kept": 1}  # the client's own extra arguments pass
    for call in workers["decode"].completions():
        assert call.json().get("kv_transfer_params") == (_kv() if pd else None)  # the prefill's, or none


def test_chat_on_both_legs() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    reply, workers = _send("/v1/chat/completions", body, [PREFILLED], [CHAT])
    assert reply.status == 200
    _assert_clean(workers, pd=True)


def test_completions_on_both_legs() -> None:
    reply, workers = _send("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 8}, [PREFILLED],
                           [TEXT])  # fmt: skip
    assert reply.status == 200
    _assert_clean(workers, pd=True)


def test_responses_with_server_side_tools_on_the_decode_alone() -> None:
    body = {"model": "tiny", "input": "look it up", "tools": [{"type": "web_search"}]}
    reply, workers = _send("/v1/responses", body, [], [RESPONSE])
    assert reply.status == 200 and not workers["prefill"].completions()
    _assert_clean(workers, pd=False)


def test_responses_on_both_legs() -> None:
    reply, workers = _send("/v1/responses", {"model": "tiny", "input": "hello"}, [PREFILLED], [RESPONSE])
    assert reply.status == 200
    _assert_clean(workers, pd=True)


def test_messages_on_both_legs() -> None:
    body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
    reply, workers = _send("/v1/messages", body, [PREFILLED_MESSAGE], [MESSAGE])
    assert reply.status == 200
    _assert_clean(workers, pd=True)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/embeddings", {"model": "tiny", "input": "hello"}), ("/tokenize", {"model": "tiny", "prompt": "hello"}),
     ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]})],
)  # fmt: skip
def test_the_passthrough_routes(path: str, body: dict[str, Any]) -> None:
    reply, workers = _send(path, body, [EMBEDDED], [EMBEDDED])
    assert reply.status == 200
    _assert_clean(workers, pd=False)


def test_the_colocated_strategy() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    reply, workers = _send("/v1/chat/completions", body, [CHAT], [CHAT], strategy="colocated")
    assert reply.status == 200
    _assert_clean(workers, pd=False)
