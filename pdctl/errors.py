"""pdctl's exceptions.

* PdctlError            -- anything pdctl reports to a user as one message (CLI exit 1)
  + ConfigError         -- a bad config.toml / settings.json (file, line, key); CLI exit 2
  + LaunchError         -- a process failed to start or become ready
  + NotRunningError     -- no deployment found in the run directory
  + EngineMissingError  -- an optional dependency (vLLM, transformers) is not installed
"""

from __future__ import annotations

__all__ = ["ConfigError", "EngineMissingError", "LaunchError", "NotRunningError", "PdctlError"]


class PdctlError(Exception):
    """An error meant for a person: ``str(err)`` is the message, ``hint`` says how to fix it."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class ConfigError(PdctlError):
    """A configuration error located in a file: ``config.toml:14: prefill.max_num_seqs: expected ...``."""

    exit_code = 2

    def __init__(
        self,
        file: str,
        key: str | None,
        message: str,
        line: int | None = None,
        column: int | None = None,
        hint: str | None = None,
    ) -> None:
        self.file = file
        self.key = key
        self.line = line
        self.column = column
        self.detail = message
        where = file if line is None else f"{file}:{line}" + (f":{column}" if column is not None else "")
        text = f"{where}: {key}: {message}" if key else f"{where}: {message}"
        super().__init__(text, hint)


class LaunchError(PdctlError):
    """A process did not start, crashed while starting, or never became ready."""


class NotRunningError(PdctlError):
    """``status`` / ``down`` / ``logs`` found no deployment in the run directory."""


class EngineMissingError(PdctlError):
    """An optional dependency (vLLM CPU, transformers, nixl) is missing."""
