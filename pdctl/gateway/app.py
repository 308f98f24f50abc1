"""The gateway as a raw ASGI app (no Starlette middleware: it would hide client disconnects).

Request flow for the generating routes (chat, completions, ``/v1/responses``, Anthropic ``/v1/messages``;
errors in each route's own shape, :data:`pdctl.gateway.errors.Wire`)::

    draining? -> auth -> body (413 before reading it all) -> JSON/UTF-8/nesting (400)
      -> validation (400) -> model: local | upstream | 404 (routed once) -> fits the context (400)
      -> rate limit (429) -> adaptive PD's decision (``routing.pd_mode = "adaptive"``: local or both legs; ``"auto"``:
         the SLO autopilot's, :mod:`pdctl.gateway.routing.autopilot`: local, whole on a prefill engine, or both legs)
      -> SLO admission (503 or overflow to upstream) -> pd_disagg | colocated | upstream

A client that leaves cancels the handler, and with it the worker calls (vLLM aborts the request when the
connection closes): the gateway's server tells the request from its connection's ``connection_lost``
(:func:`pdctl.gateway.direct.watch_disconnect`), another ASGI server through a watcher task per request that waits
for ``http.disconnect``. During leg 1 a disconnect only marks the client gone, and the PD flow frees the prefill's
KV when leg 1 is over (:mod:`pdctl.gateway.pd`). Parsing and validation are the pure functions of
:mod:`pdctl.gateway.request`. ``/v1/embeddings`` and ``/tokenize`` pass through to a worker when the model is local
(the worker's answer as it is), else to the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from pdctl.errors import ConfigError
from pdctl.gateway import agent_sessions, asgi
from pdctl.gateway.admission import Admission
from pdctl.gateway.advisor import Advisor, observe_tokens
from pdctl.gateway.asgi import Receive, Scope, Send
from pdctl.gateway.direct import watch_disconnect
from pdctl.gateway.discovery import Discovery
from pdctl.gateway.errors import ApiError
from pdctl.gateway.keys import KeyEntry, KeyRing
from pdctl.gateway.legs import PdContext
from pdctl.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from pdctl.gateway.pd import serve_colocated, serve_pd
from pdctl.gateway.ratelimit import RateLimiter
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.request import (
    COMPLETION_PATHS,
    PASSTHROUGH_PATHS,
    CompletionRequest,
    Route,
    body_limit,
    check_fits,
    check_lists,
    parse_body_off_loop,
    read_model,
    route_model,
    validate,
    value_limit,
    wire_of,
)
from pdctl.gateway.routing import Choice, Pool, RoutePlan, Router
from pdctl.gateway.settings import GatewaySettings
from pdctl.gateway.tokens import TokenCounter
from pdctl.gateway.tracing import Tracing, answer_text
from pdctl.gateway.upstream import Upstream
from pdctl.gateway.workers import ClientFactory
from pdctl.vllm.protocol import connector_kind

__all__ = ["Gateway", "create_app"]

log = logging.getLogger("pdctl.gateway")
access = logging.getLogger("pdctl.gateway.access")


class Gateway:
    """The gateway's state, lifecycle and dispatch; an ASGI app (``await gw(scope, receive, send)``).

    It reads the body, checks it with :mod:`pdctl.gateway.request`, applies limits and admission, hands the request
    to :mod:`pdctl.gateway.pd` (with :attr:`legs`, the narrow context built once) or to the upstream, and records
    the outcome. ``clients``: how the pool reaches the workers (:mod:`pdctl.gateway.workers`). ``keys``: the
    client keys (default: ``gateway.keys_file`` when set, plus ``api_key`` named ``default`` when given).
    """

    def __init__(
        self,
        settings: GatewaySettings,
        api_key: str | None,
        upstream_key: str | None = None,
        clients: ClientFactory | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.pool = Pool(settings, self.metrics, clients)
        self.discovery = Discovery(self.pool)
        g = settings.gateway
        if keys is None:
            keys = (
                KeyRing.from_file(Path(g.keys_file), api_key, settings.process)
                if g.keys_file
                else KeyRing.single(api_key or "")
            )
        self.keys = keys
        self.tokens = TokenCounter()
        self.secrets = tuple(k for k in (api_key, upstream_key) if k)
        self.metrics_need_key = not g.metrics_public and g.listen_host not in ("127.0.0.1", "localhost", "::1")
        self.limiter = RateLimiter(settings.gateway.rate_limit, share=settings.process)
        self.admission = Admission(settings.slo)
        self.tracing = Tracing(settings.logging.otlp_traces_endpoint, settings.logging.trace_content)
        if g.upstream_base_url and not upstream_key and keys.per_user:
            raise ConfigError("settings.json", "gateway.upstream_api_key_env",
                              "per-user keys (gateway.keys_file) with an upstream need the upstream's own key",
                              hint='set "upstream_api_key_env": "TAOTOKEN_API_KEY" and export that variable; '
                              "client keys are never sent upstream")  # fmt: skip
        self.upstream = (
            Upstream(
                g.upstream_base_url,
                upstream_key or api_key or "",
                g.request_timeout_s,
                g.max_retries,
                self.metrics,
                self.secrets,
            )
            if g.upstream_base_url
            else None
        )
        self.draining = False
        self.in_flight = 0
        self._background: set[asyncio.Task[Any]] = set()
        self._started = False
        self.router = Router(settings, self.pool, self.metrics, lambda: self.admission.sec_per_token.mean)
        self.kv_events = self.router.events
        """The workers' KV cache events (``routing.prefix_view = "exact"``; None: not read)."""
        self.legs = PdContext(settings, self.pool, self.router, self.metrics, self.admission,
                              connector_kind(settings.connector), self.secrets, self.spawn, self.upstream)  # fmt: skip
        self.advisor = Advisor.of(settings, self.metrics, self.pool)
        """``slo.capacity_profile``: the sizing advice for the last window's traffic (None: not computed here)."""

    # ------------------------------------------------------------------------------------- lifecycle

    async def startup(self) -> None:
        """Resolve the endpoints' DNS names, probe the workers once and start the health and discovery loops."""
        if not self._started:
            self._started = True
            await self.discovery.start()
            await self.pool.start()
            self.spawn(self._load_tokenizers())
            if self.kv_events is not None:
                self.spawn(self.kv_events.run())
            if self.keys.per_user:
                self.spawn(self._watch_keys())
            if self.advisor is not None:
                self.spawn(self.advisor.run())

    async def _load_tokenizers(self) -> None:
        """Load each local model's tokenizer on a thread; until then (and without one) counts are estimates."""
        sources = {m.name: m.source or m.name for m in self.settings.models}
        for name in self.local_models():
            sources.setdefault(name, name)
        sim = [m.name for m in self.settings.models if m.engine == "sim"]
        await asyncio.to_thread(self.tokens.load, sources, sim)

    async def _watch_keys(self) -> None:
        """Reload the keys file when it changes (checked every second; SIGHUP reloads at once)."""
        while True:
            await asyncio.sleep(1.0)
            self.keys.reload_if_changed()

    def reload_keys(self) -> None:
        """Re-read the keys file now (SIGHUP)."""
        self.keys.reload()

    async def shutdown(self) -> None:
        """Stop background work and close clients."""
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.discovery.close()
        await self.pool.close()
        if self.upstream is not None:
            await self.upstream.close()
        await asyncio.to_thread(self.tracing.shutdown)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background, kept referenced until it ends."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---------------------------------------------------------------------------------------- models

    def local_models(self) -> dict[str, int | None]:
        """Local model ids and their ``max_model_len`` (from config, else from the workers' /v1/models)."""
        out: dict[str, int | None] = {m.name: m.max_model_len for m in self.settings.models}
        for inst in self.pool.instances:
            for m in inst.models:
                mid = m["id"]
                mlen = m.get("max_model_len")
                if mid in out or not self.settings.models:
                    if out.get(mid) is None and isinstance(mlen, int):
                        out[mid] = mlen
                    else:
                        out.setdefault(mid, None)
        return out

    # ------------------------------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if path in COMPLETION_PATHS or path in PASSTHROUGH_PATHS:
            if method != "POST":
                err = ApiError(405, f"use POST for {path}", code="method_not_allowed")
                await asgi.plain_error(send, err, wire_of(path))
                return
            await self._completion(scope, receive, send, path)
        elif path == "/health" and method in ("GET", "HEAD"):
            await asgi.json_response(send, 200, b'{"status":"ok"}')
        elif path == "/ready" and method in ("GET", "HEAD"):
            ready = self.pool.ready() and not self.draining
            self.metrics.ready.set(1 if ready else 0)
            body = json.dumps({"ready": ready, "draining": self.draining, "instances": [
                {"name": i.name, "role": i.role, "url": i.url, "state": i.state, "healthy": i.healthy,
                 "breaker_open": i.breaker_open, "in_flight": i.in_flight}
                for i in self.pool.instances]}).encode()  # fmt: skip
            await asgi.json_response(send, 200 if ready else 503, body)
        elif path == "/metrics" and method == "GET":
            if self.metrics_need_key and self.keys.identify(asgi.header(scope, b"authorization")) is None:
                await asgi.plain_error(send, asgi.auth_error())
                return
            self.metrics.tasks.set(len(asyncio.all_tasks()))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", CONTENT_TYPE.encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": self.metrics.render()})
        elif path == "/v1/models" and method == "GET":
            entry = self.keys.identify(asgi.header(scope, b"authorization"))
            if entry is None:
                await asgi.plain_error(send, asgi.auth_error())
                return
            await self._models(send, entry)
        else:
            await asgi.plain_error(send, ApiError(404, f"no route {method} {path}", code="not_found"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # a failed probe setup must not kill the server silently
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _models(self, send: Send, entry: KeyEntry) -> None:
        now = int(time.time())
        local = self.local_models()
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": now, "owned_by": "pdctl", "max_model_len": mlen}
            for name, mlen in local.items()
            if entry.may_use(name)
        ]
        if self.upstream is not None and entry.upstream:
            for m in await self.upstream.models():
                if m["id"] not in local and entry.may_use(m["id"]):
                    data.append({"id": m["id"], "object": "model", "created": m.get("created", now),
                                 "owned_by": m.get("owned_by", "upstream")})  # fmt: skip
        await asgi.json_response(send, 200, json.dumps({"object": "list", "data": data}).encode())

    # ----------------------------------------------------------------------------------- completions

    async def _completion(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        started = time.monotonic()
        rid_header = asgi.header(scope, b"x-request-id")
        # the form of uuid4().hex, without a UUID object
        rid = asgi.clean_id(rid_header) or f"pdctl-{os.urandom(16).hex()}"
        ex = RequestRecord(send=send, request_id=rid, started=started,
                           deadline=started + self.settings.gateway.request_timeout_s, wire=wire_of(endpoint),
                           trace=self.tracing.start("POST", endpoint, asgi.header(scope, b"traceparent"),
                                                    asgi.header(scope, b"tracestate")))  # fmt: skip
        self.in_flight += 1
        self.metrics.accepted.inc()
        self.metrics.gateway_in_flight.inc()
        key_limiter: RateLimiter | None = None
        key_name = "-"
        watcher: asyncio.Task[None] | None = None
        choice: Choice | None = None
        try:
            if self.draining:
                raise ApiError(503, "the gateway is shutting down", code="server_shutting_down", retry_after_s=5)
            entry = self.keys.identify(asgi.client_key(scope, endpoint))
            if entry is None:
                raise asgi.auth_error()
            key_name = entry.name
            ex.upstream_allowed = entry.upstream
            held = self.keys.limiters.get(entry.name)
            if held is None:
                raise asgi.auth_error()
            held.check(0, entry.name)  # a key at its limits is refused before its body is read,
            self.limiter.check(0)
            held.hold()  # and holds its slot while the body is read: max_concurrency bounds bodies in memory
            self.limiter.hold()
            key_limiter = held
            raw = await self._read_body(scope, receive, ex)
            body = await parse_body_off_loop(raw, self.settings.max_nesting)
            if ex.trace is not None and ex.trace.wants_content:
                ex.trace.prompt(body)
                ex.transcript = []
            gone = asgi.client_gone(ex, asyncio.current_task())
            if not watch_disconnect(send, gone):
                watcher = asyncio.ensure_future(asgi.watch_disconnect(receive, gone))
            if endpoint in PASSTHROUGH_PATHS:
                await self._passthrough(ex, endpoint, body, entry)
                return
            req, route, prompt_tokens = await self._check(body, endpoint, ex, entry)
            tokens = prompt_tokens + (req.max_tokens or 0)
            if self.keys.limiters.get(entry.name) is None:  # revoked by a reload while this request was being read
                raise asgi.auth_error()
            held.check(tokens, entry.name, held=True)
            self.limiter.check(tokens, held=True)
            held.charge(tokens)
            self.limiter.charge(tokens)
            self.metrics.child(self.metrics.key_tokens, key_name).inc(tokens)
            pd = route == "local" and self.settings.routing.strategy != "colocated" and not req.colocated_only
            # Adaptive PD decides before admission: a request for the decode alone is judged without the prefill.
            plan = None
            if pd and self.router.by_request:
                ids = await self.tokens.prompt_ids(req.model, endpoint, body) if self.kv_events is not None else None
                who = agent_sessions.identify(lambda name: asgi.header(scope, name), body)
                plan = self.router.plan(body, prompt_tokens, ids, endpoint, who)
                if plan is not None:  # the SLO autopilot: local, whole on a prefill, or both legs
                    plan, choice = self.router.steer(plan)
            if route == "local":
                route = self._admit(ex, prompt_tokens, entry.upstream, plan)
            if route == "upstream":
                assert self.upstream is not None
                await self.upstream.serve(ex, endpoint, body)
            elif self.settings.routing.strategy == "colocated":
                await serve_colocated(self.legs, ex, endpoint, body, prompt_tokens)
            elif req.colocated_only:
                await serve_colocated(self.legs, ex, endpoint, body, prompt_tokens, ("decode",))
            else:
                await serve_pd(self.legs, ex, endpoint, body, prompt_tokens, plan)
        except ApiError as err:
            if ex.path in ("-", "rejected"):
                ex.path = "rejected"
                self.metrics.rejected.labels(err.reason or "error").inc()
            await self._fail(ex, err)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not ex.client_gone:
                with contextlib.suppress(Exception):
                    await ex.fail(ApiError(503, "the gateway is shutting down", code="server_shutting_down"))
                raise
            if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11
                task.uncancel()
            ex.status = 499
            phase = "before_first_byte" if not ex.headers_sent else "streaming"
            self.metrics.client_cancelled.labels(phase).inc()
        except Exception:
            log.exception("request %s: internal error", rid)
            await self._fail(ex, ApiError(500, "internal gateway error (see the gateway log)", code="internal_error"))
        finally:
            if watcher is not None:
                watcher.cancel()
            else:
                watch_disconnect(send, None)
            if key_limiter is not None:
                key_limiter.release()
                self.limiter.release()
            self.in_flight -= 1
            self.metrics.gateway_in_flight.dec()
            if choice is not None:
                self.router.finish(choice, ex)
            self._finish(ex, key_name)

    async def _fail(self, ex: RequestRecord, err: ApiError) -> None:
        with contextlib.suppress(Exception):
            await ex.fail(err)
        if not ex.status:
            ex.status = err.status

    def _finish(self, ex: RequestRecord, key_name: str) -> None:
        duration = time.monotonic() - ex.started
        status_label = ex.outcome()
        m = self.metrics
        m.child(m.requests, ex.path, status_label).inc()
        m.child(m.key_requests, key_name, status_label).inc()
        m.child(m.duration, ex.path).observe(duration)
        if ex.ttft_s is not None:
            m.child(m.ttft, ex.path).observe(ex.ttft_s)
        observe_tokens(m, ex)
        if ex.trace is not None and ex.trace.recording:
            if ex.transcript:
                ex.trace.answer(answer_text(b"".join(ex.transcript), ex.stream))
            ex.trace.end(ex.span_attributes(status_label), status_label == "stream_error" or ex.status >= 500)
        access.info(ex.access_line(status_label, duration))

    async def _read_body(self, scope: Scope, receive: Receive, ex: RequestRecord) -> bytes:
        configured, lens, upstream = self.settings.gateway.max_body_bytes, self.local_models().values(), self.upstream
        limit = body_limit(configured, lens, upstream is not None)
        return await asgi.read_body(scope, receive, ex, limit, value_limit(configured, lens, upstream is not None))

    async def _passthrough(self, ex: RequestRecord, endpoint: str, body: dict[str, Any], entry: KeyEntry) -> None:
        """``/v1/embeddings``, ``/tokenize``, ``/v1/messages/count_tokens``: a local model's request to a worker,
        any other embeddings request to the upstream (when the key may use it)."""
        model = body.get("model")
        ex.model = model if isinstance(model, str) and model else "-"
        local = self.local_models()
        if model is None and endpoint == "/tokenize":
            model = next(iter(local), None)  # vLLM's /tokenize defaults to its one model
        if not isinstance(model, str):
            model = read_model(body)
        if not entry.may_use(model):
            raise ApiError(403, f"key {entry.name!r} may not use model {model!r}", param="model",
                           type="permission_error", code="model_not_allowed")  # fmt: skip
        upstream_ok = self.upstream is not None and endpoint == "/v1/embeddings" and entry.upstream
        route = route_model(model, local, upstream_ok)
        if route == "upstream":
            assert self.upstream is not None
            await self.upstream.serve(ex, endpoint, body)
            return
        await serve_colocated(self.legs, ex, endpoint, body, 1, ("decode", "prefill"))

    async def _check(
        self, body: dict[str, Any], endpoint: str, ex: RequestRecord, entry: KeyEntry
    ) -> tuple[CompletionRequest, Route, int]:
        """Validate ``body``, count its prompt tokens, route its model once and check the key may use it.

        The count is the model tokenizer's when loaded (then the context check uses it too), else
        :func:`pdctl.gateway.tokens.estimate_tokens`, for limits and admission only.
        """
        ex.model = read_model(body)
        req = validate(body, endpoint, ex.model)
        ex.stream = req.stream
        check_lists(req, self.local_models().get(req.model))
        prompt_tokens = await self.tokens.count(req.model, body)
        if self.tokens.exact(req.model):
            req.prompt_tokens = prompt_tokens
        local = self.local_models()
        route = route_model(req.model, local, self.upstream is not None)
        if not entry.may_use(req.model):
            raise ApiError(403, f"key {entry.name!r} may not use model {req.model!r}", param="model",
                           type="permission_error", code="model_not_allowed")  # fmt: skip
        if route == "upstream" and not entry.upstream:
            raise ApiError(403, f"key {entry.name!r} may not use the upstream channel, which serves {req.model!r}",
                           param="model", type="permission_error", code="upstream_not_allowed")  # fmt: skip
        check_fits(req, route, self.settings.routing.strategy == "pd_disagg", local.get(req.model))
        return req, route, prompt_tokens

    def _admit(
        self, ex: RequestRecord, prompt_tokens: int, may_overflow: bool = True, plan: RoutePlan | None = None
    ) -> Route:
        """The SLO predictor's verdict on the load ahead of the request (:meth:`Router.load_ahead`)."""
        if self.settings.routing.strategy == "colocated":
            return "local"
        tokens, ahead, concurrency = self.router.load_ahead(plan, prompt_tokens)
        verdict = self.admission.decide(tokens, ahead, concurrency)
        if verdict.admit:
            return "local"
        if self.settings.slo.overflow == "upstream" and self.upstream is not None and may_overflow:
            self.metrics.rejected.labels(f"slo_{verdict.reason}_overflow").inc()
            log.info("request %s: SLO predictor (%s) sends it upstream", ex.request_id, verdict.reason)
            return "upstream"
        ex.path = "rejected"
        what = "time to first token" if verdict.reason == "ttft" else "time per output token"
        raise ApiError(
            503, f"server overloaded: predicted {what} would miss the SLO; retry later",
            type="server_error", code="server_overloaded", retry_after_s=verdict.retry_after_s,
            should_retry=False, reason=f"slo_{verdict.reason}",
        )  # fmt: skip


def create_app(
    settings: GatewaySettings,
    api_key: str | None,
    upstream_key: str | None = None,
    clients: ClientFactory | None = None,
    keys: KeyRing | None = None,
) -> Gateway:
    """The ASGI app for ``settings``; keys come from the caller (read from the environment by the CLI).

    With ``gateway.keys_file`` set, ``api_key`` is optional (accepted as the key named ``default``).
    ``clients``: how to reach the workers (default: HTTP; :class:`pdctl.gateway.memory.MemoryWorkers` in tests).
    """
    return Gateway(settings, api_key, upstream_key, clients, keys)
