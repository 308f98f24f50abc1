"""Gateway overhead: the same simulator workers behind nothing, pdctl's gateway, the Rust routers, a toy proxy.

Two groups of arms, each with its own no-proxy baseline, measured side by side in one run:

* colocated (one hop):  ``direct`` (client -> decode worker) | ``pdctl-colocated`` | ``vllm-router`` and
  ``sglang-router`` in their plain (non-PD) modes.
* PD (two legs):        ``direct-pd`` (the client itself runs leg 1 on prefill and leg 2 on decode with
  :mod:`pdctl.vllm.protocol`: the protocol's floor) | ``pdctl-pd`` | ``pdctl-pd-w2`` / ``-w4`` / ``-w8``
  (``gateway.workers`` = 2 / 4 / 8) | ``pdctl-pd-traced`` (tracing on: ``logging.otlp_traces_endpoint`` at a
  receiver in this process that drops the spans) | ``vllm-router-pd`` (``--vllm-pd-disaggregation``; its tokio
  runtime has a worker thread per core) | ``vllm-router-pd-t1`` (the same on one worker thread,
  ``TOKIO_WORKER_THREADS=1``) |
  ``toy-proxy-pd`` (FastAPI + httpx, vLLM's toy_proxy_server shape) | ``sglang-router-pd`` (``--pd-disaggregation``;
  SGLang's protocol sends the whole request to prefill and decode at once, so the prefill simulator generates
  too and there is no KV hand-over: its numbers are not a like-for-like PD comparison) | ``proto-*`` (minimal
  two-leg proxies per library pair, from ``proto_proxy.py``).

All arms of a mode run at once; for each concurrency level the arms are measured one after the other (the
order alternates between ``--rounds``), so an arm and its baseline are measured minutes apart at most on a
machine whose load changes. Two modes per arm and concurrency (1, 16, 64, 256 closed-loop streams by default):

* ``latency``: workers pace tokens like a GPU (``--sim-speed`` so one decode step = ``--tpot-ms``, 20 ms);
  reports TTFT p50/p99 and the TTFT added over the group's baseline.
* ``throughput``: workers as fast as the CPU allows (``--sim-speed 1000``); reports streamed chunks/s, the
  proxy's CPU seconds per 1k chunks and its RSS. On a 2-core machine the proxy, the workers and the client
  share the cores, so a cheaper proxy shows up as more chunks/s.

The Rust routers and the toy proxy are installed from PyPI into their own venvs under /tmp on first use
(``pip install vllm-router`` / ``sglang-router`` / ``fastapi uvicorn[standard] httpx``); an arm that cannot
be installed or started is skipped with a note.

    .venv/bin/python -m benchmarks.gateway_overhead [--modes latency,throughput] [--streams 1,16,64,256]
        [--arms all|NAME,..] [--measure-s 8] [--rounds 1] [--out benchmarks/results/gateway_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import _harness as H
from pdctl.testing import free_port

BENCH = Path(__file__).resolve().parent
VENV_ROOT = Path(os.environ.get("PDBENCH_VENVS", "/tmp"))
PEER_VENVS = {
    "vllm-router": (VENV_ROOT / "pdbench-vllm-router", ["vllm-router"], "vllm-router"),
    "sglang-router": (VENV_ROOT / "pdbench-sglang-router", ["sglang-router"], "sglang-router"),
    "toy": (VENV_ROOT / "pdbench-toy-proxy", ["fastapi", "uvicorn[standard]", "httpx"], "python"),
}
COLOCATED = ["direct", "pdctl-colocated", "vllm-router", "sglang-router"]
PD = [
    "direct-pd",
    "pdctl-pd",
    "pdctl-pd-w2",
    "pdctl-pd-w4",
    "pdctl-pd-w8",
    "pdctl-pd-traced",
    "vllm-router-pd",
    "vllm-router-pd-t1",
    "toy-proxy-pd",
    "sglang-router-pd",
]
PROTO = ["proto-uvicorn-httpx", "proto-uvicorn-aiohttp", "proto-aiohttp"]
# Another checkout's gateway (e.g. before a change), or this one's under another interpreter (a venv's python with
# the gateway's dependencies), as arms pdctl-colocated-alt / pdctl-pd-alt.
ALT_TREE = os.environ.get("PDBENCH_ALT_TREE")
ALT_PYTHON = os.environ.get("PDBENCH_ALT_PYTHON")
if ALT_TREE or ALT_PYTHON:
    COLOCATED.insert(2, "pdctl-colocated-alt")
    PD.insert(2, "pdctl-pd-alt")
ALL_ARMS = COLOCATED + PD + PROTO
BASELINE = dict.fromkeys(COLOCATED, "direct") | dict.fromkeys(PD + PROTO, "direct-pd")


def baseline(arm: str) -> str:
    """The arm ``arm`` is compared with (``pdctl-pd-wN`` for any N: ``direct-pd``)."""
    return "direct-pd" if arm.startswith("pdctl-pd-w") else BASELINE[arm]


_SINK: H.TraceSink | None = None


def _trace_sink() -> str:
    """The OTLP/HTTP endpoint of the ``pdctl-pd-traced`` arm: a receiver in this process that drops the spans."""
    global _SINK
    if _SINK is None:
        _SINK = H.TraceSink()
    return _SINK.url


def ensure_venv(kind: str) -> Path | None:
    """The peer's executable, installing it into its own venv first; None (with a note) when that fails."""
    venv, pkgs, exe = PEER_VENVS[kind]
    path = venv / "bin" / exe
    if path.exists():
        return path
    print(f"# installing {' '.join(pkgs)} into {venv} ...", file=sys.stderr, flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *pkgs], check=True, capture_output=True,
                       timeout=900)  # fmt: skip
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"# could not install {pkgs}: {exc}", file=sys.stderr)
        return None
    return path if path.exists() else None


@dataclass
class Setup:
    """The running workers of one mode."""

    prefill: H.Proc
    decode: H.Proc
    log_dir: str


def start_arm(arm: str, s: Setup) -> tuple[H.Proc | None, int, int | None]:
    """Start the proxy for ``arm``: (process or None for a direct arm, port to send to, prefill port for direct-pd)."""
    p, d, logs = s.prefill, s.decode, s.log_dir
    if arm == "direct":
        return None, d.port, None
    if arm == "direct-pd":
        return None, d.port, p.port
    if arm.startswith("pdctl-"):
        alt = arm.endswith("-alt")
        tree, python = (ALT_TREE, ALT_PYTHON) if alt else (None, None)
        if arm.startswith("pdctl-colocated"):
            # Both roles on the decode worker, so the gateway routes exactly where `direct` sends.
            proc = H.start_pdctl_gateway(arm, logs, d.url, d.url, "colocated", tree=tree, python=python)
        else:
            # pdctl-pd-wN: gateway.workers = N (N gateway processes on one port); -traced: OTLP spans exported
            workers = int(arm.rpartition("-w")[2]) if "-w" in arm else 1
            otlp = _trace_sink() if arm.endswith("-traced") else None
            proc = H.start_pdctl_gateway(
                arm, logs, p.url, d.url, "pd_disagg", tree=tree, workers=workers, python=python, otlp=otlp
            )
        return proc, proc.port, None
    port = free_port()
    # Both routers export Prometheus on port 29000 by default: each instance gets its own free port.
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
              str(free_port())]  # fmt: skip
    env: dict[str, str] = {}
    if arm.startswith("vllm-router"):
        exe = ensure_venv("vllm-router")
        if exe is None:
            raise RuntimeError("vllm-router could not be installed")
        argv = [str(exe), *common, "--log-level", "warning", "--policy", "round_robin"]
        if arm.endswith("-t1"):  # its tokio runtime on one worker thread, as one pdctl gateway process
            env["TOKIO_WORKER_THREADS"] = "1"
            arm = arm.removesuffix("-t1")
        if arm.endswith("-pd"):
            argv += ["--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url]
        else:
            argv += ["--worker-urls", d.url]
    elif arm.startswith("sglang-router"):
        exe = ensure_venv("sglang-router")
        if exe is None:
            raise RuntimeError("sglang-router could not be installed")
        argv = [str(exe), "launch", *common, "--log-level", "warn", "--policy", "round_robin"]
        if arm.endswith("-pd"):
            argv += ["--pd-disaggregation", "--prefill", p.url, "--decode", d.url]
        else:
            argv += ["--worker-urls", d.url]
    elif arm == "toy-proxy-pd":
        exe = ensure_venv("toy")
        if exe is None:
            raise RuntimeError("fastapi/uvicorn/httpx could not be installed into a venv")
        argv = [str(exe), str(BENCH / "toy_proxy.py"), "--port", str(port), "--prefiller-url", p.url,
                "--decoder-url", d.url]  # fmt: skip
    elif arm.startswith("proto-"):
        argv = [H.PY, str(BENCH / "proto_proxy.py"), "--variant", arm.removeprefix("proto-"), "--port", str(port),
                "--prefill", p.url, "--decode", d.url]  # fmt: skip
    else:
        raise ValueError(f"unknown arm {arm}")
    proc = H.start(arm, argv, port, logs, env=env, ready_path="/health", ready_timeout_s=120)
    return proc, port, None


def warm(port: int, prefill_port: int | None) -> None:
    """A few requests so connection pools and lazy handshakes are set up before measuring."""

    async def go() -> None:
        counter = H.Counter()
        target = H.Target(port, counter, pd_prefill_port=prefill_port)
        for _ in range(5):
            await target.run(H.completion_body("warm up " * 8, 4))
        target.close()

    H.run_loop(go())


def window(
    arm: str, port: int, pport: int | None, proc: H.Proc | None, mode: str, n: int, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """One closed-loop measurement window of ``n`` streams against a running arm."""
    tokens = (8, 24) if mode == "latency" else (128, 384)
    w: H.Window = H.run_loop(
        H.closed_loop(
            H.Target(port, H.Counter(), pd_prefill_port=pport), n, warmup_s=args.warmup_s,
            measure_s=args.measure_s, tokens=tokens, prompt_words=48, seed=seed,
            cpu_probe=proc.cpu_s if proc is not None else None,
        )
    )  # fmt: skip
    t = w.ttfts_ms()
    tp = w.tpots_ms()
    lvl: dict[str, Any] = {
        "streams": n,
        "requests": len(w.results),
        "errors": w.errors,
        "first_error": w.first_error[:160],
        "ttft_p50_ms": H.pct(t, 50),
        "ttft_p99_ms": H.pct(t, 99),
        "ttft_mean_ms": sum(t) / len(t) if t else float("nan"),
        "ttfts_ms": [round(x, 3) for x in t],
        "tpot_p50_ms": H.pct(tp, 50),
        "tpot_p99_ms": H.pct(tp, 99),
        "tpots_ms": [round(x, 3) for x in tp],
        "chunks": w.chunks,
        "chunks_per_s": w.chunks_per_s,
        "proxy_cpu_s": w.proxy_cpu_s,
        "proxy_cpu_per_1k_chunks_s": 1000 * w.proxy_cpu_s / w.chunks if w.chunks else None,
        "client_cpu_util": w.client_cpu_s / w.seconds if w.seconds else None,
        "loadavg": os.getloadavg()[0],
    }
    print(
        f"  {mode:10s} {arm:22s} n={n:<4d} req={len(w.results):<6d} err={w.errors:<4d} "
        f"ttft p50={H.fmt(lvl['ttft_p50_ms'])} p99={H.fmt(lvl['ttft_p99_ms'])} ms  "
        f"tpot p50={H.fmt(lvl['tpot_p50_ms'])} p99={H.fmt(lvl['tpot_p99_ms'])} ms  "
        f"{w.chunks_per_s:9.0f} chunks/s  proxy cpu/1k={H.fmt(lvl['proxy_cpu_per_1k_chunks_s'], 3)} s  "
        f"client util={H.fmt(lvl['client_cpu_util'])}  load={lvl['loadavg']:.1f}",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return lvl


def measure(arm: str, s: Setup, mode: str, streams: list[int], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """All concurrency levels of one arm in one mode (the arm started and stopped here)."""
    try:
        proc, port, pport = start_arm(arm, s)
    except (RuntimeError, OSError) as exc:
        return {"arm": arm, "mode": mode, "skipped": str(exc).splitlines()[0]}
    out: dict[str, Any] = {"arm": arm, "mode": mode, "levels": {}}
    try:
        warm(port, pport)
        for n in streams:
            out["levels"][str(n)] = window(arm, port, pport, proc, mode, n, args, seed)
        if proc is not None:
            out["rss_mb"], out["peak_rss_mb"] = proc.rss_mb()
    finally:
        if proc is not None:
            proc.stop()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Per mode: start the workers and every arm, then for each level and round measure the arms one after
    the other (order alternating between rounds), so each arm is measured next to its baseline in time."""
    arms = ALL_ARMS if args.arms == "all" else [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ALL_ARMS:
            raise SystemExit(f"unknown arm {a!r}; choose from {', '.join(ALL_ARMS)}")
    for a in list(arms):
        if baseline(a) not in arms:
            arms.insert(0, baseline(a))
    streams = [int(x) for x in args.streams.split(",")]
    modes = args.modes.split(",")
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "-m", "benchmarks.gateway_overhead", *sys.argv[1:]]),
        "machine_before": H.machine(),
        "params": {"streams": streams, "modes": modes, "tpot_ms": args.tpot_ms, "warmup_s": args.warmup_s,
                   "measure_s": args.measure_s, "rounds": args.rounds},
        "runs": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pdbench-") as tmp:
        logs = args.keep_logs or tmp
        Path(logs).mkdir(parents=True, exist_ok=True)
        for mode in modes:
            # fast profile: one decode step = 0.2 ms / speed
            speed = 0.2 / args.tpot_ms if mode == "latency" else 1000.0
            s = Setup(H.start_sim(f"prefill-{mode}", "kv_producer", logs, speed),
                      H.start_sim(f"decode-{mode}", "kv_consumer", logs, speed), logs)  # fmt: skip
            running: dict[str, tuple[H.Proc | None, int, int | None]] = {}
            try:
                for arm in arms:
                    try:
                        running[arm] = start_arm(arm, s)
                        warm(running[arm][1], running[arm][2])
                    except (RuntimeError, OSError) as exc:
                        why = str(exc).splitlines()[0]
                        print(f"  {mode:10s} {arm:22s} SKIPPED: {why}", file=sys.stderr)
                        report["runs"].append({"arm": arm, "mode": mode, "skipped": why})
                live = [a for a in arms if a in running]
                best = 0.0  # the best chunks/s of this mode so far, to spot a stalled window
                for n in streams:
                    for rnd in range(args.rounds):
                        order = live if rnd % 2 == 0 else list(reversed(live))
                        for arm in order:
                            proc, port, pport = running[arm]
                            lvl = window(arm, port, pport, proc, mode, n, args, args.seed)
                            for _ in range(2):
                                # The shared simulator workers now and then stall for seconds (seen under
                                # heavy machine load): such a window says nothing about the proxy, so it is
                                # measured again, and counted in the report.
                                if lvl["chunks_per_s"] >= 0.2 * best and lvl["requests"] > 0:
                                    break
                                report.setdefault("remeasured", []).append(f"{mode}/{arm}/{n}")
                                time.sleep(3)
                                lvl = window(arm, port, pport, proc, mode, n, args, args.seed)
                            best = max(best, lvl["chunks_per_s"])
                            report["runs"].append({"arm": arm, "mode": mode, "round": rnd, "levels": {str(n): lvl}})
                for arm in live:
                    proc = running[arm][0]
                    if proc is not None:
                        rss, peak = proc.rss_mb()
                        report["runs"].append({"arm": arm, "mode": mode, "levels": {}, "rss_mb": rss,
                                               "peak_rss_mb": peak})  # fmt: skip
            finally:
                for proc, _, _ in running.values():
                    if proc is not None:
                        proc.stop()
                s.prefill.stop()
                s.decode.stop()
    report["machine_after"] = H.machine()
    return report


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Pool rounds per (mode, arm, streams); add TTFT added over the baseline and throughput ratios.

    The added mean is there for slow paces: TTFTs then fall into modes a decode step apart, so a percentile
    jumps by a whole step when a few requests cross over, while the mean moves by what they add."""
    pooled: dict[tuple[str, str, str], dict[str, Any]] = {}
    notes: dict[str, str] = {}
    rss: dict[str, float] = {}
    for r in report["runs"]:
        if "skipped" in r:
            notes[r["arm"]] = r["skipped"]
            continue
        if "peak_rss_mb" in r:
            rss[r["arm"]] = max(rss.get(r["arm"], 0.0), r["peak_rss_mb"])
        for n, lvl in r["levels"].items():
            key = (r["mode"], r["arm"], n)
            p = pooled.setdefault(key, {"ttfts": [], "tpots": [], "cps": [], "cpu1k": [], "errors": 0, "requests": 0,
                                        "client_util": []})  # fmt: skip
            p["ttfts"] += lvl["ttfts_ms"]
            p["tpots"] += lvl.get("tpots_ms", [])
            p["cps"].append(lvl["chunks_per_s"])
            if lvl["proxy_cpu_per_1k_chunks_s"] is not None:
                p["cpu1k"].append(lvl["proxy_cpu_per_1k_chunks_s"])
            if lvl["client_cpu_util"] is not None:
                p["client_util"].append(lvl["client_cpu_util"])
            p["errors"] += lvl["errors"]
            p["requests"] += lvl["requests"]
    rows: list[dict[str, Any]] = []
    for (mode, arm, n), p in sorted(pooled.items(), key=lambda kv: (kv[0][0], ALL_ARMS.index(kv[0][1]), int(kv[0][2]))):
        base = pooled.get((mode, baseline(arm), n))
        row: dict[str, Any] = {
            "mode": mode, "arm": arm, "streams": int(n), "baseline": baseline(arm), "requests": p["requests"],
            "errors": p["errors"], "ttft_p50_ms": H.pct(p["ttfts"], 50), "ttft_p99_ms": H.pct(p["ttfts"], 99),
            "ttft_mean_ms": _mean(p["ttfts"]),
            "tpot_p50_ms": H.pct(p["tpots"], 50), "tpot_p99_ms": H.pct(p["tpots"], 99),
            "chunks_per_s": sum(p["cps"]) / len(p["cps"]),
            "proxy_cpu_per_1k_chunks_s": sum(p["cpu1k"]) / len(p["cpu1k"]) if p["cpu1k"] else None,
            "client_cpu_util": max(p["client_util"]) if p["client_util"] else None,
            "peak_rss_mb": rss.get(arm),
        }  # fmt: skip
        if base is not None and arm != baseline(arm):
            row["added_ttft_p50_ms"] = row["ttft_p50_ms"] - H.pct(base["ttfts"], 50)
            row["added_ttft_p99_ms"] = row["ttft_p99_ms"] - H.pct(base["ttfts"], 99)
            row["added_ttft_mean_ms"] = row["ttft_mean_ms"] - _mean(base["ttfts"])
            bcps = sum(base["cps"]) / len(base["cps"])
            row["throughput_vs_baseline"] = row["chunks_per_s"] / bcps if bcps else None
        rows.append(row)
    return {"rows": rows, "skipped": notes}


def markdown(summary: dict[str, Any]) -> str:
    """The tables for docs/performance.md."""
    out: list[str] = []
    rows = summary["rows"]
    lat = [r for r in rows if r["mode"] == "latency"]
    thr = [r for r in rows if r["mode"] == "throughput"]
    if lat:
        out += ["| arm | streams | requests | TTFT p50 ms | TTFT p99 ms | added p50 ms | added p99 ms | added mean ms "
                "| TPOT p50 / p99 ms | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in lat:
            out.append(
                f"| {r['arm']} | {r['streams']} | {r['requests']} | {H.fmt(r['ttft_p50_ms'])} | "
                f"{H.fmt(r['ttft_p99_ms'])} | {H.fmt(r.get('added_ttft_p50_ms'))} | "
                f"{H.fmt(r.get('added_ttft_p99_ms'))} | {H.fmt(r.get('added_ttft_mean_ms'))} | "
                f"{H.fmt(r.get('tpot_p50_ms'))} / {H.fmt(r.get('tpot_p99_ms'))} "
                f"| {r['errors']} |"
            )
        out.append("")
    if thr:
        out += ["| arm | streams | chunks/s | vs baseline | proxy CPU s / 1k chunks | client core util | peak RSS MiB | errors |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in thr:
            vs = r.get("throughput_vs_baseline")
            out.append(
                f"| {r['arm']} | {r['streams']} | {r['chunks_per_s']:.0f} | {H.fmt(vs)} | "
                f"{H.fmt(r['proxy_cpu_per_1k_chunks_s'], 3)} | {H.fmt(r['client_cpu_util'])} | "
                f"{H.fmt(r['peak_rss_mb'], 0)} | {r['errors']} |"
            )
        out.append("")
    for arm, why in summary["skipped"].items():
        out.append(f"- {arm} skipped: {why}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="latency,throughput")
    ap.add_argument("--streams", default="1,16,64,256")
    ap.add_argument("--arms", default="all", help=f"all, or a comma list of {', '.join(ALL_ARMS)}")
    ap.add_argument("--tpot-ms", type=float, default=20.0, help="decode step in latency mode")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--measure-s", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=1, help="repeat all arms, alternating their order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(BENCH / "results" / "gateway_overhead.json"))
    ap.add_argument("--keep-logs", default=None, metavar="DIR", help="keep the workers' and proxies' logs here")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every started worker and proxy is stopped by the finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    report = run(args)
    report["summary"] = summarize(report)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for r in report["runs"]:  # keep the JSON small: raw TTFTs only in the pooled summary's source runs
        for lvl in r.get("levels", {}).values():
            lvl["ttfts_ms"] = lvl["ttfts_ms"][:20000]
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(markdown(report["summary"]))
    print(f"\nmachine before: {report['machine_before']}\nmachine after:  {report['machine_after']}")
    print(f"wrote {args.out} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
