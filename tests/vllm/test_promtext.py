"""pdctl.vllm.promtext: Prometheus text read with prometheus_client's parser, on a real vLLM CPU /metrics body."""

from __future__ import annotations

from pathlib import Path

from pdctl.vllm.promtext import metric_value, samples

BODY = (Path(__file__).parent.parent / "fixtures" / "vllm-cpu" / "example-connector-decode.metrics.txt").read_text()


def test_real_vllm_body_sums_by_labels() -> None:
    parsed = samples(BODY)
    assert len(parsed) > 400
    total = metric_value(parsed, "vllm:prompt_tokens_by_source_total")
    by_source = [
        metric_value(parsed, "vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    ]
    assert total is not None and all(v is not None for v in by_source)
    assert total == sum(v for v in by_source if v is not None)
    assert metric_value(parsed, "vllm:prompt_tokens_by_source_total", source="nowhere") is None


def test_name_filter_keeps_exactly_the_samples_of_those_names() -> None:
    names = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")
    assert samples(BODY, names) == [s for s in samples(BODY) if s[0].startswith(names)]


def test_text_that_is_not_prometheus_reads_as_no_samples() -> None:
    assert samples("<html>502 Bad Gateway</html>") == []
    assert samples('x{a="1"} 2\nx{a="2"} 3\n') == [("x", {"a": "1"}, 2.0), ("x", {"a": "2"}, 3.0)]
