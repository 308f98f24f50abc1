"""``pdctl bench -w claude-code`` and ``-w codex`` under always-PD and adaptive PD on the calibrated simulator (1P1D).

    .venv/bin/python -m benchmarks.agent_clients --sessions 4,8 --out docs/data/agent-clients-sim-DATE.json.gz

One prefill and one decode simulator (``python -m pdctl.sim``, NixlConnector, the ``cpu-small`` profile; the simulator
drops Claude Code's billing block before rendering, as vLLM 0.32 does), then per side a gateway over the same two
workers (``pd_mode = "always"``, then ``"adaptive"`` with ``local_max_uncached_tokens = 512``), and on each side, per
client and session count, one ``pdctl bench`` run (``--turns 6 --answer-len 32 --user-len 60``, the other sizes at
their defaults). Each run has prompts of its own (its run id), so no run finds another's cached.

Per run: the later requests' paths (turn 2 on, the sub-agent's included), their TTFT and TPOT p50, turn 1's TTFT p50,
the KV moved and each engine's prefix-cache hit rate. Prints a Markdown table; ``--out`` keeps every run's result
JSON (gzipped). Only loopback and free ports.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import PY, ROOT
from benchmarks.adaptive_sweep import KEY, MODEL, start_gateway, start_worker

SIZES = ("--turns", "6", "--answer-len", "32", "--user-len", "60")


def bench(gateway: str, client: str, sessions: int, metrics: dict[str, str], out: Path) -> dict[str, Any]:
    argv = [PY, "-m", "pdctl", "bench", "--gateway", gateway, "--model", MODEL, "-w", client,
            "--conversations", str(sessions), *SIZES, "--no-progress", "-o", str(out)]  # fmt: skip
    for url in metrics.values():
        argv += ["--metrics-url", f"{url}/metrics"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PDCTL_API_KEY=KEY),
                          timeout=1800, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"pdctl bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def row(result: dict[str, Any], metrics: dict[str, str]) -> dict[str, Any]:
    """The run's later requests (turn 2 on): paths, TTFT and TPOT p50; turn 1's TTFT p50; KV; prefix-cache hits."""
    p = result["pdctl"]
    reqs = p["requests"]
    later = [i for i, t in enumerate(reqs["turn"]) if t > 1]
    names = {f"{url}/metrics": name for name, url in metrics.items()}
    return {
        "completed": result["completed"], "failed": result["failed"], "later": len(later),
        "later_local": sum(reqs["pd_path"][i] == "local" for i in later),
        "later_ttft_p50_ms": statistics.median(result["ttfts"][i] * 1000 for i in later),
        "later_tpot_p50_ms": p["turn_groups"]["2+"]["tpot"]["p50"],
        "turn1_ttft_p50_ms": p["turn_groups"]["1"]["ttft"]["p50"],
        "kv_mb": p["kv_transfer"].get("kv_bytes", 0) / 1e6, "kv_transfers": p["kv_transfer"].get("kv_transfers", 0),
        "hit_rate": {names.get(url, url): v["hit_rate"] for url, v in p["prefix_cache"].items()},
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", default="4,8", help="session counts, comma-separated")
    p.add_argument("--clients", default="claude-code,codex")
    p.add_argument("--out", type=Path, help="every run's result JSON, gzipped")
    a = p.parse_args(argv)
    counts = [int(x) for x in a.sessions.split(",")]
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="agent-clients-") as logs:
        prefill = start_worker("prefill", "kv_producer", logs, "cpu-small", 1.0, 1.0)
        decode = start_worker("decode", "kv_consumer", logs, "cpu-small", 1.0, 1.0)
        metrics = {"prefill": prefill.url, "decode": decode.url}
        try:
            for side, threshold in (("always-PD", "always"), ("adaptive", "512")):
                gw = start_gateway(f"gw-{threshold}", logs, prefill.url, decode.url, threshold)
                try:
                    for client in a.clients.split(","):
                        for n in counts:
                            result = bench(gw.url, client, n, metrics, Path(logs) / "run.json")
                            raw[f"{client}-{side}-{n}"] = result
                            rows.append({"client": client, "side": side, "sessions": n, **row(result, metrics)})
                finally:
                    gw.stop()
        finally:
            decode.stop()
            prefill.stop()
    if a.out:
        a.out.write_bytes(gzip.compress(json.dumps({"rows": rows, "runs": raw}).encode(), mtime=0))
    print("| client | sessions | side | later requests: local | TTFT p50 later (ms) | TPOT p50 later (ms) "
          "| TTFT p50 turn 1 (ms) | KV moved (MB) | prefix-cache hits: prefill / decode |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        hits = " / ".join(f"{100 * r['hit_rate'].get(k, 0):.1f} %" for k in ("prefill", "decode"))
        print(f"| {r['client']} | {r['sessions']} | {r['side']} | {r['later_local']} of {r['later']} | "
              f"{r['later_ttft_p50_ms']:.0f} | {r['later_tpot_p50_ms']:.1f} | {r['turn1_ttft_p50_ms']:.0f} | "
              f"{r['kv_mb']:.2f} | {hits} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
