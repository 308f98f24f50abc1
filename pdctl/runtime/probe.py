"""The two-leg call straight to a prefill and a decode worker, and ``up``'s warm-up probe built on it.

vLLM's NIXL handshake is lazy: the first P→D request performs it, and on a loaded machine that first
attempt can fail with HTTP 500 (``handshake_setup_failed``). ``up`` runs this probe for every
prefill→decode pair before the gateway opens, retrying with a fresh request id, so the link is proven
and the first user request does not pay for the handshake. :func:`two_legs` is the one call both the
warm-up and ``verify``'s KV probes send (the gateway runs the same legs through ``pdctl.vllm.protocol``).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdctl.config import Deployment
from pdctl.errors import LaunchError
from pdctl.vllm.identity import fetch_identity, identity_problems
from pdctl.vllm.protocol import (
    ConnectorKind,
    KVParamsCheck,
    build_decode_body,
    build_prefill_body,
    check_kv_params,
    connector_kind,
)

__all__ = ["ProbeAttempt", "ProbeResult", "TwoLegs", "describe_http_error", "probe_pair", "run_warmup", "two_legs"]

MAX_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class ProbeAttempt:
    """One two-leg try: its request id, and the error if it failed (None when it passed)."""

    request_id: str
    error: str | None
    retryable: bool = True


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome for one prefill→decode pair."""

    prefill: str
    decode: str
    ok: bool
    attempts: tuple[ProbeAttempt, ...] = field(default_factory=tuple)

    @property
    def error(self) -> str | None:
        """The last attempt's error."""
        return self.attempts[-1].error if self.attempts else None


@dataclass(frozen=True, slots=True)
class TwoLegs:
    """What one two-leg call through a prefill and a decode worker brought back.

    ``params`` is prefill's ``kv_transfer_params`` check (None when leg 1 failed); ``decode_body`` the
    parsed decode reply (None when leg 2 was not sent or answered no JSON); ``error`` the first failure.
    """

    request_id: str
    prefill_status: int = 0
    params: KVParamsCheck | None = None
    decode_status: int = 0
    decode_body: Any = None
    error: str | None = None
    retryable: bool = True


def _reply_error(leg: str, url: str, r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    message = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
    return f"{leg} leg ({url}) answered HTTP {r.status_code}: {message or r.text[:200]}"


def two_legs(
    client: httpx.Client,
    prefill_url: str,
    decode_url: str,
    body: Mapping[str, Any],
    kind: ConnectorKind,
    request_id: str,
    *,
    prefill_model: str | None = None,
    require_params: bool = True,
    timeout_s: float | None = None,
) -> TwoLegs:
    """Send ``body`` through prefill then decode with one ``X-Request-Id``, as the gateway does.

    ``prefill_model`` names the model prefill serves (each leg names its own worker's model, so a served-name
    mismatch cannot hide the link). With ``require_params`` an unusable ``kv_transfer_params`` ends the call
    (not retryable: the worker runs without the right connector); without it decode gets no params, which is
    how verify measures the silent fallback.
    """
    headers = {"X-Request-Id": request_id}
    extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
    leg1 = build_prefill_body({**body, "model": prefill_model or body.get("model")}, kind)
    try:
        r1 = client.post(f"{prefill_url}/v1/completions", json=leg1, headers=headers, **extra)
    except httpx.HTTPError as exc:
        return TwoLegs(request_id, error=f"prefill leg ({prefill_url}): {describe_http_error(exc)}")
    if r1.status_code != 200:
        return TwoLegs(request_id, r1.status_code, error=_reply_error("prefill", prefill_url, r1))
    try:
        reply = r1.json()
    except ValueError:
        return TwoLegs(request_id, 200, error=f"prefill leg ({prefill_url}) answered non-JSON: {r1.text[:200]}")
    check = check_kv_params(reply if isinstance(reply, Mapping) else {})
    params = check.params if check.usable and kind != "shared_storage" else None
    if kind != "shared_storage" and not check.usable and require_params:
        detail = f"missing fields {', '.join(check.missing)}" if check.missing else check.reason
        return TwoLegs(
            request_id,
            200,
            check,
            error=f"prefill {prefill_url} returned no usable kv_transfer_params ({detail})",
            retryable=False,
        )
    try:
        r2 = client.post(f"{decode_url}/v1/completions", json=build_decode_body(body, params), headers=headers, **extra)
    except httpx.HTTPError as exc:
        return TwoLegs(request_id, 200, check, error=f"decode leg ({decode_url}): {describe_http_error(exc)}")
    try:
        decoded: Any = r2.json()
    except ValueError:
        decoded = None
    if r2.status_code != 200:
        return TwoLegs(request_id, 200, check, r2.status_code, decoded, _reply_error("decode", decode_url, r2))
    return TwoLegs(request_id, 200, check, 200, decoded)


def describe_http_error(exc: Exception) -> str:
    """A short reason for a failed HTTP call (``connection refused``, ``timed out (ReadTimeout)``, ...)."""
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


def _one(
    client: httpx.Client, prefill_url: str, decode_url: str, model: str, kind: ConnectorKind, rid: str
) -> ProbeAttempt:
    body = {"model": model, "prompt": f"pdctl warm-up probe {rid}", "max_tokens": 2, "temperature": 0}
    legs = two_legs(client, prefill_url, decode_url, body, kind, rid)
    return ProbeAttempt(rid, legs.error, legs.retryable)


def probe_pair(
    prefill_url: str,
    decode_url: str,
    model: str,
    kind: ConnectorKind = "params",
    *,
    timeout_s: float = 300.0,
    client: httpx.Client | None = None,
    max_attempts: int = MAX_ATTEMPTS,
    on_attempt: Callable[[ProbeAttempt], None] | None = None,
) -> ProbeResult:
    """Send the two legs until one passes, with a fresh ``X-Request-Id`` per attempt, within ``timeout_s``."""
    own = client is None
    http = client or httpx.Client(timeout=httpx.Timeout(max(5.0, timeout_s)))
    deadline = time.monotonic() + timeout_s
    attempts: list[ProbeAttempt] = []
    try:
        while len(attempts) < max_attempts:
            rid = f"pdctl-warmup-{uuid.uuid4().hex[:12]}"
            attempt = _one(http, prefill_url, decode_url, model, kind, rid)
            attempts.append(attempt)
            if on_attempt is not None:
                on_attempt(attempt)
            if attempt.error is None:
                return ProbeResult(prefill_url, decode_url, True, tuple(attempts))
            if not attempt.retryable or time.monotonic() + 1.0 > deadline:
                break
            time.sleep(1.0)
    finally:
        if own:
            http.close()
    return ProbeResult(prefill_url, decode_url, False, tuple(attempts))


def run_warmup(
    dep: Deployment,
    *,
    on_attempt: Callable[[str, ProbeAttempt], None] | None = None,
    only: str | None = None,
    raise_on_failure: bool = True,
) -> list[ProbeResult]:
    """Probe every prefill→decode pair of ``dep`` (only those involving the worker ``only`` if given).

    Raises :class:`LaunchError` naming the first pair that fails, unless ``raise_on_failure`` is False.
    """
    results: list[ProbeResult] = []
    timeout = dep.supervisor.warmup_timeout_s
    for p in dep.prefill:
        for d in dep.decode:
            if only is not None and only not in (p.name, d.name):
                continue
            kind = connector_kind(dep.connector_for(p))
            label = f"{p.name}->{d.name}"
            # S6: a decode that serves another model (or tokenizes differently) must never become ready.
            with httpx.Client(timeout=30.0) as client:
                probe_text = "pdctl identity probe: 用一句话解释 KV Cache"
                problems = identity_problems(
                    p.name, fetch_identity(client, p.url, p.model_name, probe_text),
                    d.name, fetch_identity(client, d.url, d.model_name, probe_text), require_tokenize=False,
                )  # fmt: skip
            if problems and raise_on_failure:
                raise LaunchError(
                    f"{p.name} and {d.name} do not serve the same model: " + "; ".join(problems),
                    hint="give both the identical model, served_model_name and max_model_len (recipe §5.4); "
                    "vLLM must be the same version on both",
                )
            report: Callable[[ProbeAttempt], None] | None = None
            if on_attempt is not None:
                report = functools.partial(on_attempt, label)
            res = probe_pair(
                p.url,
                d.url,
                d.model_name,
                kind,
                timeout_s=timeout,
                on_attempt=report,
            )
            results.append(res)
            if not res.ok and raise_on_failure:
                raise LaunchError(
                    f"warm-up probe {label} failed after {len(res.attempts)} attempt(s): {res.error}",
                    hint="the KV link between the workers does not work: check both use the same kv_connector "
                    "and model, the side-channel ports are free, and `pdctl logs --kv`; "
                    "set supervisor.warmup = false to skip the probe",
                )
    return results
