"""xPyD routing policies at scale on the simulator: pdctl's per-pool policies and vllm-router in front of the same
simulated workers.

    .venv/bin/python -m benchmarks.xpyd_scale                                   # 4P4D, every arm, two rates
    .venv/bin/python -m benchmarks.xpyd_scale --pools 8x8 --arms least_loaded,kv_aware --rates 12

Per arm and rate: NP prefill and ND decode simulators started afresh (``python -m pdctl.sim``, NixlConnector, a GPU
timing profile, ``--sim-speed`` below 1 so the 2-core machine paces them, the prefix cache capped by
``--num-gpu-blocks-override``, KV cache events published to one port), one router in front of them, then
``pdctl bench`` with one workload (``--workload``): ``shared-prefix`` (SGLang's generated shared prefix: groups of
prompts behind one system prompt, shuffled; the groups' system prompts together hold more blocks than the pool's
prefix caches, so eviction matters and routing decides the hit rate), ``agent`` (multi-turn conversations, each turn
re-sending its history, over chat), ``claude-code`` / ``codex`` (sessions shaped like those clients' requests, over
``/v1/messages`` / ``/v1/responses``: ``pdctl bench -w claude-code``) or ``mixed`` (the recipe's mix: 128-token chats
and 10 % 4,096-token prompts).
Arms:

- ``pdctl:<prefill policy>/<decode policy>[+adaptive][+exact][+workers=N][+<routing key>=<JSON>]``:
  ``pdctl gateway`` with ``routing.prefill_policy`` and ``decode_policy`` (``kv_aware`` with
  ``prefix_view = "exact"``, the workers' events); ``+adaptive``: ``routing.pd_mode = "adaptive"`` (a request whose
  prompt the chosen decode mostly holds is served there alone); ``+exact``: ``prefix_view = "exact"`` for the other
  policies too (the gateway then reads a config.toml naming the workers' model as the simulator's, whose
  tokenizer gives the prompts' exact token ids); ``+workers=N``: ``gateway.workers = N`` processes, each with its
  own prefix view and load counts;
  any other ``+key=value``: that ``routing`` key (``+balance_abs_threshold=4``);
- ``vllm-router:<prefill policy>/<decode policy>``: vllm-router (PyPI) ``--vllm-pd-disaggregation`` with
  ``--prefill-policy`` and ``--decode-policy``.

Reports per arm and rate: TTFT p50/p90, ITL p99, output tokens/s, requests failed, the prefill and decode pools'
prefix-cache hit rates (``vllm:prefix_cache_hits`` over ``queries``, summed over the pool) and, for conversations,
how often a later turn landed on the decode that served its session's previous turn (the one holding its history). Writes the runs' JSON
(``--out``) and prints a Markdown table. Only loopback and free ports.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks._harness import (
    PY,
    ROOT,
    Proc,
    fmt,
    md_table,
    pct_cell,
    run_pdctl_bench,
    start,
    start_gateway_with,
    start_nixl_sim,
)
from pdctl.sim.timing import PROFILES
from pdctl.testing import free_port

KEY = "xpyd-scale-key-not-secret"
MODEL = "sim-model"
ARMS = (
    "pdctl:least_loaded/least_loaded",
    "pdctl:round_robin/round_robin",
    "pdctl:power_of_two/power_of_two",
    "pdctl:cache_aware/power_of_two",
    "pdctl:cache_aware/cache_aware",
    "pdctl:kv_aware/kv_aware",
    "pdctl:kv_aware/power_of_two",
    "vllm-router:cache_aware/power_of_two",
    "vllm-router:round_robin/round_robin",
)


def start_workers(
    n_prefill: int, n_decode: int, log_dir: str, args: argparse.Namespace, events_port: int
) -> tuple[list[Proc], list[Proc]]:
    """The pool: prefill and decode simulators, each publishing its KV cache events to ``events_port``."""
    pools: tuple[list[Proc], list[Proc]] = ([], [])
    for pool, role, n in ((pools[0], "kv_producer", n_prefill), (pools[1], "kv_consumer", n_decode)):
        for i in range(n):
            name = f"{'prefill' if role == 'kv_producer' else 'decode'}-{i}"
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://127.0.0.1:{events_port}", "topic": name}  # fmt: skip
            flags = [
                "--kv-events-config", json.dumps(events), "--sim-profile", args.profile,
                "--sim-speed", repr(args.speed), "--sim-kv-scale", repr(args.kv_scale), "--max-model-len", "8192",
                "--num-gpu-blocks-override", str(args.cache_blocks), "--max-num-seqs", str(args.max_num_seqs),
            ]  # fmt: skip
            pool.append(start_nixl_sim(name, role, log_dir, MODEL, flags))
    return pools


def parse_arm(arm: str) -> tuple[str, str, str, dict[str, str]]:
    """``kind:prefill/decode+opt+key=value`` -> (kind, prefill policy, decode policy, options)."""
    kind, _, rest = arm.partition(":")
    policies, *opts = rest.split("+")
    p_policy, _, d_policy = policies.partition("/")
    options = {o.partition("=")[0]: o.partition("=")[2] for o in opts}
    return kind, p_policy, d_policy, options


def start_router(arm: str, log_dir: str, prefill: Sequence[Proc], decode: Sequence[Proc], events_port: int) -> Proc:
    """``arm``'s router in front of the pool."""
    kind, p_policy, d_policy, options = parse_arm(arm)
    port = free_port()
    name = arm.replace(":", "-").replace("/", "-").replace("+", "-").replace("=", "")
    if kind == "vllm-router":
        exe = Path(PY).with_name("vllm-router")
        if not exe.exists():
            found = shutil.which("vllm-router")
            if found is None:
                raise RuntimeError("vllm-router is not installed: .venv/bin/pip install vllm-router")
            exe = Path(found)
        argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port()), "--log-level", "warning", "--vllm-pd-disaggregation",
                "--prefill-policy", p_policy, "--decode-policy", d_policy]  # fmt: skip
        for p in prefill:
            argv += ["--prefill", p.url]
        for d in decode:
            argv += ["--decode", d.url]
        return start(name, argv, port, log_dir, ready_path="/health", ready_timeout_s=120)
    routing: dict[str, Any] = {
        "prefill_endpoint": [p.url for p in prefill], "decode_endpoint": [d.url for d in decode],
        "strategy": "pd_disagg", "kv_connector": "NixlConnector", "prefill_policy": p_policy,
        "decode_policy": d_policy,
    }  # fmt: skip
    if "kv_aware" in (p_policy, d_policy) or "exact" in options:
        routing.update(prefix_view="exact", kv_events_port=events_port)
    if "adaptive" in options:
        routing.update(pd_mode="adaptive")
    routing.update({k: json.loads(v) for k, v in options.items() if k not in ("adaptive", "exact", "workers")})
    gateway = {"listen": f"127.0.0.1:{port}", "api_key_env": "PDCTL_API_KEY", "request_timeout_s": 600,
               "workers": int(options.get("workers") or 1)}  # fmt: skip
    settings = {
        "gateway": gateway,
        "routing": routing,
        "slo": {"ttft_ms": 60000, "tpot_ms": 10000, "p90": True, "admission": False},
        "logging": {"level": "warning", "log_kv_transfer": False},
    }
    extra: list[str] = []
    if routing.get("prefix_view") == "exact":  # the exact view needs the prompts' token ids: the simulator's model
        config = Path(log_dir) / f"{name}.config.toml"
        config.write_text("".join(
            f'[[{role}]]\nmodel = "{MODEL}"\nengine = "sim"\n\n'
            for role, pool in (("prefill", prefill), ("decode", decode)) for _ in pool
        ))  # fmt: skip
        extra += ["-c", str(config)]
    return start_gateway_with(name, log_dir, port, settings, KEY, extra=extra)


def workload(args: argparse.Namespace) -> list[str]:
    """``pdctl bench``'s workload flags for ``--workload``."""
    if args.workload == "agent":
        return ["--endpoint", "chat", "-w", "agent", "--conversations", str(args.conversations), "--turns",
                args.turns, "--system-len", str(args.agent_system_len), "--context-len", str(args.context_len),
                "--answer-len", args.answer_len]  # fmt: skip
    if args.workload in ("claude-code", "codex"):
        return ["-w", args.workload, "--conversations", str(args.conversations), "--turns", args.turns,
                "--answer-len", args.answer_len, "--user-len", "60"]  # fmt: skip
    if args.workload == "mixed":
        return ["--endpoint", "completions", "-w", "mixed"]
    return ["--endpoint", "completions", "-w", "shared-prefix", "--groups", str(args.groups),
            "--prompts-per-group", str(args.prompts_per_group), "--system-len", str(args.system_len),
            "--question-len", str(args.question_len), "--output-len", str(args.output_len)]  # fmt: skip


def bench(url: str, workers: Sequence[Proc], rate: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``pdctl bench`` run of ``--workload`` against ``url``."""
    conversational = args.workload in ("agent", "claude-code", "codex")
    count = [] if conversational else ["-n", str(args.requests)]  # conversations x turns
    flags = ["--gateway", url, "--model", MODEL, *workload(args), "--rate", rate, *count, "--warmup", "8",
             "--seed", str(args.seed), "--timeout", "600", "--no-progress", "--no-slo"]  # fmt: skip
    for w in workers:
        flags += ["--metrics-url", f"{w.url}/metrics"]
    return run_pdctl_bench(flags, KEY, out, timeout_s=1800)


def queue_rules(arm: str, url: str) -> dict[str, int] | None:
    """A pdctl arm's requests per prefill-queue rule (``pdctl_prefill_queue_wait_seconds_count``), None for others."""
    if not arm.startswith("pdctl:"):
        return None
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    found = re.findall(r'^pdctl_prefill_queue_wait_seconds_count\{rule="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {rule: int(float(n)) for rule, n in found} or None


def _hit_rate(caches: dict[str, dict[str, float]], urls: Sequence[str]) -> float | None:
    mine = [v for k, v in caches.items() if any(k.startswith(u) for u in urls)]
    queries = sum(v.get("queries", 0.0) for v in mine)
    return sum(v.get("hits", 0.0) for v in mine) / queries if queries else None


def sticky(run: dict[str, Any]) -> tuple[int, int] | None:
    """Of a conversational run's later turns, how many went to the decode of their session's previous turn, and how
    many there were (None: not conversations)."""
    reqs = run.get("pdctl", {}).get("requests", {})
    if "conversation" not in reqs:
        return None
    last: dict[Any, tuple[int, str]] = {}
    same = later = 0
    for conv, turn, decode in sorted(zip(reqs["conversation"], reqs["turn"], reqs["pd_decode"], strict=True),
                                     key=lambda x: (str(x[0]), x[1] or 0)):  # fmt: skip
        prev = last.get(conv)
        if prev is not None and decode:
            later += 1
            same += decode == prev[1]
        if decode:
            last[conv] = (turn or 0, decode)
    return same, later


def row(arm: str, rate: str, run: dict[str, Any], prefill: Sequence[Proc], decode: Sequence[Proc]) -> dict[str, Any]:
    """The numbers of one run."""
    caches = run.get("pdctl", {}).get("prefix_cache", {})
    return {
        "arm": arm,
        "rate": rate,
        "completed": run.get("completed"),
        "failed": run.get("failed"),
        "ttft_p50_ms": run.get("median_ttft_ms"),
        "ttft_p90_ms": run.get("p90_ttft_ms"),
        "itl_p99_ms": run.get("p99_itl_ms"),
        "output_tok_s": run.get("output_throughput"),
        "request_s": run.get("request_throughput"),
        "prefill_hit_rate": _hit_rate(caches, [p.url for p in prefill]),
        "decode_hit_rate": _hit_rate(caches, [d.url for d in decode]),
        "sticky": sticky(run),
    }


def markdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    columns = ("rate (req/s)", "arm (prefill / decode policy)", "TTFT p50 / p90 (ms)", "ITL p99 (ms)", "output tok/s",
               "req/s", "failed", "prefix-cache hits: prefill / decode")  # fmt: skip

    def cells(r: dict[str, Any]) -> list[str]:
        hits = f"{pct_cell(r['prefill_hit_rate'])} / {pct_cell(r['decode_hit_rate'])}"
        return [str(r["rate"]), r["arm"],
                f"{fmt(r['ttft_p50_ms'], 0, grouped=True)} / {fmt(r['ttft_p90_ms'], 0, grouped=True)}",
                fmt(r["itl_p99_ms"], 1, grouped=True), fmt(r["output_tok_s"], 0, grouped=True),
                fmt(r["request_s"], 2, grouped=True), str(r["failed"]),
                hits + (f"; queue: {r['queue_rules']}" if r.get("queue_rules") else "")
                + (f"; later turns on their session's decode: {r['sticky'][0]} of {r['sticky'][1]}"
                   if r.get("sticky") else "")]  # fmt: skip

    return md_table(columns, "rllrrrrl", (cells(r) for r in rows))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--pools", default="4x4", help="prefill x decode simulators, e.g. 4x4,8x8")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms (module docstring)")
    p.add_argument("--rates", default="4,8", help="request rates (req/s), headroom first, e.g. 4,8")
    p.add_argument("--profile", default="h100", choices=sorted(PROFILES), help="the simulator's timing profile")
    p.add_argument("--speed", type=float, default=0.1, help="--sim-speed (0.1: ten times slower than the GPU)")
    p.add_argument("--kv-scale", type=float, default=0.0005,
                   help="--sim-kv-scale: the bytes really moved per KV handoff (timing stays the profile's)")  # fmt: skip
    p.add_argument("--cache-blocks", type=int, default=512, help="each worker's prefix cache, in 16-token blocks")
    p.add_argument("--max-num-seqs", type=int, default=64, help="each worker's --max-num-seqs")
    p.add_argument("--workload", default="shared-prefix",
                   choices=("shared-prefix", "agent", "claude-code", "codex", "mixed"))  # fmt: skip
    p.add_argument("--groups", type=int, default=24, help="shared-prefix groups (system prompts)")
    p.add_argument("--prompts-per-group", type=int, default=16)
    p.add_argument("--system-len", type=int, default=2048, help="tokens per system prompt")
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--conversations", type=int, default=48, help="agent: conversations")
    p.add_argument("--turns", default="6:9", help="agent: requests per conversation, N or MIN:MAX")
    p.add_argument("--agent-system-len", type=int, default=500, help="agent: the shared system prompt's tokens")
    p.add_argument("--context-len", type=int, default=3000, help="agent: mean context tokens per conversation")
    p.add_argument("--answer-len", default="16:32", help="agent: answer tokens, N or MIN:MAX")
    p.add_argument("--requests", type=int, default=192, help="requests per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "xpyd_scale.json"))
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if parse_arm(a)[0] not in ("pdctl", "vllm-router") or "/" not in a]
    if unknown:
        p.error(f"unknown arms {unknown}: use pdctl:PREFILL/DECODE or vllm-router:PREFILL/DECODE")
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for pools in args.pools.split(","):
        n_p, _, n_d = pools.partition("x")
        for rate in args.rates.split(","):
            for arm in arms:
                with tempfile.TemporaryDirectory(prefix="xpyd-") as logs:
                    events = free_port()
                    prefill, decode = start_workers(int(n_p), int(n_d), logs, args, events)
                    router: Proc | None = None
                    try:
                        router = start_router(arm, logs, prefill, decode, events)
                        run = bench(router.url, [*prefill, *decode], rate, args, Path(logs) / "bench.json")
                        rules = queue_rules(arm, router.url)
                    finally:
                        for proc in [*([router] if router else []), *prefill, *decode]:
                            proc.stop()
                label = f"{pools} {arm}"
                rows.append(row(label, rate, run, prefill, decode) | ({"queue_rules": rules} if rules else {}))
                runs.append({"pools": pools, "arm": arm, "rate": rate, "run": run})
                print(markdown(rows[-1:])[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"started": started, "args": vars(args), "rows": rows, "runs": runs}, indent=2))
    print(f"\n{started}; {out}\n")
    print("\n".join(markdown(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
