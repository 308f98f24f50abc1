"""``pdctl verify``: the recipe's test requests, plus proof that the KV really moved and arrived intact.

Checks, in order (each a :class:`CheckResult`; ``ok`` is ``None`` when skipped), and where they live::

    gateway_checks.py
      gateway                 the gateway answers /health
      workers                 every prefill/decode instance answers /health
      chat                    the recipe's non-stream chat through the gateway, with the key
      stream                  the recipe's stream: SSE chunks, [DONE], TTFT and TPOT against the SLOs
      auth                    no key / a wrong key -> 401 in OpenAI's error shape
      gateway_pd_path         the gateway ran both legs (x-pd-path: disagg; under pd_mode adaptive, local or disagg)
    adaptive.py, under routing.pd_mode = "adaptive":
      adaptive_decision       a short fresh probe served by decode alone, a long one on both legs, both
                              token-identical to the colocated reference
    agent.py, under routing.strategy = "pd_disagg":
      agent_session           two turns of a Claude-Code-shaped /v1/messages session (a new billing line each):
                              turn 2 local on turn 1's decode (adaptive), the decode's prefix-cache hits rise
    link.py, per prefill->decode pair, with unique short / typical / long probe prompts:
      identity[p->d]          same model id and root, max_model_len, vLLM version, connector, /tokenize
      kv_params[p->d]         leg 1 returned usable kv_transfer_params (connectors that return them)
      kv_metrics[p->d]        decode's external_kv_transfer prompt tokens rose by about the prompt; NIXL moved
      kv_logs[p->d]           the logs show the load (in the recipe's vocabulary) and no KV failure
      kv_correctness[p->d]    greedy PD tokens == a colocated reference on decode (fresh cache_salt), each run
                              alone on its worker; a difference judged by top-k logprobs (proof.py): a
                              numerical tie is re-run once, a clear margin is corruption
    gateway_checks.py
      compare_colocated       (optional) the stream's TTFT through PD and through one worker

``diagnoses.py`` holds every failure's likely ``cause`` and ``next_step`` (the recipe's §5), ``report.py``
the result types, ``wire.py`` the HTTP, SSE and /metrics reading. A missed SLO is reported in the detail,
never a failure: the SLOs are targets for tuned GPUs, and verify runs on any machine. The core never prints;
``pdctl/cli/verify_cmd.py`` renders the report.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from pdctl.config import Deployment
from pdctl.verify import gateway_checks as gw
from pdctl.verify import link
from pdctl.verify.adaptive import check_adaptive
from pdctl.verify.agent import check_agent
from pdctl.verify.gateway_checks import CHAT_PROMPT, STREAM_PROMPT, Target
from pdctl.verify.report import CheckResult, Timer, VerifyReport
from pdctl.verify.wire import Http, metric_total

__all__ = [
    "CHAT_PROMPT",
    "STREAM_PROMPT",
    "CheckResult",
    "VerifyReport",
    "metric_total",
    "run_verify",
]


class _LogTail:
    """Each worker's log from where it ended when verify started (the lines verify's requests caused)."""

    def __init__(self, logs_dir: Path | None, names: Sequence[str]) -> None:
        self.logs_dir = logs_dir
        self.offsets: dict[str, int] = {}
        for name in names:
            try:
                if logs_dir is not None:
                    self.offsets[name] = (logs_dir / f"{name}.log").stat().st_size
            except OSError:
                continue

    def lines(self, name: str) -> list[str] | None:
        """The new lines of ``name``'s log (None without a log file)."""
        if self.logs_dir is None or name not in self.offsets:
            return None
        try:
            with (self.logs_dir / f"{name}.log").open("rb") as fh:
                fh.seek(self.offsets[name])
                data = fh.read()
        except OSError:
            return None
        return data.decode("utf-8", errors="replace").split("\n")


def _check_pairs(
    t: Target, worker_up: Mapping[str, bool], tail: _LogTail, nonce: str, sizes: Sequence[str]
) -> list[CheckResult]:
    out: list[CheckResult] = []
    for p in t.dep.prefill:
        for d in t.dep.decode:
            label = f"[{p.name}->{d.name}]"
            if not (worker_up.get(p.name) and worker_up.get(d.name)):
                dead = p if not worker_up.get(p.name) else d
                out += [
                    CheckResult(f"{n}{label}", None, f"skipped: {dead.name} is not answering")
                    for n in ("identity", "kv_params", "kv_metrics", "kv_logs", "kv_correctness")
                ]
                continue
            pc = link.connector_from_logs(t.logs_dir, p) or t.dep.connector_for(p)
            dc = link.connector_from_logs(t.logs_dir, d) or t.dep.connector_for(d)
            pair = link.Pair(t.http, p, d, pc, dc, nonce)
            identity = link.check_identity(pair)
            timer = Timer()
            probes, block = link.probe_link(pair, sizes)
            out += [
                identity,
                link.judge_params(pair, probes, timer.ms),
                link.judge_metrics(pair, probes, block, identity.ok),
                link.judge_logs(pair, probes, tail.lines(p.name), tail.lines(d.name)),
                link.judge_correctness(pair, probes, identity.ok),
            ]
    return out


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
        t = Target(dep, Http(http_client, timeout_s), (gateway_url or dep.gateway.url).rstrip("/"), api_key, logs_dir)
        tail = _LogTail(logs_dir, [w.name for w in dep.workers])
        gateway, gateway_up = gw.check_gateway(t)
        workers, worker_up = gw.check_workers(t)
        results = [gateway, workers]
        if not (gateway_up or any(worker_up.values())):
            return VerifyReport(tuple(results), reachable=False)
        stream_ttft: float | None = None
        headers_seen: list[tuple[str, Mapping[str, str]]] = []
        if gateway_up:
            chat, chat_headers = gw.check_chat(t, worker_up)
            stream, streamed = gw.check_stream(t, worker_up)
            results += [chat, stream, gw.check_auth(t)]
            headers_seen += [("chat", chat_headers)] if chat_headers is not None else []
            headers_seen += [("stream", streamed.headers)] if streamed is not None else []
            stream_ttft = streamed.ttft_ms if streamed is not None else None
        else:
            results += [
                CheckResult(n, None, "skipped: the gateway is not reachable") for n in ("chat", "stream", "auth")
            ]
        results.append(gw.check_gateway_path(dep.routing, headers_seen))
        if gateway_up and dep.routing.pd_mode == "adaptive" and dep.routing.strategy == "pd_disagg":
            results.append(check_adaptive(t))
        if gateway_up and dep.routing.strategy == "pd_disagg":
            results.append(check_agent(t))
        results += _check_pairs(t, worker_up, tail, uuid.uuid4().hex[:8], probes)
        if compare_colocated:
            results.append(gw.check_compare_colocated(t, stream_ttft, bool(worker_up.get(dep.decode[0].name))))
    finally:
        if own:
            http_client.close()
    return VerifyReport(tuple(results))
