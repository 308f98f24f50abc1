"""Command lines for peer routers, from the same two files (``pdctl render vllm-router``).

A peer takes the gateway's place in front of the same workers; ``pdctl verify`` and ``pdctl bench`` then
point at it with ``--gateway URL`` (docs/multi-node.md, "Peers").
"""

from __future__ import annotations

from pdctl.config import Deployment
from pdctl.errors import PdctlError

__all__ = ["vllm_router_argv"]

#: vllm-router's ``--kv-connector`` choices for pdctl's connector names.
_VLLM_ROUTER_CONNECTORS = {"NixlConnector": "nixl", "NixlPullConnector": "nixl", "MooncakeConnector": "mooncake"}


def vllm_router_argv(dep: Deployment, *, cluster: bool = False) -> list[str]:
    """``vllm-router`` in PD mode with static worker URLs: the settings' endpoints, or (``cluster``) the
    headless Service names ``pdctl render k8s`` gives the groups; it listens where the gateway would."""
    from pdctl.render.k8s import service_url

    connector = dep.routing.kv_connector or dep.connector.kv_connector
    kind = _VLLM_ROUTER_CONNECTORS.get(connector)
    if kind is None:
        raise PdctlError(
            f"vllm-router has no PD mode for {connector}",
            hint="vllm-router moves KV with nixl or mooncake: use NixlConnector, or keep pdctl's gateway",
        )
    argv = ["vllm-router", "--vllm-pd-disaggregation", "--kv-connector", kind]
    for w in dep.prefill:
        argv += ["--prefill", service_url(w) if cluster else w.url, "none"]
    for w in dep.decode:
        argv += ["--decode", service_url(w) if cluster else w.url]
    g = dep.gateway
    argv += ["--host", "0.0.0.0" if cluster else g.listen_host, "--port", str(g.listen_port)]
    argv += ["--request-timeout-secs", str(int(g.request_timeout_s))]
    return argv
