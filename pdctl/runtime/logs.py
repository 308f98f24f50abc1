"""Output of several processes: reader threads, one queue, one printer, and the per-process log files.

* :class:`LogLine`       -- one line of one process (name, text, time)
* :func:`start_reader`   -- a thread copying a child's pipe into its log file and a sink (e.g. a queue)
* :class:`Printer`       -- ``HH:MM:SS name | text``, a colour per process on a TTY (never with NO_COLOR)
* :func:`read_logs`      -- ``pdctl logs``: the run directory's files merged by time, filtered
* :func:`follow_logs`    -- ``pdctl logs -f``: new lines as they are written

The printer writes plain text with ANSI colour codes, never rich markup, so vLLM's ``[file.py:12]`` and
a model's ``[bold]`` come out exactly as printed.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import IO, Any, TextIO

__all__ = [
    "LogLine",
    "Printer",
    "follow_logs",
    "line_time",
    "read_logs",
    "start_reader",
    "use_colour",
]

PDCTL_NAME = "pdctl"
_PALETTE = ("36", "33", "32", "35", "34", "91", "96", "93", "92", "95")


@dataclass(frozen=True, slots=True)
class LogLine:
    """One line printed by one process (``ts`` is a Unix time; the text has no trailing newline)."""

    name: str
    text: str
    ts: float

    def to_json(self) -> dict[str, Any]:
        """The ``logs --json`` shape."""
        return {"time": _iso(self.ts), "process": self.name, "line": self.text}


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts).isoformat(timespec="milliseconds") if ts > 0 else ""


def start_reader(
    name: str,
    stream: IO[bytes],
    sink: Callable[[LogLine], None] | None,
    log_file: IO[bytes] | None,
    keep: Callable[[str], None] | None = None,
) -> threading.Thread:
    """Copy ``stream`` line by line into ``log_file`` (raw bytes) and ``sink`` until EOF, on a daemon thread.

    ``keep`` also receives each decoded line (a process keeps its tail for crash reports).
    """

    def run() -> None:
        try:
            for raw in iter(stream.readline, b""):
                if log_file is not None:
                    try:
                        log_file.write(raw)
                        log_file.flush()
                    except (OSError, ValueError):
                        pass
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if keep is not None:
                    keep(text)
                if sink is not None:
                    sink(LogLine(name, text, time.time()))
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    thread = threading.Thread(target=run, name=f"pdctl-reader-{name}", daemon=True)
    thread.start()
    return thread


def use_colour(out: TextIO) -> bool:
    """Colour only on a terminal, and never when ``NO_COLOR`` is set (https://no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


class Printer:
    """Writes :class:`LogLine` s as ``HH:MM:SS name | text``; names padded to the widest; one writer."""

    def __init__(self, out: TextIO, names: Sequence[str], colour: bool | None = None) -> None:
        self.out = out
        self.colour = use_colour(out) if colour is None else colour
        self.width = max([len(n) for n in [*names, PDCTL_NAME]])
        self._colours = {n: _PALETTE[i % len(_PALETTE)] for i, n in enumerate(names)}
        self._lock = threading.Lock()

    def format(self, line: LogLine) -> str:
        """The printed form of one line (with ANSI codes when colour is on)."""
        stamp = time.strftime("%H:%M:%S", time.localtime(line.ts))
        prefix = f"{stamp} {line.name.ljust(self.width)} | "
        if self.colour:
            code = "2" if line.name == PDCTL_NAME else self._colours.get(line.name, "37")
            prefix = f"\x1b[{code}m{prefix}\x1b[0m"
        return prefix + line.text

    def write(self, line: LogLine) -> None:
        """Print one line."""
        with self._lock:
            try:
                self.out.write(self.format(line) + "\n")
                self.out.flush()
            except (BrokenPipeError, ValueError):
                pass


# ------------------------------------------------------------------------------------------ files

_VLLM_TIME = re.compile(r"\b(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\b")
_ISO_TIME = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:[.,](\d+))?")
_CLOCK_TIME = re.compile(r"^(\d{2}):(\d{2}):(\d{2})(?:[.,](\d+))?\b")


def line_time(text: str, day: date | None = None) -> float | None:
    """The Unix time a log line carries: ISO ``YYYY-MM-DD HH:MM:SS``, vLLM's ``MM-DD HH:MM:SS``, or a
    leading ``HH:MM:SS`` (the gateway's); ``day`` supplies what the line leaves out (default: today)."""
    day = day or date.today()
    year = day.year
    m = _ISO_TIME.search(text)
    try:
        if m:
            y, mo, d, h, mi, s = (int(x) for x in m.groups()[:6])
            frac = float("0." + m.group(7)) if m.group(7) else 0.0
            return datetime(y, mo, d, h, mi, s).timestamp() + frac
        m = _VLLM_TIME.search(text)
        if m:
            mo, d, h, mi, s = (int(x) for x in m.groups()[:5])
            frac = float("0." + m.group(6)) if m.group(6) else 0.0
            return datetime(year, mo, d, h, mi, s).timestamp() + frac
        m = _CLOCK_TIME.match(text)
        if m:
            h, mi, s = (int(x) for x in m.groups()[:3])
            frac = float("0." + m.group(4)) if m.group(4) else 0.0
            return datetime(day.year, day.month, day.day, h, mi, s).timestamp() + frac
    except ValueError:
        return None
    return None


def _file_lines(name: str, path: Path) -> list[LogLine]:
    try:
        data = path.read_bytes()
    except OSError:
        return []
    try:
        day: date | None = datetime.fromtimestamp(path.stat().st_mtime).date()
    except OSError:
        day = None
    out: list[LogLine] = []
    last = 0.0
    for raw in data.splitlines():
        text = raw.decode("utf-8", errors="replace")
        ts = line_time(text, day)
        if ts is not None:
            last = ts
        out.append(LogLine(name, text, last))
    return out


def read_logs(
    files: Mapping[str, Path],
    *,
    since: float | None = None,
    request_id: str | None = None,
    tail: int | None = None,
) -> list[LogLine]:
    """Lines of the given files (name -> path), merged by the time each line carries.

    A line without a time of its own takes the time of the line before it in the same file. ``since`` keeps
    lines at or after that Unix time; ``request_id`` keeps lines mentioning it (vLLM turns an
    ``X-Request-Id`` into ``cmpl-<id>-0-...``, so a substring match follows one request through the
    gateway, prefill and decode logs); ``tail`` keeps the last N lines.
    """
    merged: list[LogLine] = []
    for name, path in files.items():
        merged.extend(_file_lines(name, path))
    # sorted() is stable: lines of one file with equal times keep their order.
    merged.sort(key=lambda ln: ln.ts)
    if since is not None:
        merged = [ln for ln in merged if ln.ts >= since]
    if request_id:
        merged = [ln for ln in merged if request_id in ln.text]
    if tail is not None:
        merged = merged[-tail:] if tail > 0 else []
    return merged


def follow_logs(
    files: Mapping[str, Path],
    *,
    stop: threading.Event | None = None,
    poll_s: float = 0.25,
    from_end: bool = True,
) -> Iterator[LogLine]:
    """New lines appended to the files (``tail -f`` over several files), until ``stop`` is set."""
    offsets: dict[str, int] = {}
    partial: dict[str, bytes] = {}
    for name, path in files.items():
        try:
            offsets[name] = path.stat().st_size if from_end else 0
        except OSError:
            offsets[name] = 0
    while stop is None or not stop.is_set():
        got = False
        for name, path in files.items():
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size < offsets[name]:  # truncated or replaced
                offsets[name], partial[name] = 0, b""
            if size == offsets[name]:
                continue
            with path.open("rb") as fh:
                fh.seek(offsets[name])
                chunk = fh.read(size - offsets[name])
            offsets[name] += len(chunk)
            data = partial.get(name, b"") + chunk
            *complete, rest = data.split(b"\n")
            partial[name] = rest
            for raw in complete:
                got = True
                yield LogLine(name, raw.decode("utf-8", errors="replace").rstrip("\r"), time.time())
        if not got:
            if stop is not None:
                stop.wait(poll_s)
            else:
                time.sleep(poll_s)
