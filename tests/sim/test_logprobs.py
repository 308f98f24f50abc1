"""The simulator's logprobs and /detokenize, in vLLM 0.32's shapes, read back by verify's proof parser."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdctl.testing import SimProcess, start_sim
from pdctl.verify.proof import parse_sample


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    sp = start_sim(["--served-model-name", "tiny", "--max-model-len", "256"], str(tmp_path_factory.mktemp("sim")))
    try:
        yield sp
    finally:
        sp.stop()


def _post(sp: SimProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(sp.url + path, json=body, timeout=30)


GREEDY = {"model": "tiny", "prompt": "explain the KV cache", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_completion_logprobs_shape_and_ids(sim: SimProcess) -> None:
    body = {**GREEDY, "logprobs": 3, "return_tokens_as_token_ids": True, "return_token_ids": True}
    r = _post(sim, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    ids = choice["token_ids"]
    assert len(ids) == 6 and len(lp["tokens"]) == 6 and len(lp["top_logprobs"]) == 6
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    for tid, chosen, top in zip(ids, lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 3 and all(k.startswith("token_id:") for k in top)
        # greedy: the chosen token is the most likely one, and the simulator never makes a near-tie
        assert top[f"token_id:{tid}"] == chosen == max(top.values())
        assert chosen - sorted(top.values())[-2] >= 0.5
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    sample = parse_sample(r.json())
    assert sample is not None and sample.steps is not None
    assert sample.tokens == tuple(ids) and all(s.margin is not None and s.margin >= 0.5 for s in sample.steps)


def test_logprobs_are_deterministic_and_absent_unless_asked(sim: SimProcess) -> None:
    body = {**GREEDY, "logprobs": 2}
    a, b = (_post(sim, "/v1/completions", body).json()["choices"][0]["logprobs"] for _ in range(2))
    assert a == b
    assert all(not k.startswith("token_id:") for k in a["top_logprobs"][0])  # text keys without the flag
    assert _post(sim, "/v1/completions", GREEDY).json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_shape(sim: SimProcess) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    content = _post(sim, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == entry["logprob"]


def test_too_many_logprobs_is_a_400_naming_the_field(sim: SimProcess) -> None:
    r = _post(sim, "/v1/completions", {**GREEDY, "logprobs": 21})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "logprobs" in err["message"] and "20" in err["message"]


def test_detokenize_round_trip(sim: SimProcess) -> None:
    choice = _post(sim, "/v1/completions", {**GREEDY, "return_token_ids": True}).json()["choices"][0]
    r = _post(sim, "/detokenize", {"model": "tiny", "tokens": choice["token_ids"]})
    assert r.status_code == 200 and r.json()["prompt"] == choice["text"]
    assert _post(sim, "/detokenize", {"model": "tiny", "tokens": "abc"}).status_code == 400
