"""The Grafana dashboard ``pdctl render monitoring`` writes (``grafana/pdctl.json``): a deployment and a role
variable, and for each row the gateway's panel on the left beside vLLM's on the right (the KV transfer, the prefix
cache, the queues). Each panel's description names the metric it reads; :func:`dashboard_queries` lists every
query, for the tests that check each one against the metrics the gateway and vLLM really export.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdctl.config import Deployment

__all__ = ["CAPACITY_REASONS", "dashboard", "dashboard_queries"]

#: The reasons of ``pdctl_rejected_total`` that mean "no capacity" (not a client's mistake or its own quota).
CAPACITY_REASONS = "server_overloaded|max_concurrency|slo_.*"

_DS = {"type": "prometheus", "uid": "${datasource}"}
_GW = 'deployment="$deployment"'
_VL = 'deployment="$deployment",role=~"$role"'
_RI = "$__rate_interval"


def _panel(
    title: str, targets_: Sequence[tuple[str, str]], unit: str, x: int, y: int, description: str
) -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": _DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": _DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets_)
        ],
    }


def _row(title: str, y: int) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            "panels": []}  # fmt: skip


def _q_hist(q: float, metric: str, sel: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{sel}}}[{_RI}])))"


# (row title, [(gateway panel), (vLLM panel)]): each panel (title, [(expr, legend)], unit, description).
_Panel = tuple[str, list[tuple[str, str]], str, str]
_ROWS: list[tuple[str, list[tuple[_Panel, _Panel]]]] = [
    ("The KV link: gateway paths beside vLLM's KV connector", [
        (("Requests by path", [(f"sum by (path) (rate(pdctl_requests_total{{{_GW}}}[{_RI}]))", "{{path}}")],
          "reqps", "pdctl_requests_total: disagg (two legs), local, colocated, fallback, rejected, upstream"),
         ("KV bytes/s (NIXL)", [(f"sum by (instance) (rate(vllm:nixl_bytes_transferred_sum{{{_VL}}}[{_RI}]))",
                                 "{{instance}}")],
          "Bps", "vllm:nixl_bytes_transferred (sum): bytes moved by NixlConnector per second")),
        (("Silent fallbacks and prefill fallbacks",
          [(f"sum by (reason) (rate(pdctl_pd_fallback_total{{{_GW}}}[{_RI}]))", "silent: {{reason}}"),
           (f"sum by (to, reason) (rate(pdctl_prefill_fallback_total{{{_GW}}}[{_RI}]))", "to {{to}}: {{reason}}")],
          "reqps", "pdctl_pd_fallback_total: decode ran without usable KV (PdctlSilentFallback); "
                   "pdctl_prefill_fallback_total: no prefill could serve"),
         ("NIXL failed transfers and expired KV",
          [(f"sum by (instance) (increase(vllm:nixl_num_failed_transfers_total{{{_VL}}}[{_RI}]))",
            "failed: {{instance}}"),
           (f"sum by (instance) (increase(vllm:nixl_num_kv_expired_reqs_total{{{_VL}}}[{_RI}]))",
            "expired: {{instance}}")],
          "short", "vllm:nixl_num_failed_transfers_total, vllm:nixl_num_kv_expired_reqs_total")),
        (("Adaptive PD decisions",
          [(f"sum by (path, reason) (rate(pdctl_pd_decisions_total{{{_GW}}}[{_RI}]))", "{{path}}: {{reason}}")],
          "reqps", "pdctl_pd_decisions_total (routing.pd_mode = adaptive): local or disagg, and why"),
         ("Prompt tokens by source",
          [(f"sum by (instance, source) (rate(vllm:prompt_tokens_by_source_total{{{_VL}}}[{_RI}]))",
            "{{instance}}: {{source}}")],
          "short", "vllm:prompt_tokens_by_source_total: external_kv_transfer on decode is KV that came over the link")),
        (("TTFT by path (gateway)",
          [(_q_hist(0.5, "pdctl_ttft_seconds", _GW, "path"), "p50 {{path}}"),
           (_q_hist(0.9, "pdctl_ttft_seconds", _GW, "path"), "p90 {{path}}"),
           (_q_hist(0.99, "pdctl_ttft_seconds", _GW, "path"), "p99 {{path}}")],
          "s", "pdctl_ttft_seconds: time to first token as the client sees it (streams)"),
         ("NIXL transfer time",
          [(_q_hist(0.9, "vllm:nixl_xfer_time_seconds", _VL, "instance"), "xfer p90 {{instance}}"),
           (_q_hist(0.9, "vllm:nixl_post_time_seconds", _VL, "instance"), "post p90 {{instance}}")],
          "s", "vllm:nixl_xfer_time_seconds, vllm:nixl_post_time_seconds")),
        (("TPOT by path and TTFT legs (gateway)",
          [(_q_hist(0.9, "pdctl_tpot_seconds", _GW, "path"), "TPOT p90 {{path}}"),
           (_q_hist(0.9, "pdctl_leg_seconds", _GW, "leg"), "TTFT leg p90 {{leg}}")],
          "s", "pdctl_tpot_seconds; pdctl_leg_seconds splits TTFT into prefill, handoff, first_chunk"),
         ("Prefix cache hit ratio",
          [(f"sum by (instance) (rate(vllm:prefix_cache_hits_total{{{_VL}}}[{_RI}])) / "
            f"(sum by (instance) (rate(vllm:prefix_cache_queries_total{{{_VL}}}[{_RI}])) > 0)", "{{instance}}")],
          "percentunit", "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total (tokens)")),
    ]),
    ("Admission and load", [
        (("Rejected before any worker call",
          [(f"sum by (reason) (rate(pdctl_rejected_total{{{_GW}}}[{_RI}]))", "{{reason}}")],
          "reqps", f"pdctl_rejected_total; capacity reasons ({CAPACITY_REASONS}) feed PdctlCapacityRejections"),
         ("Running and waiting requests",
          [(f"sum by (instance) (vllm:num_requests_running{{{_VL}}})", "running {{instance}}"),
           (f"sum by (instance) (vllm:num_requests_waiting{{{_VL}}})", "waiting {{instance}}")],
          "short", "vllm:num_requests_running, vllm:num_requests_waiting (PdctlPrefillQueueGrowing)")),
        (("In flight",
          [(f"sum(pdctl_gateway_in_flight{{{_GW}}})", "client requests"),
           (f"sum by (exported_instance) (pdctl_in_flight{{{_GW}}})", "calls to {{exported_instance}}")],
          "short", "pdctl_gateway_in_flight; pdctl_in_flight per worker (its own instance label is "
                   "exported_instance: Prometheus keeps the target's)"),
         ("KV cache usage", [(f"max by (instance) (vllm:kv_cache_usage_perc{{{_VL}}})", "{{instance}}")],
          "percentunit", "vllm:kv_cache_usage_perc")),
        (("SLO miss ratio (5m)",
          [(f"pdctl:ttft_slo_miss_ratio:rate5m{{{_GW}}}", "TTFT"),
           (f"pdctl:tpot_slo_miss_ratio:rate5m{{{_GW}}}", "TPOT")],
          "percentunit", "share of streamed requests over the settings.json slo targets (PdctlTtftSloBurn, "
                         "PdctlTpotSloBurn)"),
         ("Processes up and restarts",
          [(f"sum by (role, instance) (up{{{_VL}}})", "up {{instance}}"),
           (f"sum by (role, instance) (changes(process_start_time_seconds{{{_VL}}}[1h]))", "starts/1h {{instance}}")],
          "short", "up (PdctlProcessDown), process start times (PdctlProcessRestarting)")),
    ]),
    ("Routing: the SLO autopilot and the prefill queue", [
        (("Autopilot predictor error (observed / predicted)",
          [(_q_hist(0.5, "pdctl_autopilot_ttft_ratio", _GW, "path"), "TTFT p50 {{path}}"),
           (_q_hist(0.5, "pdctl_autopilot_tpot_ratio", _GW, "path"), "TPOT p50 {{path}}")],
          "short", "pdctl_autopilot_ttft_ratio, pdctl_autopilot_tpot_ratio (routing.pd_mode = auto): 1 is a perfect "
                   "prediction, above 1 slower than predicted"),
         ("Prefill time in vLLM",
          [(_q_hist(0.9, "vllm:request_prefill_time_seconds", _VL, "instance"), "p90 {{instance}}")],
          "s", "vllm:request_prefill_time_seconds: what the autopilot learns as prefill seconds per token")),
        (("Gateway prefill queue",
          [(f"sum(pdctl_prefill_queue_waiting{{{_GW}}})", "waiting"),
           (f"sum by (rule) (rate(pdctl_prefill_queue_wait_seconds_count{{{_GW}}}[{_RI}]))", "bound/s by {{rule}}")],
          "short", "pdctl_prefill_queue_waiting, pdctl_prefill_queue_wait_seconds (routing.prefill_queue_tokens): "
                   "requests held until a prefill has room, and how they were bound (match, policy, idle)"),
         ("Queue time in vLLM",
          [(_q_hist(0.9, "vllm:request_queue_time_seconds", _VL, "instance"), "p90 {{instance}}")],
          "s", "vllm:request_queue_time_seconds: time waiting inside the engine, after the gateway's queue")),
    ]),
    ("Sizing: the gateway's advice for its last window (slo.capacity_profile)", [
        (("Serving and advised instances",
          [(f"max by (role, of) (pdctl_advice_replicas{{{_GW}}})", "{{role}} {{of}}")],
          "short", "pdctl_advice_replicas: instances serving now (current) and the fewest meeting the SLO for the "
                   "window's traffic (recommended) (PdctlPrefillUnderProvisioned, PdctlDecodeUnderProvisioned)"),
         ("Predicted p90 now and at the advised counts",
          [(f'max by (of) (pdctl_advice_ttft_seconds{{{_GW},quantile="0.9"}})', "TTFT {{of}}"),
           (f'max by (of) (pdctl_advice_tpot_seconds{{{_GW},quantile="0.9"}})', "TPOT {{of}}")],
          "s", "pdctl_advice_ttft_seconds, pdctl_advice_tpot_seconds: pdctl advise's model on the window's traffic")),
    ]),
    ("Per key", [
        (("Requests per key", [(f"sum by (key, status) (rate(pdctl_key_requests_total{{{_GW}}}[{_RI}]))",
                                "{{key}} {{status}}")],
          "reqps", "pdctl_key_requests_total, by the key's name (never the key)"),
         ("Tokens charged per key", [(f"sum by (key) (rate(pdctl_key_tokens_total{{{_GW}}}[{_RI}]))", "{{key}}")],
          "short", "pdctl_key_tokens_total: prompt + max_tokens")),
    ]),
]  # fmt: skip


def dashboard(dep: Deployment) -> dict[str, Any]:
    """The Grafana dashboard: for each row, the gateway's panel on the left, vLLM's on the right."""
    name = dep.cluster.name
    panels: list[dict[str, Any]] = []
    y = 0
    for title, pairs in _ROWS:
        panels.append(_row(title, y))
        y += 1
        for left, right in pairs:
            for x, (ptitle, tgts, unit, desc) in ((0, left), (12, right)):
                panels.append(_panel(ptitle, tgts, unit, x, y, desc))
            y += 8
    return {
        "title": f"pdctl: {name}",
        "uid": f"pdctl-{name}"[:40],
        "tags": ["pdctl", "vllm", "pd"],
        "schemaVersion": 39,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
                {
                    "name": "deployment",
                    "type": "query",
                    "datasource": _DS,
                    "label": "Deployment",
                    "query": {"query": "label_values(up, deployment)", "refId": "deployment"},
                    "definition": "label_values(up, deployment)",
                    "refresh": 1,
                    "current": {"text": name, "value": name},
                },
                {
                    "name": "role",
                    "type": "custom",
                    "label": "Role",
                    "query": "prefill,decode,gateway",
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".*",
                    "current": {"text": ["All"], "value": ["$__all"]},
                    "options": [{"text": v, "value": v, "selected": False} for v in ("prefill", "decode", "gateway")],
                },
            ]
        },
        "panels": panels,
    }


def dashboard_queries(board: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of a dashboard."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
