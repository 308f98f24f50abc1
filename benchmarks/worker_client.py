"""The gateway's worker client against aiohttp's, in one process, on one simulator worker: CPU per call.

Both sides do what the gateway's legs do: ``short`` = leg 1 (a POST, the whole JSON body read, ``max_tokens``
1), ``stream`` = leg 2 (a POST streamed piece by piece to the end, 8–24 tokens). ``aiohttp`` is how
``pdctl.vllm.transport.Client`` called aiohttp before it moved to its own protocol (one pooled ``ClientSession``,
``request`` + ``content.readany()``); ``raw`` is ``pdctl.vllm.transport.Client`` now. The simulator runs unpaced in
its own process; the number is this process's CPU (``time.process_time``) per call and per streamed event,
over ``--seconds`` of ``--streams`` closed-loop callers, on uvloop, arms alternating over ``--rounds``.

    .venv/bin/python -m benchmarks.worker_client [--streams 64] [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from typing import Any

import aiohttp

from benchmarks import _harness as H
from pdctl.vllm.transport import Client


class _Aiohttp:
    """The previous worker client: aiohttp's session, as pdctl.vllm.transport.Client used it."""

    def __init__(self, base: str) -> None:
        self.base = base
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0, use_dns_cache=True)
        self.s = aiohttp.ClientSession(connector=conn, auto_decompress=False, skip_auto_headers=("User-Agent",),
                                       timeout=aiohttp.ClientTimeout(total=None))  # fmt: skip
        self.timeout = aiohttp.ClientTimeout(sock_connect=10, sock_read=300)

    async def call(self, body: bytes, rid: str, stream: bool) -> int:
        h = {"accept-encoding": "identity", "content-type": "application/json", "x-request-id": rid}
        resp = await self.s.request("POST", self.base + "/v1/completions", data=body, headers=h,
                                    timeout=self.timeout, allow_redirects=False, compress=None)  # fmt: skip
        events = 0
        if stream:
            while data := await resp.content.readany():
                events += data.count(b"data:")
        else:
            await resp.read()
        resp.release()
        return events

    async def aclose(self) -> None:
        await self.s.close()


class _Raw:
    def __init__(self, base: str) -> None:
        self.c = Client(base, read_timeout_s=300, connect_timeout_s=10, keepalive_s=4.0,
                        headers={"accept-encoding": "identity"})  # fmt: skip

    async def call(self, body: bytes, rid: str, stream: bool) -> int:
        resp = await self.c.request("POST", "/v1/completions", body=body,
                                    headers={"content-type": "application/json", "x-request-id": rid})  # fmt: skip
        events = 0
        try:
            if stream:
                while data := await resp.chunk():
                    events += data.count(b"data:")
            else:
                await resp.read()
        finally:
            resp.close()
        return events

    async def aclose(self) -> None:
        await self.c.aclose()


async def _window(client: Any, streams: int, seconds: float, stream: bool) -> dict[str, float]:
    calls = events = 0
    stop = False

    async def caller(i: int) -> None:
        nonlocal calls, events
        n = 0
        while not stop:
            tokens = 1 if not stream else 8 + (i + n) % 17
            body = json.dumps(H.completion_body("alpha beta gamma " * 20, tokens, stream)).encode()
            got = await client.call(body, f"bench-{i}-{n}", stream)  # not `events += await`: it reads first
            events += got
            calls += 1
            n += 1

    tasks = [asyncio.ensure_future(caller(i)) for i in range(streams)]
    await asyncio.sleep(1.0)  # warm-up: connections opened
    c0, e0, cpu0, t0 = calls, events, time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    c1, e1, cpu1, t1 = calls, events, time.process_time(), time.perf_counter()
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    cpu, n, ev = cpu1 - cpu0, c1 - c0, e1 - e0
    return {"calls_per_s": n / (t1 - t0), "cpu_us_per_call": cpu / max(n, 1) * 1e6,
            "cpu_us_per_event": cpu / max(ev, 1) * 1e6 if stream else 0.0, "cpu_share": cpu / (t1 - t0)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdbench-client-") as logs:
        sim = H.start_sim("worker", "kv_both", logs, speed=1000.0)
        try:
            print(f"# {H.machine()}", flush=True)
            print("| client | calls | round | calls/s | CPU µs per call | CPU µs per event | client core util |")
            print("|---|---|---:|---:|---:|---:|---:|")
            for rnd in range(a.rounds):
                arms = [("aiohttp", _Aiohttp), ("raw", _Raw)]
                for name, make in arms if rnd % 2 == 0 else arms[::-1]:
                    for stream in (False, True):

                        async def one(make: Any = make, stream: bool = stream) -> dict[str, float]:
                            client = make(sim.url)
                            try:
                                return await _window(client, a.streams, a.seconds, stream)
                            finally:
                                await client.aclose()

                        r = H.run_loop(one())
                        print(f"| {name} | {'stream' if stream else 'short'} | {rnd + 1} | {r['calls_per_s']:.0f} | "
                              f"{r['cpu_us_per_call']:.0f} | {H.fmt(r['cpu_us_per_event'] or None, 1)} | "
                              f"{r['cpu_share']:.2f} |", flush=True)  # fmt: skip
        finally:
            sim.stop()


if __name__ == "__main__":
    main()
