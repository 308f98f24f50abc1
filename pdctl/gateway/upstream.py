"""The upstream channel: models not served locally go to ``gateway.upstream_base_url``.

Base-URL convention (as the OpenAI SDK, plus the recipe's case): a base whose path ends in a version
segment (``/v1``, ``/v4``) gets the endpoint appended (``https://api.openai.com/v1`` ->
``.../v1/chat/completions``); any other base gets ``/v1`` and the endpoint (the recipe's
``https://taotoken.net/api`` -> ``https://taotoken.net/api/v1/chat/completions``, which is taotoken's
documented URL).

Retries happen only before the first byte reached the client, only for connection errors, timeouts,
429/502/503/504, at most ``gateway.max_retries`` times, each with a new request id, within the
request's deadline. A ``Retry-After`` longer than :data:`MAX_RETRY_AFTER_WAIT_S` is passed on to the client
instead of waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from typing import Any

import httpx

from pdctl.gateway import codec
from pdctl.gateway.errors import ApiError, sanitize
from pdctl.gateway.metrics import GatewayMetrics
from pdctl.gateway.record import RequestRecord
from pdctl.gateway.relay import relay
from pdctl.vllm.transport import TransportError

__all__ = ["MAX_RETRY_AFTER_WAIT_S", "Upstream", "upstream_url"]

MAX_RETRY_AFTER_WAIT_S = 5.0
RETRY_STATUSES = frozenset({429, 502, 503, 504})
_VERSION = re.compile(r"/v\d+$")


def upstream_url(base: str, endpoint: str) -> str:
    """``base`` + ``endpoint`` (``/chat/completions``, ``/models``) by the convention above."""
    base = base.rstrip("/")
    if not _VERSION.search(base):
        base += "/v1"
    return base + endpoint


def _retry_after(resp: httpx.Response) -> float | None:
    ms = resp.headers.get("retry-after-ms")
    if ms:
        with contextlib.suppress(ValueError):
            return float(ms) / 1000.0
    value = resp.headers.get("retry-after")
    if value:
        with contextlib.suppress(ValueError):
            return max(0.0, float(value))
    return None


class _HttpxBody:
    """An httpx response as the relay reads it (:class:`pdctl.gateway.relay.Body`), failures as ``TransportError``."""

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self._chunks = resp.aiter_raw()

    async def read(self) -> bytes:
        try:
            return await self._resp.aread()
        except httpx.HTTPError as exc:
            raise _transport_error(exc) from exc

    async def chunk(self) -> bytes:
        try:
            async for data in self._chunks:
                if data:
                    return data
            return b""
        except httpx.HTTPError as exc:
            raise _transport_error(exc) from exc


def _transport_error(exc: httpx.HTTPError) -> TransportError:
    if isinstance(exc, httpx.TimeoutException):
        return TransportError("timeout", str(exc) or type(exc).__name__)
    return TransportError("broken", str(exc) or type(exc).__name__)


class Upstream:
    """One pooled client to the upstream API; ``secrets``: keys to scrub from its error messages (``key`` too)."""

    def __init__(
        self,
        base_url: str,
        key: str,
        request_timeout_s: float,
        max_retries: int,
        metrics: GatewayMetrics,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.base_url = base_url
        self.max_retries = max_retries
        self._key = key
        self._metrics = metrics
        self._secrets = (*secrets, key)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=min(10.0, request_timeout_s)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._models: tuple[float, list[dict[str, Any]]] = (0.0, [])

    def _headers(self, request_id: str) -> dict[str, str]:
        return {
            "authorization": f"Bearer {self._key}",
            "content-type": "application/json",
            "x-request-id": request_id,
            "accept-encoding": "identity",
        }

    async def models(self) -> list[dict[str, Any]]:
        """The upstream's ``/models`` (cached 60 s; empty when unreachable)."""
        at, cached = self._models
        if time.monotonic() - at < 60.0:
            return cached
        data: list[dict[str, Any]] = []
        try:
            resp = await self.client.get(
                upstream_url(self.base_url, "/models"), headers=self._headers("models"), timeout=3.0
            )
            payload = resp.json() if resp.status_code == 200 else None
            if isinstance(payload, dict) and isinstance(payload.get("data"), list):
                data = [m for m in payload["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (httpx.HTTPError, ValueError):
            data = []
        self._models = (time.monotonic(), data)
        return data

    async def serve(self, ex: RequestRecord, endpoint: str, body: dict[str, Any]) -> None:
        """Send the request upstream and relay the answer."""
        ex.path = "upstream"
        url = upstream_url(self.base_url, endpoint.removeprefix("/v1"))
        content = codec.encode(body)
        for attempt in range(self.max_retries + 1):
            rid = ex.request_id if attempt == 0 else f"{ex.request_id}-retry{attempt}"
            req = self.client.build_request("POST", url, content=content, headers=self._headers(rid))
            wait: float | None = None
            err: ApiError
            try:
                resp = await asyncio.wait_for(self.client.send(req, stream=True), timeout=max(0.05, ex.remaining()))
            except (TimeoutError, httpx.TimeoutException):
                self._metrics.upstream_calls.labels("timeout").inc()
                err = ApiError(504, "the upstream API did not answer in time", code="upstream_timeout")
            except httpx.HTTPError as exc:
                self._metrics.upstream_calls.labels("connect_error").inc()
                err = ApiError(502, f"the upstream API is unreachable ({type(exc).__name__})", code="upstream_error")
            else:
                try:
                    if resp.status_code == 200:
                        self._metrics.upstream_calls.labels("ok").inc()
                        result = await relay(ex, _HttpxBody(resp), ex.stream)
                        if ex.stream and result.first_chunk_at is not None:
                            ex.ttft_s = result.first_chunk_at - ex.started
                        ex.tokens = result.completion_tokens
                        ex.prompt_tokens = result.prompt_tokens
                        return
                    payload = (await resp.aread())[:65536]
                finally:
                    await resp.aclose()
                self._metrics.upstream_calls.labels(str(resp.status_code)).inc()
                err = self._translate(resp, payload, self._secrets)
                if resp.status_code not in RETRY_STATUSES:
                    raise err
                wait = _retry_after(resp)
            if attempt >= self.max_retries:
                raise err
            delay = wait if wait is not None else random.uniform(0, min(2.0, 0.25 * 2**attempt))
            if (wait is not None and wait > MAX_RETRY_AFTER_WAIT_S) or delay >= ex.remaining():
                raise err
            self._metrics.retries.labels("upstream").inc()
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    @staticmethod
    def _translate(resp: httpx.Response, payload: bytes, secrets: tuple[str, ...]) -> ApiError:
        message = ""
        try:
            data = json.loads(payload)
            e = data.get("error") if isinstance(data, dict) else None
            message = str(e.get("message") if isinstance(e, dict) else e or "")
        except ValueError:
            message = payload[:200].decode("utf-8", "replace")
        message = sanitize(message, secrets)
        status = resp.status_code
        if status in (401, 403):
            return ApiError(
                502, "the upstream API rejected the gateway's upstream key; check gateway.upstream_api_key_env",
                code="upstream_auth_error",
            )  # fmt: skip
        if status == 429:
            return ApiError(429, message or "the upstream API is rate limiting", code="rate_limit_exceeded",
                            retry_after_s=_retry_after(resp) or 1.0)  # fmt: skip
        if status in (502, 503, 504):
            return ApiError(502 if status != 504 else 504, f"the upstream API failed ({status}) {message}".strip(),
                            code="upstream_error", retry_after_s=_retry_after(resp))  # fmt: skip
        if 400 <= status < 500:
            err = ApiError(status if status in (400, 404, 413, 422) else 400, message or f"upstream {status}",
                           code="upstream_rejected")  # fmt: skip
            return err
        return ApiError(502, f"the upstream API failed ({status})", code="upstream_error")

    async def close(self) -> None:
        """Close the client."""
        await self.client.aclose()
