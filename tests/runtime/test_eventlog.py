"""pdctl.runtime.eventlog: the supervisor's event lines as written and as read back by `up -d`."""

from __future__ import annotations

import time
from pathlib import Path

from pdctl.runtime.eventlog import EventTail, event_message, format_event


def test_a_formatted_line_reads_back_as_its_message() -> None:
    line = format_event(time.time(), "ready", "all processes are ready: gateway  x")
    assert event_message(line) == "all processes are ready: gateway  x"
    assert event_message("a line of another shape") == "a line of another shape"


def test_tail_returns_complete_lines_once(tmp_path: Path) -> None:
    path = tmp_path / "pdctl.log"
    tail = EventTail(path)
    assert tail.new_messages() == []  # not written yet
    with path.open("a", encoding="utf-8") as fh:
        fh.write(format_event(1.0, "start", "one") + "\n" + format_event(2.0, "start", "tw"))
    assert tail.new_messages() == ["one"]
    with path.open("a", encoding="utf-8") as fh:
        fh.write("o\n")
    assert tail.new_messages() == ["two"]
    assert tail.new_messages() == []
