"""Where a proxy's CPU goes per request: user against system time, system calls, and the cyclic GC's share.

For each arm of ``gateway_overhead.py`` (``pdctl-pd``, ``pdctl-pd-alt``, ``vllm-router-pd``, ...) in turn, the
arm order alternating over ``--rounds``: simulator workers, the proxy, ``--streams`` closed-loop streams for
``--seconds``, and the proxy's user and system CPU (its process and children) per request and per chunk, the
cores it used on average, and its threads that did a tenth or more of its work (their shares). With
``--strace`` a second window runs under ``strace -c -f`` and prints the system calls per request (strace slows
the proxy several fold: that window's rates are not the first's). With ``--perf`` a window runs under ``perf
record`` (cpu-clock, 999 Hz) and prints the share of samples in CPython's cyclic GC and the top shared objects.

    .venv/bin/python -m benchmarks.proxy_cpu_split --arms pdctl-pd,vllm-router-pd --streams 256 --tpot-ms 20
    .venv/bin/python -m benchmarks.proxy_cpu_split --arms pdctl-pd,vllm-router-pd --streams 64 --tokens 1,1 --strace
    PDBENCH_ALT_TREE=<checkout> .venv/bin/python -m benchmarks.proxy_cpu_split --arms pdctl-pd,pdctl-pd-alt --perf
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks import _harness as H
from benchmarks import gateway_overhead as G

#: CPython's cyclic collector, as perf names its functions.
_GC = re.compile(r"gc_collect|visit_reachable|visit_decref|_traverse\b|move_unreachable|update_refs|subtract_refs")


def _cpu(pid: int) -> tuple[float, float]:
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    times = [p.cpu_times() for p in procs]
    return sum(t.user for t in times), sum(t.system for t in times)


def _thread_cpu(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds of each thread of the proxy's process tree, by (pid, thread id)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    out: dict[tuple[int, int], float] = {}
    for p in procs:
        for t in p.threads():
            out[(p.pid, t.id)] = t.user_time + t.system_time
    return out


def _load(port: int, pport: int | None, args: argparse.Namespace, probe: H.Proc) -> H.Window:
    lo, hi = (int(x) for x in args.tokens.split(","))
    return H.run_loop(H.closed_loop(
        H.Target(port, H.Counter(), pd_prefill_port=pport), args.streams, warmup_s=0.5, measure_s=args.seconds,
        tokens=(lo, hi), prompt_words=48, seed=0, cpu_probe=probe.cpu_s,
    ))  # fmt: skip


def _strace_counts(out: Path) -> dict[str, int]:
    calls: dict[str, int] = {}
    for line in out.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3])
    return calls


def _perf_report(data: Path) -> tuple[float, list[tuple[str, float]]]:
    def report(sort: str) -> list[tuple[str, float]]:
        text = subprocess.run(["perf", "report", "-i", str(data), "--sort", sort, "--stdio"],
                              capture_output=True, text=True, check=False).stdout  # fmt: skip
        rows = []
        for line in text.splitlines():
            m = re.match(r"\s*([\d.]+)%\s+(?:\[[.k]\]\s+)?(.+?)\s*$", line)
            if m:
                rows.append((m.group(2), float(m.group(1))))
        return rows

    gc_share = sum(share for name, share in report("sym") if _GC.search(name))
    return gc_share, report("dso")[:6]


def _window(arm: str, r: int, s: G.Setup, logs: str, args: argparse.Namespace) -> None:
    proc, port, pport = G.start_arm(arm, s)
    assert proc is not None, f"{arm} has no proxy process"
    pid = proc.popen.pid
    try:
        G.warm(port, pport)
        u0, s0 = _cpu(pid)
        t0 = _thread_cpu(pid)
        w = _load(port, pport, args, proc)
        u1, s1 = _cpu(pid)
        t1 = _thread_cpu(pid)
        n, c = max(1, len(w.results)), max(1, w.chunks)
        # Threads that did a tenth or more of the window's work: how many cores the proxy can use at once.
        busy = sorted((t1[k] - t0.get(k, 0.0) for k in t1), reverse=True)
        total = sum(busy) or 1.0
        working = [b for b in busy if b >= 0.1 * total]
        print(
            f"round {r + 1} {arm:16s} {n / w.seconds:6.0f} req/s {w.chunks_per_s:7.0f} chunks/s | per request user "
            f"{1e6 * (u1 - u0) / n:5.0f} us, system {1e6 * (s1 - s0) / n:5.0f} us | per chunk "
            f"{1e6 * (u1 - u0) / c:5.1f} + {1e6 * (s1 - s0) / c:5.1f} us | {(u1 - u0 + s1 - s0) / w.seconds:.2f} "
            f"cores on average, {len(working)} working thread(s): "
            + ", ".join(f"{100 * b / total:.0f} %" for b in working),
            flush=True,
        )
        if args.strace:
            out = Path(logs) / f"{arm}.strace"
            tracer = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", str(out)],
                                      stderr=subprocess.DEVNULL)  # fmt: skip
            time.sleep(1.0)
            w = _load(port, pport, args, proc)
            tracer.send_signal(signal.SIGINT)
            tracer.wait(30)
            n = max(1, len(w.results))
            calls = collections.Counter(_strace_counts(out))
            top = ", ".join(f"{k} {v / n:.2f}" for k, v in calls.most_common(8))
            print(f"  system calls per request, {sum(calls.values()) / n:.1f} in all: {top}", flush=True)
        if args.perf:
            data = Path(logs) / f"{arm}.perf"
            rec = subprocess.Popen(
                ["perf", "record", "-F", "999", "-o", str(data), "-p", str(pid), "--", "sleep", str(args.seconds)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            _load(port, pport, args, proc)
            rec.wait(60)
            gc_share, dsos = _perf_report(data)
            top = ", ".join(f"{name} {share:.1f} %" for name, share in dsos)
            print(f"  perf: cyclic GC {gc_share:.2f} % of samples; by object: {top}", flush=True)
    finally:
        proc.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="pdctl-pd,vllm-router-pd")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tpot-ms", type=float, default=20.0, help="pace the workers (0: as fast as the CPU allows)")
    ap.add_argument("--tokens", default="8,24", help="output tokens per request, MIN,MAX")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--strace", action="store_true", help="also count system calls (needs strace)")
    ap.add_argument("--perf", action="store_true", help="also sample with perf: the GC's share (needs perf)")
    args = ap.parse_args(argv)
    for tool, wanted in (("strace", args.strace), ("perf", args.perf)):
        if wanted and shutil.which(tool) is None:
            print(f"{tool} is not installed", file=sys.stderr)
            return 2
    arms = args.arms.split(",")
    speed = 0.2 / args.tpot_ms if args.tpot_ms > 0 else 1000.0
    print(f"load average {psutil.getloadavg()}; {args.streams} streams, tpot {args.tpot_ms} ms, tokens {args.tokens}")
    with tempfile.TemporaryDirectory(prefix="pdbench-split-") as logs:
        s = G.Setup(H.start_sim("prefill", "kv_producer", logs, speed),
                    H.start_sim("decode", "kv_consumer", logs, speed), logs)  # fmt: skip
        try:
            for r in range(args.rounds):
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    _window(arm, r, s, logs, args)
        finally:
            s.prefill.stop()
            s.decode.stop()
    print(f"load average {psutil.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
