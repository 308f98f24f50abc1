"""N5, no secret exposure: no secret in log files, captured output, response bodies, metrics or ``/proc``.

:func:`check_n5` searches every place it is given plus ``/proc/<pid>/cmdline`` (all, or the ones named) and the
workers' ``/proc/<pid>/environ``; its detail names places, never the secret.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import psutil

from pdctl.testing.invariants.result import InvariantResult, verdict

__all__ = ["check_n5"]


def _proc_bytes(pid: int, what: str) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return None


def check_n5(
    secrets: Sequence[str],
    *,
    files: Iterable[Path] = (),
    texts: Mapping[str, str | bytes] | None = None,
    environ_pids: Iterable[int] = (),
    all_cmdlines: bool = True,
    cmdline_pids: Iterable[int] = (),
    exclude_pids: Iterable[int] = (),
) -> InvariantResult:
    """Search every place a secret could leak; the detail names places, never the secret.

    ``files`` may contain directories (searched recursively). ``environ_pids`` are processes that must not
    carry a secret even in their environment (the workers; the gateway legitimately has the key there).
    With ``all_cmdlines`` every readable ``/proc/*/cmdline`` on the host is searched, except
    ``exclude_pids`` (a test's own fakes, which may be handed a key on purpose).
    """
    needles = [s.encode() for s in secrets if s]
    if not needles:
        return InvariantResult("N5", True, "no secret given", skipped=True)
    problems: list[str] = []
    searched = 0

    def scan(where: str, data: bytes) -> None:
        nonlocal searched
        searched += 1
        for i, n in enumerate(needles, start=1):
            if n in data:
                problems.append(f"secret #{i} in {where}")

    paths: list[Path] = []
    for f in files:
        f = Path(f)
        if f.is_dir():
            paths.extend(p for p in sorted(f.rglob("*")) if p.is_file())
        elif f.is_file():
            paths.append(f)
    for p in paths:
        with contextlib.suppress(OSError):
            scan(str(p), p.read_bytes())
    for name, text in (texts or {}).items():
        scan(name, text.encode("utf-8", "replace") if isinstance(text, str) else text)
    pids = set(cmdline_pids)
    if all_cmdlines:
        pids.update(psutil.pids())
    for pid in sorted(pids - set(exclude_pids)):
        data = _proc_bytes(pid, "cmdline")
        if data is not None:
            scan(f"/proc/{pid}/cmdline", data)
    for pid in environ_pids:
        data = _proc_bytes(pid, "environ")
        if data is not None:
            scan(f"/proc/{pid}/environ", data)
    return verdict("N5", problems, f"{len(needles)} secret(s) absent from {searched} files, texts and /proc entries")
