"""One deployment run: run directory, watchdog, supervisor, warm-up, state.json. Foreground or detached.

``pdctl up`` uses :class:`Runner` in its own process (foreground) or starts ``python -m pdctl.cli.daemon -c
CONFIG -s SETTINGS`` in a new session (``up -d``) and waits for state.json to say ``ready`` or ``failed``.
A start that fails is reported with what the caller's ``explain`` makes of it (the CLI's: ``check``'s PD018
finding for a port taken after ``check`` ran).
In both cases the process running the :class:`Runner` is "the supervisor" that ``pdctl down`` signals:
SIGTERM (or SIGINT) stops everything in order; a second one skips the grace periods.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TextIO

import psutil

from pdctl.config import Deployment
from pdctl.errors import LaunchError, PdctlError
from pdctl.runtime.eventlog import EVENT_LOG, format_event
from pdctl.runtime.logs import LogLine
from pdctl.runtime.plan import Plan, build_plan
from pdctl.runtime.probe import ProbeAttempt, run_warmup
from pdctl.runtime.rundir import RunState, ensure_not_running, prepare_run_dir, write_state
from pdctl.runtime.supervisor import Event, Supervisor, SupervisorOptions
from pdctl.runtime.watchdog import Watchdog

__all__ = ["EVENT_LOG", "Runner", "ensure_not_running", "error_text", "prepare_run_dir"]

STATE_EVERY_S = 1.0


class Runner:
    """Start, supervise and stop one deployment, recording it in the run directory."""

    def __init__(
        self,
        dep: Deployment,
        plan: Plan | None = None,
        *,
        detached: bool = False,
        on_line: Callable[[LogLine], None] | None = None,
        on_event: Callable[[Event], None] | None = None,
        remote: Sequence[tuple[str, str]] = (),
        explain: Callable[[BaseException], LaunchError | None] | None = None,
    ) -> None:
        """``explain``: a failed start's error, explained (None: reported as it is)."""
        self.dep = dep
        self._explain = explain
        self.plan = plan if plan is not None else build_plan(dep)
        self.run_dir = dep.run_dir
        self.log_dir = self.run_dir / "logs"
        self._on_event = on_event
        self._lock = threading.Lock()
        self._event_fh: TextIO | None = None
        self._last_write = 0.0
        me = psutil.Process()
        self.state = RunState(
            run_dir=str(self.run_dir),
            config_path=dep.config_path,
            settings_path=dep.settings_path,
            supervisor_pid=me.pid,
            supervisor_create_time=me.create_time(),
            supervisor_argv=me.cmdline(),
            detached=detached,
            gateway_url=dep.gateway.url,
            api_key_env=dep.gateway.api_key_env,
            started_at=time.time(),
        )
        self.watchdog = Watchdog()
        warmup = self._warmup if dep.supervisor.warmup and dep.prefill and dep.decode else None
        self.supervisor = Supervisor(
            self.plan,
            SupervisorOptions.from_config(dep.supervisor, dep.gateway.drain_timeout_s),
            self.log_dir,
            on_event=self._event,
            on_line=on_line,
            warmup=warmup,
            rewarm=self._rewarm if warmup is not None else None,
            watchdog=self.watchdog,
            remote=remote,
        )

    # ------------------------------------------------------------------------------------------ io

    def _event(self, ev: Event) -> None:
        with self._lock:
            if self._event_fh is None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                self._event_fh = (self.log_dir / EVENT_LOG).open("a", encoding="utf-8")
            self._event_fh.write(format_event(ev.ts, ev.kind, ev.message) + "\n")
            self._event_fh.flush()
        if self._on_event is not None:
            self._on_event(ev)
        self.write_state()

    def _warmup(self) -> None:
        def attempt(pair: str, a: ProbeAttempt) -> None:
            result = "passed" if a.error is None else f"failed: {a.error}"
            self._event(Event("warmup", "pdctl", f"warm-up {pair} request {a.request_id} {result}"))

        run_warmup(self.dep, on_attempt=attempt)

    def _rewarm(self, name: str) -> None:
        def attempt(pair: str, a: ProbeAttempt) -> None:
            result = "passed" if a.error is None else f"failed: {a.error}"
            self._event(Event("warmup", "pdctl", f"re-warm-up {pair} request {a.request_id} {result}"))

        for res in run_warmup(self.dep, on_attempt=attempt, only=name, raise_on_failure=False):
            if not res.ok:
                self._event(Event("warmup", "pdctl", f"re-warm-up after restarting {name} failed: {res.error}"))

    def write_state(self, status: str | None = None, error: str | None = None) -> None:
        """Record the current processes (and optionally a new status / error) in state.json."""
        with self._lock:
            if status is not None:
                self.state.status = status
            if error is not None:
                self.state.error = error
            self.state.watchdog_pid = self.watchdog.pid
            self.state.processes = self.supervisor.snapshot()
            write_state(self.run_dir, self.state)
            self._last_write = time.monotonic()

    def _tick(self) -> None:
        if time.monotonic() - self._last_write >= STATE_EVERY_S:
            self.write_state()

    # ---------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start everything and wait until ready (raises :class:`LaunchError`; nothing is left running)."""
        self.write_state("starting")
        self.watchdog.start()
        try:
            self.supervisor.start()
        except BaseException as exc:
            taken = self._explain(exc) if self._explain is not None else None
            self.write_state("failed", error=error_text(taken or exc))
            self._close()
            if taken is not None:
                raise taken from None
            raise
        self.write_state("ready")

    def serve(self) -> str | None:
        """Supervise until asked to stop (None) or until the deployment fails (the reason)."""
        return self.supervisor.run(tick=self._tick)

    def stop(self, reason: str | None = None) -> None:
        """Stop everything in order (skip the grace periods once ``force_event`` is set)."""
        self.write_state("stopping", error=reason)
        self.supervisor.shutdown(force=self.supervisor.force_event.is_set())
        self.write_state("failed" if reason else "stopped")
        self._close()

    def _close(self) -> None:
        with self._lock:
            if self._event_fh is not None:
                self._event_fh.close()
                self._event_fh = None

    def request_stop(self) -> bool:
        """First call: graceful stop (True); later calls: force (False)."""
        if self.supervisor.stop_event.is_set():
            self.supervisor.force_event.set()
            return False
        self.supervisor.stop_event.set()
        return True


def error_text(exc: BaseException) -> str:
    """A failure as state.json and the detached supervisor's stderr say it: the message and its hint."""
    if isinstance(exc, PdctlError):
        return str(exc) + (f"\nhint: {exc.hint}" if exc.hint else "")
    return f"{type(exc).__name__}: {exc}"
