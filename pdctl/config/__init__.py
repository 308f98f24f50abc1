"""config.toml + settings.json -> one frozen :class:`Deployment`.

This package reads the two files and nothing else. Every error is a :class:`ConfigError` naming the
file, the line (best effort) and the dotted key, what was expected and what was found. Unknown keys
are errors with a did-you-mean hint. Cross-file consistency (connectors, models, ports) is the job of
:mod:`pdctl.check`, which reports findings instead of raising, so a user sees all of them at once.

Data flow::

    config.toml, settings.json --loader.read_toml/read_json--> dicts
        --loader, per table: each key checked as schema declares it; lines locates errors-->
        workers.* (config.toml's tables) + settings.* (settings.json's objects) --> deployment.Deployment

Modules:

- :mod:`~pdctl.config.schema`: how a key is declared (:class:`Key`, :func:`key`, :func:`section`), read back
  (:func:`keys_of`, :func:`sections_of`, :func:`file_keys`) and checked (``as_int``, ``as_str``, ...;
  :func:`parse_endpoint`, :func:`parse_listen`).
- :mod:`~pdctl.config.workers`: config.toml's tables (:class:`WorkerConfig` and the rest, ``CONFIG_SECTIONS``,
  ``WORKER_KEYS``, :func:`instance_name`).
- :mod:`~pdctl.config.settings`: settings.json's objects (:class:`GatewayConfig` and the rest, :class:`Settings`,
  ``SETTINGS_SECTIONS``).
- :mod:`~pdctl.config.deployment`: :class:`Deployment`, both files together; ``DECLARED_SECTIONS``.
- :mod:`~pdctl.config.lines`: :class:`SourceMap`, the line of a dotted key in a TOML or JSON text.
- :mod:`~pdctl.config.loader`: :func:`read_toml`, :func:`read_json`, :func:`load`, :func:`load_settings`.
- :mod:`~pdctl.config.templates` (``pdctl init``'s files) and :mod:`~pdctl.config.recipe` (the recipe's two
  test requests) stand beside the flow.

Callers import from here (``from pdctl.config import load``); the names below are the package's surface.
"""

from __future__ import annotations

from pdctl.config.deployment import DECLARED_SECTIONS, Deployment
from pdctl.config.lines import SourceMap
from pdctl.config.loader import DEFAULT_CONFIG, DEFAULT_SETTINGS, load, load_settings, read_json, read_toml
from pdctl.config.schema import (
    Key,
    KeyKind,
    file_keys,
    key,
    keys_of,
    parse_endpoint,
    parse_listen,
    section,
    sections_of,
)
from pdctl.config.settings import (
    SETTINGS_SECTIONS,
    Fallback,
    GatewayConfig,
    LoggingConfig,
    RateLimitConfig,
    RoutingConfig,
    Settings,
    SLOConfig,
    Strategy,
)
from pdctl.config.workers import (
    CONFIG_SECTIONS,
    NIXL_SIDE_CHANNEL_BASE,
    WORKER_KEYS,
    ClusterConfig,
    ConnectorConfig,
    Engine,
    EngineConfig,
    KVTransferConfig,
    RestartPolicy,
    Role,
    SimConfig,
    SupervisorConfig,
    WorkerConfig,
    instance_name,
)
from pdctl.errors import ConfigError

__all__ = [
    "CONFIG_SECTIONS",
    "DECLARED_SECTIONS",
    "DEFAULT_CONFIG",
    "DEFAULT_SETTINGS",
    "NIXL_SIDE_CHANNEL_BASE",
    "SETTINGS_SECTIONS",
    "WORKER_KEYS",
    "ClusterConfig",
    "ConfigError",
    "ConnectorConfig",
    "Deployment",
    "Engine",
    "EngineConfig",
    "Fallback",
    "GatewayConfig",
    "KVTransferConfig",
    "Key",
    "KeyKind",
    "LoggingConfig",
    "RateLimitConfig",
    "RestartPolicy",
    "Role",
    "RoutingConfig",
    "SLOConfig",
    "Settings",
    "SimConfig",
    "SourceMap",
    "Strategy",
    "SupervisorConfig",
    "WorkerConfig",
    "file_keys",
    "instance_name",
    "key",
    "keys_of",
    "load",
    "load_settings",
    "parse_endpoint",
    "parse_listen",
    "read_json",
    "read_toml",
    "section",
    "sections_of",
]
