"""Real vLLM CPU: how often ``pdctl verify`` cries wolf on a fresh start, and whether it catches a broken link.

Fresh runs (the newcomer's path, as ``scripts/demo.sh`` does it, on a copy of ``examples/cpu`` moved to free
ports): ``pdctl up -d``, ``pdctl verify --json`` at once, ``pdctl down``; every ``--loaded-every``-th run beside
``--hogs`` busy-looping processes, every ``--cold-every``-th with empty compile caches. Recorded per
run: the verdict, the failed checks, and per probe the first difference (position, token ids, margins,
verdict) and the batch context (each worker's running + waiting requests just before each leg).

Broken runs: a decode that loads *different weights* (``pdctl model tiny --seed 1``) under the same model
path, served name and tokenizer: prefill starts on a symlink to the seed-0 model, the symlink is switched to
the seed-1 model, then decode starts. Identity passes (same root, name, tokenizer, vLLM); only the output
check can tell. Detected = ``kv_correctness`` failed with a clear-margin difference.

Each run takes ``--lock`` (``/tmp/pdctl-real.lock``) for itself only, so other real-vLLM work on the machine
interleaves. Results are rewritten to ``--out`` after every run.

    PYTHONPATH=. .venv/bin/python -m benchmarks.verify_false_alarms --runs 44 --loaded-every 2 --cold-every 4 --hogs 2 \\
        --broken 3 --out results/verify_false_alarms.json
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import tomlkit

from pdctl import config
from pdctl.runtime.plan import GATEWAY_HOLD_ENV, ProcessSpec, build_plan
from pdctl.testing import free_port, wait_until_ready
from pdctl.verify import metric_total, run_verify

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cpu"
MODEL_REL = "../../models/tiny-qwen3"
KEY = "verify-bench-key-not-secret"


def _pdctl(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PDCTL_API_KEY": KEY, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "pdctl", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@contextlib.contextmanager
def _locked(path: str) -> Iterator[float]:
    """Hold the machine's real-engine lock (none for ``""``: the caller holds it); yields the seconds waited."""
    start = time.monotonic()
    if not path:
        yield 0.0
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - start
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _hogs(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _probe_records(report: dict[str, Any]) -> list[dict[str, Any]]:
    for c in report.get("checks", []):
        if c["name"].startswith("kv_correctness"):
            return list(c.get("data", {}).get("probes", []))
    return []


def _clear_compile_caches() -> None:
    """Empty vLLM's and torch inductor's compile caches, as on a machine that never ran vLLM."""
    for cache in [Path.home() / ".cache" / "vllm", *Path(tempfile.gettempdir()).glob("torchinductor_*")]:
        shutil.rmtree(cache, ignore_errors=True)


def example_copy(dst: Path) -> list[str]:
    """``examples/cpu`` copied to ``dst`` on free ports (a running demo keeps the example's own), as ``-c``/``-s`` args.

    Everything else is the example as shipped; the model path becomes absolute so the copy serves the same model.
    """
    dst.mkdir(parents=True, exist_ok=True)
    doc = tomlkit.parse((EXAMPLE / "config.toml").read_text(encoding="utf-8"))
    for table in ("prefill", "decode"):
        worker = doc[table]
        assert isinstance(worker, dict)
        worker["model"] = str((EXAMPLE / str(worker["model"])).resolve())
        if "side_channel_port" in worker:
            worker["side_channel_port"] = free_port()
    (dst / "config.toml").write_text(tomlkit.dumps(doc), encoding="utf-8")
    settings = json.loads((EXAMPLE / "settings.json").read_text(encoding="utf-8"))
    settings["gateway"]["listen"] = f"127.0.0.1:{free_port()}"
    for key in ("prefill_endpoint", "decode_endpoint"):
        settings["routing"][key] = f"http://127.0.0.1:{free_port()}"
    (dst / "settings.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return ["-c", str(dst / "config.toml"), "-s", str(dst / "settings.json")]


def fresh_run(conf: list[str], loaded: bool, hogs: int, lock: str, cold: bool = False) -> dict[str, Any]:
    """One fresh start of examples/cpu, verify at once, down; under the lock (and the hogs when loaded).

    ``cold`` empties the compile caches first (under the lock, so no other engine is using them).
    """
    with _locked(lock) as waited, _hogs(hogs if loaded else 0):
        if cold:
            _clear_compile_caches()
        load_1m = os.getloadavg()[0]
        t0 = time.monotonic()
        up = _pdctl("up", "-d", *conf, timeout=1500)
        up_s = time.monotonic() - t0
        rec: dict[str, Any] = {"kind": "fresh", "loaded": loaded, "cold": cold, "lock_wait_s": round(waited, 1)}
        rec["load_1m_at_start"] = round(load_1m, 2)
        rec["up_rc"], rec["up_s"] = up.returncode, round(up_s, 1)
        try:
            if up.returncode != 0:
                rec["error"] = (up.stdout + up.stderr)[-1500:]
                return rec
            t1 = time.monotonic()
            ver = _pdctl("verify", *conf, "--json", "--timeout", "300", timeout=1500)
            rec["verify_s"] = round(time.monotonic() - t1, 1)
            rec["verify_rc"] = ver.returncode
            try:
                report = json.loads(ver.stdout)
            except ValueError:
                rec["error"] = (ver.stdout + ver.stderr)[-1500:]
                return rec
            rec["ok"] = report["ok"]
            rec["failed"] = [c["name"] for c in report["checks"] if c["ok"] is False]
            rec["skipped"] = [c["name"] for c in report["checks"] if c["ok"] is None]
            rec["kv_correctness"] = next(
                ({k: c.get(k) for k in ("ok", "detail", "cause")} for c in report["checks"]
                 if c["name"].startswith("kv_correctness")), None,
            )  # fmt: skip
            rec["probes"] = _probe_records(report)
        finally:
            rec["down_rc"] = _pdctl("down", *conf, timeout=300).returncode
    return rec


def _spawn(spec: ProcessSpec, logs: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in spec.unset_env}
    env.update(spec.env)
    env.pop(GATEWAY_HOLD_ENV, None)
    if spec.ipc_dir is not None:  # vLLM binds its IPC sockets there and does not create it (pdctl.runtime.plan.IPC_ENV)
        Path(spec.ipc_dir).mkdir(parents=True, exist_ok=True)
    with (logs / f"{spec.name}.log").open("wb") as out:
        return subprocess.Popen(
            list(spec.argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )  # fmt: skip


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def broken_run(seed0: Path, seed1: Path, lock: str, ready_timeout_s: float = 900.0) -> dict[str, Any]:
    """A decode with other weights under the same path and name; returns what verify's link checks said."""
    with _locked(lock) as waited, tempfile.TemporaryDirectory(prefix="pdctl-broken-") as tmp:
        folder = Path(tmp)
        link = folder / "model"
        link.symlink_to(seed0.resolve())
        # examples/cpu on ports picked here, so a running demo (8000, 8100, 8200, 5600, 5700) does not matter
        ctext = (EXAMPLE / "config.toml").read_text(encoding="utf-8").replace(f'"{MODEL_REL}"', f'"{link}"')
        stext = (EXAMPLE / "settings.json").read_text(encoding="utf-8")
        for old in ("side_channel_port = 5600", "side_channel_port = 5700"):
            ctext = ctext.replace(old, f"side_channel_port = {free_port()}")
        for old in ("127.0.0.1:8000", "127.0.0.1:8100", "127.0.0.1:8200"):
            stext = stext.replace(old, f"127.0.0.1:{free_port()}")
        (folder / "config.toml").write_text(ctext, encoding="utf-8")
        (folder / "settings.json").write_text(stext, encoding="utf-8")
        dep = config.load(folder / "config.toml", folder / "settings.json")
        logs = dep.run_dir / "logs"
        logs.mkdir(parents=True)
        plan = build_plan(dep)
        procs: list[subprocess.Popen[bytes]] = []
        rec: dict[str, Any] = {"kind": "broken", "lock_wait_s": round(waited, 1)}
        try:
            pspec, dspec = plan.get("prefill"), plan.get("decode")
            procs.append(_spawn(pspec, logs))
            wait_until_ready(procs[-1], pspec.ready_url, ready_timeout_s, name=pspec.name)
            link.unlink()
            link.symlink_to(seed1.resolve())  # decode loads the seed-1 weights from the same path
            procs.append(_spawn(dspec, logs))
            wait_until_ready(procs[-1], dspec.ready_url, ready_timeout_s, name=dspec.name)
            report = run_verify(dep, logs_dir=logs, timeout_s=300.0, api_key=KEY)
        except RuntimeError as exc:
            rec["error"] = str(exc)
            return rec
        finally:
            _stop(procs)
        checks = {c.name.split("[")[0]: c for c in report.checks if "[" in c.name}
        rec["identity_ok"] = checks["identity"].ok
        rec["identity"] = checks["identity"].detail
        corr = checks["kv_correctness"]
        rec["kv_correctness"] = {"ok": corr.ok, "detail": corr.detail, "cause": corr.cause}
        rec["probes"] = list(corr.data.get("probes", []))
        rec["detected"] = corr.ok is False and "corrupted" in (corr.cause or "")
    return rec


def batch_experiment(conf: list[str], prompts: int, lock: str) -> dict[str, Any]:
    """Is vLLM CPU batch-invariant? Each prompt greedy on decode alone, then again beside 3 other requests.

    Records per prompt whether the tokens differ, the first difference's verdict, and the logprob drift.
    """
    import concurrent.futures

    from pdctl.verify.proof import drift, first_divergence, parse_sample

    decode = "http://127.0.0.1:8200"
    rec: dict[str, Any] = {"kind": "batch_experiment", "prompts": []}
    with _locked(lock) as waited:
        rec["lock_wait_s"] = round(waited, 1)
        up = _pdctl("up", "-d", *conf, timeout=1500)
        if up.returncode != 0:
            rec["error"] = (up.stdout + up.stderr)[-1500:]
            return rec
        try:
            with httpx.Client(timeout=300, trust_env=False) as client:

                def greedy(prompt: str, max_tokens: int = 8) -> Any:
                    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True, "logprobs": 5,
                            "return_tokens_as_token_ids": True, "cache_salt": os.urandom(8).hex()}  # fmt: skip
                    return client.post(f"{decode}/v1/completions", json=body).json()

                for i in range(prompts):
                    prompt = f"batch experiment {i} " + " ".join(f"w{j % 97}" for j in range(40 + 37 * i))
                    alone = parse_sample(greedy(prompt))
                    with concurrent.futures.ThreadPoolExecutor(4) as pool:
                        others = [pool.submit(greedy, f"neighbour {i}.{k} " + "x " * 300, 400) for k in range(3)]
                        time.sleep(1.0)  # the neighbours are decoding when the probe arrives
                        metrics = client.get(f"{decode}/metrics").text
                        running = metric_total(metrics, "vllm:num_requests_running")
                        shared = parse_sample(pool.submit(greedy, prompt).result())
                        for f in others:
                            f.result()
                    if alone is None or shared is None:
                        rec["prompts"].append({"error": "no token ids"})
                        continue
                    div = first_divergence(alone, shared)
                    rec["prompts"].append({
                        "differ": div is not None,
                        "divergence": div.to_json() if div else None,
                        "drift": drift(alone, shared),
                        "running_at_probe": running,
                    })  # fmt: skip
        finally:
            rec["down_rc"] = _pdctl("down", *conf, timeout=300).returncode
    return rec


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """False alarms among fresh runs (quiet / loaded) and the detection rate among broken runs."""
    fresh = [r for r in runs if r["kind"] == "fresh" and "ok" in r]
    broken = [r for r in runs if r["kind"] == "broken" and "detected" in r]

    def part(rs: list[dict[str, Any]]) -> dict[str, Any]:
        divs = [p["divergence"] for r in rs for p in r.get("probes", []) if p.get("divergence")]
        ties = [p["first_tie"] for r in rs for p in r.get("probes", []) if p.get("first_tie")]
        return {
            "runs": len(rs),
            "false_alarms": sum(1 for r in rs if "kv_correctness[prefill->decode]" in r.get("failed", [])),
            "verify_failed": sum(1 for r in rs if not r["ok"]),
            "divergences": divs,
            "ties_rerun": ties,
        }

    exp = [p for r in runs if r["kind"] == "batch_experiment" for p in r.get("prompts", []) if "differ" in p]
    return {
        "batch_experiment": {
            "prompts": len(exp),
            "tokens_differ": sum(1 for p in exp if p["differ"]),
            "logprobs_moved": sum(1 for p in exp if p["drift"]),
        },
        "quiet": part([r for r in fresh if not r["loaded"]]),
        "cold": part([r for r in fresh if r.get("cold")]),
        "loaded": part([r for r in fresh if r["loaded"]]),
        "start_failures": sum(1 for r in runs if r["kind"] == "fresh" and "ok" not in r),
        "broken_runs": len(broken),
        "broken_detected": sum(1 for r in broken if r["detected"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=4, help="fresh-start runs")
    ap.add_argument("--loaded-every", type=int, default=2, help="every Nth fresh run beside the hogs (0: none)")
    ap.add_argument(
        "--cold-every", type=int, default=0, help="every Nth fresh run (from the first) with empty compile caches"
    )
    ap.add_argument("--hogs", type=int, default=2, help="busy-looping processes during a loaded run")
    ap.add_argument("--broken", type=int, default=1, help="broken-link runs (decode with other weights)")
    ap.add_argument("--lock", default="/tmp/pdctl-real.lock", help='taken per run; "" when the caller holds it')
    ap.add_argument(
        "--models",
        type=Path,
        default=ROOT / "models",
        help="folder for the broken runs' seed-0 and seed-1 models (fresh runs serve examples/cpu's own)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "verify_false_alarms.json")
    ap.add_argument("--batch-experiment", type=int, default=0, help="prompts: alone vs beside 3 others (0: skip)")
    ap.add_argument("--stop-after-s", type=float, default=None, help="start no run after this many seconds")
    args = ap.parse_args()
    # SIGTERM (a timeout, a test's teardown) unwinds like Ctrl-C: each run's `finally` stops what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.monotonic() + args.stop_after_s if args.stop_after_s else None
    conf = example_copy(Path(tempfile.mkdtemp(prefix="pdctl-verify-bench-")))
    seed0, seed1 = args.models / "tiny-qwen3", args.models / "tiny-qwen3-seed1"
    needed = [(ROOT / "models" / "tiny-qwen3", "0")] if args.runs else []
    needed += [(seed0, "0"), (seed1, "1")] if args.broken else []
    for path, seed in needed:
        made = _pdctl("model", "tiny", str(path), "--seed", seed, timeout=600)
        if made.returncode != 0:
            sys.exit(f"pdctl model tiny {path} --seed {seed} failed:\n{made.stdout}{made.stderr}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    if args.batch_experiment:
        runs.append(batch_experiment(conf, args.batch_experiment, args.lock))
        print(json.dumps(runs[-1], indent=1), flush=True)
        args.out.write_text(json.dumps({"summary": summarize(runs), "runs": runs}, indent=1, ensure_ascii=False))
    fresh = [
        (
            "fresh",
            bool(args.loaded_every) and (i + 1) % args.loaded_every == 0,
            bool(args.cold_every) and i % args.cold_every == 0,
        )
        for i in range(args.runs)
    ]
    # The first fresh run goes first (with --cold-every, a cold start as on a new machine), then the broken ones.
    plan = fresh[:1] + [("broken", False, False)] * args.broken + fresh[1:]
    for i, (kind, loaded, cold) in enumerate(plan):
        if deadline is not None and time.monotonic() > deadline:
            print(f"--stop-after-s reached: {i} of {len(plan)} runs done", flush=True)
            break
        started = datetime.now(UTC).isoformat(timespec="seconds")
        if kind == "broken":
            rec = broken_run(seed0, seed1, args.lock)
        else:
            rec = fresh_run(
                example_copy(Path(tempfile.mkdtemp(prefix="pdctl-verify-bench-"))),
                loaded,
                args.hogs,
                args.lock,
                cold=cold,
            )
        rec["index"], rec["started"] = i, started
        runs.append(rec)
        verdict = rec.get("detected", rec.get("ok", rec.get("error", "?")))
        tags = "".join([" loaded" if loaded else "", " cold" if cold else ""])
        print(f"[{i + 1}/{len(plan)}] {kind}{tags}: {verdict}", flush=True)
        args.out.write_text(json.dumps({"summary": summarize(runs), "runs": runs}, indent=1, ensure_ascii=False))
    print(json.dumps(summarize(runs), indent=1))


if __name__ == "__main__":
    main()
