"""`pdctl render k8s --autoscale`: KEDA ScaledObjects, valid against KEDA's own CRD schema (vendored:
tests/fixtures/keda/keda.sh_scaledobjects.yaml, kedacore/keda v2.20.2, config/crd/bases), validated with jsonschema
against the CRD's openAPIV3Schema (kubernetes-validate knows no CRDs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pdctl import config
from pdctl.render.autoscale import AutoscaleError, load_plan, with_autoscaling
from pdctl.render.k8s import dump_yaml, render
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
    assert "autoscale.yaml" in rendered.files["kustomization.yaml"][0]["resources"]
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
    assert "* 512 / 30000" in ptrig["metadata"]["query"] and 'exported_role="prefill"' in ptrig["metadata"]["query"]
    assert f'deployment="{dep.cluster.name}"' in dtrig["metadata"]["query"]
    assert "kv_cache_usage" not in dtrig["metadata"]["query"]


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
