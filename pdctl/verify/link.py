"""The KV link checks of one prefill->decode pair, from one set of probes.

::

    probe_link(pair)            per size (short / typical / long): a unique prompt, the two legs straight to
                                the workers, decode's counters before/after, then the colocated reference;
                                each PD decode and each reference runs alone on its worker (verify waits
                                for the worker to be idle and records what it saw: the batch context)
      identity[p->d]            check_identity: same model id and root, max_model_len, vLLM version,
                                connector, /tokenize
      kv_params[p->d]           judge_params: leg 1 returned usable kv_transfer_params
      kv_metrics[p->d]          judge_metrics: decode's external_kv_transfer tokens rose by about the prompt
      kv_logs[p->d]             judge_logs: the logs show the load and no KV failure
      kv_correctness[p->d]      judge_correctness: greedy PD tokens == the reference's, a difference judged
                                by the logprobs (:mod:`pdctl.verify.proof`): tie (probe re-run once with a
                                fresh prompt; a second tie is inconclusive, not a failure) or corruption

The judges are pure functions of the probes; only :func:`probe_link` and :func:`check_identity` talk HTTP.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdctl.config import WorkerConfig
from pdctl.runtime.probe import two_legs
from pdctl.verify import diagnoses as dg
from pdctl.verify import proof
from pdctl.verify.gateway_checks import CHAT_PROMPT
from pdctl.verify.proof import TIE_TOLERANCE_NATS, TOP_K, Divergence, Sample, first_divergence, parse_sample, show_token
from pdctl.verify.report import CheckResult, Timer
from pdctl.verify.wire import Http, block_size, metric_total
from pdctl.vllm import kvlog
from pdctl.vllm.identity import fetch_identity, identity_problems
from pdctl.vllm.protocol import ConnectorKind, connector_kind

__all__ = [
    "EXTERNAL",
    "PROBE_MAX_TOKENS",
    "Pair",
    "Probe",
    "check_identity",
    "greedy_body",
    "judge_correctness",
    "judge_logs",
    "judge_metrics",
    "judge_params",
    "probe_link",
    "probe_prompt",
]

PROBE_MAX_TOKENS = 8
EXTERNAL = "external_kv_transfer"
IDLE_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class Pair:
    """One prefill->decode pair under test, the connectors each side really runs, and verify's run nonce."""

    http: Http
    p: WorkerConfig
    d: WorkerConfig
    pc: str
    dc: str
    nonce: str

    @property
    def label(self) -> str:
        """``[prefill->decode]``, the suffix of the pair's check names."""
        return f"[{self.p.name}->{self.d.name}]"

    @property
    def kind(self) -> ConnectorKind:
        """How the legs run for prefill's connector."""
        return connector_kind(self.pc)


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe prompt sent through the pair, what came back, and what the reference produced.

    ``batch`` records each worker's running + waiting requests just before each leg (0: it ran alone);
    ``first_tie`` the divergence of a first try that tied, when the probe was re-run.
    """

    size: str
    request_ids: tuple[str, ...]
    prompt: str
    prompt_tokens: int
    params_reason: str = "not_sent"
    params_usable: bool = False
    prefill_status: int = 0
    decode_status: int = 0
    external_delta: float | None = None
    nixl_delta: float | None = None
    pd: Sample | None = None
    ref: Sample | None = None
    divergence: Divergence | None = None
    first_tie: Divergence | None = None
    token_texts: Mapping[int, str] = field(default_factory=dict)
    batch: Mapping[str, float | None] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The per-probe record in ``kv_correctness``'s data (and the false-alarm benchmark's)."""
        return {
            "size": self.size,
            "request_ids": list(self.request_ids),
            "prompt_tokens": self.prompt_tokens,
            "pd_tokens": list(self.pd.tokens) if self.pd else None,
            "ref_tokens": list(self.ref.tokens) if self.ref else None,
            "ref_margins": proof.margins(self.ref),
            "pd_margins": proof.margins(self.pd),
            "drift": proof.drift(self.ref, self.pd) if self.ref and self.pd else None,
            "divergence": self.divergence.to_json() if self.divergence else None,
            "first_tie": self.first_tie.to_json() if self.first_tie else None,
            "batch": dict(self.batch),
            "error": self.error,
        }


# ------------------------------------------------------------------------------------------ identity


def connector_from_logs(logs_dir: Path | None, w: WorkerConfig) -> str | None:
    """The connector ``w``'s log says it created (a hand-started worker may differ from the config)."""
    if logs_dir is None:
        return None
    try:
        lines = (logs_dir / f"{w.name}.log").read_text(encoding="utf-8", errors="replace").split("\n")
    except OSError:
        return None
    found = None
    for ev in kvlog.scan(lines, w.name):
        m = re.match(r"connector (\w+) created", ev.detail)
        if m:
            found = m.group(1)
    return found


def _norm_conn(name: str) -> str:
    return "NixlConnector" if name in ("NixlConnector", "NixlPullConnector") else name


def check_identity(pair: Pair) -> CheckResult:
    """``identity``: both sides serve the same model and tokenizer, on the same vLLM, with the same connector."""
    timer = Timer()
    name = f"identity{pair.label}"
    p, d, pc, dc, http = pair.p, pair.d, pair.pc, pair.dc, pair.http
    probe_text = f"pdctl verify {pair.nonce}: {CHAT_PROMPT}"
    ip, idd = (fetch_identity(http.client, w.url, w.model_name, probe_text, http.timeout_s) for w in (p, d))
    problems = identity_problems(p.name, ip, d.name, idd)
    mismatch = connector_kind(pc) != connector_kind(dc) or (
        connector_kind(pc) == "unknown" and _norm_conn(pc) != _norm_conn(dc)
    )
    if mismatch:
        detail = f"connector: {p.name} {pc}, {d.name} {dc}" + ("; " + "; ".join(problems) if problems else "")
        return CheckResult(name, False, detail, timer.ms, dg.connector_mismatch(pc, dc), dg.NEXT_CONNECTOR)
    if problems:
        return CheckResult(name, False, "; ".join(problems), timer.ms, dg.D_GARBAGE, dg.NEXT_GARBAGE)
    summary = (
        f"model {idd.model_id!r} (root {idd.root!r}), max_model_len {idd.max_model_len}, vLLM {idd.version}, "
        f"connector {pc}/{dc}, /tokenize identical"
    )
    return CheckResult(name, True, summary, timer.ms)


# ------------------------------------------------------------------------------------------- probes


def _tokens(http: Http, w: WorkerConfig, text: str) -> int | None:
    r = http.call("POST", f"{w.url}/tokenize", body={"model": w.model_name, "prompt": text})
    if r.ok and isinstance(r.body, Mapping) and isinstance(r.body.get("tokens"), list):
        return len(r.body["tokens"])
    return None


def _numbered(i: int) -> str:
    return f"w{i % 97}"


def probe_prompt(
    http: Http, d: WorkerConfig, head: str, size: str, target: int, word: Callable[[int], str] = _numbered
) -> tuple[str, int]:
    """A prompt starting with ``head`` of about ``target`` tokens (``short``: ``head`` alone), then ``word(i)``s."""
    if size == "short":
        return head, _tokens(http, d, head) or 0
    words = 8
    text, count = head, _tokens(http, d, head) or 0
    for _ in range(6):
        text = head + " " + " ".join(word(i) for i in range(words))
        c = _tokens(http, d, text)
        if c is None:
            return text, 0
        count = c
        if 0.85 * target <= c <= target:
            break
        words = max(1, int(words * target / max(c, 1) * 0.97))
    while count > target and words > 1:
        words = max(1, int(words * 0.9))
        text = head + " " + " ".join(word(i) for i in range(words))
        count = _tokens(http, d, text) or 0
    return text, count


def _metrics_text(http: Http, w: WorkerConfig) -> str | None:
    r = http.call("GET", f"{w.url}/metrics")
    return r.text if r.ok else None


def _counters(http: Http, d: WorkerConfig) -> tuple[float | None, float | None, int | None]:
    text = _metrics_text(http, d)
    if text is None:
        return None, None, None
    ext = metric_total(text, "vllm:prompt_tokens_by_source_total", {"source": EXTERNAL})
    nixl = metric_total(text, "vllm:nixl_xfer_time_seconds_count")
    return ext, nixl, block_size(text)


def _load(http: Http, w: WorkerConfig) -> float | None:
    text = _metrics_text(http, w)
    if text is None:
        return None
    running = metric_total(text, "vllm:num_requests_running")
    waiting = metric_total(text, "vllm:num_requests_waiting")
    return None if running is None else running + (waiting or 0.0)


def wait_idle(http: Http, w: WorkerConfig, timeout_s: float = IDLE_WAIT_S) -> float | None:
    """Wait until ``w`` runs no request (its running + waiting gauges are 0); return the last load seen.

    A non-zero return means something else shared the batch (a user request through the gateway, or a
    request still finishing): the probe records it as its batch context.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        load = _load(http, w)
        if not load or time.monotonic() >= deadline:
            return load
        time.sleep(0.05)


def _max_model_len(http: Http, d: WorkerConfig) -> int:
    r = http.call("GET", f"{d.url}/v1/models")
    if isinstance(r.body, Mapping) and isinstance(r.body.get("data"), list) and r.body["data"]:
        first = r.body["data"][0]
        if isinstance(first, Mapping) and isinstance(first.get("max_model_len"), int):
            return int(first["max_model_len"])
    return d.max_model_len or 2048


def greedy_body(model: str, prompt: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": PROBE_MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": TOP_K,
        "return_tokens_as_token_ids": True,
    }


def _reference(pair: Pair, prompt: str, rid: str) -> tuple[Sample | None, float | None]:
    # Shared storage: decode would reload the stored KV for the reference too (the real ExampleConnector
    # does, cache_salt or not), so the reference is computed on prefill.
    w = pair.p if pair.kind == "shared_storage" else pair.d
    load = wait_idle(pair.http, w)
    body = {**greedy_body(w.model_name, prompt), "cache_salt": uuid.uuid4().hex}
    r = pair.http.call("POST", f"{w.url}/v1/completions", body=body, headers={"X-Request-Id": rid + "-ref"})
    return (parse_sample(r.body) if r.ok else None), load


def _detokenize(pair: Pair, ids: Sequence[int | None]) -> dict[int, str]:
    out: dict[int, str] = {}
    for tid in {i for i in ids if i is not None}:
        r = pair.http.call("POST", f"{pair.d.url}/detokenize", body={"model": pair.d.model_name, "tokens": [tid]})
        if r.ok and isinstance(r.body, Mapping) and isinstance(r.body.get("prompt"), str):
            out[tid] = r.body["prompt"]
    return out


def _one_probe(pair: Pair, size: str, rid: str, prompt: str, n: int, ext0: float | None, nixl0: float | None) -> Probe:
    p, d, http = pair.p, pair.d, pair.http
    batch = {"prefill_before": wait_idle(http, p), "decode_before": wait_idle(http, d)}
    legs = two_legs(
        http.client,
        p.url,
        d.url,
        greedy_body(d.model_name, prompt),
        pair.kind,
        rid,
        prefill_model=p.model_name,
        require_params=False,
        timeout_s=http.timeout_s,
    )
    usage = legs.decode_body.get("usage") if isinstance(legs.decode_body, Mapping) else None
    if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int):
        n = int(usage["prompt_tokens"])  # the server's own count beats /tokenize
    probe = Probe(
        size,
        (rid,),
        prompt,
        n,
        params_reason=legs.params.reason if legs.params else "not_sent",
        params_usable=bool(legs.params and legs.params.usable),
        prefill_status=legs.prefill_status,
        decode_status=legs.decode_status,
        pd=parse_sample(legs.decode_body) if legs.error is None else None,
        error=legs.error,
    )
    ext1, nixl1, _ = _counters(http, d)
    if legs.error is None and ext1 is not None and ext0 is not None and ext1 - ext0 < n:
        # Stats may trail the response by an engine step: look once more before judging.
        time.sleep(0.5)
        ext1, nixl1, _ = _counters(http, d)
    ref, div = None, None
    if probe.pd is not None:
        ref, batch["reference_before"] = _reference(pair, prompt, rid)
        div = first_divergence(ref, probe.pd) if ref is not None else None
    return replace(
        probe,
        external_delta=ext1 - ext0 if ext1 is not None and ext0 is not None else None,
        nixl_delta=nixl1 - nixl0 if nixl1 is not None and nixl0 is not None else None,
        ref=ref,
        divergence=div,
        batch=batch,
    )


def probe_link(pair: Pair, sizes: Sequence[str]) -> tuple[list[Probe], int]:
    """Send one probe per size through the pair (re-run once on a tie); return them and decode's block size."""
    limit = _max_model_len(pair.http, pair.d)
    ext0, nixl0, block = _counters(pair.http, pair.d)
    block = block or pair.d.block_size or 16
    targets = {"short": 1, "typical": min(256, max(limit // 4, 2)), "long": max(limit - PROBE_MAX_TOKENS - 8, 2)}
    out: list[Probe] = []
    for size in sizes:
        rid = f"pdctl-verify-{pair.nonce}-{pair.p.index}-{pair.d.index}-{size}"
        prompt, n = probe_prompt(pair.http, pair.d, f"pdctl verify {pair.nonce} {size}.", size, targets[size])
        probe = _one_probe(pair, size, rid, prompt, n, ext0, nixl0)
        if probe.divergence is not None and probe.divergence.verdict == "tie":
            # A near-tie may break either way in another batch shape: one fresh prompt settles it.
            first = probe.divergence
            ext0, nixl0, _ = _counters(pair.http, pair.d)
            prompt, n = probe_prompt(pair.http, pair.d, f"pdctl verify {pair.nonce} {size} again.", size, targets[size])
            again = _one_probe(pair, size, rid + "-again", prompt, n, ext0, nixl0)
            probe = replace(again, request_ids=(rid, *again.request_ids), first_tie=first)
        if probe.divergence is not None:
            probe = replace(
                probe, token_texts=_detokenize(pair, [probe.divergence.ref_token, probe.divergence.pd_token])
            )
        ext0, nixl0, _ = _counters(pair.http, pair.d)
        out.append(probe)
    return out, block


# -------------------------------------------------------------------------------------------- judges


def judge_params(pair: Pair, probes: Sequence[Probe], probe_ms: float) -> CheckResult:
    """``kv_params``: every prefill leg returned usable kv_transfer_params (when the connector returns them)."""
    name = f"kv_params{pair.label}"
    errors = [f"{pr.size}: {pr.error}" for pr in probes if pr.error and pr.prefill_status != 200]
    if errors:
        return CheckResult(
            name, False, "; ".join(errors), probe_ms, "the prefill leg failed", f"`pdctl logs {pair.p.name}`"
        )
    if pair.kind == "shared_storage":
        return CheckResult(name, None, f"skipped: {pair.pc} returns no kv_transfer_params (shared storage)", probe_ms)
    bad = [f"{pr.size}: {pr.params_reason}" for pr in probes if not pr.params_usable]
    if bad:
        mismatch = connector_kind(pair.dc) != pair.kind
        cause = dg.connector_mismatch(pair.pc, pair.dc) if mismatch else dg.D_SILENT_PARAMS
        step = dg.NEXT_CONNECTOR if mismatch else dg.NEXT_PARAMS
        return CheckResult(name, False, "unusable params: " + ", ".join(bad), probe_ms, cause, step)
    return CheckResult(name, True, f"usable kv_transfer_params for {len(probes)} probe(s)", probe_ms)


def judge_metrics(pair: Pair, probes: Sequence[Probe], block: int, identity_ok: bool | None) -> CheckResult:
    """``kv_metrics``: decode counted about each prompt as external tokens (and NIXL moved, for NIXL)."""
    name = f"kv_metrics{pair.label}"
    timer = Timer()
    kind, pc = pair.kind, pair.pc
    if any(pr.external_delta is None for pr in probes):
        return CheckResult(name, None, "skipped: decode's /metrics has no prompt_tokens_by_source counter", timer.ms)
    parts, bad = [], []
    for pr in probes:
        delta = pr.external_delta or 0.0
        expect_min = pr.prompt_tokens - block if kind == "shared_storage" else pr.prompt_tokens * 0.9 - 1
        nixl = ""
        if pr.nixl_delta is not None and kind == "params" and pc.startswith("Nixl"):
            nixl = f", NIXL transfers +{pr.nixl_delta:g}"
        parts.append(f"{pr.size} {pr.prompt_tokens} tok: external +{delta:g}{nixl}")
        if pr.error:
            bad.append(f"{pr.size}: {pr.error}")
        elif kind == "shared_storage" and pr.prompt_tokens <= block:
            # Shorter than one block + 1 token: ExampleConnector stores and loads nothing.
            parts[-1] += f" (under one {block}-token block: nothing to transfer)"
        elif delta <= 0 or delta < expect_min:
            bad.append(f"{pr.size}: external tokens +{delta:g}, expected about {pr.prompt_tokens}")
        elif kind == "params" and pr.nixl_delta is not None and pr.nixl_delta <= 0 and pc.startswith("Nixl"):
            bad.append(f"{pr.size}: NIXL transfer counter did not move")
    if kind == "shared_storage" and all(pr.prompt_tokens <= block for pr in probes):
        return CheckResult(name, None, "skipped: every probe is under one block: " + "; ".join(parts), timer.ms)
    if not bad:
        return CheckResult(name, True, "; ".join(parts), timer.ms)
    if connector_kind(pair.dc) != connector_kind(pc):
        cause, step = dg.connector_mismatch(pc, pair.dc), dg.NEXT_CONNECTOR
    elif all(pr.error and pr.prefill_status != 200 for pr in probes):
        cause = f"no probe reached decode: the prefill leg failed ({probes[0].error})"
        step = f"see kv_params{pair.label}; `pdctl logs {pair.p.name}`"
    elif identity_ok is False and any(pr.error and pr.decode_status >= 500 for pr in probes):
        cause = "§5.4 decode refused prefill's KV: the two sides do not serve the same model (see identity)"
        step = dg.NEXT_GARBAGE
    elif any(pr.error and pr.decode_status >= 500 for pr in probes):
        cause = "§5.1 decode could not load the KV (handshake or transfer failed; the request failed)"
        step = dg.NEXT_TOKENS
    else:
        cause, step = dg.D_SILENT_TOKENS, dg.NEXT_TOKENS
    return CheckResult(name, False, "; ".join(bad) + " | " + "; ".join(parts), timer.ms, cause, step)


def judge_logs(pair: Pair, probes: Sequence[Probe], plines: list[str] | None, dlines: list[str] | None) -> CheckResult:
    """``kv_logs``: the lines written since verify started show the probes' load and no KV failure."""
    name = f"kv_logs{pair.label}"
    timer = Timer()
    if plines is None or dlines is None:
        return CheckResult(name, None, "skipped: no log files in the run directory (started by hand?)", timer.ms)
    pev = kvlog.scan(plines, pair.p.name, setup=False)
    dev = kvlog.scan(dlines, pair.d.name, setup=False)
    ids = [rid for pr in probes for rid in pr.request_ids]

    def tied(events: list[kvlog.KVEvent]) -> list[kvlog.KVEvent]:
        return [e for e in events if any(kvlog.request_matches(e.request_id, i) for i in ids)]

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
            dg.NEXT_TOKENS,
        )
        if any("hash mismatch" in e.line for e in fails):
            cause = (
                "§5.4 NIXL compatibility hash mismatch: the two sides differ in vLLM version, model string, "
                "dtype or attention backend"
            )
            step = dg.NEXT_GARBAGE
        detail = f"{len(fails)} KV failure line(s): {first.source}: {first.detail} | {shown}"
        return CheckResult(name, False, detail, timer.ms, cause, step, {"line": first.line[:300]})
    if counts["decode start_load_kv"] and counts["decode wait_for_layer_load"]:
        return CheckResult(name, True, shown + " (tied to the probes' request ids)", timer.ms)
    if any(untied.values()):
        extra = ", ".join(f"{k} {v}" for k, v in untied.items() if v)
        return CheckResult(name, True, f"{shown}; decode lines without request ids: {extra}", timer.ms)
    return CheckResult(
        name,
        None,
        f"skipped: no per-request KV lines at this log level ({shown}); "
        'set logging.log_kv_transfer = true in settings.json (or logging.level = "debug") and restart '
        "the workers for per-request evidence",
        timer.ms,
    )


def _nats(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def describe(div: Divergence, texts: Mapping[int, str]) -> str:
    """The first difference in words: position, both tokens (id and escaped text), the margins."""
    ref = show_token(div.ref_token, texts.get(div.ref_token) if div.ref_token is not None else None)
    pd = show_token(div.pd_token, texts.get(div.pd_token) if div.pd_token is not None else None)
    gap = "PD's token not in its top-5" if div.ref_gap is None else f"prefers its token by {_nats(div.ref_gap)}"
    return (
        f"first difference at output token {div.position}: reference {ref} (margin {_nats(div.ref_margin)} nats "
        f"over its runner-up; {gap}), PD {pd} (margin {_nats(div.pd_margin)})"
    )


def judge_correctness(pair: Pair, probes: Sequence[Probe], identity_ok: bool | None) -> CheckResult:
    """``kv_correctness``: PD's greedy tokens equal the colocated reference's; a difference is a tie or not."""
    name = f"kv_correctness{pair.label}"
    timer = Timer()
    compared, moved = 0, 0
    parts: list[str] = []
    bad: list[str] = []
    ties: list[str] = []
    for pr in probes:
        if pr.error or pr.pd is None:
            parts.append(f"{pr.size}: no PD output")
            continue
        if pr.ref is None:
            parts.append(f"{pr.size}: no reference")
            continue
        compared += 1
        if (pr.external_delta or 0) > 0:
            moved += 1
        rerun = f" (re-run after a tie: {describe(pr.first_tie, {})})" if pr.first_tie else ""
        div = pr.divergence
        if div is None:
            parts.append(f"{pr.size}: token ids identical{rerun}")
        elif div.verdict == "tie":
            ties.append(f"{pr.size}: {describe(div, pr.token_texts)}")
        else:
            bad.append(f"{pr.size}: {describe(div, pr.token_texts)}")
    data = {"probes": [pr.to_json() for pr in probes]}
    if compared == 0:
        return CheckResult(name, None, "skipped: " + "; ".join(parts), timer.ms, data=data)
    if bad:
        cause = dg.D_GARBAGE if identity_ok is False else dg.D_CORRUPT
        step = dg.NEXT_GARBAGE if identity_ok is False else dg.NEXT_CORRUPT
        return CheckResult(name, False, "; ".join(bad), timer.ms, cause, step, data)
    if ties:
        detail = (
            "inconclusive at a numerical tie, twice (both sides rank the two tokens within "
            f"{TIE_TOLERANCE_NATS:g} nats; not a failure): " + "; ".join(ties + parts)
        )
        return CheckResult(name, None, detail, timer.ms, data=data)
    if moved == 0:
        detail = "; ".join(parts) + " — but no KV moved, so this proves nothing about the link"
        return CheckResult(name, None, detail, timer.ms, data=data)
    return CheckResult(name, True, "; ".join(parts) + " (greedy, vs colocated reference)", timer.ms, data=data)
