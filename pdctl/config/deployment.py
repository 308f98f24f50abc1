"""The :class:`Deployment`: everything read from both files, frozen; what the rest of pdctl takes.

:data:`DECLARED_SECTIONS` names every table of both files with the dataclass declaring its keys.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdctl.config.lines import SourceMap
from pdctl.config.settings import SETTINGS_SECTIONS, GatewayConfig, LoggingConfig, RoutingConfig, Settings, SLOConfig
from pdctl.config.workers import (
    CONFIG_SECTIONS,
    ClusterConfig,
    ConnectorConfig,
    EngineConfig,
    KVTransferConfig,
    SimConfig,
    SupervisorConfig,
    WorkerConfig,
)

#: Every table of both files, by name (the two files share no table name).
DECLARED_SECTIONS: dict[str, type] = CONFIG_SECTIONS | SETTINGS_SECTIONS


@dataclass(frozen=True, slots=True)
class Deployment:
    """Everything pdctl knows about one deployment, read from ``config.toml`` and ``settings.json``."""

    config_path: str
    settings_path: str
    cluster: ClusterConfig
    kv_transfer: KVTransferConfig
    connector: ConnectorConfig
    prefill: tuple[WorkerConfig, ...]
    decode: tuple[WorkerConfig, ...]
    gateway: GatewayConfig
    routing: RoutingConfig
    slo: SLOConfig
    logging: LoggingConfig
    supervisor: SupervisorConfig
    sim: SimConfig
    sources: SourceMap = field(compare=False, repr=False)
    engine: EngineConfig = field(default_factory=EngineConfig)
    config_keys: tuple[str, ...] = ()
    settings_keys: tuple[str, ...] = ()

    @property
    def settings(self) -> Settings:
        """The settings.json part."""
        return Settings(self.gateway, self.routing, self.slo, self.logging)

    @property
    def workers(self) -> tuple[WorkerConfig, ...]:
        """Prefill instances then decode instances (start order)."""
        return self.prefill + self.decode

    def connector_for(self, worker: WorkerConfig) -> str:
        """The connector a worker is launched with."""
        return worker.kv_connector or self.connector.kv_connector

    @property
    def run_dir(self) -> Path:
        """The run directory (relative paths are relative to config.toml's folder)."""
        path = Path(self.supervisor.run_dir)
        return path if path.is_absolute() else Path(self.config_path).parent / path

    def resolve_path(self, value: str) -> str:
        """A path from the config, made absolute relative to config.toml's folder."""
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else (Path(self.config_path).parent / path).resolve())

    @property
    def engine_python(self) -> str:
        """The interpreter that runs vLLM: ``[engine] python`` (relative to config.toml), else pdctl's own."""
        if not self.engine.python:
            return sys.executable
        # Not resolved: a venv's bin/python is a symlink, and following it would leave the venv.
        path = Path(self.engine.python).expanduser()
        return str(path if path.is_absolute() else Path(self.config_path).parent / path)
