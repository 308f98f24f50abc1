"""The gateway in front of simulator workers (``python -m pdctl.sim``): the real PD protocol end to end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdctl.testing import SimProcess, start_sim
from pdctl.vllm.promtext import metric_value, samples
from tests.fakes.gateway_harness import KEY, GatewayThread, make_settings, wait_for

ARGS = ["--max-model-len", "1024", "--sim-profile", "fast"]


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[list[SimProcess]]:
    started: list[SimProcess] = []
    yield started
    for s in started:
        s.stop()


def _pair(
    sims: list[SimProcess], tmp_path: Path, prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()
) -> tuple[SimProcess, SimProcess]:
    p = start_sim([*ARGS, *prefill_args], str(tmp_path), name="prefill", model="sim-model", role="kv_producer")
    sims.append(p)
    d = start_sim([*ARGS, *decode_args], str(tmp_path), name="decode", model="sim-model", role="kv_consumer")
    sims.append(d)
    return p, d


@contextlib.contextmanager
def _gateway(p: SimProcess, d: SimProcess) -> Iterator[GatewayThread]:
    """A gateway in front of ``p`` and ``d`` that learns its models from their /v1/models (settings.json alone),
    once ready; stopped at the end."""
    g = GatewayThread(make_settings([p.url], [d.url], models=()))
    try:
        assert wait_for(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 200, timeout=20)
        yield g
    finally:
        g.stop()


def _metric(url: str, name: str, **labels: str) -> float:
    return metric_value(samples(httpx.get(url + "/metrics", timeout=10).text), name, **labels) or 0.0


def test_sim_pd_end_to_end_with_openai_sdk(sims: list[SimProcess], tmp_path: Path) -> None:
    p, d = _pair(sims, tmp_path)
    with _gateway(p, d) as g:
        before = _metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        client = openai.OpenAI(base_url=g.url + "/v1", api_key=KEY, max_retries=0)
        stream = client.chat.completions.with_raw_response.create(
            model="sim-model",
            messages=[{"role": "user", "content": "tell me about disaggregation " * 20}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert stream.headers["x-pd-path"] == "disagg"
        chunks = list(stream.parse())
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        comp = client.completions.create(model="sim-model", prompt="one two three " * 10, max_tokens=4)
        assert comp.usage is not None and comp.usage.completion_tokens == 4
        after = _metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        assert after > before  # decode really pulled KV instead of recomputing
        assert {m.id for m in client.models.list().data} == {"sim-model"}
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="sim-model", prompt="x", max_tokens=5000)


def test_sim_no_kv_params_is_a_counted_fallback(sims: list[SimProcess], tmp_path: Path) -> None:
    p, d = _pair(sims, tmp_path, prefill_args=("--sim-fault", "no-kv-params"))
    with _gateway(p, d) as g:
        with g.client() as c:
            r = c.post("/v1/completions", json={"model": "sim-model", "prompt": "hello " * 30, "max_tokens": 3})
        assert r.status_code == 200
        assert r.headers["x-pd-path"] == "fallback"
        assert g.metric("pdctl_pd_fallback_total", reason="missing") == 1


def test_sim_handshake_failure_absorbed_by_one_retry(sims: list[SimProcess], tmp_path: Path) -> None:
    p, d = _pair(sims, tmp_path, decode_args=("--sim-fault", "handshake-fail"))
    with _gateway(p, d) as g:
        with g.client() as c:
            r = c.post(
                "/v1/completions",
                json={"model": "sim-model", "prompt": "hello " * 30, "max_tokens": 3},
                headers={"x-request-id": "hsreq"},
            )
        assert r.status_code == 200, r.text
        assert r.headers["x-pd-path"] == "disagg"
        assert g.metric("pdctl_retries_total", leg="decode") == 1
