"""What verify returns: one :class:`CheckResult` per named check, and the :class:`VerifyReport` verdict."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckResult", "Timer", "VerifyReport"]


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One named check: ``ok`` True (passed), False (failed) or None (skipped), with a likely cause."""

    name: str
    ok: bool | None
    detail: str
    duration_ms: float = 0.0
    cause: str | None = None
    next_step: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` shape of one check."""
        out: dict[str, Any] = {
            "name": self.name,
            "ok": self.ok,
            "detail": self.detail,
            "duration_ms": round(self.duration_ms, 1),
        }
        if self.cause:
            out["cause"] = self.cause
        if self.next_step:
            out["next_step"] = self.next_step
        if self.data:
            out["data"] = dict(self.data)
        return out


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """All checks; ``ok`` when none failed; ``reachable`` False when nothing of the deployment answered."""

    checks: tuple[CheckResult, ...]
    reachable: bool = True

    @property
    def ok(self) -> bool:
        """No check failed (skipped checks do not count) and the deployment was reachable."""
        return self.reachable and all(c.ok is not False for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0 all passed, 1 a check failed, 2 the deployment could not be reached."""
        if not self.reachable:
            return 2
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, Any]:
        """``{"ok": bool, "checks": [{"name", "ok", "detail", "duration_ms", ...}]}``."""
        return {"ok": self.ok, "checks": [c.to_json() for c in self.checks]}


class Timer:
    """Milliseconds since construction (a check's ``duration_ms``)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def ms(self) -> float:
        """Elapsed milliseconds."""
        return (time.perf_counter() - self.start) * 1000.0
