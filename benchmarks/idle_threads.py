"""Which threads of a running deployment's workers use CPU, and what the busiest ones run (docs/cpu.md, "Idle
engines").

1. Per-thread CPU of each worker's process tree over ``--seconds`` (``/proc/PID/task/TID/stat``, utime + stime),
   the busiest threads listed with their process, name and last CPU.
2. With ``--native``: ``perf record -g -t TID`` on each thread above ``--busy-pct``, and its hottest call chains
   (``perf report --no-children``), which name the native loop (NIXL's UCX progress thread, OpenMP, ...).
3. With ``--probe-core N``: what a bystander on core N gets beside the deployment: a pure-Python loop's speed
   and a 1 ms sleep's wake-up lateness (p50/p99/max), the same as with the deployment stopped.
4. With ``--contention ROUNDS``: what the idle engines take from other work on their own cores. One pure-Python
   loop pinned to each core in ``--cores`` for ``--seconds``, while each engine's per-thread CPU is sampled, in
   each of these arms, interleaved ROUNDS times (:data:`ARMS`): ``group`` (the threads pdctl idled at SCHED_IDLE,
   put into the idle cpu cgroup, and from then on left to the supervisor's follower, which takes them out while the
   engine serves: ``[supervisor] idle_group = "cgroup"``, which the deployment must run with), ``sched_idle`` (SCHED_IDLE, held in the root cgroup,
   i.e. their session's autogroup: ``idle_group = "off"``), ``other`` (SCHED_OTHER, as vLLM starts them, in the
   root cgroup: ``idle_spinning_threads = false``), ``static`` (SCHED_IDLE, held in the idle cgroup, requests or
   not) and ``frozen`` (every worker process SIGSTOPped: the engines' CPU as with the deployment down, without
   reloading it), ``weight`` (SCHED_IDLE, held in a cgroup of :data:`WEIGHT_SHARES` shares: about a tenth of a core
   against one busy session); each arm's engine CPU (% of a core) and loop speed. A held arm writes its cgroup again every
   0.02 s, over the supervisor's own moves. The threads are put back (policy and cgroup) at the end, the workers
   continued.
5. With ``--ab ROUNDS``: the same arms but ``frozen`` under load, interleaved: ``pdctl bench -w doc -n 8
   --concurrency 2`` through the gateway, ROUNDS times; each arm's TTFT/TPOT medians and the engines' NIXL
   transfers. The threads are those at SCHED_IDLE when the run starts (pdctl's choice), else the busy ones.
   With ``--ab-load``, a pure-Python loop pinned to each of ``--cores`` runs through every bench (and 2 s before
   it): the requests arrive while other work holds the cores. With ``--first``, each bench is one request after
   5 s idle (:data:`FIRST_IDLE_S`): the first request of a burst, where a thread out of its group is back latest.
   Needs the gateway's key in its variable (``PDCTL_API_KEY`` for examples/cpu). Without a writable cgroup v1 cpu
   hierarchy (not root), ``group`` is left out: there pdctl lowers the engine's autogroup instead, which follows
   the engine's activity and is not switched here.

    .venv/bin/python -m benchmarks.idle_threads -c examples/cpu/config.toml -s examples/cpu/settings.json \\
        [--seconds 15] [--native] [--probe-core 0] [--contention 2 --cores 0,1] [--ab 2 [--ab-load] [--first]]
        [--arms group,other]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from pdctl.bench.engine_metrics import kv_summary
from pdctl.config import load
from pdctl.runtime import cpugroup
from pdctl.runtime.rundir import read_state

_HZ = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ThreadCpu:
    """One thread's share of a core over the window."""

    worker: str
    pid: int
    process: str
    tid: int
    name: str
    last_cpu: int
    pct: float


def _ticks(pid: int, tid: int) -> tuple[str, int, int] | None:
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return name, int(fields[11]) + int(fields[12]), int(fields[36])


def _sample(workers: dict[str, int]) -> dict[tuple[str, int, str, int], tuple[str, int, int]]:
    out = {}
    for worker, root in workers.items():
        try:
            procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                pname, tids = p.name(), [t.id for t in p.threads()]
            except psutil.Error:
                continue
            for tid in tids:
                got = _ticks(p.pid, tid)
                if got:
                    out[(worker, p.pid, pname, tid)] = got
    return out


def thread_cpu(workers: dict[str, int], seconds: float) -> list[ThreadCpu]:
    """Every thread of the workers' trees, busiest first."""
    before = _sample(workers)
    time.sleep(seconds)
    after = _sample(workers)
    rows = [
        ThreadCpu(k[0], k[1], k[2], k[3], name, cpu, round((ticks - before[k][1]) / _HZ / seconds * 100, 1))
        for k, (name, ticks, cpu) in after.items()
        if k in before
    ]
    return sorted(rows, key=lambda r: -r.pct)


def native_chains(tid: int, seconds: float = 4.0, lines: int = 18) -> str:
    """The hottest call chains of one thread, from perf."""
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "perf.data")
        rec = subprocess.run(["perf", "record", "-q", "-g", "-t", str(tid), "-o", data, "--", "sleep", str(seconds)],
                             capture_output=True, text=True, check=False)  # fmt: skip
        if rec.returncode != 0:
            return f"perf record failed: {rec.stderr.strip()[-300:]}"
        rep = subprocess.run(["perf", "report", "-q", "--stdio", "--no-children", "-i", data],
                             capture_output=True, text=True, check=False)  # fmt: skip
        return "\n".join([ln for ln in rep.stdout.splitlines() if ln.strip()][:lines])


_LOOP = """
import time
end = time.perf_counter() + {s}
n = 0
while time.perf_counter() < end:
    for _ in range(10000):
        n += 1
print(n / {s})
"""
_WAKE = """
import json, time
late = []
for _ in range({n}):
    t = time.perf_counter()
    time.sleep(0.001)
    late.append((time.perf_counter() - t - 0.001) * 1000)
late.sort()
print(json.dumps([late[len(late) // 2], late[int(len(late) * 0.99)], late[-1]]))
"""


def probe(core: int, seconds: float = 5.0, wakes: int = 2000) -> dict[str, float]:
    """A bystander pinned to ``core``: Python loop iterations/s, and a 1 ms sleep's lateness (ms)."""
    pin = ["taskset", "-c", str(core), sys.executable, "-c"]
    loop = subprocess.run([*pin, _LOOP.format(s=seconds)], capture_output=True, text=True, check=True)
    wake = subprocess.run([*pin, _WAKE.format(n=wakes)], capture_output=True, text=True, check=True)
    p50, p99, worst = json.loads(wake.stdout)
    return {"loop_mit_s": float(loop.stdout) / 1e6, "wake_p50_ms": p50, "wake_p99_ms": p99, "wake_max_ms": worst}


def set_policy(tids: list[int], policy: int) -> None:
    """SCHED_OTHER or SCHED_IDLE for each thread (one gone meanwhile is skipped)."""
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:
            pass


#: Every arm: how the idled threads are set (``frozen``: the workers stopped instead).
#: Idle time before a ``--first`` request: longer than the follower's hold and vLLM's own spin after a request.
FIRST_IDLE_S = 5.0
ARMS = ("group", "sched_idle", "other", "static", "weight", "frozen")
#: The ``weight`` arm's cgroup: held there, not idle but at this ``cpu.shares`` (1024 is a nice-0 group's).
WEIGHT_SHARES = 102
#: After ``frozen``, the gateway's health checks took the stopped engines out of its pool (it answered 503
#: ``server_overloaded`` to a bench started at once): the A/B waits this long for them to be seen again.
FROZEN_GRACE_S = 20.0


def _cpu_cgroup(tid: int) -> str:
    """The cpu cgroup of one thread, relative to the hierarchy's root ("" without a v1 cpu hierarchy)."""
    try:
        for line in Path(f"/proc/{tid}/task/{tid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                return path
    except OSError:
        pass
    return ""


class Arms:
    """Puts ``tids`` (and ``workers``' trees, for ``frozen``) into each arm's state; :meth:`restore` puts back the
    policies and cgroups found at the start and continues any stopped worker."""

    def __init__(self, workers: dict[str, int], tids: list[int]) -> None:
        self.workers, self.tids = workers, tids
        self.root = cpugroup.cpu_cgroup_root()
        self.group = cpugroup.idle_cgroup(self.root)
        self.weighted = self._weighted_cgroup()
        self.before = {tid: (os.sched_getscheduler(tid), _cpu_cgroup(tid)) for tid in tids}
        self.stopped: list[int] = []
        self._hold: tuple[threading.Event, threading.Thread] | None = None

    def available(self, names: list[str]) -> list[str]:
        """``names`` less ``group`` where there is no idle cgroup to switch."""
        return [n for n in names if n not in ("group", "static", "weight") or self.group is not None]

    def set(self, name: str) -> None:
        self._cont()
        self._release()
        if name == "frozen":
            self.stopped = [p.pid for w in self.workers.values() for p in _tree(w)]
            for pid in self.stopped:
                os.kill(pid, signal.SIGSTOP)
            return
        set_policy(self.tids, os.SCHED_OTHER if name == "other" else os.SCHED_IDLE)
        if self.root is None:
            return
        target = self.group if name in ("group", "static") and self.group else self.root
        if name == "weight" and self.weighted is not None:
            target = self.weighted
        cpugroup.move_threads(self.tids, target)
        if name != "group":
            stop = threading.Event()
            holder = threading.Thread(target=self._holder, args=(stop, target), daemon=True)
            holder.start()
            self._hold = (stop, holder)

    def _weighted_cgroup(self) -> Path | None:
        if self.root is None:
            return None
        group = self.root / (cpugroup.IDLE_CGROUP + "-weight")
        try:
            group.mkdir(exist_ok=True)
            (group / "cpu.shares").write_text(str(WEIGHT_SHARES))
        except OSError:
            return None
        return group

    def _holder(self, stop: threading.Event, target: Path) -> None:
        while not stop.wait(0.02):
            cpugroup.move_threads(self.tids, target)

    def _release(self) -> None:
        if self._hold is not None:
            self._hold[0].set()
            self._hold[1].join()
            self._hold = None

    def restore(self) -> None:
        self._cont()
        self._release()
        for tid, (policy, cgroup) in self.before.items():
            set_policy([tid], policy)
            if self.root is not None and cgroup:
                cpugroup.move_threads([tid], self.root / cgroup.lstrip("/"))

    def _cont(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped = []


def _tree(root: int) -> list[psutil.Process]:
    try:
        return [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return []


def idled_threads(workers: dict[str, int]) -> list[int]:
    """The threads of the workers' trees at SCHED_IDLE now."""
    out = []
    for _w, _pid, _name, tid in _sample(workers):
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                out.append(tid)
        except OSError:
            continue
    return out


def contention(
    workers: dict[str, int], tids: list[int], cores: list[int], seconds: float, rounds: int, names: list[str]
) -> dict[str, list[dict[str, float]]]:
    """Bystander loops pinned to ``cores`` beside the idle engines in each arm of ``names``, interleaved: each
    engine's CPU (% of a core), that of ``tids`` together, and the loops' mean speed (M it/s)."""
    state = Arms(workers, tids)
    names = state.available(names)
    arms: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    try:
        for _ in range(rounds):
            for name in names:
                state.set(name)
                loops = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", _LOOP.format(s=seconds)],
                                          stdout=subprocess.PIPE, text=True) for c in cores]  # fmt: skip
                rows = thread_cpu(workers, seconds - 1.0)
                speeds = [float(p.communicate()[0]) / 1e6 for p in loops]
                row = {f"{w}_pct": round(sum(r.pct for r in rows if r.worker == w), 1) for w in workers}
                row["threads_pct"] = round(sum(r.pct for r in rows if r.tid in tids), 1)
                row["loop_mit_s"] = round(sum(speeds) / len(speeds), 2)
                arms[name].append(row)
                print(f"  {name}: {row}")
    finally:
        state.restore()
    return arms


def bench(config: str, settings: str, out: Path, urls: list[str], first: bool = False) -> dict[str, float]:
    """One short ``pdctl bench`` run through the gateway (8 requests, 2 at a time, after one warm-up; ``first``: one
    request, no warm-up), the engines' ``urls`` scraped: completed, failed, TTFT and TPOT medians (ms), NIXL
    transfers and their mean time (ms, the engines' ``vllm:nixl_xfer_time_seconds``)."""
    n, concurrency, warmup = ("1", "1", "0") if first else ("8", "2", "1")
    pdctl = [sys.executable, "-m", "pdctl", "bench", "-c", config, "-s", settings, "-w", "doc", "-n", n,
             "--concurrency", concurrency, "--warmup", warmup, "--timeout", "300", "-o", str(out)]  # fmt: skip
    for url in urls:
        pdctl += ["--metrics-url", url.rstrip("/") + "/metrics"]
    subprocess.run(pdctl, capture_output=True, text=True, check=True)
    run = json.loads(out.read_text(encoding="utf-8"))
    row = {k: float(run[k]) for k in ("completed", "failed", "median_ttft_ms", "median_tpot_ms")}
    if run["failed"]:
        print(f"  failed: {[e for e in run.get('errors') or [] if e]}")
    kv = kv_summary((run.get("pdctl") or {}).get("metric_deltas") or {})
    row["kv_transfers"] = kv.get("kv_transfers", 0.0)
    row["kv_xfer_ms_mean"] = round(kv.get("kv_xfer_ms_mean", 0.0), 2)
    return row


def ab(
    config: str,
    settings: str,
    workers: dict[str, int],
    tids: list[int],
    rounds: int,
    names: list[str],
    urls: list[str],
    load_cores: Sequence[int] = (),
    first: bool = False,
) -> dict[str, list[dict[str, float]]]:
    """Benchmarks in each arm of ``names`` (not ``frozen``), interleaved; the threads put back at the end. With
    ``load_cores``, a bystander loop pinned to each of them runs through every bench (other work on the cores).
    ``first``: each bench is one request after :data:`FIRST_IDLE_S` of idle (the first request of a burst)."""
    state = Arms(workers, tids)
    names = [n for n in state.available(names) if n != "frozen"]
    arms: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(rounds):
                for name in names:
                    state.set(name)
                    loops = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", _LOOP.format(s=3600)],
                                              stdout=subprocess.DEVNULL, start_new_session=True) for c in load_cores]  # fmt: skip
                    # The engines idle beside the loops first, as beside a job.
                    time.sleep(FIRST_IDLE_S if first else 2.0 if loops else 0.0)
                    try:
                        arms[name].append(bench(config, settings, Path(d) / f"{name}-{i}.json", urls, first))
                    finally:
                        for p in loops:
                            p.kill()
                            p.wait()
                    print(f"  {name} round {i + 1}: {arms[name][-1]}")
    finally:
        state.restore()
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default="config.toml")
    ap.add_argument("-s", "--settings", default="settings.json")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--busy-pct", type=float, default=20.0, help="a thread above it is 'busy' (--native)")
    ap.add_argument("--native", action="store_true", help="perf call chains of the busy threads")
    ap.add_argument("--probe-core", type=int, default=None, help="measure a bystander on this core")
    ap.add_argument("--contention", type=int, default=0, metavar="ROUNDS", help="bystanders beside the idle engines")
    ap.add_argument("--cores", default="0,1", help="--contention's cores, comma-separated")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS", help="benchmarks in each arm (not frozen)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"--contention's and --ab's arms, of {', '.join(ARMS)}")
    ap.add_argument("--ab-load", action="store_true", help="--ab with a bystander loop on each of --cores")
    ap.add_argument("--first", action="store_true", help="--ab's benches: one request after 5 s idle each")
    ap.add_argument("--json", default=None, help="write the measurements here")
    a = ap.parse_args()
    dep = load(Path(a.config), Path(a.settings))
    state = read_state(dep.run_dir)
    running = [p for p in state.processes if p.get("role") in ("prefill", "decode") and p.get("pid")]
    workers = {p["name"]: p["pid"] for p in running}
    urls = [p["url"] for p in running if p.get("url")]
    names = [n for n in a.arms.split(",") if n]
    if unknown := set(names) - set(ARMS):
        sys.exit(f"--arms: unknown {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if not workers:
        sys.exit(f"no running worker in {dep.run_dir}/state.json")
    rows = thread_cpu(workers, a.seconds)
    result: dict[str, object] = {"seconds": a.seconds, "threads": [asdict(r) for r in rows[: a.top]]}
    for w in workers:
        print(f"{w}: {sum(r.pct for r in rows if r.worker == w):.1f} % of a core ({a.seconds:g} s, idle)")
    for r in rows[: a.top]:
        print(f"  {r.pct:5.1f} %  {r.worker} pid {r.pid} ({r.process}) tid {r.tid} {r.name!r} on CPU {r.last_cpu}")
    if a.native:
        if shutil.which("perf") is None:
            print("perf is not installed: no native stacks (apt-get install linux-perf)")
        for r in (r for r in rows if r.pct >= a.busy_pct):
            print(f"== tid {r.tid} ({r.worker}, {r.pct} %)\n{native_chains(r.tid)}")
    if a.probe_core is not None:
        result["probe"] = probe(a.probe_core)
        print(f"bystander on core {a.probe_core}: {result['probe']}")
    idled = idled_threads(workers)
    result["sched_idle"] = idled
    print(f"threads at SCHED_IDLE: {idled or 'none'}")
    if a.contention:
        tids = idled or [r.tid for r in rows if r.pct >= a.busy_pct]
        cores = [int(c) for c in a.cores.split(",")]
        print(f"contention: loops on cores {cores} beside {len(tids)} thread(s) {tids}, {a.contention} round(s)")
        result["contention"] = contention(workers, tids, cores, a.seconds, a.contention, names)
        if a.ab and "frozen" in names:
            time.sleep(FROZEN_GRACE_S)
    if a.ab:
        busy = idled or [r.tid for r in rows if r.pct >= a.busy_pct]
        print(f"A/B of {len(busy)} busy thread(s) {busy}: arms {names}, {a.ab} round(s)")
        load_cores = [int(c) for c in a.cores.split(",")] if a.ab_load else []
        result["ab"] = ab(a.config, a.settings, workers, busy, a.ab, names, urls, load_cores, a.first)
        result["ab_first"] = a.first
        result["ab_load_cores"] = load_cores
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
