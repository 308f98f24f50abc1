"""`pdctl advise` against the simulator: does the model's capacity, attainment and verdict match measured runs?

    .venv/bin/python -m benchmarks.advise_check                      # both workloads, both SLO pairs (~3 min)
    .venv/bin/python -m benchmarks.advise_check --workloads recipe --slos 400/40 --scale 0.5

Everything runs in virtual time (``pdctl.sim.virtual``): the simulator's engines in one process on a virtual
clock, the h100 profile, KV over ``rdma-400g`` (the real side channel between engines), so the numbers are the
timing model's and not this machine's. Steps:

1. measure the profile of a 1P1D pair with ``pdctl profile``'s own probe schedule
   (:func:`pdctl.capacity.measure.measure`, prompts up to 8,000 tokens, 1-64 streams at two contexts);
2. per workload and SLO: ``advise`` at the target rate (:func:`pdctl.capacity.model.size_for_rate`);
3. run the advised configuration at its predicted capacity, then up (x1.1, 1.25, 1.5, 2) while it meets the SLO
   or down (x0.9 ... 0.5) until it does (open-loop Poisson arrivals, least in-flight routing for each leg): the
   measured capacity lies between the highest passing and the lowest failing rate;
4. run every xPyD split and every colocated count up to the advised engines + 1 at the target rate: the
   cheapest configuration meeting the SLO, and whether it is colocated or P/D.

Engines: prefill ``max_num_batched_tokens 8192``, ``max_num_seqs 8``, no chunked prefill; decode 2048 / 64;
colocated 8192 / 64, no chunked prefill (the recipe's settings). Prints Markdown; ``--out`` writes the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl.bench.metrics import percentile
from pdctl.capacity import model as m
from pdctl.capacity.measure import ProbeResult, Schedule, measure
from pdctl.capacity.profile import DeploymentProfile
from pdctl.sim.engine import EngineConfig, KVSettings, SimEngine, SimRequest
from pdctl.sim.experiment import token_times
from pdctl.sim.logfmt import VllmLog
from pdctl.sim.text import VOCAB_SIZE
from pdctl.sim.timing import get_link, get_profile
from pdctl.sim.virtual import run_virtual
from pdctl.vllm.protocol import PREFILL_REQUEST_PARAMS, check_kv_params

PROFILE, LINK = "h100", "rdma-400g"
WORKLOADS: dict[str, tuple[str, str, float, float]] = {
    # name: (ISL histogram, OSL histogram, target requests/s, simulated seconds per run)
    "recipe": ("128:0.9 4096:0.1", "128:0.9 8:0.1", 30.0, 15.0),  # `pdctl bench -w mixed`: 10 % long prompts
    "long": ("4000:0.5 8000:0.5", "64", 3.0, 45.0),
}
SLOS = {"400/40": m.Slo(0.4, 0.04), "1000/8": m.Slo(1.0, 0.008)}


def _config(role: str, batched: int, seqs: int) -> EngineConfig:
    kv = KVSettings()
    if role in ("kv_producer", "kv_consumer"):
        kv = KVSettings(connector="NixlConnector", role=role, side_port=0)
    return EngineConfig(
        model="Qwen/Qwen3-8B", served_model_name="Qwen/Qwen3-8B", profile=get_profile(PROFILE), link=get_link(LINK),
        kv_scale=0.0002, max_model_len=8192 + 256, max_num_batched_tokens=batched, max_num_seqs=seqs,
        enable_chunked_prefill=False, kv=kv,
    )  # fmt: skip


@dataclass
class Pool:
    """Engines of one role and their in-flight counts (least in-flight routing)."""

    engines: list[SimEngine]
    load: list[int]

    def pick(self) -> int:
        return min(range(len(self.engines)), key=lambda i: self.load[i])


class Cluster:
    """``prefill`` + ``decode`` engines (P/D), or ``decode`` colocated engines when ``prefill`` is 0."""

    def __init__(self, prefill: int, decode: int) -> None:
        log = VllmLog(level="ERROR")
        self.pd = prefill > 0
        if self.pd:
            self.p = Pool([SimEngine(_config("kv_producer", 8192, 8), log=log) for _ in range(prefill)], [0] * prefill)
            self.d = Pool([SimEngine(_config("kv_consumer", 2048, 64), log=log) for _ in range(decode)], [0] * decode)
        else:
            self.p = Pool([], [])
            self.d = Pool([SimEngine(_config("none", 8192, 64), log=log) for _ in range(decode)], [0] * decode)
        self.counter = itertools.count()

    async def start(self) -> None:
        for e in self.p.engines + self.d.engines:
            await e.start()

    async def stop(self) -> None:
        for e in self.p.engines + self.d.engines:
            await e.stop()

    async def serve(self, ids: list[int], max_tokens: int) -> tuple[float, float | None, list[float]] | None:
        """(send time, prefill leg end, token times) on the loop's clock; None when a leg failed."""
        loop = asyncio.get_running_loop()
        rid = f"cmpl-{next(self.counter)}-0-sim"
        t0 = loop.time()
        params, leg = None, None
        if self.pd:
            i = self.p.pick()
            self.p.load[i] += 1
            leg1 = SimRequest(rid + "p", ids, 1, temperature=0, kv_params=dict(PREFILL_REQUEST_PARAMS))
            try:
                _, err = await token_times(self.p.engines[i], leg1)
            finally:
                self.p.load[i] -= 1
            check = check_kv_params({"kv_transfer_params": leg1.result_params})
            if err is not None or not check.usable:
                return None
            params, leg = check.params, loop.time()
        j = self.d.pick()
        self.d.load[j] += 1
        try:
            times, err = await token_times(self.d.engines[j], SimRequest(rid, ids, max_tokens, temperature=0,
                                                                     kv_params=params))  # fmt: skip
        finally:
            self.d.load[j] -= 1
        return None if err is not None or not times else (t0, leg, times)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def measure_profile(seed: int = 0) -> DeploymentProfile:
    """``pdctl profile``'s schedule against an in-process 1P1D on the virtual clock."""
    schedule = Schedule(prompt_lens=(128, 512, 1024, 2048, 4096, 8000), repeats=2, running=(1, 4, 16, 32, 64),
                        contexts=(256, 4096), output_len=24)  # fmt: skip

    async def main() -> DeploymentProfile:
        cluster = Cluster(1, 1)
        await cluster.start()
        rng = random.Random(seed)

        async def send(prompt_tokens: int, max_tokens: int) -> ProbeResult:
            out = await cluster.serve(_prompt(rng, prompt_tokens), max_tokens)
            if out is None:
                raise RuntimeError("probe failed")
            t0, leg, times = out
            gaps = tuple(b - a for a, b in itertools.pairwise(times))
            return ProbeResult(times[0] - t0, None if leg is None else leg - t0, gaps, prompt_tokens, t0)

        try:
            return await measure(send, schedule, source=f"sim:{PROFILE}", model="Qwen/Qwen3-8B",
                                 prefill_max_batched_tokens=8192, decode_max_num_seqs=64)  # fmt: skip
        finally:
            await cluster.stop()

    return run_virtual(main())


def run_at(
    prefill: int, decode: int, wl: m.Workload, rate: float, duration: float, slo: m.Slo, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for ``duration`` simulated seconds; measured attainment and percentiles."""

    async def main() -> dict[str, Any]:
        cluster = Cluster(prefill, decode)
        await cluster.start()
        rng = random.Random(seed)
        isl, osl = wl.isl.sampler(rng), wl.osl.sampler(rng)
        loop = asyncio.get_running_loop()
        ttfts: list[float] = []
        tpots: list[float] = []
        failed = [0]

        async def one(n_in: int, n_out: int) -> None:
            out = await cluster.serve(_prompt(rng, n_in), n_out)
            if out is None:
                failed[0] += 1
                return
            t0, _, times = out
            ttfts.append(times[0] - t0)
            tpots.append((times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0)

        tasks = []
        while loop.time() < duration:
            tasks.append(asyncio.ensure_future(one(int(isl()), int(osl()))))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        await cluster.stop()
        n = len(ttfts) + failed[0]
        good = sum(1 for a, b in zip(ttfts, tpots, strict=True) if a <= slo.ttft_s and b <= slo.tpot_s)
        return {
            "prefill": prefill, "decode": decode, "rate": rate, "requests": n, "failed": failed[0],
            "attainment": good / n if n else 0.0,
            "ttft_ms": {"p50": _pct(ttfts, 50) * 1000, "p90": _pct(ttfts, 90) * 1000},
            "tpot_ms": {"p50": _pct(tpots, 50) * 1000, "p90": _pct(tpots, 90) * 1000},
        }  # fmt: skip

    return run_virtual(main())


def _pct(xs: list[float], p: float) -> float:
    return percentile(xs, p, empty=float("nan"))


def _label(prefill: int, decode: int) -> str:
    return f"{prefill}P{decode}D" if prefill else f"{decode}C"


def check_cell(
    prof: DeploymentProfile, name: str, slo_name: str, scale: float, log: Callable[[str], None]
) -> dict[str, Any]:
    isl, osl, rate, seconds = WORKLOADS[name]
    duration = seconds * scale
    wl = m.Workload(m.parse_histogram(isl, "isl"), m.parse_histogram(osl, "osl"))
    slo = SLOS[slo_name]
    adv = m.size_for_rate(prof, wl, slo, rate, max_engines=16)
    c = adv.chosen
    x, y = c.prefill, c.decode
    log(f"{name} {slo_name}: advise {_label(x, y)} at {rate}/s, predicted capacity {adv.capacity_rate:.2f}/s")
    at_target = run_at(x, y, wl, rate, duration, slo, 1)
    # From the predicted capacity, up while the runs meet the SLO, or down until one does: the measured capacity
    # lies between the highest passing and the lowest failing rate of the grid.
    cap_runs: list[dict[str, Any]] = []

    def probe(f: float) -> bool:
        r = run_at(x, y, wl, adv.capacity_rate * f, duration, slo, 2)
        cap_runs.append(r)
        log(f"  {_label(x, y)} at {r['rate']:.2f}/s: attainment {r['attainment']:.1%}")
        return bool(r["attainment"] >= slo.attainment)

    up = probe(1.0)
    for f in (1.1, 1.25, 1.5, 2.0) if up else (0.9, 0.8, 0.7, 0.6, 0.5):
        if probe(f) != up:
            break
    passing = [r["rate"] for r in cap_runs if r["attainment"] >= slo.attainment]
    failing = [r["rate"] for r in cap_runs if r["attainment"] < slo.attainment]
    measured_cap = max(passing) if passing else 0.0
    bracket = (measured_cap, min(failing) if failing else None)
    sweep = []
    limit = min(c.engines + 1, 6)
    configs = [(0, n) for n in range(1, limit + 1)] + [(p, t - p) for t in range(2, limit + 1) for p in range(1, t)]
    for p, d in configs:
        r = run_at(p, d, wl, rate, duration, slo, 1)
        r["predicted_attainment"] = m.predict(prof, wl, slo, rate, "pd" if p else "colocated", p, d).attainment
        sweep.append(r)
        log(f"  sweep {_label(p, d)}: attainment {r['attainment']:.1%} (predicted {r['predicted_attainment']:.1%})")
    meeting = [r for r in sweep if r["attainment"] >= slo.attainment]
    cheapest = min(meeting, key=lambda r: (r["prefill"] + r["decode"], r["prefill"] > 0)) if meeting else None
    return {
        "workload": name, "slo": slo_name, "rate": rate, "advice": adv.as_dict(),
        "at_target": at_target, "predicted_capacity": adv.capacity_rate, "measured_capacity": measured_cap,
        "measured_bracket": bracket,
        "capacity_runs": cap_runs, "sweep": sweep,
        "cheapest": None if cheapest is None else _label(cheapest["prefill"], cheapest["decode"]),
        "cheapest_engines": None if cheapest is None else cheapest["prefill"] + cheapest["decode"],
        "cheapest_mode": None if cheapest is None else ("pd" if cheapest["prefill"] else "colocated"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--slos", default=",".join(SLOS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply each workload's simulated seconds per run")
    ap.add_argument("--out", default="benchmarks/results/advise_check.json")
    args = ap.parse_args(argv)
    t = time.monotonic()
    prof = measure_profile()
    print(f"profile: prefill {prof.prefill_s_per_token * 1e6:.1f} µs/token + {prof.prefill_fixed_s * 1e3:.1f} ms, "
          f"KV {prof.kv_s_per_token * 1e9:.0f} ns/token + {prof.kv_fixed_s * 1e3:.2f} ms, decode "
          + ", ".join(f"{p.running}@{p.context_tokens}: {p.step_s * 1e3:.1f} ms" for p in prof.decode),
          file=sys.stderr)  # fmt: skip
    cells = []
    for name in args.workloads.split(","):
        for slo_name in args.slos.split(","):
            cells.append(check_cell(prof, name, slo_name, args.scale, lambda s: print(s, file=sys.stderr)))
    print(
        "| workload | SLO TTFT/TPOT ms | rate | advised | predicted / measured capacity (req/s) | error | "
        "attainment at rate: predicted / measured | cheapest in sweep | verdict agrees |"
    )
    print("|---|---|---:|---|---|---:|---|---|---|")
    for c in cells:
        adv = c["advice"]
        label = _label(adv["prefill"], adv["decode"])
        err = (c["predicted_capacity"] / c["measured_capacity"] - 1) if c["measured_capacity"] else float("nan")
        agree = c["cheapest_mode"] == adv["verdict"]
        lo, hi = c["measured_bracket"]
        measured = f"{lo:.2f}–{hi:.2f}" if hi is not None else f"≥ {lo:.2f}"
        print(f"| {c['workload']} | {c['slo']} | {c['rate']:g} | {label} | {c['predicted_capacity']:.2f} / "
              f"{measured} | {err:+.0%} | {adv['predicted']['attainment']:.1%} / "
              f"{c['at_target']['attainment']:.1%} | {c['cheapest']} | {'yes' if agree else 'no'} |")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"profile": json.loads(__import__("msgspec").json.encode(prof)), "cells": cells},
                              indent=2))  # fmt: skip
    print(f"\n{time.monotonic() - t:.0f} s wall; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
