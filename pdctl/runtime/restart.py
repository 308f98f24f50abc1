"""The supervisor's restart rule, as a pure function of a process's run history and the clock.

* :class:`Run` -- one run of a process: when it was started and when it was seen exited
* :class:`RestartDecision` -- restart at a time (after a delay), or give up and why
* :func:`decide_restart` -- policy + history + now -> decision (``start_secs``, ``max_restarts``, the backoff)

:class:`~pdctl.runtime.supervisor.Supervisor` keeps each process's history and acts on the decision; the state
diagram is in its module docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdctl.config import SupervisorConfig

__all__ = ["RestartDecision", "Run", "decide_restart"]


@dataclass(frozen=True, slots=True)
class Run:
    """One run of a process, in the supervisor's clock: when it was started and when it was seen exited."""

    started: float
    ended: float


@dataclass(frozen=True, slots=True)
class RestartDecision:
    """What to do after an exit: restart at ``at`` (after ``delay_s``), or give up (``restart`` False)."""

    restart: bool
    failures: int  # quick failures in a row, this exit included
    delay_s: float = 0.0
    at: float = 0.0
    reason: str = ""


def decide_restart(
    policy: str, history: Sequence[Run], now: float, config: SupervisorConfig, backoff_base_s: float = 1.0
) -> RestartDecision:
    """The restart rule, a pure function of the run ``history`` (oldest first, the run that just ended
    last) and ``now``, under ``[supervisor]``'s ``config``.

    A run shorter than ``start_secs`` is a failure; the trailing failures count. More than
    ``max_restarts`` of them in a row gives up; otherwise the delay doubles from ``backoff_base_s`` with
    each failure, capped at ``backoff_max_s`` (a run that outlived ``start_secs`` restarts after the base
    delay). ``policy = "never"`` always gives up.
    """
    if policy != "on-failure":
        return RestartDecision(False, 0, reason="its restart policy is 'never'")
    failures = 0
    for run in reversed(history):
        if run.ended - run.started >= config.start_secs:
            break
        failures += 1
    if failures > config.max_restarts:
        return RestartDecision(False, failures, reason=(
            f"failed {failures} time(s) in a row, each within start_secs ({config.start_secs:g} s); "
            f"max_restarts = {config.max_restarts} reached"))  # fmt: skip
    delay = min(config.backoff_max_s, backoff_base_s * 2 ** (max(failures, 1) - 1))
    return RestartDecision(True, failures, delay, now + delay)
