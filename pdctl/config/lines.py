"""Where a dotted key stands in the text of a file: best-effort line numbers for errors and findings.

:class:`SourceMap` holds the texts of the files read (TOML or JSON) and answers :meth:`SourceMap.line` for a key
such as ``decode[1].model`` or ``gateway.rate_limit.max_concurrency``; :meth:`SourceMap.error` makes the
:class:`~pdctl.errors.ConfigError` located there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from pdctl.errors import ConfigError


class SourceMap:
    """Best-effort line numbers of dotted keys in the two source files."""

    def __init__(self, texts: Mapping[str, str], kinds: Mapping[str, str]) -> None:
        # Keyed by resolved path: the loader names files as given, Deployment.config_path is absolute.
        self._texts = {_norm(f): t for f, t in texts.items()}
        self._kinds = {_norm(f): k for f, k in kinds.items()}
        self._cache: dict[tuple[str, str], int | None] = {}

    def line(self, file: str, key: str) -> int | None:
        """Line (1-based) where ``key`` (dotted, list indices as ``[i]``) is set in ``file``."""
        cached = self._cache.get((file, key), -1)
        if cached != -1:
            return cached
        text = self._texts.get(_norm(file))
        found: int | None = None
        if text is not None:
            kind = self._kinds.get(_norm(file), "toml")
            found = _toml_line(text, key) if kind == "toml" else _json_line(text, key)
        self._cache[(file, key)] = found
        return found

    def error(self, file: str, key: str, message: str, hint: str | None = None) -> ConfigError:
        """A :class:`ConfigError` located at ``key`` in ``file``."""
        return ConfigError(Path(file).name, key, message, line=self.line(file, key), hint=hint)


def _norm(file: str) -> str:
    return str(Path(file).resolve())


def _toml_line(text: str, key: str) -> int | None:
    parts = [p for p in re.split(r"\.(?![^\[]*\])", key) if p]
    if not parts:
        return None
    lines = text.splitlines()
    # Arrays of tables: prefill[1].model -> the second [[prefill]] header.
    head = parts[0]
    m = re.fullmatch(r"([\w-]+)\[(\d+)\]", head)
    table, nth = (m.group(1), int(m.group(2))) if m else (head, 0)
    header_re = re.compile(r"^\s*\[\[?\s*" + re.escape(table) + r"\s*\]\]?\s*(#.*)?$")
    seen = -1
    start: int | None = None
    for i, line in enumerate(lines):
        if header_re.match(line):
            seen += 1
            if seen == nth:
                start = i
                break
    if start is None:
        for i, line in enumerate(lines):
            if re.match(r"^\s*" + re.escape(table) + r"\s*=", line):
                return i + 1
        return None
    if len(parts) == 1:
        return start + 1
    leaf = parts[1].split("[")[0]
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if re.match(r"^\s*\[", line):
            break
        if re.match(r"^\s*\"?" + re.escape(leaf) + r"\"?\s*=", line):
            return i + 1
    return start + 1


def _json_line(text: str, key: str) -> int | None:
    pos = 0
    line_found: int | None = None
    for part in [p for p in key.split(".") if p]:
        name = part.split("[")[0]
        idx = text.find(f'"{name}"', pos)
        if idx < 0:
            return line_found
        pos = idx + len(name) + 2
        line_found = text.count("\n", 0, idx) + 1
    return line_found
