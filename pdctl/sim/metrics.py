"""vLLM's Prometheus metrics (names, labels ``model_name`` and ``engine``, buckets) on a private registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["SimMetrics"]

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)  # fmt: skip
_XFER = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_BYTES = tuple(float(2048 * 4**i) for i in range(12))
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class SimMetrics:
    """The metrics one simulated engine exports; ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        lab = ["model_name", "engine"]
        self._labels = {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lab, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*lab, *extra], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, lab, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL,
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _E2E)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _E2E
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _E2E
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _E2E
        )
        self.req_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tuple(map(float, _TOKENS))
        )
        self.req_gen_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tuple(map(float, _TOKENS))
        )
        self.nixl_xfer = hist(
            "vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", _XFER
        )
        self.nixl_post = hist(
            "vllm:nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV Cache transfers.", _XFER
        )
        self.nixl_bytes = hist(
            "vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.", _BYTES
        )
        self.nixl_failed = counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification failures.",
        )
        self.nixl_expired = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
        )
        self._cache_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            ["block_size", "enable_prefix_caching", "engine", "num_cpu_blocks", "num_gpu_blocks"], registry=r,
        )  # fmt: skip
        # Every labelled child exists from the start, as in vLLM, so a scrape shows zeros.
        for m in (self.running, self.waiting, self.kv_usage):
            m.labels(**self._labels).set(0)
        for c in (self.prompt_tokens, self.generation_tokens, self.nixl_failed, self.nixl_expired,
                  self.prefix_queries, self.prefix_hits):  # fmt: skip
            c.labels(**self._labels)
        for s in SOURCES:
            self.by_source.labels(source=s, **self._labels)
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason, **self._labels)
        hists = (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill_time, self.decode_time)
        for h in (*hists, self.req_prompt_tokens, self.req_gen_tokens, self.nixl_xfer, self.nixl_post, self.nixl_bytes):
            h.labels(**self._labels)

    def cache_config(self, block_size: int, num_gpu_blocks: int, prefix_caching: bool) -> None:
        """Publish the engine's cache configuration, as vLLM does once its KV cache is allocated."""
        labels = {"block_size": str(block_size), "enable_prefix_caching": str(prefix_caching), "engine": "0",
                  "num_cpu_blocks": "None", "num_gpu_blocks": str(num_gpu_blocks)}  # fmt: skip
        self._cache_info.labels(**labels).set(1)

    def g(self, gauge: Gauge) -> Gauge:
        """The labelled child of a gauge."""
        return gauge.labels(**self._labels)

    def c(self, counter: Counter, **extra: str) -> Counter:
        """The labelled child of a counter."""
        return counter.labels(**self._labels, **extra)

    def h(self, hist: Histogram) -> Histogram:
        """The labelled child of a histogram."""
        return hist.labels(**self._labels)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
