"""CLI commands (placeholder until this group lands)."""

from __future__ import annotations

from pdctl.cli._app import app  # noqa: F401
