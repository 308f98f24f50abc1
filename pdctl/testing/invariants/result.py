"""What every invariant check returns: one :class:`InvariantResult` each, collected in an :class:`InvariantReport`.

:func:`verdict` turns a check's list of problems into its result (the first few in the detail), or an ok one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["InvariantReport", "InvariantResult", "verdict"]


@dataclass(frozen=True, slots=True)
class InvariantReport:
    """The verdicts of one check run, in order."""

    results: tuple[InvariantResult, ...]

    @property
    def ok(self) -> bool:
        """True when no invariant failed (skipped ones do not fail)."""
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> tuple[InvariantResult, ...]:
        """The invariants that failed."""
        return tuple(r for r in self.results if not r.ok)

    def get(self, name: str) -> InvariantResult:
        """The result called ``name`` (KeyError if it was not checked)."""
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def render(self) -> str:
        """One line per invariant: ``N1 ok   detail``."""
        return "\n".join(
            f"{r.name} {'skip' if r.skipped else 'ok  ' if r.ok else 'FAIL'} {r.detail}" for r in self.results
        )

    def to_json(self) -> list[dict[str, Any]]:
        """Plain dicts."""
        return [asdict(r) for r in self.results]


@dataclass(frozen=True, slots=True)
class InvariantResult:
    """One invariant's verdict; ``detail`` says what was measured (or what broke)."""

    name: str
    ok: bool
    detail: str
    skipped: bool = False


# A failed result's detail names this many of its problems, then counts the rest.
PROBLEMS_SHOWN = 8


def verdict(name: str, problems: Sequence[str], ok_detail: str) -> InvariantResult:
    """``name`` failed with ``problems`` (the first :data:`PROBLEMS_SHOWN` in the detail), or passed: ``ok_detail``."""
    if problems:
        n = PROBLEMS_SHOWN
        shown = "; ".join(problems[:n]) + (f"; ... {len(problems) - n} more" if len(problems) > n else "")
        return InvariantResult(name, False, shown)
    return InvariantResult(name, True, ok_detail)
