"""Classify vLLM log lines into KV-transfer events, in the recipe's vocabulary.

The recipe tells people to look for ``save_kv_layer`` / ``start_load_kv`` / ``wait_for_layer_load`` in the
logs. Those are method names of vLLM's connector API (``KVConnectorBase_V1``), not words vLLM prints, so
this module maps the lines real connectors do print onto those phases:

* ``save_kv_layer``       prefill: KV computed and held for decode, ready to send, done sending
* ``start_load_kv``       decode: handshake with prefill, reading remote blocks, shared-storage cache hit
* ``wait_for_layer_load`` decode: waiting for remote KV, KV received / injected into the paged memory
* ``kv_transfer_metrics`` either side: the periodic ``KV Transfer metrics:`` line, numbers in ``metrics``
* ``kv_failure``          either side: transfer/handshake failure, failed requests, expired leases,
                          invalid params, compatibility-hash mismatch
* ``kv_setup``            either side: the connector was created, its side channel or storage path is up,
                          a handshake request was served. Not one of the recipe's words; kept apart
                          (:data:`SETUP_PHASES`) so ``logs --kv`` can show that the connector exists even at
                          INFO level, where NIXL's prefill side prints nothing per request.

Lines that are not KV events give ``None``: cache sizing at start (``CPU KV cache size``, ``GiB for KV
cache``, ``Registering KV_Caches``), the engine's periodic stats (``External prefix cache hit rate``),
traceback continuation lines, scheduler bookkeeping (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``request_finished(...), request_status=``; the worker lines that follow carry
the same facts) and ExampleConnector's ``In connector.start_load_kv, but the attn_metadata is None``
(printed on every forward step without attention metadata, prefill included; nothing is loaded).

Unknown connectors fall back to a keyword match on the message (KV + save/send/load/receive words,
failures only at WARNING or above).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

__all__ = [
    "KV_PHASES",
    "PHASES",
    "SETUP_PHASES",
    "KVEvent",
    "LinePrefix",
    "Phase",
    "base_request_id",
    "classify",
    "parse_prefix",
    "parse_transfer_metrics",
    "request_matches",
    "scan",
]

Phase = Literal[
    "save_kv_layer", "start_load_kv", "wait_for_layer_load", "kv_transfer_metrics", "kv_failure", "kv_setup"
]
KV_PHASES: tuple[Phase, ...] = (
    "save_kv_layer",
    "start_load_kv",
    "wait_for_layer_load",
    "kv_transfer_metrics",
    "kv_failure",
)
SETUP_PHASES: tuple[Phase, ...] = ("kv_setup",)
PHASES: tuple[Phase, ...] = KV_PHASES + SETUP_PHASES


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One classified KV line: the phase, a short description and what the line says about where/when."""

    phase: Phase
    detail: str
    request_id: str | None
    time: str | None
    process: str | None
    line: str
    source: str | None = None
    level: str | None = None
    lineno: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LinePrefix:
    """vLLM's ``(<Proc> pid=N) LEVEL MM-DD HH:MM:SS [file:line]`` prefix, split into its parts."""

    process: str | None
    pid: int | None
    level: str | None
    time: str | None
    location: str | None
    message: str


_PREFIX = re.compile(
    r"^(?:\x1b\[[0-9;]*m)*"
    r"(?:\((?P<proc>[\w.:-]+) pid=(?P<pid>\d+)\)\s+)?"
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+"
    r"(?P<time>\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?\s+"
    r"\[(?P<loc>[^\]]+)\]\s?"
    r"(?P<msg>.*)$"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_prefix(line: str) -> LinePrefix:
    """Split a vLLM log line into its prefix fields; other lines come back with only ``message``."""
    text = _ANSI.sub("", line.rstrip("\r\n"))
    m = _PREFIX.match(text)
    if m is None:
        return LinePrefix(None, None, None, None, None, text)
    pid = m.group("pid")
    return LinePrefix(
        process=m.group("proc"),
        pid=int(pid) if pid else None,
        level=m.group("level"),
        time=m.group("time"),
        location=m.group("loc"),
        message=m.group("msg"),
    )


# ------------------------------------------------------------------------------------------ the rules

_Detail = Callable[["re.Match[str]"], str]


@dataclass(frozen=True, slots=True)
class _Rule:
    phase: Phase
    pattern: re.Pattern[str]
    detail: _Detail
    request_group: str | None = None


def _rule(phase: Phase, pattern: str, detail: str | _Detail, request_group: str | None = None) -> _Rule:
    fn = detail if callable(detail) else _const(detail)
    return _Rule(phase, re.compile(pattern), fn, request_group)


def _transfer_failure(m: re.Match[str]) -> str:
    why = re.search(r"'error': ['\"](?P<e>[^'\"]+)", m.string)
    return f"NIXL transfer failure: {m['kind']}" + (f" ({why['e']})" if why else "")


def _const(text: str) -> _Detail:
    def detail(_m: re.Match[str]) -> str:
        return text

    return detail


_REQ = r"(?P<req>[\w.:-]+)"

# Order matters: the first match wins (failures before the generic progress lines).
_RULES: tuple[_Rule, ...] = (
    # --- failures
    _rule("kv_failure", r"NIXL transfer failure: (?P<kind>\w+)", _transfer_failure),
    # vllm/v1/core/sched/scheduler.py (0.32 and 0.33): kv_load_failure_policy "recompute", then "fail".
    _rule(
        "kv_failure",
        r"Recovered from KV load failure: (?P<n>\d+) request\(s\) rescheduled(?: \((?P<t>\d+) tokens affected\))?",
        lambda m: (
            f"{m['n']} request(s) rescheduled to recompute after a KV load failure"
            + (f" ({m['t']} tokens)" if m["t"] else "")
        ),
    ),
    _rule(
        "kv_failure",
        r"Failing (?P<n>\d+) request\(s\) due to KV load failure(?: \((?P<why>[^)]*)\))?",
        lambda m: f"{m['n']} request(s) failed: KV load failure" + (f" ({m['why']})" if m["why"] else ""),
    ),
    # NIXL's worker (vLLM 0.33) when prefill and decode block sizes cannot be paired: their transfers cannot work.
    _rule(
        "kv_failure",
        r"Not pairing remote (?P<r>\d+)-token blocks with local (?P<l>\d+)-token blocks: (?P<why>[^.]*)",
        lambda m: (
            f"handshake: remote {m['r']}-token blocks cannot be paired with local {m['l']}-token blocks "
            f"({m['why']}): give prefill and decode the same block size"
        ),
    ),
    _rule("kv_failure", r"Got invalid KVTransferParams", "decode got invalid kv_transfer_params: it recomputes"),
    _rule(
        "kv_failure",
        r"compatibility hash mismatch",
        "NIXL compatibility hash mismatch (model/version differ)",
    ),
    _rule(
        "kv_failure",
        r"Releasing expired KV blocks for request " + _REQ,
        "prefill released KV blocks: lease expired before decode read them",
        "req",
    ),
    _rule(
        "kv_failure",
        r"Potentially invalid KV blocks for unrecognized request " + _REQ,
        "decode read KV blocks prefill no longer held (expired)",
        "req",
    ),
    _rule(
        "kv_failure",
        r"Skipping KV post-processing for failed request " + _REQ,
        "KV load failed for this request",
        "req",
    ),
    _rule(
        "kv_failure",
        r"get_finished: (?P<s>\d+) requests done sending and (?P<r>\d+) requests done recving "
        r"\((?P<f>[1-9]\d*) failed\)",
        lambda m: f"{m['f']} transfer(s) failed ({m['s']} sent, {m['r']} received)",
    ),
    # --- metrics
    _rule("kv_transfer_metrics", r"KV Transfer metrics: (?P<body>.*)", lambda m: _metrics_detail(m["body"])),
    # --- prefill side
    _rule(
        "save_kv_layer",
        r"Finished sending KV transfer for request " + _REQ,
        "done sending KV",
        "req",
    ),
    _rule(
        "save_kv_layer",
        r"request_finished\(" + _REQ + r"\) waiting for (?P<s>[\d.]+) seconds before releasing blocks",
        lambda m: f"KV saved, ready to send (held {m['s']} s for decode)",
        "req",
    ),
    _rule(
        "save_kv_layer",
        r"Heartbeat extended lease for request " + _REQ + r" by (?P<s>[\d.]+)s",
        lambda m: f"KV lease extended by {m['s']} s while decode reads",
        "req",
    ),
    _rule(
        "save_kv_layer",
        r"get_finished: (?P<s>[1-9]\d*) requests done sending and 0 requests done recving",
        lambda m: f"{m['s']} request(s) done sending",
    ),
    # --- decode side: handshake and reads
    _rule("start_load_kv", r"NIXL compatibility check passed", "handshake: compatibility check passed"),
    _rule(
        "start_load_kv",
        r"Querying metadata on path: (?P<path>\S+)",
        lambda m: f"handshake: query {m['path']}",
    ),
    _rule(
        "start_load_kv",
        r"NIXL handshake: (?P<what>get metadata|add agent) took:? (?P<s>[\d.eE+-]+)",
        lambda m: f"handshake: {m['what']} took {float(m['s']) * 1000:.1f} ms",
    ),
    _rule("start_load_kv", r"Transfer plan: TransferTopology", "handshake: transfer plan agreed"),
    _rule(
        "start_load_kv",
        r"Registering remote agent \((?P<eng>[\w-]+)",
        lambda m: f"handshake: registering remote agent {m['eng']}",
    ),
    _rule(
        "start_load_kv",
        r"Created \d+ blocks for dst engine (?P<eng>[\w-]+)",
        lambda m: f"handshake: mapped remote blocks of {m['eng']}",
    ),
    _rule(
        "start_load_kv",
        r"start_load_kv for request " + _REQ + r" from remote engine (?P<eng>[\w-]+)",
        lambda m: f"load started from remote engine {m['eng']}",
        "req",
    ),
    _rule(
        "start_load_kv",
        r"calling _read_blocks on remote rank (?P<rank>\d+).* for req " + _REQ,
        lambda m: f"reading remote blocks (remote rank {m['rank']})",
        "req",
    ),
    _rule("start_load_kv", r"External Cache Hit!", "shared-storage cache hit: loading KV"),
    # --- decode side: waiting / finished
    _rule(
        "wait_for_layer_load",
        _REQ + r" is still in WAITING_FOR_REMOTE_KVS state",
        "waiting for remote KV",
        "req",
    ),
    _rule(
        "wait_for_layer_load",
        r"Finished recving KV transfer for request " + _REQ,
        "KV received",
        "req",
    ),
    _rule(
        "wait_for_layer_load",
        r"Inject KV cache of (?P<n>\d+) tokens to the paged memory",
        lambda m: f"KV of {m['n']} tokens injected into the paged memory",
    ),
    _rule(
        "wait_for_layer_load",
        r"get_finished: (?P<s>\d+) requests done sending and (?P<r>[1-9]\d*) requests done recving",
        lambda m: f"{m['r']} request(s) done receiving" + (f", {m['s']} done sending" if m["s"] != "0" else ""),
    ),
    # --- setup
    _rule(
        "kv_setup",
        r"Creating v1 connector with name: (?P<name>\w+) and engine_id: (?P<eng>[\w-]+)",
        lambda m: f"connector {m['name']} created (engine {m['eng']})",
    ),
    _rule("kv_setup", r"Shared storage path is (?P<p>\S+)", lambda m: f"shared storage at {m['p']}"),
    _rule(
        "kv_setup",
        r"Starting listening on path: (?P<p>\S+)",
        lambda m: f"NIXL side channel listening on {m['p']}",
    ),
    _rule(
        "kv_setup",
        r"Received message for pp rank \d+, tp rank \d+",
        "side channel: handshake request from decode served",
    ),
)

# Lines that mention KV but are deliberately not events (see the module docstring).
_IGNORE = re.compile(
    r"In connector\.start_load_kv, but the attn_metadata is None"
    r"|get_num_new_matched_tokens|update_state_after_alloc|request_status="
    r"|KV cache size|for KV cache|KV cache layout|Registering KV_Caches|KV cache usage|prefix cache hit rate"
    r"|hybrid kv cache manager|Maximum concurrency|num_gpu_blocks|kv_transfer_config|KVTransferConfig\("
    r"|KVConnectorBase_V1|kv_cache_dtype|Initializing NIXL|NIXL is available|Registering layer"
    r"|NIXL compatibility hash:|KV fetch:",
    re.IGNORECASE,
)
_TRACEBACK = re.compile(r"^(\s|Traceback|File \"|\^|\w+(\.\w+)*(Error|Exception|Again)\b:)")

_FALLBACK_FAIL = re.compile(
    r"\b(kv|kv[ _-]?cache|kv[ _-]?transfer|connector)\b.*"
    r"\b(fail(ed|ure)?|error|timed? ?out|expired|abort(ed)?)\b"
    r"|\b(fail(ed|ure)?|error|timed? ?out)\b.*\b(kv|kv[ _-]?cache|kv[ _-]?transfer)\b",
    re.IGNORECASE,
)
_FALLBACK_DONE = re.compile(
    r"\b(kv|kv[ _-]?cache)\b.*\b(loaded|received|retrieved|injected|arrived)\b"
    r"|\b(loaded|received|retrieved|injected)\b.*\bkv\b",
    re.IGNORECASE,
)
_FALLBACK_LOAD = re.compile(
    r"\b(kv|kv[ _-]?cache)\b.*\b(load(ing)?|retriev(e|ing)|fetch(ing)?|recv|receiv(e|ing)|pull(ing)?|hit)\b"
    r"|\b(load(ing)?|retriev(e|ing)|fetch(ing)?|pull(ing)?)\b.*\bkv\b",
    re.IGNORECASE,
)
_FALLBACK_SAVE = re.compile(
    r"\b(kv|kv[ _-]?cache)\b.*"
    r"\b(sav(e|ed|ing)|stor(e|ed|ing)|sen[dt]|sending|offload(ed|ing)?|push(ed|ing)?)\b"
    r"|\b(sav(e|ed|ing)|stor(e|ed|ing)|sen[dt]|sending|offload(ed|ing)?|push(ed|ing)?)\b.*\bkv\b",
    re.IGNORECASE,
)
_FALLBACK_REQ = re.compile(r"\b(?:request|req)(?:[ _]?id)?[:= ]+'?(?P<req>(?:chat)?cmpl-[\w.-]+|[0-9a-f]{8,})")
_CONTEXT_REQ = re.compile(r"'request_id': '(?P<req>[^']+)'")
_IDSET = re.compile(r"Request IDs: \{(?P<ids>[^}]*)\}")
_ACCESS = re.compile(r"^INFO:\s+[\d.:\[\]a-f]+ - \"")


def classify(line: str) -> KVEvent | None:
    """The KV event a log line reports, or ``None`` when it is not one."""
    p = parse_prefix(line)
    msg = p.message
    if not msg or _TRACEBACK.match(msg) or _ACCESS.match(msg):
        return None
    raw = line.rstrip("\r\n")
    for rule in _RULES:
        m = rule.pattern.search(msg)
        if m is None:
            continue
        req = m.group(rule.request_group) if rule.request_group else _request_id(msg)
        metrics = parse_transfer_metrics(m["body"]) if rule.phase == "kv_transfer_metrics" else {}
        return KVEvent(rule.phase, rule.detail(m), req, p.time, p.process, raw, level=p.level, metrics=metrics)
    if _IGNORE.search(msg):
        return None
    phase = _fallback_phase(msg, p.level)
    if phase is None:
        return None
    return KVEvent(phase, f"(keyword match) {msg[:120]}", _request_id(msg), p.time, p.process, raw, level=p.level)


def _fallback_phase(msg: str, level: str | None) -> Phase | None:
    if level in ("WARNING", "ERROR", "CRITICAL") and _FALLBACK_FAIL.search(msg):
        return "kv_failure"
    if _FALLBACK_DONE.search(msg):
        return "wait_for_layer_load"
    if _FALLBACK_LOAD.search(msg):
        return "start_load_kv"
    if _FALLBACK_SAVE.search(msg):
        return "save_kv_layer"
    return None


def _request_id(msg: str) -> str | None:
    for pattern in (_CONTEXT_REQ, _FALLBACK_REQ):
        m = pattern.search(msg)
        if m:
            return m["req"]
    m = _IDSET.search(msg)
    if m:
        ids = [x.strip().strip("'\"") for x in m["ids"].split(",") if x.strip()]
        return ids[0] if ids else None
    return None


def scan(lines: Iterable[str], source: str | None = None, *, setup: bool = True) -> list[KVEvent]:
    """Classify every line; ``source`` (a process or file name) is recorded on each event."""
    out: list[KVEvent] = []
    for n, line in enumerate(lines, start=1):
        ev = classify(line)
        if ev is None or (not setup and ev.phase in SETUP_PHASES):
            continue
        out.append(replace(ev, source=source, lineno=n))
    return out


# --------------------------------------------------------------------------------- metrics and ids


def parse_transfer_metrics(body: str) -> dict[str, float]:
    """``Num successful transfers=3, Avg xfer time (ms)=4.1`` -> ``{"num_successful_transfers": 3.0}``."""
    out: dict[str, float] = {}
    for part in re.split(r",\s*(?=[A-Za-z])", body):
        name, sep, value = part.rpartition("=")
        if not sep:
            continue
        key = name.strip().lower().replace("(ms)", "ms").replace("(mb/s)", "mb_s")
        key = re.sub(r"[^a-z0-9]+", "_", key).strip("_")
        try:
            out[key] = float(value.strip())
        except ValueError:
            continue
    return out


def _metrics_detail(body: str) -> str:
    m = parse_transfer_metrics(body)
    ok = m.get("num_successful_transfers")
    failed = m.get("num_failed_transfers")
    parts = []
    if ok is not None:
        parts.append(f"{ok:g} transfer(s) ok")
    if failed is not None:
        parts.append(f"{failed:g} failed")
    if "avg_xfer_time_ms" in m:
        parts.append(f"avg {m['avg_xfer_time_ms']:g} ms")
    if "throughput_mb_s" in m:
        parts.append(f"{m['throughput_mb_s']:g} MB/s")
    return "KV Transfer metrics: " + (", ".join(parts) if parts else body[:80])


_VLLM_ID = re.compile(r"^(?:chatcmpl|cmpl)-(?P<base>.+?)(?:-\d+)?-[0-9a-f]{8}$")


def base_request_id(request_id: str) -> str:
    """The client's ``X-Request-Id`` inside vLLM's ``cmpl-<id>-<i>-<8hex>`` / ``chatcmpl-<id>-<8hex>``."""
    m = _VLLM_ID.match(request_id)
    return m["base"] if m else request_id


def request_matches(event_request_id: str | None, request_id: str) -> bool:
    """Whether a log line's request id belongs to the request sent with ``X-Request-Id: request_id``."""
    if not event_request_id:
        return False
    return event_request_id == request_id or base_request_id(event_request_id) == request_id
