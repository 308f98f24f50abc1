"""Manifests as YAML text, for ``pdctl render k8s`` and ``pdctl render compose``: multi-line strings (the
ConfigMap's files, hook scripts) in block style so they stay readable."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml

__all__ = ["dump_yaml"]


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings."""


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data and not data.endswith((" ", "\t")) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def dump_yaml(docs: Iterable[Mapping[str, Any]]) -> str:
    """Objects as one multi-document YAML text (``kubectl apply -f -``)."""
    return yaml.dump_all(
        [dict(d) for d in docs], Dumper=_Dumper, sort_keys=False, explicit_start=True, allow_unicode=True, width=120
    )
