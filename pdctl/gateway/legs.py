"""One worker call of the PD flow each (:mod:`pdctl.gateway.pd` orders them): leg 1 on a prefill
(:func:`prefill_once`), leg 2 or a whole request on a decode (:func:`decode`, whose stream a migration continues when
it breaks after its first byte, :mod:`pdctl.gateway.migration`), and the release leg that frees a prefill's KV when
the client left during leg 1 (:func:`release`). Each call is traced (:mod:`pdctl.gateway.tracing`), counted against
its instance's breaker (a decode that fails pulling KV from a prefill that is down is the prefill's failure,
:func:`_blame`), and sees the gateway only through a :class:`PdContext`; instances come from its
:class:`~pdctl.gateway.routing.Router`.
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
from pdctl.vllm.protocol import ConnectorKind, build_decode_body, cap_output, check_kv_params
from pdctl.vllm.transport import TransportError

__all__ = [
    "DecodeFailed",
    "LegResult",
    "PdContext",
    "Spawn",
    "decode",
    "no_instance",
    "prefill_once",
    "release",
    "trace_leg",
]

log = logging.getLogger("pdctl.gateway")
_MAX_ERROR_BODY = 64 * 1024
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


def trace_leg(ex: RequestRecord, name: str, inst: Instance, request_id: str) -> Leg | None:
    """The worker call's trace headers and span (:mod:`pdctl.gateway.tracing`); None without a trace."""
    return ex.trace.leg(name, inst.name, request_id) if ex.trace is not None else None


async def prefill_once(
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


def no_instance(ctx: PdContext, roles: tuple[Role, ...], what: str) -> ApiError:
    return ApiError(
        503, f"no {what} instance is available (all unhealthy or failing); retry later",
        code="server_overloaded", retry_after_s=ctx.pool.retry_after_s(roles),
    )  # fmt: skip


class DecodeFailed(ApiError):
    """Decode failed before any byte reached the client (a whole new pipeline may be tried)."""


async def decode(
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
        raise no_instance(ctx, roles, what)
    ex.decode = inst.name
    keep: Kept | None = None
    if ex.wire == "openai" and migration.eligible(endpoint, body, ex.stream, ctx.settings.gateway.migration_limit):
        keep = Kept(show_prompt_ids=bool(body.get("return_token_ids")), fold=migration.summary_event)
        body = migration.first_leg_body(body)
    payload = codec.encode(body)
    span = trace_leg(ex, ex.path if ex.path in _LEG_NAMES else "decode", inst, request_id)
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
                raise DecodeFailed(504, f"{what} {inst.name} did not answer in time", code="decode_timeout") from None
            if exc.kind == "connect":
                inst.set_healthy(False)
            raise DecodeFailed(502, f"{what} {inst.name} failed: {_what(exc)}", code="decode_unavailable") from None
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
                    raise DecodeFailed(err.status, f"{what} {inst.name}: {err.message}", code="decode_failed")
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


async def release(ctx: PdContext, leg: LegResult, endpoint: str, body: Mapping[str, Any], ex: RequestRecord) -> None:
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
    span = trace_leg(ex, "release", inst, rid)
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
