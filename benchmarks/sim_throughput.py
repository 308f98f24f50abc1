"""How many streamed SSE chunks per second one simulator process serves on one CPU core (docs/simulator.md).

Starts ``python -m pdctl.sim`` (fast profile, ``--sim-speed`` high so the timing model costs nothing) pinned to
one core, drives it with a minimal raw-socket streaming client (pinned elsewhere when there is a second core),
and reports chunks/s of wall time and chunks per CPU-second of the simulator process.

    .venv/bin/python -m benchmarks.sim_throughput [--streams 64] [--tokens 256] [--duration 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import psutil

from pdctl.testing import start_sim


async def _one_stream(port: int, tokens: int, counter: list[int]) -> None:
    body = json.dumps(
        {"model": "sim-model", "prompt": "hello world", "max_tokens": tokens, "stream": True, "ignore_eos": True}
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        buf = tail + data
        counter[0] += buf.count(b'data: {"id"') - tail.count(b'data: {"id"')
        tail = buf[-16:]
    writer.close()


async def _drive(port: int, streams: int, tokens: int, duration_s: float) -> tuple[int, float]:
    counter = [0]
    stop_at = time.perf_counter() + duration_s

    async def loop() -> None:
        while time.perf_counter() < stop_at:
            await _one_stream(port, tokens, counter)

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(streams)))
    return counter[0], time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--speed", type=float, default=1000.0, help="--sim-speed (high: the timing model is free)")
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as logs:
        sp = start_sim(["--sim-speed", str(args.speed), "--max-num-seqs", "1024"], logs, connector=None)
        try:
            os.sched_setaffinity(sp.proc.pid, {cores[0]})
            if len(cores) > 1:
                os.sched_setaffinity(0, set(cores[1:]))
            proc = psutil.Process(sp.proc.pid)
            cpu0 = proc.cpu_times()
            chunks, wall = asyncio.run(_drive(sp.port, args.streams, args.tokens, args.duration))
            cpu1 = proc.cpu_times()
        finally:
            sp.stop()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    result = {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "chunks": chunks,
        "wall_s": round(wall, 2),
        "chunks_per_s": round(chunks / wall),
        "sim_cpu_s": round(cpu, 2),
        "chunks_per_cpu_s": round(chunks / cpu) if cpu > 0 else None,
        "sim_core": cores[0],
        "client_cores": cores[1:] or cores[:1],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
