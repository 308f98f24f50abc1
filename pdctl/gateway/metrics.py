"""The gateway's Prometheus metrics (``pdctl_`` prefix), in a registry of its own (no module globals).

With ``gateway.workers > 1`` every gateway process runs in ``prometheus_client``'s multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` set by the parent before the process starts): each process writes its values
to files there and ``/metrics``, whichever process answers it, sums them (counters, histograms, the in-flight
gauges of live processes; a state gauge shows the largest value of the live processes).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = ["CONTENT_TYPE", "TOKEN_BUCKETS", "GatewayMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

M = TypeVar("M", bound=MetricWrapperBase)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.5, 3.0, 6.0, 12.0, 30.0, 60.0, 120.0)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
#: Token counts, 1 .. 131,072 in steps of √2: the advice's ISL / OSL shapes (tests/capacity/test_advisory.py: the
#: counts advised from these buckets equal those from the exact lengths).
TOKEN_BUCKETS = tuple(round(2 ** (i / 2), 1) for i in range(35))


class GatewayMetrics:
    """All metrics of one gateway app; ``render()`` is the ``/metrics`` body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdctl_requests", "Requests answered, by path and HTTP status.", ["path", "status"], registry=r
        )
        # Per key: labelled by the key's name from the keys file, never by the key.
        self.key_requests = Counter(
            "pdctl_key_requests", "Completion requests by key name and HTTP status ('-': no valid key).",
            ["key", "status"], registry=r,
        )  # fmt: skip
        self.key_tokens = Counter(
            "pdctl_key_tokens", "Tokens charged to each key's limits (prompt + max_tokens).", ["key"], registry=r
        )
        self.fallbacks = Counter(
            "pdctl_pd_fallback", "Requests served by decode without usable KV from prefill.", ["reason"],
            registry=r,
        )  # fmt: skip
        self.prefill_fallbacks = Counter(
            "pdctl_prefill_fallback", "PD requests no prefill could serve, by where they went (gateway.fallback).",
            ["to", "reason"], registry=r,
        )  # fmt: skip
        self.pd_decisions = Counter(
            "pdctl_pd_decisions",
            "routing.pd_mode = adaptive or auto: requests by path (local, whole, disagg) and reason.",
            ["path", "reason"], registry=r,
        )  # fmt: skip
        self.kv_events = Counter(
            "pdctl_kv_events", "routing.prefix_view = exact: KV cache events applied, by worker and event type; "
            "gap and restart: the worker's view started over; malformed: an unreadable message.",
            ["instance", "event"], registry=r,
        )  # fmt: skip
        self.view_cached_tokens = Counter(
            "pdctl_pd_view_cached_tokens", "routing.prefix_view = exact: prompt tokens cached on the chosen decode, "
            "by the view that counted them (approx: what the approximate view counted for the same requests).",
            ["view"], registry=r,
        )  # fmt: skip
        self.view_disagreements = Counter(
            "pdctl_pd_view_disagreements", "routing.prefix_view = exact: decisions the approximate view would have "
            "made the other way, by the exact view's path.", ["path"], registry=r,
        )  # fmt: skip
        self.cache_breaks = Counter(
            "pdctl_session_cache_breaks", "Agent sessions' turns whose prompt does not begin with the session's "
            "previous prompt, by where it first differs (system, tools, message, trailing_system); the session is in "
            "the access log, never a label.", ["at"], registry=r,
        )  # fmt: skip
        self.autopilot_ttft_ratio = Histogram(
            "pdctl_autopilot_ttft_ratio", "routing.pd_mode = auto: observed / predicted TTFT of each streamed "
            "request, by the path taken (local, whole, disagg): the predictor's error.", ["path"],
            buckets=_RATIO_BUCKETS, registry=r,
        )  # fmt: skip
        self.autopilot_tpot_ratio = Histogram(
            "pdctl_autopilot_tpot_ratio", "routing.pd_mode = auto: observed / predicted TPOT of each streamed "
            "request of two tokens or more, by the path taken (local, whole, disagg): the predictor's error.",
            ["path"], buckets=_RATIO_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill_queue_waiting = Gauge(
            "pdctl_prefill_queue_waiting", "routing.prefill_queue_tokens: requests waiting in the gateway for a "
            "prefill with room.", registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.prefill_queue_wait = Histogram(
            "pdctl_prefill_queue_wait_seconds", "routing.prefill_queue_tokens: how long requests waited for a "
            "prefill, by the rule that bound them (match, policy, idle).", ["rule"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Histogram(
            "pdctl_request_prompt_tokens", "Prompt tokens of each request a local worker answered.",
            buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.generation_tokens = Histogram(
            "pdctl_request_generation_tokens", "Output tokens of each request a local worker answered.",
            buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        # slo.capacity_profile: the advice for the last window's traffic (pdctl.gateway.advisor); one gateway
        # process computes it from every process's histograms, so the largest live value is the value.
        self.advice_replicas = Gauge(
            "pdctl_advice_replicas", "slo.capacity_profile: serving instances per role now (of=current) and the "
            "fewest that meet the SLO for the last window's traffic (of=recommended).", ["role", "of"], registry=r,
            multiprocess_mode="livemax",
        )  # fmt: skip
        self.advice_ttft, self.advice_tpot = (
            Gauge(f"pdctl_advice_{what.lower()}_seconds", f"slo.capacity_profile: predicted {what} for the last "
                  "window's traffic at the current and the recommended counts (+Inf: cannot keep up).",
                  ["of", "quantile"], registry=r, multiprocess_mode="livemax")
            for what in ("TTFT", "TPOT")
        )  # fmt: skip
        self.advice_rate = Gauge(
            "pdctl_advice_rate", "slo.capacity_profile: requests per second finished in the advice's window.",
            ["window"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.advice_status = Gauge(
            "pdctl_advice_status", "slo.capacity_profile: 1 for the advice's status (ok, over, under_prefill, "
            "under_decode, under_both, unreachable, idle), 0 for the others.", ["status"], registry=r,
            multiprocess_mode="livemax",
        )  # fmt: skip
        self.rejected = Counter("pdctl_rejected", "Requests rejected before any worker call.", ["reason"], registry=r)
        self.upstream_calls = Counter(
            "pdctl_upstream_calls", "Calls to the upstream channel, by outcome.", ["outcome"], registry=r
        )
        self.retries = Counter("pdctl_retries", "Retried calls, by leg.", ["leg"], registry=r)
        self.client_cancelled = Counter(
            "pdctl_client_cancelled", "Requests whose client disconnected, by phase.", ["phase"], registry=r
        )
        self.kv_release = Counter(
            "pdctl_kv_release", "Release legs sent after a client left between the legs.", ["outcome"], registry=r
        )
        self.stream_errors = Counter(
            "pdctl_stream_errors", "Streams ended with an SSE error event after headers.", ["reason"], registry=r
        )
        self.migrations = Counter(
            "pdctl_migrations", "Broken streams continued elsewhere (gateway.migration_limit), by target and outcome.",
            ["target", "outcome"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "pdctl_ttft_seconds", "Time to first token at the gateway.", ["path"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "pdctl_tpot_seconds", "Time per output token after the first, at the gateway.", ["path"],
            buckets=_TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.leg = Histogram(
            "pdctl_leg_seconds",
            "TTFT decomposition: prefill leg, handoff (decode request to response headers), first decode chunk.",
            ["leg"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "pdctl_request_duration_seconds", "Whole request duration.", ["path"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.in_flight = Gauge("pdctl_in_flight", "Requests in flight per instance.", ["instance", "role"], registry=r,
                               multiprocess_mode="livesum")  # fmt: skip
        self.healthy = Gauge("pdctl_instance_healthy", "1 when the instance is in the pool.", ["instance", "role"],
                             registry=r, multiprocess_mode="livemax")  # fmt: skip
        self.instances = Gauge(
            "pdctl_instances", "Worker instances in the pool, by role and state (warming, serving, draining).",
            ["role", "state"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.gateway_in_flight = Gauge("pdctl_gateway_in_flight", "Client requests in flight.", registry=r,
                                       multiprocess_mode="livesum")  # fmt: skip
        self.accepted = Counter(
            "pdctl_accepted", "Completion requests received; each ends in one pdctl_requests_total.", registry=r
        )
        self.tasks = Gauge("pdctl_asyncio_tasks", "asyncio tasks alive in the gateway's loop when scraped.",
                           registry=r, multiprocess_mode="livesum")  # fmt: skip
        self.ready = Gauge("pdctl_ready", "1 when /ready answers 200.", registry=r, multiprocess_mode="livemax")
        self._multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def child(self, metric: M, *values: str) -> M:
        """``metric.labels(*values)``, remembered: on every request's path a dict lookup instead of
        ``labels()``'s validation and lock (3 µs → 0.5 µs each, docs/performance.md, "History")."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def _merged(self) -> CollectorRegistry:
        if self._multiprocess_dir:
            merged = CollectorRegistry()
            MultiProcessCollector(merged, self._multiprocess_dir)  # type: ignore[no-untyped-call]
            return merged
        return self.registry

    def render(self) -> bytes:
        """The Prometheus text exposition (every gateway process's values, in multiprocess mode)."""
        return generate_latest(self._merged())

    def histogram(self, name: str) -> tuple[dict[float, float], float]:
        """Histogram ``name``'s cumulative bucket counts by upper bound and its sum, over every gateway process
        (summed over labels)."""
        buckets: dict[float, float] = {}
        total = 0.0
        for family in self._merged().collect():
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name == f"{name}_bucket":
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value
                elif sample.name == f"{name}_sum":
                    total += sample.value
        return buckets, total
