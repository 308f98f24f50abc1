"""``pdctl verify``: the recipe's test requests, plus proof that the KV really moved and arrived intact.

Checks, in order (each a :class:`CheckResult`; ``ok`` is ``None`` when skipped)::

    gateway                 the gateway answers /health
    workers                 every prefill/decode instance answers /health
    chat                    the recipe's non-stream chat through the gateway, with the key
    stream                  the recipe's stream: SSE chunks, [DONE], TTFT and TPOT against the SLOs
    auth                    no key / a wrong key -> 401 in OpenAI's error shape
    gateway_pd_path         the gateway ran both legs (x-pd-path: disagg)
    per prefill->decode pair, with unique short / typical / long probe prompts:
      identity[p->d]        same model id and root, max_model_len, vLLM version, connector, /tokenize
      kv_params[p->d]       leg 1 returned usable kv_transfer_params (connectors that return them)
      kv_metrics[p->d]      decode's external_kv_transfer prompt tokens rose by about the prompt; NIXL moved
      kv_logs[p->d]         the logs show the load (in the recipe's vocabulary) and no KV failure
      kv_correctness[p->d]  greedy PD output == a colocated reference on decode (fresh cache_salt)
    compare_colocated       (optional) the stream's TTFT through PD and through one worker

Every failure carries a likely ``cause`` and a ``next_step`` taken from the recipe's troubleshooting
(§5.1 connector mismatch / decode waiting, §5.2 401/403 and the key variable, §5.3 out of memory,
§5.4 garbage output / model or tokenizer mismatch) and the silent fallback (no params, no external tokens).
A missed SLO is reported in the detail, never a failure: the SLOs are targets for tuned GPUs, and verify
runs on any machine. The core never prints; ``pdctl/cli/verify_cmd.py`` renders the report.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdctl import kvevents
from pdctl.config import Deployment, WorkerConfig
from pdctl.identity import fetch_identity, identity_problems
from pdctl.protocol import (
    ConnectorKind,
    build_decode_body,
    build_prefill_body,
    check_kv_params,
    connector_kind,
)

__all__ = [
    "CHAT_PROMPT",
    "STREAM_PROMPT",
    "CheckResult",
    "Probe",
    "VerifyReport",
    "metric_total",
    "run_verify",
]

CHAT_PROMPT = "用一句话解释 KV Cache"
STREAM_PROMPT = "写一段 200 字的自我介绍"
CHAT_MAX_TOKENS = 32
STREAM_MAX_TOKENS = 256
PROBE_MAX_TOKENS = 8
EXTERNAL = "external_kv_transfer"

_OOM = re.compile(
    r"out of memory|OutOfMemoryError|Cannot allocate memory|std::bad_alloc|\bMemoryError\b|oom-kill"
    r"|(?-i:^Killed\b)",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One named check: ``ok`` True (passed), False (failed) or None (skipped), with a likely cause."""

    name: str
    ok: bool | None
    detail: str
    duration_ms: float = 0.0
    cause: str | None = None
    next_step: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` shape of one check."""
        out: dict[str, Any] = {
            "name": self.name,
            "ok": self.ok,
            "detail": self.detail,
            "duration_ms": round(self.duration_ms, 1),
        }
        if self.cause:
            out["cause"] = self.cause
        if self.next_step:
            out["next_step"] = self.next_step
        if self.data:
            out["data"] = dict(self.data)
        return out


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """All checks; ``ok`` when none failed; ``reachable`` False when nothing of the deployment answered."""

    checks: tuple[CheckResult, ...]
    reachable: bool = True

    @property
    def ok(self) -> bool:
        """No check failed (skipped checks do not count) and the deployment was reachable."""
        return self.reachable and all(c.ok is not False for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0 all passed, 1 a check failed, 2 the deployment could not be reached."""
        if not self.reachable:
            return 2
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, Any]:
        """``{"ok": bool, "checks": [{"name", "ok", "detail", "duration_ms", ...}]}``."""
        return {"ok": self.ok, "checks": [c.to_json() for c in self.checks]}


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe prompt sent through a prefill->decode pair, and what came back."""

    kind: str
    request_id: str
    prompt: str
    prompt_tokens: int
    params_reason: str = "not_sent"
    params_usable: bool = False
    prefill_status: int = 0
    decode_status: int = 0
    external_delta: float | None = None
    nixl_delta: float | None = None
    pd_tokens: tuple[int, ...] | None = None
    pd_text: str | None = None
    ref_tokens: tuple[int, ...] | None = None
    ref_text: str | None = None
    error: str | None = None


# ------------------------------------------------------------------------------------------ diagnoses

_D_KEY = "§5.2: the gateway rejected the key"
_D_SILENT_PARAMS = (
    "silent fallback: prefill answered without usable kv_transfer_params, so decode recomputes the whole "
    "prompt (no KV moved; answers stay correct but PD brings nothing)"
)
_D_SILENT_TOKENS = (
    "silent fallback: decode's external_kv_transfer prompt tokens did not rise, so decode computed the prompt "
    "itself instead of loading prefill's KV"
)
_D_GARBAGE = (
    "§5.4: different model weights or tokenizer on the two sides (garbage output after a 'successful' transfer)"
)
_D_CORRUPT = "the KV arrived altered: identity matches, so the bytes were corrupted in transit or in the buffer"


def _connector_mismatch(p: str, d: str) -> str:
    return (
        f"§5.1 connector mismatch: prefill uses {p}, decode uses {d}; decode cannot read prefill's KV and waits "
        "in wait_for_layer_load until the timeout, or recomputes"
    )


_NEXT_CONNECTOR = (
    "give both workers the identical kv_connector ([connector] kv_connector, no per-worker override), "
    "then `pdctl down && pdctl up`; `pdctl check` reports the mismatch"
)
_NEXT_PARAMS = (
    "check the prefill worker was started with a --kv-transfer-config (kv_role kv_producer) and that the "
    "gateway forwards kv_transfer_params; `pdctl plan` shows the flags, `pdctl logs --kv` the events"
)
_NEXT_TOKENS = (
    "compare both --kv-transfer-config (`pdctl plan`), look for 'Got invalid KVTransferParams' or NIXL "
    "failures in `pdctl logs --kv`, and check the NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT) is "
    "reachable from decode"
)
_NEXT_GARBAGE = (
    "give prefill and decode the identical --model string and the same vLLM version (not a local path on one "
    "side and a hub name on the other), then restart both"
)
_NEXT_CORRUPT = (
    "look for NIXL transfer failures in `pdctl logs --kv`; check kv_buffer_device and the transport (UCX) on "
    "both sides; with kv_load_failure_policy=recompute decode hides broken transfers"
)


# ------------------------------------------------------------------------------------------- HTTP


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    body: Any
    headers: Mapping[str, str]
    text: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300


def _describe_error(exc: Exception) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


class _Http:
    def __init__(self, client: httpx.Client, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s

    def call(
        self,
        method: str,
        url: str,
        *,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> _Reply:
        try:
            r = self.client.request(
                method, url, json=body, headers=dict(headers or {}), timeout=timeout_s or self.timeout_s
            )
        except httpx.HTTPError as exc:
            return _Reply(0, None, {}, "", _describe_error(exc))
        try:
            parsed: Any = r.json()
        except ValueError:
            parsed = None
        return _Reply(r.status_code, parsed, dict(r.headers), r.text)


# ---------------------------------------------------------------------------------------- metrics


def metric_total(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """Sum of the samples called ``name`` (whose labels include ``labels``); ``None`` if there is none."""
    total: float | None = None
    want = dict(labels or {})
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
                    total = (total or 0.0) + float(s.value)
    except ValueError:
        return None
    return total


def _block_size(text: str) -> int | None:
    m = re.search(r'vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', text)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------- helpers


class _Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000.0


def _oom_sign(logs_dir: Path | None, name: str) -> str | None:
    if logs_dir is None:
        return None
    path = logs_dir / f"{name}.log"
    try:
        tail = path.read_text(encoding="utf-8", errors="replace").splitlines()[-200:]
    except OSError:
        return None
    for line in reversed(tail):
        if _OOM.search(line):
            return line.strip()[:200]
    return None


def _error_message(reply: _Reply) -> str:
    if reply.error:
        return reply.error
    body = reply.body
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            return f"HTTP {reply.status}: {err['message']}"
        if isinstance(err, str):
            return f"HTTP {reply.status}: {err}"
        if body.get("message"):
            return f"HTTP {reply.status}: {body['message']}"
    return f"HTTP {reply.status}: {reply.text[:160]}"


def _short(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _choice_tokens(body: Any) -> tuple[tuple[int, ...] | None, str | None]:
    if not isinstance(body, Mapping):
        return None, None
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None, None
    c = choices[0]
    ids = c.get("token_ids")
    tokens = tuple(int(t) for t in ids) if isinstance(ids, list) and ids else None
    text = c.get("text")
    return tokens, text if isinstance(text, str) else None


# ------------------------------------------------------------------------------------------ runner


class _Verifier:
    def __init__(
        self,
        dep: Deployment,
        http: _Http,
        gateway_url: str,
        api_key: str | None,
        logs_dir: Path | None,
        compare_colocated: bool,
        probe_kinds: Sequence[str],
    ) -> None:
        self.dep = dep
        self.http = http
        self.gateway_url = gateway_url.rstrip("/")
        self.api_key = api_key
        self.logs_dir = logs_dir
        self.compare_colocated = compare_colocated
        self.probe_kinds = tuple(probe_kinds)
        self.nonce = uuid.uuid4().hex[:8]
        self.results: list[CheckResult] = []
        self.worker_up: dict[str, bool] = {}
        self.gateway_up = False
        self.headers_seen: list[tuple[str, Mapping[str, str]]] = []
        self.stream_ttft_ms: float | None = None
        self.log_offsets = self._log_offsets()

    # -- plumbing

    def add(
        self,
        name: str,
        ok: bool | None,
        detail: str,
        timer: _Timer,
        cause: str | None = None,
        next_step: str | None = None,
        **data: Any,
    ) -> CheckResult:
        res = CheckResult(name, ok, detail, timer.ms, cause, next_step, data)
        self.results.append(res)
        return res

    def _log_offsets(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.logs_dir is None:
            return out
        for w in self.dep.workers:
            try:
                out[w.name] = (self.logs_dir / f"{w.name}.log").stat().st_size
            except OSError:
                continue
        return out

    def new_log_lines(self, name: str) -> list[str] | None:
        if self.logs_dir is None or name not in self.log_offsets:
            return None
        try:
            with (self.logs_dir / f"{name}.log").open("rb") as fh:
                fh.seek(self.log_offsets[name])
                data = fh.read()
        except OSError:
            return None
        return data.decode("utf-8", errors="replace").split("\n")

    def auth_headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key is not None else {}

    @property
    def model(self) -> str:
        return self.dep.decode[0].model_name

    @property
    def key_env(self) -> str:
        return self.dep.gateway.api_key_env

    def dead_worker_cause(self, w: WorkerConfig) -> tuple[str, str]:
        oom = _oom_sign(self.logs_dir, w.name)
        if oom:
            return (
                f"§5.3 out of memory in {w.name}'s log: {oom}",
                "enable enable_chunked_prefill or lower max_num_batched_tokens (4096); keep decode's "
                "gpu_memory_utilization <= 0.95; then `pdctl up` again",
            )
        return (
            f"{w.role} instance {w.name} at {w.url} is not answering (process down, still loading, or a wrong "
            "endpoint in settings.json)",
            f"`pdctl status` and `pdctl logs {w.name}`; restart with `pdctl up`",
        )

    def missing_key(self) -> tuple[str, str]:
        return (
            f"§5.2: ${self.key_env} is not set in verify's environment, so requests carry no key",
            f"export {self.key_env}=<the gateway's key> in this shell, then run verify again",
        )

    def gateway_failure(self, reply: _Reply) -> tuple[str, str]:
        if reply.status in (401, 403):
            return (
                f"{_D_KEY}: verify sent ${self.key_env} but the gateway has a different key, or it reads another "
                "variable",
                f"`env | grep {self.key_env}` in both shells: the gateway must be started with {self.key_env} "
                "set to the same value; api_key_env holds the variable's name, never the key",
            )
        if reply.error:
            return (
                f"the gateway at {self.gateway_url} is not answering ({reply.error})",
                "start it (`pdctl up`, or `pdctl gateway -c config.toml -s settings.json`) or pass --gateway URL",
            )
        for w in self.dep.workers:
            if self.worker_up.get(w.name) is False:
                return self.dead_worker_cause(w)
        for w in self.dep.workers:
            oom = _oom_sign(self.logs_dir, w.name)
            if oom:
                return self.dead_worker_cause(w)
        return (
            f"the gateway answered {_error_message(reply)}",
            "`pdctl logs gateway` and `pdctl logs --kv` for the failing leg",
        )

    # -- reachability

    def check_reachability(self) -> None:
        t = _Timer()
        r = self.http.call("GET", f"{self.gateway_url}/health", timeout_s=min(self.http.timeout_s, 10.0))
        self.gateway_up = r.error is None
        if r.ok:
            self.add("gateway", True, f"{self.gateway_url}/health answered {r.status}", t)
        elif r.error is None:
            self.add(
                "gateway",
                False,
                f"{self.gateway_url}/health answered {r.status}",
                t,
                "the gateway is up but not ready: an upstream worker is not ready",
                "`pdctl status` and `pdctl logs gateway` say which instance is not ready",
            )
        else:
            cause, step = self.gateway_failure(r)
            self.add("gateway", False, f"{self.gateway_url}: {r.error}", t, cause, step)

        t = _Timer()
        down: list[WorkerConfig] = []
        parts = []
        for w in self.dep.workers:
            r = self.http.call("GET", f"{w.url}/health", timeout_s=min(self.http.timeout_s, 10.0))
            self.worker_up[w.name] = r.ok
            parts.append(f"{w.name} {'ok' if r.ok else (r.error or r.status)}")
            if not r.ok:
                down.append(w)
        if down:
            cause, step = self.dead_worker_cause(down[0])
            self.add("workers", False, ", ".join(str(p) for p in parts), t, cause, step)
        else:
            self.add("workers", True, ", ".join(parts), t)

    @property
    def reachable(self) -> bool:
        return self.gateway_up or any(self.worker_up.values())

    # -- the recipe's requests

    def check_chat(self) -> None:
        t = _Timer()
        if not self.gateway_up:
            self.add("chat", None, "skipped: the gateway is not reachable", t)
            return
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": CHAT_PROMPT}],
            "max_tokens": CHAT_MAX_TOKENS,
        }
        r = self.http.call(
            "POST", f"{self.gateway_url}/v1/chat/completions", body=body, headers=self.auth_headers(self.api_key)
        )
        if r.ok:
            self.headers_seen.append(("chat", r.headers))
        if self.api_key is None and not r.ok:
            self.add("chat", False, f"sent without a key: {_error_message(r)}", t, *self.missing_key())
            return
        if not r.ok:
            cause, step = self.gateway_failure(r)
            self.add("chat", False, _error_message(r), t, cause, step)
            return
        content = None
        b = r.body
        if isinstance(b, Mapping) and isinstance(b.get("choices"), list) and b["choices"]:
            msg = b["choices"][0].get("message") if isinstance(b["choices"][0], Mapping) else None
            if isinstance(msg, Mapping) and isinstance(msg.get("content"), str):
                content = msg["content"]
        if not content:
            self.add(
                "chat",
                False,
                f"HTTP {r.status} but choices[0].message.content is empty or missing: {r.text[:120]}",
                t,
                "the answer is not valid OpenAI chat JSON with content",
                "`pdctl logs decode` for the decode leg; check the gateway returns decode's body unchanged",
            )
            return
        usage = b.get("usage") if isinstance(b, Mapping) else None
        tokens = usage.get("completion_tokens") if isinstance(usage, Mapping) else None
        path = r.headers.get("x-pd-path", "?")
        self.add(
            "chat",
            True,
            f"{_short(content)!r} ({tokens} tokens, path {path})",
            t,
            content=content,
            completion_tokens=tokens,
        )

    def check_stream(self) -> None:
        t = _Timer()
        if not self.gateway_up:
            self.add("stream", None, "skipped: the gateway is not reachable", t)
            return
        res = self._stream(f"{self.gateway_url}/v1/chat/completions", self.auth_headers(self.api_key), salt=False)
        if res.error is not None:
            if self.api_key is None and res.status in (0, 401, 403):
                cause, step = self.missing_key()
            elif res.status == 200:
                cause = "the stream is not OpenAI SSE (text/event-stream, data: chunks, data: [DONE])"
                step = (
                    "check the gateway forwards decode's stream unchanged with Content-Type text/event-stream "
                    "(vLLM's toy proxy sends application/json); `pdctl logs gateway`"
                )
            elif res.status == 0:
                cause, step = self.gateway_failure(_Reply(0, None, {}, "", res.error))
            else:
                cause, step = self.gateway_failure(_Reply(res.status, None, {}, res.error, None))
            self.add("stream", False, res.error, t, cause, step)
            return
        self.headers_seen.append(("stream", res.headers))
        self.stream_ttft_ms = res.ttft_ms
        slo = self.dep.slo
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
        self.add(
            "stream",
            True,
            detail,
            t,
            ttft_ms=res.ttft_ms,
            tpot_ms=res.tpot_ms,
            slo_ttft_ms=slo.ttft_ms,
            slo_tpot_ms=slo.tpot_ms,
            slo_met=not notes,
        )

    def _stream(self, url: str, headers: Mapping[str, str], salt: bool) -> _StreamResult:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": STREAM_PROMPT}],
            "max_tokens": STREAM_MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if salt:
            body["cache_salt"] = uuid.uuid4().hex
        return _read_stream(self.http, url, body, headers)

    def check_auth(self) -> None:
        t = _Timer()
        if not self.gateway_up:
            self.add("auth", None, "skipped: the gateway is not reachable", t)
            return
        body = {"model": self.model, "messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": 1}
        wrong = "pdctl-verify-wrong-" + uuid.uuid4().hex
        bad: list[str] = []
        seen: list[str] = []
        for label, headers in (("no key", {}), ("wrong key", self.auth_headers(wrong))):
            r = self.http.call("POST", f"{self.gateway_url}/v1/chat/completions", body=body, headers=headers)
            shape = isinstance(r.body, Mapping) and isinstance(r.body.get("error"), Mapping)
            shape = shape and isinstance(r.body["error"].get("message"), str)
            seen.append(f"{label} -> {r.status or r.error}")
            if r.status != 401:
                bad.append(f"{label} got {r.status or r.error}, expected 401")
            elif not shape:
                bad.append(f"{label} got 401 but not OpenAI's {{'error': {{'message', 'type'}}}} shape")
        if bad:
            self.add(
                "auth",
                False,
                "; ".join(bad),
                t,
                "the gateway does not enforce the key (§5.2 in reverse: anyone can call it)",
                f"start the gateway with {self.key_env} set; it must refuse requests without that key",
            )
        else:
            self.add("auth", True, ", ".join(seen) + " (OpenAI error shape)", t)

    def check_gateway_path(self) -> None:
        t = _Timer()
        if not self.headers_seen:
            self.add("gateway_pd_path", None, "skipped: no successful request through the gateway", t)
            return
        paths = {label: h.get("x-pd-path") for label, h in self.headers_seen}
        if all(v is None for v in paths.values()):
            self.add("gateway_pd_path", None, "skipped: the gateway sends no x-pd-path header", t)
            return
        want = "disagg" if self.dep.routing.strategy == "pd_disagg" else "colocated"
        wrong = {k: v for k, v in paths.items() if v != want}
        shown = ", ".join(f"{k}: {v}" for k, v in paths.items())
        legs = [
            f"prefill {h.get('x-pd-prefill')} ({h.get('x-pd-prefill-ms', '?')} ms) -> decode {h.get('x-pd-decode')}"
            for _, h in self.headers_seen[:1]
            if h.get("x-pd-prefill")
        ]
        if wrong:
            self.add(
                "gateway_pd_path",
                False,
                f"x-pd-path {shown} (expected {want})",
                t,
                "silent fallback at the gateway: it did not run the prefill leg (prefill unhealthy, no "
                "kv_transfer_params, or SLO overflow to upstream)",
                "`curl -s $GATEWAY/metrics | grep pdctl_pd_fallback_total` gives the reason; `pdctl logs gateway`",
            )
        else:
            self.add("gateway_pd_path", True, f"x-pd-path {shown}" + (f"; {legs[0]}" if legs else ""), t)

    def check_compare_colocated(self) -> None:
        t = _Timer()
        d = self.dep.decode[0]
        if self.stream_ttft_ms is None or not self.worker_up.get(d.name):
            self.add("compare_colocated", None, "skipped: needs a passing stream check and a live decode", t)
            return
        res = self._stream(f"{d.url}/v1/chat/completions", {}, salt=True)
        if res.error is not None or res.ttft_ms is None:
            self.add("compare_colocated", None, f"skipped: the single-worker stream failed: {res.error}", t)
            return
        ratio = self.stream_ttft_ms / res.ttft_ms if res.ttft_ms > 0 else float("inf")
        self.add(
            "compare_colocated",
            True,
            f"TTFT through PD {self.stream_ttft_ms:.0f} ms vs one worker ({d.name}) {res.ttft_ms:.0f} ms "
            f"(x{ratio:.2f}); informational",
            t,
            pd_ttft_ms=self.stream_ttft_ms,
            colocated_ttft_ms=res.ttft_ms,
        )

    # -- the KV link, per pair

    def check_pair(self, p: WorkerConfig, d: WorkerConfig) -> None:
        pair = f"[{p.name}->{d.name}]"
        names = ("identity", "kv_params", "kv_metrics", "kv_logs", "kv_correctness")
        if not (self.worker_up.get(p.name) and self.worker_up.get(d.name)):
            dead = p if not self.worker_up.get(p.name) else d
            t = _Timer()
            for n in names:
                self.add(f"{n}{pair}", None, f"skipped: {dead.name} is not answering", t)
            return
        # What the logs say each side created wins over the config (a hand-started worker may differ).
        pc = self._connector_from_logs(p) or self.dep.connector_for(p)
        dc = self._connector_from_logs(d) or self.dep.connector_for(d)
        kind = connector_kind(pc)

        t = _Timer()
        ident_ok, ident_detail, ident_cause, ident_step = self._identity(p, d, pc, dc)
        self.results.append(CheckResult(f"identity{pair}", ident_ok, ident_detail, t.ms, ident_cause, ident_step))

        t = _Timer()
        probes, block = self._run_probes(p, d, kind)
        probe_ms = t.ms
        self._judge_params(pair, probes, kind, pc, dc, probe_ms)
        self._judge_metrics(pair, probes, kind, pc, dc, block, ident_ok)
        self._judge_logs(pair, p, d, probes)
        self._judge_correctness(pair, probes, ident_ok)

    def _identity(
        self, p: WorkerConfig, d: WorkerConfig, pc: str, dc: str
    ) -> tuple[bool | None, str, str | None, str | None]:
        probe_text = f"pdctl verify {self.nonce}: {CHAT_PROMPT}"
        ip, idd = (
            fetch_identity(self.http.client, w.url, w.model_name, probe_text, self.http.timeout_s) for w in (p, d)
        )
        problems = identity_problems(p.name, ip, d.name, idd)
        seen_p, seen_d = pc, dc
        mismatch = connector_kind(seen_p) != connector_kind(seen_d) or (
            connector_kind(seen_p) == "unknown" and _norm_conn(seen_p) != _norm_conn(seen_d)
        )
        summary = (
            f"model {idd.model_id!r} (root {idd.root!r}), max_model_len {idd.max_model_len}, vLLM {idd.version}, "
            f"connector {seen_p}/{seen_d}"
        )
        if mismatch:
            return (
                False,
                f"connector: {p.name} {seen_p}, {d.name} {seen_d}" + ("; " + "; ".join(problems) if problems else ""),
                _connector_mismatch(seen_p, seen_d),
                _NEXT_CONNECTOR,
            )
        if problems:
            return False, "; ".join(problems), _D_GARBAGE, _NEXT_GARBAGE
        return True, summary + ", /tokenize identical", None, None

    def _connector_from_logs(self, w: WorkerConfig) -> str | None:
        if self.logs_dir is None:
            return None
        try:
            lines = (self.logs_dir / f"{w.name}.log").read_text(encoding="utf-8", errors="replace").split("\n")
        except OSError:
            return None
        found = None
        for ev in kvevents.scan(lines, w.name):
            m = re.match(r"connector (\w+) created", ev.detail)
            if m:
                found = m.group(1)
        return found

    def _tokenize(self, w: WorkerConfig, text: str) -> list[int] | None:
        r = self.http.call("POST", f"{w.url}/tokenize", body={"model": w.model_name, "prompt": text})
        if r.ok and isinstance(r.body, Mapping) and isinstance(r.body.get("tokens"), list):
            return [int(x) for x in r.body["tokens"]]
        return None

    def _decode_metrics(self, d: WorkerConfig) -> tuple[float | None, float | None, int | None]:
        r = self.http.call("GET", f"{d.url}/metrics")
        if not r.ok:
            return None, None, None
        ext = metric_total(r.text, "vllm:prompt_tokens_by_source_total", {"source": EXTERNAL})
        nixl = metric_total(r.text, "vllm:nixl_xfer_time_seconds_count")
        return ext, nixl, _block_size(r.text)

    def _probe_prompt(self, d: WorkerConfig, kind: str, target: int) -> tuple[str, int]:
        head = f"pdctl verify {self.nonce} {kind}."
        if kind == "short":
            n = self._count(d, head)
            return head, n if n is not None else 0
        words = 8
        text, count = head, self._count(d, head) or 0
        for _ in range(6):
            text = head + " " + " ".join(f"w{i % 97}" for i in range(words))
            c = self._count(d, text)
            if c is None:
                return text, 0
            count = c
            if 0.85 * target <= c <= target:
                break
            words = max(1, int(words * target / max(c, 1) * 0.97))
        while count > target and words > 1:
            words = max(1, int(words * 0.9))
            text = head + " " + " ".join(f"w{i % 97}" for i in range(words))
            count = self._count(d, text) or 0
        return text, count

    def _count(self, w: WorkerConfig, text: str) -> int | None:
        toks = self._tokenize(w, text)
        return len(toks) if toks is not None else None

    def _max_model_len(self, d: WorkerConfig) -> int:
        r = self.http.call("GET", f"{d.url}/v1/models")
        if isinstance(r.body, Mapping) and isinstance(r.body.get("data"), list) and r.body["data"]:
            first = r.body["data"][0]
            if isinstance(first, Mapping) and isinstance(first.get("max_model_len"), int):
                return int(first["max_model_len"])
        return d.max_model_len or 2048

    def _run_probes(self, p: WorkerConfig, d: WorkerConfig, kind: ConnectorKind) -> tuple[list[Probe], int]:
        limit = self._max_model_len(d)
        ext0, nixl0, block = self._decode_metrics(d)
        block = block or d.block_size or 16
        targets = {"short": 1, "typical": min(256, max(limit // 4, 2)), "long": max(limit - PROBE_MAX_TOKENS - 8, 2)}
        out: list[Probe] = []
        for k in self.probe_kinds:
            prompt, n = self._probe_prompt(d, k, targets[k])
            rid = f"pdctl-verify-{self.nonce}-{p.index}-{d.index}-{k}"
            probe = self._probe(p, d, kind, k, rid, prompt, n)
            ext1, nixl1, _ = self._decode_metrics(d)
            if probe.error is None and ext1 is not None and ext0 is not None and ext1 - ext0 < probe.prompt_tokens:
                # Stats may trail the response by an engine step: look once more before judging.
                time.sleep(0.5)
                ext1, nixl1, _ = self._decode_metrics(d)
            ext_delta = ext1 - ext0 if ext1 is not None and ext0 is not None else None
            nixl_delta = nixl1 - nixl0 if nixl1 is not None and nixl0 is not None else None
            ext0, nixl0 = ext1, nixl1
            # Shared storage: decode would reload the stored KV for the reference too (the real
            # ExampleConnector does, cache_salt or not), so the reference is computed on prefill.
            ref_tokens, ref_text = self._reference(p if kind == "shared_storage" else d, prompt, rid)
            out.append(
                _replace(
                    probe,
                    external_delta=ext_delta,
                    nixl_delta=nixl_delta,
                    ref_tokens=ref_tokens,
                    ref_text=ref_text,
                )
            )
        return out, block

    def _probe(
        self, p: WorkerConfig, d: WorkerConfig, kind: ConnectorKind, k: str, rid: str, prompt: str, n: int
    ) -> Probe:
        body = {
            "model": d.model_name,
            "prompt": prompt,
            "max_tokens": PROBE_MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        headers = {"X-Request-Id": rid}
        # Each leg names the model its own worker serves, so a served-name mismatch cannot hide the link.
        leg1 = build_prefill_body({**body, "model": p.model_name}, kind)
        r1 = self.http.call("POST", f"{p.url}/v1/completions", body=leg1, headers=headers)
        probe = Probe(k, rid, prompt, n, prefill_status=r1.status)
        if not r1.ok:
            return _replace(probe, error=f"prefill leg: {_error_message(r1)}")
        check = check_kv_params(r1.body if isinstance(r1.body, Mapping) else {})
        params = check.params if check.usable else None
        if kind == "shared_storage":
            params = None
        r2 = self.http.call("POST", f"{d.url}/v1/completions", body=build_decode_body(body, params), headers=headers)
        tokens, text = _choice_tokens(r2.body)
        usage = r2.body.get("usage") if isinstance(r2.body, Mapping) else None
        if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int):
            # The server's own count beats /tokenize (which may be missing or count differently).
            probe = _replace(probe, prompt_tokens=int(usage["prompt_tokens"]))
        probe = _replace(
            probe,
            params_reason=check.reason,
            params_usable=check.usable,
            decode_status=r2.status,
            pd_tokens=tokens,
            pd_text=text,
        )
        if not r2.ok:
            return _replace(probe, error=f"decode leg: {_error_message(r2)}")
        return probe

    def _reference(self, d: WorkerConfig, prompt: str, rid: str) -> tuple[tuple[int, ...] | None, str | None]:
        body = {
            "model": d.model_name,
            "prompt": prompt,
            "max_tokens": PROBE_MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
            "cache_salt": uuid.uuid4().hex,
        }
        r = self.http.call("POST", f"{d.url}/v1/completions", body=body, headers={"X-Request-Id": rid + "-ref"})
        if not r.ok:
            return None, None
        return _choice_tokens(r.body)

    def _judge_params(
        self, pair: str, probes: list[Probe], kind: ConnectorKind, pc: str, dc: str, probe_ms: float
    ) -> None:
        name = f"kv_params{pair}"
        errors = [f"{pr.kind}: {pr.error}" for pr in probes if pr.error and pr.prefill_status != 200]
        if errors:
            self.results.append(
                CheckResult(
                    name,
                    False,
                    "; ".join(errors),
                    probe_ms,
                    "the prefill leg failed",
                    "`pdctl logs " + pair[1:].split("->")[0] + "`",
                )
            )
            return
        if kind == "shared_storage":
            self.results.append(
                CheckResult(name, None, f"skipped: {pc} returns no kv_transfer_params (shared storage)", probe_ms)
            )
            return
        bad = [f"{pr.kind}: {pr.params_reason}" for pr in probes if not pr.params_usable]
        if bad:
            cause = _connector_mismatch(pc, dc) if connector_kind(dc) != kind else _D_SILENT_PARAMS
            step = _NEXT_CONNECTOR if connector_kind(dc) != kind else _NEXT_PARAMS
            self.results.append(CheckResult(name, False, "unusable params: " + ", ".join(bad), probe_ms, cause, step))
            return
        self.results.append(CheckResult(name, True, f"usable kv_transfer_params for {len(probes)} probe(s)", probe_ms))

    def _judge_metrics(
        self,
        pair: str,
        probes: list[Probe],
        kind: ConnectorKind,
        pc: str,
        dc: str,
        block: int,
        identity_ok: bool | None,
    ) -> None:
        name = f"kv_metrics{pair}"
        t = _Timer()
        if any(pr.external_delta is None for pr in probes):
            self.results.append(
                CheckResult(name, None, "skipped: decode's /metrics has no prompt_tokens_by_source counter", t.ms)
            )
            return
        parts, bad = [], []
        for pr in probes:
            delta = pr.external_delta or 0.0
            expect_min = pr.prompt_tokens - block if kind == "shared_storage" else pr.prompt_tokens * 0.9 - 1
            nixl = ""
            if pr.nixl_delta is not None and kind == "params" and pc.startswith("Nixl"):
                nixl = f", NIXL transfers +{pr.nixl_delta:g}"
            parts.append(f"{pr.kind} {pr.prompt_tokens} tok: external +{delta:g}{nixl}")
            if pr.error:
                bad.append(f"{pr.kind}: {pr.error}")
            elif kind == "shared_storage" and pr.prompt_tokens <= block:
                # Shorter than one block + 1 token: ExampleConnector stores and loads nothing.
                parts[-1] += f" (under one {block}-token block: nothing to transfer)"
            elif delta <= 0 or delta < expect_min:
                bad.append(f"{pr.kind}: external tokens +{delta:g}, expected about {pr.prompt_tokens}")
            elif kind == "params" and pr.nixl_delta is not None and pr.nixl_delta <= 0 and pc.startswith("Nixl"):
                bad.append(f"{pr.kind}: NIXL transfer counter did not move")
        if kind == "shared_storage" and all(pr.prompt_tokens <= block for pr in probes):
            self.results.append(
                CheckResult(name, None, "skipped: every probe is under one block: " + "; ".join(parts), t.ms)
            )
            return
        if bad:
            if connector_kind(dc) != connector_kind(pc):
                cause, step = _connector_mismatch(pc, dc), _NEXT_CONNECTOR
            elif all(pr.error and pr.prefill_status != 200 for pr in probes):
                cause = f"no probe reached decode: the prefill leg failed ({probes[0].error})"
                step = f"see kv_params{pair}; `pdctl logs {pair[1:].split('->')[0]}`"
            elif identity_ok is False and any(pr.error and pr.decode_status >= 500 for pr in probes):
                cause = "§5.4 decode refused prefill's KV: the two sides do not serve the same model (see identity)"
                step = _NEXT_GARBAGE
            elif any(pr.error and pr.decode_status >= 500 for pr in probes):
                cause = "§5.1 decode could not load the KV (handshake or transfer failed; the request failed)"
                step = _NEXT_TOKENS
            else:
                cause, step = _D_SILENT_TOKENS, _NEXT_TOKENS
            self.results.append(CheckResult(name, False, "; ".join(bad) + " | " + "; ".join(parts), t.ms, cause, step))
            return
        self.results.append(CheckResult(name, True, "; ".join(parts), t.ms))

    def _judge_logs(self, pair: str, p: WorkerConfig, d: WorkerConfig, probes: list[Probe]) -> None:
        name = f"kv_logs{pair}"
        t = _Timer()
        plines, dlines = self.new_log_lines(p.name), self.new_log_lines(d.name)
        if plines is None or dlines is None:
            self.results.append(
                CheckResult(name, None, "skipped: no log files in the run directory (started by hand?)", t.ms)
            )
            return
        pev = kvevents.scan(plines, p.name, setup=False)
        dev = kvevents.scan(dlines, d.name, setup=False)
        ids = [pr.request_id for pr in probes]

        def tied(events: list[kvevents.KVEvent]) -> list[kvevents.KVEvent]:
            return [e for e in events if any(kvevents.request_matches(e.request_id, i) for i in ids)]

        fails = [e for e in pev + dev if e.phase == "kv_failure"]
        fails = [e for e in fails if e.request_id is None or e in tied(pev + dev)]
        counts = {
            "prefill save_kv_layer": sum(1 for e in tied(pev) if e.phase == "save_kv_layer"),
            "decode start_load_kv": sum(1 for e in tied(dev) if e.phase == "start_load_kv"),
            "decode wait_for_layer_load": sum(1 for e in tied(dev) if e.phase == "wait_for_layer_load"),
        }
        untied = {
            ph: sum(1 for e in dev if e.phase == ph and e.request_id is None)
            for ph in ("start_load_kv", "wait_for_layer_load", "kv_transfer_metrics")
        }
        shown = ", ".join(f"{k} {v}" for k, v in counts.items())
        if fails:
            first = fails[0]
            cause, step = (
                "§5.1 the KV transfer failed or timed out (handshake, side channel, or an expired lease)",
                _NEXT_TOKENS,
            )
            if any("hash mismatch" in e.line for e in fails):
                cause = (
                    "§5.4 NIXL compatibility hash mismatch: the two sides differ in vLLM version, model string, "
                    "dtype or attention backend"
                )
                step = _NEXT_GARBAGE
            self.results.append(
                CheckResult(
                    name,
                    False,
                    f"{len(fails)} KV failure line(s): {first.source}: {first.detail} | {shown}",
                    t.ms,
                    cause,
                    step,
                    {"line": first.line[:300]},
                )
            )
            return
        if counts["decode start_load_kv"] and counts["decode wait_for_layer_load"]:
            self.results.append(CheckResult(name, True, shown + " (tied to the probes' request ids)", t.ms))
            return
        if untied["start_load_kv"] or untied["wait_for_layer_load"] or untied["kv_transfer_metrics"]:
            extra = ", ".join(f"{k} {v}" for k, v in untied.items() if v)
            self.results.append(CheckResult(name, True, f"{shown}; decode lines without request ids: {extra}", t.ms))
            return
        self.results.append(
            CheckResult(
                name,
                None,
                f"skipped: no per-request KV lines at this log level ({shown}); "
                'set logging.log_kv_transfer = true in settings.json (or logging.level = "debug") and restart '
                "the workers for per-request evidence",
                t.ms,
            )
        )

    def _judge_correctness(self, pair: str, probes: list[Probe], identity_ok: bool | None) -> None:
        name = f"kv_correctness{pair}"
        t = _Timer()
        compared, moved, bad = 0, 0, []
        parts = []
        for pr in probes:
            if pr.error or (pr.pd_tokens is None and pr.pd_text is None):
                parts.append(f"{pr.kind}: no PD output")
                continue
            if pr.ref_tokens is None and pr.ref_text is None:
                parts.append(f"{pr.kind}: no reference")
                continue
            compared += 1
            if pr.pd_tokens is not None and pr.ref_tokens is not None:
                same, how = pr.pd_tokens == pr.ref_tokens, "token ids"
            else:
                same, how = pr.pd_text == pr.ref_text, "text"
            if (pr.external_delta or 0) > 0:
                moved += 1
            parts.append(f"{pr.kind}: {how} {'identical' if same else 'DIFFER'}")
            if not same:
                bad.append(
                    f"{pr.kind}: PD {_short(pr.pd_text or str(pr.pd_tokens), 30)!r} vs reference "
                    f"{_short(pr.ref_text or str(pr.ref_tokens), 30)!r}"
                )
        if compared == 0:
            self.results.append(CheckResult(name, None, "skipped: " + "; ".join(parts), t.ms))
            return
        if bad:
            cause = _D_GARBAGE if identity_ok is False else _D_CORRUPT
            step = _NEXT_GARBAGE if identity_ok is False else _NEXT_CORRUPT
            self.results.append(CheckResult(name, False, "; ".join(bad), t.ms, cause, step))
            return
        if moved == 0:
            self.results.append(
                CheckResult(
                    name,
                    None,
                    "; ".join(parts) + " — but no KV moved, so this proves nothing about the link",
                    t.ms,
                )
            )
            return
        self.results.append(CheckResult(name, True, "; ".join(parts) + " (greedy, vs colocated reference)", t.ms))

    # -- all of it

    def run(self) -> VerifyReport:
        self.check_reachability()
        if not self.reachable:
            return VerifyReport(tuple(self.results), reachable=False)
        self.check_chat()
        self.check_stream()
        self.check_auth()
        self.check_gateway_path()
        for p in self.dep.prefill:
            for d in self.dep.decode:
                self.check_pair(p, d)
        if self.compare_colocated:
            self.check_compare_colocated()
        return VerifyReport(tuple(self.results))


def _norm_conn(name: str) -> str:
    return "NixlConnector" if name in ("NixlConnector", "NixlPullConnector") else name


def _replace(probe: Probe, **changes: Any) -> Probe:
    from dataclasses import replace

    return replace(probe, **changes)


# ------------------------------------------------------------------------------------------ streams


@dataclass(frozen=True, slots=True)
class _StreamResult:
    status: int
    error: str | None
    headers: Mapping[str, str]
    chunks: int = 0
    tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None


def _read_stream(http: _Http, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> _StreamResult:
    start = time.perf_counter()
    first: float | None = None
    first_content: float | None = None
    last_content: float | None = None
    chunks = content_chunks = 0
    usage_tokens: int | None = None
    done = False
    try:
        with http.client.stream("POST", url, json=dict(body), headers=dict(headers), timeout=http.timeout_s) as r:
            if r.status_code != 200:
                r.read()
                return _StreamResult(r.status_code, f"HTTP {r.status_code}: {r.text[:160]}", dict(r.headers))
            ctype = r.headers.get("content-type", "")
            for line in _lines(r.iter_lines()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(data)
                except ValueError:
                    return _StreamResult(r.status_code, f"not JSON in an SSE chunk: {data[:80]}", dict(r.headers))
                if isinstance(obj, Mapping) and isinstance(obj.get("error"), Mapping):
                    return _StreamResult(
                        r.status_code, f"error in the stream: {obj['error'].get('message')}", dict(r.headers)
                    )
                choices = obj.get("choices") if isinstance(obj, Mapping) else None
                usage = obj.get("usage") if isinstance(obj, Mapping) else None
                if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
                    usage_tokens = usage["completion_tokens"]
                if not choices:
                    continue
                chunks += 1
                if first is None:
                    first = now
                delta = choices[0].get("delta", {}) if isinstance(choices[0], Mapping) else {}
                if isinstance(delta, Mapping) and delta.get("content"):
                    content_chunks += 1
                    first_content = first_content or now
                    last_content = now
            resp_headers = dict(r.headers)
    except httpx.HTTPError as exc:
        return _StreamResult(0, _describe_error(exc), {})
    if "text/event-stream" not in ctype:
        return _StreamResult(200, f"Content-Type is {ctype!r}, expected text/event-stream", resp_headers)
    if not done:
        return _StreamResult(200, f"the stream ended without [DONE] after {chunks} chunks", resp_headers)
    if first is None or content_chunks == 0:
        return _StreamResult(200, "the stream carried no content", resp_headers)
    tokens = usage_tokens if usage_tokens is not None else content_chunks
    tpot = None
    if first_content is not None and last_content is not None and tokens > 1:
        tpot = (last_content - first_content) * 1000.0 / (tokens - 1)
    return _StreamResult(200, None, resp_headers, chunks, tokens, (first - start) * 1000.0, tpot)


def _lines(it: Iterator[str]) -> Iterator[str]:
    for line in it:
        yield line.rstrip("\r")


# ------------------------------------------------------------------------------------------ entry


def run_verify(
    dep: Deployment,
    *,
    gateway_url: str | None = None,
    api_key: str | None = None,
    client: httpx.Client | None = None,
    logs_dir: Path | None = None,
    timeout_s: float = 120.0,
    compare_colocated: bool = False,
    probes: Sequence[str] = ("short", "typical", "long"),
) -> VerifyReport:
    """Run every check against a running deployment and return the report (never raises for a bad link).

    ``api_key`` is the gateway key (the CLI reads it from ``$gateway.api_key_env``); ``client`` may carry a
    test transport; ``logs_dir`` is the run directory's ``logs/`` (``None``: the log check is skipped).
    """
    own = client is None
    http_client = client if client is not None else httpx.Client(timeout=timeout_s, trust_env=False)
    try:
        v = _Verifier(
            dep,
            _Http(http_client, timeout_s),
            gateway_url or dep.gateway.url,
            api_key,
            logs_dir,
            compare_colocated,
            probes,
        )
        report = v.run()
    finally:
        if own:
            http_client.close()
    return report
