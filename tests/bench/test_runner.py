"""The runner and the report against an in-process fake server (httpx.MockTransport; no pdctl code faked)."""

from __future__ import annotations

import asyncio
import html
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.bench.engine_metrics import (
    engine_summary,
    kv_summary,
    metric_deltas,
    parse_metrics,
    prefix_cache_summary,
)
from pdctl.bench.html import render_html
from pdctl.bench.metrics import SLO
from pdctl.bench.plots import write_plots
from pdctl.bench.report import (
    best_swept_rate,
    compare,
    load_results,
    percentile_key,
    result_json,
    write_results,
)
from pdctl.bench.runner import (
    BenchError,
    BenchTarget,
    LiveStats,
    LoadShape,
    discover_model,
    run_ab,
    run_async,
    run_once,
    run_sweep,
    search_max_goodput_rate,
)
from pdctl.bench.workload import WorkloadSpec, make_workload

METRICS_TEMPLATE = """# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {n}
vllm:nixl_xfer_time_seconds_count{{engine="0",model_name="m"}} {n}
vllm:nixl_xfer_time_seconds_sum{{engine="0",model_name="m"}} {xfer}
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_count{{engine="0",model_name="m"}} {n}
vllm:nixl_bytes_transferred_sum{{engine="0",model_name="m"}} {bytes}
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="external_kv_transfer"}} {tokens}
vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="local_compute"}} 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} 1
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {itls}
vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {itls}
vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {itl_sum}
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} {n}
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="m"}} {e2e}
"""


class FakeServer:
    """An OpenAI-style streaming server whose TTFT grows with the requests in flight."""

    def __init__(
        self,
        *,
        ttft_s: float = 0.01,
        per_inflight_s: float = 0.0,
        itl_s: float = 0.002,
        path: str = "disagg",
        stall_s: float = 0.0,
    ):
        self.ttft_s, self.per_inflight_s, self.itl_s, self.path = ttft_s, per_inflight_s, itl_s, path
        # the first stream's second token comes stall_s late: one decode stall
        self.stall_s = stall_s
        self.started = 0
        self.inflight = 0
        self.max_inflight = 0
        self.requests: list[dict[str, Any]] = []
        self.served = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            n = self.served
            text = METRICS_TEMPLATE.format(
                n=n, xfer=0.005 * n, bytes=1000 * n, tokens=10 * n, itls=3 * n, itl_sum=0.006 * n, e2e=0.25 * n
            )
            return httpx.Response(200, text=text)
        body = json.loads(request.content)
        self.requests.append(body)
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream", "x-pd-path": self.path, "x-pd-prefill-ms": "3.0"},
            stream=_Stream(self, body["max_tokens"]),
        )


class _Stream(httpx.AsyncByteStream):
    def __init__(self, server: FakeServer, n: int) -> None:
        self.server, self.n = server, n

    async def __aiter__(self) -> Any:
        s = self.server
        s.inflight += 1
        s.started += 1
        stall = s.stall_s if s.started == 1 else 0.0
        s.max_inflight = max(s.max_inflight, s.inflight)
        await asyncio.sleep(s.ttft_s + s.per_inflight_s * (s.inflight - 1))
        for i in range(self.n):
            if i:
                await asyncio.sleep(s.itl_s + (stall if i == 1 else 0.0))
            yield b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
        usage = {"prompt_tokens": 7, "completion_tokens": self.n, "total_tokens": 7 + self.n}
        # Done before the last chunk: the client stops reading at [DONE] and never resumes this generator.
        s.served += 1
        s.inflight -= 1
        yield b'data: {"choices":[],"usage":' + json.dumps(usage).encode() + b"}\n\ndata: [DONE]\n\n"


def target(server: FakeServer, *, workload: str = "random", label: str = "", metrics: bool = False) -> BenchTarget:
    wl = make_workload(WorkloadSpec(workload, input_len=20, output_len=4))
    return BenchTarget(
        "http://fake",
        "m",
        wl,
        label=label,
        metrics_urls=("http://fake/metrics",) if metrics else (),
        transport=server.transport(),
    )


def test_open_loop_run_counts_and_warmup() -> None:
    server = FakeServer()
    live = LiveStats()
    run = run_async(run_once(target(server), LoadShape(rate=50.0, num_requests=20, warmup=2), live))
    assert len(server.requests) == 22  # warm-up requests went out ...
    assert len(run.results) == 20  # ... but are not measured
    s = run.summary
    assert (s.completed, s.failed) == (20, 0)
    assert live.completed == 20 and live.sent == 20 and len(live.ttfts_ms) == 20 and live.phase == "done"
    # the last request is scheduled at n / rate = 0.4 s, so the run cannot be shorter
    assert s.duration_s >= 0.38
    assert [r.scheduled_s for r in run.results] == sorted(r.scheduled_s for r in run.results)
    assert run.results[-1].scheduled_s == pytest.approx(0.4)
    assert s.paths == {"disagg": 20}
    assert s.prefill_leg.median == pytest.approx(3.0)
    assert all(b["ignore_eos"] and b["stream"] for b in server.requests)


def test_closed_loop_keeps_concurrency() -> None:
    server = FakeServer(ttft_s=0.03)
    run = run_async(run_once(target(server), LoadShape(concurrency=3, num_requests=12, warmup=0)))
    assert run.summary.completed == 12
    assert server.max_inflight == 3
    assert run.summary.max_concurrent_requests == 3


def test_rate_with_concurrency_cap_records_queue_time() -> None:
    server = FakeServer(ttft_s=0.05)
    run = run_async(run_once(target(server), LoadShape(rate=1000.0, concurrency=2, num_requests=6, warmup=0)))
    assert server.max_inflight == 2
    waited = sorted(r.queue_s for r in run.results)
    assert waited[-1] >= 0.05  # the last ones waited for a slot
    # waiting for a slot is queue time, not scheduling lag (both reported in ms)
    assert run.summary.queue.max == pytest.approx(waited[-1] * 1000)
    assert run.summary.lag.max < waited[-1] * 1000


def test_duration_bound_closed_loop() -> None:
    server = FakeServer(ttft_s=0.02)
    run = run_async(run_once(target(server), LoadShape(concurrency=2, num_requests=None, duration_s=0.3, warmup=0)))
    assert run.summary.completed >= 2
    # The loop starts no request once the duration is over. (Its send stamp comes a loop hop later, after the
    # client's task starts, so on a loaded machine it may land just past 0.3 s: the decision is what is tested.)
    assert all(r.scheduled_s < 0.3 for r in run.results)
    assert all(r.sent_s >= r.scheduled_s for r in run.results)


def test_duration_needs_rate_or_concurrency() -> None:
    with pytest.raises(BenchError, match="duration"):
        run_async(run_once(target(FakeServer()), LoadShape(num_requests=None, duration_s=1.0)))


def test_metric_deltas_and_kv_summary() -> None:
    server = FakeServer()
    run = run_async(run_once(target(server, metrics=True), LoadShape(rate=100.0, num_requests=5, warmup=1)))
    kv = kv_summary(run.metric_deltas)
    # warm-up happens before the first scrape: only the 5 measured requests show
    assert kv["kv_transfers"] == 5
    assert kv["kv_bytes"] == 5000
    assert kv["external_kv_tokens"] == 50
    assert kv["kv_xfer_ms_mean"] == pytest.approx(5.0)
    assert not any("vllm:num_requests_running" in k for d in run.metric_deltas.values() for k in d)


def test_engine_view_histogram_means_and_gauges_sampled_during_the_run() -> None:
    server = FakeServer()
    run = run_async(run_once(target(server, metrics=True), LoadShape(rate=20.0, num_requests=8, warmup=1)))
    engine = engine_summary(run.metric_deltas)["http://fake/metrics"]
    # the fake engine reports 3 gaps of 2 ms and 250 ms end to end per request: only the 8 measured ones
    assert engine["requests"] == 8
    assert engine["itl_ms"] == pytest.approx(2.0) and engine["e2el_ms"] == pytest.approx(250.0)
    gauges = run.gauges["http://fake/metrics"].stats()
    assert gauges["samples"] >= 1 and gauges["running_max"] == 3 and gauges["waiting_max"] == 1
    obj = result_json(run)
    assert obj["pdctl"]["engine"]["http://fake/metrics"]["itl_ms"] == pytest.approx(2.0)
    assert obj["pdctl"]["engine_gauges"]["http://fake/metrics"]["series"][0][1:] == [3.0, 1.0]
    page = render_html([run])
    running = _svgs(page)["Requests running on each engine, 20 req/s"]
    assert ">fake<" in running and "requests running" in running
    assert "own view (vLLM /metrics)" in page and "<td>fake</td>" in page and "http://fake" not in page


def test_engine_view_leaves_out_the_tpot_of_one_token_legs() -> None:
    # vLLM 0.32 on PD's prefill: every request finishes after one token and is observed with a TPOT of 0
    tpot, e2e = "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds"
    deltas = {"P": {f"{tpot}_count": 6.0, f"{tpot}_sum": 0.0, f"{e2e}_count": 6.0, f"{e2e}_sum": 0.3}}
    assert engine_summary(deltas) == {"P": {"e2el_ms": pytest.approx(50.0), "requests": 6.0}}


def test_parse_metrics_drops_engine_labels_and_buckets() -> None:
    parsed = parse_metrics(METRICS_TEMPLATE.format(n=2, xfer=0.5, bytes=10, tokens=4, itls=0, itl_sum=0, e2e=0))
    assert parsed["vllm:nixl_xfer_time_seconds_count"] == 2
    assert parsed["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"] == 4
    assert not any("bucket" in k for k in parsed)
    assert metric_deltas({"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 2.0, "c": 1.0}) == {"a": 2.0, "c": 1.0}


def test_fallback_warning() -> None:
    server = FakeServer(path="fallback")
    run = run_async(run_once(target(server), LoadShape(rate=100.0, num_requests=3, warmup=0)))
    assert any("fallback" in w for w in run.warnings)


def test_failures_are_counted_and_warned() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "overloaded", "code": "server_overloaded"}})

    wl = make_workload(WorkloadSpec("doc"))
    t = BenchTarget("http://fake", "m", wl, transport=httpx.MockTransport(refuse))
    run = run_async(run_once(t, LoadShape(rate=100.0, num_requests=4, warmup=0, slo=SLO(ttft_ms=100))))
    s = run.summary
    assert (s.completed, s.failed, s.rejected) == (0, 4, 4)
    assert s.slo_attainment == 0.0
    assert any("4 request(s) failed" in w for w in run.warnings)


def test_sweep_and_max_goodput_search() -> None:
    # TTFT = 10 ms + 30 ms per other request in flight: the SLO (100 ms) breaks as the rate grows.
    server = FakeServer(ttft_s=0.01, per_inflight_s=0.03, itl_s=0.005)
    shape = LoadShape(num_requests=16, warmup=0, slo=SLO(ttft_ms=100, attainment=0.9))
    runs = run_async(run_sweep(target(server), shape, [5.0, 1000.0]))
    assert [r.shape.rate for r in runs] == [5.0, 1000.0]
    assert runs[0].summary.slo_met is True
    assert runs[1].summary.slo_met is False
    search = run_async(
        search_max_goodput_rate(target(server), shape, start_rate=5.0, max_rate=2000.0, rel_tol=0.25, max_runs=10)
    )
    assert search.best_rate is not None
    met = {r.shape.rate: bool(r.summary.slo_met) for r in search.runs}
    assert met[search.best_rate]
    assert any(not ok and rate > search.best_rate for rate, ok in met.items())
    assert 5.0 <= search.best_rate < 2000.0


def _prompts(server: FakeServer) -> list[str]:
    return [str(b["messages"][0]["content"]) for b in server.requests]


def test_every_run_of_a_sweep_and_a_search_sends_prompts_no_earlier_run_sent() -> None:
    server = FakeServer()
    shape = LoadShape(num_requests=6, warmup=1, slo=SLO(ttft_ms=1000))
    runs = run_async(run_sweep(target(server), shape, [100.0, 200.0, 400.0]))
    run_search = run_async(search_max_goodput_rate(target(server), shape, start_rate=100.0, max_rate=400.0))
    prompts = _prompts(server)
    assert len(prompts) == 7 * (3 + len(run_search.runs)) == len(set(prompts))  # warm-ups included
    ids = [r.run_id for r in [*runs, *run_search.runs]]
    assert len(set(ids)) == len(ids) and all(len(i.split()) == 3 for i in ids)
    # Each run sends the seed's requests: the text after the tag, and the lengths, are the same every time.
    bodies = [p.split("] ", 1)[1] for p in prompts]
    assert bodies[:7] == bodies[7:14] == bodies[14:21]
    assert [r.prompt_len for r in runs[0].results] == [r.prompt_len for r in runs[2].results]
    assert result_json(runs[1])["pdctl"]["workload"]["run_id"] == runs[1].run_id
    assert all(runs[1].run_id.replace(" ", "-") in r.request_id for r in runs[1].results)


def test_a_given_run_id_repeats_a_run_exactly() -> None:
    first, second = FakeServer(), FakeServer()
    for server in (first, second):
        run_async(run_once(target(server), LoadShape(rate=100.0, num_requests=4), run_id="red blue green"))
    assert _prompts(first) == _prompts(second)
    assert _prompts(first)[1].startswith("[bench red blue green 0-0] ")


def test_discover_model_reads_the_first_listed_id_with_the_key() -> None:
    seen: list[str | None] = []

    def models(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if request.url.host == "listed":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}, {"id": "other"}]})
        if request.url.host == "locked":
            return httpx.Response(401, json={"error": "no key"})
        return httpx.Response(200, json=["not", "a", "model", "list"])

    transport = httpx.MockTransport(models)
    assert discover_model("http://listed/", "k", transport) == "tiny"
    assert seen == ["Bearer k"]
    for host in ("locked", "odd"):
        with pytest.raises(BenchError, match=f"cannot tell which model http://{host} serves") as err:
            discover_model(f"http://{host}", None, transport)
        assert err.value.hint is not None and "--model" in err.value.hint


def test_search_needs_slo() -> None:
    with pytest.raises(BenchError, match="SLO"):
        run_async(search_max_goodput_rate(target(FakeServer()), LoadShape(num_requests=2)))


def test_ab_runs_both_targets_with_the_same_requests() -> None:
    fast, slow = FakeServer(ttft_s=0.005), FakeServer(ttft_s=0.06)
    pair = run_async(
        run_ab(
            target(slow, label="colocated"),
            target(fast, label="pd"),
            LoadShape(num_requests=4, warmup=0, slo=SLO(ttft_ms=40)),
            [20.0],
        )
    )
    assert [r.target.label for r in pair.a] == ["colocated"] and [r.target.label for r in pair.b] == ["pd"]
    # The same requests behind each side's own tag: shared workers would otherwise serve B from A's cache.
    a_texts, b_texts = (_prompts(slow), _prompts(fast))
    assert [t.split("] ", 1)[1] for t in a_texts] == [t.split("] ", 1)[1] for t in b_texts]
    assert not set(a_texts) & set(b_texts)
    rows = {row.key: row for row in compare(result_json(pair.a[0]), result_json(pair.b[0]))}
    ttft = rows["mean_ttft_ms"]
    assert ttft.better == "B" and ttft.ratio == pytest.approx(ttft.b / ttft.a), ttft  # 5 ms against 60 ms a token
    assert rows["slo_attainment"].a == 0.0  # 60 ms is never within 40 ms, however fast the machine


VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls",
    "errors", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms", "mean_e2el_ms",
    "p99_e2el_ms",
}  # fmt: skip


def test_result_json_keys_units_and_roundtrip(tmp_path: Path) -> None:
    server = FakeServer(ttft_s=0.02)
    slo = SLO(ttft_ms=400, tpot_ms=40)
    run = run_async(run_once(target(server), LoadShape(rate=100.0, num_requests=5, warmup=0, slo=slo)))
    obj = result_json(run)
    assert VLLM_KEYS <= set(obj)
    assert obj["completed"] == 5 and obj["request_rate"] == 100.0
    # per-request arrays in seconds, statistics in ms
    assert obj["ttfts"][0] == pytest.approx(obj["mean_ttft_ms"] / 1000, rel=0.5)
    # In ms, not s: about the fake's 20 ms. Not exactly: uvloop's timers count whole milliseconds from the loop's
    # cached time, so by the bench's clock a sleep can end early (19.96 ms was seen in CI).
    assert obj["mean_ttft_ms"] >= 10.0
    assert obj["output_lens"] == [4] * 5 and obj["input_lens"] == [7] * 5
    assert obj["request_goodput"] is not None and obj["goodput"] == {"ttft": 400.0, "tpot": 40.0}
    assert obj["pdctl"]["slo_attainment"] == 1.0
    assert obj["pdctl"]["requests"]["pd_path"] == ["disagg"] * 5
    assert percentile_key(99.9, "itl") == "p99.9_itl_ms" and percentile_key(90, "ttft") == "p90_ttft_ms"
    inf = run_async(run_once(target(server), LoadShape(concurrency=1, num_requests=2, warmup=0)))
    assert result_json(inf)["request_rate"] == "inf"

    path = tmp_path / "r.json"
    write_results(path, [run])
    assert load_results(path)[0]["completed"] == 5
    write_results(path, [run, inf])
    assert [o["completed"] for o in load_results(path)] == [5, 2]
    json.loads(path.read_text())  # strict JSON (no NaN/Infinity)


def test_load_results_rejects_other_json(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(Exception, match="not a benchmark result"):
        load_results(path)


def _svgs(page: str) -> dict[str, str]:
    """The page's plots by title."""
    out = {}
    for chunk in page.split("<svg")[1:]:
        title = re.search(r'font-weight="bold">([^<]*)</text>', chunk)
        assert title is not None
        out[html.unescape(title.group(1))] = chunk.split("</svg>")[0]
    return out


def _y_ticks(svg: str) -> list[float]:
    return [float(v.replace(",", "")) for v in re.findall(r'text-anchor="end">([^<]*)</text>', svg)]


def test_html_report_of_a_sweep_has_every_rate_and_no_url() -> None:
    server = FakeServer(ttft_s=0.01)
    wl = make_workload(WorkloadSpec("mixed", short_len=10, long_len=50, output_len=4, long_fraction=0.3))
    t = BenchTarget("http://fake", "m", wl, transport=server.transport())
    shape = LoadShape(num_requests=12, warmup=0, slo=SLO(ttft_ms=400, tpot_ms=40))
    runs = run_async(run_sweep(t, shape, [50.0, 100.0]))
    page = render_html(runs, title="t <x>")
    assert page.startswith("<!DOCTYPE html>") and "t &lt;x&gt;" in page
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    plots = _svgs(page)
    assert set(plots) == {
        "Goodput vs request rate", "SLO attainment vs request rate", "TTFT p90 vs request rate",
        "TPOT p90 vs request rate", "TTFT CDF", "TPOT CDF", "ITL CDF", "E2EL CDF",
        "TPOT over time, 50 req/s", "TPOT over time, 100 req/s",
    }  # fmt: skip
    for metric in ("TTFT", "TPOT", "ITL", "E2EL"):  # every rate's curve, not only the last one's
        cdf = plots[f"{metric} CDF"]
        assert cdf.count("<polyline") == 2 and ">50 req/s<" in cdf and ">100 req/s<" in cdf
    assert max(_y_ticks(plots["SLO attainment vs request rate"])) == 100.0
    assert "long-prompt arrival" in plots["TPOT over time, 100 req/s"]
    assert "By request kind" in page and "<td>long</td>" in page


def test_html_report_of_an_ab_overlays_the_sides_at_every_rate() -> None:
    fast, slow = FakeServer(ttft_s=0.005), FakeServer(ttft_s=0.03)
    shape = LoadShape(num_requests=6, warmup=0, slo=SLO(ttft_ms=20))
    pair = run_async(run_ab(target(slow, label="colocated"), target(fast, label="pd"), shape, [20.0, 40.0]))
    runs = [x for ab in zip(pair.a, pair.b, strict=True) for x in ab]
    plots = _svgs(render_html(runs))
    for rate in ("20", "40"):
        for metric in ("TTFT", "TPOT", "ITL", "E2EL"):
            cdf = plots[f"{metric} CDF, {rate} req/s"]
            assert cdf.count("<polyline") == 2 and ">colocated<" in cdf and ">pd<" in cdf
        assert ">colocated<" in plots[f"TPOT over time, {rate} req/s"]
    goodput = plots["Goodput vs request rate"]
    assert ">colocated<" in goodput and ">pd<" in goodput and "goodput = rate" in goodput
    assert ">colocated<" in plots["Gaps between tokens over time, 20 req/s"]
    # Each side keeps its colour on every plot.
    colour = re.search(r'fill="(#[0-9a-f]{6})"/><text[^>]*>pd<', goodput)
    assert colour is not None
    assert all(f'fill="{colour.group(1)}"/><text' in p for t, p in plots.items() if "CDF" in t)


def test_a_decode_stall_shows_at_its_full_length_in_the_gaps_over_time() -> None:
    stalled, smooth = FakeServer(stall_s=0.4), FakeServer()
    shape = LoadShape(num_requests=4, warmup=0)
    pair = run_async(run_ab(target(stalled, label="colocated"), target(smooth, label="pd"), shape, [50.0]))
    plot = _svgs(render_html([pair.a[0], pair.b[0]]))["Gaps between tokens over time, 50 req/s"]
    # one ~400 ms gap among ~2 ms ones: the y axis reaches it (not clipped at a percentile), and segments that
    # wide are drawn in the stalled side's colour only
    assert 400.0 <= max(_y_ticks(plot)) <= 600.0
    wide = [
        colour
        for d, colour in re.findall(r'<path d="([^"]*)" fill="none" stroke="(#[0-9a-f]+)" stroke-width="2"', plot)
        for a, b in re.findall(r"M([0-9.]+) [0-9.]+H([0-9.]+)", d)
        if float(b) - float(a) > 20
    ]
    colocated = re.search(r'fill="(#[0-9a-f]{6})"/><text[^>]*>colocated<', plot)
    # (a loaded machine may add a second long gap on the stalled side; the smooth side draws none that wide)
    assert colocated is not None and wide and set(wide) == {colocated.group(1)}


def test_plots_as_files_and_the_best_swept_rate_per_side(tmp_path: Path) -> None:
    fast, slow = FakeServer(ttft_s=0.005), FakeServer(ttft_s=0.01, per_inflight_s=0.03)
    shape = LoadShape(num_requests=12, warmup=0, slo=SLO(ttft_ms=60, attainment=0.9))
    pair = run_async(run_ab(target(slow, label="colocated"), target(fast, label="pd"), shape, [5.0, 1000.0]))
    runs = [x for ab in zip(pair.a, pair.b, strict=True) for x in ab]
    # the slow side misses the SLO when all 12 arrive at once; the fast one meets it at both rates
    assert best_swept_rate(runs) == {"colocated": 5.0, "pd": 1000.0}
    page = render_html(runs)
    assert "Highest swept rate within the SLOs</b> (colocated): 5 req/s" in page
    written = write_plots(tmp_path / "plots", runs)
    names = sorted(p.name for p in written)
    assert "goodput-vs-rate.svg" in names and "tpot-over-time-5-req-s.svg" in names
    assert "ttft-cdf-1000-req-s.svg" in names and "itl-over-time-5-req-s.svg" in names
    assert len(names) == len(set(names)) == 4 + 2 * 4 + 2 + 2
    # each file is the report's own plot
    assert (tmp_path / "plots" / "goodput-vs-rate.svg").read_text() in page


def test_trace_replays_its_timestamps(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [(0.0, 5, 2), (0.1, 5, 2), (0.3, 8, 3)]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_len": i, "output_len": o}) + "\n" for t, i, o in rows))
    server = FakeServer()
    wl = make_workload(WorkloadSpec("trace", path=str(trace)))
    t = BenchTarget("http://fake", "m", wl, transport=server.transport())
    run = run_async(run_once(t, LoadShape(num_requests=None, warmup=0)))
    assert [r.scheduled_s for r in run.results] == pytest.approx([0.0, 0.1, 0.3])
    assert all(r.sent_s >= r.scheduled_s for r in run.results)
    assert [b["max_tokens"] for b in server.requests] == [2, 2, 3]


def test_prefix_cache_hit_rates_from_real_vllm_metrics() -> None:
    """vLLM 0.32 CPU's own /metrics after three prompts (739 + 8 + 302 tokens) sent over NIXL, each also re-run on
    decode as the colocated reference: prefill queried them once, decode twice, and decode's hits came over NIXL."""
    folder = Path(__file__).parent.parent / "fixtures" / "vllm-cpu"
    deltas = {
        role: metric_deltas({}, parse_metrics((folder / f"nixl-{role}.metrics.txt").read_text()))
        for role in ("prefill", "decode")
    }
    caches = prefix_cache_summary(deltas)
    assert caches["prefill"] == {"queries": 1049.0, "hits": 0.0, "hit_rate": 0.0, "external_queries": 1049.0,
                                 "external_hits": 0.0, "external_hit_rate": 0.0}  # fmt: skip
    assert caches["decode"]["queries"] == 2098.0 and caches["decode"]["external_hits"] == 1049.0
    assert caches["decode"]["external_hit_rate"] == 0.5
    assert prefix_cache_summary({"gateway": {"pdctl_requests_total": 3.0}}) == {}
