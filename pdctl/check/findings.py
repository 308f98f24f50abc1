"""Findings and their ways out, and the context every rule reads.

- :class:`Finding`: one result of ``pdctl check`` (code, severity, file, line, key, message, hint), with its
  ways out as data: ``fixes`` (alternative edits of the files: key -> value, ``None`` removes; a key prefixed
  :data:`SETTINGS` is in settings.json) and ``actions`` (:class:`Action`: export, run, stop).
- :func:`finding_from_error`: a load error (``ConfigError``) as finding PD000.
- :class:`Ctx`: what a rule reads (the deployment, ``for_up``, the engine's vLLM, the environment, each
  worker's context length); :meth:`Ctx.at` makes a finding and writes its hint from the fixes and actions.
- :data:`Rule`: a rule's type; :func:`is_local`: whether a ``model`` is a local path (several rules ask).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pdctl.config import Deployment, WorkerConfig
from pdctl.errors import ConfigError
from pdctl.runtime.plan import VllmInstall
from pdctl.vllm.modelinfo import ContextLength

Severity = Literal["error", "warning", "info"]
ActionKind = Literal["export", "run", "stop"]


@dataclass(frozen=True, slots=True)
class Action:
    """A change to the machine rather than to the files: one alternative way out of a finding.

    ``export``: set the environment variable ``subject`` where pdctl runs (its value is the user's: a key);
    ``run``: run the command line ``subject`` (a pdctl command, absolute paths); ``stop``: stop what listens on
    ``subject`` (``host:port``).
    """

    kind: ActionKind
    subject: str

    @property
    def text(self) -> str:
        """The action as a hint says it."""
        if self.kind == "export":
            return f"`export {self.subject}=<key>` in the shell that runs pdctl"
        if self.kind == "run":
            return f"run `{self.subject}`"
        port = self.subject.rpartition(":")[2]
        return (f"stop what listens on {self.subject} (`ss -ltnp 'sport = :{port}'` names it; `pdctl down` if "
                "it is a deployment)")  # fmt: skip

    def to_json(self) -> dict[str, str]:
        """One entry of ``check --json``'s ``actions``."""
        return {"kind": self.kind, "subject": self.subject, "text": self.text}


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of ``pdctl check``."""

    code: str
    severity: Severity
    file: str
    line: int | None
    key: str | None
    message: str
    hint: str | None = None
    #: Alternative fixes, each a set of ``config.toml`` keys (``settings.json:``-prefixed for the other file)
    #: and the values that make the finding go away and the deployment start (the hint is written from them;
    #: a test applies each one and starts it).
    fixes: tuple[Mapping[str, object], ...] = ()
    #: Alternatives that change the machine instead (the hint names them after the fixes).
    actions: tuple[Action, ...] = ()

    @property
    def text(self) -> str:
        """``PD018 config.toml:42: decode.side_channel_port: port 5700 ...``: code, where, key and message."""
        where = self.file + (f":{self.line}" if self.line else "")
        return f"{self.code} {where}: " + (f"{self.key}: " if self.key else "") + self.message

    def to_json(self) -> dict[str, object]:
        """The ``check --json`` shape."""
        return {
            "code": self.code,
            "severity": self.severity,
            "file": self.file,
            "line": self.line,
            "key": self.key,
            "message": self.message,
            "hint": self.hint,
            "fixes": [dict(f) for f in self.fixes],
            "actions": [a.to_json() for a in self.actions],
        }


#: Prefix of a fix key that is in settings.json (the others are config.toml keys).
SETTINGS = "settings.json:"


def _fix_text(fixes: Iterable[Mapping[str, object]]) -> str:
    """``set prefill.max_model_len = 8192 and decode.max_model_len = 8192, or set ...`` (``None``: remove)."""

    def one(key: str, value: object) -> str:
        where = " in settings.json" if key.startswith(SETTINGS) else ""
        key = key.removeprefix(SETTINGS)
        return f"remove {key}{where}" if value is None else f"set {key} = {json.dumps(value)}{where}"

    return ", or ".join(" and ".join(one(k, v) for k, v in fix.items()) for fix in fixes)


def finding_from_error(err: ConfigError) -> Finding:
    """A load error as a finding (code PD000), so ``check`` reports it like the others."""
    return Finding("PD000", "error", err.file, err.line, err.key, err.detail, err.hint)


@dataclass(frozen=True, slots=True)
class Ctx:
    """What the rules read; ``at`` makes a finding about ``key`` of ``file`` ("config" or "settings")."""

    dep: Deployment
    for_up: bool
    vllm: VllmInstall
    env: dict[str, str]
    contexts: Mapping[str, ContextLength]  # per worker name: the model's context length and its source

    def at(
        self, code: str, severity: Severity, file: str, key: str | None, message: str, hint: str | None = None,
        fixes: tuple[Mapping[str, object], ...] = (), actions: tuple[Action, ...] = (),
    ) -> Finding:  # fmt: skip
        path = self.dep.config_path if file == "config" else self.dep.settings_path
        line = self.dep.sources.line(path, key) if key else None
        if fixes or actions:
            ways = ([_fix_text(fixes)] if fixes else []) + [a.text for a in actions]
            hint = ", or ".join(ways) + (f" ({hint})" if hint else "")
        return Finding(code, severity, Path(path).name, line, key, message, hint, fixes, actions)

    def max_model_len(self, w: WorkerConfig) -> int | None:
        """The ``max_model_len`` vLLM will use on ``w``: the configured one, else the model's context length."""
        return w.max_model_len or self.contexts[w.name].tokens


Rule = Callable[[Ctx], Iterable[Finding]]


def is_local(model: str) -> bool:
    """Whether ``model`` names a folder on this machine rather than a model on the hub."""
    return model.startswith((".", "/", "~"))
