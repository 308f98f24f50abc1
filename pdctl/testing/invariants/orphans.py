"""N4, no orphans, and X4, loopback only: what a run started is gone after a stop, and listened only on loopback.

:func:`run_census` reads a run directory's ``state.json`` into a :class:`RunCensus` (pids with create times,
process groups, ports, logs); :func:`check_n4` waits for every pid, group member and port to be gone;
:func:`check_loopback` (X4) checks the live processes' listening sockets; :func:`port_free` is the port test.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pdctl.testing.invariants.result import InvariantResult, verdict

__all__ = ["RunCensus", "check_loopback", "check_n4", "port_free", "run_census"]


@dataclass(frozen=True, slots=True)
class RunCensus:
    """Everything a run directory says pdctl started: pids (with create times), groups, ports."""

    pids: Mapping[int, float]
    pgids: frozenset[int]
    ports: frozenset[int]
    gateway_pid: int | None = None
    worker_pids: Mapping[str, int] = field(default_factory=dict)
    worker_urls: Mapping[str, str] = field(default_factory=dict)
    log_files: tuple[Path, ...] = ()

    def merge(self, other: RunCensus) -> RunCensus:
        """Union of two censuses (take one while running and one after each restart)."""
        return RunCensus(
            {**self.pids, **other.pids},
            self.pgids | other.pgids,
            self.ports | other.ports,
            other.gateway_pid or self.gateway_pid,
            {**self.worker_pids, **other.worker_pids},
            {**self.worker_urls, **other.worker_urls},
            tuple(dict.fromkeys((*self.log_files, *other.log_files))),
        )


def run_census(run_dir: Path) -> RunCensus:
    """Read ``state.json`` (empty census when there is none); live children of recorded pids are added."""
    try:
        state = json.loads((run_dir / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return RunCensus({}, frozenset(), frozenset())
    pids: dict[int, float] = {}
    for key, ct in (("supervisor_pid", "supervisor_create_time"), ("watchdog_pid", None)):
        pid = int(state.get(key) or 0)
        if pid > 0:
            pids[pid] = float(state.get(ct) or 0.0) if ct else 0.0
    pgids: set[int] = set()
    ports: set[int] = set()
    workers: dict[str, int] = {}
    urls: dict[str, str] = {}
    gateway: int | None = None
    logs: list[Path] = []
    for rec in state.get("processes", []):
        pid = int(rec.get("pid") or 0)
        if pid > 0:
            pids[pid] = float(rec.get("create_time") or 0.0)
            if rec.get("role") == "gateway":
                gateway = pid
            else:
                workers[rec["name"]] = pid
                if rec.get("url"):
                    urls[rec["name"]] = rec["url"]
        if rec.get("pgid"):
            pgids.add(int(rec["pgid"]))
        ports.update(int(p) for p in rec.get("ports", []))
        for dpid, dct in rec.get("descendants", []):
            pids[int(dpid)] = float(dct)
        if rec.get("log_file"):
            logs.append(Path(rec["log_file"]))
    for pid in list(pids):
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(pid).children(recursive=True):
                pids.setdefault(c.pid, c.create_time())
    log_dir = run_dir / "logs"
    if log_dir.is_dir():
        logs.extend(p for p in sorted(log_dir.iterdir()) if p.is_file() and p not in logs)
    return RunCensus(pids, frozenset(pgids), frozenset(ports), gateway, workers, urls, tuple(logs))


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nobody listens on ``port`` (bound like a server, with SO_REUSEADDR: TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _alive(pid: int, create_time: float) -> bool:
    try:
        p = psutil.Process(pid)
        if create_time and abs(p.create_time() - create_time) > 0.05:
            return False  # the pid was reused by someone else
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group_members(pgids: frozenset[int]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "name"]):
        pid = p.info["pid"]
        if pid == me:
            continue
        try:
            if os.getpgid(pid) in pgids or os.getsid(pid) in pgids:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append((pid, str(p.info["name"])))
        except (OSError, psutil.Error):
            continue
    return out


def check_n4(census: RunCensus, *, extra_ports: Iterable[int] = (), timeout_s: float = 10.0) -> InvariantResult:
    """After a stop: no recorded pid alive, no member of a recorded group/session, every port free."""
    ports = sorted(census.ports | set(extra_ports))
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid, ct in census.pids.items() if _alive(pid, ct)]
        members = _group_members(census.pgids)
        busy = [p for p in ports if not port_free(p)]
        if not (alive or members or busy) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    problems = [f"pid {pid} still alive" for pid in alive]
    problems += [f"pid {pid} ({name}) left in a recorded process group or session" for pid, name in members]
    problems += [f"port {p} still in use" for p in busy]
    detail = f"{len(census.pids)} pids, {len(census.pgids)} groups gone; {len(ports)} ports free"
    return verdict("N4", problems, detail)


def check_loopback(census: RunCensus, *, allowed: Iterable[int] = ()) -> InvariantResult:
    """X4: every listening TCP socket of the run's live processes is bound to loopback, except ``allowed`` ports."""
    ok_ports = set(allowed)
    problems: list[str] = []
    seen = 0
    pids = set(census.pids)
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error as exc:
        return InvariantResult("X4", True, f"cannot list sockets: {exc}", skipped=True)
    for c in conns:
        if c.status != psutil.CONN_LISTEN or c.pid is None:
            continue
        try:
            in_run = c.pid in pids or os.getpgid(c.pid) in census.pgids
        except OSError:
            continue
        if not in_run:
            continue
        seen += 1
        ip, port = str(getattr(c.laddr, "ip", "")), int(getattr(c.laddr, "port", 0))
        if ip not in ("127.0.0.1", "::1") and port not in ok_ports:
            problems.append(f"pid {c.pid} listens on {ip}:{port}")
    return verdict("X4", problems, f"{seen} listening socket(s), all on loopback")
