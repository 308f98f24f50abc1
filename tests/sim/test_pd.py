"""Two simulator workers driven through the two-leg protocol by hand (pdctl.vllm.protocol), against colocated output."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdctl.testing import SimProcess, start_sim
from pdctl.vllm.promtext import metric_value, samples
from pdctl.vllm.protocol import build_decode_body, build_prefill_body, check_kv_params

PROMPT = " ".join(f"word{i % 37} and stuff, line {i}." for i in range(60))


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimProcess]]:
    started: dict[str, SimProcess] = {}
    log_dir = str(tmp_path_factory.mktemp("sim"))

    def add(name: str, *args: str, role: str = "kv_both") -> SimProcess:
        started[name] = start_sim(list(args), log_dir, name=name, role=role)
        return started[name]

    add("prefill", role="kv_producer")
    add("decode", role="kv_consumer")
    add("prefill_corrupt", "--sim-fault", "corrupt-kv", role="kv_producer")
    add("prefill_noparams", "--sim-fault", "no-kv-params", role="kv_producer")
    add("decode_corrupt", "--sim-fault", "corrupt-kv", role="kv_consumer")
    try:
        yield started
    finally:
        for sp in started.values():
            sp.stop()


def _body(**kw: Any) -> dict[str, Any]:
    # A unique start keeps each test's prompt out of the blocks earlier tests left in the prefix caches.
    prompt = f"{uuid.uuid4().hex} {PROMPT}"
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    body.update(kw)
    return body


def _post(base: str, body: dict[str, Any], rid: str, path: str = "/v1/completions") -> dict[str, Any]:
    r = httpx.post(base + path, json=body, headers={"X-Request-Id": rid}, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _metric(base: str, name: str, **labels: str) -> float:
    value = metric_value(samples(httpx.get(base + "/metrics", timeout=10).text), name, **labels)
    assert value is not None, f"{name}{labels} not exported"
    return value


def _pd(prefill: SimProcess, decode: SimProcess, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    rid = uuid.uuid4().hex
    p = _post(prefill.url, build_prefill_body(body), rid)
    check = check_kv_params(p)
    d = _post(decode.url, build_decode_body(body, check.params if check.usable else None), rid)
    return p, d


def _colocated(worker: SimProcess, body: dict[str, Any]) -> list[int]:
    # A fresh cache_salt keeps the reference from hitting blocks the PD run left in decode's prefix cache.
    ref = _post(worker.url, {**body, "cache_salt": uuid.uuid4().hex}, uuid.uuid4().hex)
    ids: list[int] = ref["choices"][0]["token_ids"]
    return ids


def test_pd_output_equals_colocated_and_kv_really_moves(workers: dict[str, SimProcess]) -> None:
    prefill, decode = workers["prefill"], workers["decode"]
    body = _body()
    ext_before = _metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    p, d = _pd(prefill, decode, body)

    check = check_kv_params(p)
    assert check.usable, check
    params = p["kv_transfer_params"]
    assert params["remote_port"] == prefill.side_port
    assert params["remote_request_id"].startswith(p["id"] + "-0-")
    assert params["remote_num_tokens"] == p["usage"]["prompt_tokens"]
    assert p["usage"]["completion_tokens"] == 1

    pd_ids = d["choices"][0]["token_ids"]
    assert len(pd_ids) == 24
    assert pd_ids == _colocated(decode, body)
    assert pd_ids == _colocated(prefill, body)

    n = d["usage"]["prompt_tokens"]
    ext_after = _metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert ext_after - ext_before == n
    assert _metric(decode.url, "vllm:nixl_xfer_time_seconds_count") >= 1
    assert "NIXL compatibility check passed (hash: " in decode.output()


def test_pd_stream_matches_non_stream(workers: dict[str, SimProcess]) -> None:
    prefill, decode = workers["prefill"], workers["decode"]
    body = _body(max_tokens=8)
    _, d = _pd(prefill, decode, body)
    sbody = {**body, "stream": True, "stream_options": {"include_usage": True}}
    rid = uuid.uuid4().hex
    p = _post(prefill.url, build_prefill_body(sbody), rid)
    params = check_kv_params(p).params
    with httpx.stream("POST", decode.url + "/v1/completions", json=build_decode_body(sbody, params), timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == d["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_corrupt_kv_changes_output(workers: dict[str, SimProcess]) -> None:
    body = _body()
    _, d = _pd(workers["prefill_corrupt"], workers["decode"], body)
    assert d["choices"][0]["token_ids"] != _colocated(workers["decode"], body)


def test_corrupt_kv_on_decode_side_changes_output(workers: dict[str, SimProcess]) -> None:
    body = _body()
    _, d = _pd(workers["prefill"], workers["decode_corrupt"], body)
    assert d["choices"][0]["token_ids"] != _colocated(workers["decode_corrupt"], body)
    _, clean = _pd(workers["prefill"], workers["decode"], body | {"prompt": body["prompt"] + " again"})
    assert clean["choices"][0]["token_ids"] == _colocated(
        workers["decode"], body | {"prompt": body["prompt"] + " again"}
    )


def test_missing_params_is_a_silent_local_fallback(workers: dict[str, SimProcess]) -> None:
    decode = workers["decode"]
    body = _body()
    ext = _metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = _metric(decode.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
    p, d = _pd(workers["prefill_noparams"], decode, body)
    assert p["kv_transfer_params"] is None
    assert check_kv_params(p).reason == "missing"
    n = d["usage"]["prompt_tokens"]
    # Same text (decode recomputed the prompt itself) but no KV came over the link.
    assert _metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == ext
    assert _metric(decode.url, "vllm:prompt_tokens_by_source_total", source="local_compute") == local + n
    assert d["choices"][0]["token_ids"] == _colocated(decode, body)


def test_prefill_blocks_released_after_pull(workers: dict[str, SimProcess]) -> None:
    prefill, decode = workers["prefill"], workers["decode"]
    body = _body()
    rid = uuid.uuid4().hex
    p = _post(prefill.url, build_prefill_body(body), rid)
    params = check_kv_params(p).params
    _post(decode.url, build_decode_body(body, params), rid)
    # A second decode with the same params finds nothing to pull: vLLM's fail policy answers 500.
    r = httpx.post(decode.url + "/v1/completions", json=build_decode_body({**body, "cache_salt": "x"}, params))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == 500
    out = decode.output()
    assert "NIXL transfer failure: transfer_failed | Context: {" in out
    assert re.search(r"Failing 1 request\(s\) due to KV load failure \(failure_policy=fail, \d+ tokens", out)
