"""``pdctl render k8s --autoscale ADVICE.json``: per-role autoscaling beside the rendered StatefulSets, with KEDA
``ScaledObject``s (default) or plain ``HorizontalPodAutoscaler``s on external metrics (``--autoscaler hpa``).

Map::

    load_plan(path)                      the ``autoscale`` section of ``pdctl advise --json``'s output, validated
    signal_rules(dep)                    the two recording rules the scalers read (also in ``render monitoring``)
    scaled_objects(dep, ns, plan, url)   one ScaledObject per role's StatefulSet, reading Prometheus at ``url``
    autoscalers(dep, ns, plan)           one autoscaling/v2 HPA per role, on prometheus-adapter's external metrics
    adapter_rules(dep)                   prometheus-adapter's ``externalRules`` for those metrics (Helm values)
    with_autoscaling(rendered, ...)      the Rendered of render/k8s.py plus ``autoscale.yaml`` (the scalers) and
                                         ``autoscale-rules.yaml`` (a PrometheusRule) in its kustomization

Signals (docs/multi-node.md, "Autoscaling"), recording rules over the gateway's own metrics as
``pdctl render k8s --pod-monitor`` labels them (``deployment``; the gateway's ``role`` label becomes
``exported_role`` beside the target's):

* ``pdctl:prefill_queued_requests``: prefill legs in flight plus requests waiting in the gateway's prefill queue.
  Seconds of queued prefill work are that × ``tokens_per_request`` / V_P, against ``threshold_s`` per replica
  (llm-d's signal; the tokens per request are the advised workload's mean uncached prompt, a constant, as the
  gateway exports no token gauge). The HPA's target is the same threshold in requests: ``threshold_s`` × V_P /
  ``tokens_per_request``;
* ``pdctl:decode_streams``: the streams in flight to decode engines against ``streams_per_replica`` (the profile's
  streams at which a step still leaves headroom under the TPOT SLO), not ``vllm:kv_cache_usage_perc`` alone.

Scaling steps follow llm-d's: up by one pod a minute without a stabilisation window, down by one pod per five
minutes after five minutes of lower demand. Both scalers' ``AverageValue`` targets divide the signal by the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from pdctl.config.deployment import Deployment
from pdctl.errors import PdctlError
from pdctl.render.k8s import Rendered

__all__ = [
    "DEFAULT_PROMETHEUS",
    "AutoscaleError",
    "AutoscaleSection",
    "Autoscaler",
    "adapter_rules",
    "autoscalers",
    "load_plan",
    "scaled_objects",
    "signal_rules",
    "with_autoscaling",
]

Autoscaler = Literal["keda", "hpa"]

DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
SCALE_UP = {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}
SCALE_DOWN = {"stabilizationWindowSeconds": 300, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]}


class AutoscaleError(PdctlError):
    """An advice file without a usable ``autoscale`` section, or a deployment it cannot apply to."""


class PrefillScale(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    min: int
    max: int
    threshold_s: float
    tokens_per_request: float
    v_p: float


class DecodeScale(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    min: int
    max: int
    streams_per_replica: float


class AutoscaleSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``pdctl advise --json`` writes under ``autoscale``."""

    prefill: PrefillScale
    decode: DecodeScale

    def __post_init__(self) -> None:
        for role, r in (("prefill", self.prefill), ("decode", self.decode)):
            if not 1 <= r.min <= r.max:
                raise msgspec.ValidationError(f"{role}: need 1 <= min <= max, got {r.min}..{r.max}")
        if min(self.prefill.threshold_s, self.prefill.tokens_per_request, self.prefill.v_p) <= 0:
            raise msgspec.ValidationError("prefill: threshold_s, tokens_per_request and v_p must be > 0")
        if self.decode.streams_per_replica <= 0:
            raise msgspec.ValidationError("decode: streams_per_replica must be > 0")


class _AdviceFile(msgspec.Struct, frozen=True):
    autoscale: AutoscaleSection


def load_plan(path: Path) -> AutoscaleSection:
    """The ``autoscale`` section of an advice file (AutoscaleError naming the file and the field otherwise)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=_AdviceFile).autoscale
    except OSError as exc:
        raise AutoscaleError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except msgspec.ValidationError as exc:
        hint = "write it with `pdctl advise PROFILE --rate R ... --json > advice.json` (P/D advice at a rate)"
        raise AutoscaleError(f"{path}: no usable autoscale section: {exc}", hint=hint) from None
    except msgspec.DecodeError as exc:
        raise AutoscaleError(f"{path}: not JSON: {exc}") from None


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _sel(dep: Deployment) -> str:
    return f'deployment="{_quote(dep.cluster.name)}"'


def signal_rules(dep: Deployment) -> list[dict[str, Any]]:
    """The recording rules of the two signals: requests in prefill legs or waiting for one, and decode streams.
    ``or`` keeps both metrics' series (their label sets differ) for the sum."""
    d = _sel(dep)
    return [
        {"record": "pdctl:prefill_queued_requests",
         "expr": f'sum by (namespace, deployment) (pdctl_in_flight{{{d},exported_role="prefill"}} or '
                 f"pdctl_prefill_queue_waiting{{{d}}})"},
        {"record": "pdctl:decode_streams",
         "expr": f'sum by (namespace, deployment) (pdctl_in_flight{{{d},exported_role="decode"}})'},
    ]  # fmt: skip


def _queries(dep: Deployment, plan: AutoscaleSection) -> dict[str, str]:
    sel, p = _sel(dep), plan.prefill
    return {
        "prefill": f"(sum(pdctl:prefill_queued_requests{{{sel}}}) or vector(0)) * {p.tokens_per_request:g} / {p.v_p:g}",
        "decode": f"sum(pdctl:decode_streams{{{sel}}}) or vector(0)",
    }


def _one_group(dep: Deployment, role: str) -> str:
    """The StatefulSet of ``role``'s one group (AutoscaleError if it has several)."""
    group = dep.prefill if role == "prefill" else dep.decode
    if len(group) != 1:
        raise AutoscaleError(
            f"--autoscale: {len(group)} [[{role}]] groups; one group per role scales as one StatefulSet",
            hint=f"keep one [[{role}]] entry and let its replicas (and the autoscaler) set the count",
        )
    return group[0].name


def _meta(dep: Deployment, name: str, ns: str, role: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/part-of": dep.cluster.name, "app.kubernetes.io/managed-by": "pdctl",
              "pdctl.io/role": role}  # fmt: skip
    return {"name": name, "namespace": ns, "labels": labels}


def scaled_objects(dep: Deployment, ns: str, plan: AutoscaleSection, prometheus: str) -> list[dict[str, Any]]:
    """One ScaledObject per role, targeting that role's one StatefulSet (AutoscaleError if a role has several)."""
    queries = _queries(dep, plan)
    out: list[dict[str, Any]] = []
    for role, scale, threshold in (("prefill", plan.prefill, plan.prefill.threshold_s),
                                   ("decode", plan.decode, plan.decode.streams_per_replica)):  # fmt: skip
        name = _one_group(dep, role)
        trigger = {
            "type": "prometheus",
            "name": f"{role}-load",
            "metricType": "AverageValue",
            "metadata": {"serverAddress": prometheus, "query": queries[role], "threshold": f"{threshold:.3g}"},
        }
        out.append({
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": _meta(dep, f"{name}-autoscale", ns, role),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name},
                "minReplicaCount": scale.min,
                "maxReplicaCount": scale.max,
                "pollingInterval": 15,
                "cooldownPeriod": 300,
                "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleUp": SCALE_UP,
                                                                            "scaleDown": SCALE_DOWN}}},
                "triggers": [trigger],
            },
        })  # fmt: skip
    return out


def autoscalers(dep: Deployment, ns: str, plan: AutoscaleSection) -> list[dict[str, Any]]:
    """One autoscaling/v2 HorizontalPodAutoscaler per role on prometheus-adapter's external metric of its signal
    (:func:`adapter_rules`), the prefill target converted from seconds of work to requests."""
    p, d = plan.prefill, plan.decode
    targets = (("prefill", p.min, p.max, p.threshold_s * p.v_p / p.tokens_per_request),
               ("decode", d.min, d.max, d.streams_per_replica))  # fmt: skip
    out: list[dict[str, Any]] = []
    for role, low, high, target in targets:
        name = _one_group(dep, role)
        metric = "pdctl_prefill_queued_requests" if role == "prefill" else "pdctl_decode_streams"
        out.append({
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(dep, f"{name}-autoscale", ns, role),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name},
                "minReplicas": low,
                "maxReplicas": high,
                "metrics": [{"type": "External", "external": {
                    "metric": {"name": metric, "selector": {"matchLabels": {"deployment": dep.cluster.name}}},
                    "target": {"type": "AverageValue", "averageValue": f"{max(target, 0.001):.3f}"}}}],
                "behavior": {"scaleUp": SCALE_UP, "scaleDown": SCALE_DOWN},
            },
        })  # fmt: skip
    return out


def adapter_rules(dep: Deployment) -> dict[str, Any]:
    """prometheus-adapter's configuration for the HPAs: ``pdctl:<signal>`` exposed as the external metric
    ``pdctl_<signal>`` (the adapter adds the HPA's namespace to the series query)."""
    return {"externalRules": [{
        "seriesQuery": '{__name__=~"^pdctl:(prefill_queued_requests|decode_streams)$",deployment!=""}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
        "name": {"matches": "^pdctl:(.*)$", "as": "pdctl_${1}"},
        "metricsQuery": "sum by (deployment) (<<.Series>>{<<.LabelMatchers>>})",
    }]}  # fmt: skip


def _rule_object(dep: Deployment, ns: str) -> dict[str, Any]:
    group = {"name": f"pdctl-{dep.cluster.name}-autoscale", "rules": signal_rules(dep)}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": _meta(dep, "pdctl-autoscale-signals", ns, "gateway"), "spec": {"groups": [group]}}  # fmt: skip


def with_autoscaling(
    rendered: Rendered, dep: Deployment, plan: AutoscaleSection, prometheus: str, autoscaler: Autoscaler = "keda"
) -> Rendered:
    """``rendered`` plus ``autoscale.yaml`` (the scalers) and ``autoscale-rules.yaml`` (the signals' recording
    rules, a PrometheusRule), listed in the top kustomization; with ``hpa`` also ``prometheus-adapter.yaml``, the
    adapter's rules to merge into its configuration (not a manifest). Nothing added to an empty render."""
    if not rendered.files:
        return rendered
    files: dict[str, Sequence[Any]] = dict(rendered.files)
    ns = rendered.namespace
    if autoscaler == "hpa":
        files["autoscale.yaml"] = autoscalers(dep, ns, plan)
        files["prometheus-adapter.yaml"] = [adapter_rules(dep)]
    else:
        files["autoscale.yaml"] = scaled_objects(dep, ns, plan, prometheus)
    files["autoscale-rules.yaml"] = [_rule_object(dep, ns)]
    kust = dict(files["kustomization.yaml"][0])
    kust["resources"] = [*kust["resources"], "autoscale-rules.yaml", "autoscale.yaml"]
    files["kustomization.yaml"] = [kust]
    return Rendered(files, rendered.findings, rendered.namespace)
