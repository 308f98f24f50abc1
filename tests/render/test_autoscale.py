"""`pdctl render k8s --autoscale`: KEDA ScaledObjects, valid against KEDA's own CRD schema (vendored:
tests/fixtures/keda/keda.sh_scaledobjects.yaml, kedacore/keda v2.20.2, config/crd/bases), validated with jsonschema
against the CRD's openAPIV3Schema (kubernetes-validate knows no CRDs); or HPAs (``--autoscaler hpa``), valid against
Kubernetes' own schema; both reading the recording rules of ``autoscale-rules.yaml``, which promtool checks."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdctl import config
from pdctl.render.autoscale import AutoscaleError, load_plan, with_autoscaling
from pdctl.render.k8s import KUBERNETES_VERSION, dump_yaml, render
from tests.conftest import REPO

CRD = REPO / "tests" / "fixtures" / "keda" / "keda.sh_scaledobjects.yaml"
SEED = REPO / "tests" / "fixtures" / "recipe"
PLAN = {"prefill": {"min": 2, "max": 5, "threshold_s": 0.25, "tokens_per_request": 512.0, "v_p": 30000.0},
        "decode": {"min": 1, "max": 3, "streams_per_replica": 40.0}}  # fmt: skip


def _schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _advice(tmp_path: Path, plan: Any = PLAN) -> Path:
    path = tmp_path / "advice.json"
    path.write_text(json.dumps({"verdict": "pd", "prefill": 2, "decode": 1, "autoscale": plan}))
    return path


def test_scaled_objects_validate_against_kedas_crd(tmp_path: Path) -> None:
    dep = config.load(SEED / "config.toml", SEED / "settings.json")
    rendered = with_autoscaling(render(dep), dep, load_plan(_advice(tmp_path)), "http://prom:9090")
    assert {"autoscale.yaml", "autoscale-rules.yaml"} <= set(rendered.files["kustomization.yaml"][0]["resources"])
    docs = [d for d in yaml.safe_load_all(dump_yaml(rendered.files["autoscale.yaml"])) if d]
    schema = _schema()
    for doc in docs:
        jsonschema.validate(doc, schema)
    by_role = {d["metadata"]["labels"]["pdctl.io/role"]: d for d in docs}
    prefill, decode = by_role["prefill"]["spec"], by_role["decode"]["spec"]
    names = {d["metadata"]["name"] for d in rendered.files["prefill.yaml"] if d["kind"] == "StatefulSet"}
    assert prefill["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": names.pop()}
    assert (prefill["minReplicaCount"], prefill["maxReplicaCount"]) == (2, 5)
    assert (decode["minReplicaCount"], decode["maxReplicaCount"]) == (1, 3)
    ptrig, dtrig = prefill["triggers"][0], decode["triggers"][0]
    assert ptrig["metadata"]["threshold"] == "0.25" and dtrig["metadata"]["threshold"] == "40"
    assert (
        "* 512 / 30000" in ptrig["metadata"]["query"] and "pdctl:prefill_queued_requests{" in ptrig["metadata"]["query"]
    )
    assert f'pdctl:decode_streams{{deployment="{dep.cluster.name}"}}' in dtrig["metadata"]["query"]
    assert "kv_cache_usage" not in dtrig["metadata"]["query"]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: .ci/run installs Debian's prometheus"
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def test_the_scalers_read_recording_rules_rendered_beside_them_and_in_render_monitoring(tmp_path: Path) -> None:
    """autoscale-rules.yaml is a PrometheusRule whose groups promtool accepts, recording the two series the KEDA
    queries and the adapter's rules name; render monitoring's rule file records them too (the same rules)."""
    from pdctl.render.monitoring import recording_rules

    dep = config.load(SEED / "config.toml", SEED / "settings.json")
    rendered = with_autoscaling(render(dep), dep, load_plan(_advice(tmp_path)), "http://p")
    (rule,) = rendered.files["autoscale-rules.yaml"]
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    r = _promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    recorded = {x["record"] for x in rule["spec"]["groups"][0]["rules"]}
    assert recorded == {"pdctl:prefill_queued_requests", "pdctl:decode_streams"}
    assert recorded <= {x["record"] for x in recording_rules(dep)}
    queries = " ".join(d["spec"]["triggers"][0]["metadata"]["query"] for d in rendered.files["autoscale.yaml"])
    assert all(name in queries for name in recorded)


def test_hpas_on_external_metrics_validate_and_match_the_adapters_rules(tmp_path: Path) -> None:
    """--autoscaler hpa: autoscaling/v2 HPAs (Kubernetes' schema, strict) on the external metrics that the
    rendered prometheus-adapter rules expose from the recording rules; the prefill target is the threshold in
    requests (threshold_s × V_P / tokens per request), the same scale point as KEDA's in seconds."""
    dep = config.load(SEED / "config.toml", SEED / "settings.json")
    rendered = with_autoscaling(render(dep), dep, load_plan(_advice(tmp_path)), "http://p", "hpa")
    hpas = {d["metadata"]["labels"]["pdctl.io/role"]: d for d in rendered.files["autoscale.yaml"]}
    for doc in hpas.values():
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
    prefill, decode = (hpas[r]["spec"] for r in ("prefill", "decode"))
    assert (prefill["minReplicas"], prefill["maxReplicas"], decode["minReplicas"], decode["maxReplicas"]) == (
        2,
        5,
        1,
        3,
    )
    pm, dm = prefill["metrics"][0]["external"], decode["metrics"][0]["external"]
    assert pm["target"]["averageValue"] == f"{0.25 * 30000 / 512:.3f}" and dm["target"]["averageValue"] == "40.000"
    assert pm["metric"]["selector"]["matchLabels"] == {"deployment": dep.cluster.name}
    (adapter,) = rendered.files["prometheus-adapter.yaml"]
    rule = adapter["externalRules"][0]
    for series, metric in (("pdctl:prefill_queued_requests", pm["metric"]["name"]),
                           ("pdctl:decode_streams", dm["metric"]["name"])):  # fmt: skip
        assert re.search(rule["seriesQuery"].split('"')[1], series)
        assert re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series) == metric
    assert "prometheus-adapter.yaml" not in rendered.files["kustomization.yaml"][0]["resources"]
    assert all(d.get("kind") for d in rendered.manifests)  # -o - prints manifests only


def test_the_schema_catches_a_broken_object(tmp_path: Path) -> None:
    """The validation can fail: a trigger without its type is refused by KEDA's schema."""
    dep = config.load(SEED / "config.toml", SEED / "settings.json")
    doc = with_autoscaling(render(dep), dep, load_plan(_advice(tmp_path)), "http://p").files["autoscale.yaml"][0]
    broken = json.loads(json.dumps(doc))
    del broken["spec"]["triggers"][0]["type"]
    with pytest.raises(jsonschema.ValidationError, match="'type' is a required property"):
        jsonschema.validate(broken, _schema())


def test_bad_advice_files_and_several_groups(tmp_path: Path) -> None:
    bad = dict(PLAN, decode={"min": 3, "max": 1, "streams_per_replica": 4})
    with pytest.raises(AutoscaleError, match=r"advice\.json: no usable autoscale section: decode: need 1 <= min"):
        load_plan(_advice(tmp_path, bad))
    path = tmp_path / "advice.json"
    path.write_text(json.dumps({"verdict": "colocated", "autoscale": None}))
    with pytest.raises(AutoscaleError, match="no usable autoscale section"):
        load_plan(path)
    two = REPO / "tests" / "configs" / "k8s-2p2d"
    dep = config.load(two / "config.toml", two / "settings.json")
    with pytest.raises(AutoscaleError, match=r"2 \[\[prefill\]\] groups"):
        with_autoscaling(render(dep), dep, load_plan(_advice(tmp_path)), "http://p")


def test_cli_writes_autoscale_yaml(tmp_path: Path, cli: Callable[..., Any]) -> None:
    out = tmp_path / "k8s"
    result = cli("render", "k8s", "-c", str(SEED / "config.toml"), "-s", str(SEED / "settings.json"), "-o", str(out),
                 "--autoscale", str(_advice(tmp_path)))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "ScaledObject" in (out / "autoscale.yaml").read_text()
    assert "autoscale.yaml" in (out / "kustomization.yaml").read_text()
    assert "PrometheusRule" in (out / "autoscale-rules.yaml").read_text()
    result = cli("render", "k8s", "-c", str(SEED / "config.toml"), "-s", str(SEED / "settings.json"), "-o", str(out),
                 "--autoscale", str(_advice(tmp_path)), "--autoscaler", "hpa")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "HorizontalPodAutoscaler" in (out / "autoscale.yaml").read_text()
    assert "externalRules" in (out / "prometheus-adapter.yaml").read_text()
    if shutil.which("kubectl"):  # `kubectl apply -k` builds the folder: the adapter's values are not a resource
        proc = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        kinds = {d["kind"] for d in yaml.safe_load_all(proc.stdout) if d}
        assert {"PrometheusRule", "HorizontalPodAutoscaler", "StatefulSet"} <= kinds and "ScaledObject" not in kinds
    result = cli("render", "k8s", "-c", str(SEED / "config.toml"), "-s", str(SEED / "settings.json"), "-o", str(out),
                 "--autoscale", str(_advice(tmp_path)), "--autoscaler", "vpa")  # fmt: skip
    assert result.exit_code != 0 and "keda or hpa" in result.output
