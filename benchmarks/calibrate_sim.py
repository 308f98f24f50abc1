"""Fit the simulator's CPU step-time model (``pdctl.sim.timing``) to real ``pdctl bench`` runs of vLLM CPU.

    python -m benchmarks.calibrate_sim docs/data/ab3-real-2026-12-04/ab.json.gz
    python -m benchmarks.calibrate_sim results/ab-DATE/ab.json --check results/ab-DATE/unloaded.json --size small

Input: result files as ``pdctl bench -o`` writes them (a list of runs, vLLM bench's keys plus ``pdctl``; ``.gz``
read as such). What is used:

* **prefill** (TTFT): the requests of the low-load runs (``--concurrency 1``, or a rate of at most
  ``--max-rate`` req/s) that one engine served whole (path ``colocated`` or ``local``), grouped by kind
  (``pdctl.requests.kind``): median prompt tokens (``input_lens``) and median TTFT (``ttfts``). A line through
  TTFT against the prefill's FLOPs gives the achieved FLOP/s (the slope) and a fixed cost per request (the
  intercept: step overhead plus one sequence's cost, plus HTTP, which the fit folds into the step);
* **decode** (TPOT): the same requests' median TPOT (``pdctl.requests.tpots``) as steps of batch 1, plus, from
  runs at any rate where every request took both legs (``pdctl.paths`` all ``disagg``), the decode engine's own
  TPOT (``pdctl.engine[...].tpot_ms``) against its batch while busy (the mean of ``pdctl.engine_gauges``'
  running count over the samples where it was not idle): how a step grows with the batch.

Model (``Profile.step_s``): ``max(FLOPs / F, (W + KV read) / B) + step_overhead + n_seqs · seq_overhead``. F
comes from the prefill line; for each bandwidth B on a log grid, ``step_overhead`` and ``seq_overhead`` (both
≥ 0) are the least-squares solution over every point (relative errors), and the best B wins. With a small
model the memory term is a few ms at most, so B is loosely determined: read it as "the part of a decode step
that does not grow with the batch", not as the machine's DRAM bandwidth.

Prints the fitted ``Hardware`` numbers (to paste into ``CPU_CORE`` in pdctl/sim/timing.py) and a table of real
against predicted TTFT and TPOT per kind, as sim/real ratios, for the fitted numbers and for the profile now in
timing.py.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdctl.sim.timing import CPU_CORE, CPU_MODELS, Hardware, ModelShape, Profile

ONE_ENGINE_PATHS = ("colocated", "local", "", None)


@dataclass(frozen=True)
class KindPoint:
    """Medians of one kind of request served whole by one engine at low load."""

    source: str
    kind: str
    count: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None


@dataclass(frozen=True)
class DecodePoint:
    """One decode step time: ``batch`` sequences at context ``ctx`` took ``step_s``."""

    source: str
    batch: float
    ctx: int
    step_s: float


@dataclass(frozen=True)
class Fit:
    """The fitted numbers and how well they fit."""

    flops: float
    bandwidth: float
    step_overhead_s: float
    seq_overhead_s: float
    rms_rel_error: float

    def hardware(self, base: Hardware = CPU_CORE) -> Hardware:
        """``base`` with the fitted achieved rates (mfu = bw_eff = 1) and overheads."""
        return replace(base, peak_flops=self.flops, hbm_bw=self.bandwidth, mfu=1.0, bw_eff=1.0,
                       step_overhead_s=self.step_overhead_s, seq_overhead_s=self.seq_overhead_s)  # fmt: skip


# ---------------------------------------------------------------------------------------------- reading the runs
def load_runs(path: str | Path) -> list[dict[str, Any]]:
    """The runs of one results file (a list of runs, one run, or JSON lines; gzipped if it ends in .gz)."""
    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    text = raw.decode("utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    return data if isinstance(data, list) else [data]


def run_name(run: Mapping[str, Any]) -> str:
    load = run.get("pdctl", {}).get("load", {})
    conc = load.get("concurrency")
    where = f"c={conc}" if conc else f"{run.get('request_rate', '?')}/s"
    return f"{run.get('label') or '-'} {where}"


def is_low_load(run: Mapping[str, Any], max_rate: float) -> bool:
    """One request at a time, or an open-loop rate of at most ``max_rate`` req/s."""
    load = run.get("pdctl", {}).get("load", {})
    if load.get("concurrency") == 1:
        return True
    rate = run.get("request_rate")
    return isinstance(rate, int | float) and not math.isinf(rate) and 0 < rate <= max_rate


def kind_points(run: Mapping[str, Any], source: str) -> list[KindPoint]:
    """Per kind: medians of the requests one engine served whole."""
    reqs = run.get("pdctl", {}).get("requests", {})
    n = len(run.get("ttfts", []))
    kinds = reqs.get("kind") or [""] * n
    paths = reqs.get("pd_path") or [None] * n
    tpots = reqs.get("tpots") or [None] * n
    errors = run.get("errors") or [""] * n
    groups: dict[str, list[int]] = {}
    for i in range(n):
        if paths[i] in ONE_ENGINE_PATHS and not errors[i] and run["ttfts"][i]:
            groups.setdefault(kinds[i] or "all", []).append(i)
    out = []
    for kind, idx in sorted(groups.items()):
        tp = [tpots[i] for i in idx if tpots[i]]
        out.append(
            KindPoint(
                source=source,
                kind=kind,
                count=len(idx),
                prompt_tokens=round(statistics.median(run["input_lens"][i] for i in idx)),
                output_tokens=round(statistics.median(run["output_lens"][i] for i in idx)),
                ttft_s=statistics.median(run["ttfts"][i] for i in idx),
                tpot_s=statistics.median(tp) if tp else None,
            )
        )
    return out


def decode_engine_points(run: Mapping[str, Any], source: str) -> list[DecodePoint]:
    """The decode engine's TPOT against its busy batch, from a run where every request took both legs."""
    pd = run.get("pdctl", {})
    paths = pd.get("paths") or {}
    if not paths or set(paths) != {"disagg"}:
        return []
    ctx = round(statistics.median(run["input_lens"]) + statistics.median(run["output_lens"]) / 2)
    out = []
    for url, eng in (pd.get("engine") or {}).items():
        tpot_ms = eng.get("tpot_ms")
        series = (pd.get("engine_gauges") or {}).get(url, {}).get("series") or []
        busy = [s[1] for s in series if len(s) > 1 and s[1] > 0]
        if tpot_ms and busy:
            out.append(DecodePoint(f"{source} {url}", statistics.mean(busy), ctx, tpot_ms / 1000))
    return out


def collect(paths: Sequence[str | Path], max_rate: float) -> tuple[list[KindPoint], list[DecodePoint]]:
    kinds: list[KindPoint] = []
    decode: list[DecodePoint] = []
    for path in paths:
        for run in load_runs(path):
            source = f"{Path(path).name} {run_name(run)}"
            if is_low_load(run, max_rate):
                kinds += kind_points(run, source)
            decode += decode_engine_points(run, source)
    return kinds, decode


# ---------------------------------------------------------------------------------------------- the fit
def _prefill_profile(model: ModelShape) -> Profile:
    return Profile("fit", model, replace(CPU_CORE, peak_flops=1.0, mfu=1.0))


def fit_prefill(model: ModelShape, points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(FLOP/s, fixed seconds) of the least-squares line TTFT = FLOPs / F + a over (prompt tokens, TTFT) points."""
    flops_of = _prefill_profile(model).prefill_flops
    xs = [flops_of(tokens, 0) for tokens, _ in points]
    ys = [t for _, t in points]
    if len(set(xs)) < 2:
        raise ValueError("the prefill fit needs prompts of at least two lengths (e.g. short and long)")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError("TTFT does not grow with the prompt: no prefill cost to fit")
    return 1.0 / slope, my - slope * mx


@dataclass(frozen=True)
class Step:
    """One engine step: prefill chunks (new, past), then ``batch`` decode sequences at context ``ctx`` (a
    fractional batch, such as a mean, interpolates between the whole batches around it)."""

    prefill: tuple[tuple[int, int], ...] = ()
    ctx: int = 0
    batch: float = 0.0

    def model_s(self, profile: Profile) -> float:
        lo = math.floor(self.batch)
        t = profile.step_s(self.prefill, [self.ctx] * lo)
        frac = self.batch - lo
        return t + frac * (profile.step_s(self.prefill, [self.ctx] * (lo + 1)) - t) if frac else t


@dataclass(frozen=True)
class Observation:
    """A measured time the fit explains: steps run one after another (a TTFT: the prompt's chunks; a TPOT: one
    decode step) and the seconds they took."""

    steps: tuple[Step, ...]
    seconds: float

    def model_s(self, profile: Profile) -> float:
        return sum(st.model_s(profile) for st in self.steps)

    @property
    def seq_steps(self) -> float:
        """Sequences summed over the steps: what multiplies ``seq_overhead_s``."""
        return sum(len(st.prefill) + st.batch for st in self.steps)


def prefill_steps(prompt_tokens: int, max_num_batched_tokens: int) -> tuple[Step, ...]:
    """A prompt alone on an engine: chunks of at most ``max_num_batched_tokens``, one step each."""
    return tuple(
        Step(((min(max_num_batched_tokens, prompt_tokens - past), past),))
        for past in range(0, prompt_tokens, max_num_batched_tokens)
    )


def _overheads(
    base: Sequence[float], steps: Sequence[float], seqs: Sequence[float], ys: Sequence[float]
) -> tuple[float, float, float]:
    """Least squares for y ≈ base + k·o + n·s (k steps, n sequence-steps) in relative error, o, s ≥ 0:
    (o, s, rms relative error)."""
    w = [1.0 / y for y in ys]
    r = [y - b for y, b in zip(ys, base, strict=True)]

    def err(o: float, s: float) -> float:
        return math.sqrt(
            statistics.fmean((wi * (ri - k * o - s * n)) ** 2 for wi, ri, k, n in zip(w, r, steps, seqs, strict=True))
        )

    # Normal equations of the weighted problem: minimise Σ (w·(r - k·o - n·s))²; w·k and w·n are the columns.
    c1 = [wi * k for wi, k in zip(w, steps, strict=True)]
    c2 = [wi * n for wi, n in zip(w, seqs, strict=True)]
    wr = [wi * ri for wi, ri in zip(w, r, strict=True)]
    a11 = sum(x * x for x in c1)
    a12 = sum(x * y for x, y in zip(c1, c2, strict=True))
    a22 = sum(x * x for x in c2)
    b1 = sum(x * y for x, y in zip(c1, wr, strict=True))
    b2 = sum(x * y for x, y in zip(c2, wr, strict=True))
    det = a11 * a22 - a12 * a12
    candidates = []
    if det > 1e-12 * a11 * a22:
        o, s = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        if o >= 0 and s >= 0:
            candidates.append((o, s))
    candidates.append((max(0.0, b1 / a11), 0.0))
    candidates.append((0.0, max(0.0, b2 / a22)))
    best = min(candidates, key=lambda c: err(*c))
    return best[0], best[1], err(*best)


def fit_steps(model: ModelShape, flops: float, observations: Sequence[Observation]) -> Fit:
    """Given the FLOP/s, the bandwidth and both overheads that best explain ``observations`` (relative error)."""
    ys = [ob.seconds for ob in observations]
    ks = [float(len(ob.steps)) for ob in observations]
    seqs = [ob.seq_steps for ob in observations]

    def solve(bw: float) -> Fit:
        hw = replace(CPU_CORE, peak_flops=flops, hbm_bw=bw, mfu=1.0, bw_eff=1.0, step_overhead_s=0.0,
                     seq_overhead_s=0.0)  # fmt: skip
        prof = Profile("fit", model, hw)
        base = [ob.model_s(prof) for ob in observations]
        o, s, e = _overheads(base, ks, seqs, ys)
        return Fit(flops, bw, o, s, e)

    grid = [10 ** (8 + 5 * i / 200) for i in range(201)]  # 100 MB/s .. 10 TB/s
    fits = [solve(bw) for bw in grid]
    i = min(range(len(fits)), key=lambda k: fits[k].rms_rel_error)
    lo, hi = math.log(grid[max(0, i - 1)]), math.log(grid[min(len(grid) - 1, i + 1)])
    for _ in range(60):  # golden-section refinement between the neighbours
        m1, m2 = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
        if solve(math.exp(m1)).rms_rel_error <= solve(math.exp(m2)).rms_rel_error:
            hi = m2
        else:
            lo = m1
    return min([fits[i], solve(math.exp((lo + hi) / 2))], key=lambda f: f.rms_rel_error)


def tpot_observation(kind: KindPoint) -> list[Observation]:
    """A decode step of batch 1 halfway through a request of this kind (its TPOT), if it has one."""
    if kind.tpot_s is None or kind.output_tokens < 2:
        return []
    return [Observation((Step(ctx=kind.prompt_tokens + kind.output_tokens // 2, batch=1.0),), kind.tpot_s)]


def fit(
    model: ModelShape, kinds: Sequence[KindPoint], decode: Sequence[DecodePoint], max_num_batched_tokens: int
) -> Fit:
    """Prefill line first (FLOP/s), then bandwidth and overheads over every observation."""
    flops, _ = fit_prefill(model, [(k.prompt_tokens, k.ttft_s) for k in kinds])
    obs = [Observation(prefill_steps(k.prompt_tokens, max_num_batched_tokens), k.ttft_s) for k in kinds]
    for k in kinds:
        obs += tpot_observation(k)
    obs += [Observation((Step(ctx=d.ctx, batch=d.batch),), d.step_s) for d in decode]
    return fit_steps(model, flops, obs)


# ---------------------------------------------------------------------------------------------- predictions
def predict(profile: Profile, kind: KindPoint, max_num_batched_tokens: int) -> tuple[float, float | None]:
    """(TTFT, TPOT) of one request of this kind alone on an engine of ``profile``: its prefill chunks, then
    decode steps of batch 1 (TPOT = their mean)."""
    ttft = sum(st.model_s(profile) for st in prefill_steps(kind.prompt_tokens, max_num_batched_tokens))
    if kind.output_tokens < 2:
        return ttft, None
    steps = [profile.step_s([], [kind.prompt_tokens + i]) for i in range(1, kind.output_tokens)]
    return ttft, statistics.fmean(steps)


def ratio_rows(
    profile: Profile, kinds: Iterable[KindPoint], max_num_batched_tokens: int
) -> list[tuple[str, str, float, float]]:
    """(source, metric, real ms, sim ms) per kind."""
    rows = []
    for k in kinds:
        ttft, tpot = predict(profile, k, max_num_batched_tokens)
        rows.append((k.source, f"TTFT {k.kind} ({k.prompt_tokens} tokens)", k.ttft_s * 1000, ttft * 1000))
        if k.tpot_s is not None and tpot is not None:
            rows.append((k.source, f"TPOT {k.kind} ({k.output_tokens} tokens)", k.tpot_s * 1000, tpot * 1000))
    return rows


def markdown(rows: Sequence[tuple[str, str, float, float]], label: str) -> list[str]:
    lines = [f"| run | metric | real ms | {label} ms | sim/real |", "|---|---|---:|---:|---:|"]
    for source, metric, real, sim in rows:
        lines.append(f"| {source} | {metric} | {real:.1f} | {sim:.1f} | {sim / real:.2f} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="pdctl bench results (.json or .json.gz)")
    p.add_argument("--size", default="small", choices=sorted(CPU_MODELS), help="the model the runs served")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="the engines' prefill chunk (vLLM CPU's default for the API server: 2048)",
    )
    p.add_argument("--max-rate", type=float, default=1.0, help="runs at most this rate count as low load (req/s)")
    p.add_argument(
        "--check",
        nargs="*",
        default=[],
        metavar="RESULTS",
        help="more results whose low-load points go into the table but not into the fit",
    )
    p.add_argument("--json", dest="json_out", help="also write the fit and the table here")
    args = p.parse_args(argv)

    model = CPU_MODELS[args.size]
    kinds, decode = collect(args.results, args.max_rate)
    if not kinds:
        print("error: no low-load run (concurrency 1 or rate <= --max-rate) in the files", file=sys.stderr)
        return 1
    try:
        result = fit(model, kinds, decode, args.max_num_batched_tokens)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    hw = result.hardware()

    print(f"model {model.name}: {model.params_total / 1e6:.1f}M parameters, W = {model.weight_bytes / 1e6:.1f} MB, "
          f"KV {model.kv_bytes_per_token} B/token")  # fmt: skip
    print("\nlow-load points (median per kind):")
    for k in kinds:
        tpot = f"{k.tpot_s * 1000:.1f}" if k.tpot_s is not None else "-"
        print(f"  {k.source}: {k.kind} x{k.count}, {k.prompt_tokens} tokens -> TTFT {k.ttft_s * 1000:.1f} ms, "
              f"{k.output_tokens} out, TPOT {tpot} ms")  # fmt: skip
    if decode:
        print("decode engine, step time against its busy batch:")
        for d in decode:
            print(f"  {d.source}: batch {d.batch:.2f} at ctx {d.ctx} -> {d.step_s * 1000:.1f} ms")
    print(
        "\nfitted Hardware (pdctl/sim/timing.py CPU_CORE):\n"
        f"  peak_flops={result.flops:.4g}  # achieved FLOP/s, mfu=1.0\n"
        f"  hbm_bw={result.bandwidth:.4g}  # achieved bytes/s, bw_eff=1.0\n"
        f"  step_overhead_s={result.step_overhead_s:.4g}\n"
        f"  seq_overhead_s={result.seq_overhead_s:.4g}\n"
        f"  rms relative error over the points: {result.rms_rel_error:.1%}"
    )
    checked, _ = collect(args.check, args.max_rate)
    kinds = [*kinds, *checked]
    fitted = Profile(f"fitted-{args.size}", model, hw)
    current = Profile(f"cpu-{args.size}", model, CPU_CORE)
    for label, prof in (("fitted", fitted), (current.name, current)):
        print(f"\nreal vs predicted, {label}:\n")
        print("\n".join(markdown(ratio_rows(prof, kinds, args.max_num_batched_tokens), label)))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {"fit": result.__dict__, "model": model.name,
                 "rows": [dict(zip(("run", "metric", "real_ms", "sim_ms"), r, strict=True))
                          for r in ratio_rows(fitted, kinds, args.max_num_batched_tokens)]},
                indent=2,
            ) + "\n"
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
