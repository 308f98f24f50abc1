"""One child process: spawn, readiness, exit report, and a stop that leaves nothing behind.

The child leads its own session (so its process group holds vLLM's EngineCore and workers too), gets an
explicit environment (``os.environ`` minus the secrets the plan names, plus the plan's overrides), the files
the plan names (vLLM's logging config), a fresh folder of its own when the plan names one (``ipc_dir``, removed
once it stopped), the CPU affinity of ``cpu_ids`` from its first instruction (and
:meth:`ManagedProcess.pin_threads` to keep its tree there), reads /dev/null, and its stdout+stderr go
through one pipe to a reader thread that writes ``logs/<name>.log`` and feeds the multiplexed view; the
reader also watches for a line after which the child can never become ready (:func:`pdctl.vllm.diagnose.dead_end`,
a port taken), so a wait for readiness ends at once instead of at its deadline.
Stopping is SIGTERM to the group, a grace period, SIGKILL to the group, then a sweep of every descendant
seen since the start (some leave the group, e.g. with ``setsid``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import psutil

from pdctl.config import parse_endpoint
from pdctl.errors import LaunchError
from pdctl.runtime.logs import LogLine, start_reader
from pdctl.runtime.pgroup import signal_group
from pdctl.runtime.plan import ProcessSpec
from pdctl.vllm.diagnose import Diagnosis, dead_end, diagnose

__all__ = [
    "ExitInfo",
    "ManagedProcess",
    "NeverReadyError",
    "ProcessExitedError",
    "child_env",
    "listening",
    "signal_name",
]

TAIL_LINES = 40
#: How long a process that printed a dead-end line may take to exit by itself (vLLM does on a taken HTTP port)
#: before it counts as one that runs on but can never become ready: its exit report is the better one.
DEAD_END_GRACE_S = 2.0


def child_env(spec: ProcessSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's whole environment: ``base`` (os.environ) minus ``spec.unset_env``, plus ``spec.env``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in spec.unset_env}
    env.update(spec.env)
    return env


def signal_name(returncode: int | None) -> str:
    """``exit code 3`` / ``killed by SIGKILL`` / ``running``."""
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """How a process ended: its return code (negative = signal; None: it still runs but can never become
    ready), the last lines it printed, a diagnosis."""

    name: str
    returncode: int | None
    tail: tuple[str, ...]
    diagnosis: Diagnosis | None
    log_file: str

    def describe(self) -> str:
        """A multi-line report for a person."""
        if self.returncode is None:
            lines = [f"{self.name} still runs but can never become ready"]
        else:
            lines = [f"{self.name} exited ({signal_name(self.returncode)})"]
        if self.diagnosis:
            lines.append(f"diagnosis: {self.diagnosis.message}")
        if self.tail:
            lines.append(f"last {len(self.tail)} lines of {self.log_file}:")
            lines.extend(f"  {t}" for t in self.tail)
        return "\n".join(lines)

    def diagnosed(self) -> str:
        """``port 5700 is already in use (decode.log: zmq.error.ZMQError: ...)``: the diagnosis and its line."""
        assert self.diagnosis is not None
        return f"{self.diagnosis.message} ({Path(self.log_file).name}: {self.diagnosis.line})"


class ProcessExitedError(LaunchError):
    """A process exited while pdctl waited for it to become ready."""

    def __init__(self, info: ExitInfo) -> None:
        self.info = info
        hint = info.diagnosis.hint if info.diagnosis else f"see {info.log_file}"
        super().__init__(info.describe(), hint)


class NeverReadyError(ProcessExitedError):
    """A starting process that still runs printed a line after which it can never become ready (a port it must
    bind is taken: vLLM's engine would wait minutes for its dead NIXL listener). ``info.returncode`` is None."""


class ManagedProcess:
    """One started child of a :class:`~pdctl.runtime.plan.ProcessSpec` (start it with :meth:`start`)."""

    def __init__(
        self,
        spec: ProcessSpec,
        log_dir: Path,
        sink: Callable[[LogLine], None] | None = None,
        *,
        env_base: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.log_path = Path(log_dir) / f"{spec.name}.log"
        self._sink = sink
        self._env_base = env_base
        self._popen: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._log_fh: IO[bytes] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._dead_end: Diagnosis | None = None
        self._dead_end_at = 0.0
        self._known: dict[int, psutil.Process] = {}
        self.pid = 0
        self.pgid = 0
        self.create_time = 0.0
        self.started_mono = 0.0
        self.started_wall = 0.0

    # ---------------------------------------------------------------------------------------- start

    def start(self) -> None:
        """Spawn the child (raises :class:`LaunchError` when the program cannot be executed)."""
        self._write_files()
        self._fresh_ipc_dir()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_fh = self.log_path.open("ab")
        self._tail.clear()
        self._dead_end = None
        try:
            with _thread_affinity(self.spec.cpu_ids, self.name):
                self._popen = subprocess.Popen(
                    list(self.spec.argv),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=child_env(self.spec, self._env_base),
                    start_new_session=True,
                    close_fds=True,
                )
        except OSError as exc:
            self._log_fh.close()
            raise LaunchError(
                f"{self.name}: cannot run {self.spec.argv[0]!r}: {exc.strerror}",
                hint="check the engine is installed (`pdctl check` shows which vLLM runs; [engine] python "
                "in config.toml names another environment's interpreter)",
            ) from None
        except LaunchError:
            self._log_fh.close()
            raise
        self.pid = self._popen.pid
        self.pgid = self.pid
        self.started_mono = time.monotonic()
        self.started_wall = time.time()
        try:
            ps = psutil.Process(self.pid)
            self.create_time = ps.create_time()
            self._known = {self.pid: ps}
        except psutil.Error:
            self.create_time = 0.0
            self._known = {}
        assert self._popen.stdout is not None
        self._reader = start_reader(self.name, self._popen.stdout, self._sink, self._log_fh, self._keep)

    def _keep(self, line: str) -> None:
        """Each line the child prints, on the reader thread: into the tail, and the first dead end noted."""
        self._tail.append(line)
        if self._dead_end is None and (found := dead_end(line)) is not None:
            self._dead_end_at = time.monotonic()
            self._dead_end = found

    def _write_files(self) -> None:
        for path, text in self.spec.files.items():
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(text, encoding="utf-8")
            except OSError as exc:
                raise LaunchError(
                    f"{self.name}: cannot write {path}: {exc.strerror}",
                    hint="make supervisor.run_dir a writable folder",
                ) from None

    def _fresh_ipc_dir(self) -> None:
        """The spec's ``ipc_dir``, emptied: what an earlier start (or a killed supervisor's run) left goes."""
        if self.spec.ipc_dir is None:
            return
        shutil.rmtree(self.spec.ipc_dir, ignore_errors=True)
        try:
            Path(self.spec.ipc_dir).mkdir(parents=True, mode=0o700)
        except OSError as exc:
            raise LaunchError(
                f"{self.name}: cannot create {self.spec.ipc_dir}: {exc.strerror}",
                hint="make supervisor.run_dir a writable folder",
            ) from None

    def pin_threads(self, *, refresh: bool = True) -> list[tuple[int, int, tuple[int, ...]]]:
        """Move every thread of the tree that runs outside ``spec.cpu_ids`` back onto them.

        vLLM CPU's NIXL worker moves its main thread to the last core of each NUMA node
        (``os.sched_setaffinity`` in nixl/base_worker.py), whichever engine owns that core; affinity set at
        spawn cannot prevent that, so the supervisor calls this every few seconds. A thread already inside
        ``cpu_ids`` (OpenMP threads bound to one core each) is left as it is. Returns ``(pid, tid, old
        cpus)`` of each thread moved. ``refresh=False``: the caller has just recorded the descendants.
        """
        cpus = set(self.spec.cpu_ids)
        if not cpus or not self.alive:
            return []
        if refresh:
            self.refresh_descendants()
        moved: list[tuple[int, int, tuple[int, ...]]] = []
        for proc in self.descendants():
            try:
                tids = [t.id for t in proc.threads()]
            except psutil.Error:
                continue
            for tid in tids:
                try:
                    now = os.sched_getaffinity(tid)
                    if now <= cpus:
                        continue
                    os.sched_setaffinity(tid, (now & cpus) or cpus)
                except OSError:
                    continue  # the thread ended meanwhile
                moved.append((proc.pid, tid, tuple(sorted(now))))
        return moved

    # ------------------------------------------------------------------------------------- queries

    @property
    def started(self) -> bool:
        """Whether :meth:`start` succeeded."""
        return self._popen is not None

    def poll(self) -> int | None:
        """The return code, or None while it runs."""
        return None if self._popen is None else self._popen.poll()

    @property
    def alive(self) -> bool:
        """Started and not exited."""
        return self._popen is not None and self._popen.poll() is None

    def uptime_s(self) -> float:
        """Seconds since start (monotonic)."""
        return time.monotonic() - self.started_mono if self.started_mono else 0.0

    def tail(self) -> tuple[str, ...]:
        """The last lines the child printed (up to 40)."""
        return tuple(self._tail)

    def never_ready(self) -> ExitInfo | None:
        """While the child runs: its report once it printed a line after which it can never become ready
        (:func:`pdctl.vllm.diagnose.dead_end`) and did not exit within ``DEAD_END_GRACE_S``, else None."""
        if self._dead_end is None or time.monotonic() - self._dead_end_at < DEAD_END_GRACE_S or not self.alive:
            return None
        return ExitInfo(self.name, None, self.tail(), self._dead_end, str(self.log_path))

    def exit_info(self) -> ExitInfo:
        """Return code, log tail and diagnosis (waits briefly for the reader to drain the pipe)."""
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        tail = self.tail()
        return ExitInfo(self.name, self.poll(), tail, diagnose(tail), str(self.log_path))

    def is_ready(self, client: httpx.Client) -> bool:
        """One GET of ``ready_url``: True on HTTP 200; a ``tcp://`` one (a ZMQ socket: the KV events relay's) is
        ready once it accepts a connection."""
        if not listening(self.spec.ready_url):
            return False
        if self.spec.ready_url.startswith("tcp://"):
            return True
        try:
            return client.get(self.spec.ready_url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(
        self,
        timeout_s: float,
        *,
        client: httpx.Client | None = None,
        stop: threading.Event | None = None,
        poll_s: float = 0.25,
    ) -> None:
        """Poll ``ready_url`` until 200, checking on every poll that the child is still alive.

        Raises :class:`ProcessExitedError` at once if it exits, :class:`NeverReadyError` once it printed a line
        after which it can never become ready, :class:`LaunchError` at the deadline.
        """
        own = client is None
        http = client or httpx.Client()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.poll() is not None:
                    raise ProcessExitedError(self.exit_info())
                if (stuck := self.never_ready()) is not None:
                    raise NeverReadyError(stuck)
                if self.is_ready(http):
                    return
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"{self.name} did not answer 200 on {self.spec.ready_url} within {timeout_s:g} s",
                        hint=f"see {self.log_path}; raise supervisor.ready_timeout_s for slow model loads",
                    )
                if stop is not None and stop.is_set():
                    raise LaunchError(f"start of {self.name} interrupted")
                time.sleep(poll_s)
        finally:
            if own:
                http.close()

    # ---------------------------------------------------------------------------------------- stop

    def refresh_descendants(self) -> None:
        """Remember every current descendant, so a later sweep finds those that left the group."""
        root = self._known.get(self.pid)
        if root is None or not self.alive:
            return
        try:
            for child in root.children(recursive=True):
                self._known.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def thread_cpu_s(self) -> dict[tuple[int, int], float]:
        """CPU seconds (user + system) of every thread but each process's main thread, in the recorded tree,
        keyed ``(pid, tid)``: what :meth:`idle_threads` compares between two looks."""
        out: dict[tuple[int, int], float] = {}
        for proc in self.descendants():
            try:
                threads = proc.threads()
            except psutil.Error:
                continue
            for t in threads:
                if t.id != proc.pid:
                    out[(proc.pid, t.id)] = t.user_time + t.system_time
        return out

    @staticmethod
    def idle_threads(tids: Iterator[int] | list[int]) -> list[int]:
        """Put each thread at ``SCHED_IDLE`` (it runs only when its core has nothing else to run); returns those
        changed (a thread gone or already there is skipped)."""
        changed = []
        for tid in tids:
            try:
                if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                    continue
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                continue
            changed.append(tid)
        return changed

    def parent_pids(self) -> dict[int, int]:
        """``{pid: its parent's pid}`` of the recorded descendants still running (and the child itself)."""
        out = {}
        for p in self.descendants():
            with contextlib.suppress(psutil.Error):
                out[p.pid] = p.ppid()
        return out

    def known_pids(self) -> set[int]:
        """Pids of the child and every descendant recorded so far."""
        return set(self._known)

    def descendant_records(self) -> list[tuple[int, float]]:
        """``(pid, create_time)`` of the recorded descendants still running (for state.json)."""
        out = []
        for p in self.descendants():
            if p.pid != self.pid:
                with contextlib.suppress(psutil.Error):
                    out.append((p.pid, p.create_time()))
        return out

    def descendants(self) -> list[psutil.Process]:
        """Recorded descendants (and the child itself) that still run."""
        out = []
        for p in self._known.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def send_signal_group(self, sig: signal.Signals) -> None:
        """Signal the child's process group; a group that is gone is not an error."""
        if self.pgid:
            signal_group(self.pgid, sig)

    def begin_stop(self) -> None:
        """SIGTERM to the group (after recording the descendants)."""
        if self._popen is None:
            return
        self.refresh_descendants()
        if self.alive:
            self.send_signal_group(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the child to exit; True if it did."""
        if self._popen is None:
            return True
        try:
            self._popen.wait(timeout=max(0.0, timeout_s))
            return True
        except subprocess.TimeoutExpired:
            return False

    def finish_stop(self) -> list[int]:
        """SIGKILL the group and every recorded descendant still alive; reap; return the pids killed."""
        if self._popen is None:
            return []
        killed: list[int] = []
        if self.alive:
            killed.append(self.pid)
        self.send_signal_group(signal.SIGKILL)
        survivors = self.descendants()
        for p in survivors:
            with contextlib.suppress(psutil.Error):
                p.kill()
                if p.pid not in killed:
                    killed.append(p.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=5.0)
        psutil.wait_procs([p for p in survivors if p.pid != self.pid], timeout=5.0)
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        if self._log_fh is not None:
            with contextlib.suppress(OSError):
                self._log_fh.close()
        if self.spec.ipc_dir is not None:  # the sockets its engine left
            shutil.rmtree(self.spec.ipc_dir, ignore_errors=True)
        return killed

    def stop(self, grace_s: float) -> list[int]:
        """SIGTERM, up to ``grace_s`` of grace, then SIGKILL and the sweep; returns the pids SIGKILLed."""
        self.begin_stop()
        self.wait_exit(grace_s)
        return self.finish_stop()


def listening(url: str) -> bool:
    """Whether anything listens at ``url``'s host and port (``http(s)://`` or ``tcp://``): a bare TCP connect, a
    tenth of the CPU of an HTTP client's refused GET, which shows when a loading engine is polled 10 times a second
    on a machine the engines keep busy (docs/performance.md, "Cutting pdctl's own share")."""
    try:
        where = parse_endpoint(url.replace("tcp://", "http://", 1))
        with socket.create_connection(where, timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _thread_affinity(cpu_ids: tuple[int, ...], name: str) -> Iterator[None]:
    """Run the block with the calling thread bound to ``cpu_ids``: a child forked there inherits the mask
    from its first instruction, before it starts any thread (no ``preexec_fn``, which is unsafe with threads)."""
    if not cpu_ids:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpu_ids)
    except OSError as exc:
        raise LaunchError(
            f"{name}: cannot bind to cpu_ids {list(cpu_ids)}: {exc.strerror} (this machine allows {sorted(before)})",
            hint="use core numbers from `nproc`/`taskset -p $$` in cpu_ids",
        ) from None
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
