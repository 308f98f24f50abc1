"""Claude Code's billing line under adaptive PD: the gateway's decisions before and after it renders the prompt as vLLM.

    .venv/bin/python -m benchmarks.agent_billing --before /tmp/pdctl-before      # that tree: a checkout before #49

One prefill and one decode simulator (``python -m pdctl.sim``, NixlConnector, the ``cpu-small`` profile; the
simulator drops the billing block before rendering, as vLLM 0.32 does), then per side a gateway with
``pd_mode = "adaptive"`` (``--view approx`` or ``exact``) over the same two workers: ``before`` runs the gateway of
another checkout (``--before``), ``after`` this one. Each side sends ``--sessions`` Claude-Code-shaped sessions of
``--turns`` turns through ``/v1/messages`` (tests/agent_corpus.py: system blocks with ``cache_control``, two long
tools, ``tool_use`` / ``tool_result`` turns, ``<system-reminder>`` blocks, the rolling breakpoint), with the billing
line as Claude Code sends it (a new ``cch`` every request) and, as the control, without it. Each side's sessions are
its own (a seed per side), so no side finds another's prompts cached.

Per side: paths of the later turns (2+), the gateway's cached tokens (its access log) against the prompt tokens, and
the decode's own prefix-cache hit rate over the side (``vllm:prefix_cache_hits`` / ``queries``). Prints a Markdown
table; only loopback and free ports.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks._harness import Proc, start_gateway_with
from benchmarks.adaptive_sweep import MODEL, start_worker
from pdctl.bench.engine_metrics import parse_metrics
from pdctl.testing import free_port
from tests.agent_corpus import claude_code

KEY = "agent-billing-key-not-secret"


def start_gateway(name: str, log_dir: str, prefill: str, decode: str, view: str, tree: str | None) -> Proc:
    port = free_port()
    settings = {
        "gateway": {"listen": f"127.0.0.1:{port}", "api_key_env": "PDCTL_API_KEY", "request_timeout_s": 600},
        "routing": {"prefill_endpoint": prefill, "decode_endpoint": decode, "strategy": "pd_disagg",
                    "kv_connector": "NixlConnector", "pd_mode": "adaptive", "prefix_view": "approx"},
        "slo": {"ttft_ms": 60000, "tpot_ms": 10000, "p90": True, "admission": False},
        "logging": {"level": "info"},
    }  # fmt: skip
    if view == "exact":
        settings["routing"]["prefix_view"] = "exact"  # type: ignore[index]
    return start_gateway_with(name, log_dir, port, settings, KEY, tree=tree)


def _hits(worker: Proc) -> tuple[float, float]:
    m = parse_metrics(httpx.get(worker.url + "/metrics", timeout=10).text)
    return m.get("vllm:prefix_cache_hits_total", 0.0), m.get("vllm:prefix_cache_queries_total", 0.0)


def run_side(
    gateway: Proc, decode: Proc, sessions: int, turns: int, billing: bool, seed: int, context: int
) -> dict[str, Any]:
    """Send the side's sessions turn by turn; its paths, the gateway's cached tokens and the decode's hits."""
    h0, q0 = _hits(decode)
    paths: list[str] = []
    with httpx.Client(base_url=gateway.url, timeout=600, headers={"x-api-key": KEY}) as http:
        for s in range(sessions):
            for k, body in enumerate(claude_code(turns, seed * 1000 + s, trailing_system=False, context_words=context)):
                body = {**body, "model": MODEL, "stream": False, "max_tokens": 8}
                if not billing:
                    body["system"] = body["system"][1:]
                rid = f"ab{seed}-{s}-{k}"
                r = http.post("/v1/messages", json=body,
                              headers={"x-claude-code-session-id": f"s{seed}-{s}", "x-request-id": rid})  # fmt: skip
                assert r.status_code == 200, r.text
                if k > 0:
                    paths.append(r.headers.get("x-pd-path", "?"))
    h1, q1 = _hits(decode)
    cached = prompt = 0
    for line in Path(gateway.log_path).read_text(errors="replace").splitlines():
        m = re.search(rf"request_id=ab{seed}-\d+-[1-9]\d* .*cached_tokens=(\d+) uncached_tokens=(\d+)", line)
        if m:  # later turns only
            cached += int(m[1])
            prompt += int(m[1]) + int(m[2])
    return {"local": paths.count("local"), "disagg": paths.count("disagg"), "later_turns": len(paths),
            "gateway_cached_share": cached / prompt if prompt else None,
            "decode_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else None}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", help="another checkout's tree (its gateway is the 'before' side)")
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--view", default="approx", choices=("approx", "exact"))
    p.add_argument("--context-words", type=int, default=1200, help="words of a file read into each first turn")
    p.add_argument("--out", type=Path, help="the rows as JSON")
    a = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="agent-billing-") as logs:
        prefill = start_worker("prefill", "kv_producer", logs, "cpu-small", 1.0, 1.0)
        decode = start_worker("decode", "kv_consumer", logs, "cpu-small", 1.0, 1.0)
        try:
            seed = 1
            for side, tree in (("before", a.before), ("after", None)):
                if side == "before" and not a.before:
                    continue
                for billing in (False, True):
                    gw = start_gateway(f"gw-{side}-{billing}", logs, prefill.url, decode.url, a.view, tree)
                    try:
                        seed += 1
                        row = run_side(gw, decode, a.sessions, a.turns, billing, seed, a.context_words)
                    finally:
                        gw.stop()
                    rows.append({"side": side, "view": a.view, "billing": billing, **row})
        finally:
            decode.stop()
            prefill.stop()
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2))
    print("| gateway | view | billing line | later turns: paths | gateway's cached share | decode's prefix hits |")
    print("|---|---|---|---|---:|---:|")
    for r in rows:
        share = "-" if r["gateway_cached_share"] is None else f"{r['gateway_cached_share']:.1%}"
        hits = "-" if r["decode_hit_rate"] is None else f"{r['decode_hit_rate']:.1%}"
        print(f"| {r['side']} | {r['view']} | {'yes' if r['billing'] else 'no'} | local {r['local']}, "
              f"disagg {r['disagg']} | {share} | {hits} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
