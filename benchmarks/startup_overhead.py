"""Real vLLM CPU: time from ``pdctl up`` to gateway ready vs starting the two engines by hand.

1. ``pdctl up -d -c CONFIG -s SETTINGS`` (returns once the gateway is ready: workers healthy, warm-up P->D
   request done, gateway listening), timed; each output line is stamped, and the phases are read from the
   supervisor's own event log (``logs/pdctl.log``, millisecond stamps): first process started, workers
   ready, warm-up passed, gateway released (it starts with the workers, held until then), gateway ready;
   then ``pdctl down``.
2. By hand: the two worker processes exactly as ``pdctl plan --json`` lists them (argv, env, unset env),
   started together in their own sessions; timed until both answer ``/health`` 200, and then until one PD
   request by hand (leg 1 on prefill, leg 2 on decode, :mod:`pdctl.vllm.protocol`) has finished, which pays the
   lazy NIXL handshake that ``pdctl up``'s warm-up pays.

Overhead = pdctl up - by hand (health + first PD request); target <= 5 %. Uses the ports in the config
(examples/cpu: 8000, 8100, 8200, 5600, 5700): nothing else may be using them. Needs the tiny model
(``pdctl model tiny models/tiny-qwen3``) and vLLM CPU in .venv.

    PDCTL_API_KEY=... .venv/bin/python -m benchmarks.startup_overhead [-c examples/cpu/config.toml]
        [-s examples/cpu/settings.json] [--order up-first|hand-first]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks import _harness as H
from pdctl.config import load
from pdctl.runtime.pgroup import signal_group
from pdctl.runtime.probe import two_legs
from pdctl.testing import stop_group

BENCH = Path(__file__).resolve().parent
PDCTL = str(Path(H.PY).parent / "pdctl")


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2.0).status_code == 200
    return False


_EVENT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) \S+\s+(.*)$")
# phase name -> the supervisor's event message it starts with (the first such line counts)
_PHASES = {
    "first_process_started_s": "started ",
    "prefill_ready_s": "prefill is ready",
    "decode_ready_s": "decode is ready",
    "warmup_passed_s": "warm-up probe passed",
    "gateway_released_s": "released gateway",
    "gateway_ready_s": "gateway is ready",
}


def up_phases(event_log: Path, t0_wall: float) -> dict[str, float]:
    """Seconds from ``pdctl up`` to each phase, from the stamped lines of the supervisor's event log."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in event_log.read_text(encoding="utf-8").splitlines():
            m = _EVENT.match(line)
            if not m:
                continue
            ts = datetime.fromisoformat(m.group(1)).timestamp()
            for phase, prefix in _PHASES.items():
                if phase not in out and m.group(2).startswith(prefix):
                    out[phase] = round(ts - t0_wall, 2)
    if "prefill_ready_s" in out and "decode_ready_s" in out:
        out["workers_ready_s"] = max(out["prefill_ready_s"], out["decode_ready_s"])
    if "gateway_ready_s" in out and "warmup_passed_s" in out:
        out["gateway_after_warmup_s"] = round(out["gateway_ready_s"] - out["warmup_passed_s"], 2)
    return out


def pdctl_cpu(run_dir: Path) -> dict[str, float]:
    """CPU seconds (user + system) the supervisor, its watchdog and the gateway used so far."""
    state = json.loads((run_dir / "state.json").read_text(encoding="utf-8"))
    pids = {"supervisor": state["supervisor_pid"], "watchdog": state["watchdog_pid"]}
    pids |= {p["name"]: p["pid"] for p in state["processes"] if p["role"] == "gateway"}
    out: dict[str, float] = {}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[name] = round(t.user + t.system, 2)
    return out


def time_up(config: str, settings: str, env: dict[str, str]) -> dict[str, Any]:
    t0_wall = time.time()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [PDCTL, "up", "-d", "-c", config, "-s", settings], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=env, text=True, cwd=H.ROOT,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((round(time.monotonic() - t0, 2), line.rstrip()))
    _, status, usage = os.wait4(proc.pid, 0)  # wait4: the CLI's own CPU time as well
    rc = proc.returncode = os.waitstatus_to_exitcode(status)
    total = time.monotonic() - t0
    run_dir = load(config, settings).run_dir
    phases = up_phases(run_dir / "logs" / "pdctl.log", t0_wall)
    cpu = {"cli": round(usage.ru_utime + usage.ru_stime, 2), **pdctl_cpu(run_dir)}
    plan = json.loads(subprocess.run([PDCTL, "plan", "-c", config, "-s", settings, "--json"], capture_output=True,
                                     text=True, env=env, check=True, cwd=H.ROOT).stdout)  # fmt: skip
    gw = next(p for p in plan["processes"] if p["role"] == "gateway")
    ready = _healthy(gw["url"] + "/ready")
    down = subprocess.run([PDCTL, "down", "-c", config, "-s", settings], capture_output=True, text=True, env=env,
                          cwd=H.ROOT, timeout=300)  # fmt: skip
    return {"rc": rc, "seconds": total, "phases": phases, "pdctl_cpu_s": cpu, "gateway_ready_after": ready,
            "lines": lines[-60:], "down_rc": down.returncode}  # fmt: skip


def time_by_hand(config: str, settings: str, env: dict[str, str]) -> dict[str, Any]:
    plan = json.loads(subprocess.run([PDCTL, "plan", "-c", config, "-s", settings, "--json"], capture_output=True,
                                     text=True, env=env, check=True, cwd=H.ROOT).stdout)  # fmt: skip
    workers = [p for p in plan["processes"] if p["role"] in ("prefill", "decode")]
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []
    out: dict[str, Any] = {"argv": [p["argv"] for p in workers]}
    t0 = time.monotonic()
    try:
        for p in workers:
            penv = {k: v for k, v in env.items() if k not in p.get("unset_env", [])} | p["env"]
            if p.get("ipc_dir"):  # as `pdctl plan` says: vLLM binds its IPC sockets there, and does not create it
                Path(p["ipc_dir"]).mkdir(parents=True, exist_ok=True)
            log = open(f"/tmp/pdbench-hand-{p['name']}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(p["argv"], env=penv, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
        pending = {p["name"]: p["ready_url"] for p in workers}
        deadline = t0 + 1200
        while pending and time.monotonic() < deadline:
            for name, url in list(pending.items()):
                if _healthy(url):
                    out[f"{name}_healthy_s"] = round(time.monotonic() - t0, 2)
                    del pending[name]
            for pr in procs:
                if pr.poll() is not None:
                    raise RuntimeError(f"a worker exited with {pr.returncode}; see /tmp/pdbench-hand-*.log")
            time.sleep(0.2)
        if pending:
            raise RuntimeError(f"not healthy after 1200 s: {sorted(pending)}")
        out["health_s"] = time.monotonic() - t0
        pre = next(p for p in workers if p["role"] == "prefill")
        dec = next(p for p in workers if p["role"] == "decode")
        model = pre["argv"][pre["argv"].index("--served-model-name") + 1]
        body = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 4}
        with httpx.Client(timeout=900) as c:
            legs = two_legs(c, pre["url"], dec["url"], body, "params", "startup-overhead", require_params=False)
        out["first_pd_status"] = legs.decode_status
        out["seconds"] = time.monotonic() - t0
    finally:
        for pr in procs:
            signal_group(pr.pid, signal.SIGTERM)
        for pr in procs:
            stop_group(pr, 60)
        for log in logs:
            log.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default="examples/cpu/config.toml")
    ap.add_argument("-s", "--settings", default="examples/cpu/settings.json")
    ap.add_argument("--order", choices=["up-first", "hand-first"], default="up-first")
    ap.add_argument("--out", default=str(BENCH / "results" / "startup_overhead.json"))
    args = ap.parse_args(argv)
    env = dict(os.environ)
    env.setdefault("PDCTL_API_KEY", "pdbench-startup-key")
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "-m", "benchmarks.startup_overhead", *sys.argv[1:]]),
        "machine_before": H.machine(),
        "order": args.order,
    }
    steps = ["up", "hand"] if args.order == "up-first" else ["hand", "up"]
    for step in steps:
        print(f"# {step} ...", file=sys.stderr, flush=True)
        if step == "up":
            report["up"] = time_up(args.config, args.settings, env)
        else:
            report["hand"] = time_by_hand(args.config, args.settings, env)
        print(f"# {step}: {report[step]['seconds']:.1f} s", file=sys.stderr, flush=True)
        time.sleep(5)  # let the ports and memory free up between the two
    up_s, hand_s, health_s = report["up"]["seconds"], report["hand"]["seconds"], report["hand"]["health_s"]
    report["overhead_pct_vs_first_pd"] = 100 * (up_s - hand_s) / hand_s
    report["overhead_pct_vs_health"] = 100 * (up_s - health_s) / health_s
    report["machine_after"] = H.machine()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("| measurement | seconds |\n|---|---:|")
    print(f"| pdctl up -d (workers healthy, warm-up P->D request, gateway ready) | {up_s:.1f} |")
    for phase, secs in report["up"]["phases"].items():
        print(f"| pdctl up: {phase} | {secs:.2f} |")
    for name, secs in report["up"]["pdctl_cpu_s"].items():
        print(f"| pdctl up: CPU seconds of the {name} process | {secs:.2f} |")
    print(f"| by hand: both workers /health 200 | {health_s:.1f} |")
    print(f"| by hand: + first PD request done (pays the NIXL handshake as up's warm-up does) | {hand_s:.1f} |")
    print(f"\noverhead vs by hand incl. first PD request: {report['overhead_pct_vs_first_pd']:+.1f} %")
    print(f"overhead vs by hand, health only: {report['overhead_pct_vs_health']:+.1f} %")
    print(f"machine before: {report['machine_before']}\nmachine after: {report['machine_after']}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
