"""Run the gateway under uvicorn (uvloop + httptools) with a graceful drain on SIGTERM/SIGINT.

Drain order: ``/ready`` turns false and new completions get 503 at once; :data:`READY_GRACE_S` later the
listener closes; in-flight requests get up to ``gateway.drain_timeout_s`` to finish; what is left is
cancelled (a stream still open gets one SSE error event). A second signal exits at once. Exit status 0.

Held start (``pdctl up``): :func:`make_server` does every import and builds the app and uvicorn's config
while the engines load; :func:`wait_for_release` then waits for the go-file before :func:`run` binds the
port, so no client reaches the gateway before the supervisor's warm-up passed. SIGTERM/SIGINT while held
end the wait; the process exits 0 without ever listening.

TLS: ``gateway.tls_certfile``/``tls_keyfile`` go to uvicorn's ``ssl_certfile``/``ssl_keyfile`` after
:func:`tls_files` checked them (present, readable, a certificate that is not expired, a key that matches).
SIGHUP re-reads the keys file (:meth:`pdctl.gateway.app.Gateway.reload_keys`) between ticks.

Once started, :func:`settle_heap` takes everything startup allocated out of the cyclic collector's way and
makes its young-generation passes rarer (docs/performance.md, "Where the CPU goes").

One of several processes (``gateway.workers``, :mod:`pdctl.gateway.processes`): :func:`run` serves on the
process's own SO_REUSEPORT listener, and a server given ``parent_pid`` drains by itself when its parent is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import gc
import logging
import math
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable, Generator
from pathlib import Path
from types import FrameType

import uvicorn

from pdctl.config import GatewayConfig
from pdctl.errors import ConfigError
from pdctl.gateway.app import Gateway
from pdctl.gateway.direct import HttpProtocol
from pdctl.gateway.edge import FD_RESERVE, FDS_PER_CONNECTION, EdgeLimits, attach_limits, connection_cap
from pdctl.gateway.processes import FORCE_SIGNAL, STOP_SIGNAL

__all__ = [
    "GC_YOUNG_THRESHOLD",
    "HOLD_POLL_S",
    "READY_GRACE_S",
    "DrainingServer",
    "configure_logging",
    "edge_limits",
    "make_server",
    "run",
    "serve",
    "settle_heap",
    "stop_timeout_s",
    "tls_files",
    "wait_for_release",
]

READY_GRACE_S = 1.0
HOLD_POLL_S = 0.25
#: Allocations (net of frees) that trigger a young-generation collection while serving; CPython's default is 700.
#: Every in-flight request's objects are live at a young collection, so with hundreds of streams the default's
#: frequent passes mostly promote and re-scan them (docs/performance.md, "Where the CPU goes").
GC_YOUNG_THRESHOLD = 10_000


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal first marks the gateway as draining."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, parent_pid: int | None = None) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.parent_pid = parent_pid
        self._exit_at: float | None = None
        self._reload = False
        self._exit_signals = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        handlers = {signal.SIGHUP: self._on_sighup, STOP_SIGNAL: self._on_stop, FORCE_SIGNAL: self._on_force}
        previous = {s: signal.signal(s, h) for s, h in handlers.items()}
        try:
            with super().capture_signals():
                yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _on_sighup(self, sig: int, frame: FrameType | None) -> None:
        self._reload = True  # acted on in on_tick, outside the signal handler

    def _on_stop(self, sig: int, frame: FrameType | None) -> None:
        self._drain()  # the parent passes its first SIGTERM/SIGINT on: a drain, never a forced exit

    def _on_force(self, sig: int, frame: FrameType | None) -> None:
        self.should_exit = True
        self.force_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Counted apart from the parent's STOP_SIGNAL: a signal to the whole process group reaches this process
        # and the parent, which passes it on; the two together are one request to stop, not two.
        self._exit_signals += 1
        if self._exit_signals == 1:
            self._drain()
        else:
            self._on_force(sig, frame)

    def _drain(self) -> None:
        if self.gateway.draining:
            return
        self.gateway.draining = True
        grace = min(READY_GRACE_S, self.gateway.settings.gateway.drain_timeout_s)
        self._exit_at = time.monotonic() + grace
        logging.getLogger("pdctl.gateway").info(
            "draining: /ready is false, %d request(s) in flight, up to %.0fs",
            self.gateway.in_flight, self.gateway.settings.gateway.drain_timeout_s,
        )  # fmt: skip

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        settle_heap()

    async def on_tick(self, counter: int) -> bool:
        if self._reload:
            self._reload = False
            self.gateway.reload_keys()
        if self.parent_pid is not None and not self.gateway.draining and os.getppid() != self.parent_pid:
            self._drain()  # the parent is gone: nothing else would ever stop this process
        if self._exit_at is not None and time.monotonic() >= self._exit_at:
            self.should_exit = True
        return await super().on_tick(counter)


def stop_timeout_s(g: GatewayConfig) -> float:
    """How long a gateway process may take to stop after SIGTERM: the grace, the drain, and 5 s to close."""
    return READY_GRACE_S + max(0.0, g.drain_timeout_s) + 5.0


class _Formatter(logging.Formatter):
    """``logging.Formatter`` with the time of day formatted once a second, not once a line."""

    _second = -1
    _text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        if second != self._second:
            self._text = super().formatTime(record, datefmt)
            self._second = second
        return self._text


def configure_logging(level: str, with_pid: bool = False) -> None:
    """One line per event on stdout: ``HH:MM:SS LEVEL pdctl.gateway message`` (``pdctl.gateway[pid]`` with
    ``with_pid``, when several gateway processes share the log). For the gateway's own process: it also turns off
    what the logging module records per line that no line shows (the caller's frame, thread, process name, and the
    pid without ``with_pid``), as the logging HOWTO's "Optimization" section describes; with the time formatted
    once a second that halves the cost of the access log's line per request (docs/performance.md, "History")."""
    logging._srcfile = None  # the documented switch (the HOWTO's "Optimization")
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging.logProcesses = with_pid
    handler = logging.StreamHandler(sys.stdout)
    name = "%(name)s[%(process)d]" if with_pid else "%(name)s"
    handler.setFormatter(_Formatter(f"%(asctime)s %(levelname)s {name} %(message)s", "%H:%M:%S"))
    root = logging.getLogger("pdctl.gateway")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def serve(gateway: Gateway, host: str, port: int) -> None:
    """Serve until a signal; returns after the drain."""
    run(make_server(gateway, host, port))


def make_server(gateway: Gateway, host: str, port: int, parent_pid: int | None = None) -> DrainingServer:
    """The server, its config loaded (protocol classes imported, app wrapped); nothing is bound yet.

    ``parent_pid``: one of several gateway processes, which stops when that parent is gone."""
    g = gateway.settings.gateway
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop = "asyncio"
    tls = tls_files(g)
    config = uvicorn.Config(
        gateway,
        host=host,
        port=port,
        loop=loop,
        http=HttpProtocol,  # uvicorn's httptools protocol, telling a request when its client leaves
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=max(1, int(g.drain_timeout_s)) if g.drain_timeout_s > 0 else None,
        timeout_keep_alive=max(1, math.ceil(g.keepalive_timeout_s)),  # HttpProtocol keeps the exact number
        backlog=4096,
        # The gateway reads no client address, so X-Forwarded-* need no rewriting: one ASGI layer less per request.
        proxy_headers=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    config.load()
    attach_limits(config, edge_limits(gateway))
    return DrainingServer(config, gateway, parent_pid)


def edge_limits(gateway: Gateway) -> EdgeLimits:
    """This process's edge limits (:mod:`pdctl.gateway.edge`): its share of ``gateway.max_connections``, lowered to
    what its file descriptors allow (with a warning)."""
    limits = EdgeLimits.of(gateway.settings.gateway, gateway.settings.process)
    cap = connection_cap(limits.max_connections)
    if cap < limits.max_connections:
        logging.getLogger("pdctl.gateway").warning(
            "gateway.max_connections: this process's share %d needs %d file descriptors, more than the limit "
            "(ulimit -n) allows; capped at %d connections",
            limits.max_connections, limits.max_connections * FDS_PER_CONNECTION + FD_RESERVE, cap,
        )  # fmt: skip
        limits = dataclasses.replace(limits, max_connections=cap)
    return limits


def settle_heap() -> None:
    """Freeze what startup allocated (``gc.freeze``, as vLLM's API server does once started), so full collections
    no longer walk it, and raise the young generation's threshold to :data:`GC_YOUNG_THRESHOLD`."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def tls_files(g: GatewayConfig) -> tuple[str, str] | None:
    """``(certfile, keyfile)`` from the settings, or None; :class:`ConfigError` naming the key when unusable."""
    if g.tls_certfile is None or g.tls_keyfile is None:
        return None
    for key, path in (("gateway.tls_certfile", g.tls_certfile), ("gateway.tls_keyfile", g.tls_keyfile)):
        if not Path(path).is_file():
            raise ConfigError(
                "settings.json",
                key,
                f"{path}: no such file",
                hint="give the path of a PEM file (relative paths start at settings.json's folder)",
            )
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(Path(g.tls_certfile).read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "settings.json",
            "gateway.tls_certfile",
            f"{g.tls_certfile}: not a PEM certificate ({exc})",
            hint="the certificate (BEGIN CERTIFICATE), not the key",
        ) from None
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc < now:
        raise ConfigError(
            "settings.json",
            "gateway.tls_certfile",
            f"{g.tls_certfile}: the certificate expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC",
            hint="renew it (for example with certbot, or openssl for a self-signed one)",
        )
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(g.tls_certfile, g.tls_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            "settings.json",
            "gateway.tls_keyfile",
            f"{g.tls_keyfile}: cannot use it with {g.tls_certfile} ({exc})",
            hint="the private key (unencrypted PEM) that belongs to the certificate",
        ) from None
    return g.tls_certfile, g.tls_keyfile


def run(server: DrainingServer, sock: socket.socket | None = None) -> None:
    """Bind (or serve on ``sock``), serve until a signal, drain; returns after the drain."""
    sockets = [sock] if sock is not None else None
    asyncio.run(server.serve(sockets)) if server.config.loop == "asyncio" else uvloop_run(server, sockets)


def wait_for_release(go_file: Path, poll_s: float = HOLD_POLL_S, announce: Callable[[], None] | None = None) -> bool:
    """Block until ``go_file`` exists (True), or until SIGTERM/SIGINT asks to stop (False).

    ``announce`` runs once the signals are held back: a SIGTERM sent as soon as the hold is announced then ends
    the wait (exit 0) instead of killing the process by the signal's default action.

    The supervisor sends SIGCONT right after it creates the file, which ends the wait at once; the file is
    checked again every ``poll_s`` as well, for a signal that came before this wait began (or a file made by
    hand). Not a fast poll: each wake-up costs CPU for the whole engine load (docs/performance.md, "Cutting
    pdctl's own share").
    """
    signals = {signal.SIGTERM, signal.SIGINT, signal.SIGCONT, STOP_SIGNAL, FORCE_SIGNAL}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        if announce is not None:
            announce()
        while not go_file.exists():
            info = signal.sigtimedwait(signals, poll_s)
            if info is not None and info.si_signo != signal.SIGCONT:
                return False
        return True
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def uvloop_run(server: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
    """Run the server on uvloop."""
    import uvloop

    uvloop.run(server.serve(sockets))
