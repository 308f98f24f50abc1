"""``pdctl advise``'s 1P1D prediction against a measured A/B on a running real deployment (docs/multi-node.md,
"Sizing"; issue #51's real check).

1. ``pdctl profile`` through the deployment's gateway (it must be otherwise idle);
2. an SLO scaled to the machine: ``--ttft-x`` × (prefill + KV hand-off + one step) of an ``--input-len`` prompt,
   ``--tpot-x`` × the one-stream step, from the profile (the examples' own SLO, a minute, would make every rate
   meet it);
3. the measured capacity: ``pdctl bench --max-goodput`` with that SLO (DistServe's search: the highest Poisson rate
   whose run meets the SLO for 90 % of requests) on ``--workload`` (``doc``, the recipe's two prompts, by default:
   ``random`` needs a tokenizer with one token per bench word, ``pdctl model tiny --bench-words``);
4. the predicted capacity: ``pdctl advise PROFILE --bench RESULTS --engines 2 --json`` with the same SLO, its P/D
   (1P1D) rate, on the workload of the best passing run (its measured lengths and prefill hit rate).

Prints predicted / measured and writes both, every probe of the search and the profile to ``--out``::

    .venv/bin/python -m benchmarks.advise_real -c examples/cpu/config.toml -s examples/cpu/settings.json \\
        --input-len 64 -n 24 --out docs/data/advise-real-2026-12-07.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import PY, ROOT, write_report
from pdctl.capacity.profile import decode_step_s, kv_s, load, prefill_s


def _pdctl(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([PY, "-m", "pdctl", *args], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=timeout_s, check=False, env=os.environ.copy())  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"pdctl {args[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def _workload(args: argparse.Namespace) -> list[str]:
    if args.workload == "doc":  # the recipe's two chat prompts: lengths the tokenizer gives, whatever it is
        return ["-w", "doc"]
    return ["-w", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("-s", "--settings", required=True)
    ap.add_argument(
        "--workload",
        choices=("doc", "random"),
        default="doc",
        help="random needs a tokenizer with one token per bench word (pdctl model tiny --bench-words)",
    )
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("-n", "--num-requests", type=int, default=40)
    ap.add_argument("--ttft-x", type=float, default=8.0)
    ap.add_argument("--tpot-x", type=float, default=3.0)
    ap.add_argument("--bench-timeout", type=float, default=1200.0)
    ap.add_argument("--keep-bench", help="Also write pdctl bench's results here.")
    ap.add_argument("--out", default="advise-real.json")
    args = ap.parse_args(argv)
    started = time.time()
    files = ("-c", args.config, "-s", args.settings)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        profile = work / "profile.json"
        _pdctl("profile", *files, "-o", str(profile), "--prompt-lens", f"64,{args.input_len},{args.input_len * 3}",
               "--repeats", "3", "--running", "1,2,4,8", "--contexts", str(args.input_len), "--output-len",
               str(args.output_len), timeout_s=1800)  # fmt: skip
        prof = load(profile)
        n = args.input_len
        ttft_ms = args.ttft_x * (prefill_s(prof, n) + kv_s(prof, n) + decode_step_s(prof, 1, n)) * 1000
        tpot_ms = args.tpot_x * decode_step_s(prof, 1, n + args.output_len / 2) * 1000
        print(f"SLO from the profile: TTFT {ttft_ms:.0f} ms, TPOT {tpot_ms:.1f} ms", flush=True, file=sys.stderr)
        settings = json.loads(Path(args.settings).read_text(encoding="utf-8"))
        settings["slo"] = {"ttft_ms": round(ttft_ms), "tpot_ms": round(tpot_ms, 1), "p90": True}
        slo_file = work / "settings.json"
        slo_file.write_text(json.dumps(settings), encoding="utf-8")
        # The search starts at half the rate advise predicts for these lengths, so it brackets the capacity in a
        # few runs (from 1 req/s it may halve down to 1/64 req/s: 40 requests then last most of an hour).
        first = json.loads(_pdctl("advise", str(profile), "-s", str(slo_file), "--isl", str(n), "--osl",
                                  str(args.output_len), "--engines", "2", "--json", timeout_s=300).stdout)  # fmt: skip
        start = max((first.get("pd") or {}).get("rate") or 1.0, 0.05) / 2 if args.workload == "random" else 1.0
        results = work / "bench.json"
        _pdctl("bench", *files, *_workload(args), "-n", str(args.num_requests), "--max-goodput", "--search-start",
               f"{start:.3g}", "--goodput",
               f"ttft:{ttft_ms:.0f}", f"tpot:{tpot_ms:.1f}", "--no-progress", "-o", str(results),
               timeout_s=args.bench_timeout)  # fmt: skip
        runs = json.loads(results.read_text())
        runs = runs if isinstance(runs, list) else [runs]
        if args.keep_bench:
            Path(args.keep_bench).write_text(results.read_text())
        measured = runs[-1]["pdctl"].get("max_goodput_rate")
        best = max(runs, key=lambda r: (r["pdctl"]["slo"] or {}).get("met", False) * (r.get("request_rate") or 0))
        bench_file = work / "best.json"
        bench_file.write_text(json.dumps(best))
        done = _pdctl("advise", str(profile), "-s", str(slo_file), "--bench", str(bench_file), "--engines", "2",
                      "--json", timeout_s=300)  # fmt: skip
        advice = json.loads(done.stdout)
        predicted = advice["pd"]["rate"] if advice.get("pd") else None
        probes = [{"rate": r.get("request_rate"), "slo_attainment": r["pdctl"].get("slo_attainment"),
                   "met": (r["pdctl"]["slo"] or {}).get("met"), "completed": r.get("completed"),
                   "ttft_p90_ms": r.get("p90_ttft_ms"), "tpot_p90_ms": r.get("p90_tpot_ms")} for r in runs]  # fmt: skip
        ratio = predicted / measured if predicted and measured else None
        print(f"1P1D capacity at the SLO: predicted {predicted} req/s, measured {measured} req/s, "
              f"predicted/measured {ratio if ratio is None else round(ratio, 2)}")  # fmt: skip
        fields: dict[str, Any] = {
            "slo_ms": {"ttft": round(ttft_ms), "tpot": round(tpot_ms, 1)},
            "workload": {"input_len": n, "output_len": args.output_len, "requests_per_rate": args.num_requests},
            "predicted_rate": predicted, "measured_rate": measured, "predicted_over_measured": ratio,
            "probes": probes, "advice": advice, "profile": json.loads(profile.read_text()),
        }  # fmt: skip
    out = write_report(args.out, "benchmarks.advise_real", argv, started, fields)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
