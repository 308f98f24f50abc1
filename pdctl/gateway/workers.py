"""The typed interface the gateway talks to its workers through; :class:`pdctl.vllm.transport.Client` implements it.

* :class:`WorkerClient` — one worker's base URL: ``request()`` returns once the status line is in.
* :class:`WorkerResponse` — the body on demand, whole (``read``, ``json``) or piece by piece (``chunk``, ``b""``
  at its end); ``close()`` before the end drops the connection, which makes vLLM abort the request.
* :data:`ClientFactory` — how :class:`pdctl.gateway.routing.Pool` gets a client per instance:
  :func:`http_clients` in production, :class:`pdctl.gateway.memory.MemoryWorkers` in tests (no processes).

Failures below HTTP raise :class:`pdctl.vllm.transport.TransportError`, whose ``kind`` the PD legs read to decide
between retry, breaker and health.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pdctl.gateway.settings import GatewaySettings, InstanceSpec
from pdctl.vllm.transport import Client

__all__ = ["ClientFactory", "WorkerClient", "WorkerResponse", "http_clients"]


class WorkerResponse(Protocol):
    """A worker's answer: status at once, the body on demand."""

    @property
    def status(self) -> int: ...

    async def read(self) -> bytes: ...

    async def json(self) -> Any: ...

    async def chunk(self) -> bytes: ...

    def close(self) -> None: ...


class WorkerClient(Protocol):
    """Calls to one worker."""

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        total_timeout_s: float | None = None,
    ) -> WorkerResponse: ...

    async def aclose(self) -> None: ...


ClientFactory = Callable[[InstanceSpec], WorkerClient]


def http_clients(settings: GatewaySettings) -> ClientFactory:
    """Pooled keep-alive clients (:class:`pdctl.vllm.transport.Client`) with the gateway's timeouts."""
    g = settings.gateway

    def connect(spec: InstanceSpec) -> WorkerClient:
        return Client(
            spec.url,
            read_timeout_s=g.request_timeout_s,
            connect_timeout_s=min(settings.connect_timeout_s, g.request_timeout_s),
            # Idle connections go after 4 s, before vLLM's (uvicorn's) 5 s keep-alive ends them.
            keepalive_s=4.0,
            headers={"accept-encoding": "identity"},
        )

    return connect
