"""The gateway's NetworkPolicy (``pdctl render k8s``, ``routing.prefix_view = "exact"``): only the deployment's
worker pods reach the KV cache events port, whose messages steer routing and carry no authentication unless
``routing.kv_events_curve`` (vLLM 0.32's publisher has no CURVE; the relay sidecars add it: docs/multi-node.md, The
KV events port); the HTTP port stays open to every client.

It takes effect where the cluster's network plugin enforces NetworkPolicy (Calico, Cilium, ...); elsewhere the
gateway's topic allowlist (:mod:`pdctl.gateway.routing.exact_view`) is what is left.
"""

from __future__ import annotations

from typing import Any

from pdctl.config import Deployment

__all__ = ["NAME", "gateway_policy"]

NAME = "gateway-kv-events"


def gateway_policy(dep: Deployment, ns: str, labels: dict[str, str], gateway: dict[str, str]) -> dict[str, Any] | None:
    """The NetworkPolicy selecting the gateway's pods (``gateway``: their selector labels; ``labels``: the object's),
    or None when the gateway has no events port."""
    r = dep.routing
    if r.prefix_view != "exact" or r.strategy != "pd_disagg":
        return None
    part_of = gateway["app.kubernetes.io/part-of"]
    workers = {
        "matchLabels": {"app.kubernetes.io/part-of": part_of},
        "matchExpressions": [{"key": "pdctl.io/role", "operator": "In", "values": ["prefill", "decode"]}],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": NAME, "namespace": ns, "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": gateway},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": dep.gateway.listen_port}]},
                {"from": [{"podSelector": workers}], "ports": [{"protocol": "TCP", "port": r.kv_events_port}]},
            ],
        },
    }
