"""``slo.capacity_profile``: the gateway counts the tokens of the requests its workers answer, and its advisor sizes
the deployment for the last window of them with ``pdctl advise``'s model (the ``pdctl_advice_*`` gauges)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdctl.capacity import model as m
from pdctl.capacity.profile import DeploymentProfile, ProfileError, dump
from pdctl.config import SLOConfig
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from tests.capacity.conftest import timing_profile
from tests.fakes.gateway_harness import KEY, asgi_request, make_settings, run_app
from tests.gateway.test_adaptive import _prefill

PROMPT, OUTPUT = 1800, 12


def _decoded(prompt_tokens: int = PROMPT, completion_tokens: int = OUTPUT) -> MemoryReply:
    return MemoryReply.json({"id": "cmpl-d", "choices": [{"index": 0, "message": {"content": "done"}}],
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}})  # fmt: skip


def _gateway(tmp_path: Path, profile: DeploymentProfile | None, **slo: object) -> tuple[Gateway, MemoryWorkers]:
    settings_slo = SLOConfig(admission=False, advise_window_s=60.0, **slo)  # type: ignore[arg-type]
    if profile is not None:
        path = tmp_path / "profile.json"
        path.write_bytes(dump(profile))
        settings_slo = dataclasses.replace(settings_slo, capacity_profile=str(path))
    workers = MemoryWorkers()
    workers["prefill"].default = _prefill()
    workers["decode"].default = _decoded()
    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"], slo=settings_slo)
    return create_app(settings, KEY, clients=workers), workers


def _value(gw: Gateway, name: str, **labels: str) -> float | None:
    return gw.metrics.registry.get_sample_value(name, labels)


async def _send(gw: Gateway, n: int) -> None:
    for i in range(n):
        reply = await asgi_request(gw, "/v1/chat/completions",
                                   {"model": "tiny", "messages": [{"role": "user", "content": f"q{i}"}]})  # fmt: skip
        assert reply.status == 200, reply.body


def test_the_advice_for_a_window_of_long_prompts_asks_for_the_prefills_the_model_names(tmp_path: Path) -> None:
    profile = timing_profile()
    gw, _ = _gateway(tmp_path, profile)
    advisor = gw.advisor
    assert advisor is not None
    now = [100.0]
    advisor.clock = lambda: now[0]
    rate = 40.0

    async def test(app: Gateway) -> None:
        advisor.snapshots.clear()
        advisor.snapshots.append(advisor.snapshot())
        await _send(app, 80)
        now[0] += 80 / rate
        advice = await advisor.tick()
        expected = m.best_pd(profile, m.Workload(m.Histogram(((PROMPT, 1),)), m.Histogram(((OUTPUT, 1),))), advisor.slo,
                             rate)  # fmt: skip
        assert advice.rate == pytest.approx(rate)
        assert (advice.recommended_prefill, advice.recommended_decode) == (expected.prefill, expected.decode)
        assert expected.prefill > 1 and advice.status in ("under_prefill", "under_both"), advice.reason

    run_app(gw, test)
    assert _value(gw, "pdctl_request_prompt_tokens_count") == 80
    assert _value(gw, "pdctl_request_prompt_tokens_sum") == 80 * PROMPT
    assert _value(gw, "pdctl_advice_replicas", role="prefill", of="current") == 1
    assert _value(gw, "pdctl_advice_replicas", role="prefill", of="recommended") == advisor.latest.recommended_prefill  # type: ignore[union-attr]
    assert _value(gw, "pdctl_advice_status", status=advisor.latest.status) == 1  # type: ignore[union-attr]
    assert _value(gw, "pdctl_advice_status", status="ok") == 0
    assert _value(gw, "pdctl_advice_rate", window="60s") == pytest.approx(rate)
    current_ttft = _value(gw, "pdctl_advice_ttft_seconds", of="current", quantile="0.9")
    best_ttft = _value(gw, "pdctl_advice_ttft_seconds", of="recommended", quantile="0.9")
    assert current_ttft is not None and best_ttft is not None and best_ttft <= 0.4 < current_ttft


def test_the_window_forgets_requests_older_than_advise_window_s(tmp_path: Path) -> None:
    gw, workers = _gateway(tmp_path, timing_profile())
    advisor = gw.advisor
    assert advisor is not None
    now = [0.0]
    advisor.clock = lambda: now[0]

    async def test(app: Gateway) -> None:
        advisor.snapshots.clear()
        advisor.snapshots.append(advisor.snapshot())
        await _send(app, 30)
        now[0] = 30.0
        first = await advisor.tick()
        assert first.status != "idle" and first.rate == pytest.approx(1.0)
        now[0] = 85.0  # 55 s on, nothing new: the window (60 s) starts at the tick at 30 s
        quiet = await advisor.tick()
        assert quiet.status == "idle" and quiet.rate == 0.0
        workers["decode"].default = _decoded(prompt_tokens=100)
        await _send(app, 25)
        now[0] = 120.0
        later = await advisor.tick()
        assert later.rate == pytest.approx(25 / (120.0 - 85.0))  # from the tick at 85 s: 30 s is out of the window

    run_app(gw, test)


def test_no_advisor_without_a_profile_or_in_a_second_gateway_process_and_a_bad_profile_names_its_file(
    tmp_path: Path,
) -> None:
    assert _gateway(tmp_path, None)[0].advisor is None
    gw, _ = _gateway(tmp_path, timing_profile())
    assert gw.advisor is not None
    second = create_app(dataclasses.replace(gw.settings, process=(1, 2)), KEY, clients=MemoryWorkers())
    assert second.advisor is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "source": "x"}')
    slo = dataclasses.replace(gw.settings.slo, capacity_profile=str(bad))
    with pytest.raises(ProfileError, match=r"bad\.json"):
        create_app(dataclasses.replace(gw.settings, slo=slo), KEY, clients=MemoryWorkers())


def test_requests_not_answered_by_the_workers_are_not_counted(tmp_path: Path) -> None:
    gw, workers = _gateway(tmp_path, None)
    workers["decode"].default = MemoryReply.json({"error": {"message": "boom"}}, status=500)

    async def test(app: Gateway) -> None:
        reply = await asgi_request(app, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
                                                                                                "content": "x"}]})  # fmt: skip
        assert reply.status >= 500
        ok = await asgi_request(app, "/v1/chat/completions", {"model": "nope", "messages": []})
        assert ok.status >= 400

    run_app(gw, test)
    assert _value(gw, "pdctl_request_prompt_tokens_count") == 0
