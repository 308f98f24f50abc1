"""One request's journey through the gateway, prefill and decode, rebuilt from the deployment's log files.

* :func:`parse_access`   -- the gateway's access-log line (``pdctl.gateway.access request_id=... k=v ...``) as a dict
* :func:`line_matches`   -- whether a log line names the request (its id, vLLM's ``cmpl-<id>-0-<8hex>``, ``-retryN``)
* :func:`build_trace`    -- lines (already read) -> :class:`Trace`, rows in the order the request went through
* :func:`trace_request`  -- ``pdctl trace``: read the files, build the trace, or :class:`RequestNotFound`

The gateway's access line is the backbone: it is written when the request ends, with ``duration_ms``, so the
arrival is its time minus the duration, and ``prefill_ms``, ``ttft_ms`` and ``duration_ms`` place the prefill's
end, the first token and the end to the millisecond (``exact`` rows). Worker lines carry vLLM's one-second clock
(``MM-DD HH:MM:SS``): their offsets from the arrival are approximate, and rows are ordered by stage (arrival,
decision, prefill, kv, decode, end), not by those coarse times.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pdctl.errors import PdctlError
from pdctl.runtime.logs import LogLine, read_logs
from pdctl.vllm.kvlog import KVEvent, classify, parse_prefix

__all__ = [
    "STAGES",
    "RequestNotFound",
    "Stage",
    "Trace",
    "TraceRow",
    "build_trace",
    "line_matches",
    "parse_access",
    "trace_request",
]

Stage = Literal["arrival", "decision", "prefill", "kv", "decode", "stall", "end"]
STAGES: tuple[Stage, ...] = ("arrival", "decision", "prefill", "kv", "decode", "stall", "end")

NOT_RECORDED = "not recorded"


class RequestNotFound(PdctlError):
    """No line of the searched logs names the request."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One step of the journey: ``at_ms`` from the gateway's arrival (None: unknown); ``exact`` when it comes
    from the gateway's millisecond timings, not a log line's one-second clock."""

    stage: Stage
    event: str
    process: str
    detail: str
    at_ms: float | None = None
    exact: bool = False
    line: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``trace --json`` shape of a row."""
        return {
            "stage": self.stage,
            "event": self.event,
            "process": self.process,
            "at_ms": None if self.at_ms is None else round(self.at_ms, 1),
            "exact": self.exact,
            "detail": self.detail,
            "line": self.line,
        }


@dataclass(slots=True)
class Trace:
    """A request's rows, the access-log fields they came from, and the worker-side ids seen."""

    request_id: str
    rows: list[TraceRow]
    access: dict[str, str] | None
    arrival_ts: float | None
    worker_ids: list[str] = field(default_factory=list)
    searched: list[str] = field(default_factory=list)
    access_lines: int = 0

    def to_json(self) -> dict[str, Any]:
        """The ``trace --json`` document."""
        acc = self.access or {}
        return {
            "request_id": self.request_id,
            "path": acc.get("path"),
            "status": acc.get("status"),
            "prefill": _dash(acc.get("prefill")),
            "decode": _dash(acc.get("decode")),
            "ttft_ms": _num(acc.get("ttft_ms")),
            "prefill_ms": _num(acc.get("prefill_ms")),
            "duration_ms": _num(acc.get("duration_ms")),
            "prompt_tokens": _num(acc.get("prompt_tokens")),
            "tokens": _num(acc.get("tokens")),
            "decision": acc.get("decision"),
            "cached_tokens": _num(acc.get("cached_tokens")),
            "session": acc.get("session"),
            "cache_break": acc.get("cache_break"),
            "reused_tokens": _num(acc.get("reused_tokens")),
            "access": self.access,
            "access_lines": self.access_lines,
            "worker_request_ids": self.worker_ids,
            "logs": self.searched,
            "rows": [r.to_json() for r in self.rows],
        }


def _dash(v: str | None) -> str | None:
    return None if v in (None, "-", "") else v


def _num(v: str | None) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------- parsing

_KV_PAIR = re.compile(r"(\w+)=(\S+)")
_ACCESS = re.compile(r" pdctl\.gateway\.access(?:\[\d+\])? ")
_GATEWAY = re.compile(r"^\S+ [A-Z]+ pdctl\.gateway(?:\.\w+)*(?:\[\d+\])? ")


def parse_access(text: str) -> dict[str, str] | None:
    """The ``key=value`` fields of a gateway access-log line, or None for any other line."""
    m = _ACCESS.search(text)
    if m is None:
        return None
    fields = dict(_KV_PAIR.findall(text, m.end()))
    return fields if "request_id" in fields else None


def _id_pattern(request_id: str) -> re.Pattern[str]:
    # vLLM: cmpl-<id>-<i>-<8hex> / chatcmpl-<id>-<8hex>; the gateway's retries and release legs add a suffix.
    return re.compile(
        r"(?<![\w.:-])(?:(?:chat)?cmpl-)?" + re.escape(request_id)
        + r"(?P<suffix>-retry\d+|-release)?(?:-\d+)?(?:-[0-9a-f]{8}|-sim)?(?![\w-]|[.:][\w-])"
    )  # fmt: skip


def line_matches(text: str, request_id: str) -> bool:
    """Whether a line names the request: its id, the worker-side ids vLLM derives from it, or its retries."""
    return _id_pattern(request_id).search(text) is not None


def _worker_ids(text: str, request_id: str) -> list[str]:
    return [m.group(0) for m in _id_pattern(request_id).finditer(text) if m.group(0) != request_id]


# -------------------------------------------------------------------------------------------- build

_KV_STAGE: dict[str, Stage] = {
    "save_kv_layer": "prefill",
    "start_load_kv": "kv",
    "wait_for_layer_load": "kv",
    "kv_transfer_metrics": "kv",
    "kv_failure": "kv",
    "kv_setup": "kv",
}


_CLOSING = ("prefill end",)


def _role(name: str, access: Mapping[str, str] | None) -> str:
    if access is not None:
        for role in ("prefill", "decode"):
            if access.get(role) == name:
                return role
    for role in ("gateway", "prefill", "decode"):
        if name.startswith(role):
            return role
    return "worker"


def build_trace(
    request_id: str,
    lines: Sequence[LogLine],
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    searched: Sequence[str] = (),
) -> Trace:
    """The journey of ``request_id`` through ``lines`` (all lines of the logs, merged by time)."""
    pattern = _id_pattern(request_id)
    accesses = [(ln, a) for ln in lines if (a := parse_access(ln.text)) is not None and a["request_id"] == request_id]
    access_line, access = accesses[-1] if accesses else (None, None)
    arrival: float | None = None
    if access_line is not None and access is not None and access_line.ts > 0:
        dur = _num(access.get("duration_ms"))
        arrival = access_line.ts - (dur or 0.0) / 1000.0
    matched = [
        ln for ln in lines if ln is not access_line and parse_access(ln.text) is None and pattern.search(ln.text)
    ]
    if arrival is None and matched:
        arrival = matched[0].ts
    trace = Trace(request_id, [], access, arrival, searched=list(searched), access_lines=len(accesses))
    rows = trace.rows
    if access is not None and access_line is not None:
        rows.extend(_gateway_rows(access, access_line, slo_ttft_ms, slo_tpot_ms))
    ids: list[str] = []
    decode_seen = False
    last_kv_ts: float | None = None
    for ln in matched:
        for wid in _worker_ids(ln.text, request_id):
            if wid not in ids:
                ids.append(wid)
        role = _role(ln.name, access)
        approx = None if arrival is None or ln.ts <= 0 else max(0.0, (ln.ts - arrival) * 1000.0)
        ev = classify(ln.text)
        if role == "gateway":
            rows.append(TraceRow("decision", "gateway", ln.name, _message(ln.text), approx, line=ln.text))
        elif ev is not None:
            row = _kv_row(ev, ln, role, approx)
            if row.event == "KV loaded" and any(r.event == "KV failure" and r.process == ln.name for r in rows):
                # vLLM prints "Finished recving" for a failed read too
                row = replace(row, event="KV receive ended", detail="KV receive ended after the failure above")
            rows.append(row)
            if role == "decode":
                decode_seen = True
                last_kv_ts = ln.ts
        else:
            stage: Stage = "prefill" if role == "prefill" else "decode"
            rows.append(TraceRow(stage, f"{role} log", ln.name, _message(ln.text), approx, line=ln.text))
    trace.worker_ids = ids
    # NIXL's "KV Transfer metrics" line sums a window of transfers, not one request: the first one after this
    # request's KV arrived on decode, named as a window.
    if decode_seen and last_kv_ts is not None and access is not None:
        dname = access.get("decode", "")
        for ln in lines:
            if ln.name != dname or ln.ts < last_kv_ts or ln.ts > last_kv_ts + 15:
                continue
            ev = classify(ln.text)
            if ev is not None and ev.phase == "kv_transfer_metrics":
                approx = None if arrival is None else max(0.0, (ln.ts - arrival) * 1000.0)
                rows.append(TraceRow("kv", "transfer metrics (window)", ln.name, _window(ev), approx, line=ln.text))
                break
    if (
        access is not None
        and (access.get("path") in ("disagg", "fallback"))
        and not any(r.stage == "kv" and r.process != "gateway" for r in rows)
    ):
        rows.append(TraceRow("kv", "worker KV lines", "-", NOT_RECORDED + " (no prefill/decode line names this "
                             "request; the workers' KV loggers print per-request lines at DEBUG)"))  # fmt: skip
    order = {s: i for i, s in enumerate(STAGES)}
    # Stable: within a stage, the gateway's opening rows, then log lines in time order, then the stage's close.
    rows.sort(key=lambda r: (order[r.stage], 2 if r.event in _CLOSING else 0 if r.line is None else 1))
    if not rows:
        raise RequestNotFound(f"request {request_id} not found in {', '.join(searched) or 'the logs'}")
    return trace


def _message(text: str) -> str:
    m = _GATEWAY.match(text)
    return text[m.end() :] if m else parse_prefix(text).message


def _kv_row(ev: KVEvent, ln: LogLine, role: str, at_ms: float | None) -> TraceRow:
    stage = _KV_STAGE.get(ev.phase, "kv")
    if ev.phase == "kv_failure":
        event = "KV failure"
    elif ev.phase == "save_kv_layer":
        event = "KV saved"
    elif ev.phase == "wait_for_layer_load" and role == "decode":
        event = "KV loaded" if ("received" in ev.detail or "injected" in ev.detail) else "waiting for KV"
    elif ev.phase == "start_load_kv":
        event = "KV load started"
    else:
        event = ev.phase
    return TraceRow(stage, event, ln.name, ev.detail, at_ms, line=ln.text)


def _window(ev: KVEvent) -> str:
    m = ev.metrics
    parts = [f"{m.get('num_successful_transfers', 0):g} transfer(s) in the window"]
    if "avg_xfer_time_ms" in m:
        parts.append(f"avg {m['avg_xfer_time_ms']:g} ms")
    if "avg_mb_per_transfer" in m:
        parts.append(f"{m['avg_mb_per_transfer']:g} MB per transfer")
    if "throughput_mb_s" in m:
        parts.append(f"{m['throughput_mb_s']:g} MB/s")
    if m.get("num_failed_transfers"):
        parts.append(f"{m['num_failed_transfers']:g} failed")
    return ", ".join(parts)


def _gateway_rows(
    a: Mapping[str, str], ln: LogLine, slo_ttft_ms: float | None, slo_tpot_ms: float | None
) -> list[TraceRow]:
    g = ln.name
    path = a.get("path", "-")
    prefill, decode = _dash(a.get("prefill")), _dash(a.get("decode"))
    ttft, prefill_ms, dur = _num(a.get("ttft_ms")), _num(a.get("prefill_ms")), _num(a.get("duration_ms"))
    prompt, tokens = a.get("prompt_tokens", "-"), a.get("tokens", "-")
    rows = [TraceRow("arrival", "arrival", g, f"model={a.get('model', '-')}", 0.0, True)]
    decision = f"x-pd-path: {path}"
    if a.get("decision") == "always":
        decision += "; decision=always (pd_mode always: both legs)"
    elif "decision" in a:
        decision += f"; decision={a['decision']} cached_tokens={a.get('cached_tokens', '-')} " + (
            f"uncached_tokens={a.get('uncached_tokens', '-')}"
        )
        if "view" in a:
            decision += f" view={a['view']}"
    else:
        decision += "; decision reason not recorded (routing.pd_mode is not adaptive)"
    # routing policies (pdctl.gateway.routing.policies): policy:rule, then name:score
    for role in ("decode", "prefill"):
        if f"{role}_pick" in a:
            decision += f"; {role} by {a[f'{role}_pick']} scores {a.get(f'{role}_scores', '-')}"
    if "auto" in a:  # the SLO autopilot (pdctl.gateway.routing.autopilot): each path's predicted TTFT/TPOT/others' TPOT
        shown = [f"{k} {a[f'auto_{k}']}" for k in ("local", "whole", "disagg") if f"auto_{k}" in a]
        decision += f"; auto chose {a['auto']} (predicted ttft/tpot/others' tpot ms: {'; '.join(shown)})"
    if "fallback" in a:
        decision += f"; fallback={a['fallback']}"
    if "session" in a:  # an agent session (pdctl.gateway.agent_sessions): where its prompt cache broke since last turn
        decision += f"; session={a['session']}" + "".join(f" {k}={a[k]}" for k in ("agent", "parent") if k in a)
        if "cache_break" in a:
            where = "none (the previous turn's prompt is all reused)" if a["cache_break"] == "-" else a["cache_break"]
            decision += f"; cache break at {where}, reused_tokens={a.get('reused_tokens', '-')}"
    rows.append(TraceRow("decision", "decision", g, decision, 0.0, True))
    if prefill is not None:
        rows.append(TraceRow("prefill", "prefill start", g, f"leg 1 on {prefill}, prompt_tokens={prompt}", 0.0))
        if prefill_ms is not None:
            rows.append(TraceRow("prefill", "prefill end", g, f"prefill_ms={prefill_ms:g}", prefill_ms, True))
    elif path in ("local", "colocated", "fallback", "upstream"):
        rows.append(TraceRow("prefill", "no prefill leg", g, f"path {path}: the prompt ({prompt} tokens) is "
                             "computed where it is decoded"))  # fmt: skip
    if "kv_engine" in a:
        rows.append(TraceRow("kv", "KV handoff", g, f"blocks={a.get('kv_blocks', '-')} remote={a.get('kv_remote', '-')}"
                             f" engine={a['kv_engine']}; bytes/ms per request {NOT_RECORDED}", prefill_ms,
                             prefill_ms is not None))  # fmt: skip
    elif prefill is not None:
        rows.append(TraceRow("kv", "KV handoff", g, f"{NOT_RECORDED} (logging.log_kv_transfer off)", prefill_ms,
                             prefill_ms is not None))  # fmt: skip
    if decode is not None:
        if ttft is not None:
            rows.append(TraceRow("decode", "first token", g, f"on {decode}, ttft_ms={ttft:g}", ttft, True))
        else:
            rows.append(TraceRow("decode", "first token", g, f"on {decode}; ttft {NOT_RECORDED} (not a stream, "
                                 "or no token)"))  # fmt: skip
    if ttft is not None and slo_ttft_ms is not None and ttft > slo_ttft_ms:
        rows.append(TraceRow("stall", "TTFT over SLO", g, f"ttft_ms={ttft:g} > slo.ttft_ms={slo_ttft_ms:g}", ttft,
                             True))  # fmt: skip
    n = _num(tokens)
    if ttft is not None and dur is not None and n is not None and n > 1:
        tpot = (dur - ttft) / (n - 1)
        if slo_tpot_ms is not None and tpot > slo_tpot_ms:
            rows.append(TraceRow("stall", "TPOT over SLO", g, f"average {tpot:.1f} ms per token > slo.tpot_ms="
                                 f"{slo_tpot_ms:g}", dur, True))  # fmt: skip
    rows.append(TraceRow("stall", "stalls between tokens", g, f"{NOT_RECORDED} (the access log keeps no per-token "
                         "times)"))  # fmt: skip
    end = f"status={a.get('status', '-')} tokens={tokens}"
    if "error" in a:
        end += f" error={a['error']}"
    rows.append(TraceRow("end", "end", g, end, dur, dur is not None, line=ln.text))
    return rows


# --------------------------------------------------------------------------------------------- read


def trace_request(
    files: Mapping[str, Path],
    request_id: str,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> Trace:
    """Read ``files`` (name -> path) and build the request's :class:`Trace`; :class:`RequestNotFound` if no line
    names it."""
    searched = [str(p) for p in files.values()]
    lines = read_logs(files)
    if not any(line_matches(ln.text, request_id) for ln in lines):
        raise RequestNotFound(
            f"request {request_id} not found in {', '.join(searched) or 'no log files'}",
            hint="the id is the gateway's x-request-id (the client's X-Request-Id, or the one it generated)",
        )
    return build_trace(request_id, lines, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, searched=searched)
