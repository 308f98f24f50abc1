"""The PD two-leg flow (and ``colocated``), built on :mod:`pdctl.vllm.protocol`.

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

With ``routing.pd_mode = "adaptive"`` a :class:`pdctl.gateway.routing.chooser.Chooser` decides first, per request,
whether the chosen decode serves it alone (``x-pd-path: local``, counted in ``pdctl_pd_decisions_total``); a
local attempt that fails before any byte reached the client takes the two legs instead. On the two legs the
prefill and the decode are then chosen by their cached prefix too.

When no prefill can serve the request (none available, or leg 1 failed on every attempt) ``gateway.fallback``
decides: ``none`` answers the error, ``decode`` has decode compute the prompt itself (``x-pd-path: fallback``),
``upstream`` sends it to the upstream (``x-pd-path: upstream``); ``pdctl_prefill_fallback_total{to,reason}``
counts each.

The legs see the gateway only through a :class:`PdContext`, and the workers only through
:class:`pdctl.gateway.workers.WorkerClient` (``tests/gateway/test_legs.py`` drives them on in-memory workers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from pdctl.gateway import codec, migration
from pdctl.gateway.admission import Admission
from pdctl.gateway.errors import ApiError, translate_worker_error
from pdctl.gateway.metrics import GatewayMetrics
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.relay import Kept, relay
from pdctl.gateway.routing import Instance, Pool, Role, RoutePlan, Router
from pdctl.gateway.settings import GatewaySettings
from pdctl.gateway.tracing import Leg
from pdctl.gateway.upstream import Upstream
from pdctl.vllm.protocol import ConnectorKind, build_decode_body, build_prefill_body, cap_output, check_kv_params
from pdctl.vllm.transport import TransportError

__all__ = ["MAX_PD_RETRIES", "LegResult", "PdContext", "Spawn", "serve_colocated", "serve_pd"]

log = logging.getLogger("pdctl.gateway")
_MAX_ERROR_BODY = 64 * 1024
#: Each PD retry holds a prefill's KV blocks until its lease ends: more than a few only adds load to a sick pool.
MAX_PD_RETRIES = 3
#: The paths whose worker call is named after them in a trace; any other call to a decode is ``decode``.
_LEG_NAMES = ("local", "fallback", "colocated")


Spawn = Callable[[Coroutine[Any, Any, None]], None]
"""Runs a coroutine in the background, outliving the request (the gateway keeps it referenced)."""


@dataclass(frozen=True, slots=True)
class PdContext:
    """What the legs use of the gateway: the router (every choice of instance), the pool (health), metrics, the SLO
    predictor, settings and a spawn function."""

    settings: GatewaySettings
    pool: Pool
    router: Router
    metrics: GatewayMetrics
    admission: Admission
    kind: ConnectorKind
    """How the connector hands KV over (:func:`pdctl.vllm.protocol.connector_kind` of ``settings.connector``)."""
    secrets: tuple[str, ...]
    """Keys to scrub from a worker's error message before it reaches the client."""
    spawn: Spawn
    upstream: Upstream | None = None
    """The upstream channel, for ``gateway.fallback = "upstream"``."""


@dataclass(slots=True)
class LegResult:
    """The outcome of one prefill attempt."""

    reply: dict[str, Any] | None
    error: ApiError | None
    retryable: bool
    elapsed_s: float
    request_id: str
    instance: Instance | None = None


def _headers(request_id: str, leg: Leg | None = None) -> dict[str, str]:
    headers = {"content-type": "application/json", "x-request-id": request_id}
    if leg is not None:
        headers.update(leg.headers)
    return headers


def _leg(ex: RequestRecord, name: str, inst: Instance, request_id: str) -> Leg | None:
    """The worker call's trace headers and span (:mod:`pdctl.gateway.tracing`); None without a trace."""
    return ex.trace.leg(name, inst.name, request_id) if ex.trace is not None else None


async def _prefill_once(
    ctx: PdContext,
    inst: Instance,
    endpoint: str,
    body: bytes,
    request_id: str,
    tokens: int,
    timeout_s: float,
    span: Leg | None = None,
) -> LegResult:
    result: LegResult | None = None
    try:
        result = await _prefill_call(ctx, inst, endpoint, body, request_id, tokens, timeout_s, span)
        return result
    finally:
        if span is not None:
            err = result.error if result is not None else None
            if result is None:
                span.end(None, "cancelled")
            else:
                span.end(200 if err is None else err.status, None if err is None else err.code or err.type)


async def _prefill_call(
    ctx: PdContext,
    inst: Instance,
    endpoint: str,
    body: bytes,
    request_id: str,
    tokens: int,
    timeout_s: float,
    span: Leg | None,
) -> LegResult:
    start = time.monotonic()
    try:
        with inst.track(tokens):
            # total_timeout_s bounds the whole leg (headers and body): leg 1 is one short JSON answer.
            resp = await inst.client.request(
                "POST", endpoint, body=body, headers=_headers(request_id, span), total_timeout_s=timeout_s
            )
            try:
                payload = await resp.read()
            finally:
                resp.close()
    except TransportError as exc:
        ctx.pool.record_failure(inst)
        if exc.kind in ("timeout", "connect_timeout"):
            err = ApiError(504, f"prefill {inst.name} did not answer within {timeout_s:.1f}s", code="prefill_timeout")
            return LegResult(None, err, True, time.monotonic() - start, request_id)
        if exc.kind == "connect":
            inst.set_healthy(False)  # out of the pool until a /health probe brings it back
        err = ApiError(502, f"prefill {inst.name} failed: {_what(exc)}", code="prefill_unavailable")
        return LegResult(None, err, True, time.monotonic() - start, request_id)
    elapsed = time.monotonic() - start
    if resp.status == 200:
        try:
            reply = codec.decode(payload)
        except ValueError:
            reply = None
        if isinstance(reply, dict):
            ctx.pool.record_success(inst)
            return LegResult(reply, None, False, elapsed, request_id, inst)
        ctx.pool.record_failure(inst)
        err = ApiError(502, f"prefill {inst.name} answered invalid JSON", code="prefill_failed")
        return LegResult(None, err, True, elapsed, request_id)
    err = translate_worker_error(resp.status, payload[:_MAX_ERROR_BODY], ctx.secrets)
    if resp.status >= 500 and err.status != 400:
        ctx.pool.record_failure(inst)
        err = ApiError(502, f"prefill {inst.name}: {err.message}", code="prefill_failed")
        return LegResult(None, err, True, elapsed, request_id)
    return LegResult(None, err, False, elapsed, request_id)


def _what(exc: TransportError) -> str:
    return {"connect": "ConnectError", "connect_timeout": "ConnectTimeout", "timeout": "ReadTimeout"}.get(
        exc.kind, "RemoteProtocolError"
    )


def _no_instance(ctx: PdContext, roles: tuple[Role, ...], what: str) -> ApiError:
    return ApiError(
        503, f"no {what} instance is available (all unhealthy or failing); retry later",
        code="server_overloaded", retry_after_s=ctx.pool.retry_after_s(roles),
    )  # fmt: skip


class _DecodeFailed(ApiError):
    """Decode failed before any byte reached the client (a whole new pipeline may be tried)."""


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
            await _fallback(ctx, ex, endpoint, body, prompt_tokens, _no_instance(ctx, ("prefill",), "prefill"))
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
            await _decode(
                ctx, ex, endpoint, dbody, leg.request_id, prompt_tokens, ("decode",), "decode", source=leg.instance,
                plan=plan if attempt == 0 else None,
            )  # fmt: skip
            return
        except _DecodeFailed as err:
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
        await _decode(ctx, ex, endpoint, build_decode_body(body, None), ex.request_id, prompt_tokens,
                      ("prefill",) if whole else ("decode",), "decode", plan=plan)  # fmt: skip
    except _DecodeFailed as err:
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
        await _decode(ctx, ex, endpoint, build_decode_body(body, None), ex.request_id, prompt_tokens, ("decode",),
                      "decode")  # fmt: skip
    except _DecodeFailed as failed:
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
        raise _no_instance(ctx, ("prefill",), "prefill")
    ex.in_leg1 = True
    leg: LegResult | None = None
    try:
        pbody = codec.encode(build_prefill_body(body, ctx.kind, endpoint))
        ahead = inst.in_flight_tokens
        timeout = max(0.05, min(ex.remaining(), ctx.settings.gateway.request_timeout_s))
        leg = await _prefill_once(
            ctx, inst, endpoint, pbody, rid, prompt_tokens, timeout, _leg(ex, "prefill", inst, rid)
        )
    finally:
        ex.in_leg1 = False
        ctx.router.prefill_done(inst, plan, leg is not None and leg.reply is not None)  # leg 1 ends once
    if ex.client_gone:  # the client left during leg 1: free what the prefill now holds, then end as cancelled
        if leg.reply is not None:
            ctx.spawn(_release(ctx, leg, endpoint, body, ex))
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
    await _decode(ctx, ex, endpoint, body, ex.request_id, prompt_tokens, roles, "worker")


async def _decode(
    ctx: PdContext,
    ex: RequestRecord,
    endpoint: str,
    body: Mapping[str, Any],
    request_id: str,
    prompt_tokens: int,
    roles: tuple[Role, ...],
    what: str,
    source: Instance | None = None,
    plan: RoutePlan | None = None,
) -> None:
    """Leg 2 (or the whole colocated request) on the least-loaded of ``roles``; ``source``: the prefill holding
    the KV this request pulls; ``plan``: the adaptive decision, whose decode is taken while it is available and
    whose prompt blocks that decode then holds."""
    inst = ctx.router.take_decode(roles, plan)
    if plan is not None and ctx.router.by_request:
        ex.decision = plan.log_fields()
    if inst is None:
        raise _no_instance(ctx, roles, what)
    ex.decode = inst.name
    keep: Kept | None = None
    if ex.wire == "openai" and migration.eligible(endpoint, body, ex.stream, ctx.settings.gateway.migration_limit):
        keep = Kept(show_prompt_ids=bool(body.get("return_token_ids")), fold=migration.summary_event)
        body = migration.first_leg_body(body)
    payload = codec.encode(body)
    span = _leg(ex, ex.path if ex.path in _LEG_NAMES else "decode", inst, request_id)
    try:
        await _decode_call(ctx, ex, inst, endpoint, payload, request_id, prompt_tokens, roles, what, source, plan, span,
                           (body, keep) if keep is not None else None)  # fmt: skip
    except ApiError as err:
        if span is not None:
            span.end(err.status, err.code or err.type)
        raise
    except BaseException:
        if span is not None:
            span.end(None, "cancelled")
        raise
    if span is not None:
        span.end(ex.status or 200, ex.error_code)


async def _decode_call(
    ctx: PdContext,
    ex: RequestRecord,
    inst: Instance,
    endpoint: str,
    payload: bytes,
    request_id: str,
    prompt_tokens: int,
    roles: tuple[Role, ...],
    what: str,
    source: Instance | None,
    plan: RoutePlan | None,
    span: Leg | None,
    kept: tuple[Mapping[str, Any], Kept] | None = None,
) -> None:
    """The call itself; ``kept``: a migratable stream's body and forwarded events (:mod:`pdctl.gateway.migration`),
    continued elsewhere when it breaks after its first byte."""
    stream = ex.stream
    concurrency = sum(i.in_flight for i in ctx.pool.instances if i.role in roles)
    headers = _headers(request_id, span)
    sent = time.monotonic()
    # Until the first token: the request's deadline plus the KV handoff's. Each read is also bounded by the
    # client's read timeout (request_timeout_s), so an explicit deadline (a Task per wait) is only needed
    # when it is the shorter one, e.g. after a slow leg 1.
    first_deadline = ex.remaining() + ctx.settings.kv_timeout_s
    bounded = first_deadline if first_deadline < ctx.settings.gateway.request_timeout_s else None
    with inst.track(prompt_tokens):
        try:
            call = inst.client.request("POST", endpoint, body=payload, headers=headers)
            resp = await (call if bounded is None else asyncio.wait_for(call, timeout=max(0.05, bounded)))
        except (TimeoutError, TransportError) as exc:
            _count_failure(ctx, inst, source)
            if isinstance(exc, asyncio.TimeoutError) or exc.kind in ("timeout", "connect_timeout"):
                raise _DecodeFailed(504, f"{what} {inst.name} did not answer in time", code="decode_timeout") from None
            if exc.kind == "connect":
                inst.set_healthy(False)
            raise _DecodeFailed(502, f"{what} {inst.name} failed: {_what(exc)}", code="decode_unavailable") from None
        try:
            headers_at = time.monotonic()
            ctx.metrics.child(ctx.metrics.leg, "handoff").observe(headers_at - sent)
            if resp.status != 200:
                try:
                    err_body = await resp.read()
                except TransportError:
                    err_body = b""
                err = translate_worker_error(resp.status, err_body[:_MAX_ERROR_BODY], ctx.secrets)
                if resp.status >= 500 and err.status != 400:
                    _count_failure(ctx, inst, source)
                    raise _DecodeFailed(err.status, f"{what} {inst.name}: {err.message}", code="decode_failed")
                raise err
            if stream:
                resp.stall_timeout(ctx.settings.gateway.stall_timeout_s)
            result = await relay(
                ex,
                resp,
                stream,
                None if bounded is None else max(0.05, bounded - (time.monotonic() - sent)),
                kept[1] if kept is not None else None,
            )
        finally:
            resp.close()
    failed = result.error is not None
    if failed:
        # After a first token the KV was already pulled: whatever broke is decode's.
        _count_failure(ctx, inst, source if result.first_chunk_at is None else None)
    if result.error is not None and kept is not None and not ex.finished:
        result.error = await _migrate(ctx, ex, endpoint, kept, inst, result.error)
        result.completion_tokens = ex.tokens
    if not failed:
        ctx.pool.record_success(inst)
        ctx.router.decode_done(inst, plan)
    elif result.error is not None:
        ctx.metrics.stream_errors.labels(result.error.code or "error").inc()
    ex.tokens = result.completion_tokens
    # Only a stream's first chunk is a first token; a non-streamed body arrives when decode is done.
    if stream and result.first_chunk_at is not None:
        ctx.metrics.child(ctx.metrics.leg, "first_chunk").observe(result.first_chunk_at - headers_at)
        ctx.admission.observe_handoff(result.first_chunk_at - sent)
        ex.ttft_s = result.first_chunk_at - ex.started
        n = result.completion_tokens
        if n and n > 1 and result.last_chunk_at is not None and not failed:
            tpot = (result.last_chunk_at - result.first_chunk_at) / (n - 1)
            ctx.metrics.child(ctx.metrics.tpot, ex.path).observe(tpot)
            ctx.admission.observe_itl(tpot, max(1, concurrency + 1))
    if result.prompt_tokens is not None and ex.prompt_tokens is None:
        ex.prompt_tokens = result.prompt_tokens


async def _migrate(
    ctx: PdContext,
    ex: RequestRecord,
    endpoint: str,
    kept: tuple[Mapping[str, Any], Kept],
    inst: Instance,
    err: ApiError,
) -> ApiError | None:
    """Continue a stream that broke after its first byte (:mod:`pdctl.gateway.migration`); the error, answered as
    the stream's last event, when it could not be."""
    body, keep = kept
    sent = migration.read_sent(keep.events, keep.prompt_ids)
    ex.tokens = len(sent.tokens)
    try:
        await migration.resume(ctx, ex, endpoint, body, sent, inst, err, keep.show_prompt_ids)
    except ApiError as last:
        await ex.fail(last)
        return last
    ex.error_code = None
    return None


def _count_failure(ctx: PdContext, inst: Instance, source: Instance | None) -> None:
    """Count a failed call against ``inst``, unless it may be the KV source's fault (see :func:`_blame`)."""
    if source is None or source is inst:
        ctx.pool.record_failure(inst)
    else:
        ctx.spawn(_blame(ctx, inst, source))


async def _blame(ctx: PdContext, decode: Instance, prefill: Instance) -> None:
    """A decode failed before its first token, so maybe while pulling KV from ``prefill``. When that prefill is
    down (it fails a ``/health`` probe now), the failure is the prefill's: counting it against decode would
    eject a healthy decode for every request that was in flight when a prefill crashed."""
    await ctx.pool.probe(prefill)
    if prefill.healthy is False:
        ctx.pool.record_failure(prefill)
        log.warning("decode %s failed pulling KV from prefill %s, which is down: counted against %s",
                    decode.name, prefill.name, prefill.name)  # fmt: skip
    else:
        ctx.pool.record_failure(decode)


async def _release(ctx: PdContext, leg: LegResult, endpoint: str, body: Mapping[str, Any], ex: RequestRecord) -> None:
    """The client left during leg 1, which finished: have decode pull (and so free) the blocks."""
    assert leg.reply is not None
    check = check_kv_params(leg.reply)
    if not check.usable or check.params is None:
        ctx.metrics.kv_release.labels("nothing_held").inc()
        return
    dbody = build_decode_body(body, check.params)
    cap_output(dbody, endpoint)
    inst = ctx.router.release_target()
    if inst is None:
        ctx.metrics.kv_release.labels("no_decode").inc()
        return
    rid = f"{leg.request_id}-release"
    span = _leg(ex, "release", inst, rid)
    status: int | None = None
    try:
        with inst.track(0):
            resp = await inst.client.request(
                "POST", endpoint, body=codec.encode(dbody), headers=_headers(rid, span),
                total_timeout_s=ctx.settings.kv_timeout_s + ctx.settings.gateway.request_timeout_s,
            )  # fmt: skip
            try:
                await resp.read()
            finally:
                resp.close()
        status = resp.status
        ctx.metrics.kv_release.labels("ok" if resp.status == 200 else "error").inc()
    except TransportError:
        ctx.metrics.kv_release.labels("error").inc()
    finally:
        if span is not None:
            span.end(status, None if status == 200 else "release_failed")
    log.info("request %s: client left during leg 1; release leg sent to %s", leg.request_id, inst.name)
