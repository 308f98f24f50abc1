"""The KV events port under hostile publishers (docs/reliability.md, Hostile clients and hostile networks): topics
that are none of the deployment's workers, forged block sizes, unhashable ``extra_keys``, impossible block
counts, and a Hypothesis fuzzer feeding arbitrary msgpack to :meth:`~pdctl.gateway.routing.kv_events.KvEventSubscriber.feed`;
then the loop failing through a real ZMQ socket and coming back.

``PDCTL_FUZZ_EXAMPLES=2000 pytest tests/gateway/test_kv_events_hostile.py`` runs a longer search.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.gateway.routing.exact_view import ExactIndex, token_block_hashes
from pdctl.gateway.routing.kv_events import KvEventSubscriber
from pdctl.vllm.kv_events import BlockStored, KVEventBatch

BS = 16
WORKERS = ("prefill", "decode", "decode@10.0.0.7")
_ENC = msgspec.msgpack.Encoder()
_EXAMPLES = int(os.environ.get("PDCTL_FUZZ_EXAMPLES", "150"))


def _stored(ids: Sequence[int], hashes: Sequence[int], parent: int | None = None, bs: int = BS,
            extra: Any = None) -> BlockStored:  # fmt: skip
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(ids), block_size=bs,
                       lora_id=None, medium="GPU", lora_name=None, extra_keys=extra or [None] * len(hashes),
                       group_idx=0)  # fmt: skip


def _frames(topic: str, seq: int, *events: Any) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), _ENC.encode(KVEventBatch(1.0, list(events), 0))]


def _raw(topic: str, seq: int, payload: Any) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), msgspec.msgpack.encode(payload)]


def _subscriber(counted: list[tuple[str, str]], max_blocks: int = 1 << 20) -> KvEventSubscriber:
    return KvEventSubscriber("tcp://127.0.0.1:1", lambda t, w: counted.append((t, w)),
                             allowed=WORKERS.__contains__, max_blocks=max_blocks)  # fmt: skip


def _state(sub: KvEventSubscriber) -> dict[str, tuple[int | None, int, int]]:
    return {t: (v.block_size, len(v), v.orphans) for t, v in sub.views.items()}


def test_junk_topics_get_no_view_no_tracker_and_no_label_of_their_own() -> None:
    counted: list[tuple[str, str]] = []
    sub = _subscriber(counted)
    ids = list(range(2 * BS))
    sub.feed(_frames("decode", 0, _stored(ids, [1, 2])))
    before = _state(sub)
    for i in range(20_000):
        sub.feed(_frames(f"junk-{i}", 0, _stored(ids, [1, 2], bs=1)))
    sub.feed(_frames("decode-evil", 1, _stored(ids, [1, 2], bs=1)))  # a prefix of a worker's name is not its name
    assert _state(sub) == before and set(sub.views) == {"decode"} and len(sub._seq) == 1
    assert {t for t, _ in counted} == {"decode", "-"} and counted.count(("-", "unknown_topic")) == 20_001
    view = sub.view("decode")
    assert view is not None and view.match(token_block_hashes(ids, BS)) == 2


def test_the_latest_block_size_wins_so_a_forged_first_message_pins_nothing() -> None:
    sub = _subscriber([])
    ids = list(range(2 * BS))
    sub.feed(_frames("decode", 0, _stored(ids, list(range(2 * BS)), bs=1)))  # forged: block size 1
    sub.feed(_frames("decode", 1, _stored(ids, [1, 2])))  # the engine's own
    view = sub.view("decode")
    assert view is not None and view.block_size == BS and len(view) == 2
    assert view.match(token_block_hashes(ids, BS)) == 2


def test_nested_extra_keys_are_hashed_not_fatal_and_match_no_plain_prompt() -> None:
    counted: list[tuple[str, str]] = []
    sub = _subscriber(counted)
    ids = list(range(BS))
    # msgpack has no tuples: an extra key holding a tuple (a multimodal hash with its offset) arrives as a list
    event = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": ids,
             "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [[["mm-hash", 3], {"k": [1]}]]}  # fmt: skip
    sub.feed(_raw("decode", 0, [1.0, [event], 0]))
    view = sub.view("decode")
    assert view is not None and len(view) == 1 and ("decode", "malformed") not in counted
    assert view.match(token_block_hashes(ids, BS)) == 0
    sub.feed(_frames("decode", 1, _stored(ids, [8])))  # the loop goes on
    assert view.match(token_block_hashes(ids, BS)) == 1


def test_a_message_that_cannot_be_applied_is_dropped_and_its_view_starts_over() -> None:
    counted: list[tuple[str, str]] = []
    sub = _subscriber(counted)
    ids = list(range(2 * BS))
    sub.feed(_frames("decode", 0, _stored(ids, [1, 2])))
    sub.feed(_frames("decode", 1, _stored(ids[:BS], [3], bs=0)))  # block size 0: nothing sensible to apply
    view = sub.view("decode")
    assert view is not None and len(view) == 0 and counted.count(("decode", "malformed")) == 1
    sub.feed(_frames("decode", 2, b"not an event"))  # undecodable: dropped, counted
    sub.feed([b"decode", b"\x00"])  # two frames
    assert counted.count(("decode", "malformed")) == 2 and counted.count(("-", "malformed")) == 1
    sub.feed(_frames("decode", 3, _stored(ids, [1, 2])))
    assert view.match(token_block_hashes(ids, BS)) == 2


def test_a_view_never_holds_more_than_its_bound() -> None:
    counted: list[tuple[str, str]] = []
    sub = _subscriber(counted, max_blocks=8)
    ids = list(range(12 * BS))
    sub.feed(_frames("decode", 0, _stored(ids[: 6 * BS], range(6))))
    sub.feed(_frames("decode", 1, _stored(ids[6 * BS :], range(6, 12), parent=5)))  # 12 blocks > 8: lies
    view = sub.view("decode")
    assert view is not None and len(view) <= 8 and ("decode", "overflow") in counted
    ix = ExactIndex(max_blocks=3)
    ix.apply(_stored(ids[: 3 * BS], [1, 2, 3]))
    assert len(ix) == 3 and ix.overflows == 0


def test_a_views_bound_follows_its_engines_reported_capacity() -> None:
    """``capacity(topic)``: twice the engine's blocks bounds its view, under the configured bound; unknown: the
    configured bound alone."""
    counted: list[tuple[str, str]] = []
    reported = {"decode": 3}
    sub = KvEventSubscriber("tcp://127.0.0.1:1", lambda t, w: counted.append((t, w)), allowed=WORKERS.__contains__,
                            max_blocks=100, capacity=reported.get)  # fmt: skip
    ids = list(range(10 * BS))
    sub.feed(_frames("decode", 0, _stored(ids[: 6 * BS], range(6))))
    sub.feed(_frames("prefill", 0, _stored(ids, range(10))))
    assert _state(sub) == {"decode": (BS, 6, 0), "prefill": (BS, 10, 0)} and ("decode", "overflow") not in counted
    sub.feed(_frames("decode", 1, _stored(ids[6 * BS : 7 * BS], [6], parent=5)))  # a 7th block > 2 x 3
    assert ("decode", "overflow") in counted and ("prefill", "overflow") not in counted
    view = sub.view("decode")
    assert view is not None and view.max_blocks == 6 and len(view) <= 6


# ------------------------------------------------------------------------------------------------- the fuzzer

_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
_any = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                    max_leaves=20)  # fmt: skip
_ints = st.lists(st.integers(0, 2**32), max_size=4 * BS)
_event = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", ""])},
    optional={"block_hashes": st.one_of(st.lists(st.integers(0, 50), max_size=6), _any),
              "parent_block_hash": st.one_of(st.none(), st.integers(0, 50), _any),
              "token_ids": st.one_of(_ints, _any), "block_size": st.one_of(st.integers(-2, 2 * BS), _any),
              "lora_id": st.none(), "medium": st.just("GPU"), "lora_name": st.none(),
              "extra_keys": st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(_any, max_size=3)),
                                                          max_size=6), _any),
              "group_idx": st.one_of(st.none(), st.integers(-1, 2), _any)},
)  # fmt: skip
_payload = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda p: msgspec.msgpack.encode(p), _any),
    st.builds(lambda ts, evs, rank: msgspec.msgpack.encode([ts, evs, rank]),
              st.one_of(st.floats(), _any), st.lists(_event, max_size=4), st.one_of(st.integers(0, 3), _any)),
)  # fmt: skip
_message = st.tuples(
    st.one_of(st.sampled_from(WORKERS), st.text(max_size=12)),
    st.one_of(st.integers(0, 8).map(lambda n: n.to_bytes(8, "big")), st.binary(max_size=9)),
    _payload,
    st.integers(2, 4),
)


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_message, min_size=1, max_size=12))
def test_hostile_msgpack_crashes_nothing_bounds_memory_and_unknown_topics_change_nothing(
    messages: list[tuple[str, bytes, bytes, int]],
) -> None:
    counted: list[tuple[str, str]] = []
    sub = _subscriber(counted, max_blocks=16)
    for topic, seq, payload, n in messages:
        frames = [topic.encode("utf-8", "surrogatepass"), seq, payload, b""][:n]
        before = _state(sub)
        sub.feed(frames)  # raises nothing, whatever it is fed
        if topic not in WORKERS or n != 3:
            assert _state(sub) == before
        assert set(sub.views) <= set(WORKERS) and set(sub._seq) <= set(WORKERS)
        assert all(len(v) <= 16 for v in sub.views.values())
    assert {t for t, _ in counted} <= {*WORKERS, "-"}


# ------------------------------------------------------------------------------------ the loop fails and returns


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_failed_loop_is_counted_reads_as_absent_and_listens_again() -> None:
    counted: list[tuple[str, str]] = []
    failures = [RuntimeError("the metrics registry broke")]

    def count(topic: str, what: str) -> None:
        counted.append((topic, what))
        if what == "unknown_topic" and failures:
            raise failures.pop()

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sub = KvEventSubscriber(endpoint, count, allowed=WORKERS.__contains__)
    ids = list(range(BS))

    async def until(cond: Any, pub: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        for _ in range(500):
            if cond():
                return
            await pub.send_multipart(frames)
            await asyncio.sleep(0.02)
        raise AssertionError("the condition never held")

    async def main() -> None:
        task = asyncio.create_task(sub.run())
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.connect(endpoint)  # as vLLM's publisher does; it reconnects by itself when the gateway binds again
        try:
            seq = iter(range(10_000))
            await until(lambda: sub.view("decode") is not None, pub, _frames("decode", 0, _stored(ids, [1])))
            await until(lambda: sub.failed, pub, _frames("junk", 0, _stored(ids, [1])))
            assert sub.view("decode") is None  # the approximate view serves meanwhile
            assert ("-", "subscriber_error") in counted
            await until(lambda: not sub.failed and sub.view("decode") is not None and len(sub.views["decode"]),
                        pub, _frames("decode", next(seq), _stored(ids, [1])))  # fmt: skip
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
            ctx.term()

    asyncio.run(main())
