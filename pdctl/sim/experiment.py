"""Colocated vs chunked-prefill vs PD on the timing model, in virtual time (docs/simulator.md, "Experiment").

The engines are the simulator's own (``SimEngine``), driven in-process on a ``VirtualClockLoop``; PD uses the
real side channel between a prefill and a decode engine in the same loop. No HTTP, no wall clock: results
are deterministic for a given seed and say what the timing model predicts, not how fast this machine is.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdctl.bench.metrics import percentile
from pdctl.sim.engine import EngineConfig, KVSettings, SimEngine, SimRequest
from pdctl.sim.logfmt import VllmLog
from pdctl.sim.text import VOCAB_SIZE
from pdctl.sim.timing import get_link, get_profile
from pdctl.sim.virtual import run_virtual
from pdctl.vllm.protocol import PREFILL_REQUEST_PARAMS, check_kv_params

__all__ = ["Mode", "ModeResult", "Workload", "run_mode", "token_times"]

Mode = Literal["colocated", "chunked", "pd"]


@dataclass(frozen=True, slots=True)
class Workload:
    """Closed-loop short streams plus long prompts arriving at a fixed interval."""

    streams: int = 16
    short_prompt: int = 200
    out_len: int = 128
    long_prompt: int = 8000
    long_out: int = 8
    long_every_s: float = 0.3  # 0 = no long prompts
    duration_s: float = 30.0
    seed: int = 0


@dataclass
class ModeResult:
    """Per-request timings (seconds) of one mode."""

    mode: str
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    long_ttft_s: list[float] = field(default_factory=list)
    errors: int = 0

    def summary(self) -> dict[str, Any]:
        """p50/p90/p99 in milliseconds."""

        def pct(xs: Sequence[float]) -> dict[str, float]:
            return {f"p{p}": round(percentile(xs, p, empty=float("nan")) * 1000, 1) for p in (50, 90, 99)}

        return {
            "mode": self.mode,
            "short_requests": len(self.tpot_s),
            "long_requests": len(self.long_ttft_s),
            "errors": self.errors,
            "tpot_ms": pct(self.tpot_s),
            "itl_ms": pct(self.itl_s),
            "ttft_ms": pct(self.ttft_s),
            "long_ttft_ms": pct(self.long_ttft_s),
        }


def _config(profile: str, link: str, role: str, **kw: Any) -> EngineConfig:
    kv = KVSettings()
    if role in ("kv_producer", "kv_consumer"):
        kv = KVSettings(connector="NixlConnector", role=role, side_port=0)
    return EngineConfig(
        model="Qwen/Qwen3-8B",
        served_model_name="Qwen/Qwen3-8B",
        profile=get_profile(profile),
        link=get_link(link),
        kv_scale=0.0005,
        max_model_len=8192,
        kv=kv,
        **kw,
    )


async def token_times(engine: SimEngine, req: SimRequest) -> tuple[list[float], str | None]:
    """Token arrival times (loop clock) until the request ends; the error message if it failed."""
    loop = asyncio.get_running_loop()
    engine.add(req)
    times: list[float] = []
    while True:
        ev = await req.events.get()
        if ev.kind == "token":
            times.append(loop.time())
        elif ev.kind == "finish":
            return times, None
        else:
            return times, ev.message


async def _run(mode: Mode, profile: str, link: str, w: Workload) -> ModeResult:
    loop = asyncio.get_running_loop()
    log = VllmLog(level="ERROR")
    res = ModeResult(mode)
    engines: list[SimEngine] = []
    if mode == "pd":
        prefill = SimEngine(
            _config(profile, link, "kv_producer", max_num_batched_tokens=8192, max_num_seqs=8,
                    enable_chunked_prefill=False),
            log=log,
        )  # fmt: skip
        decode = SimEngine(_config(profile, link, "kv_consumer", max_num_batched_tokens=2048, max_num_seqs=64), log=log)
        engines = [prefill, decode]
    elif mode == "colocated":
        decode = SimEngine(
            _config(profile, link, "none", max_num_batched_tokens=8192, max_num_seqs=64, enable_chunked_prefill=False),
            log=log,
        )
        engines = [decode]
    else:
        decode = SimEngine(
            _config(profile, link, "none", max_num_batched_tokens=2048, max_num_seqs=64, enable_chunked_prefill=True),
            log=log,
        )
        engines = [decode]
    for e in engines:
        await e.start()
    rng = random.Random(w.seed)
    counter = [0]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(VOCAB_SIZE) for _ in range(n)]

    async def one(ids: list[int], max_tokens: int) -> tuple[float, list[float]] | None:
        counter[0] += 1
        rid = f"cmpl-{counter[0]}-0-sim"
        t0 = loop.time()
        params = None
        if mode == "pd":
            leg1 = SimRequest(rid + "p", ids, 1, temperature=0, kv_params=dict(PREFILL_REQUEST_PARAMS))
            _, err = await token_times(engines[0], leg1)
            check = check_kv_params({"kv_transfer_params": leg1.result_params})
            if err is not None or not check.usable:
                res.errors += 1
                return None
            params = check.params
        req = SimRequest(rid, ids, max_tokens, temperature=0, kv_params=params)
        times, err = await token_times(decode, req)
        if err is not None or not times:
            res.errors += 1
            return None
        return t0, times

    end = w.duration_s

    async def short_stream() -> None:
        while loop.time() < end:
            out = await one(prompt(w.short_prompt), w.out_len)
            if out is None:
                continue
            t0, times = out
            res.ttft_s.append(times[0] - t0)
            if len(times) > 1:
                res.tpot_s.append((times[-1] - times[0]) / (len(times) - 1))
            res.itl_s.extend(b - a for a, b in itertools.pairwise(times))

    async def long_prompts() -> None:
        pending = []

        async def long_one() -> None:
            out = await one(prompt(w.long_prompt), w.long_out)
            if out is not None:
                res.long_ttft_s.append(out[1][0] - out[0])

        await asyncio.sleep(w.long_every_s / 2)
        while loop.time() < end:
            pending.append(asyncio.ensure_future(long_one()))
            await asyncio.sleep(w.long_every_s)
        await asyncio.gather(*pending)

    jobs = [short_stream() for _ in range(w.streams)]
    if w.long_every_s > 0:
        jobs.append(long_prompts())
    await asyncio.gather(*jobs)
    for e in engines:
        await e.stop()
    return res


def run_mode(mode: Mode, workload: Workload, profile: str = "h100", link: str = "rdma-400g") -> ModeResult:
    """Run one mode of the experiment on a fresh virtual-time loop."""
    return run_virtual(_run(mode, profile, link, workload))
