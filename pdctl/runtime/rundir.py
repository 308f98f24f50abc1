"""The run directory: ``state.json`` and ``logs/``, so ``status``, ``logs`` and ``down`` work from any shell.

Layout (``Deployment.run_dir``, default ``.pdctl`` next to config.toml)::

    state.json          status, supervisor pid, per process: pid, pgid, create_time, argv, urls, ports, ...
    gateway.go          created by the supervisor once the workers are ready and the warm-up passed: the
                        gateway, started with the workers and held, listens only then (removed at each start)
    logs/<name>.log     raw output of each process (appended across restarts)
    logs/pdctl.log      the supervisor's own events
    logs/daemon.log     the detached supervisor's stdout/stderr (tracebacks if it crashes)
    ipc/<name>/         a vLLM worker's ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``), there while it runs

Before signalling a recorded pid, :func:`owned_process` checks with psutil that the pid still belongs to
the process pdctl started (same create_time, same command line): pids are reused.

httpx and psutil are imported where they are used, so a command that only reads or writes state.json (such
as ``pdctl up`` on its way to its first process) does not import them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdctl.errors import LaunchError, NotRunningError, PdctlError

if TYPE_CHECKING:
    import httpx
    import psutil

    from pdctl.config import Deployment

__all__ = [
    "STATE_FILE",
    "ProcessStatus",
    "RunState",
    "collect_status",
    "ensure_not_running",
    "gateway_counters",
    "is_running",
    "kill_recorded",
    "owned_process",
    "part_dir",
    "prepare_run_dir",
    "read_state",
    "write_state",
]

STATE_FILE = "state.json"


def part_dir(run_dir: Path, only: Sequence[str] = ()) -> Path:
    """The run directory of one ``--only`` selection (``<run_dir>/only-decode+gateway``); ``run_dir`` without one.

    Each host part has its own state.json and logs, so ``down``/``status``/``logs --only`` address just it, and
    two parts can run from one folder (two "hosts" on one machine, or a shared file system).
    """
    if not only:
        return run_dir
    return run_dir / ("only-" + "+".join(sorted(set(only))))


@dataclass(slots=True)
class RunState:
    """The content of ``state.json``."""

    run_dir: str
    config_path: str
    settings_path: str
    status: str = "starting"  # starting ready failed stopping stopped
    supervisor_pid: int = 0
    supervisor_create_time: float = 0.0
    supervisor_argv: list[str] = field(default_factory=list)
    watchdog_pid: int = 0
    detached: bool = False
    error: str | None = None
    gateway_url: str | None = None
    api_key_env: str | None = None
    started_at: float = 0.0
    updated_at: float = 0.0
    processes: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A plain dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> RunState:
        """Parse, ignoring unknown keys (a newer pdctl may add some); ValueError names what is damaged."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        missing = [k for k in ("run_dir", "config_path", "settings_path") if k not in data]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        state = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        if not isinstance(state.supervisor_pid, int) or not isinstance(state.supervisor_create_time, (int, float)):
            raise ValueError("supervisor_pid / supervisor_create_time: expected numbers")
        if not isinstance(state.processes, list):
            raise ValueError("processes: expected a list")
        for i, rec in enumerate(state.processes):
            if not (isinstance(rec, dict) and isinstance(rec.get("name"), str) and isinstance(rec.get("pid", 0), int)):
                raise ValueError(f"processes[{i}]: expected an object with a name and an integer pid")
        return state


def write_state(run_dir: Path, state: RunState) -> None:
    """Write ``state.json`` atomically (a reader never sees half a file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    state.updated_at = time.time()
    tmp = run_dir / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(state.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / STATE_FILE)


def read_state(run_dir: Path) -> RunState:
    """Read ``state.json``; :class:`NotRunningError` when there is none or it is damaged."""
    path = run_dir / STATE_FILE
    try:
        return RunState.from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise NotRunningError(
            f"no deployment found: {path} does not exist", hint="start one with `pdctl up` (or pass -c CONFIG)"
        ) from None
    except (OSError, ValueError) as exc:
        raise NotRunningError(
            f"cannot read {path}: {exc}",
            hint=f"stop any process of that deployment by hand, then remove {path}; `pdctl up` writes a new one",
        ) from None


def owned_process(pid: int, create_time: float, argv: Sequence[str] | None = None) -> psutil.Process | None:
    """The process ``pid`` if it is still the one pdctl started (create_time and command line match)."""
    if pid <= 0:
        return None
    import psutil

    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) > 0.05:
            return None
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        if argv:
            cmd = p.cmdline()
            # A process may rename itself (setproctitle); then the same create_time is enough.
            if cmd != list(argv) and not (len(cmd) == 1 and not cmd[0].startswith("/")):
                return None
        return p
    except psutil.Error:
        return None


def is_running(state: RunState) -> bool:
    """Whether the supervisor recorded in ``state`` still runs."""
    return owned_process(state.supervisor_pid, state.supervisor_create_time, state.supervisor_argv) is not None


def ensure_not_running(dep: Deployment) -> None:
    """Raise :class:`LaunchError` if a deployment recorded in this run directory still runs."""
    run_dir = dep.run_dir
    try:
        old = read_state(run_dir)
    except PdctlError:
        return
    if is_running(old):
        raise LaunchError(
            f"a deployment is already running from {run_dir} (supervisor pid {old.supervisor_pid})",
            hint="stop it with `pdctl down`, or set supervisor.run_dir to run a second one",
        )


def prepare_run_dir(dep: Deployment) -> Path:
    """Refuse if a deployment runs from this run directory; move the last run's logs to ``logs.prev/``."""
    ensure_not_running(dep)
    run_dir = dep.run_dir
    logs = run_dir / "logs"
    if logs.exists():
        prev = run_dir / "logs.prev"
        shutil.rmtree(prev, ignore_errors=True)
        logs.rename(prev)
    logs.mkdir(parents=True, exist_ok=True)
    return run_dir


def _tree(p: psutil.Process) -> list[psutil.Process]:
    import psutil

    try:
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return [p]


def kill_recorded(state: RunState, grace_s: float) -> list[int]:
    """Stop every recorded process still owned (groups, then descendants): SIGTERM, grace, SIGKILL.

    Used by ``down`` when the supervisor is gone; returns the pids that had to be signalled.
    """
    import psutil

    procs: dict[int, psutil.Process] = {}
    for rec in state.processes:
        p = owned_process(int(rec.get("pid", 0)), float(rec.get("create_time", 0.0)), rec.get("argv"))
        if p is not None:
            for q in _tree(p):
                procs[q.pid] = q
        for pid, ctime in rec.get("descendants", []):
            d = owned_process(int(pid), float(ctime))
            if d is not None:
                procs[d.pid] = d
    targets = list(procs.values())
    for q in targets:
        with contextlib.suppress(psutil.Error):
            q.terminate()
    _, alive = psutil.wait_procs(targets, timeout=grace_s)
    for q in alive:
        with contextlib.suppress(psutil.Error):
            q.kill()
    psutil.wait_procs(alive, timeout=5.0)
    return [q.pid for q in targets]


# ----------------------------------------------------------------------------------------- status


@dataclass(frozen=True, slots=True)
class ProcessStatus:
    """One row of ``pdctl status``."""

    name: str
    role: str
    state: str
    pid: int
    alive: bool
    uptime_s: float | None
    restarts: int
    health: str  # "ok", "HTTP 503", "down", "-"
    cpu_percent: float | None
    rss_bytes: int | None
    gpu_mem_mib: float | None
    url: str
    gpu_ids: tuple[int, ...]
    cpu_ids: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        """The ``status --json`` shape."""
        d = asdict(self)
        d["gpu_ids"], d["cpu_ids"] = list(self.gpu_ids), list(self.cpu_ids)
        return d


def _gpu_memory() -> dict[int, float]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run(
            [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    mem: dict[int, float] = {}
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            with contextlib.suppress(ValueError):
                mem[int(parts[0])] = mem.get(int(parts[0]), 0.0) + float(parts[1])
    return mem


def _health(client: httpx.Client, url: str) -> str:
    import httpx

    if url.startswith("tcp://"):  # a ZMQ socket (the KV events relay's): listening is all it shows
        from pdctl.runtime.process import listening

        return "ok" if listening(url) else "down"
    try:
        r = client.get(url, timeout=2.0)
    except httpx.HTTPError:
        return "down"
    return "ok" if r.status_code == 200 else f"HTTP {r.status_code}"


def collect_status(state: RunState, *, sample_s: float = 0.3) -> list[ProcessStatus]:
    """Live status of each recorded process: owned? health, CPU and RSS of its tree, GPU memory."""
    import httpx
    import psutil

    trees: dict[str, list[psutil.Process]] = {}
    for rec in state.processes:
        p = owned_process(int(rec.get("pid", 0)), float(rec.get("create_time", 0.0)), rec.get("argv"))
        trees[rec["name"]] = _tree(p) if p is not None else []
    for tree in trees.values():
        for q in tree:
            with contextlib.suppress(psutil.Error):
                q.cpu_percent(None)
    if any(trees.values()):
        time.sleep(sample_s)
    gpu = _gpu_memory()
    rows: list[ProcessStatus] = []
    with httpx.Client() as client:
        for rec in state.processes:
            tree = trees[rec["name"]]
            alive = bool(tree)
            cpu = rss = None
            gpu_mib = None
            if alive:
                cpu, rss = 0.0, 0
                for q in tree:
                    with contextlib.suppress(psutil.Error):
                        cpu += q.cpu_percent(None)
                        rss += q.memory_info().rss
                if gpu:
                    gpu_mib = sum(gpu.get(q.pid, 0.0) for q in tree)
            started = float(rec.get("started_at") or 0.0)
            rows.append(
                ProcessStatus(
                    name=rec["name"],
                    role=rec.get("role", ""),
                    state=rec.get("state", "?") if alive or rec.get("state") in ("fatal", "exited") else "gone",
                    pid=int(rec.get("pid", 0)),
                    alive=alive,
                    uptime_s=(time.time() - started) if alive and started else None,
                    restarts=int(rec.get("restarts", 0)),
                    health=_health(client, rec["ready_url"]) if alive and rec.get("ready_url") else "-",
                    cpu_percent=cpu,
                    rss_bytes=rss,
                    gpu_mem_mib=gpu_mib,
                    url=rec.get("url", ""),
                    gpu_ids=tuple(rec.get("gpu_ids", ())),
                    cpu_ids=tuple(rec.get("cpu_ids", ())),
                )
            )
    return rows


def gateway_counters(gateway_url: str, api_key: str | None = None) -> dict[str, float] | None:
    """``pdctl_requests_total`` from the gateway's /metrics, keyed ``path/status`` (None if unreachable).

    ``api_key``: sent when given (a gateway listening beyond loopback wants one for /metrics).
    """
    import httpx

    from pdctl.vllm.promtext import samples

    try:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        r = httpx.get(f"{gateway_url}/metrics", timeout=2.0, headers=headers)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for name, labels, value in samples(r.text, ("pdctl_requests_total",)):
        if name == "pdctl_requests_total":
            key = f"{labels.get('path', '?')}/{labels.get('status', '?')}"
            out[key] = out.get(key, 0.0) + value
    return out
