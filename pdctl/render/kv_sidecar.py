"""CURVE on the KV events port in the pods (``pdctl render k8s``, ``routing.kv_events_curve``): each worker pod
gets a ``kv-relay`` sidecar that its engine publishes to on the pod's loopback, and the relay and the gateway
read their keys from the Secret :data:`~pdctl.vllm.kv_curve.SECRET_NAME` (``env.valueFrom.secretKeyRef``), which
``pdctl keys kv-events --format k8s`` makes: no manifest holds a key. The NetworkPolicy
(:mod:`pdctl.render.netpol`) still admits only the worker pods to the port.
"""

from __future__ import annotations

import json
from typing import Any

from pdctl.config import Deployment
from pdctl.runtime.plan import ProcessSpec
from pdctl.vllm.kv_curve import (
    CLIENT_PUBLIC_ENV,
    CLIENT_SECRET_ENV,
    SECRET_NAME,
    SERVER_PUBLIC_ENV,
    SERVER_SECRET_ENV,
)
from pdctl.vllm.kv_events import connect_endpoint

__all__ = ["GATEWAY_KEYS", "RELAY_KEYS", "relay_sidecars", "secret_env"]

GATEWAY_KEYS = (SERVER_SECRET_ENV, CLIENT_PUBLIC_ENV)
"""What the gateway container reads from the Secret."""
RELAY_KEYS = (CLIENT_SECRET_ENV, SERVER_PUBLIC_ENV)
"""What each relay sidecar reads from the Secret."""


def secret_env(dep: Deployment, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """``names`` from the Secret, as container env entries; none unless ``routing.kv_events_curve``."""
    if not dep.routing.kv_events_curve:
        return []
    return [{"name": n, "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": n}}} for n in names]


def relay_sidecars(dep: Deployment, spec: ProcessSpec, image: str, gateway: str) -> list[dict[str, Any]]:
    """The worker pod's ``kv-relay`` container, listening where the planned engine publishes (its
    ``--kv-events-config`` endpoint, on loopback) and forwarding to the ``gateway`` Service; [] when the worker
    publishes no events or ``routing.kv_events_curve`` is off."""
    if not dep.routing.kv_events_curve or "--kv-events-config" not in spec.argv:
        return []
    endpoint = json.loads(spec.argv[spec.argv.index("--kv-events-config") + 1])["endpoint"]
    to = connect_endpoint(gateway, dep.routing.kv_events_port)
    return [
        {
            "name": "kv-relay",
            "image": image,
            "command": ["pdctl"],
            "args": ["kv-relay", "--listen", endpoint.removeprefix("tcp://"), "--to", to],
            "env": [{"name": "NO_COLOR", "value": "1"}, *secret_env(dep, RELAY_KEYS)],
        }
    ]
