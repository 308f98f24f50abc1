"""`kubectl kustomize` (kubectl's built-in kustomize, what `kubectl apply -k` runs) on every `render k8s` folder of
the test configs, and on an overlay that changes replicas and images: the build holds the rendered objects and they
pass the same strict offline schema validation as tests/render/test_k8s.py's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdctl.render.k8s import KUBERNETES_VERSION, K8sOptions, render, write
from tests.render.test_k8s import CONFIGS, load

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None and os.environ.get("CI") != "true",  # .ci/run installs it: there, missing fails
    reason="kubectl (its built-in kustomize) is not installed; the same objects are schema-checked without it in "
    "test_k8s.py",
)


def kustomize_major() -> int:
    """The major version of kubectl's built-in kustomize (kubectl before 1.21 does not say it: kustomize 2)."""
    proc = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True, timeout=60, check=False)
    found = re.search(r"Kustomize Version: v(\d+)", proc.stdout)
    return int(found.group(1)) if found else 2


def build(path: Path) -> list[dict[str, Any]]:
    proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kustomize_builds_every_rendered_folder_into_valid_objects(name: str, tmp_path: Path) -> None:
    rendered = render(load(name))
    write(rendered, tmp_path)
    built = build(tmp_path)
    assert sorted(map(key, built)) == sorted(key(dict(d)) for d in rendered.manifests if d["kind"] != "Job")
    if name == "seed":  # namespace, ConfigMap, two Services + StatefulSets, the gateway's Deployment + Service
        assert len(built) == 8
    for doc in built:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
    (job,) = build(tmp_path / "verify")
    assert key(job) == ("Job", "pdctl-verify")
    assert kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_an_overlay_changes_replicas_and_images_and_stays_valid(tmp_path: Path) -> None:
    if kustomize_major() < 4:  # Debian 12's kubectl (1.20) carries kustomize 2: no `replicas:`, no folder resources
        pytest.skip("kubectl's kustomize is older than 4 (the overlay's `replicas:` and folder resources)")
    base = tmp_path / "k8s"
    write(render(load("2p2d"), K8sOptions(pdctl_image="pdctl:0.1.0")), base)
    overlay = tmp_path / "prod"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["../k8s"],
                "replicas": [{"name": "decode-1", "count": 3}, {"name": "prefill-0", "count": 2}],
                "images": [
                    {"name": "docker.io/vllm/vllm-openai", "newName": "registry.example/vllm", "newTag": "v0.32.0-rc"},
                    {"name": "pdctl", "newName": "registry.example/pdctl", "newTag": "0.1.0"},
                ],
            }
        ),
        encoding="utf-8",
    )
    built = {key(d): d for d in build(overlay)}
    sets = {n: built[("StatefulSet", n)]["spec"] for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")}
    assert {n: s["replicas"] for n, s in sets.items()} == {"prefill-0": 2, "prefill-1": 1, "decode-0": 1,
                                                           "decode-1": 3}  # fmt: skip
    for spec in sets.values():
        assert spec["template"]["spec"]["containers"][0]["image"] == "registry.example/vllm:v0.32.0-rc"
    gateway = built[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["image"] == "registry.example/pdctl:0.1.0"
    for doc in built.values():
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
