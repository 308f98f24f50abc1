"""The typed interface the gateway talks to its workers through; :class:`pdctl.vllm.transport.Client` implements it.

* :class:`WorkerClient` — one worker's base URL: ``request()`` returns once the status line is in; its keyword
  options (body, headers, the call's total timeout) are :class:`RequestOptions`.
* :class:`WorkerResponse` — the body on demand, whole (``read``, ``json``) or piece by piece (``chunk``, ``b""``
  at its end); ``close()`` before the end drops the connection, which makes vLLM abort the request.
* :data:`ClientFactory` — how :class:`pdctl.gateway.routing.pool.Pool` gets a client per instance:
  :func:`http_clients` in production, :class:`pdctl.gateway.memory.MemoryWorkers` in tests (no processes).

Failures below HTTP raise :class:`pdctl.vllm.transport.TransportError`, whose ``kind`` the PD legs read to decide
between retry, breaker and health.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from pdctl.gateway.settings import GatewaySettings, InstanceSpec
from pdctl.vllm.transport import Client

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11's; only mypy reads it here, pdctl runs on 3.10 too

__all__ = ["ClientFactory", "RequestOptions", "WorkerClient", "WorkerResponse", "http_clients"]


class RequestOptions(TypedDict, total=False):
    """A worker call's keyword options, each None by default; :meth:`pdctl.vllm.transport.Client.request` takes
    them as plain keyword arguments (no dict per call on the gateway's path), mypy holds it to this list."""

    body: bytes | None
    headers: Mapping[str, str] | None
    total_timeout_s: float | None


class WorkerResponse(Protocol):
    """A worker's answer: status at once, the body on demand."""

    @property
    def status(self) -> int: ...

    async def read(self) -> bytes: ...

    async def json(self) -> Any: ...

    async def chunk(self) -> bytes: ...

    def stall_timeout(self, read_s: float) -> None:
        """From the body's first piece on, bound each wait for the next piece by ``read_s`` when shorter than the
        call's read timeout (:meth:`pdctl.vllm.transport.Response.stall_timeout`)."""

    def close(self) -> None: ...


class WorkerClient(Protocol):
    """Calls to one worker."""

    async def request(self, method: str, path: str, **options: Unpack[RequestOptions]) -> WorkerResponse: ...

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
