"""The simulator's KV cache event publisher: ``--kv-events-config`` and a ZMQ PUB socket, as vLLM 0.32 has them.

Mirrors vllm/config/kv_events.py (``KVEventsConfig``) and vllm/distributed/kv_events.py (``ZmqEventPublisher``,
``NullEventPublisher``, ``EventPublisherFactory``); the wire format is pdctl.vllm.kv_events's, whose structs
encode the batches here.

- :func:`parse_config`: the flag's JSON -> :class:`KVEventsSettings`, rejecting unknown keys and wrong types as
  vLLM's pydantic config does (:class:`KVEventsConfigError`).
- :func:`create_publisher`: settings -> :class:`ZmqEventPublisher`, or :class:`NullEventPublisher` when events
  are off or ``publisher`` is ``"null"``.
- :class:`ZmqEventPublisher`: ``publish(batch)`` queues (never blocks the caller); one thread owns the sockets
  and sends each batch as ``[topic, seq (8 bytes big-endian, 0, 1, ...), msgpack payload]``. The PUB socket
  binds when the endpoint has ``*`` or ``::`` or is ipc/inproc and connects otherwise; the optional replay
  ROUTER socket always binds and answers ``[b"", start_seq]`` with the buffered batches from ``start_seq`` on,
  then ``[b"", b"", END_SEQ, b""]``.

The simulator is one engine, data-parallel rank 0, so the endpoints' ports are used as given.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import msgspec
import zmq

from pdctl.vllm.kv_events import KVEventBatch

__all__ = [
    "KVEventsConfigError",
    "KVEventsSettings",
    "NullEventPublisher",
    "Publisher",
    "ZmqEventPublisher",
    "create_publisher",
    "is_bind_endpoint",
    "parse_config",
]

END_SEQ_BYTES = (-1).to_bytes(8, "big", signed=True)


class KVEventsConfigError(ValueError):
    """``--kv-events-config`` is not a valid ``KVEventsConfig`` (the message is vLLM's validation error)."""


@dataclass(frozen=True, slots=True)
class KVEventsSettings:
    """vLLM's ``KVEventsConfig``: the same keys, defaults and meaning."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    """``"zmq"`` or ``"null"``; when not given, ``"zmq"`` if events are enabled, else ``"null"``."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """The PUB socket's send high-water mark (messages queued for a slow subscriber before ZMQ drops)."""
    max_queue_size: int = 100_000
    """Batches queued for the publisher thread; beyond it the simulator drops them (vLLM would block)."""
    topic: str = ""

    @property
    def active(self) -> bool:
        """Whether a ZMQ publisher is created."""
        return self.enable_kv_cache_events and self.publisher != "null"


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str,),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}
_EXPECTED = {bool: "a valid boolean", str: "a valid string", int: "a valid integer"}


def _error(key: str, message: str, value: Any) -> KVEventsConfigError:
    # pydantic's layout, as vLLM prints a rejected config: the model, the field, the message and the input.
    return KVEventsConfigError(
        f"1 validation error for KVEventsConfig\n{key}\n  {message} [input_value={value!r}, input_type="
        f"{type(value).__name__}]"
    )


def parse_config(raw: str) -> KVEventsSettings:
    """``--kv-events-config`` JSON -> settings; raises :class:`KVEventsConfigError` for what vLLM rejects."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise KVEventsConfigError(f"--kv-events-config is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise KVEventsConfigError("--kv-events-config must be a JSON object")
    known = {f.name for f in fields(KVEventsSettings)}
    for key, value in data.items():
        if key not in known:
            raise _error(key, "Extra inputs are not permitted", value)
        types = _TYPES[key]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise _error(key, f"Input should be {_EXPECTED[types[0]]}", value)
    if data.get("publisher") not in (None, "zmq", "null"):
        raise _error("publisher", "Input should be 'null' or 'zmq'", data["publisher"])
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if key in data and data[key] < 0:
            raise _error(key, "Input should be greater than or equal to 0", data[key])
    enabled = bool(data.get("enable_kv_cache_events", False))
    publisher = data.get("publisher") or ("zmq" if enabled else "null")
    return KVEventsSettings(**{**data, "publisher": publisher})


def is_bind_endpoint(endpoint: str) -> bool:
    """Whether the PUB socket binds ``endpoint`` (a wildcard, IPv6 or ipc/inproc address) rather than dials it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher(Protocol):
    """What the engine publishes its step's events through."""

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch; never blocks."""

    def shutdown(self) -> None:
        """Send what is queued (within a second), then close."""


class NullEventPublisher:
    """Events off: every batch is dropped (vLLM's ``NullEventPublisher``)."""

    def publish(self, batch: KVEventBatch) -> None:
        """Drop ``batch``."""

    def shutdown(self) -> None:
        """Nothing to close."""


class ZmqEventPublisher:
    """vLLM's ``ZmqEventPublisher``: a PUB socket (and an optional replay ROUTER) fed by one thread.

    The sockets are made and bound or connected here, so an address in use fails at start-up (``zmq.ZMQError``);
    from then on only the thread touches them. ``on_drop`` is called (from the caller's thread) with the number
    of batches dropped so far when the queue is full."""

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, settings: KVEventsSettings, on_drop: Callable[[int], None] | None = None) -> None:
        self.settings = settings
        self.dropped = 0
        self._on_drop = on_drop
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=settings.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._topic = settings.topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(settings.hwm)
            if is_bind_endpoint(settings.endpoint):
                self._pub.bind(settings.endpoint)
            else:
                self._pub.connect(settings.endpoint)
            if settings.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(settings.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="zmq-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch`` for the thread (dropped, and counted, when the queue is full)."""
        if not self._running:
            raise RuntimeError("Publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop(self.dropped)

    def shutdown(self) -> None:
        """Stop the thread once the queue is sent (or after a second), close the sockets with linger 0."""
        if not self._running:
            return
        self._running = False
        deadline = time.monotonic() + self.SHUTDOWN_TIMEOUT_S
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            with contextlib.suppress(zmq.ZMQError):
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # vLLM logs "Invalid replay request" and answers nothing
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ_BYTES, b""))


def create_publisher(
    settings: KVEventsSettings | None, on_drop: Callable[[int], None] | None = None
) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``settings`` ask for (vLLM's ``EventPublisherFactory.create``)."""
    if settings is None or not settings.active:
        return NullEventPublisher()
    return ZmqEventPublisher(settings, on_drop)
