"""Per-pool routing policies (``routing.prefill_policy``, ``routing.decode_policy``) on the gateway's real pool and
prefix router, over in-memory workers; load is real in-flight tracking (:meth:`Instance.track`), the exact view is
fed real KV event messages."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from pdctl.config import RoutingConfig
from pdctl.errors import ConfigError
from pdctl.gateway.agent_sessions import session_hint
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.memory import MemoryWorkers
from pdctl.gateway.routing.chooser import Chooser
from pdctl.gateway.routing.kv_events import KvEventSubscriber
from pdctl.gateway.routing.policies import Sessions
from pdctl.gateway.routing.pool import Instance, Pool
from pdctl.gateway.settings import InstanceSpec, LocalModel
from pdctl.runtime.logs import LogLine
from pdctl.runtime.trace import build_trace, parse_access
from tests.fakes.gateway_harness import KEY, asgi_request, make_settings, run_app
from tests.gateway.test_adaptive import _decoded, _prefill
from tests.gateway.test_kv_view import BS, _frames, _stored

PREFIX = "You are a careful assistant for the billing team. " * 40  # ~2,000 characters: 8 approximate blocks


def _gateway(n_prefill: int = 2, n_decode: int = 2, workers: MemoryWorkers | None = None, **routing: Any) -> Gateway:
    settings = make_settings([f"http://p{i}.invalid" for i in range(n_prefill)],
                             [f"http://d{i}.invalid" for i in range(n_decode)],
                             models=(LocalModel("tiny", 4096, engine="sim"),))  # fmt: skip
    settings = dataclasses.replace(settings, routing=dataclasses.replace(settings.routing, **routing))
    gw = create_app(settings, KEY, clients=workers or MemoryWorkers())
    gw.pool.rng = random.Random(7)
    return gw


def _role(pool: Pool, role: str) -> list[Instance]:
    return [i for i in pool.instances if i.role == role]


@contextlib.contextmanager
def _busy(inst: Instance, requests: int, tokens: int = 100) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for _ in range(requests):
            stack.enter_context(inst.track(tokens))
        yield


def _body(question: str, prefix: str = PREFIX) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prefix + question, "max_tokens": 4}


def test_least_loaded_is_the_default_and_rotates_ties() -> None:
    assert RoutingConfig().policies == ("least_loaded", "least_loaded")
    gw = _gateway(n_prefill=3)
    p = _role(gw.pool, "prefill")
    assert not gw.router.by_request  # the default plans no request: today's path, unchanged
    assert [gw.router.chooser.by_load(gw.pool, ("prefill",)) for _ in range(3)] == p  # all idle: in turn
    with _busy(p[0], 2), _busy(p[1], 1, tokens=50), _busy(p[2], 1, tokens=80):
        assert {gw.router.chooser.by_load(gw.pool, ("prefill",)) for _ in range(4)} == {
            p[1]
        }  # fewest requests, then tokens


def test_round_robin_ignores_load_and_power_of_two_never_takes_the_busiest() -> None:
    gw = _gateway(n_prefill=4, prefill_policy="round_robin", decode_policy="power_of_two", n_decode=4)
    p, d = _role(gw.pool, "prefill"), _role(gw.pool, "decode")
    with _busy(p[0], 5):
        assert [gw.router.chooser.by_load(gw.pool, ("prefill",)) for _ in range(8)] == p + p
    with _busy(d[0], 9), _busy(d[1], 3), _busy(d[2], 1):
        picks = Counter(gw.router.chooser.by_load(gw.pool, ("decode",)) for _ in range(300))
    assert d[0] not in picks  # the less loaded of any two is never the busiest
    assert picks[d[3]] > picks[d[2]] > picks[d[1]] > 0  # the idlest wins every pair it is in


def test_discovered_instances_join_the_policy_once_serving() -> None:
    gw = _gateway(n_prefill=1, prefill_policy="round_robin")
    new = gw.pool.add(InstanceSpec("prefill-new", "prefill", "http://p9.invalid"), "warming")
    assert {gw.router.chooser.by_load(gw.pool, ("prefill",)) for _ in range(4)} == {_role(gw.pool, "prefill")[0]}
    gw.pool.serve(new)
    assert new in {gw.router.chooser.by_load(gw.pool, ("prefill",)) for _ in range(4)}
    gw.pool.retire(new)
    assert new not in {gw.router.chooser.by_load(gw.pool, ("prefill",)) for _ in range(4)}


def _router(gw: Gateway) -> Chooser:
    assert gw.router.chooser is not None
    return gw.router.chooser


def test_cache_aware_follows_the_prefix_until_the_pool_is_imbalanced() -> None:
    gw = _gateway(prefill_policy="cache_aware")
    router, p = _router(gw), _role(gw.pool, "prefill")
    first = router.decide(gw.pool, _body("Q1"), 600)
    assert first.reason == "always" and first.decode is None  # pd_mode always: no decode chosen up front
    a = router.pick(gw.pool, "prefill", first)
    assert a is not None and first.picks[-1].startswith("prefill_pick=cache_aware:smallest_view")
    other = p[1] if a is p[0] else p[0]
    busy = router.decide(gw.pool, _body("Q0", prefix="Tell me a story: " * 10), 600)
    assert router.pick(gw.pool, "prefill", busy) is other  # the smaller view; now neither prefill is idle
    # Learned when routed (no completion yet): the same prefix follows, though `a` is busier.
    with _busy(a, 10):
        plan = router.decide(gw.pool, _body("Q2"), 600)
        assert router.pick(gw.pool, "prefill", plan) is a
        assert plan.picks[-1].startswith("prefill_pick=cache_aware:match ")
        assert f"{other.name}:0" in plan.picks[-1]
        # An unrelated prompt (share 0 <= 0.3) goes to the smallest view: the other instance.
        fresh = router.decide(gw.pool, _body("Q3", prefix="Translate to French: " * 120), 600)
        assert router.pick(gw.pool, "prefill", fresh) is other
    with _busy(a, 100):  # 100 vs 0 in flight: more than 64 apart and over 1.5x: the escape
        plan = router.decide(gw.pool, _body("Q4"), 600)
        assert router.pick(gw.pool, "prefill", plan) is other
        assert plan.picks[-1].startswith("prefill_pick=cache_aware:imbalanced")
    del first, busy


def test_cache_aware_prefill_escapes_to_an_idle_instance_rather_than_queue() -> None:
    """The idle escape: a prompt no prefill holds, whose smallest view has work queued, goes to a prefill with
    nothing queued; a match stays with its holder even while another prefill idles (its cache saves the compute)."""
    gw = _gateway(prefill_policy="cache_aware")
    router = _router(gw)
    warm = router.decide(gw.pool, _body("Q1"), 600)
    a = router.pick(gw.pool, "prefill", warm)
    assert a is not None
    router.record(a, warm)  # `a` computed PREFIX (8 blocks in its view)
    router.leg1_done(a, warm)  # its leg 1 ended: nothing queued
    short = "Translate: " * 30  # a 1-block prefix: `b`'s view stays the smaller
    first = router.decide(gw.pool, _body("Q2", prefix=short), 600)
    b = router.pick(gw.pool, "prefill", first)
    assert b is not None and b is not a and router.prefilling_tokens(b) == 600 and router.prefilling_tokens(a) == 0
    # `b`'s prefix again while `b` computes it and `a` idles: the match.
    again = router.decide(gw.pool, _body("Q2b", prefix=short), 600)
    assert router.pick(gw.pool, "prefill", again) is b and ":match " in again.picks[-1]
    # A new prefix: the smallest view is `b`'s, which has 600 tokens queued; `a` has none and takes it.
    fresh = router.decide(gw.pool, _body("Q3", prefix="Summarise this contract: " * 40), 600)
    assert router.pick(gw.pool, "prefill", fresh) is a and ":idle " in fresh.picks[-1]
    # Both have work queued now: no idle prefill, the choices stand.
    late = router.decide(gw.pool, _body("Q4", prefix="Describe the weather: " * 40), 600)
    assert router.pick(gw.pool, "prefill", late) is not None and ":smallest_view " in late.picks[-1]
    same = router.decide(gw.pool, _body("Q5", prefix=short), 600)
    assert router.pick(gw.pool, "prefill", same) is b and ":match " in same.picks[-1]
    del first, again, fresh, late, same


def test_cache_aware_thresholds_are_settings() -> None:
    gw = _gateway(prefill_policy="cache_aware", cache_threshold=1.0, balance_abs_threshold=2)
    router, p = _router(gw), _role(gw.pool, "prefill")
    a = router.pick(gw.pool, "prefill", router.decide(gw.pool, _body("Q1"), 600))
    assert a is not None
    plan = router.decide(gw.pool, _body("Q2"), 600)
    assert router.pick(gw.pool, "prefill", plan) is not None
    assert ":smallest_view" in plan.picks[-1]  # a share of 1.0 is never above the threshold
    with _busy(a, 4):
        plan = router.decide(gw.pool, _body("Q1"), 600)
        assert router.pick(gw.pool, "prefill", plan) is not a and ":imbalanced" in plan.picks[-1]
    assert len(p) == 2


def _exact(gw: Gateway) -> KvEventSubscriber:
    assert gw.kv_events is not None
    return gw.kv_events


def test_kv_aware_prices_overlap_against_load_with_dynamos_cost() -> None:
    gw = _gateway(decode_policy="kv_aware", prefix_view="exact", kv_events_port=1)
    router, d = _router(gw), _role(gw.pool, "decode")
    prompts = [list(range(1000 * k, 1000 * k + 8 * BS)) for k in range(1, 5)]  # 8 full blocks each, never routed
    for k, ids in enumerate(prompts):  # decode-1 holds 6 blocks of each
        _exact(gw).feed(_frames(d[1].name, k, _stored(ids[: 6 * BS], range(10 * k + 1, 10 * k + 7))))
    _exact(gw).feed(_frames(d[0].name, 0, _stored([7] * BS, [99])))  # decode-0 has published: block size known

    def pick(ids: list[int]) -> tuple[Instance | None, str]:
        plan = router.decide(gw.pool, {"prompt": ids}, len(ids), ids)
        return router.pick(gw.pool, "decode", plan), plan.picks[-1]

    assert pick(prompts[0]) == (d[1], f"decode_pick=kv_aware:cost decode_scores={d[0].name}:8,{d[1].name}:2")
    with _busy(d[1], 1, tokens=5 * BS):  # 2 new + 5 in flight = 7 < 8: still the overlap
        assert pick(prompts[1])[0] is d[1]
    with _busy(d[1], 1, tokens=7 * BS):  # 2 + 7 = 9 > 8: the load wins
        assert pick(prompts[2])[0] is d[0]
    with _busy(d[1], 1, tokens=6 * BS):  # 8 = 8: a tie, broken at random
        chosen, fields = pick(prompts[3])
    assert fields.startswith("decode_pick=kv_aware:random ") and chosen in d


def test_kv_overlap_credit_keeps_a_prefix_with_its_holder_against_a_longer_queue() -> None:
    """Dynamo's overlap credit: each cached block takes ``kv_overlap_credit`` blocks off the cost."""
    gw = _gateway(decode_policy="kv_aware", prefix_view="exact", kv_events_port=1, kv_overlap_credit=2.0)
    router, d = _router(gw), _role(gw.pool, "decode")
    ids = list(range(1000, 1000 + 8 * BS))
    _exact(gw).feed(_frames(d[1].name, 0, _stored(ids[: 6 * BS], range(1, 7))))  # decode-1 holds 6 of 8 blocks
    _exact(gw).feed(_frames(d[0].name, 0, _stored([7] * BS, [99])))
    with _busy(d[1], 1, tokens=7 * BS):  # credit 1 would give 2 + 7 = 9 > 8: decode-0 (the test above)
        plan = router.decide(gw.pool, {"prompt": ids}, len(ids), ids)
        assert router.pick(gw.pool, "decode", plan) is d[1]
    assert plan.picks[-1] == f"decode_pick=kv_aware:cost decode_scores={d[0].name}:8,{d[1].name}:7"


def test_kv_aware_counts_what_it_routed_a_moment_ago_and_what_prefills_still_compute() -> None:
    """A prefill's load is the uncached tokens of the requests it has not finished; the prompt it was sent a moment
    ago counts as held there before its events arrive (the routed index)."""
    gw = _gateway(prefill_policy="kv_aware", prefix_view="exact", kv_events_port=1)
    router, p = _router(gw), _role(gw.pool, "prefill")
    ids = list(range(50, 50 + 16 * BS))
    first = router.decide(gw.pool, {"prompt": ids}, len(ids), ids)
    a = router.pick(gw.pool, "prefill", first)
    assert a is not None and router.prefilling_tokens(a) == len(ids)
    other = p[1] if a is p[0] else p[0]
    again = router.decide(gw.pool, {"prompt": ids}, len(ids), ids)
    assert router.pick(gw.pool, "prefill", again) is other  # `a` is still computing the whole prompt: busier
    router.record(a, first)  # `a` computed the prompt; no event from `a` yet
    router.leg1_done(a, first)
    assert router.prefilling_tokens(a) == 0
    follow = router.decide(gw.pool, {"prompt": [*ids, 1, 2, 3]}, len(ids) + 3, [*ids, 1, 2, 3])
    assert router.pick(gw.pool, "prefill", follow) is a  # held by the routed index; `other` still computes
    del again, follow
    assert router.prefilling_tokens(other) == 0  # requests that ended otherwise drop out with their decisions


def test_kv_aware_without_the_exact_view_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        _gateway(decode_policy="kv_aware")
    assert str(err.value).startswith("settings.json: routing.decode_policy: kv_aware reads the workers' KV cache")
    assert err.value.hint is not None and '"prefix_view": "exact"' in err.value.hint


def test_a_session_breaks_ties_and_never_overrides_a_score() -> None:
    gw = _gateway(decode_policy="power_of_two", prefill_policy="round_robin")
    router, d = _router(gw), _role(gw.pool, "decode")
    body = {**_body("hi"), "metadata": {"user_id": "user_1_session_abc"}}
    plan = router.decide(gw.pool, body, 100)
    assert plan.session == "user_1_session_abc"
    first = router.pick(gw.pool, "decode", plan)
    assert first is not None
    later = [router.decide(gw.pool, body, 100) for _ in range(20)]
    assert {router.pick(gw.pool, "decode", p) for p in later} == {first}  # both idle: a tie, the session's
    assert later[-1].picks[-1].startswith("decode_pick=power_of_two:session ")
    anon = {router.pick(gw.pool, "decode", router.decide(gw.pool, _body("hi"), 100)) for _ in range(20)}
    assert anon == set(d)  # no session: ties at random
    with _busy(first, 1):
        assert all(router.pick(gw.pool, "decode", router.decide(gw.pool, body, 100)) is not first for _ in range(10))


def test_session_hint_sources_and_memory_bound() -> None:
    assert session_hint({"metadata": {"user_id": "u"}}, "hdr") == "hdr"
    assert session_hint({"conversation": "conv_1"}) == "conv_1"
    assert session_hint({"conversation": {"id": "conv_2"}}) == "conv_2"
    assert session_hint({"metadata": {"user_id": "u"}}) == "u"
    assert session_hint({"previous_response_id": "resp_1", "metadata": {}}) is None
    s = Sessions(capacity=2)
    for name in "abc":
        s.remember("decode", name, f"d-{name}")
    assert len(s) == 2 and s.last("decode", "a") is None and s.last("decode", "c") == "d-c"
    assert s.last("prefill", "c") is None


def test_the_gateway_routes_by_policy_and_logs_each_pick_with_scores(caplog: pytest.LogCaptureFixture) -> None:
    """prefill cache_aware, decode round_robin, pd_mode always: a shared prefix stays on one prefill, decodes take
    turns, and each access line carries both picks with the candidates' scores, as ``pdctl trace`` reads them."""
    workers = MemoryWorkers()
    for i in range(2):
        workers[f"prefill-{i}"].default = _prefill()
        workers[f"decode-{i}"].default = _decoded()
    caplog.set_level(logging.INFO, logger="pdctl.gateway.access")
    heads: list[dict[str, str]] = []

    async def test(app: Gateway) -> None:
        for n in range(4):
            reply = await asgi_request(app, "/v1/completions", _body(f"Question {n}?"), request_id=f"r{n}")
            assert reply.status == 200 and reply.headers["x-pd-path"] == "disagg"
            heads.append(reply.headers)

    app = run_app(_gateway(workers=workers, prefill_policy="cache_aware", decode_policy="round_robin"), test)
    assert len({h["x-pd-prefill"] for h in heads}) == 1
    assert [h["x-pd-decode"] for h in heads] == ["decode-0", "decode-1", "decode-0", "decode-1"]
    lines = [parse_access(f" pdctl.gateway.access {r.getMessage()}") for r in caplog.records]
    fields = {f["request_id"]: f for f in lines if f is not None}
    assert fields["r0"]["decision"] == "always" and fields["r0"]["prefill_pick"] == "cache_aware:smallest_view"
    assert fields["r1"]["prefill_pick"] == "cache_aware:match"
    assert fields["r1"]["prefill_scores"].split(",")[0].startswith("prefill-")
    assert fields["r3"]["decode_pick"] == "round_robin:turn"
    assert fields["r3"]["decode_scores"] == "decode-0:0,decode-1:0"
    metric = app.metrics.registry.get_sample_value
    assert metric("pdctl_pd_decisions_total", {"path": "disagg", "reason": "always"}) == 4


def test_adaptive_pd_keeps_its_prefix_pick_under_least_loaded() -> None:
    """Under ``pd_mode = "adaptive"`` the default decode policy is today's: most cached, then least loaded."""
    gw = _gateway(pd_mode="adaptive")
    router, d = _router(gw), _role(gw.pool, "decode")
    text = "Summarise the ledger. " * 100
    first = router.decide(gw.pool, {"prompt": text}, 500)
    assert first.decode is not None
    router.record(first.decode, first)
    with _busy(first.decode, 3):
        plan = router.decide(gw.pool, {"prompt": text + " And?"}, 501)
    assert plan.decode is first.decode and plan.local
    assert plan.picks[0].startswith("decode_pick=least_loaded:cached ")
    assert f"{d[0].name}:" in plan.log_fields() and plan.log_fields().startswith("decision=cached ")


def test_pdctl_trace_shows_the_picks_and_their_scores() -> None:
    line = (
        "2026-12-04 19:00:00,000 INFO pdctl.gateway.access request_id=r1 model=tiny path=disagg prefill=prefill-1 "
        "decode=decode-0 status=200 ttft_ms=5.0 prefill_ms=2.0 prompt_tokens=320 tokens=4 duration_ms=9.0 "
        "decision=always prefill_pick=cache_aware:match prefill_scores=prefill-0:0,prefill-1:0.85 "
        "decode_pick=kv_aware:cost decode_scores=decode-0:3,decode-1:23"
    )
    trace = build_trace("r1", [LogLine("gateway", line, 1.0)])
    row = next(r for r in trace.rows if r.stage == "decision")
    assert row.detail == (
        "x-pd-path: disagg; decision=always (pd_mode always: both legs); decode by kv_aware:cost scores "
        "decode-0:3,decode-1:23; prefill by cache_aware:match scores prefill-0:0,prefill-1:0.85"
    )


def test_adaptive_pd_with_cache_aware_decode_counts_what_the_decode_held_before_this_request() -> None:
    """The decode's tree learns the request when it is routed, but the decision reads the decode before that: a
    long fresh prompt takes both legs, and only its later turns go local."""
    gw = _gateway(pd_mode="adaptive", decode_policy="cache_aware")
    router = _router(gw)
    first = router.decide(gw.pool, _body("Q1"), 600)
    assert first.decode is not None and not first.local and first.reason == "uncached_tokens"
    assert first.cached_tokens == 0 and first.picks[0].startswith("decode_pick=cache_aware:smallest_view ")
    again = router.decide(gw.pool, _body("Q2"), 600)  # the tree learned the first: this one follows it, local
    assert again.decode is first.decode and again.local and again.reason == "cached"
    assert again.picks[0].startswith("decode_pick=cache_aware:match ")
