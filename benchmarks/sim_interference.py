"""Colocated vs PD on the simulator's H100 profile: do long prompts stall running streams? (docs/simulator.md)

Two clocks:

* ``--clock virtual`` (default): the simulator's engines in-process on a virtual clock
  (``pdctl.sim.experiment``): deterministic, seconds of CPU, independent of machine load.
* ``--clock wall``: real ``python -m pdctl.sim`` processes over HTTP with the two-leg protocol from
  pdctl.vllm.protocol; times are wall time × ``--speed`` and include Python/HTTP overhead and machine noise.

Both run the same workload against one colocated worker (the recipe's prefill batch settings, no chunked
prefill), a chunked-prefill worker (vLLM's default alternative) and a prefill + decode pair, and print
TTFT / TPOT / ITL percentiles of the short streams.

    .venv/bin/python -m benchmarks.sim_interference [--clock virtual|wall] [--long-len 8000] [--long-every 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks._harness import pct
from pdctl.testing import SimProcess, start_sim
from pdctl.vllm.protocol import build_decode_body, build_prefill_body, check_kv_params

MODEL = "Qwen/Qwen3-8B"


@dataclass
class Stream:
    """One short streamed request as the client saw it."""

    ttft_s: float
    latency_s: float
    chunk_times: list[float]

    @property
    def tpot_s(self) -> float | None:
        n = len(self.chunk_times)
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None


@dataclass
class Result:
    """Everything one mode measured."""

    mode: str
    streams: list[Stream] = field(default_factory=list)
    long_ttft_s: list[float] = field(default_factory=list)
    errors: int = 0


def _prompt(rng: random.Random, words: int) -> str:
    # Distinct words per request keep the prefix cache out of the comparison.
    # Letters only: the simulator's toy tokenizer makes each such word exactly one token.
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choices(letters, k=7)) for _ in range(words))


async def _post_leg1(client: httpx.AsyncClient, prefill: str, body: dict[str, Any]) -> dict[str, Any] | None:
    r = await client.post(prefill + "/v1/completions", json=build_prefill_body(body))
    r.raise_for_status()
    check = check_kv_params(r.json())
    return dict(check.params) if check.usable and check.params is not None else None


async def _stream_once(client: httpx.AsyncClient, target: str, prefill: str | None, body: dict[str, Any]) -> Stream:
    t0 = time.perf_counter()
    if prefill is not None:
        body = build_decode_body(body, await _post_leg1(client, prefill, body))
    times: list[float] = []
    async with client.stream("POST", target + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"choices":[{' in line:
                times.append(time.perf_counter())
    end = time.perf_counter()
    return Stream(times[0] - t0, end - t0, times)


async def _short_loop(
    client: httpx.AsyncClient, target: str, prefill: str | None, stop_at: float, res: Result, seed: int, out_len: int
) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < stop_at:
        body = {"model": MODEL, "prompt": _prompt(rng, 200), "max_tokens": out_len, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        try:
            res.streams.append(await _stream_once(client, target, prefill, body))
        except httpx.HTTPError:
            res.errors += 1


async def _long_loop(
    client: httpx.AsyncClient, target: str, prefill: str | None, stop_at: float, res: Result, every_s: float,
    long_len: int,
) -> None:  # fmt: skip
    rng = random.Random(99)
    tasks = []

    async def one() -> None:
        body = {"model": MODEL, "prompt": _prompt(rng, long_len), "max_tokens": 8, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        try:
            res.long_ttft_s.append((await _stream_once(client, target, prefill, body)).ttft_s)
        except httpx.HTTPError:
            res.errors += 1

    await asyncio.sleep(every_s / 2)
    while time.perf_counter() < stop_at:
        tasks.append(asyncio.ensure_future(one()))
        await asyncio.sleep(every_s)
    await asyncio.gather(*tasks)


async def _run_mode(mode: str, target: str, prefill: str | None, args: argparse.Namespace) -> Result:
    res = Result(mode)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        stop_at = time.perf_counter() + args.duration
        jobs = [_short_loop(client, target, prefill, stop_at, res, i, args.out_len) for i in range(args.streams)]
        if args.long_every > 0:
            jobs.append(_long_loop(client, target, prefill, stop_at, res, args.long_every, args.long_len))
        await asyncio.gather(*jobs)
    return res


def summarize(res: Result, speed: float) -> dict[str, Any]:
    """Percentiles in simulated milliseconds."""
    ms = 1000.0 * speed
    tpot = [s.tpot_s * ms for s in res.streams if s.tpot_s is not None]
    ttft = [s.ttft_s * ms for s in res.streams]
    itl = [(b - a) * ms for s in res.streams for a, b in itertools.pairwise(s.chunk_times)]
    longt = [t * ms for t in res.long_ttft_s]
    return {
        "mode": res.mode,
        "short_requests": len(res.streams),
        "long_requests": len(res.long_ttft_s),
        "errors": res.errors,
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90)},
        "tpot_ms": {
            "p50": pct(tpot, 50),
            "p90": pct(tpot, 90),
            "max": max(tpot, default=float("nan")),
        },
        "itl_ms": {
            "p50": pct(itl, 50),
            "p90": pct(itl, 90),
            "p99": pct(itl, 99),
        },
        "long_ttft_ms": {
            "p50": pct(longt, 50),
            "p90": pct(longt, 90),
        },
        "mean_tpot_ms": statistics.fmean(tpot) if tpot else float("nan"),
    }


def _virtual(args: argparse.Namespace) -> int:
    from pdctl.sim.experiment import Workload, run_mode

    wl = Workload(streams=args.streams, out_len=args.out_len, long_prompt=args.long_len,
                  long_every_s=args.long_every, duration_s=args.duration)  # fmt: skip
    out = []
    for mode in args.modes.split(","):
        s = run_mode(mode, wl, args.profile, args.link).summary()
        s.update(profile=args.profile, link=args.link, clock="virtual", streams=args.streams,
                 long_len=args.long_len, long_every_s=args.long_every, duration_s=args.duration)  # fmt: skip
        out.append(s)
        print(json.dumps(s), flush=True)
    return _report(out, args.json)


def _report(out: list[dict[str, Any]], json_path: str | None) -> int:
    """The summary table on stdout, and every mode's summary as JSON when asked."""
    print(
        f"{'mode':10} {'TPOT p50':>9} {'TPOT p90':>9} {'ITL p90':>9} {'ITL p99':>9} {'TTFT p50':>9} {'long TTFT p50':>14}"
    )
    for s in out:
        print(f"{s['mode']:10} {s['tpot_ms']['p50']:9.1f} {s['tpot_ms']['p90']:9.1f} {s['itl_ms']['p90']:9.1f} "
              f"{s['itl_ms']['p99']:9.1f} {s['ttft_ms']['p50']:9.1f} {s['long_ttft_ms']['p50']:14.1f}")  # fmt: skip
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per mode")
    ap.add_argument("--streams", type=int, default=16, help="concurrent short streams")
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--long-len", type=int, default=8000, help="tokens of each long prompt")
    ap.add_argument("--long-every", type=float, default=0.25, help="simulated seconds between long prompts (0: none)")
    ap.add_argument("--link", default="rdma-400g")
    ap.add_argument("--modes", default="colocated,chunked,pd", help="any of colocated, chunked, pd")
    ap.add_argument("--json", default=None)
    ap.add_argument("--clock", choices=["virtual", "wall"], default="virtual")
    args = ap.parse_args(argv)
    if args.clock == "virtual":
        return _virtual(args)
    args.long_every = args.long_every / args.speed
    common = ["--sim-profile", args.profile, "--sim-speed", str(args.speed), "--sim-kv-scale", "0.0005",
              "--sim-link", args.link, "--max-model-len", "8192"]  # fmt: skip
    recipe_prefill = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "8", "--no-enable-chunked-prefill"]
    recipe_decode = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.9"]
    # A single GPU running the recipe's prefill batch settings, with room for the decode streams.
    colocated = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "64", "--no-enable-chunked-prefill"]
    # vLLM's default alternative: chunked prefill with a small token budget per step (Sarathi-style).
    chunked = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "64", "--enable-chunked-prefill"]
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as logs:
        for mode in args.modes.split(","):
            procs: list[SimProcess] = []
            try:
                if mode == "colocated":
                    w = start_sim(common + colocated, logs, name="colo", model=MODEL, connector=None)
                    procs.append(w)
                    res = asyncio.run(_run_mode(mode, w.url, None, args))
                elif mode == "chunked":
                    w = start_sim(common + chunked, logs, name="chunked", model=MODEL, connector=None)
                    procs.append(w)
                    res = asyncio.run(_run_mode(mode, w.url, None, args))
                elif mode == "pd":
                    p = start_sim(common + recipe_prefill, logs, name="p", model=MODEL, role="kv_producer")
                    procs.append(p)
                    d = start_sim(common + recipe_decode, logs, name="d", model=MODEL, role="kv_consumer")
                    procs.append(d)
                    res = asyncio.run(_run_mode(mode, d.url, p.url, args))
                else:
                    raise SystemExit(f"unknown mode {mode!r}")
            finally:
                for sp in procs:
                    with contextlib.suppress(Exception):
                        sp.stop()
            summary = summarize(res, args.speed)
            summary.update(profile=args.profile, link=args.link, speed=args.speed, streams=args.streams,
                           long_len=args.long_len, long_every_s=args.long_every * args.speed)  # fmt: skip
            out.append(summary)
            print(json.dumps(summary), flush=True)
    return _report(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
