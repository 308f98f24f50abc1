"""The gateway's prefill queue (``routing.prefill_queue_tokens``) on the real pool, prefix router and legs, over
in-memory workers: requests wait while no prefill has room, a prefill with room takes the request it holds, a
prompt another one is computing waits for it, an idle prefill never idles while requests wait, and a request
that waits too long or whose client leaves is answered and forgotten."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pdctl.config import SLOConfig
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.errors import ApiError
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from pdctl.gateway.routing.chooser import Chooser
from pdctl.gateway.routing.plan import RoutePlan
from pdctl.gateway.routing.pool import Instance
from pdctl.gateway.routing.prefill_queue import PrefillQueue
from pdctl.gateway.settings import LocalModel
from pdctl.runtime.trace import parse_access
from tests.fakes.gateway_harness import KEY, asgi_request, make_settings, run_app
from tests.gateway.test_adaptive import _decoded, _prefill
from tests.gateway.test_policy import _body, _gateway, _role

A = "Ledger rules for the billing team, version one. " * 40
B = "Style guide for the support desk, second edition. " * 40
C = "Release checklist for the platform group, draft. " * 40


def _parts(gw: Gateway) -> tuple[Chooser, PrefillQueue, Instance, Instance]:
    router, queue = gw.router.chooser, gw.router.queue
    assert router is not None and queue is not None
    p0, p1 = _role(gw.pool, "prefill")
    return router, queue, p0, p1


def _run(gw: Gateway, test: Callable[[Gateway], Awaitable[None]]) -> None:
    async def main() -> None:
        await test(gw)

    asyncio.run(main())


def _plan(router: Chooser, gw: Gateway, prefix: str, question: str, tokens: int = 600) -> RoutePlan:
    return router.decide(gw.pool, _body(question, prefix), tokens)


def _waiting(gw: Gateway) -> float | None:
    return gw.metrics.registry.get_sample_value("pdctl_prefill_queue_waiting")


def test_the_queue_is_off_by_default_and_needs_the_per_request_router() -> None:
    assert _gateway().router.queue is None
    gw = _gateway(prefill_queue_tokens=1000)
    assert gw.router.chooser is not None and gw.router.queue is not None and gw.router.queue.limit == 1000


def test_a_leg_1_ends_once_where_its_caller_says_so_not_when_its_prompt_is_recorded() -> None:
    """The view learning a prompt (``record``) and the leg 1 ending (``leg1_done``, or the queue's ``release``) are
    two facts, said once each: recording the prompt leaves the leg's tokens counted until the caller ends it."""
    gw = _gateway(prefill_queue_tokens=500)
    router, queue, p0, _ = _parts(gw)
    plan = _plan(router, gw, A, "computing")
    assert router.pick(gw.pool, "prefill", plan, among=[p0]) is p0 and router.prefilling_tokens(p0) == 600
    router.record(p0, plan)
    assert router.prefilling_tokens(p0) == 600  # still in leg 1: its room is not free yet
    assert router.cached(p0, _plan(router, gw, A, "later")) > 0  # but the view holds the prompt
    queue.release(gw.pool, p0, plan)
    assert router.prefilling_tokens(p0) == 0


def test_a_prefill_with_room_takes_the_waiting_request_it_holds_not_the_oldest() -> None:
    gw = _gateway(prefill_queue_tokens=500)
    router, queue, p0, p1 = _parts(gw)

    async def test(gw: Gateway) -> None:
        router.record(p0, _plan(router, gw, A, "earlier"))  # p0 computed prefix A, p1 prefix B
        router.record(p1, _plan(router, gw, B, "earlier"))
        busy = [_plan(router, gw, C, f"busy {n}") for n in range(2)]
        for plan, inst in zip(busy, (p0, p1), strict=True):  # each computing 600 tokens: no room left
            assert router.pick(gw.pool, "prefill", plan, among=[inst]) is inst
        b2, a2 = _plan(router, gw, B, "later"), _plan(router, gw, A, "later")
        wait_b = asyncio.create_task(queue.pick(gw.pool, b2, 5.0))
        wait_a = asyncio.create_task(queue.pick(gw.pool, a2, 5.0))
        await asyncio.sleep(0.01)
        assert not wait_a.done() and not wait_b.done() and len(queue) == 2 and _waiting(gw) == 2
        queue.release(gw.pool, p0, busy[0])  # p0 has room: it takes A's request, though B's waited longer
        assert await wait_a is p0 and not wait_b.done()
        assert a2.picks[-1].startswith("prefill_queue=match:")
        queue.release(gw.pool, p1, busy[1])
        assert await wait_b is p1 and len(queue) == 0 and _waiting(gw) == 0
        assert router.prefilling_tokens(p0) < 600  # A's request computes only what p0 does not hold

    _run(gw, test)


def test_a_prompt_another_request_is_computing_waits_for_it_then_matches_there() -> None:
    """vLLM caches a block once it is computed: two requests of one new prefix sent together both compute it
    whole. The second waits for the first, though a prefill has room, then goes where the first was computed."""
    gw = _gateway(prefill_queue_tokens=2000)
    router, queue, p0, p1 = _parts(gw)

    async def test(gw: Gateway) -> None:
        leader = _plan(router, gw, A, "first")
        lead_at = await queue.pick(gw.pool, leader, 1.0)
        assert lead_at is not None and leader.picks[-1].startswith("prefill_queue=policy:")
        other = p1 if lead_at is p0 else p0
        busy = _plan(router, gw, B, "busy")  # (held: a request's tokens count while its decision lives)
        assert router.pick(gw.pool, "prefill", busy, among=[other]) is other
        follower = _plan(router, gw, A, "second")
        waiting = asyncio.create_task(queue.pick(gw.pool, follower, 5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # both prefills have room, but the leader's prompt is not computed yet
        router.record(lead_at, leader)  # leg 1 done: the view holds A
        queue.release(gw.pool, lead_at, leader)
        assert await waiting is lead_at and follower.picks[-1].startswith("prefill_queue=match:")

    _run(gw, test)


def test_an_idle_prefill_takes_a_request_that_waits_for_a_busy_holder() -> None:
    gw = _gateway(prefill_queue_tokens=500)
    router, queue, p0, p1 = _parts(gw)

    async def test(gw: Gateway) -> None:
        router.record(p0, _plan(router, gw, A, "earlier"))
        busy = _plan(router, gw, C, "busy")
        assert router.pick(gw.pool, "prefill", busy, among=[p0]) is p0
        assert router.prefilling_tokens(p0) >= 500 and router.prefilling_tokens(p1) == 0  # p0 has no room
        again = _plan(router, gw, A, "again")
        assert await queue.pick(gw.pool, again, 1.0) is p1  # p0 holds A but has no room; p1 would idle
        assert again.picks[-1].startswith("prefill_queue=idle:")

    _run(gw, test)


def test_a_request_waits_until_its_deadline_then_gets_a_503_and_is_forgotten() -> None:
    gw = _gateway(prefill_queue_tokens=100)
    router, queue, p0, p1 = _parts(gw)

    async def test(gw: Gateway) -> None:
        busy = [_plan(router, gw, C, f"busy {n}") for n in range(2)]
        assert [await queue.pick(gw.pool, plan, 1.0) for plan in busy].count(None) == 0
        late = _plan(router, gw, A, "late")
        with pytest.raises(ApiError) as err:
            await queue.pick(gw.pool, late, 0.05)
        assert err.value.status == 503 and "routing.prefill_queue_tokens" in err.value.message
        assert err.value.retry_after_s is not None
        assert len(queue) == 0 and _waiting(gw) == 0
        gone = asyncio.create_task(queue.pick(gw.pool, _plan(router, gw, A, "leaves"), 5.0))
        await asyncio.sleep(0.01)
        gone.cancel()  # the client left while waiting
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert len(queue) == 0 and _waiting(gw) == 0
        p0.healthy = p1.healthy = False  # no prefill at all: the caller answers its "no prefill" error
        assert await queue.pick(gw.pool, _plan(router, gw, A, "none"), 1.0) is None

    _run(gw, test)


def test_requests_through_the_gateway_wait_for_their_prefill_and_log_how_they_were_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Four concurrent requests of two prefixes over two slow prefills with room for one prompt each: every
    request is answered, each prefix's later request goes to the prefill that computed it, and the access log
    says so (``prefill_queue=<rule>:<ms>``)."""
    workers = MemoryWorkers()
    slow = _prefill()
    for i in range(2):
        workers[f"prefill-{i}"].default = MemoryReply(slow.status, slow.parts, delay_s=0.2)
        workers[f"decode-{i}"].default = _decoded()
    caplog.set_level(logging.INFO, logger="pdctl.gateway.access")

    async def test(app: Gateway) -> None:
        async def send(prefix: str, n: int, after: float) -> Any:
            await asyncio.sleep(after)
            return await asgi_request(app, "/v1/completions", _body(f"Question {n}?", prefix), request_id=f"r{n}")

        replies = await asyncio.gather(send(A, 0, 0), send(B, 1, 0.02), send(A, 2, 0.04), send(B, 3, 0.06))
        assert [r.status for r in replies] == [200] * 4
        heads = [r.headers for r in replies]
        assert heads[0]["x-pd-prefill"] == heads[2]["x-pd-prefill"] != heads[1]["x-pd-prefill"]
        assert heads[1]["x-pd-prefill"] == heads[3]["x-pd-prefill"]

    app = run_app(_gateway(workers=workers, prefill_queue_tokens=100), test)
    lines = [parse_access(f" pdctl.gateway.access {r.getMessage()}") for r in caplog.records]
    fields = {f["request_id"]: f for f in lines if f is not None}
    assert fields["r0"]["prefill_queue"].startswith("policy:")
    rule, _, ms = fields["r2"]["prefill_queue"].partition(":")
    assert rule == "match" and float(ms) >= 100  # waited for r0's prefill to finish (200 ms, sent 40 ms later)
    assert app.metrics.registry.get_sample_value("pdctl_prefill_queue_wait_seconds_count", {"rule": "match"}) == 2


def test_the_slo_predictor_counts_the_requests_waiting_in_the_queue_as_ahead() -> None:
    """One prefill with room for one prompt, 0.3 s a prompt: the second request waits in the gateway, and the
    third's predicted TTFT counts that one too (three prompts' time, over the target) and is refused early."""
    workers = MemoryWorkers()
    slow = _prefill()
    workers["prefill"].default = MemoryReply(slow.status, slow.parts, delay_s=0.3)
    workers["decode"].default = _decoded()
    slo = SLOConfig(ttft_ms=750, tpot_ms=10_000, p90=False, admission=True)
    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"], slo=slo,
                             models=(LocalModel("tiny", 4096, engine="sim"),))  # fmt: skip
    settings = dataclasses.replace(settings, routing=dataclasses.replace(settings.routing, prefill_queue_tokens=1))
    replies: list[Any] = []

    async def test(app: Gateway) -> None:
        async def send(n: int) -> Any:
            return await asgi_request(app, "/v1/completions", _body(f"Question {n}?", A), request_id=f"r{n}")

        replies.append(await send(0))  # measures the prefill: about 0.3 s for the prompt
        leg1 = asyncio.ensure_future(send(1))  # an idle deployment: admitted, then in leg 1
        while not workers["prefill"].completions():
            await asyncio.sleep(0.01)
        waits = asyncio.ensure_future(send(2))  # one prompt ahead: 0.6 s predicted, admitted; waits in the queue
        while app.router.queue is None or not len(app.router.queue):
            await asyncio.sleep(0.01)
        replies.append(await send(3))  # one in leg 1 and one waiting ahead: 0.9 s predicted
        replies.extend(await asyncio.gather(leg1, waits))

    app = run_app(create_app(settings, KEY, clients=workers), test)
    first, refused, second, third = replies
    assert [first.status, second.status, third.status] == [200, 200, 200]
    assert refused.status == 503 and "time to first token" in refused.json()["error"]["message"]
    assert app.metrics.registry.get_sample_value("pdctl_rejected_total", {"reason": "slo_ttft"}) == 1


def test_the_slo_predictor_shares_the_waiting_prompts_among_the_prefills_in_the_pool_only() -> None:
    """Two prefills, one with its breaker open: the prompts waiting in the gateway all wait for the one left, so
    a new request's predicted TTFT counts all of them, not half (over-admitting exactly when capacity is down)."""
    slo = SLOConfig(ttft_ms=900, tpot_ms=10_000, p90=False, admission=True)
    settings = make_settings(["http://p0.invalid", "http://p1.invalid"], ["http://d0.invalid"], slo=slo,
                             models=(LocalModel("tiny", 4096, engine="sim"),))  # fmt: skip
    settings = dataclasses.replace(settings, routing=dataclasses.replace(settings.routing, prefill_queue_tokens=100))
    gw = create_app(settings, KEY, clients=MemoryWorkers())
    router, queue, p0, p1 = _parts(gw)
    replies: list[Any] = []

    async def test(gw: Gateway) -> None:
        p1.open_until = time.monotonic() + 600.0  # down: out of the pool
        gw.admission.sec_per_token.add(0.001)  # measured earlier: 1 ms a prompt token
        busy = _plan(router, gw, C, "busy")
        assert router.pick(gw.pool, "prefill", busy, among=[p0]) is p0  # p0 has no room
        waiting = [asyncio.create_task(queue.pick(gw.pool, _plan(router, gw, B, f"w{n}"), 30.0)) for n in range(2)]
        await asyncio.sleep(0.01)
        assert len(queue) == 2 and queue.waiting_tokens() == 1200  # 1.2 s ahead on p0; 0.6 s if shared by two
        reply = asyncio.wait_for(asgi_request(gw, "/v1/completions", _body("Hi?", ""), request_id="new"), 3.0)
        replies.append(await reply)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    run_app(gw, test)
    [refused] = replies
    assert refused.status == 503 and "time to first token" in refused.json()["error"]["message"]


def test_a_release_that_binds_many_waiting_requests_looks_each_up_once() -> None:
    """64 requests of one prefix wait while its first prompt is computed on one of 8 prefills; the end of that
    leg 1 binds all 64 there in one dispatch, which looks each waiting prompt up in the 8 views once (it used
    to rebuild the window x prefills matrix for every bind: about 12,000 lookups, 62 ms on the event loop)."""
    gw = _gateway(n_prefill=8, prefill_queue_tokens=1_000_000)
    router, queue = gw.router.chooser, gw.router.queue
    assert router is not None and queue is not None

    async def test(gw: Gateway) -> None:
        leader = _plan(router, gw, A, "first")
        at = await queue.pick(gw.pool, leader, 1.0)
        assert at is not None
        busy = [_plan(router, gw, C, f"busy {n}") for n in range(7)]  # (held: their tokens count while they live)
        for plan, other in zip(busy, [i for i in _role(gw.pool, "prefill") if i is not at], strict=True):
            assert router.pick(gw.pool, "prefill", plan, among=[other]) is other  # none idle
        followers = [_plan(router, gw, A, f"follower {n}") for n in range(64)]
        waiting = [asyncio.create_task(queue.pick(gw.pool, plan, 5.0)) for plan in followers]
        await asyncio.sleep(0.01)
        assert len(queue) == 64  # each waits for the leader's prompt to be computed
        router.record(at, leader)
        before = queue.lookups
        queue.release(gw.pool, at, leader)
        assert queue.lookups - before <= 64 * 8
        assert await asyncio.gather(*waiting) == [at] * 64
        assert {plan.picks[-1].partition(":")[0] for plan in followers} == {"prefill_queue=match"}

    _run(gw, test)


def _queue_gateway(workers: MemoryWorkers, tokens: int, **gateway: Any) -> Gateway:
    """One prefill with room for ``tokens`` uncached prompt tokens, one decode, over ``workers``."""
    settings = make_settings(["http://prefill.invalid"], ["http://decode.invalid"],
                             models=(LocalModel("tiny", 4096, engine="sim"),), **gateway)  # fmt: skip
    routing = dataclasses.replace(settings.routing, prefill_queue_tokens=tokens)
    return create_app(dataclasses.replace(settings, routing=routing), KEY, clients=workers)


def test_a_failed_leg_1_gives_its_room_back() -> None:
    """The prefill's first answer is an error: that leg 1's tokens stop counting against its room at once (not
    when the request ends), so its retry is bound again rather than waiting out its deadline behind itself."""
    workers = MemoryWorkers()
    workers["prefill"].script(MemoryReply.json({"error": {"message": "boom"}}, status=500))
    workers["prefill"].default = _prefill()
    workers["decode"].default = _decoded()
    app = _queue_gateway(workers, 1, request_timeout_s=3.0, max_retries=1)
    replies: list[Any] = []

    async def test(app: Gateway) -> None:
        for n in range(2):
            replies.append(await asgi_request(app, "/v1/completions", _body(f"Q{n}?", A), request_id=f"r{n}"))

    run_app(app, test)
    assert [r.status for r in replies] == [200, 200]
    assert [c.request_id for c in workers["prefill"].completions()] == ["r0", "r0-retry1", "r1"]
    router = app.router.chooser
    assert router is not None and router.prefilling_tokens(app.pool.by_role("prefill")[0]) == 0


def test_a_request_that_waits_past_its_deadline_gets_a_503_with_retry_after_through_the_gateway() -> None:
    workers = MemoryWorkers()
    workers["prefill"].default = _prefill()
    workers["decode"].default = _decoded()
    app = _queue_gateway(workers, 100, request_timeout_s=0.3)
    replies: list[Any] = []

    async def test(app: Gateway) -> None:
        router, [prefill] = app.router.chooser, app.pool.by_role("prefill")
        assert router is not None
        busy = _plan(router, app, C, "busy")  # computing on the one prefill for the whole test: no room
        assert router.pick(app.pool, "prefill", busy) is prefill
        replies.append(await asgi_request(app, "/v1/completions", _body("Late?", A), request_id="late"))
        assert app.router.queue is not None and len(app.router.queue) == 0 and _waiting(app) == 0

    run_app(app, test)
    [late] = replies
    assert late.status == 503 and late.json()["error"]["code"] == "server_overloaded"
    assert "routing.prefill_queue_tokens" in late.json()["error"]["message"]
    assert int(late.headers["retry-after"]) >= 1
    assert not workers["prefill"].completions()


def test_a_client_that_leaves_as_its_request_is_bound_gives_the_room_back() -> None:
    """The request is bound to a prefill and its client's cancel lands before it resumes: the room it was
    bound with goes back and the next waiting request takes it."""
    gw = _gateway(prefill_queue_tokens=500)
    router, queue, p0, p1 = _parts(gw)

    async def test(gw: Gateway) -> None:
        busy = [_plan(router, gw, C, f"busy {n}") for n in range(2)]
        for plan, inst in zip(busy, (p0, p1), strict=True):
            assert router.pick(gw.pool, "prefill", plan, among=[inst]) is inst  # no room anywhere
        leaving, later = _plan(router, gw, A, "leaves"), _plan(router, gw, B, "later")
        gone = asyncio.create_task(queue.pick(gw.pool, leaving, 5.0))
        await asyncio.sleep(0.01)
        stays = asyncio.create_task(queue.pick(gw.pool, later, 5.0))
        await asyncio.sleep(0.01)
        queue.release(gw.pool, p0, busy[0])  # p0 has room for one: the older request is bound ...
        assert len(queue) == 1 and router.prefilling_tokens(p0) == 600
        gone.cancel()  # ... and its client leaves before it resumes
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert await stays is p0  # the room went back and the next one took it
        assert len(queue) == 0 and _waiting(gw) == 0

    _run(gw, test)
