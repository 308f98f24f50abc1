"""The warm-up probe: one short two-leg request straight to a prefill and a decode worker.

vLLM's NIXL handshake is lazy: the first P→D request performs it, and on a loaded machine that first
attempt can fail with HTTP 500 (``handshake_setup_failed``). ``up`` runs this probe for every
prefill→decode pair before the gateway opens, retrying with a fresh request id, so the link is proven
and the first user request does not pay for the handshake. ``verify`` can reuse :func:`probe_pair`.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from pdctl.config import Deployment
from pdctl.errors import LaunchError
from pdctl.identity import fetch_identity, identity_problems
from pdctl.protocol import ConnectorKind, build_decode_body, build_prefill_body, check_kv_params, connector_kind

__all__ = ["ProbeAttempt", "ProbeResult", "probe_pair", "run_warmup"]

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


def _one(
    client: httpx.Client, prefill_url: str, decode_url: str, model: str, kind: ConnectorKind, rid: str
) -> ProbeAttempt:
    body = {"model": model, "prompt": f"pdctl warm-up probe {rid}", "max_tokens": 2, "temperature": 0}
    headers = {"X-Request-Id": rid}
    try:
        r1 = client.post(f"{prefill_url}/v1/completions", json=build_prefill_body(body, kind), headers=headers)
    except httpx.HTTPError as exc:
        return ProbeAttempt(rid, f"prefill {prefill_url}: {type(exc).__name__}: {exc}")
    if r1.status_code != 200:
        return ProbeAttempt(rid, f"prefill {prefill_url} answered HTTP {r1.status_code}: {r1.text[:200]}")
    try:
        reply = r1.json()
    except ValueError:
        return ProbeAttempt(rid, f"prefill {prefill_url} answered non-JSON: {r1.text[:200]}")
    params = None
    if kind != "shared_storage":
        chk = check_kv_params(reply)
        if not chk.usable:
            detail = f"missing fields {', '.join(chk.missing)}" if chk.missing else chk.reason
            # Retrying cannot help: the prefill worker runs without a KV connector (or the wrong one).
            return ProbeAttempt(
                rid, f"prefill {prefill_url} returned no usable kv_transfer_params ({detail})", retryable=False
            )
        params = chk.params
    try:
        r2 = client.post(f"{decode_url}/v1/completions", json=build_decode_body(body, params), headers=headers)
    except httpx.HTTPError as exc:
        return ProbeAttempt(rid, f"decode {decode_url}: {type(exc).__name__}: {exc}")
    if r2.status_code != 200:
        return ProbeAttempt(rid, f"decode {decode_url} answered HTTP {r2.status_code}: {r2.text[:200]}")
    return ProbeAttempt(rid, None)


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
