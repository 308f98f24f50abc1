"""In-memory workers behind :class:`pdctl.gateway.workers.WorkerClient`: the PD legs without processes or sockets.

For tests (``create_app(settings, key, clients=workers)``)::

    workers = MemoryWorkers()
    workers["prefill-0"].script(MemoryReply.json({"kv_transfer_params": params}))
    workers["decode"].script(MemoryReply.sse([b'data: {...}\\n\\n', 0.05, TransportError("broken", "cut")]))
    app = create_app(settings, key, clients=workers)

A :class:`MemoryWorker` answers ``GET /health`` (200 while ``healthy``, a ``connect`` failure otherwise, a
``timeout`` with ``health_times_out``), ``GET /v1/models`` and ``GET /metrics`` (:attr:`MemoryWorker.metrics`);
every other call takes the next scripted reply, or :attr:`MemoryWorker.default` once the script is used up. A reply
is a :class:`MemoryReply` or a :class:`~pdctl.vllm.transport.TransportError` to raise instead of answering. A
reply's body parts are bytes (sent), floats (a pause in seconds) or a ``TransportError`` (raised at that point, as a
connection that breaks mid-body). Every call is recorded (:attr:`MemoryWorker.calls`), with whether its response was
closed before its end (the client left: vLLM would abort the request). As :class:`pdctl.vllm.transport.Client`, a
call's ``total_timeout_s`` bounds a reply's ``delay_s`` (a ``timeout`` failure when it is not shorter).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdctl.gateway.settings import InstanceSpec
from pdctl.gateway.workers import RequestOptions, WorkerClient, WorkerResponse
from pdctl.vllm.transport import TransportError

if TYPE_CHECKING:
    from typing import Unpack

__all__ = ["PROBES", "MemoryCall", "MemoryReply", "MemoryResponse", "MemoryWorker", "MemoryWorkers", "Part"]

PROBES = ("/health", "/v1/models", "/metrics")
"""The calls a worker answers itself, never from its script."""

Part = bytes | float | TransportError
"""One piece of a scripted body: bytes to send, a pause in seconds, or a failure to raise."""


@dataclass(frozen=True, slots=True)
class MemoryReply:
    """A scripted answer: status, body parts, and a pause before the status line (``delay_s``)."""

    status: int = 200
    parts: tuple[Part, ...] = ()
    delay_s: float = 0.0

    @classmethod
    def json(cls, payload: Any, status: int = 200, delay_s: float = 0.0) -> MemoryReply:
        """One JSON body."""
        return cls(status, (json.dumps(payload).encode(),), delay_s)

    @classmethod
    def sse(cls, parts: Iterable[Part], delay_s: float = 0.0) -> MemoryReply:
        """A 200 event stream, piece by piece."""
        return cls(200, tuple(parts), delay_s)


@dataclass(slots=True)
class MemoryCall:
    """One request a worker received."""

    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    total_timeout_s: float | None
    response: MemoryResponse | None = None

    def json(self) -> Any:
        """The request body as JSON."""
        return json.loads(self.body or b"null")

    @property
    def request_id(self) -> str | None:
        """The ``x-request-id`` the gateway sent."""
        return self.headers.get("x-request-id")


class MemoryResponse:
    """A :class:`~pdctl.gateway.workers.WorkerResponse` that plays a :class:`MemoryReply`'s parts."""

    def __init__(self, reply: MemoryReply) -> None:
        self.status = reply.status
        self._parts = deque(reply.parts)
        self.ended = False
        self.closed_early: bool | None = None
        """None while open; True when closed before its end (the client of this call left)."""
        self.stall_s: float | None = None
        """:meth:`stall_timeout`'s bound, once a piece was returned (a longer pause then fails as a ``timeout``)."""
        self._stall: float | None = None
        self._started = False

    def stall_timeout(self, read_s: float) -> None:
        self._stall = read_s
        if self._started:
            self.stall_s = read_s

    async def chunk(self) -> bytes:
        while self._parts:
            part = self._parts.popleft()
            if isinstance(part, TransportError):
                raise part
            if isinstance(part, float):
                if self.stall_s is not None and part >= self.stall_s:
                    await asyncio.sleep(self.stall_s)
                    raise TransportError("timeout", f"no data for {self.stall_s:.3g} s (stall timeout)")
                await asyncio.sleep(part)
                continue
            if part:
                self._started = True
                self.stall_s = self._stall
                return part
        self.ended = True
        return b""

    async def read(self) -> bytes:
        pieces = []
        while piece := await self.chunk():
            pieces.append(piece)
        return b"".join(pieces)

    async def json(self) -> Any:
        return json.loads(await self.read())

    def close(self) -> None:
        if self.closed_early is None:
            self.closed_early = not self.ended


@dataclass(slots=True)
class MemoryWorker:
    """One in-memory worker: a script of replies, a default, and the calls it received."""

    name: str
    models: tuple[Mapping[str, Any], ...] = ({"id": "tiny", "object": "model", "max_model_len": 2048},)
    default: MemoryReply | TransportError = field(default_factory=lambda: MemoryReply(500, (b"no reply scripted",)))
    healthy: bool = True
    metrics: str = ""
    """The ``/metrics`` body (Prometheus text)."""
    health_times_out: bool = False
    """``/health`` fails as a timeout (a worker too busy to answer it in time), whatever ``healthy`` says."""
    calls: list[MemoryCall] = field(default_factory=list)
    _script: deque[MemoryReply | TransportError] = field(default_factory=deque)

    def script(self, *replies: MemoryReply | TransportError) -> MemoryWorker:
        """Queue replies for the next calls (other than :data:`PROBES`), in order."""
        self._script.extend(replies)
        return self

    def completions(self) -> list[MemoryCall]:
        """The calls other than probes."""
        return [c for c in self.calls if c.path not in PROBES]

    def _reply(self, path: str) -> MemoryReply | TransportError:
        if path == "/health" and self.health_times_out:
            return TransportError("timeout", f"{self.name} did not answer /health in time")
        if path == "/health":
            return MemoryReply(200) if self.healthy else TransportError("connect", f"{self.name} is down")
        if path == "/v1/models":
            return MemoryReply.json({"object": "list", "data": list(self.models)})
        if path == "/metrics":
            return MemoryReply(200, (self.metrics.encode(),))
        return self._script.popleft() if self._script else self.default


class _Client:
    """The :class:`~pdctl.gateway.workers.WorkerClient` of one :class:`MemoryWorker`."""

    def __init__(self, worker: MemoryWorker) -> None:
        self.worker = worker

    async def request(self, method: str, path: str, **options: Unpack[RequestOptions]) -> WorkerResponse:
        total_timeout_s = options.get("total_timeout_s")
        call = MemoryCall(method, path, options.get("body"), dict(options.get("headers") or {}), total_timeout_s)
        self.worker.calls.append(call)
        reply = self.worker._reply(path)
        if isinstance(reply, TransportError):
            raise reply
        if total_timeout_s is not None and reply.delay_s >= total_timeout_s:
            await asyncio.sleep(total_timeout_s)  # as the real client: the call's total bound ends the wait
            raise TransportError("timeout", f"{self.worker.name} did not answer within {total_timeout_s:.2f}s")
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        call.response = MemoryResponse(reply)
        return call.response

    async def aclose(self) -> None:
        return None


class MemoryWorkers:
    """A :data:`~pdctl.gateway.workers.ClientFactory` of in-memory workers, one per instance name (made on use)."""

    def __init__(self) -> None:
        self._workers: dict[str, MemoryWorker] = {}

    def __getitem__(self, name: str) -> MemoryWorker:
        if name not in self._workers:
            self._workers[name] = MemoryWorker(name)
        return self._workers[name]

    def __call__(self, spec: InstanceSpec) -> WorkerClient:
        return _Client(self[spec.name])
