"""A deployment driven from outside its supervisor: the detached start, the ordered stop, the status.

* :func:`host_part`          -- ``up --only NAME|ROLE``: this host's part of the deployment (its processes,
  its own run directory) and the workers other hosts run
* :func:`start_detached`     -- ``up -d``: start ``python -m pdctl.cli.daemon`` in its own session, relay its event
  log, return the state once it says ``ready`` (:class:`LaunchError` otherwise)
* :func:`stop_deployment`    -- ``down``: SIGTERM the supervisor (it stops gateway, decode, prefill in order),
  wait, SIGKILL it if it hangs, then kill whatever recorded process is left
* :func:`log_files`          -- ``logs``: each process's log file, by name
* :func:`deployment_status`  -- ``status``: a :class:`DeploymentStatus` in every state of the run directory,
  including none and a damaged one

Everything is read from the run directory (:mod:`pdctl.runtime.rundir`), so these work from any shell. Progress goes
to the callbacks; nothing here prints or exits. psutil and httpx are imported where they are used (see
:mod:`pdctl.runtime.rundir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdctl.config import Deployment
from pdctl.errors import ConfigError, LaunchError, NotRunningError, PdctlError
from pdctl.runtime.eventlog import EVENT_LOG, EventTail
from pdctl.runtime.plan import Plan, build_plan, relay_name
from pdctl.runtime.rundir import (
    STATE_FILE,
    ProcessStatus,
    RunState,
    collect_status,
    gateway_counters,
    is_running,
    kill_recorded,
    owned_process,
    part_dir,
    read_state,
    write_state,
)

__all__ = [
    "DeploymentStatus",
    "HostPart",
    "deployment_status",
    "host_part",
    "log_files",
    "split_only",
    "start_detached",
    "stop_deployment",
]

Say = Callable[[str], None]


# ---------------------------------------------------------------------------------------------- --only

ROLES = ("prefill", "decode", "gateway")


@dataclass(frozen=True, slots=True)
class HostPart:
    """What one host runs under ``up --only``: the deployment with its own run directory, the plan of its
    processes, and the workers other hosts run (name, health URL), waited for before the gateway opens."""

    dep: Deployment
    plan: Plan
    remote: tuple[tuple[str, str], ...]


def split_only(values: Sequence[str] | None) -> tuple[str, ...]:
    """``--only decode,gateway --only prefill-1`` -> the selectors, in order, without repeats."""
    out: list[str] = []
    for v in values or ():
        out += [x.strip() for x in v.split(",") if x.strip() and x.strip() not in out]
    return tuple(out)


def host_part(dep: Deployment, only: Sequence[str], plan: Plan | None = None) -> HostPart:
    """This host's processes: those named in ``only`` or of a role in it (``prefill``, ``decode``, ``gateway``),
    and the KV events relays of the workers among them.

    Raises :class:`ConfigError` for a selector that is neither a process name nor a role.
    """
    full = plan if plan is not None else build_plan(dep)
    if not only:
        return HostPart(dep, full, ())
    names = [p.name for p in full.processes]
    for sel in only:
        if sel not in names and sel not in ROLES:
            raise ConfigError(
                dep.config_path,
                None,
                f"--only {sel}: no process or role of that name",
                hint=f"name processes ({', '.join(names)}) or roles ({', '.join(ROLES)}), comma-separated",
            )
    sup = dataclasses.replace(dep.supervisor, run_dir=str(part_dir(dep.run_dir, only)))
    part = dataclasses.replace(dep, supervisor=sup)
    # Rebuilt for the part's run directory (the gateway's go-file and vLLM's logging file live there).
    rebuilt = build_plan(part, full.vllm)
    picked = {p.name for p in rebuilt.processes if p.name in only or p.role in only}
    # A worker's KV events relay (routing.kv_events_curve) runs on the worker's host.
    chosen = tuple(p for p in rebuilt.processes if p.name in picked or p.name in {relay_name(n) for n in picked})
    remote = tuple((w.name, f"{w.url}/health") for w in dep.workers if w.name not in {p.name for p in chosen})
    return HostPart(part, dataclasses.replace(rebuilt, processes=chosen), remote)


# ------------------------------------------------------------------------------------------------ up -d


def start_detached(dep: Deployment, plan: Plan, on_message: Say, only: Sequence[str] = ()) -> RunState:
    """Start the detached supervisor and wait until state.json says ``ready``; its events go to ``on_message``.

    The wait is bounded by every wave's ``ready_timeout_s`` plus the warm-up's; on a timeout or Ctrl-C the
    supervisor is asked to stop (SIGTERM) before this raises. ``dep``/``plan`` are a :class:`HostPart`'s when
    ``only`` selects one.
    """
    run_dir = dep.run_dir
    log_dir = run_dir / "logs"
    daemon_log = (log_dir / "daemon.log").open("ab")
    argv = [sys.executable, "-m", "pdctl.cli.daemon", "-c", dep.config_path, "-s", dep.settings_path]
    for sel in only:
        argv += ["--only", sel]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=daemon_log, stderr=subprocess.STDOUT,
                            start_new_session=True, close_fds=True)  # fmt: skip
    daemon_log.close()
    tail = EventTail(log_dir / EVENT_LOG)
    sup = dep.supervisor
    # A held gateway is waited for after the last wave, under its own ready_timeout_s.
    waves = len({p.wave for p in plan.processes}) + int(any(p.hold_file for p in plan.processes))
    deadline = time.monotonic() + sup.ready_timeout_s * waves + (sup.warmup_timeout_s if sup.warmup else 0) + 60
    state: RunState | None = None
    seen: tuple[int, int, int] | None = None
    try:
        while True:
            for msg in tail.new_messages():
                on_message(msg)
            stamp = _stamp(run_dir / STATE_FILE)
            if stamp != seen:  # parse state.json only when it was rewritten
                seen = stamp
                state = _state_of(run_dir, proc.pid)
            if state is not None and state.status in ("ready", "failed", "stopped"):
                break
            if proc.poll() is not None:
                state = _state_of(run_dir, proc.pid)
                break
            if time.monotonic() > deadline:
                proc.send_signal(signal.SIGTERM)
                raise LaunchError("the detached supervisor did not report ready in time; it was asked to stop")
            time.sleep(0.1)
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=sup.stop_timeout_s * 3 + 30)
        raise
    for msg in tail.new_messages():
        on_message(msg)
    if state is None or state.status != "ready":
        proc.wait(timeout=sup.stop_timeout_s * 3 + 30)
        error = state.error if state and state.error else _tail(log_dir / "daemon.log")
        raise LaunchError(f"up failed:\n{error}", hint=f"see {log_dir}")
    return state


def _stamp(path: Path) -> tuple[int, int, int] | None:
    # Each write is a new file (os.replace), so the inode changes too; the daemon rewrites it every second anyway.
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _state_of(run_dir: Path, pid: int) -> RunState | None:
    try:
        state = read_state(run_dir)
    except NotRunningError:
        return None
    return state if state.supervisor_pid == pid else None


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no output in {path})"


# -------------------------------------------------------------------------------------------------- down


def stop_deployment(run_dir: Path, timeout_s: float, say: Say, warn: Say) -> None:
    """Stop the deployment recorded in ``run_dir`` so that nothing of it survives.

    The supervisor gets SIGTERM and stops its processes in order (gateway, decode, prefill); after
    ``timeout_s`` it is SIGKILLed. Then every recorded process still owned (a supervisor that was gone
    already, or one killed mid-stop) is stopped directly, the workers' IPC folders are removed, and state.json
    says ``stopped``.
    """
    import psutil

    state = read_state(run_dir)
    sup = owned_process(state.supervisor_pid, state.supervisor_create_time, state.supervisor_argv)
    if sup is not None:
        say(f"stopping the deployment (supervisor pid {sup.pid})")
        sup.terminate()
        deadline = time.monotonic() + timeout_s
        # Poll rather than psutil's wait(): a supervisor that exited but is not yet reaped by its parent
        # (a zombie) is gone for our purposes.
        while time.monotonic() < deadline and is_running(state):
            time.sleep(0.2)
        if is_running(state):
            warn(f"supervisor did not stop within {timeout_s:g} s: killing it and every process")
            with contextlib.suppress(psutil.Error):
                sup.kill()
    elif state.status not in ("stopped", "failed"):
        say(f"the supervisor (pid {state.supervisor_pid}) is gone; stopping its processes directly")
    left = kill_recorded(read_state(run_dir), grace_s=10.0)
    if left:
        warn(f"killed {len(left)} leftover process(es): {', '.join(map(str, left))}")
    state = read_state(run_dir)
    for rec in state.processes:  # a supervisor that was killed left its workers' IPC sockets
        if isinstance(rec.get("ipc_dir"), str):
            shutil.rmtree(rec["ipc_dir"], ignore_errors=True)
    if state.status not in ("stopped", "failed"):
        state.status = "stopped"
        write_state(run_dir, state)


# -------------------------------------------------------------------------------------------------- logs


def log_files(rd: Path, names: list[str]) -> dict[str, Path]:
    """``logs/<name>.log`` of each process recorded in state.json or found in ``logs/`` (``names`` only, if given)."""
    log_dir = rd / "logs"
    known: list[str] = []
    try:
        known = [p["name"] for p in read_state(rd).processes]
    except NotRunningError:
        pass
    files = {n: log_dir / f"{n}.log" for n in known}
    for path in sorted(log_dir.glob("*.log")):
        name = path.stem
        if name == "daemon":
            continue
        files.setdefault(name, path)
    if not files and not log_dir.exists():
        raise NotRunningError(f"no logs in {log_dir}", hint="start a deployment with `pdctl up`")
    if names:
        unknown = [n for n in names if n not in files]
        if unknown:
            raise PdctlError(f"no process named {', '.join(unknown)}", hint=f"known: {', '.join(files)}")
        files = {n: files[n] for n in names}
    return files


# ------------------------------------------------------------------------------------------------ status


@dataclass(slots=True)
class DeploymentStatus:
    """What ``pdctl status`` shows, whatever the run directory holds.

    ``status``: the supervisor's (``starting``, ``ready``, ``failed``, ``stopping``, ``stopped``),
    ``supervisor gone`` when it died without stopping, ``not running`` when there is no state.json, or
    ``unreadable`` when state.json is damaged; ``problem`` then says why, with a hint.
    """

    run_dir: Path
    status: str
    state: RunState | None = None
    running: bool = False
    processes: list[ProcessStatus] = field(default_factory=list)
    gateway_requests: dict[str, float] | None = None
    problem: NotRunningError | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``status --json`` object: the same keys in every state."""
        return {
            "status": self.status,
            "supervisor_pid": self.state.supervisor_pid if self.state else None,
            "supervisor_running": self.running,
            "run_dir": str(self.run_dir),
            "error": str(self.problem) if self.problem else self.state.error if self.state else None,
            "hint": self.problem.hint if self.problem else None,
            "processes": [r.to_json() for r in self.processes],
            "gateway_requests": self.gateway_requests,
        }


def deployment_status(run_dir: Path) -> DeploymentStatus:
    """The live status of the deployment recorded in ``run_dir`` (never raises for the run directory's state)."""
    try:
        state = read_state(run_dir)
    except NotRunningError as exc:
        exists = (run_dir / STATE_FILE).exists()
        return DeploymentStatus(run_dir, "unreadable" if exists else "not running", problem=exc)
    running = is_running(state)
    overall = state.status if running or state.status in ("stopped", "failed") else "supervisor gone"
    key = os.environ.get(state.api_key_env) if state.api_key_env else None
    counters = gateway_counters(state.gateway_url, key) if state.gateway_url and running else None
    return DeploymentStatus(run_dir, overall, state, running, collect_status(state), counters)
