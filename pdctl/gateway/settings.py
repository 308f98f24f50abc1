"""What the gateway runs from: the settings.json sections, plus what config.toml adds when given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdctl.config import Deployment, GatewayConfig, LoggingConfig, RoutingConfig, Settings, SLOConfig, instance_name

__all__ = ["GatewaySettings", "InstanceSpec", "LocalModel", "from_deployment", "from_settings"]


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One prefill or decode worker the gateway routes to."""

    name: str
    role: Literal["prefill", "decode"]
    url: str


@dataclass(frozen=True, slots=True)
class LocalModel:
    """A model the workers serve, with its context length when known."""

    name: str
    max_model_len: int | None = None
    source: str | None = None
    """The model path or Hugging Face repo id the workers load (where its tokenizer is); None: ``name``."""
    engine: str = "vllm"
    """The workers' engine (``sim``: the simulator, whose tokenizer is its own)."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Everything :func:`pdctl.gateway.app.create_app` needs; built by :func:`from_deployment`/:func:`from_settings`.

    ``models`` empty means "learn them from the workers' ``/v1/models``".
    """

    gateway: GatewayConfig
    routing: RoutingConfig
    slo: SLOConfig
    logging: LoggingConfig
    prefill: tuple[InstanceSpec, ...]
    decode: tuple[InstanceSpec, ...]
    models: tuple[LocalModel, ...] = ()
    connector: str | None = None
    kv_timeout_s: float = 30.0
    health_interval_s: float = 2.0
    breaker_threshold: int = 5
    breaker_cooldown_s: float = 5.0
    connect_timeout_s: float = 5.0
    max_nesting: int = 64
    kv_events_connect: str | None = None
    """The parent's relay of the workers' KV cache events to connect to (``gateway.workers`` > 1), instead of binding
    ``routing.kv_events_port`` (:class:`pdctl.gateway.routing.kv_events.EventsRelay`)."""
    process: tuple[int, int] = (0, 1)
    """This gateway process's index and the number of processes (``gateway.workers``), for the limits' shares."""

    @property
    def instances(self) -> tuple[InstanceSpec, ...]:
        """Prefill then decode instances."""
        return self.prefill + self.decode


def _names(role: Literal["prefill", "decode"], urls: tuple[str, ...]) -> tuple[InstanceSpec, ...]:
    return tuple(InstanceSpec(instance_name(role, i, len(urls)), role, u.rstrip("/")) for i, u in enumerate(urls))


def from_settings(settings: Settings) -> GatewaySettings:
    """Settings from settings.json alone: model names come from the workers' ``/v1/models``."""
    routing = settings.routing
    return GatewaySettings(
        gateway=settings.gateway,
        routing=routing,
        slo=settings.slo,
        logging=settings.logging,
        prefill=_names("prefill", routing.prefill_endpoints),
        decode=_names("decode", routing.decode_endpoints),
        connector=routing.kv_connector,
    )


def from_deployment(dep: Deployment) -> GatewaySettings:
    """Settings from config.toml + settings.json: instance names, models and limits from the workers."""
    models: dict[str, int | None] = {}
    sources: dict[str, str] = {}
    engines: dict[str, str] = {}
    for w in dep.workers:
        engines.setdefault(w.model_name, w.engine)
        sources.setdefault(w.model_name, dep.resolve_path(w.model) if w.model.startswith((".", "~")) else w.model)
        known = models.get(w.model_name)
        lens = [x for x in (known, w.max_model_len) if x is not None]
        models[w.model_name] = min(lens) if lens else None
    return GatewaySettings(
        gateway=dep.gateway,
        routing=dep.routing,
        slo=dep.slo,
        logging=dep.logging,
        prefill=tuple(InstanceSpec(w.name, "prefill", w.url) for w in dep.prefill),
        decode=tuple(InstanceSpec(w.name, "decode", w.url) for w in dep.decode),
        models=tuple(LocalModel(n, m, sources[n], engines[n]) for n, m in models.items()),
        connector=dep.routing.kv_connector or dep.connector.kv_connector,
        kv_timeout_s=dep.kv_transfer.timeout_ms / 1000.0,
    )
