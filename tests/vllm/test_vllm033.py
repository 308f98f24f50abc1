"""What vLLM 0.33.0 changed for pdctl, over fixtures written by 0.33's own code (tests/fixtures/vllm-033/, made by
``benchmarks/vllm033_fixtures.py``; its docstring says how): the end of a Responses stream cut by
``max_output_tokens``, an event batch whose ``BlockStored`` has ``lookahead_token_ids``, and the log lines pdctl
classifies or diagnoses.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdctl.gateway.record import RequestRecord
from pdctl.gateway.relay import relay
from pdctl.vllm.diagnose import diagnose
from pdctl.vllm.kv_events import BlockRemoved, BlockStored, KVEventBatch, decode_batch
from pdctl.vllm.kvlog import classify
from pdctl.vllm.sse import sse_events

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-033"
SSE = (FIXTURES / "responses-incomplete.sse").read_bytes()
LOG = (FIXTURES / "log-lines.txt").read_text().splitlines()


class _Body:
    """A worker's streamed body in the given pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = iter(pieces)

    async def read(self) -> bytes:
        return b"".join(self.pieces)

    async def chunk(self) -> bytes:
        await asyncio.sleep(0)
        return next(self.pieces, b"")


async def _relay(pieces: list[bytes]) -> tuple[bytes, Any]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    now = time.monotonic()
    ex = RequestRecord(send=send, request_id="r", started=now, deadline=now + 30, stream=True, wire="responses")
    result = await relay(ex, _Body(pieces), stream=True)
    return b"".join(m["body"] for m in sent[1:]), result


def test_the_recorded_stream_ends_with_response_incomplete() -> None:
    events = [json.loads(e) for e in sse_events(SSE)]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "response.completed" not in kinds
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    (item,) = final["output"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Prefill reads the"


@pytest.mark.parametrize("split", ["whole", "per_event", "bytes_of_13"])
def test_the_gateway_relays_an_incomplete_stream_as_finished(split: str) -> None:
    if split == "whole":
        pieces = [SSE]
    elif split == "per_event":
        pieces = [e + b"\n\n" for e in SSE.split(b"\n\n") if e]
    else:
        pieces = [SSE[i : i + 13] for i in range(0, len(SSE), 13)]
    out, result = asyncio.run(_relay(pieces))
    assert out == SSE  # no error event after the terminal one
    assert result.done and result.error is None and result.completion_tokens == 3


def test_a_stream_without_its_terminal_event_still_fails() -> None:
    cut = SSE[: SSE.rindex(b"event: response.incomplete")]
    out, result = asyncio.run(_relay([cut]))
    assert not result.done and result.error is not None and result.error.code == "upstream_error"
    assert out.startswith(cut) and b"event: error" in out[len(cut) :]


def test_block_stored_with_lookahead_token_ids_decodes() -> None:
    batch = decode_batch((FIXTURES / "kv-events-lookahead.msgpack").read_bytes())
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [1111, 2222] and stored.token_ids == list(range(8))
    assert stored.lookahead_token_ids == [[4, 5], [8, 9]]
    assert removed.block_hashes == [999] and batch.data_parallel_rank == 0


def test_block_stored_without_lookahead_as_0_32_sends_it() -> None:
    stored = BlockStored([7], None, [1, 2], 2, None, "GPU", None)
    payload = msgspec.msgpack.encode(KVEventBatch(1.0, [stored]))
    assert b"lookahead_token_ids" not in payload  # a default is omitted, as vLLM's omit_defaults structs do
    (back,) = decode_batch(payload).events
    assert isinstance(back, BlockStored) and back.lookahead_token_ids is None and back.block_hashes == [7]


def test_the_kv_load_failure_lines_of_0_33() -> None:
    recovered, failing = classify(LOG[0]), classify(LOG[1])
    assert recovered is not None and recovered.phase == "kv_failure"
    assert recovered.detail == "2 request(s) rescheduled to recompute after a KV load failure (384 tokens)"
    assert recovered.time == "12-05 12:00:00" and recovered.process == "EngineCore"
    assert failing is not None and failing.phase == "kv_failure" and failing.request_id == "cmpl-abc-0-1234abcd"
    assert failing.detail.startswith("1 request(s) failed: KV load failure (failure_policy=fail")


@pytest.mark.parametrize("n", [2, 3])
def test_not_pairing_blocks_is_a_kv_failure_naming_both_sizes(n: int) -> None:
    event = classify(LOG[n])
    assert event is not None and event.phase == "kv_failure" and event.level == "WARNING"
    remote, local = ("528", "16") if n == 2 else ("48", "32")
    assert f"remote {remote}-token blocks cannot be paired with local {local}-token blocks" in event.detail
    assert "(keyword match)" not in event.detail


def test_the_nixl_version_refusal_is_diagnosed() -> None:
    tail = ["(EngineCore pid=9) ERROR 12-05 12:00:00 [core.py:1] EngineCore failed to start.", LOG[4]]
    found = diagnose(tail)
    assert found is not None and found.code == "nixl_version"
    assert found.line == "RuntimeError: NIXL >= 99.0.0 is required, but nixl==1.5.1 is installed"
    assert "pip install -U nixl" in found.hint
