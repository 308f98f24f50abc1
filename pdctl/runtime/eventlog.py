"""The supervisor's event log, ``logs/pdctl.log``: the line format and its reader, side by side.

The supervisor (:mod:`pdctl.runtime.daemon`) writes one :func:`format_event` line per event; ``pdctl up -d`` reads
them back while it waits (:class:`EventTail`, :func:`event_message`). ISO time first, so ``pdctl logs
--since`` reads these lines as it reads vLLM's. Standard library only: ``up -d`` imports it before anything
has started.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

__all__ = ["EVENT_LOG", "EventTail", "event_message", "format_event"]

EVENT_LOG = "pdctl.log"

_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \S+\s+(.*)$")


def format_event(ts: float, kind: str, message: str) -> str:
    """One line: ``2026-12-01 12:00:00.123 ready    message``."""
    stamp = datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="milliseconds")
    return f"{stamp} {kind:<8} {message}"


def event_message(line: str) -> str:
    """The message of a :func:`format_event` line (a line of another shape comes back whole)."""
    m = _LINE.match(line)
    return m.group(1) if m else line


class EventTail:
    """The messages of the complete lines appended to an event log since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_messages(self) -> list[str]:
        """Messages of the new complete lines (none while the file does not exist yet)."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [event_message(raw.decode("utf-8", errors="replace")) for raw in data[:end].splitlines()]
