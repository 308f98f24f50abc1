"""Rules about the KV connector and what its settings map to in vLLM.

- :func:`connectors` PD001: a worker or ``routing.kv_connector`` names another connector than ``[connector]``.
- :func:`backend` PD002: ``kv_transfer.backend`` does not fit the connector; shared storage without a folder.
- :func:`connector_exists` PD003: a connector vLLM renamed, removed or never had (:func:`known_connectors`
  reads the installed vLLM's names); PD029: one pdctl cannot run.
- :func:`mappings` PD019-PD023: what ``kv_role``, ``granularity``, ``timeout_ms`` and ``gateway.listen``
  become (info), and a connector whose protocol pdctl does not know.

Changing the connector is one fix, :func:`_connector_fix`, shared by these rules: ``routing.kv_connector``
and ``kv_transfer.backend`` follow it.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from pdctl.check.findings import SETTINGS, Ctx, Finding
from pdctl.runtime.plan import VllmInstall, detect_vllm
from pdctl.vllm.protocol import NIXL_CONNECTORS, UNSUPPORTED_CONNECTORS, connector_kind

# Connector names per vLLM release line, used when vLLM is not importable. SharedStorageConnector was
# renamed ExampleConnector (vllm PR #30201) and P2pNcclConnector removed (PR #44854).
_KNOWN_CONNECTORS = frozenset(
    {
        "NixlConnector", "NixlPullConnector", "NixlPushConnector", "ExampleConnector", "LMCacheConnectorV1",
        "MooncakeConnector", "MultiConnector", "OffloadingConnector", "DecodeBenchConnector",
        "LMCacheMPConnector", "MoRIIOConnector",
    }
)  # fmt: skip
_RENAMED = {"SharedStorageConnector": "ExampleConnector"}
_REMOVED = {"P2pNcclConnector": "removed in vLLM PR #44854", "PyNcclConnector": "removed long ago"}


def known_connectors(vllm: VllmInstall | None = None) -> frozenset[str]:
    """Connector names the engine's vLLM registers (read from its factory source, without importing vLLM)."""
    vllm = vllm or detect_vllm()
    bases: list[str] = [vllm.package_dir] if vllm.package_dir else []
    if not bases and vllm.distribution:
        spec = importlib.util.find_spec("vllm")
        bases = list(spec.submodule_search_locations or []) if spec else []
    for base in bases:
        factory = Path(base) / "distributed" / "kv_transfer" / "kv_connector" / "factory.py"
        if factory.is_file():
            names = re.findall(r"register_connector\(\s*[\"'](\w+)[\"']", factory.read_text(encoding="utf-8"))
            if names:
                return frozenset(names)
    return _KNOWN_CONNECTORS


def connectors(c: Ctx) -> Iterable[Finding]:
    """PD001: every worker and ``routing.kv_connector`` use ``[connector]``'s connector."""
    dep = c.dep
    base = dep.connector.kv_connector
    for w in dep.workers:
        if w.kv_connector and w.kv_connector != base:
            yield c.at(
                "PD001", "error", "config", f"{w.table}.kv_connector",
                f"{w.name} uses {w.kv_connector} but [connector] says {base}: decode would wait in "
                "wait_for_layer_load until the timeout (recipe §5.1)",
                "use the identical kv_connector on prefill and decode",
                fixes=({f"{w.table}.kv_connector": None},),
            )  # fmt: skip
    if dep.routing.kv_connector and dep.routing.kv_connector != base:
        yield c.at(
            "PD001", "error", "settings", "routing.kv_connector",
            f"routing.kv_connector is {dep.routing.kv_connector} but config.toml [connector] says {base} "
            "(recipe §5.1)",
            "make routing.kv_connector and [connector] kv_connector the same",
            fixes=({f"{SETTINGS}routing.kv_connector": base},),
        )  # fmt: skip


def backend(c: Ctx) -> Iterable[Finding]:
    """PD002: ``kv_transfer.backend`` fits the connector; shared storage has a folder."""
    dep = c.dep
    backend, name = dep.kv_transfer.backend, dep.connector.kv_connector
    kind = connector_kind(name)
    if backend == "nixl" and not name.startswith("Nixl"):
        yield c.at("PD002", "error", "config", "kv_transfer.backend",
                   f'backend "nixl" but the connector is {name}',
                   fixes=({"kv_transfer.backend": "shared_storage"},) if kind == "shared_storage"
                   else _connector_fix(c, "connector.kv_connector", name, "NixlConnector"))  # fmt: skip
    elif backend == "shared_storage" and kind != "shared_storage" and name not in _RENAMED:
        yield c.at("PD002", "error", "config", "kv_transfer.backend",
                   f'backend "shared_storage" but the connector is {name}',
                   'or use kv_connector = "ExampleConnector" with a shared_storage_path' if kind == "params" else None,
                   fixes=({"kv_transfer.backend": "nixl"},) if kind == "params"
                   else _connector_fix(c, "connector.kv_connector", name, "ExampleConnector"))  # fmt: skip
    if kind == "shared_storage" and not (
        dep.kv_transfer.shared_storage_path or dep.connector.extra_config.get("shared_storage_path")
    ):
        yield c.at("PD002", "warning", "config", "kv_transfer",
                   f"{name} needs a folder both workers share; none is set, the plan uses /tmp/pdctl-kv",
                   "a folder on local NVMe; relative paths are relative to config.toml",
                   fixes=({"kv_transfer.shared_storage_path": "kv-store"},))  # fmt: skip


def connector_exists(c: Ctx) -> Iterable[Finding]:
    """PD003: each connector named is in the engine's vLLM; PD029: pdctl can run it."""
    known = known_connectors(c.vllm)
    names = {c.dep.connector.kv_connector: "connector.kv_connector"}
    for w in c.dep.workers:
        if w.kv_connector:
            names.setdefault(w.kv_connector, f"{w.table}.kv_connector")
    for name, key in names.items():
        if name in _RENAMED:
            yield c.at("PD003", "error", "config", key,
                       f"{name} was renamed {_RENAMED[name]} in vLLM (no alias): vLLM fails with "
                       "'Unsupported connector type'", fixes=_connector_fix(c, key, name, _RENAMED[name]))  # fmt: skip
        elif name in _REMOVED:
            yield c.at("PD003", "error", "config", key, f"{name} is not in current vLLM ({_REMOVED[name]})",
                       '"ExampleConnector" for shared storage',
                       fixes=_connector_fix(c, key, name, "NixlConnector"))  # fmt: skip
        elif name not in known:
            source = f"vLLM {c.vllm.version}" if c.vllm.version else "pdctl's table of vLLM connectors"
            runs = sorted(n for n in known if connector_kind(n) != "unknown")
            near = difflib.get_close_matches(name, runs, n=1)
            yield c.at("PD003", "error", "config", key, f"unknown connector {name} (not in {source})",
                       f"the connectors pdctl runs: {', '.join(runs)}",
                       fixes=_connector_fix(c, key, name, near[0] if near else "NixlConnector"))  # fmt: skip
        elif name in UNSUPPORTED_CONNECTORS:
            yield c.at("PD029", "error", "config", key, f"pdctl cannot run {name}: {UNSUPPORTED_CONNECTORS[name]}",
                       fixes=_connector_fix(c, key, name, "NixlConnector"))  # fmt: skip


def _connector_fix(c: Ctx, key: str, old: str, new: str) -> tuple[Mapping[str, object], ...]:
    """Use ``new`` instead of ``old`` at ``key``, and in ``routing.kv_connector`` when it names ``old`` too;
    ``kv_transfer.backend`` follows when it would no longer fit (PD002)."""
    fix: dict[str, object] = {key: new}
    if c.dep.routing.kv_connector == old:
        fix[f"{SETTINGS}routing.kv_connector"] = new
    backend = c.dep.kv_transfer.backend
    if key == "connector.kv_connector" and backend in ("nixl", "shared_storage"):
        wanted = "shared_storage" if connector_kind(new) == "shared_storage" else "nixl"
        if backend != wanted:
            fix["kv_transfer.backend"] = wanted
    return (fix,)


def mappings(c: Ctx) -> Iterable[Finding]:
    """PD019-PD023: what the connector's settings and ``gateway.listen`` become, and a connector pdctl does not know."""
    dep = c.dep
    name = dep.connector.kv_connector
    if dep.connector.kv_role == "kv_both" and connector_kind(name) == "params":
        yield c.at("PD019", "info", "config", "connector.kv_role",
                   f"kv_both is deprecated for {name}: the plan launches prefill with kv_producer and decode "
                   "with kv_consumer", "or leave it: pdctl sets the role per worker",
                   fixes=({"connector.kv_role": None},))  # fmt: skip
    gran = dep.kv_transfer.granularity
    if "kv_transfer.granularity" in dep.config_keys:
        if name in NIXL_CONNECTORS:
            msg = (
                f'granularity "{gran}": {name} moves whole KV blocks once prefill finished; vLLM has '
                "no per-layer or per-request switch for it, so this setting changes nothing in the plan"
            )
        elif connector_kind(name) == "shared_storage":
            msg = (
                f'granularity "{gran}": {name} saves and loads layer by layer (save_kv_layer / '
                "wait_for_layer_load) regardless; this setting changes nothing in the plan"
            )
        else:
            msg = f'granularity "{gran}" is not passed to {name}: vLLM has no such option'
        yield c.at("PD020", "info", "config", "kv_transfer.granularity", msg)
    if "kv_transfer.timeout_ms" in dep.config_keys:
        parts = [f"the gateway's deadline for the KV handoff (decode's first token) is {dep.kv_transfer.timeout_ms} ms"]
        if name in NIXL_CONNECTORS:
            lease = max(1, -(-dep.kv_transfer.timeout_ms // 1000))
            parts.append(f"prefill holds KV for decode for kv_lease_duration = {lease} s")
        yield c.at("PD021", "info", "config", "kv_transfer.timeout_ms", "timeout_ms maps to: " + "; ".join(parts))
    if dep.gateway.listen_host in ("0.0.0.0", "::"):
        fix: dict[str, object] = {f"{SETTINGS}gateway.listen": f"127.0.0.1:{dep.gateway.listen_port}"}
        if "cluster.gateway_host" in dep.config_keys:
            fix["cluster.gateway_host"] = "127.0.0.1"
        yield c.at("PD022", "info", "settings", "gateway.listen",
                   "the gateway listens on all interfaces; workers bind 127.0.0.1 unless `host` says otherwise",
                   "when only clients on this machine need it", fixes=(fix,))  # fmt: skip
    if dep.routing.strategy == "pd_disagg" and connector_kind(name) == "unknown" and name not in UNSUPPORTED_CONNECTORS:
        yield c.at("PD023", "warning", "config", "connector.kv_connector",
                   f"pdctl does not know whether {name} returns kv_transfer_params; the gateway treats it like "
                   "NixlConnector and reports a fallback when none come back",
                   f"a connector whose protocol pdctl speaks; or keep {name} and see with `pdctl verify` whether "
                   "KV moved (its kv_params and kv_metrics checks)",
                   fixes=_connector_fix(c, "connector.kv_connector", name, "NixlConnector"))  # fmt: skip
