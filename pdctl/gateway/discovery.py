"""Endpoints that name a DNS name (a headless Service): re-resolved, new addresses warmed up, vanished ones drained.

One endpoint URL whose host is a name becomes one instance per address it resolves to, named
``<endpoint name>@<address>``. Every ``health_interval_s`` the names are resolved again (dnspython, A records)::

    new address ──> Instance "warming" ──/health ok + one P→D two-leg call through it──> "serving" (gets traffic)
    gone address ─> Instance "draining" (no new requests; in-flight ones finish) ──in_flight = 0──> removed

The warm-up pairs a new instance with a healthy one of the other role (a serving one first), because NIXL's
handshake is lazy: the first P→D request through a new pod performs it (:mod:`pdctl.runtime.probe` does the same for
``pdctl up``). With ``colocated`` routing a healthy probe is enough.

Not discovered, kept as one static instance: IP literals, ``localhost`` and ``*.invalid`` (RFC 6761 names that
never resolve), and a name whose first lookup finds no A record while the system resolver knows it (an
``/etc/hosts`` entry, left to the system resolver per connection as before), or gets no answer at all. A name
neither knows starts with no instance (a Service whose pods are not ready yet). Later, an answer without
addresses (NXDOMAIN, no A record) is an empty set and drains the name's instances; a lookup that times out
changes nothing.

``PDCTL_DNS_SERVER=HOST:PORT`` sends the lookups to that server instead of ``/etc/resolv.conf``'s: for tests
(``tests/fakes/dns_server.py``) and special setups.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import dns.asyncresolver
import dns.exception
import dns.resolver

from pdctl.gateway.routing.pool import Instance, Pool, Role
from pdctl.gateway.settings import InstanceSpec
from pdctl.vllm.protocol import build_decode_body, build_prefill_body, check_kv_params, connector_kind
from pdctl.vllm.transport import TransportError

__all__ = ["DNS_SERVER_ENV", "Discovery", "is_dns_name", "resolver_from_env"]

DNS_SERVER_ENV = "PDCTL_DNS_SERVER"
LOOKUP_TIMEOUT_S = 2.0
WARMUP_TIMEOUT_S = 60.0

log = logging.getLogger("pdctl.gateway")


def is_dns_name(host: str) -> bool:
    """True for a host that discovery resolves (not an IP literal, ``localhost`` or ``*.invalid``)."""
    h = host.lower().rstrip(".")
    if not h or h == "localhost" or h.endswith((".localhost", ".invalid")) or h == "invalid":
        return False
    try:
        ipaddress.ip_address(h)
    except ValueError:
        return True
    return False


def resolver_from_env(environ: dict[str, str] | None = None) -> dns.asyncresolver.Resolver:
    """The system resolver, or the one ``PDCTL_DNS_SERVER=HOST:PORT`` names."""
    value = (environ if environ is not None else dict(os.environ)).get(DNS_SERVER_ENV, "").strip()
    if not value:
        resolver = dns.asyncresolver.Resolver()
    else:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{DNS_SERVER_ENV}={value!r}: expected HOST:PORT, for example 127.0.0.1:5353")
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host.strip("[]")]
        resolver.port = int(port)
    resolver.lifetime = LOOKUP_TIMEOUT_S
    return resolver


@dataclass
class _Name:
    """One endpoint naming a DNS name, and the instances its addresses became."""

    spec: InstanceSpec
    host: str
    by_address: dict[str, Instance]


def _with_host(url: str, address: str) -> str:
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class Discovery:
    """Keeps ``pool``'s instances in step with what the endpoints' DNS names resolve to."""

    def __init__(self, pool: Pool, resolver: dns.asyncresolver.Resolver | None = None) -> None:
        self.pool = pool
        self._resolver = resolver
        self._names: list[_Name] = []
        self._task: asyncio.Task[None] | None = None
        self._warming: set[Instance] = set()

    @property
    def active(self) -> bool:
        """True when at least one endpoint is a discovered name."""
        return bool(self._names)

    async def start(self) -> None:
        """First lookup of every name (before the gateway listens), then the loop."""
        named = [i for i in self.pool.instances if is_dns_name(urlsplit(i.url).hostname or "")]
        if not named:
            return
        if self._resolver is None:
            self._resolver = resolver_from_env()
        answers = await asyncio.gather(*(self._lookup(urlsplit(i.url).hostname or "") for i in named))
        for inst, addresses in zip(named, answers, strict=True):
            if not addresses and (addresses is None or await _system_resolves(urlsplit(inst.url).hostname or "")):
                log.info("discovery: %s has no DNS records; kept as one static endpoint", inst.url)
                continue
            await self.pool.remove(inst)
            name = _Name(inst.spec, urlsplit(inst.url).hostname or "", {})
            self._names.append(name)
            self._apply(name, addresses)
        if self._names:
            await self.step_warmups()
            self._task = asyncio.create_task(self._loop(), name="pdctl-discovery")

    async def close(self) -> None:
        """Stop the loop (the pool closes the clients)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.pool.settings.health_interval_s)
            await self.refresh()

    async def refresh(self) -> None:
        """One round: resolve every name, apply the differences, warm up new instances, remove drained ones."""
        answers = await asyncio.gather(*(self._lookup(n.host) for n in self._names))
        for name, addresses in zip(self._names, answers, strict=True):
            if addresses is not None:
                self._apply(name, addresses)
        await self.step_warmups()
        await self.reap()

    async def _lookup(self, host: str) -> list[str] | None:
        """The name's A records (sorted); [] for "no such name or no address"; None when no answer came."""
        assert self._resolver is not None
        try:
            answer = await self._resolver.resolve(host, "A", search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.resolver.LifetimeTimeout):
            return None
        return sorted({r.to_text() for r in answer})

    def _apply(self, name: _Name, addresses: list[str]) -> None:
        wanted = set(addresses)
        for address, inst in list(name.by_address.items()):
            if address not in wanted:
                del name.by_address[address]
                self.pool.retire(inst)
                self._warming.discard(inst)
                log.info("discovery: %s is gone from %s; draining (%d in flight)", inst.name, name.host, inst.in_flight)
        for address in addresses:
            if address in name.by_address:
                continue
            spec = InstanceSpec(f"{name.spec.name}@{address}", name.spec.role, _with_host(name.spec.url, address))
            inst = self.pool.add(spec, state="warming")
            name.by_address[address] = inst
            self._warming.add(inst)
            log.info("discovery: %s appeared in %s; warming up", inst.name, name.host)

    async def step_warmups(self) -> None:
        """Probe each warming instance; warm up the healthy ones through a partner; serve those that passed."""
        warming = sorted((i for i in self._warming if i.state == "warming"), key=lambda i: i.name)
        unprobed = [i for i in self.pool.instances if i.healthy is None and i not in warming]
        await asyncio.gather(*(self.pool.probe(i) for i in warming + unprobed))
        for inst in warming:
            if not inst.healthy or inst.state != "warming":  # unhealthy, or warmed meanwhile as a partner
                continue
            if self.pool.settings.routing.strategy == "colocated":
                self._serve(inst)
                continue
            other: Role = "decode" if inst.role == "prefill" else "prefill"
            partners = [p for p in self.pool.by_role(other) if p.healthy and p.state in ("serving", "warming")]
            partners.sort(key=lambda p: p.state != "serving")
            for partner in partners[:2]:
                prefill, decode = (inst, partner) if inst.role == "prefill" else (partner, inst)
                error = await self._two_legs(prefill, decode)
                if error is None:
                    self._serve(inst)
                    if partner.state == "warming":
                        self._serve(partner)
                    break
                log.warning("discovery: warm-up %s->%s failed: %s", prefill.name, decode.name, error)

    def _serve(self, inst: Instance) -> None:
        self.pool.serve(inst)
        self._warming.discard(inst)
        log.info("discovery: %s passed its warm-up; serving", inst.name)

    async def reap(self) -> None:
        """Remove draining instances with nothing in flight."""
        for inst in [i for i in self.pool.instances if i.state == "draining" and i.in_flight == 0]:
            await self.pool.remove(inst)
            log.info("discovery: %s drained and removed", inst.name)

    def _model(self, *instances: Instance) -> str | None:
        if self.pool.settings.models:
            return self.pool.settings.models[0].name
        for inst in instances:
            if inst.models:
                return str(inst.models[0]["id"])
        return None

    async def _two_legs(self, prefill: Instance, decode: Instance) -> str | None:
        """One short two-leg request straight through ``prefill`` and ``decode``; None when it passed."""
        model = self._model(prefill, decode)
        if model is None:
            return "no model name known yet (no /v1/models answer)"
        rid = f"pdctl-warmup-{uuid.uuid4().hex[:12]}"
        body = {"model": model, "prompt": f"pdctl warm-up probe {rid}", "max_tokens": 2, "temperature": 0}
        headers = {"content-type": "application/json", "x-request-id": rid}
        kind = connector_kind(self.pool.settings.connector)
        try:
            status, reply = await _post(prefill, build_prefill_body(body, kind), headers)
            if status != 200 or not isinstance(reply, dict):
                return f"prefill {prefill.name} answered HTTP {status}"
            params = None
            if kind != "shared_storage":
                chk = check_kv_params(reply)
                if not chk.usable:
                    return f"prefill {prefill.name} returned no usable kv_transfer_params"
                params = chk.params
            status, _ = await _post(decode, build_decode_body(body, params), headers)
        except (TransportError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if status == 200 else f"decode {decode.name} answered HTTP {status}"


async def _system_resolves(host: str) -> bool:
    """Whether the system resolver (``/etc/hosts`` included, which DNS lookups skip) knows ``host``."""
    try:
        return bool(await asyncio.get_running_loop().getaddrinfo(host, None))
    except OSError:
        return False


async def _post(inst: Instance, payload: dict[str, object], headers: dict[str, str]) -> tuple[int, object]:
    body = json.dumps(payload, separators=(",", ":")).encode()
    resp = await inst.client.request(
        "POST", "/v1/completions", body=body, headers=headers, total_timeout_s=WARMUP_TIMEOUT_S
    )
    try:
        raw = await resp.read()
    finally:
        resp.close()
    return resp.status, json.loads(raw) if resp.status == 200 else None
