"""The workers' and the gateway's ``/metrics`` around and during a bench run.

* :func:`scrape` / :func:`parse_metrics` / :func:`metric_deltas`: each endpoint's counters (and histograms' sums and
  counts) before and after a run, as deltas; ``engine``/``model_name`` labels summed.
* :func:`kv_summary`: the KV-transfer and gateway counters' deltas, totalled over all endpoints.
* :func:`prefix_cache_summary`: per engine, its own prefix-cache hit rate over the run (``vllm:prefix_cache_hits``
  over ``vllm:prefix_cache_queries``, both in prompt tokens) and the hits of KV brought in by a connector
  (``vllm:external_prefix_cache_*``: on a PD decode, the prompt pulled from prefill).
* :func:`engine_summary`: per endpoint, the means of vLLM's own latency histograms (:data:`ENGINE_HISTOGRAMS`), to
  cross-check the client's TTFT/TPOT/ITL against the engines'.
* :func:`sample_gauges` / :class:`GaugeSeries`: the engines' batch gauges (``vllm:num_requests_running``/
  ``_waiting``) sampled every :data:`GAUGE_INTERVAL_S` while the run goes: a gauge read only before and after would
  show two idle engines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from pdctl.vllm.promtext import samples

__all__ = [
    "ENGINE_HISTOGRAMS",
    "GAUGE_INTERVAL_S",
    "GaugeSeries",
    "engine_summary",
    "kv_summary",
    "metric_deltas",
    "parse_metrics",
    "prefix_cache_summary",
    "sample_gauges",
    "scrape",
]

# vLLM 0.32's per-request latency histograms (vllm/v1/metrics/loggers.py), by what pdctl calls them. There is
# no ``vllm:time_per_output_token_seconds`` in 0.32: the per-request TPOT is ``request_time_per_output_token``.
ENGINE_HISTOGRAMS: dict[str, str] = {
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2el": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
}
# Counters (and histogram sums/counts) whose deltas tell what the KV link, the engines and the gateway did.
_METRIC_PREFIXES = (
    "vllm:nixl_", "vllm:prompt_tokens_by_source", "vllm:num_preemptions", "vllm:prefix_cache_",
    "vllm:external_prefix_cache_", "pdctl_", *ENGINE_HISTOGRAMS.values()
)  # fmt: skip
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
GAUGE_INTERVAL_S = 1.0
_IGNORED_LABELS = ("engine", "model_name", "le")


@dataclass(slots=True)
class GaugeSeries:
    """One endpoint's batch gauges sampled during a run: ``(seconds since the run started, running, waiting)``."""

    samples: list[tuple[float, float, float]] = field(default_factory=list)

    def stats(self) -> dict[str, float]:
        """Mean and max of the running and waiting requests over the samples (empty without samples)."""
        if not self.samples:
            return {}
        running = [s[1] for s in self.samples]
        waiting = [s[2] for s in self.samples]
        return {
            "samples": float(len(self.samples)),
            "running_mean": sum(running) / len(running),
            "running_max": max(running),
            "waiting_mean": sum(waiting) / len(waiting),
            "waiting_max": max(waiting),
        }


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"name{label=value,...}": value}`` for the counters pdctl tracks.

    ``engine``/``model_name`` labels are dropped (summed), ``_bucket``/``_created`` samples skipped.
    """
    out: dict[str, float] = {}
    for name, sample_labels, value in samples(text, _METRIC_PREFIXES):
        if name.endswith(("_bucket", "_created")):
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(sample_labels.items()) if k not in _IGNORED_LABELS)
        key = f"{name}{{{labels}}}" if labels else name
        out[key] = out.get(key, 0.0) + value
    return out


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after - before`` for every series present after the run (new series count from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v - before.get(k, 0.0) != 0.0}


def kv_summary(deltas: dict[str, dict[str, float]]) -> dict[str, float]:
    """Totals over all scraped endpoints: transfers, bytes, mean transfer ms, failures, token sources."""

    def total(prefix: str) -> float:
        return sum(v for d in deltas.values() for k, v in d.items() if k.startswith(prefix))

    count = total("vllm:nixl_xfer_time_seconds_count")
    out = {
        "kv_transfers": count,
        "kv_bytes": total("vllm:nixl_bytes_transferred_sum"),
        "kv_failed_transfers": total("vllm:nixl_num_failed_transfers"),
        "kv_expired_requests": total("vllm:nixl_num_kv_expired_reqs"),
        "external_kv_tokens": total("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"),
        "local_compute_tokens": total("vllm:prompt_tokens_by_source_total{source=local_compute}"),
        "local_cache_hit_tokens": total("vllm:prompt_tokens_by_source_total{source=local_cache_hit}"),
        "gateway_fallbacks": total("pdctl_pd_fallback_total"),
        "gateway_rejected": total("pdctl_rejected_total"),
        # routing.prefix_view = "exact": what each view counted as cached for the same decisions, and how many
        # decisions the approximate view would have made the other way (the drift between the views).
        "view_exact_cached_tokens": total("pdctl_pd_view_cached_tokens_total{view=exact}"),
        "view_approx_cached_tokens": total("pdctl_pd_view_cached_tokens_total{view=approx}"),
        "view_disagreements": total("pdctl_pd_view_disagreements_total"),
    }
    out["kv_xfer_ms_mean"] = 1000.0 * total("vllm:nixl_xfer_time_seconds_sum") / count if count else 0.0
    return out


def prefix_cache_summary(deltas: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per endpoint whose engine looked prompts up in its prefix cache during the run: ``queries`` and ``hits``
    (prompt tokens, vLLM 0.32's ``vllm:prefix_cache_queries_total``/``_hits_total``), ``hit_rate`` (hits /
    queries), and ``external_queries``/``external_hits``/``external_hit_rate`` for KV a connector supplied.
    Queries count every request's prompt once per admission (a preempted request again); hits are the tokens
    found in the engine's own cache."""
    out: dict[str, dict[str, float]] = {}
    for url, d in deltas.items():
        queries, hits = d.get("vllm:prefix_cache_queries_total", 0.0), d.get("vllm:prefix_cache_hits_total", 0.0)
        ext_q = d.get("vllm:external_prefix_cache_queries_total", 0.0)
        ext_h = d.get("vllm:external_prefix_cache_hits_total", 0.0)
        if queries <= 0 and ext_q <= 0:
            continue
        out[url] = {
            "queries": queries,
            "hits": hits,
            "hit_rate": hits / queries if queries > 0 else 0.0,
            "external_queries": ext_q,
            "external_hits": ext_h,
            "external_hit_rate": ext_h / ext_q if ext_q > 0 else 0.0,
        }
    return out


def engine_summary(deltas: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per endpoint that served requests during the run: how many (``requests``, vLLM's e2e count) and the
    mean of each of :data:`ENGINE_HISTOGRAMS` in ms (``ttft_ms``, ``tpot_ms``, ...), from the sums' and
    counts' deltas. On PD, prefill's TTFT is its whole leg and decode's starts when decode got the request."""
    out: dict[str, dict[str, float]] = {}
    for url, d in deltas.items():
        row: dict[str, float] = {}
        for short, name in ENGINE_HISTOGRAMS.items():
            count, total = d.get(f"{name}_count", 0.0), d.get(f"{name}_sum", 0.0)
            # vLLM observes a TPOT of 0 for a one-token output (PD's prefill leg): no decode step, no mean.
            if count > 0 and (total > 0 or short not in ("tpot", "itl")):
                row[f"{short}_ms"] = 1000.0 * total / count
        if row:
            row["requests"] = d.get(f"{ENGINE_HISTOGRAMS['e2el']}_count", 0.0)
            out[url] = row
    return out


async def sample_gauges(
    client: httpx.AsyncClient, urls: Sequence[str], t0: float, into: dict[str, GaugeSeries]
) -> None:
    """Append each URL's batch gauges to ``into`` every :data:`GAUGE_INTERVAL_S` until cancelled; an endpoint
    without them (a gateway, a server that is not vLLM) gets no series."""

    async def one(url: str) -> None:
        try:
            resp = await client.get(url, timeout=GAUGE_INTERVAL_S * 5)
        except httpx.HTTPError:
            return
        if resp.status_code != 200:
            return
        parsed = samples(resp.text, _GAUGES)
        if parsed:
            running = sum(v for n, _, v in parsed if n == _GAUGES[0])
            waiting = sum(v for n, _, v in parsed if n == _GAUGES[1])
            into.setdefault(url, GaugeSeries()).samples.append((time.perf_counter() - t0, running, waiting))

    while True:
        await asyncio.gather(*(one(u) for u in urls))
        await asyncio.sleep(GAUGE_INTERVAL_S)


async def scrape(
    client: httpx.AsyncClient, urls: Sequence[str], base_url: str, api_key: str | None
) -> dict[str, dict[str, float] | None]:
    """Each URL's metrics (None: unreadable); ``api_key`` goes to the URLs under ``base_url`` only (the target's
    own ``/metrics``: a gateway listening beyond loopback asks for one), never to other URLs."""
    own = f"{base_url}/" if api_key else None

    async def one(url: str) -> dict[str, float] | None:
        auth = {"Authorization": f"Bearer {api_key}"} if own and url.startswith(own) else {}
        try:
            resp = await client.get(url, timeout=10.0, headers=auth)
        except httpx.HTTPError:
            return None
        return parse_metrics(resp.text) if resp.status_code == 200 else None

    values = await asyncio.gather(*(one(u) for u in urls))
    return dict(zip(urls, values, strict=True))
