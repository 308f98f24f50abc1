"""pdctl's gateway: one key, PD two-leg routing, true streaming, upstream channel, limits, SLO admission.

Modules: ``app`` (raw ASGI app), ``request`` (pure parsing, validation and model routing), ``settings``,
``auth``, ``routing`` (the package that chooses every instance: its ``Router`` facade, the pool, the policies, the
prefix views, the prefill queue, the autopilot), ``pd`` (two-leg flow on a narrow ``PdContext``), ``migration``,
``workers`` (the ``WorkerClient`` interface), ``memory`` (in-memory workers for tests), ``record`` (one request's
record and response channel), ``relay`` (the chunk-by-chunk relay), ``upstream``, ``ratelimit``, ``admission``
(SLO predictor), ``metrics``, ``errors`` (OpenAI shape), ``server`` (uvicorn + drain). Data flow:
docs/architecture.md.
"""

from __future__ import annotations

from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.settings import GatewaySettings, from_deployment, from_settings

__all__ = ["Gateway", "GatewaySettings", "create_app", "from_deployment", "from_settings"]
