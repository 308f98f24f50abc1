"""The PD two-leg flow (and ``colocated``), built on :mod:`pdctl.vllm.protocol`: which legs run in which order,
retries, the local path and ``gateway.fallback``; each worker call is :mod:`pdctl.gateway.legs`'.

Leg 1 goes to the least-loaded prefill, one attempt at a time, in the request's own task, which a client
disconnect does not cancel meanwhile (:attr:`pdctl.gateway.record.RequestRecord.in_leg1`): a prefill that finished holds
KV blocks until decode reads them, so when the client left during leg 1 the gateway still finishes it and then
sends a *release leg* (the decode body with ``max_tokens = 1``, not streamed) so decode pulls and frees the
blocks at once instead of after ``kv_lease_duration``. No task of its own for leg 1: each task hand-over costs a
turn of the event loop, and under load a turn is what delays a first token. A failed or timed-out leg 1 is
retried with a fresh request id, on another prefill while one is available, at most ``gateway.max_retries``
times (capped at :data:`MAX_PD_RETRIES`) and never after a byte reached the client; decode's
``kv_transfer_params`` are never replayed (they are single-use): a retry is a whole new pipeline. A stream that
breaks after its first byte is continued elsewhere instead (:mod:`pdctl.gateway.migration`,
``gateway.migration_limit``).

With ``routing.pd_mode = "adaptive"`` the request's plan (:meth:`pdctl.gateway.routing.Router.plan`) decides first,
per request, whether the chosen decode serves it alone (``x-pd-path: local``, counted in
``pdctl_pd_decisions_total``); a local attempt that fails before any byte reached the client takes the two legs
instead. On the two legs the prefill and the decode are then chosen by their cached prefix too.

When no prefill can serve the request (none available, or leg 1 failed on every attempt) ``gateway.fallback``
decides: ``none`` answers the error, ``decode`` has decode compute the prompt itself (``x-pd-path: fallback``),
``upstream`` sends it to the upstream (``x-pd-path: upstream``); ``pdctl_prefill_fallback_total{to,reason}``
counts each.

The legs see the gateway only through a :class:`~pdctl.gateway.legs.PdContext`, choose instances only through its
:class:`~pdctl.gateway.routing.Router`, and see the workers only through
:class:`pdctl.gateway.workers.WorkerClient` (``tests/gateway/test_legs.py`` drives them on in-memory workers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from pdctl.gateway import codec, legs
from pdctl.gateway.errors import ApiError
from pdctl.gateway.legs import LegResult, PdContext
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.routing import Instance, Role, RoutePlan
from pdctl.vllm.protocol import build_decode_body, build_prefill_body, check_kv_params

__all__ = ["MAX_PD_RETRIES", "serve_colocated", "serve_pd"]

log = logging.getLogger("pdctl.gateway")
#: Each PD retry holds a prefill's KV blocks until its lease ends: more than a few only adds load to a sick pool.
MAX_PD_RETRIES = 3


async def serve_pd(
    ctx: PdContext,
    ex: RequestRecord,
    endpoint: str,
    body: dict[str, Any],
    prompt_tokens: int,
    plan: RoutePlan | None = None,
) -> None:
    """Leg 1 on a prefill, leg 2 on a decode, decode's answer relayed to the client.

    Retries (as a whole new pipeline with a fresh request id ``<id>-retryN``) after a failed or timed-out leg 1,
    or after a decode that failed before sending anything (vLLM's lazy NIXL handshake failure is a decode 500).
    When leg 1 cannot succeed, ``gateway.fallback`` decides (module docstring). ``plan``: adaptive PD's decision
    when the caller made it already (for admission); else it is made here.
    """
    tried = 0  # pipelines tried before the two legs: 1 after a failed local attempt, whose id they must not reuse
    if plan is None:
        plan = ctx.router.plan(body, prompt_tokens)
    if plan is not None:
        ex.decision = plan.log_fields()
        if plan.view == "exact" and plan.approx_cached_tokens is not None:
            m = ctx.metrics
            m.child(m.view_cached_tokens, "exact").inc(plan.cached_tokens)
            m.child(m.view_cached_tokens, "approx").inc(plan.approx_cached_tokens)
            if plan.approx_local != plan.local:
                m.child(m.view_disagreements, "local" if plan.local else "disagg").inc()
        if plan.cache_break is not None and plan.cache_break.location != "none":
            ctx.metrics.child(ctx.metrics.cache_breaks, plan.cache_break.location).inc()
        if plan.local:  # counted once, as local, even when it ends on the two legs (pdctl_retries_total{leg=local})
            if await _serve_local(ctx, ex, endpoint, body, prompt_tokens, plan):
                return
            tried = 1
        else:
            ctx.metrics.child(ctx.metrics.pd_decisions, "disagg", plan.reason).inc()
    attempts = 1 + min(ctx.settings.gateway.max_retries, MAX_PD_RETRIES)
    failed: list[Instance] = []  # prefills whose leg 1 failed: a retry goes elsewhere while another is available
    for attempt in range(attempts):
        rid = ex.request_id if attempt + tried == 0 else f"{ex.request_id}-retry{attempt + tried}"
        last = attempt == attempts - 1
        if ctx.router.least_loaded(("prefill",)) is None:
            await _fallback(ctx, ex, endpoint, body, prompt_tokens, legs.no_instance(ctx, ("prefill",), "prefill"))
            return
        leg = await _leg1(ctx, ex, endpoint, body, prompt_tokens, rid, plan, failed)
        if leg.error is not None:
            if not leg.retryable:
                raise leg.error
            if last or ex.remaining() <= 0.05:
                await _fallback(ctx, ex, endpoint, body, prompt_tokens, leg.error)
                return
            ctx.metrics.retries.labels("prefill").inc()
            log.warning("request %s: leg 1 failed (%s); retrying as %s-retry%d", ex.request_id, leg.error.message,
                        ex.request_id, attempt + 1)  # fmt: skip
            continue
        dbody = _decode_body(ctx, ex, body, leg)
        try:
            await legs.decode(
                ctx, ex, endpoint, dbody, leg.request_id, prompt_tokens, ("decode",), "decode", source=leg.instance,
                plan=plan if attempt == 0 else None,
            )  # fmt: skip
            return
        except legs.DecodeFailed as err:
            if last or ex.headers_sent or ex.remaining() <= 0.05:
                raise ApiError(err.status, err.message, code=err.code) from None
            ctx.metrics.retries.labels("decode").inc()
            log.warning("request %s: decode failed before any output (%s); retrying the whole pipeline as "
                        "%s-retry%d", ex.request_id, err.message, ex.request_id, attempt + 1)  # fmt: skip


async def _serve_local(
    ctx: PdContext, ex: RequestRecord, endpoint: str, body: dict[str, Any], prompt_tokens: int, plan: RoutePlan
) -> bool:
    """The whole request on the decode ``plan`` chose, no prefill leg. False when that decode failed before any
    byte reached the client (the caller then takes the two legs)."""
    # The SLO autopilot's whole request on a prefill engine (pdctl.gateway.routing.autopilot) is colocated's path.
    whole = plan.decode is not None and plan.decode.role == "prefill"
    ctx.metrics.child(ctx.metrics.pd_decisions, "whole" if whole else "local", plan.reason).inc()
    ex.path = "colocated" if whole else "local"
    try:
        await legs.decode(ctx, ex, endpoint, build_decode_body(body, None), ex.request_id, prompt_tokens,
                      ("prefill",) if whole else ("decode",), "decode", plan=plan)  # fmt: skip
    except legs.DecodeFailed as err:
        if ex.headers_sent or ex.remaining() <= 0.05:
            raise ApiError(err.status, err.message, code=err.code) from None
        ctx.metrics.retries.labels("local").inc()
        log.warning("request %s: local decode failed before any output (%s); taking the two legs",
                    ex.request_id, err.message)  # fmt: skip
        ex.path = "-"
        return False
    return True


async def _fallback(
    ctx: PdContext, ex: RequestRecord, endpoint: str, body: dict[str, Any], prompt_tokens: int, err: ApiError
) -> None:
    """No prefill could serve the request: ``gateway.fallback`` decides where it goes, or ``err`` is answered."""
    mode = ctx.settings.gateway.fallback
    reason = "no_prefill" if err.code == "server_overloaded" else "prefill_failed"
    if mode == "upstream" and ctx.upstream is not None and ex.upstream_allowed:
        ctx.metrics.prefill_fallbacks.labels("upstream", reason).inc()
        ex.fallback_reason = reason
        log.warning("request %s: %s; sent to the upstream (gateway.fallback)", ex.request_id, err.message)
        await ctx.upstream.serve(ex, endpoint, body)
        return
    if mode != "decode" or ctx.router.least_loaded(("decode",)) is None:
        raise err
    ctx.metrics.prefill_fallbacks.labels("decode", reason).inc()
    ex.path = "fallback"
    ex.fallback_reason = reason
    log.warning("request %s: %s; decode computes the prompt itself (gateway.fallback)", ex.request_id, err.message)
    try:
        await legs.decode(ctx, ex, endpoint, build_decode_body(body, None), ex.request_id, prompt_tokens, ("decode",),
                      "decode")  # fmt: skip
    except legs.DecodeFailed as failed:
        raise ApiError(failed.status, failed.message, code=failed.code) from None


async def _leg1(
    ctx: PdContext, ex: RequestRecord, endpoint: str, body: dict[str, Any], prompt_tokens: int, rid: str,
    plan: RoutePlan | None = None, failed: list[Instance] | None = None,
) -> LegResult:  # fmt: skip
    # a retry after a failed leg 1, whose prefill may have just died: another prefill
    inst = ctx.router.retry_prefill(failed) if failed else None
    if inst is None:
        inst = await ctx.router.take_prefill(plan, max(0.05, ex.remaining()))
        if plan is not None and ctx.router.by_request:
            ex.decision = plan.log_fields()
    if inst is None:
        raise legs.no_instance(ctx, ("prefill",), "prefill")
    ex.in_leg1 = True
    leg: LegResult | None = None
    try:
        pbody = codec.encode(build_prefill_body(body, ctx.kind, endpoint))
        ahead = inst.in_flight_tokens
        timeout = max(0.05, min(ex.remaining(), ctx.settings.gateway.request_timeout_s))
        leg = await legs.prefill_once(
            ctx, inst, endpoint, pbody, rid, prompt_tokens, timeout, legs.trace_leg(ex, "prefill", inst, rid)
        )
    finally:
        ex.in_leg1 = False
        ctx.router.prefill_done(inst, plan, leg is not None and leg.reply is not None)  # leg 1 ends once
    if ex.client_gone:  # the client left during leg 1: free what the prefill now holds, then end as cancelled
        if leg.reply is not None:
            ctx.spawn(legs.release(ctx, leg, endpoint, body, ex))
        raise asyncio.CancelledError
    if leg.error is not None and failed is not None:
        failed.append(inst)
    if leg.reply is not None:
        ctx.admission.observe_prefill(leg.elapsed_s, prompt_tokens, ahead)
        ctx.metrics.child(ctx.metrics.leg, "prefill").observe(leg.elapsed_s)
        ex.prefill = inst.name
        ex.prefill_ms = leg.elapsed_s * 1000.0
        usage = leg.reply.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            ex.prompt_tokens = usage["prompt_tokens"]
    return leg


def _decode_body(ctx: PdContext, ex: RequestRecord, body: dict[str, Any], leg: LegResult) -> dict[str, Any]:
    assert leg.reply is not None
    params: Mapping[str, Any] | None = None
    ex.path = "disagg"
    if ctx.kind != "shared_storage":
        check = check_kv_params(leg.reply)
        if check.usable:
            params = check.params
            if ctx.settings.logging.log_kv_transfer and params is not None:
                blocks = params.get("remote_block_ids")
                nblocks = sum(len(b) if isinstance(b, list) else 1 for b in blocks) if isinstance(blocks, list) else 0
                ex.kv = {
                    "engine": params.get("remote_engine_id"),
                    "blocks": nblocks,
                    "remote": f"{params.get('remote_host')}:{params.get('remote_port')}",
                }
        else:
            reason = check.reason
            ex.path = "fallback"
            ex.fallback_reason = reason
            ctx.metrics.fallbacks.labels(reason).inc()
            detail = f" (missing {', '.join(check.missing)})" if check.missing else ""
            log.warning(
                "request %s: prefill %s returned no usable kv_transfer_params (%s%s) under %s: decode will "
                "recompute the prompt (x-pd-path: fallback)", ex.request_id, ex.prefill, reason, detail,
                ctx.settings.connector or "an unknown connector",
            )  # fmt: skip
    return build_decode_body(body, params)


async def serve_colocated(
    ctx: PdContext,
    ex: RequestRecord,
    endpoint: str,
    body: dict[str, Any],
    prompt_tokens: int,
    roles: tuple[Role, ...] = ("prefill", "decode"),
) -> None:
    """The whole request on one instance of ``roles``, least-loaded (``x-pd-path: colocated``)."""
    ex.path = "colocated"
    await legs.decode(ctx, ex, endpoint, body, ex.request_id, prompt_tokens, roles, "worker")
