"""``pdctl render k8s --autoscale ADVICE.json``: per-role KEDA ``ScaledObject``s beside the rendered StatefulSets.

Map::

    load_plan(path)                      the ``autoscale`` section of ``pdctl advise --json``'s output, validated
    scaled_objects(dep, ns, plan, url)   one ScaledObject per role's StatefulSet, reading Prometheus at ``url``
    with_autoscaling(rendered, ...)      the Rendered of render/k8s.py plus ``autoscale.yaml`` in its kustomization

Signals (docs/multi-node.md, "Autoscaling"), both from the gateway's own metrics as
``pdctl render k8s --pod-monitor`` labels them (``deployment``; the gateway's ``role`` label becomes
``exported_role`` beside the target's):

* prefill: seconds of queued prefill work, ``(prefill legs in flight + requests waiting in the gateway's prefill
  queue) × tokens_per_request / V_P``, against ``threshold_s`` per replica (llm-d's signal; the tokens per request
  are the advised workload's mean uncached prompt, a constant in the query, as the gateway exports no token gauge);
* decode: the streams in flight to decode engines against ``streams_per_replica`` (the profile's streams at
  which a step still leaves headroom under the TPOT SLO), not ``vllm:kv_cache_usage_perc`` alone.

Scaling steps follow llm-d's: up by one pod a minute without a stabilisation window, down by one pod per five
minutes after five minutes of lower demand. KEDA's ``AverageValue`` metric type divides the query by the threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from pdctl.config.deployment import Deployment
from pdctl.errors import PdctlError
from pdctl.render.k8s import Rendered

__all__ = [
    "DEFAULT_PROMETHEUS",
    "AutoscaleError",
    "AutoscaleSection",
    "load_plan",
    "scaled_objects",
    "with_autoscaling",
]

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


def _queries(dep: Deployment, plan: AutoscaleSection) -> dict[str, str]:
    sel = f'deployment="{_quote(dep.cluster.name)}"'
    legs = f'(sum(pdctl_in_flight{{{sel},exported_role="prefill"}}) or vector(0))'
    waiting = f"(sum(pdctl_prefill_queue_waiting{{{sel}}}) or vector(0))"
    p = plan.prefill
    return {
        "prefill": f"({legs} + {waiting}) * {p.tokens_per_request:g} / {p.v_p:g}",
        "decode": f'sum(pdctl_in_flight{{{sel},exported_role="decode"}}) or vector(0)',
    }


def scaled_objects(dep: Deployment, ns: str, plan: AutoscaleSection, prometheus: str) -> list[dict[str, Any]]:
    """One ScaledObject per role, targeting that role's one StatefulSet (AutoscaleError if a role has several)."""
    queries = _queries(dep, plan)
    out: list[dict[str, Any]] = []
    for role, group, scale, threshold in (
        ("prefill", dep.prefill, plan.prefill, plan.prefill.threshold_s),
        ("decode", dep.decode, plan.decode, plan.decode.streams_per_replica),
    ):
        if len(group) != 1:
            raise AutoscaleError(
                f"--autoscale: {len(group)} [[{role}]] groups; one group per role scales as one StatefulSet",
                hint=f"keep one [[{role}]] entry and let its replicas (and KEDA) set the count",
            )
        w = group[0]
        trigger = {
            "type": "prometheus",
            "name": f"{role}-load",
            "metricType": "AverageValue",
            "metadata": {"serverAddress": prometheus, "query": queries[role], "threshold": f"{threshold:.3g}"},
        }
        out.append({
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": {"name": f"{w.name}-autoscale", "namespace": ns,
                         "labels": {"app.kubernetes.io/part-of": dep.cluster.name,
                                    "app.kubernetes.io/managed-by": "pdctl", "pdctl.io/role": role}},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": w.name},
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


def with_autoscaling(rendered: Rendered, dep: Deployment, plan: AutoscaleSection, prometheus: str) -> Rendered:
    """``rendered`` plus ``autoscale.yaml``, listed in the top kustomization (nothing added to an empty render)."""
    if not rendered.files:
        return rendered
    files: dict[str, Sequence[Any]] = dict(rendered.files)
    files["autoscale.yaml"] = scaled_objects(dep, rendered.namespace, plan, prometheus)
    kust = dict(files["kustomization.yaml"][0])
    kust["resources"] = [*kust["resources"], "autoscale.yaml"]
    files["kustomization.yaml"] = [kust]
    return Rendered(files, rendered.findings, rendered.namespace)
