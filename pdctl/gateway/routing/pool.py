"""The instance pool: membership, health probing in and out, a per-instance circuit breaker; no choosing (which
instance takes a request is :class:`pdctl.gateway.routing.router.Router`'s).

An instance is *available* when it is ``serving``, its last ``/health`` probe succeeded and its breaker is closed.
Static endpoints are ``serving`` from the start; :mod:`pdctl.gateway.discovery` adds instances as ``warming``,
makes them ``serving`` after their warm-up and ``draining`` when their address goes (:meth:`Pool.add`,
:meth:`Pool.serve`, :meth:`Pool.retire`, :meth:`Pool.remove`). The
breaker opens after ``breaker_threshold`` consecutive failed calls, for ``cooldown x times_opened``
seconds; after that a successful probe closes it half-way (one more failure reopens it).

A probe that *timed out* does not take out an instance that answered a call since the previous probe round:
it is alive and busy (a loaded worker, or this gateway's own event loop late under a thousand streams, answer
``/health`` slowly while streams flow), and ejecting the only decode would turn load into 503s. A refused
connection, or a timeout with no success since the last round, takes it out as before.

Once per life (:attr:`Instance.epoch`) a healthy instance is asked what it serves (``/v1/models``) and how many KV
blocks its cache holds (``vllm:cache_config_info`` on ``/metrics``): the bound of its exact view.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any, Literal

from pdctl.gateway.metrics import GatewayMetrics
from pdctl.gateway.settings import GatewaySettings, InstanceSpec
from pdctl.gateway.workers import ClientFactory, WorkerClient, http_clients
from pdctl.vllm.promtext import CACHE_CONFIG_INFO, kv_cache_blocks, samples
from pdctl.vllm.transport import TransportError

__all__ = ["Instance", "Pool"]

Role = Literal["prefill", "decode"]
State = Literal["warming", "serving", "draining"]
STATES: tuple[State, ...] = ("warming", "serving", "draining")


class Instance:
    """One worker: its pooled HTTP client, load and health."""

    def __init__(
        self, spec: InstanceSpec, client: WorkerClient, metrics: GatewayMetrics, state: State = "serving"
    ) -> None:
        self.spec = spec
        self.state: State = state
        self.name = spec.name
        self.role: Role = spec.role
        self.url = spec.url
        self.client = client
        self.in_flight = 0
        self.in_flight_tokens = 0
        self.healthy: bool | None = None  # None: not probed yet
        self.epoch = 0
        """How many times the instance came back after being known down (a restarted engine starts cold)."""
        self.failures = 0
        self.times_opened = 0
        self.open_until = 0.0
        self.last_success = -1e9
        """``time.monotonic()`` of the last successful call."""
        self.models: list[dict[str, Any]] = []
        self.kv_blocks: int | None = None
        """The blocks the engine's KV cache holds (None: not reported), read once per :attr:`epoch`."""
        self.kv_blocks_epoch = -1
        """The epoch :attr:`kv_blocks` was read in."""
        self._gauge = metrics.in_flight.labels(spec.name, spec.role)
        self._health_gauge = metrics.healthy.labels(spec.name, spec.role)

    @property
    def breaker_open(self) -> bool:
        """True while failing fast."""
        return self.open_until > 0.0

    def available(self) -> bool:
        """In the pool: serving, not known unhealthy and breaker closed."""
        return self.state == "serving" and self.healthy is not False and not self.breaker_open

    @contextlib.contextmanager
    def track(self, tokens: int) -> Iterator[None]:
        """Count one call in flight (for least-loaded choice and the per-instance gauge)."""
        self.in_flight += 1
        self.in_flight_tokens += tokens
        self._gauge.inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.in_flight_tokens -= tokens
            self._gauge.dec()

    def set_healthy(self, ok: bool) -> None:
        """Record a probe result."""
        if ok and self.healthy is False:
            self.epoch += 1
        self.healthy = ok
        self.show_health()

    def show_health(self) -> None:
        """The ``pdctl_instance_healthy`` gauge: 1 while the instance is in the pool."""
        self._health_gauge.set(1 if self.healthy and self.state == "serving" and not self.breaker_open else 0)


class Pool:
    """All instances and the background health probe.

    ``connect`` makes each instance's client (default: :func:`pdctl.gateway.workers.http_clients`).
    """

    def __init__(
        self, settings: GatewaySettings, metrics: GatewayMetrics, connect: ClientFactory | None = None
    ) -> None:
        self.settings = settings
        self._connect = connect or http_clients(settings)
        self._metrics = metrics
        self.instances = [Instance(spec, self._connect(spec), metrics) for spec in settings.instances]
        self._count_states()
        self._task: asyncio.Task[None] | None = None

    def add(self, spec: InstanceSpec, state: State) -> Instance:
        """A new instance (a discovered address), with a client of its own."""
        inst = Instance(spec, self._connect(spec), self._metrics, state)
        self.instances.append(inst)
        self._count_states()
        return inst

    def serve(self, inst: Instance) -> None:
        """The instance passed its warm-up: it gets traffic from now on."""
        inst.state = "serving"
        inst.show_health()
        self._count_states()

    def retire(self, inst: Instance) -> None:
        """No new requests for ``inst``; those in flight finish (then :meth:`remove`)."""
        inst.state = "draining"
        inst.show_health()
        self._count_states()

    async def remove(self, inst: Instance) -> None:
        """Out of the pool: its client closed, its metric series gone."""
        self.instances.remove(inst)
        for gauge in (self._metrics.in_flight, self._metrics.healthy):
            with contextlib.suppress(KeyError):
                gauge.remove(inst.name, inst.role)
        self._count_states()
        with contextlib.suppress(Exception):
            await inst.client.aclose()

    def _count_states(self) -> None:
        for role in ("prefill", "decode"):
            for state in STATES:
                n = sum(1 for i in self.instances if i.role == role and i.state == state)
                self._metrics.instances.labels(role, state).set(n)

    def by_role(self, role: Role) -> list[Instance]:
        """Instances of one role."""
        return [i for i in self.instances if i.role == role]

    def retry_after_s(self, roles: tuple[Role, ...]) -> float:
        """How long until an instance of ``roles`` may be back (breaker cooldown or probe interval)."""
        now = time.monotonic()
        waits = [i.open_until - now for i in self.instances if i.role in roles and i.breaker_open]
        return max(1.0, min(waits) if waits else self.settings.health_interval_s)

    def record_success(self, inst: Instance) -> None:
        """A call succeeded: reset the failure count and close the breaker."""
        inst.failures = 0
        inst.last_success = time.monotonic()
        # Also after a half-open close by the probe: else every later incident ejects it for longer.
        inst.times_opened = 0
        if inst.breaker_open:
            inst.open_until = 0.0
        inst.set_healthy(True)

    def record_failure(self, inst: Instance) -> None:
        """A call failed (connection error, timeout, 5xx): maybe open the breaker."""
        inst.failures += 1
        if inst.failures >= self.settings.breaker_threshold and not inst.breaker_open:
            inst.times_opened += 1
            inst.open_until = time.monotonic() + self.settings.breaker_cooldown_s * inst.times_opened
            inst.set_healthy(bool(inst.healthy))

    def ready(self) -> bool:
        """At least one available prefill and one available decode (colocated: any one instance)."""
        if self.settings.routing.strategy == "colocated":
            return any(i.healthy and i.available() for i in self.instances)
        return any(i.healthy and i.available() for i in self.by_role("prefill")) and any(
            i.healthy and i.available() for i in self.by_role("decode")
        )

    async def probe(self, inst: Instance) -> None:
        """One ``/health`` probe; a half-open breaker whose cooldown passed closes on success."""
        timeout_s = min(5.0, self.settings.health_interval_s + 1)
        started = time.monotonic()
        try:
            resp = await inst.client.request("GET", "/health", total_timeout_s=timeout_s)
            try:
                await resp.read()
            finally:
                resp.close()
            ok = resp.status == 200
        except TransportError as exc:
            busy = started - inst.last_success < self.settings.health_interval_s + timeout_s
            if exc.kind in ("timeout", "connect_timeout") and busy:
                return  # alive and busy (module docstring): keep what the last probe said
            ok = False
        if ok and inst.breaker_open and time.monotonic() >= inst.open_until:
            inst.open_until = 0.0
            inst.failures = self.settings.breaker_threshold - 1
        inst.set_healthy(ok)
        if ok and not inst.models:
            with contextlib.suppress(TransportError, ValueError, AttributeError):
                resp = await inst.client.request("GET", "/v1/models", total_timeout_s=5.0)
                try:
                    payload = await resp.json()
                finally:
                    resp.close()
                data = payload.get("data") if resp.status == 200 else None
                if isinstance(data, list):
                    inst.models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if ok and inst.kv_blocks_epoch != inst.epoch:
            inst.kv_blocks_epoch = inst.epoch
            with contextlib.suppress(TransportError, UnicodeDecodeError):
                resp = await inst.client.request("GET", "/metrics", total_timeout_s=5.0)
                try:
                    text = (await resp.read()).decode() if resp.status == 200 else ""
                finally:
                    resp.close()
                inst.kv_blocks = kv_cache_blocks(samples(text, (CACHE_CONFIG_INFO,)))

    async def probe_all(self) -> None:
        """Probe every instance once, concurrently."""
        await asyncio.gather(*(self.probe(i) for i in self.instances))

    async def _loop(self, first_done: bool) -> None:
        if not first_done:
            await self.probe_all()
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await self.probe_all()

    async def start(self) -> None:
        """Start the health loop; its first round of probes runs at once.

        The gateway waits for that round only when it must learn the model names from the workers'
        ``/v1/models`` (settings.json alone). With a config.toml the names are known, so it listens at once,
        routing to instances not yet probed as available; ``/ready`` turns true with their first successful
        probe. Under ``pdctl up`` the warm-up has just proved the workers, and a loaded vLLM can take a few
        hundred ms to answer the probes.
        """
        wait = not self.settings.models
        if wait:
            await self.probe_all()
        self._task = asyncio.create_task(self._loop(first_done=wait), name="pdctl-health")

    async def close(self) -> None:
        """Stop probing and close the clients."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(i.client.aclose() for i in self.instances), return_exceptions=True)
