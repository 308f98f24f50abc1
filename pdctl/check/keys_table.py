"""Where each configuration key ends up (:func:`describe_key`, a :class:`KeyUse`), read from the keys' declaration
in :mod:`pdctl.config`: the table behind ``pdctl check``'s key coverage and docs/config.md's tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pdctl.config import DECLARED_SECTIONS, WorkerConfig, file_keys


@dataclass(frozen=True, slots=True)
class KeyUse:
    """Where a configuration key ends up."""

    kind: Literal["argv", "env", "gateway", "supervisor", "check", "not_applicable"]
    detail: str


def _plain(doc: str) -> str:
    """A docs cell (docs/config.md) as plain text."""
    return doc.removeprefix("*extension*: ").replace("`", "")


_WORKER_KEY_USE: dict[str, KeyUse] = {
    name: KeyUse(spec.use, _plain(spec.doc)) for name, spec in file_keys(WorkerConfig).items()
}
_SECTION_KEY_USE: dict[str, KeyUse] = {
    f"{table}.{name}": KeyUse(spec.use, _plain(spec.doc))
    for table, cls in DECLARED_SECTIONS.items()
    for name, spec in file_keys(cls).items()
}


def describe_key(key: str) -> KeyUse:
    """Where ``key`` (a dotted key of either file) ends up; every known key has an answer."""
    if key in _SECTION_KEY_USE:
        return _SECTION_KEY_USE[key]
    head, _, leaf = key.partition(".")
    if re.fullmatch(r"(prefill|decode)(\[\d+\])?", head) and leaf.split(".")[0] in _WORKER_KEY_USE:
        return _WORKER_KEY_USE[leaf.split(".")[0]]
    return KeyUse("not_applicable", "pdctl does not use this key")
