"""The KV events relay next to each worker (``routing.kv_events_curve``, ``pdctl kv-relay``): plain ZMQ in on
loopback, CURVE out to the gateway.

vLLM 0.32's ``ZmqEventPublisher`` cannot set CURVE keys, so with ``kv_events_curve`` the plan points each worker's
``--kv-events-config`` endpoint at its own relay, ``tcp://127.0.0.1:<port>`` on the worker's host, and starts the
relay as a process of the deployment. The relay binds a SUB socket there (the engine's PUB dials in, as it dials
the gateway without CURVE), subscribes to everything, and sends each multipart message unchanged (topic, seq,
payload) from a PUB socket that connects to the gateway as a CURVE client (:mod:`pdctl.vllm.kv_curve`).
The gateway sees the same messages as from a worker that dials it directly; a message lost on the way (a full
queue, a reconnect) shows there as a seq gap and that worker's view starts over.

Bounded as the gateway's socket is: each frame at most :data:`~pdctl.vllm.kv_events.MAX_MESSAGE_BYTES`,
:data:`~pdctl.vllm.kv_events.RCV_HWM` messages waiting on either side. The keys come from the
environment only and are never logged.
"""

from __future__ import annotations

import logging
import threading

from pdctl.errors import LaunchError
from pdctl.vllm.kv_curve import ClientKeys, secure_client
from pdctl.vllm.kv_events import MAX_MESSAGE_BYTES, RCV_HWM

__all__ = ["POLL_MS", "WorkerRelay"]

log = logging.getLogger("pdctl.kv_relay")

POLL_MS = 100
"""How often the loop looks at its stop flag while no message arrives."""
LINGER_MS = 500
"""How long messages already queued for the gateway may still go out after a stop."""


class WorkerRelay:
    """One worker's relay: binds ``listen`` (``tcp://127.0.0.1:5600``), forwards to ``to`` over CURVE."""

    def __init__(self, listen: str, to: str, keys: ClientKeys) -> None:
        self.listen = listen
        self.to = to
        self._keys = keys
        self.forwarded = 0
        """Messages sent on to the gateway so far."""
        self.bound = threading.Event()
        """Set once the listening socket is bound (the engine can dial in)."""

    def run(self, stop: threading.Event) -> None:
        """Forward until ``stop`` is set. A :class:`~pdctl.errors.LaunchError` when ``listen`` cannot be bound."""
        import zmq

        ctx = zmq.Context()
        front, back = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        try:
            front.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            front.setsockopt(zmq.RCVHWM, RCV_HWM)
            front.setsockopt(zmq.SUBSCRIBE, b"")
            back.setsockopt(zmq.SNDHWM, RCV_HWM)
            secure_client(back, self._keys)
            try:
                front.bind(self.listen)
            except zmq.ZMQError as exc:
                raise LaunchError(f"kv-relay cannot bind {self.listen} for its worker's KV cache events: {exc}",
                                  hint="another program holds the port: stop it or change routing.kv_events_port "
                                  "(relays listen on the ports after it)") from None  # fmt: skip
            back.connect(self.to)
            self.bound.set()
            log.info("kv-relay: forwarding the KV cache events published to %s to %s over CURVE", self.listen, self.to)
            while not stop.is_set():
                if not front.poll(POLL_MS):
                    continue
                frames = front.recv_multipart()
                try:
                    back.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:  # the gateway is slow or away: a gap it will see by the seq
                    continue
                self.forwarded += 1
        finally:
            front.close(linger=0)
            back.close(linger=LINGER_MS)
            ctx.term()
