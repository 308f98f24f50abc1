"""Deployment -> Prometheus and Grafana files (``pdctl render monitoring``), built from the plan ``pdctl up`` runs.

Scrape targets are the plan's processes (:func:`pdctl.runtime.plan.build_plan`): each one's URL, with its
``role`` (prefill, decode, gateway), its name as ``instance`` and the cluster's name as ``deployment``, so
the labels are the names ``pdctl status`` and ``pdctl logs`` use. Every rule selects ``deployment="<name>"``:
the files of several deployments can be loaded into one Prometheus side by side.

Map::

    render(dep, options) -> Rendered(files: {relative path: text}, notes)
      prometheus.yml              two scrape jobs (workers, gateway): static targets, or file_sd with --file-sd
      targets/workers.json        the same targets for file_sd_configs
      targets/gateway.json
      rules/pdctl-recording.yml   RECORDING: TTFT/TPOT by path, KV bytes/s, transfer failures, prefix hit rate, SLO
      rules/pdctl-alerts.yml      ALERTS, each with annotations.runbook -> docs/troubleshooting.md#<alert, lower case>
      grafana/pdctl.json          dashboard (pdctl.render.dashboard): deployment and role variables, gateway panels
                                  beside vLLM's KV panels

The gateway's histograms' bucket bounds are read from :class:`pdctl.gateway.metrics.GatewayMetrics` itself, so the
SLO rules count requests against the bucket the gateway really has.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from pdctl.config import Deployment
from pdctl.render.autoscale import signal_rules
from pdctl.render.dashboard import CAPACITY_REASONS, dashboard
from pdctl.runtime.plan import Plan, VllmInstall, build_plan

__all__ = [
    "Alert",
    "MonitoringOptions",
    "Rendered",
    "Target",
    "alerts",
    "recording_rules",
    "render",
    "targets",
    "write",
]

#: Where each alert's runbook lives (an anchor per alert: the alert's name in lower case).
RUNBOOK = "docs/troubleshooting.md"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True)
class MonitoringOptions:
    """How the files are rendered; the defaults are what ``pdctl render monitoring`` writes.

    ``alert_for`` replaces every alert's own ``for:`` (a test runs them in seconds); ``runbook`` is the page the
    alerts link to (a URL of your copy of docs/troubleshooting.md, say).
    """

    scrape_interval_s: int = 15
    evaluation_interval_s: int = 15
    file_sd: bool = False
    alert_for: str | None = None
    runbook: str = RUNBOOK
    gateway_key_file: str = "pdctl-gateway.key"


@dataclass(frozen=True, slots=True)
class Target:
    """One process Prometheus scrapes: where (``scheme://address/metrics``) and its labels."""

    name: str
    role: str
    scheme: str
    address: str

    def labels(self, deployment: str) -> dict[str, str]:
        return {"deployment": deployment, "role": self.role, "instance": self.name}


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert rule as rendered (``expr`` already selects the deployment)."""

    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def rule(self, runbook: str, for_override: str | None) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": for_override if for_override is not None else self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook": f"{runbook}#{self.name.lower()}",
            },
        }


@dataclass(frozen=True, slots=True)
class Rendered:
    """The files (relative path -> text) and what the user should know about them."""

    files: dict[str, str]
    notes: tuple[str, ...] = ()
    alerts: tuple[Alert, ...] = field(default=())


def targets(plan: Plan) -> list[Target]:
    """Every process of the plan, as a scrape target (workers first, the gateway last, in start order)."""
    out: list[Target] = []
    for p in plan.processes:
        parts = urlsplit(p.url)
        out.append(Target(p.name, p.role, parts.scheme or "http", parts.netloc))
    return out


def _q(value: str) -> str:
    """A PromQL string literal."""
    return json.dumps(value)


def _le(bounds: Sequence[str], target_s: float) -> tuple[str, str]:
    """The matcher of the smallest bucket bound >= ``target_s`` (``le`` as the gateway writes it, and without a
    trailing ``.0``, as newer Prometheus versions normalise it), and the bound as text."""
    for b in bounds:
        if b != "+Inf" and float(b) >= target_s - 1e-12:
            alt = b[:-2] if b.endswith(".0") else None
            return (f"le=~{_q(f'{b}|{alt}')}" if alt else f"le={_q(b)}"), b
    return 'le="+Inf"', "+Inf"


def _gateway_bounds() -> dict[str, list[str]]:
    """The ``le`` values of the gateway's TTFT and TPOT histograms, from the gateway's own metric objects."""
    from pdctl.gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    m.ttft.labels("disagg")
    m.tpot.labels("disagg")
    out: dict[str, list[str]] = {}
    for family in m.registry.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                out.setdefault(s.name.removesuffix("_bucket"), []).append(s.labels["le"])
    return out


@dataclass(frozen=True, slots=True)
class _Slo:
    objective: float  # share of requests that must meet the target
    burn: float  # the miss ratio both windows must exceed: twice the budget, at most 1
    ttft_le: str
    ttft_bound: str
    tpot_le: str
    tpot_bound: str


def _slo(dep: Deployment) -> _Slo:
    bounds = _gateway_bounds()
    objective = 0.9 if dep.slo.p90 else 0.99  # as `pdctl bench`'s goodput (cli/bench_view.py)
    ttft_le, ttft_b = _le(bounds["pdctl_ttft_seconds"], dep.slo.ttft_ms / 1000)
    tpot_le, tpot_b = _le(bounds["pdctl_tpot_seconds"], dep.slo.tpot_ms / 1000)
    return _Slo(objective, min(1.0, round(2 * (1 - objective), 6)), ttft_le, ttft_b, tpot_le, tpot_b)


def recording_rules(dep: Deployment) -> list[dict[str, Any]]:
    """The recording rules: ``pdctl:<what>:<window>``, each keeping ``deployment`` (and path/role/instance)."""
    d = f"deployment={_q(dep.cluster.name)}"
    slo = _slo(dep)
    rules: list[dict[str, Any]] = [
        {"record": "pdctl:requests:rate5m",
         "expr": f"sum by (deployment, path, status) (rate(pdctl_requests_total{{{d}}}[5m]))"},
    ]  # fmt: skip
    for metric, name in (("pdctl_ttft_seconds", "ttft_seconds"), ("pdctl_tpot_seconds", "tpot_seconds")):
        for q in (0.5, 0.9, 0.99):
            rules.append({
                "record": f"pdctl:{name}:p{round(q * 100)}_5m",
                "expr": f"histogram_quantile({q}, sum by (deployment, path, le) (rate({metric}_bucket{{{d}}}[5m])))",
            })  # fmt: skip
    rules += [
        {"record": "pdctl:leg_seconds:p90_5m",
         "expr": f"histogram_quantile(0.9, sum by (deployment, leg, le) (rate(pdctl_leg_seconds_bucket{{{d}}}[5m])))"},
        {"record": "pdctl:pd_fallbacks:rate5m",
         "expr": f"sum by (deployment, reason) (rate(pdctl_pd_fallback_total{{{d}}}[5m]))"},
        {"record": "pdctl:pd_decisions:rate5m",
         "expr": f"sum by (deployment, path, reason) (rate(pdctl_pd_decisions_total{{{d}}}[5m]))"},
        {"record": "pdctl:rejected:rate5m",
         "expr": f"sum by (deployment, reason) (rate(pdctl_rejected_total{{{d}}}[5m]))"},
        {"record": "pdctl:kv_bytes_per_second:rate1m",
         "expr": f"sum by (deployment, role, instance) (rate(vllm:nixl_bytes_transferred_sum{{{d}}}[1m]))"},
        {"record": "pdctl:kv_transfers_per_second:rate1m",
         "expr": f"sum by (deployment, role, instance) (rate(vllm:nixl_bytes_transferred_count{{{d}}}[1m]))"},
        {"record": "pdctl:kv_transfer_seconds:p90_5m",
         "expr": "histogram_quantile(0.9, sum by (deployment, role, instance, le) "
                 f"(rate(vllm:nixl_xfer_time_seconds_bucket{{{d}}}[5m])))"},
        {"record": "pdctl:kv_transfer_failures:rate5m",
         "expr": f"sum by (deployment, role, instance) (rate(vllm:nixl_num_failed_transfers_total{{{d}}}[5m]))"},
        {"record": "pdctl:kv_expired_requests:rate5m",
         "expr": f"sum by (deployment, role, instance) (rate(vllm:nixl_num_kv_expired_reqs_total{{{d}}}[5m]))"},
        {"record": "pdctl:prefix_cache_hit_ratio:rate5m",
         "expr": f"sum by (deployment, role, instance) (rate(vllm:prefix_cache_hits_total{{{d}}}[5m])) / "
                 f"(sum by (deployment, role, instance) (rate(vllm:prefix_cache_queries_total{{{d}}}[5m])) > 0)"},
        {"record": "pdctl:prompt_tokens_by_source:rate5m",
         "expr": "sum by (deployment, role, instance, source) "
                 f"(rate(vllm:prompt_tokens_by_source_total{{{d}}}[5m]))"},
    ]  # fmt: skip
    rules += signal_rules(dep)  # what the autoscalers of `render k8s --autoscale` read
    for name, metric, le in (("ttft", "pdctl_ttft_seconds", slo.ttft_le), ("tpot", "pdctl_tpot_seconds", slo.tpot_le)):
        for window in ("5m", "1h"):
            good = f"sum by (deployment) (rate({metric}_bucket{{{d},{le}}}[{window}]))"
            total = f"sum by (deployment) (rate({metric}_count{{{d}}}[{window}]))"
            rules.append({"record": f"pdctl:{name}_slo_miss_ratio:rate{window}", "expr": f"1 - {good} / ({total} > 0)"})
    return rules


def alerts(dep: Deployment) -> tuple[Alert, ...]:
    """The alert rules; each one's runbook is ``docs/troubleshooting.md#<name in lower case>``."""
    d = f"deployment={_q(dep.cluster.name)}"
    slo = _slo(dep)
    prefill_seqs = [w.max_num_seqs for w in dep.prefill if w.max_num_seqs]
    queue = min(prefill_seqs) if prefill_seqs else 0
    pct = f"{slo.objective:.0%}"
    return (
        Alert(
            "PdctlSilentFallback",
            f"sum by (deployment, reason) (rate(pdctl_pd_fallback_total{{{d}}}[5m])) > 0",
            "5m", "warning",
            "Decode is recomputing prompts: prefill returns no usable KV ({{ $labels.reason }})",
            "The gateway sends PD requests to decode without usable kv_transfer_params from prefill "
            "(reason {{ $labels.reason }}). Answers are still 200, but every prompt is prefilled twice.",
        ),
        Alert(
            "PdctlKvTransferFailures",
            f"sum by (deployment, role, instance) (increase(vllm:nixl_num_failed_transfers_total{{{d}}}[10m])) > 2",
            "0s", "warning",
            "NIXL transfers fail on {{ $labels.instance }}",
            "{{ $labels.instance }} ({{ $labels.role }}) counted more than 2 failed NIXL transfers in 10 minutes "
            "(handshake, transfer or notification failures). Requests whose KV could not be loaded failed or "
            "were recomputed.",
        ),
        Alert(
            "PdctlKvExpired",
            f"sum by (deployment, role, instance) (increase(vllm:nixl_num_kv_expired_reqs_total{{{d}}}[15m])) > 0",
            "0s", "warning",
            "Prefill {{ $labels.instance }} released KV that decode never pulled",
            "{{ $labels.instance }} held KV blocks for requests whose decode leg never read them, until the lease "
            "expired: decode cannot reach prefill's side channel, or decode legs are lost.",
        ),
        Alert(
            "PdctlTtftSloBurn",
            f"pdctl:ttft_slo_miss_ratio:rate1h{{{d}}} > {slo.burn:g} and pdctl:ttft_slo_miss_ratio:rate5m{{{d}}} "
            f"> {slo.burn:g}",
            "2m", "critical",
            f"TTFT misses its target for more than {slo.burn * 100:g}% of requests",
            f"The SLO is {pct} of streamed requests with TTFT <= {dep.slo.ttft_ms:g} ms (gateway bucket "
            f"le={slo.ttft_bound}); over both the last hour and the last 5 minutes more than {slo.burn:.0%} missed "
            "it, twice the error budget.",
        ),
        Alert(
            "PdctlTpotSloBurn",
            f"pdctl:tpot_slo_miss_ratio:rate1h{{{d}}} > {slo.burn:g} and pdctl:tpot_slo_miss_ratio:rate5m{{{d}}} "
            f"> {slo.burn:g}",
            "2m", "critical",
            f"TPOT misses its target for more than {slo.burn * 100:g}% of requests",
            f"The SLO is {pct} of streamed requests with TPOT <= {dep.slo.tpot_ms:g} ms (gateway bucket "
            f"le={slo.tpot_bound}); over both the last hour and the last 5 minutes more than {slo.burn:.0%} missed "
            "it, twice the error budget.",
        ),
        Alert(
            "PdctlProcessDown",
            f"up{{{d}}} == 0",
            "1m", "critical",
            "{{ $labels.role }} {{ $labels.instance }} does not answer /metrics",
            "Prometheus cannot scrape {{ $labels.instance }} ({{ $labels.role }}): the process is down, hung, or "
            "unreachable from Prometheus.",
        ),
        Alert(
            "PdctlProcessRestarting",
            f"changes(process_start_time_seconds{{{d}}}[15m]) >= 3 or changes(up{{{d}}}[15m]) >= 6",
            "0s", "critical",
            "{{ $labels.role }} {{ $labels.instance }} restarts in a loop",
            "{{ $labels.instance }} started 3 times or more in 15 minutes (or went down and up 3 times): the "
            "supervisor restarts it and it dies again.",
        ),
        Alert(
            "PdctlPrefillQueueGrowing",
            f"sum by (deployment, instance) (vllm:num_requests_waiting{{{d},role=\"prefill\"}}) > {queue} and "
            f"sum by (deployment, instance) (deriv(vllm:num_requests_waiting{{{d},role=\"prefill\"}}[5m])) > 0",
            "10m", "warning",
            "Requests pile up in prefill {{ $labels.instance }}'s queue",
            f"More than {queue} requests wait on {{{{ $labels.instance }}}} and the queue kept growing for 10 "
            "minutes: prefill cannot keep up with the arrival rate.",
        ),
        Alert(
            "PdctlCapacityRejections",
            f"sum by (deployment) (rate(pdctl_rejected_total{{{d},reason=~{_q(CAPACITY_REASONS)}}}[5m])) / "
            f"(sum by (deployment) (rate(pdctl_accepted_total{{{d}}}[5m])) > 0) > 0.05",
            "5m", "warning",
            "The gateway turns away more than 5% of requests for lack of capacity",
            "Requests are answered 503/429 before any worker call because no instance is available, "
            "max_concurrency is reached, or admission predicts an SLO miss (pdctl_rejected_total reasons "
            f"{CAPACITY_REASONS}).",
        ),
        *(Alert(
            f"Pdctl{role.title()}UnderProvisioned",
            f"max by (deployment) (pdctl_advice_replicas{{{d},role=\"{role}\",of=\"recommended\"}}) > "
            f"max by (deployment) (pdctl_advice_replicas{{{d},role=\"{role}\",of=\"current\"}})",
            "10m", "warning",
            f"{role.title()} is under-provisioned for the {target} SLO (the gateway's advice)",
            f"For 10 minutes the gateway's advice (slo.capacity_profile: pdctl advise's model on the last window's "
            f"traffic) has needed more {role} instances than serve: at this traffic {target} misses "
            f"{ms:g} ms. pdctl_advice_ttft_seconds and pdctl_advice_tpot_seconds hold the predictions now and at the "
            "advised counts.",
        ) for role, target, ms in (("prefill", "TTFT", dep.slo.ttft_ms), ("decode", "TPOT", dep.slo.tpot_ms))),
        Alert(
            "PdctlKvEventsRejected",
            f"sum by (deployment, event) (increase(pdctl_kv_events_total{{{d},event=~\"subscriber_error|malformed\"}}"
            "[10m])) > 0",
            "0s", "warning",
            "The gateway drops KV cache events ({{ $labels.event }})",
            "The gateway's KV events subscriber failed (subscriber_error: it listens again a second later, the "
            "approximate view routes meanwhile) or dropped messages it could not read or apply (malformed): a "
            "worker publishes what pdctl does not know, or someone else reaches the events port.",
        ),
    )  # fmt: skip


def _scrape_configs(dep: Deployment, plan: Plan, options: MonitoringOptions) -> list[dict[str, Any]]:
    name = dep.cluster.name
    found = targets(plan)
    jobs: list[dict[str, Any]] = []
    for job, role_targets in (("workers", [t for t in found if t.role != "gateway"]),
                              ("gateway", [t for t in found if t.role == "gateway"])):  # fmt: skip
        if not role_targets:
            continue
        cfg: dict[str, Any] = {"job_name": f"pdctl-{name}-{job}", "metrics_path": "/metrics",
                               "scheme": role_targets[0].scheme}  # fmt: skip
        if job == "gateway" and _gateway_needs_key(dep):
            cfg["authorization"] = {"type": "Bearer", "credentials_file": options.gateway_key_file}
        if options.file_sd:
            cfg["file_sd_configs"] = [{"files": [f"targets/{job}.json"]}]
        else:
            cfg["static_configs"] = [{"targets": [t.address], "labels": t.labels(name)} for t in role_targets]
        jobs.append(cfg)
    return jobs


def _gateway_needs_key(dep: Deployment) -> bool:
    """The gateway asks for a key on /metrics unless it listens on loopback or ``metrics_public`` is set."""
    g = dep.gateway
    return not g.metrics_public and g.listen_host not in _LOOPBACK


def _prometheus_yml(dep: Deployment, plan: Plan, options: MonitoringOptions) -> dict[str, Any]:
    interval = options.scrape_interval_s
    return {
        "global": {
            "scrape_interval": f"{interval}s",
            "scrape_timeout": f"{min(10, interval)}s",
            "evaluation_interval": f"{options.evaluation_interval_s}s",
        },
        "rule_files": ["rules/pdctl-recording.yml", "rules/pdctl-alerts.yml"],
        "scrape_configs": _scrape_configs(dep, plan, options),
    }


# ---- files --------------------------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    pass


def _dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1_000_000)


def _group(name: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"groups": [{"name": name, "rules": rules}]}


def render(dep: Deployment, options: MonitoringOptions | None = None, plan: Plan | None = None) -> Rendered:
    """Every file of the monitoring folder for ``dep`` (``plan``: the plan to take the targets from)."""
    opts = options or MonitoringOptions()
    # Only names, roles and URLs are read: no need to probe the engine's vLLM.
    plan = plan if plan is not None else build_plan(dep, VllmInstall(None, None))
    name = dep.cluster.name
    header = f"# Rendered by `pdctl render monitoring` for deployment {name!r} from {dep.config_path}.\n"
    found = targets(plan)
    sd = {
        job: [{"targets": [t.address], "labels": t.labels(name)} for t in found if (t.role == "gateway") == gw]
        for job, gw in (("workers", False), ("gateway", True))
    }
    the_alerts = alerts(dep)
    files = {
        "prometheus.yml": header + _dump(_prometheus_yml(dep, plan, opts)),
        "targets/workers.json": json.dumps(sd["workers"], indent=2) + "\n",
        "targets/gateway.json": json.dumps(sd["gateway"], indent=2) + "\n",
        "rules/pdctl-recording.yml": header + _dump(_group(f"pdctl-{name}-recording", recording_rules(dep))),
        "rules/pdctl-alerts.yml": header
        + _dump(_group(f"pdctl-{name}-alerts", [a.rule(opts.runbook, opts.alert_for) for a in the_alerts])),
        "grafana/pdctl.json": json.dumps(dashboard(dep), indent=2) + "\n",
    }
    notes: list[str] = []
    if _gateway_needs_key(dep):
        notes.append(
            f"the gateway asks for a key on /metrics (it listens on {dep.gateway.listen_host}): put one of its "
            f"keys in {opts.gateway_key_file} beside prometheus.yml, or set gateway.metrics_public"
        )
    slo = _slo(dep)
    for what, target_ms, bound in (
        ("ttft", dep.slo.ttft_ms, slo.ttft_bound),
        ("tpot", dep.slo.tpot_ms, slo.tpot_bound),
    ):
        if bound == "+Inf":
            notes.append(f"slo.{what}_ms = {target_ms:g} is above the gateway's largest bucket: the {what.upper()} "
                         "SLO rules count every request as meeting it")  # fmt: skip
        elif abs(float(bound) * 1000 - target_ms) > 1e-6:
            notes.append(f"slo.{what}_ms = {target_ms:g} is not a bucket bound of the gateway's histogram: the SLO "
                         f"rules count requests up to {float(bound) * 1000:g} ms as meeting it")  # fmt: skip
    return Rendered(files, tuple(notes), the_alerts)


def write(rendered: Rendered, folder: Path) -> list[Path]:
    """Write each file under ``folder`` (created); returns the paths written."""
    out: list[Path] = []
    for rel, text in rendered.files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        out.append(path)
    return out
