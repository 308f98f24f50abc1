"""The checks through the gateway: reachability, the recipe's chat and stream, the key, the PD path.

Each is a plain function of a :class:`Target` (what to call, with which key) returning its
:class:`~pdctl.verify.report.CheckResult`; those whose output a later check reads return it beside the result.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl.config import Deployment, RoutingConfig, WorkerConfig, recipe
from pdctl.verify import diagnoses as dg
from pdctl.verify.report import CheckResult, Timer
from pdctl.verify.wire import Http, Reply, StreamResult, error_message, read_stream, short

__all__ = [
    "CHAT_MAX_TOKENS",
    "CHAT_PROMPT",
    "STREAM_MAX_TOKENS",
    "STREAM_PROMPT",
    "Target",
    "check_auth",
    "check_chat",
    "check_compare_colocated",
    "check_gateway",
    "check_gateway_path",
    "check_stream",
    "check_workers",
]

CHAT_PROMPT, CHAT_MAX_TOKENS = recipe.CHAT.prompt, recipe.CHAT.max_tokens
STREAM_PROMPT, STREAM_MAX_TOKENS = recipe.STREAM.prompt, recipe.STREAM.max_tokens


@dataclass(frozen=True, slots=True)
class Target:
    """The deployment under test: its config, the HTTP client, the gateway URL and key, the logs folder."""

    dep: Deployment
    http: Http
    gateway_url: str
    api_key: str | None
    logs_dir: Path | None

    @property
    def model(self) -> str:
        """The model name clients send (decode's served name)."""
        return self.dep.decode[0].model_name

    def auth(self, key: str | None) -> dict[str, str]:
        """The Authorization header for ``key`` (none for None)."""
        return {"Authorization": f"Bearer {key}"} if key is not None else {}

    def failure(self, reply: Reply, worker_up: Mapping[str, bool]) -> tuple[str, str]:
        """Cause and next step of a failed gateway request."""
        return dg.gateway_failure(reply, self.dep, self.gateway_url, worker_up, self.logs_dir)


def check_gateway(t: Target) -> tuple[CheckResult, bool]:
    """``gateway``: /health answers 200; also returns whether the gateway answered at all."""
    timer = Timer()
    r = t.http.call("GET", f"{t.gateway_url}/health", timeout_s=min(t.http.timeout_s, 10.0))
    if r.ok:
        return CheckResult("gateway", True, f"{t.gateway_url}/health answered {r.status}", timer.ms), True
    if r.error is None:
        return CheckResult(
            "gateway",
            False,
            f"{t.gateway_url}/health answered {r.status}",
            timer.ms,
            "the gateway is up but not ready: an upstream worker is not ready",
            "`pdctl status` and `pdctl logs gateway` say which instance is not ready",
        ), True
    cause, step = t.failure(r, {})
    return CheckResult("gateway", False, f"{t.gateway_url}: {r.error}", timer.ms, cause, step), False


def check_workers(t: Target) -> tuple[CheckResult, dict[str, bool]]:
    """``workers``: every instance answers /health; also returns which did."""
    timer = Timer()
    up: dict[str, bool] = {}
    down: list[WorkerConfig] = []
    parts = []
    for w in t.dep.workers:
        r = t.http.call("GET", f"{w.url}/health", timeout_s=min(t.http.timeout_s, 10.0))
        up[w.name] = r.ok
        parts.append(f"{w.name} {'ok' if r.ok else (r.error or r.status)}")
        if not r.ok:
            down.append(w)
    if down:
        cause, step = dg.dead_worker_cause(down[0], t.logs_dir)
        return CheckResult("workers", False, ", ".join(parts), timer.ms, cause, step), up
    return CheckResult("workers", True, ", ".join(parts), timer.ms), up


def _skipped(name: str, timer: Timer) -> CheckResult:
    return CheckResult(name, None, "skipped: the gateway is not reachable", timer.ms)


def check_chat(t: Target, worker_up: Mapping[str, bool]) -> tuple[CheckResult, Mapping[str, str] | None]:
    """``chat``: the recipe's non-stream chat with the key; also returns the answer's headers."""
    timer = Timer()
    body = {"model": t.model, "messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": CHAT_MAX_TOKENS}
    r = t.http.call("POST", f"{t.gateway_url}/v1/chat/completions", body=body, headers=t.auth(t.api_key))
    headers = r.headers if r.ok else None
    if t.api_key is None and not r.ok:
        cause, step = dg.missing_key(t.dep.gateway.api_key_env)
        return CheckResult("chat", False, f"sent without a key: {error_message(r)}", timer.ms, cause, step), headers
    if not r.ok:
        cause, step = t.failure(r, worker_up)
        return CheckResult("chat", False, error_message(r), timer.ms, cause, step), headers
    content = None
    b = r.body
    if isinstance(b, Mapping) and isinstance(b.get("choices"), list) and b["choices"]:
        msg = b["choices"][0].get("message") if isinstance(b["choices"][0], Mapping) else None
        if isinstance(msg, Mapping) and isinstance(msg.get("content"), str):
            content = msg["content"]
    if not content:
        return CheckResult(
            "chat",
            False,
            f"HTTP {r.status} but choices[0].message.content is empty or missing: {r.text[:120]}",
            timer.ms,
            "the answer is not valid OpenAI chat JSON with content",
            "`pdctl logs decode` for the decode leg; check the gateway returns decode's body unchanged",
        ), headers
    usage = b.get("usage") if isinstance(b, Mapping) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, Mapping) else None
    path = r.headers.get("x-pd-path", "?")
    detail = f"{short(content)!r} ({tokens} tokens, path {path})"
    data = {"content": content, "completion_tokens": tokens}
    return CheckResult("chat", True, detail, timer.ms, data=data), headers


def stream_recipe(t: Target, url: str, headers: Mapping[str, str], *, salt: bool) -> StreamResult:
    """The recipe's stream request to ``url`` (``salt``: a fresh cache_salt, so no prefix cache helps)."""
    body: dict[str, Any] = {
        "model": t.model,
        "messages": [{"role": "user", "content": STREAM_PROMPT}],
        "max_tokens": STREAM_MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if salt:
        body["cache_salt"] = uuid.uuid4().hex
    return read_stream(t.http, url, body, headers)


def check_stream(t: Target, worker_up: Mapping[str, bool]) -> tuple[CheckResult, StreamResult | None]:
    """``stream``: SSE chunks and [DONE]; TTFT and TPOT reported against the SLOs (never a failure)."""
    timer = Timer()
    res = stream_recipe(t, f"{t.gateway_url}/v1/chat/completions", t.auth(t.api_key), salt=False)
    if res.error is not None:
        if t.api_key is None and res.status in (0, 401, 403):
            cause, step = dg.missing_key(t.dep.gateway.api_key_env)
        elif res.status == 200:
            cause = "the stream is not OpenAI SSE (text/event-stream, data: chunks, data: [DONE])"
            step = (
                "check the gateway forwards decode's stream unchanged with Content-Type text/event-stream "
                "(vLLM's toy proxy sends application/json); `pdctl logs gateway`"
            )
        elif res.status == 0:
            cause, step = t.failure(Reply(0, None, {}, "", res.error), worker_up)
        else:
            cause, step = t.failure(Reply(res.status, None, {}, res.error, None), worker_up)
        return CheckResult("stream", False, res.error, timer.ms, cause, step), None
    slo = t.dep.slo
    notes = []
    if res.ttft_ms is not None and res.ttft_ms > slo.ttft_ms:
        notes.append(f"TTFT above the {slo.ttft_ms:g} ms SLO")
    if res.tpot_ms is not None and res.tpot_ms > slo.tpot_ms:
        notes.append(f"TPOT above the {slo.tpot_ms:g} ms SLO")
    tpot = f"{res.tpot_ms:.1f} ms" if res.tpot_ms is not None else "n/a"
    detail = (
        f"{res.chunks} chunks, {res.tokens} tokens, [DONE]; TTFT {res.ttft_ms:.0f} ms "
        f"(SLO {slo.ttft_ms:g}), TPOT {tpot} (SLO {slo.tpot_ms:g})"
    )
    if notes:
        detail += "; warning: " + ", ".join(notes) + " (reported, not a failure)"
    data = {
        "ttft_ms": res.ttft_ms,
        "tpot_ms": res.tpot_ms,
        "slo_ttft_ms": slo.ttft_ms,
        "slo_tpot_ms": slo.tpot_ms,
        "slo_met": not notes,
    }
    return CheckResult("stream", True, detail, timer.ms, data=data), res


def check_auth(t: Target) -> CheckResult:
    """``auth``: no key and a wrong key both get 401 in OpenAI's error shape."""
    timer = Timer()
    body = {"model": t.model, "messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": 1}
    wrong = "pdctl-verify-wrong-" + uuid.uuid4().hex
    bad: list[str] = []
    seen: list[str] = []
    for label, headers in (("no key", {}), ("wrong key", t.auth(wrong))):
        r = t.http.call("POST", f"{t.gateway_url}/v1/chat/completions", body=body, headers=headers)
        shape = isinstance(r.body, Mapping) and isinstance(r.body.get("error"), Mapping)
        shape = shape and isinstance(r.body["error"].get("message"), str)
        seen.append(f"{label} -> {r.status or r.error}")
        if r.status != 401:
            bad.append(f"{label} got {r.status or r.error}, expected 401")
        elif not shape:
            bad.append(f"{label} got 401 but not OpenAI's {{'error': {{'message', 'type'}}}} shape")
    if bad:
        return CheckResult(
            "auth",
            False,
            "; ".join(bad),
            timer.ms,
            "the gateway does not enforce the key (§5.2 in reverse: anyone can call it)",
            f"start the gateway with {t.dep.gateway.api_key_env} set; it must refuse requests without that key",
        )
    return CheckResult("auth", True, ", ".join(seen) + " (OpenAI error shape)", timer.ms)


def check_gateway_path(routing: RoutingConfig, headers_seen: list[tuple[str, Mapping[str, str]]]) -> CheckResult:
    """``gateway_pd_path``: the successful requests ran both legs (``x-pd-path: disagg`` under pd_disagg; ``local``
    too under ``pd_mode = "adaptive"``, where short requests go to decode alone; ``local`` or ``colocated`` too under
    ``"auto"``, whose requests may run whole on one engine). The KV proof calls the workers itself, P → D."""
    timer = Timer()
    name = "gateway_pd_path"
    if not headers_seen:
        return CheckResult(name, None, "skipped: no successful request through the gateway", timer.ms)
    paths = {label: h.get("x-pd-path") for label, h in headers_seen}
    if all(v is None for v in paths.values()):
        return CheckResult(name, None, "skipped: the gateway sends no x-pd-path header", timer.ms)
    want = "disagg" if routing.strategy == "pd_disagg" else "colocated"
    allowed = {want}
    if want == "disagg" and routing.pd_mode != "always":  # adaptive: decode alone; auto: or a whole request
        allowed |= {"local", "colocated"} if routing.pd_mode == "auto" else {"local"}
    wrong = {k: v for k, v in paths.items() if v not in allowed}
    shown = ", ".join(f"{k}: {v}" for k, v in paths.items())
    legs = [
        f"prefill {h.get('x-pd-prefill')} ({h.get('x-pd-prefill-ms', '?')} ms) -> decode {h.get('x-pd-decode')}"
        for _, h in headers_seen[:1]
        if h.get("x-pd-prefill")
    ]
    if wrong:
        return CheckResult(
            name,
            False,
            f"x-pd-path {shown} (expected {want})",
            timer.ms,
            "silent fallback at the gateway: it did not run the prefill leg (prefill unhealthy, no "
            "kv_transfer_params, or SLO overflow to upstream)",
            "`curl -s $GATEWAY/metrics | grep pdctl_pd_fallback_total` gives the reason; `pdctl logs gateway`",
        )
    return CheckResult(name, True, f"x-pd-path {shown}" + (f"; {legs[0]}" if legs else ""), timer.ms)


def check_compare_colocated(t: Target, stream_ttft_ms: float | None, decode_up: bool) -> CheckResult:
    """``compare_colocated`` (informational): the stream's TTFT through PD and on one decode worker alone."""
    timer = Timer()
    name = "compare_colocated"
    d = t.dep.decode[0]
    if stream_ttft_ms is None or not decode_up:
        return CheckResult(name, None, "skipped: needs a passing stream check and a live decode", timer.ms)
    res = stream_recipe(t, f"{d.url}/v1/chat/completions", {}, salt=True)
    if res.error is not None or res.ttft_ms is None:
        return CheckResult(name, None, f"skipped: the single-worker stream failed: {res.error}", timer.ms)
    ratio = stream_ttft_ms / res.ttft_ms if res.ttft_ms > 0 else float("inf")
    return CheckResult(
        name,
        True,
        f"TTFT through PD {stream_ttft_ms:.0f} ms vs one worker ({d.name}) {res.ttft_ms:.0f} ms "
        f"(x{ratio:.2f}); informational",
        timer.ms,
        data={"pd_ttft_ms": stream_ttft_ms, "colocated_ttft_ms": res.ttft_ms},
    )
