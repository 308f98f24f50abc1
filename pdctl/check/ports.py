"""Rules about ports: every port the plan binds, against each other and against this machine.

- :func:`ports` PD017: two uses of one port; PD018: a port something already listens on (:func:`port_in_use`).
- :func:`port_findings`: PD018 as ``up`` reports it, for a port taken after the check; :func:`port_taken_error`:
  a failed start explained by it (the :class:`~pdctl.runtime.daemon.Runner`'s ``explain``).

Each fix moves the port to a free one (:func:`_moved`), editing the key behind it: ``gateway.listen``, a
worker's endpoint URL in settings.json, or ``side_channel_port`` in config.toml.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pdctl.check.findings import SETTINGS, Action, Ctx, Finding
from pdctl.config import Deployment, WorkerConfig
from pdctl.errors import LaunchError
from pdctl.runtime.plan import VllmInstall, relay_name, relay_port
from pdctl.runtime.process import ProcessExitedError
from pdctl.vllm.protocol import connector_kind


@dataclass(frozen=True, slots=True)
class _PortUse:
    """One port pdctl's plan binds: who, where, and the key that sets it."""

    name: str
    host: str
    port: int
    file: Literal["config", "settings"]
    key: str
    worker: WorkerConfig | None = None
    process: str | None = None
    """The process that binds it when neither the worker's nor the gateway's (a KV events relay)."""


def _port_uses(dep: Deployment) -> list[_PortUse]:
    """Every port the plan binds: the gateway's (and its KV events socket's), each worker's HTTP port, its side
    channel and its KV events relay's (``routing.kv_events_curve``)."""
    g = dep.gateway
    uses = [_PortUse("gateway", g.listen_host, g.listen_port, "settings", "gateway.listen")]
    r = dep.routing
    if r.prefix_view == "exact" and r.strategy == "pd_disagg":
        key = "routing.kv_events_port"
        uses.append(_PortUse("gateway KV events", r.kv_events_host, r.kv_events_port, "settings", key))
    for w in dep.workers:
        ep = "prefill_endpoint" if w.role == "prefill" else "decode_endpoint"
        uses.append(_PortUse(w.name, w.host, w.port, "settings", f"routing.{ep}", w))
        if connector_kind(dep.connector_for(w)) == "params":
            uses.append(_PortUse(f"{w.name} side channel", w.host, w.side_channel_port, "config",
                                 f"{w.table}.side_channel_port", w))  # fmt: skip
        if r.kv_events_curve and r.prefix_view == "exact" and r.strategy == "pd_disagg":
            uses.append(_PortUse(f"{w.name} KV events relay", "127.0.0.1", relay_port(dep, w), "settings",
                                 "routing.kv_events_port", process=relay_name(w.name)))  # fmt: skip
    return uses


def _moved(dep: Deployment, use: _PortUse, taken: set[int]) -> Mapping[str, object]:
    """The edit that moves ``use`` to the next port (in steps of 100) that is not in ``taken`` (which gets it) and
    is free here."""
    candidates = [*range(use.port + 100, 65536, 100), *range(use.port % 100 + 1100, use.port, 100)]
    port = next((p for p in candidates if p not in taken and not port_in_use(use.host, p)), use.port)
    taken.add(port)  # the next finding's fix must not pick it too
    if use.key == "routing.kv_events_port":
        return {f"{SETTINGS}{use.key}": port}
    if use.worker is None:
        fix: dict[str, object] = {f"{SETTINGS}gateway.listen": f"{use.host}:{port}"}
        if "cluster.gateway_port" in dep.config_keys:
            fix["cluster.gateway_port"] = port
        return fix
    if use.file == "config":
        return {use.key: port}
    w = use.worker
    urls = list(dep.routing.prefill_endpoints if w.role == "prefill" else dep.routing.decode_endpoints)
    parts = urlsplit(urls[w.index])
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    urls[w.index] = urlunsplit(parts._replace(netloc=f"{host}:{port}"))
    return {f"{SETTINGS}{use.key}": urls[0] if len(urls) == 1 else urls}


def ports(c: Ctx) -> Iterable[Finding]:
    """PD017: each port has one use; PD018: none is taken on this machine now."""
    uses = _port_uses(c.dep)
    taken = {u.port for u in uses}
    owners: dict[int, list[_PortUse]] = {}
    for u in uses:
        owners.setdefault(u.port, []).append(u)
    for port, users in sorted(owners.items()):
        if len(users) > 1:
            names = ", ".join(u.name if u.key.endswith("side_channel_port") or u.worker is None else f"{u.name} HTTP"
                              for u in users)  # fmt: skip
            last = users[-1]
            yield c.at("PD017", "error", last.file, last.key, f"port {port} is used by {names}",
                       "every HTTP and side-channel port its own number",
                       fixes=(_moved(c.dep, last, taken),))  # fmt: skip
    for u in uses:
        if port_in_use(u.host, u.port):
            yield _in_use(c, u, taken)


def _in_use(c: Ctx, u: _PortUse, taken: set[int]) -> Finding:
    return c.at("PD018", "error" if c.for_up else "warning", u.file, u.key,
                f"port {u.port} ({u.name}) is already in use on {u.host}",
                "a clash hangs vLLM's start for minutes instead of failing" if u.file == "config" else None,
                fixes=(_moved(c.dep, u, taken),), actions=(Action("stop", f"{u.host}:{u.port}"),))  # fmt: skip


def port_findings(dep: Deployment, name: str, port: int | None) -> list[Finding]:
    """PD018 as ``up`` reports it, for a port of process ``name`` that was taken after the check: the one
    numbered ``port``, or (a line that named none) each of its ports in use now. Empty when ``port`` is none of
    ``name``'s."""
    c = Ctx(dep, True, VllmInstall(None, None), {}, {})  # the port rules read only the deployment
    uses = _port_uses(dep)
    taken = {u.port for u in uses}
    mine = [u for u in uses if (u.process or (u.worker.name if u.worker else "gateway")) == name]
    hit = [u for u in mine if (u.port == port if port is not None else port_in_use(u.host, u.port))]
    return [_in_use(c, u, taken) for u in hit]


def port_taken_error(dep: Deployment, exc: BaseException) -> LaunchError | None:
    """A start that failed on a taken port (the process exited, or printed that it cannot bind) with the PD018
    finding ``check`` gives for that port, or None when ``exc`` is something else."""
    if not isinstance(exc, ProcessExitedError) or exc.info.diagnosis is None:
        return None
    if exc.info.diagnosis.code != "port_in_use":
        return None
    findings = port_findings(dep, exc.info.name, exc.info.diagnosis.port)
    if not findings:
        return None
    text = "\n".join([str(exc), *(f"error {f.text}" for f in findings)])
    return LaunchError(text, hint="\n".join(f.hint for f in findings if f.hint) or exc.hint)


def port_in_use(host: str, port: int) -> bool:
    """True when ``host:port`` cannot be bound because something listens there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("", "localhost") else "127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False
