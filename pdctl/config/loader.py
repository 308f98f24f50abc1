"""Reading: config.toml and settings.json -> :class:`~pdctl.config.deployment.Deployment` (or settings.json alone).

:func:`read_toml`/:func:`read_json` parse a file (syntax errors with line and column); :func:`load` and
:func:`load_settings` walk its tables through ``_Section`` (typed access that records which keys were read, so
an unknown key is an error with a did-you-mean), checking each key its dataclass declares
(:mod:`pdctl.config.schema`), and build the frozen dataclasses. Every error is a
:class:`~pdctl.errors.ConfigError` located by :class:`~pdctl.config.lines.SourceMap`.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast

import tomlkit
import tomlkit.exceptions

from pdctl.config.deployment import Deployment
from pdctl.config.lines import SourceMap
from pdctl.config.schema import Key, keys_of, parse_endpoint, sections_of
from pdctl.config.settings import SETTINGS_SECTIONS, GatewayConfig, LoggingConfig, RoutingConfig, Settings, SLOConfig
from pdctl.config.workers import (
    CONFIG_SECTIONS,
    NIXL_SIDE_CHANNEL_BASE,
    WORKER_KEYS,
    ClusterConfig,
    ConnectorConfig,
    EngineConfig,
    KVTransferConfig,
    Role,
    SimConfig,
    SupervisorConfig,
    WorkerConfig,
    instance_name,
)
from pdctl.errors import ConfigError

DEFAULT_CONFIG = "config.toml"
DEFAULT_SETTINGS = "settings.json"

T = TypeVar("T")


class _Section:
    """Typed access to one table/object, recording which keys were read."""

    def __init__(self, src: SourceMap, file: str, prefix: str, data: Mapping[str, Any]) -> None:
        self.src, self.file, self.prefix, self.data = src, file, prefix, data
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def err(self, name: str, message: str, hint: str | None = None) -> ConfigError:
        return self.src.error(self.file, self.key(name), message, hint)

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str) -> Any:
        self.used.add(name)
        return self.data.get(name)

    def get(self, name: str, check: Callable[[Any], T | None], expected: str, default: T) -> T:
        if name not in self.data:
            self.used.add(name)
            return default
        value = self.raw(name)
        out = check(value)
        if out is None:
            raise self.err(name, f"expected {expected}, got {_show(value)}")
        return out

    def opt(self, name: str, check: Callable[[Any], T | None], expected: str) -> T | None:
        if name not in self.data:
            self.used.add(name)
            return None
        return self.get(name, check, expected, cast(T, None))

    def sub(self, name: str) -> _Section:
        value = self.raw(name)
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise self.err(name, f"expected a table/object, got {_show(value)}")
        return _Section(self.src, self.file, self.key(name), value)

    def finish(self, allowed: Iterator[str] | list[str] | None = None) -> None:
        known = set(allowed) if allowed is not None else self.used
        for name in self.data:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
                raise self.err(name, "unknown key", hint)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False, default=str)


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; syntax errors become a ConfigError with line and column."""
    text = _read_text(path)
    try:
        return tomlkit.parse(text).unwrap()
    except tomlkit.exceptions.ParseError as exc:
        message = re.sub(r"\s+at line \d+ col \d+$", "", str(exc))
        hint = None
        if path.suffix == ".json" or text.lstrip().startswith("{"):
            # The recipe itself writes `--config settings.json`: say which option takes which file.
            hint = (f"{path.name} is JSON, the gateway/routing file: pass it with -s/--settings "
                    "(-c/--config takes config.toml)")  # fmt: skip
        raise ConfigError(
            path.name, None, f"invalid TOML: {message}", line=exc.line, column=exc.col, hint=hint
        ) from None


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file; syntax errors become a ConfigError with line and column."""
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(path.name, None, f"invalid JSON: {exc.msg}", line=exc.lineno, column=exc.colno) from None
    if not isinstance(data, dict):
        raise ConfigError(path.name, None, "expected a JSON object at the top level", line=1)
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            str(path), None, "file not found", hint="run `pdctl init` to write the recipe's files"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(path.name, None, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(str(path), None, f"cannot read: {exc.strerror}") from None


def _flat_keys(data: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    if isinstance(data, Mapping):
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, Mapping) and k not in ("env", "extra_config", "kv_connector_extra_config"):
                out.extend(_flat_keys(v, key))
            elif isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
                for i, item in enumerate(v):
                    out.extend(_flat_keys(item, f"{key}[{i}]"))
            else:
                out.append(key)
    return out


def load(config_path: str | Path = DEFAULT_CONFIG, settings_path: str | Path = DEFAULT_SETTINGS) -> Deployment:
    """Read and validate both files into a :class:`Deployment` (raises :class:`ConfigError`)."""
    cpath, spath = Path(config_path), Path(settings_path)
    cdata = read_toml(cpath)
    sdata = read_json(spath)
    ctext, stext = _read_text(cpath), _read_text(spath)
    # Keyed by the path as given (load's own errors) and resolved (Deployment.config_path, used by check).
    src = SourceMap(
        {str(cpath): ctext, str(spath): stext, str(cpath.resolve()): ctext, str(spath.resolve()): stext},
        {str(cpath): "toml", str(spath): "json", str(cpath.resolve()): "toml", str(spath.resolve()): "json"},
    )
    cfile, sfile = str(cpath), str(spath)
    top = _Section(src, cfile, "", cdata)
    top.finish(list(CONFIG_SECTIONS))

    settings = _load_settings(src, sfile, sdata)
    gateway, routing = settings.gateway, settings.routing

    cluster = ClusterConfig(**_read_section(top, "cluster", ClusterConfig))
    if cluster.gateway_port is not None and "listen" in sdata.get("gateway", {}):
        if cluster.gateway_port != gateway.listen_port or (
            cluster.gateway_host is not None and cluster.gateway_host != gateway.listen_host
        ):
            raise src.error(
                cfile,
                "cluster.gateway_port",
                f"{cluster.gateway_host}:{cluster.gateway_port} disagrees with gateway.listen "
                f"{gateway.listen_host}:{gateway.listen_port} in {spath.name}",
                hint="make [cluster] gateway_host/gateway_port and gateway.listen name the same address",
            )
    elif cluster.gateway_port is not None:
        gateway = _replace_gateway(gateway, cluster.gateway_host or gateway.listen_host, cluster.gateway_port)

    kv = KVTransferConfig(**_read_section(top, "kv_transfer", KVTransferConfig))

    connector = ConnectorConfig(**_read_section(top, "connector", ConnectorConfig))

    supervisor = SupervisorConfig(**_read_section(top, "supervisor", SupervisorConfig))
    engine = EngineConfig(**_read_section(top, "engine", EngineConfig))
    sim = SimConfig(**_read_section(top, "sim", SimConfig))

    prefill = _load_workers(top, "prefill", routing.prefill_endpoints, sfile, src, 0)
    decode = _load_workers(top, "decode", routing.decode_endpoints, sfile, src, len(prefill))

    return Deployment(
        config_path=str(cpath.resolve()),
        settings_path=str(spath.resolve()),
        cluster=cluster,
        kv_transfer=kv,
        connector=connector,
        prefill=prefill,
        decode=decode,
        gateway=gateway,
        routing=routing,
        slo=settings.slo,
        logging=settings.logging,
        supervisor=supervisor,
        sim=sim,
        engine=engine,
        sources=src,
        config_keys=tuple(_flat_keys(cdata)),
        settings_keys=tuple(_flat_keys(sdata)),
    )


def _declared(cls: type) -> dict[str, tuple[str, Key]]:
    """``cls``'s keys that a file may set: file key -> (field name, declaration)."""
    return {spec.file_key(attr): (attr, spec) for attr, spec in keys_of(cls).items() if spec.in_file}


def _read_keys(section: _Section, cls: type) -> dict[str, Any]:
    """The keys ``cls`` declares that ``section`` sets, checked, by field name; its sub-tables, read whole."""
    values: dict[str, Any] = {}
    for k, (attr, spec) in _declared(cls).items():
        if not section.has(k):
            continue
        value = section.get(k, spec.check, spec.expected, None)
        if spec.beside_file:
            value = _beside(section.file, value)
        values.update(zip(spec.into, value, strict=True) if spec.into else [(attr, value)])
    for attr, sub in sections_of(cls).items():
        values[attr] = sub(**_read_section(section, attr, sub))
    return values


def _finish(section: _Section, cls: type) -> None:
    """A key in ``section`` that ``cls`` does not declare is an error (with a did-you-mean)."""
    section.finish([*_declared(cls), *sections_of(cls)])


def _read_section(top: _Section, name: str, cls: type) -> dict[str, Any]:
    """Table ``name`` read by :func:`_read_keys`; a key ``cls`` does not declare is an error."""
    section = top.sub(name)
    values = _read_keys(section, cls)
    _finish(section, cls)
    return values


def _replace_gateway(g: GatewayConfig, host: str, port: int) -> GatewayConfig:
    return replace(g, listen_host=host, listen_port=port)


def _load_workers(
    top: _Section, role: Role, endpoints: tuple[str, ...], sfile: str, src: SourceMap, side_index: int
) -> tuple[WorkerConfig, ...]:
    raw = top.raw(role)
    if raw is None:
        raise top.err(role, f"missing [{role}] table", hint=f"add a [{role}] table with at least `model = ...`")
    entries: list[tuple[str, Mapping[str, Any]]]
    if isinstance(raw, list):
        if not raw:
            raise top.err(role, f"[[{role}]] needs at least one instance")
        entries = [(f"{role}[{i}]", item) for i, item in enumerate(raw)]
    elif isinstance(raw, Mapping):
        entries = [(role, raw)]
    else:
        raise top.err(role, f"expected a table, got {_show(raw)}")
    if len(entries) != len(endpoints):
        key = f"routing.{role}_endpoint"
        raise src.error(
            sfile,
            key,
            f"{len(entries)} {role} instance(s) in config.toml but {len(endpoints)} endpoint(s) here",
            hint=f"give routing.{role}_endpoint one URL per [[{role}]] instance, in the same order",
        )
    out: list[WorkerConfig] = []
    for i, ((prefix, data), url) in enumerate(zip(entries, endpoints, strict=True)):
        if not isinstance(data, Mapping):
            raise top.err(prefix, f"expected a table, got {_show(data)}")
        w = _Section(top.src, top.file, prefix, data)
        values = _read_keys(w, WorkerConfig)
        declared = values.pop("role", None)
        if declared is not None and declared != role:
            raise w.err("role", f"expected {role!r} in the [{role}] table, got {declared!r}")
        if "model" not in values:
            raise w.err("model", "missing", hint='set `model = "Qwen/Qwen3-8B"` (the same on prefill and decode)')
        values.setdefault("name", instance_name(role, i, len(entries)))
        values.setdefault("side_channel_port", NIXL_SIDE_CHANNEL_BASE + 100 * (side_index + i))
        _, port = parse_endpoint(url)
        worker = WorkerConfig(role=role, index=i, table=prefix, url=url.rstrip("/"), port=port, **values)
        w.finish(list(WORKER_KEYS))
        out.append(worker)
    return tuple(out)


def _beside(file: str, path: str | None) -> str | None:
    """``path`` as given when absolute, else relative to the folder of ``file``."""
    if path is None:
        return None
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else Path(file).parent / p)


def load_settings(settings_path: str | Path = DEFAULT_SETTINGS) -> Settings:
    """Read ``settings.json`` alone (the gateway runs from it when no config.toml is given)."""
    spath = Path(settings_path)
    data = read_json(spath)
    src = SourceMap({str(spath): _read_text(spath)}, {str(spath): "json"})
    return _load_settings(src, str(spath), data)


def _load_settings(src: SourceMap, sfile: str, data: Mapping[str, Any]) -> Settings:
    top = _Section(src, sfile, "", data)
    top.finish(list(SETTINGS_SECTIONS))

    g = top.sub("gateway")
    gateway = GatewayConfig(**_read_keys(g, GatewayConfig))
    if (gateway.tls_certfile is None) != (gateway.tls_keyfile is None):
        missing = "tls_keyfile" if gateway.tls_keyfile is None else "tls_certfile"
        raise g.err(missing, "TLS needs both tls_certfile and tls_keyfile",
                    hint="set both to PEM files, or neither to serve plain HTTP")  # fmt: skip
    _finish(g, GatewayConfig)

    routing = RoutingConfig(**_read_section(top, "routing", RoutingConfig))

    slo = SLOConfig(**_read_section(top, "slo", SLOConfig))
    logging_cfg = LoggingConfig(**_read_section(top, "logging", LoggingConfig))
    return Settings(gateway, routing, slo, logging_cfg)
