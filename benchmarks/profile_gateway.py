"""Profile the gateway's hot path with py-spy while simulator workers stream through it.

Starts a prefill and a decode simulator (fast profile, ``--sim-speed 1000``), the gateway (``pdctl gateway``,
or a ``proto_proxy.py`` variant), drives ``--streams`` closed-loop streams with the lean load client, and
records the gateway with ``py-spy record --format raw`` for ``--duration`` seconds. Prints the frames with the
most inclusive and self samples; the collapsed stacks are written for flame graphs.

    .venv/bin/pip install py-spy
    .venv/bin/python -m benchmarks.profile_gateway [--arm pdctl-pd] [--streams 32] [--duration 10]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from benchmarks import _harness as H
from benchmarks import gateway_overhead as G


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="pdctl-pd", help="pdctl-pd, pdctl-colocated or proto-<variant>")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--tpot-ms", type=float, default=0.0, help="pace the workers (0: as fast as the CPU allows)")
    ap.add_argument(
        "--tokens",
        default=None,
        help="output tokens per request, MIN,MAX (default 8,24 paced, 128,384 unpaced); 1,1 profiles the "
        "per-request path",
    )
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--out", default="/tmp/pdbench-profile.txt", help="collapsed stacks")
    args = ap.parse_args(argv)
    pyspy = shutil.which("py-spy") or str(Path(H.PY).parent / "py-spy")
    with tempfile.TemporaryDirectory(prefix="pdbench-prof-") as logs:
        speed = 0.2 / args.tpot_ms if args.tpot_ms > 0 else 1000.0
        lo, hi = (
            (int(x) for x in args.tokens.split(",")) if args.tokens else (8, 24) if args.tpot_ms > 0 else (128, 384)
        )
        s = G.Setup(H.start_sim("prefill", "kv_producer", logs, speed),
                    H.start_sim("decode", "kv_consumer", logs, speed), logs)  # fmt: skip
        proc = None
        try:
            proc, port, pport = G.start_arm(args.arm, s)
            assert proc is not None
            G.warm(port, pport)
            spy = subprocess.Popen(
                [pyspy, "record", "--format", "raw", "-r", str(args.rate), "-d", str(int(args.duration)),
                 "-o", args.out, "-p", str(proc.popen.pid), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            box: list[H.Window] = []

            def load() -> None:
                box.append(H.run_loop(H.closed_loop(
                    H.Target(port, H.Counter(), pd_prefill_port=pport), args.streams, warmup_s=0.5,
                    measure_s=args.duration, tokens=(lo, hi), prompt_words=48, seed=0, cpu_probe=proc.cpu_s,
                )))  # fmt: skip

            t = threading.Thread(target=load)
            t.start()
            t.join()
            spy.wait(60)
            w = box[0]
            n = len(w.results)
            print(
                f"{w.chunks_per_s:.0f} chunks/s, {n / w.seconds:.0f} requests/s, proxy CPU "
                f"{1e6 * w.proxy_cpu_s / max(1, w.chunks):.1f} us/chunk, {1e6 * w.proxy_cpu_s / max(1, n):.0f} us/request"
            )
        finally:
            if proc is not None:
                proc.stop()
            s.prefill.stop()
            s.decode.stop()
    incl: collections.Counter[str] = collections.Counter()
    self_: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(args.out).read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack:
            continue
        count = int(samples)
        frames = stack.split(";")
        total += count
        for f in set(frames):
            incl[f] += count
        self_[frames[-1]] += count
    print(f"\n{total} samples; inclusive:")
    for f, c in incl.most_common(args.top):
        print(f"{100 * c / total:5.1f}%  {f}")
    print("\nself:")
    for f, c in self_.most_common(args.top):
        print(f"{100 * c / total:5.1f}%  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
