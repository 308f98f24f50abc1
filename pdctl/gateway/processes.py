"""Several gateway processes on one port (``gateway.workers = N``): the parent that starts, watches and stops them.

::

    pdctl gateway                      parent: no listener, no event loop; waits for signals and child exits
      ├─ pdctl gateway  PDCTL_GATEWAY_PROCESS=0/N    its own SO_REUSEPORT listener and uvloop (server.run)
      └─ pdctl gateway  PDCTL_GATEWAY_PROCESS=1/N    ...

The kernel spreads new connections over the listeners (SO_REUSEPORT hashes each connection's addresses); a
connection stays with the process that accepted it. Each child is a whole gateway (its own pool, breakers,
SLO predictor); what must hold across them:

* **limits** (``gateway.rate_limit`` and each key's): every process enforces its share, the limit split by N
  (:func:`pdctl.gateway.ratelimit.share_of`), so the sum is the limit with no shared state;
* **metrics**: ``prometheus_client``'s multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR`` = :func:`metrics_dir`
  (emptied before the children start); any process's ``/metrics`` sums them all.

Signals: the parent passes its first SIGTERM/SIGINT on as :data:`STOP_SIGNAL` (each child drains as a single
gateway does, :mod:`pdctl.gateway.server`) and any later one as :data:`FORCE_SIGNAL` (the children stop at
once); after ``stop_timeout_s`` the rest get SIGKILL. Signals of their own, because a SIGTERM sent to the whole
group (``pdctl down``, Ctrl-C) reaches the children too: with the parent's copy that would be two SIGTERMs,
which a gateway reads as "stop now". SIGHUP (reload keys) is forwarded. The children stay in the parent's
process group, so ``pdctl up``'s group signals (SIGCONT releasing a held start, SIGTERM, SIGKILL) reach them;
a child whose parent is gone (even by SIGKILL) drains and exits on its own. A child that exits while the parent
is not stopping stops the others and the parent exits 1 (fail-fast: ``pdctl up``'s restart policy restarts the
whole gateway).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from pdctl.errors import LaunchError
from pdctl.gateway.routing.kv_events import EventsRelay
from pdctl.gateway.settings import GatewaySettings
from pdctl.vllm.kv_curve import server_keys
from pdctl.vllm.kv_events import bind_endpoint

__all__ = [
    "FORCE_SIGNAL",
    "KV_EVENTS_RELAY_ENV",
    "METRICS_DIR_ENV",
    "PROCESS_ENV",
    "STOP_SIGNAL",
    "events_relay",
    "listener",
    "listener_for",
    "metrics_dir",
    "process_slot",
    "supervise",
]

PROCESS_ENV = "PDCTL_GATEWAY_PROCESS"
"""Set by the parent in each child: ``index/count/parent pid``."""
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
KV_EVENTS_RELAY_ENV = "PDCTL_KV_EVENTS_RELAY"
"""Set by the parent in each child when it relays the workers' KV cache events: the address to connect to."""
STOP_SIGNAL = signal.SIGUSR1
"""Parent -> children: drain and exit (once draining, a no-op)."""
FORCE_SIGNAL = signal.SIGUSR2
"""Parent -> children: exit now."""

log = logging.getLogger("pdctl.gateway")


def process_slot(environ: Mapping[str, str]) -> tuple[int, int, int] | None:
    """``(index, count, parent pid)`` in a child started by :func:`supervise`, else None."""
    raw = environ.get(PROCESS_ENV)
    if not raw:
        return None
    index, count, parent = raw.split("/")
    return int(index), int(count), int(parent)


def metrics_dir(run_dir: Path | None) -> Path:
    """Where the processes' metric files go: ``<run_dir>/gateway-metrics`` under ``pdctl up``, else a new
    temporary folder."""
    if run_dir is None:
        return Path(tempfile.mkdtemp(prefix="pdctl-gateway-metrics-"))
    return run_dir / "gateway-metrics"


def listener(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT, so each gateway process has its own on the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def listener_for(host: str, port: int) -> socket.socket:
    """:func:`listener`, or a :class:`LaunchError` that says what holds the port."""
    try:
        return listener(host, port)
    except OSError as exc:
        raise LaunchError(
            f"gateway process cannot listen on {host}:{port}: {exc.strerror or exc}",
            hint="another program holds the port without SO_REUSEPORT: stop it or change gateway.listen",
        ) from None


def events_relay(settings: GatewaySettings) -> EventsRelay | None:
    """The parent's relay of the workers' KV cache events (``routing.prefix_view = "exact"``), started; None when
    the view is not used. Each child gets its address in :data:`KV_EVENTS_RELAY_ENV`."""
    r = settings.routing
    if not r.reads_kv_events:
        return None
    folder = Path(tempfile.mkdtemp(prefix="pdctl-kv-events-"))
    curve = server_keys() if r.kv_events_curve else None
    relay = EventsRelay(bind_endpoint(r.kv_events_host, r.kv_events_port), folder / "relay.ipc", curve)
    try:
        relay.start()
    except LaunchError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return relay


def supervise(
    argv: Sequence[str], count: int, metrics: Path, stop_timeout_s: float, remove_metrics: bool = False,
    extra_env: Mapping[str, str] | None = None,
) -> int:  # fmt: skip
    """Run ``count`` children (``argv``, each with :data:`PROCESS_ENV` set) until a signal or a child's exit.

    Returns 0 after a stop asked by a signal, 1 when a child exited on its own. ``metrics`` is emptied first
    (and removed at the end when ``remove_metrics``).
    """
    shutil.rmtree(metrics, ignore_errors=True)
    metrics.mkdir(parents=True)
    received: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_signal(sig: int, frame: FrameType | None) -> None:
        received.append(sig)  # acted on in the loop below

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)
    previous = {s: signal.signal(s, on_signal) for s in handled}
    old_wakeup = signal.set_wakeup_fd(wake_w)
    children: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(count):
            env = os.environ | dict(extra_env or {}) | {PROCESS_ENV: f"{i}/{count}/{os.getpid()}",
                                                        METRICS_DIR_ENV: str(metrics)}  # fmt: skip
            children.append(subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL))
        return _watch(children, received, wake_r, stop_timeout_s, metrics)
    finally:
        for c in children:  # only after an error above: _watch returns with every child reaped
            if c.poll() is None:
                _signal(c, signal.SIGKILL)
                c.wait()
        signal.set_wakeup_fd(old_wakeup)
        for s, h in previous.items():
            signal.signal(s, h)
        os.close(wake_r)
        os.close(wake_w)
        if remove_metrics:
            shutil.rmtree(metrics, ignore_errors=True)


def _watch(
    children: list[subprocess.Popen[bytes]], received: list[int], wake_r: int, stop_timeout_s: float, metrics: Path
) -> int:
    from prometheus_client.multiprocess import mark_process_dead

    deadline: float | None = None
    stops = 0
    status = 0
    live = list(children)
    while live:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        with contextlib.suppress(InterruptedError):
            select.select([wake_r], [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            os.read(wake_r, 512)
        signals, received[:] = list(received), []
        for sig in signals:
            if sig in (signal.SIGTERM, signal.SIGINT):
                forward = STOP_SIGNAL if stops == 0 else FORCE_SIGNAL
                stops += 1
                if deadline is None:
                    deadline = time.monotonic() + stop_timeout_s
                    log.info("stopping %d gateway process(es)", len(live))
                for c in live:
                    _signal(c, forward)
            elif sig == signal.SIGHUP:
                for c in live:
                    _signal(c, signal.SIGHUP)
        for c in list(live):
            if c.poll() is not None:
                live.remove(c)
                mark_process_dead(c.pid, str(metrics))  # type: ignore[no-untyped-call]
                if deadline is None:
                    log.error("gateway process %d exited with status %s: stopping the others", c.pid, c.returncode)
                    status = 1
                    deadline = time.monotonic() + stop_timeout_s
                    for other in live:
                        _signal(other, STOP_SIGNAL)
        if deadline is not None and time.monotonic() >= deadline:
            for c in live:
                log.warning("gateway process %d did not stop within %.0fs: SIGKILL", c.pid, stop_timeout_s)
                _signal(c, signal.SIGKILL)
                c.wait()
                mark_process_dead(c.pid, str(metrics))  # type: ignore[no-untyped-call]
            live = []
    return status


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except OSError as exc:  # already gone
        if exc.errno not in (errno.ESRCH, errno.EPERM):
            raise
