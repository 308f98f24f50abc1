"""Reading Prometheus text (a ``/metrics`` body), with ``prometheus_client``'s own parser, in one place.

* :func:`samples`       -- every sample of a body as ``(name, labels, value)``
* :func:`metric_value`  -- the sum of the samples of one name whose labels include the given ones
* :func:`kv_cache_blocks` -- the blocks an engine's KV cache holds, from ``vllm:cache_config_info``

Names are the samples' names, suffixes included (``vllm:prompt_tokens_by_source_total``,
``..._seconds_count``). A body that is not Prometheus text reads as no samples: callers treat a missing
metric as "unknown", never as zero.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["CACHE_CONFIG_INFO", "Sample", "kv_cache_blocks", "metric_value", "samples"]

CACHE_CONFIG_INFO = "vllm:cache_config_info"
"""vLLM's info gauge of its ``CacheConfig``: one sample, whose labels are the config's fields as strings."""

Sample = tuple[str, dict[str, str], float]


def samples(text: str, names: Iterable[str] = ()) -> list[Sample]:
    """Prometheus text exposition -> ``(name, labels, value)`` samples; ``[]`` if it cannot be parsed.

    ``names``: only the samples whose names start with one of these; the other lines are dropped before
    parsing. The parser is pure Python and slow on a whole vLLM body, so loops that poll a few metrics
    pass their names (docs/performance.md, "Shared client-side parsers").
    """
    wanted = tuple(names)
    if wanted:
        text = "\n".join(line for line in text.splitlines() if line.startswith(wanted))
    try:
        return [(s.name, s.labels, float(s.value)) for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError, IndexError):
        return []


def metric_value(parsed: Iterable[Sample], name: str, **labels: str) -> float | None:
    """Sum of the samples called ``name`` whose labels include ``labels``; None if there is none."""
    total: float | None = None
    for n, lab, v in parsed:
        if n == name and all(lab.get(k) == want for k, want in labels.items()):
            total = (total or 0.0) + v
    return total


def kv_cache_blocks(parsed: Iterable[Sample]) -> int | None:
    """The blocks an engine's KV cache holds: ``num_gpu_blocks`` plus ``num_cpu_blocks`` (an offload tier; "None"
    without one) of :data:`CACHE_CONFIG_INFO`, summed over its engines (data parallel); None if not reported."""
    total: int | None = None
    for name, labels, _ in parsed:
        if name != CACHE_CONFIG_INFO:
            continue
        for field in ("num_gpu_blocks", "num_cpu_blocks"):
            value = labels.get(field, "")
            if value.isdigit():
                total = (total or 0) + int(value)
    return total
