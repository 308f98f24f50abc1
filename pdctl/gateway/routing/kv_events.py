"""The workers' KV cache events, received (``routing.prefix_view = "exact"``): the subscriber that feeds each worker's
exact view (:class:`pdctl.gateway.routing.exact_view.ExactIndex`), and the relay to a multi-process gateway's
children.

The plan starts every worker with ``--kv-events-config`` whose ``endpoint`` is ``tcp://<gateway host>:<
routing.kv_events_port>`` and whose ``topic`` is the worker's name (:func:`pdctl.vllm.args.kv_events_config`).
vLLM's PUB socket *connects* to such an address (:mod:`pdctl.vllm.kv_events`), so the gateway *binds* one SUB
socket there and every worker dials in, as llm-d's KV cache manager does; the topic tells the workers apart.

- :class:`EventsRelay`: with several gateway processes (``gateway.workers``) only one can bind the port, so the
  parent binds it and relays every message, unchanged, to its children over an ipc socket (ZMQ's XSUB/XPUB
  proxy); each child's subscriber connects there and keeps its own view, as with one process.
- :class:`KvEventSubscriber`: the SUB socket and its loop. Per topic a
  :class:`~pdctl.vllm.kv_events.SequenceTracker`: a gap (messages lost) or a restart (the seq went back; a
  restarted engine starts at 0) empties that worker's view before the message is applied, so the view never
  claims a block the engine may have dropped. ``AllBlocksCleared`` empties it too.

Who may speak (docs/reliability.md, Hostile clients and hostile networks): vLLM 0.32's publisher has no CURVE
(docs/multi-node.md), so by default the port is unauthenticated and binds ``routing.kv_events_host`` (loopback
unless configured; a NetworkPolicy guards it on Kubernetes). With ``routing.kv_events_curve`` the socket that binds
it is a CURVE server (``curve``, :mod:`pdctl.vllm.kv_curve`) that admits only the deployment's relays
(:mod:`pdctl.vllm.kv_relay`). Either way the subscriber accepts only the topics its ``allowed`` callable names (the
gateway's: its own and discovered instances'); an unknown topic gets no view, no tracker and no metric label of its
own. Every frame is at most :data:`~pdctl.vllm.kv_events.MAX_MESSAGE_BYTES` (libzmq drops the connection of a
larger one) and at most :data:`~pdctl.vllm.kv_events.RCV_HWM` messages wait per publisher. A message is applied
alone: one that cannot be read or applied is counted (``malformed``), logged once and dropped, and its worker's
view starts over. Should the loop itself fail, it is logged and counted (``subscriber_error``), every view reads as
absent (the approximate view serves) and the socket is opened again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from pdctl.config.settings import DEFAULT_KV_EVENTS_MAX_BLOCKS
from pdctl.errors import LaunchError
from pdctl.gateway.routing.exact_view import ExactIndex
from pdctl.vllm.kv_curve import ServerKeys, secure_server, start_authenticator
from pdctl.vllm.kv_events import (
    MAX_MESSAGE_BYTES,
    RCV_HWM,
    SeqStatus,
    SequenceTracker,
    decode_batch_skipping_unknown,
    split_message,
)

__all__ = ["EventsRelay", "KvEventSubscriber"]

log = logging.getLogger("pdctl.gateway")

VIEW_BLOCKS_PER_ENGINE_BLOCK = 2
"""A view's bound, per block its engine's KV cache holds (``allowed``'s worker reported it): an engine never holds
more than its blocks, so more in its view means removals were missed; twice leaves room for a removal that trails
the store that evicted it."""
RESTART_S = 1.0
"""How long the subscriber waits before opening its socket again after a failure."""


class KvEventSubscriber:
    """The gateway's SUB socket for its workers' KV cache events, and the :class:`ExactIndex` of each topic."""

    def __init__(
        self, endpoint: str, count: Callable[[str, str], None] | None = None, connect: bool = False,
        allowed: Callable[[str], bool] | None = None, max_blocks: int = DEFAULT_KV_EVENTS_MAX_BLOCKS,
        capacity: Callable[[str], int | None] | None = None,
        curve: ServerKeys | None = None,
    ) -> None:  # fmt: skip
        """``endpoint``: the address to bind (``tcp://127.0.0.1:5557``), or with ``connect`` the relay's to connect
        to (:class:`EventsRelay`); ``count(topic, what)``: called per event applied (its type name), per resync
        (``gap``, ``restart``, ``overflow``), per message dropped (``malformed``; ``unknown_topic``, counted under
        topic ``-``) and per failure of the loop (``subscriber_error``, under ``-``); ``allowed(topic)``: whether
        a topic is one of the deployment's workers (None: every topic, for a socket only trusted peers reach);
        ``max_blocks``: each view's bound (:class:`ExactIndex`), lowered to :data:`VIEW_BLOCKS_PER_ENGINE_BLOCK` x
        ``capacity(topic)``, the blocks that worker's engine holds (None: not known); ``curve``: the bound socket is
        a CURVE server with these keys, admitting their clients only."""
        self.endpoint = endpoint
        self.curve = None if connect else curve
        self.connect = connect
        self.views: dict[str, ExactIndex] = {}
        self.bound = False
        self.failed = False
        """The loop failed and is not listening again yet: every view reads as absent."""
        self._seq: dict[str, SequenceTracker] = {}
        self._count = count or (lambda topic, what: None)
        self._allowed = allowed
        self._max_blocks = max_blocks
        self._capacity = capacity
        self._logged: set[str] = set()

    def view(self, topic: str) -> ExactIndex | None:
        """The view of the worker publishing on ``topic`` (None: no event from it yet, or the loop is down)."""
        return None if self.failed else self.views.get(topic)

    def _drop(self, topic: str, what: str, why: object) -> None:
        self._count(topic, what)
        if what not in self._logged:  # once per kind: a flood must not flood the log too
            self._logged.add(what)
            log.warning("KV events: a message dropped (%s: %s); later ones are only counted", what, why)

    def _view_for(self, topic: str) -> ExactIndex:
        view = self.views.get(topic)
        if view is None:
            if self._allowed is not None:  # workers that left (discovery) give their room back
                for gone in [t for t in self.views if not self._allowed(t)]:
                    del self.views[gone]
                    self._seq.pop(gone, None)
            view = self.views[topic] = ExactIndex(self._max_blocks)
        return view

    def feed(self, frames: Sequence[bytes]) -> None:
        """Apply one multipart message (topic, seq, payload); any message, however hostile, is applied whole,
        dropped or makes its own worker's view start over, and raises nothing."""
        try:
            topic, seq, payload = split_message(frames)
        except ValueError as exc:
            self._drop("-", "malformed", exc)
            return
        if self._allowed is not None and not self._allowed(topic):
            self._drop("-", "unknown_topic", f"topic {topic[:64]!r} is none of this deployment's workers")
            return
        try:
            batch, _ = decode_batch_skipping_unknown(payload)
            check = self._seq.setdefault(topic, SequenceTracker()).observe(seq)
        except (ValueError, msgspec.DecodeError) as exc:  # not observed: the next seq shows the loss as a gap
            self._drop(topic, "malformed", exc)
            return
        view = self._view_for(topic)
        if self._capacity is not None:
            held = self._capacity(topic)
            view.max_blocks = min(self._max_blocks, VIEW_BLOCKS_PER_ENGINE_BLOCK * held) if held else self._max_blocks
        if check.status in (SeqStatus.GAP, SeqStatus.RESTART):
            self._count(topic, check.status.value)
            log.info("KV events from %s: %s at seq %d (expected %s); its view starts over", topic,
                     check.status.value, seq, check.expected)  # fmt: skip
            view.clear()
        overflows = view.overflows
        try:
            for ev in batch.events:
                view.apply(ev)
                self._count(topic, type(ev).__name__)
        except Exception as exc:  # hostile contents the decoder let through
            view.clear()
            self._seq[topic].reset()
            self._drop(topic, "malformed", repr(exc)[:200])
            return
        if view.overflows != overflows:
            self._count(topic, "overflow")

    async def run(self) -> None:
        """Listen until cancelled, opening the socket again after a failure (logged, counted, views absent
        meanwhile). A port that cannot be bound is logged and leaves every worker to the approximate view."""
        while True:
            try:
                await self._listen()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop must outlive whatever failed
                self.failed = True
                self._count("-", "subscriber_error")
                log.error("KV events: the subscriber failed (%r); the approximate view serves until it listens "
                          "again in %.0f s", exc, RESTART_S, exc_info=True)  # fmt: skip
                for t in self._seq.values():
                    t.reset()
                for v in self.views.values():
                    v.clear()
                await asyncio.sleep(RESTART_S)

    async def _listen(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        auth = start_authenticator(ctx, self.curve) if self.curve is not None else None
        sock = ctx.socket(zmq.SUB)
        try:
            if self.curve is not None:
                secure_server(sock, self.curve)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.RCVHWM, RCV_HWM)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            try:
                if self.connect:
                    sock.connect(self.endpoint)
                else:
                    sock.bind(self.endpoint)
            except zmq.ZMQError as exc:
                log.error("KV events: cannot bind %s (%s); adaptive PD uses the approximate view", self.endpoint, exc)
                return
            self.bound = True
            self.failed = False
            log.info("KV events: listening on %s%s", self.endpoint, " (CURVE)" if self.curve is not None else "")
            while True:
                self.feed(await sock.recv_multipart())
        finally:
            self.bound = False
            sock.close(linger=0)
            if auth is not None:
                auth.stop()
            ctx.term()


class EventsRelay:
    """The parent gateway process's relay: binds the workers' events address, republishes on an ipc socket."""

    def __init__(self, bind: str, ipc_path: Path, curve: ServerKeys | None = None) -> None:
        self.bind = bind
        self.curve = curve
        """The keys that make the bound socket a CURVE server (``routing.kv_events_curve``); None: plain."""
        self._auth: Any = None
        self.endpoint = f"ipc://{ipc_path}"
        """Where the children connect (:class:`KvEventSubscriber` with ``connect``)."""
        self._thread: threading.Thread | None = None
        self._ctx: Any = None

    def start(self) -> None:
        """Bind both sockets (a :class:`~pdctl.errors.LaunchError` if the events port is taken) and relay on a
        thread until :meth:`close`."""
        import zmq

        ctx = self._ctx = zmq.Context()
        self._auth = start_authenticator(ctx, self.curve) if self.curve is not None else None
        front, back = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
        if self.curve is not None:
            secure_server(front, self.curve)
        front.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        front.setsockopt(zmq.RCVHWM, RCV_HWM)
        try:
            front.bind(self.bind)
            back.bind(self.endpoint)
        except zmq.ZMQError as exc:
            front.close(linger=0)
            back.close(linger=0)
            self._stop_auth()
            ctx.term()
            raise LaunchError(f"the gateway cannot bind {self.bind} for the workers' KV cache events: {exc}",
                              hint="another program holds routing.kv_events_port: stop it or change the port",
                              ) from None  # fmt: skip

        def relay() -> None:
            try:
                zmq.proxy(front, back)
            except zmq.ContextTerminated:
                pass
            finally:
                front.close(linger=0)
                back.close(linger=0)

        self._thread = threading.Thread(target=relay, name="kv-events-relay", daemon=True)
        self._thread.start()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def close(self) -> None:
        """Stop relaying and close both sockets."""
        self._stop_auth()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
