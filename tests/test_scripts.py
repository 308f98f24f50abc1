"""scripts/demo.sh and scripts/test.sh, run in a copy of the repository's layout with stub tools.

The stubs stand in for the installer, ``pdctl``, ruff, mypy and pytest, so each test runs in a second and
checks only the scripts' own logic: demo.sh never shows a traceback whatever ``status --json`` prints, and
test.sh runs every stage even when one fails, then exits non-zero naming the failed ones.

ab-demo.sh runs for real with simulated engines (``--engine sim``): its whole flow, its files, and that nothing
it started survives it, Ctrl-C included. device-gateway-scale.sh refuses to start without the wheels it needs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pdctl.testing import port_free
from tests.real_engine import require_engine

REPO = Path(__file__).resolve().parent.parent


def _tool(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body + "\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _tree(tmp_path: Path, script: str) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / script, tmp_path / "scripts" / script)
    _tool(tmp_path / "scripts" / "install-cpu-engine.sh", "exit 0")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / ".venv" / "bin" / "python")
    return tmp_path


def test_device_run_without_its_wheels_says_how_to_get_them(tmp_path: Path) -> None:
    root = _tree(tmp_path, "device-gateway-scale.sh")
    proc = subprocess.run(["bash", "scripts/device-gateway-scale.sh"], cwd=root, capture_output=True, text=True,
                          timeout=30, env={**os.environ, "OUT": str(tmp_path / "out")})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "device-gateway-scale.sh --fetch' here first, then carry .whl" in proc.stderr
    assert not (root / "benchmarks").exists() and list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("status_output", ["", "error: the run directory is damaged", '{"unexpected": 1}', "[1, 2"])
def test_demo_never_shows_a_traceback(tmp_path: Path, status_output: str) -> None:
    root = _tree(tmp_path, "demo.sh")
    log = root / "calls.log"
    # `pdctl status --json` prints whatever this case says (and fails); every other command succeeds.
    _tool(
        root / ".venv" / "bin" / "pdctl",
        f'echo "$*" >> {log}\n'
        f'if [[ "$1 $2" == "status --json" ]]; then printf %s {status_output!r}; exit 1; fi\nexit 0',
    )
    env = {**os.environ, "PDCTL_API_KEY": "k", "VENV": str(root / ".venv")}
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "demo.sh"), "--down"], cwd=root, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "JSONDecodeError" not in out
    calls = log.read_text().splitlines()
    assert any(c.startswith("up -d") for c in calls)  # not running: the demo started it
    assert any(c.startswith("verify") for c in calls) and any(c.startswith("down") for c in calls)


@pytest.mark.parametrize("status", ["ready", "starting"])
def test_demo_rerun_beside_its_running_deployment(tmp_path: Path, status: str) -> None:
    """Re-run while its deployment is up: a ready one is reused, one not ready yet is named; never a second up."""
    root = _tree(tmp_path, "demo.sh")
    log = root / "calls.log"
    answer = json.dumps({"status": status, "supervisor_running": True, "processes": []})
    _tool(
        root / ".venv" / "bin" / "pdctl",
        f'echo "$*" >> {log}\nif [[ "$1 $2" == "status --json" ]]; then printf %s {answer!r}; fi\nexit 0',
    )
    env = {**os.environ, "PDCTL_API_KEY": "k", "VENV": str(root / ".venv")}
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "demo.sh")], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    calls = log.read_text().splitlines()
    assert not any(c.startswith("up") for c in calls) and "Traceback" not in proc.stdout + proc.stderr
    if status == "ready":
        assert proc.returncode == 0 and "already running: reusing it" in proc.stdout
        assert any(c.startswith("verify") for c in calls) and not any(c.startswith("down") for c in calls)
    else:
        assert proc.returncode == 1 and "not ready (status: starting)" in proc.stderr and "down" in proc.stderr
        assert not any(c.startswith("verify") for c in calls)


def test_demo_stops_with_a_pointer_when_verify_fails(tmp_path: Path) -> None:
    root = _tree(tmp_path, "demo.sh")
    _tool(root / ".venv" / "bin" / "pdctl", '[[ "$1" == verify ]] && exit 1\nexit 0')
    env = {**os.environ, "PDCTL_API_KEY": "k", "VENV": str(root / ".venv")}
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "demo.sh")], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "verify failed" in proc.stderr and "logs --kv" in proc.stderr and "Traceback" not in proc.stderr


def _test_sh(tmp_path: Path, fast_rc: int, real_rc: int, demo: str | None = None) -> subprocess.CompletedProcess[str]:
    """test.sh with stub tools; ``demo``: what ``pdctl status --json`` of examples/cpu prints (no pdctl if None)."""
    root = _tree(tmp_path, "test.sh")
    log = root / "calls.log"
    if demo is not None:
        _tool(root / ".venv" / "bin" / "pdctl", f'echo "pdctl $*" >> {log}\nprintf %s {demo!r}')
    for tool in ("ruff", "mypy"):
        _tool(root / ".venv" / "bin" / tool, f'echo "{tool} $*" >> {log}')
    # pytest through the stub python: the fast suite and the real suite answer with the given codes.
    (root / ".venv" / "bin" / "python").unlink()
    stub = (
        f'echo "python $*" >> {log}\n'
        f'[[ "$*" == *"not real"* ]] && exit {fast_rc}\n[[ "$*" == *"-m real"* ]] && exit {real_rc}\nexit 0'
    )
    if demo is not None:  # the real interpreter answers test.sh's JSON question; pytest stays stubbed
        _tool(root / ".venv" / "bin" / "python", f'[[ "$1" == -c ]] && exec {sys.executable} "$@"\n' + stub)
    else:
        _tool(root / ".venv" / "bin" / "python", stub)
    return subprocess.run(["bash", "scripts/test.sh"], cwd=root, capture_output=True, text=True, timeout=60)


def test_test_sh_runs_the_real_stage_after_a_failing_fast_stage(tmp_path: Path) -> None:
    proc = _test_sh(tmp_path, fast_rc=1, real_rc=0)
    assert proc.returncode == 1
    calls = (tmp_path / "calls.log").read_text()
    assert "-m real" in calls  # the real stage ran anyway
    assert "FAILED stage: fast suite" in proc.stderr and "real vLLM" not in proc.stderr


def test_test_sh_names_every_failed_stage_and_passes_when_all_pass(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    proc = _test_sh(tmp_path / "a", fast_rc=1, real_rc=2)
    assert proc.returncode == 1
    assert "FAILED stage: fast suite" in proc.stderr and "FAILED stage: real vLLM CPU end to end" in proc.stderr
    (tmp_path / "b").mkdir()
    ok = _test_sh(tmp_path / "b", fast_rc=0, real_rc=0)
    assert ok.returncode == 0 and "all stages passed" in ok.stdout


# ------------------------------------------------------------------------------------ ab-demo.sh on the simulator


def _ab_port_base() -> int:
    """A base port whose derived ports (five gateways, workers, NIXL side channels, KV events) are all free."""
    offsets = (0, 1, 2, 3, 4, 100, 200, 300, -2400, -2300)
    for _ in range(200):
        base = random.randrange(20000, 40000)
        if all(port_free(base + offset) for offset in offsets):
            return base
    raise AssertionError("no free port range")


def _ab_demo(out: Path, port: int, *extra: str, engine: str = "sim") -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VENV": str(Path(sys.executable).parent.parent)}
    env.pop("PDCTL_API_KEY", None)
    # Through a launcher that gives the script Ctrl-C's default action, as a terminal does: a test runner
    # started in the background of a non-interactive shell passes SIGINT down *ignored*, and a shell cannot
    # trap a signal it was started with ignored (the Ctrl-C test then waited for the whole bench).
    launch = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp('bash', sys.argv[1:])"
    args = [sys.executable, "-c", launch, "bash", str(REPO / "scripts" / "ab-demo.sh"), "--engine", engine,
            "--no-install", "--size", "tiny", "--port", str(port), "--out", str(out), *extra]  # fmt: skip
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _kill_script(proc: subprocess.Popen[str], out: Path) -> None:
    """After a timeout: the script's group, then what it started in sessions of their own (the detached
    deployment of ``out/deploy``, the colocated gateway), so a failed test leaves nothing running."""
    os.killpg(proc.pid, signal.SIGKILL)
    deploy = out / "deploy"
    if (deploy / "config.toml").exists():
        subprocess.run(
            [sys.executable, "-m", "pdctl", "down", "-c", str(deploy / "config.toml"), "-s", str(deploy / "settings.json")],
            capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    for p in psutil.process_iter(["cmdline"]):
        if str(out) in " ".join(p.info["cmdline"] or []):
            p.kill()


def _nothing_left(out: Path, port: int) -> None:
    """No process of the run remains: every port it used is free and none runs from its folder."""
    deadline = time.monotonic() + 30
    ports = (port, port + 1, port + 2, port + 100, port + 200)
    while time.monotonic() < deadline:
        mine = [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
        if not mine and all(port_free(p) for p in ports):
            return
        time.sleep(0.5)
    raise AssertionError(f"left running: {mine}, ports {[p for p in ports if not port_free(p)]}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--size", "huge"], "--size: expected tiny, small or medium, got 'huge'"),
        (["--engine", "tgi"], "--engine: expected vllm or sim"),
        (["--slo-scale", "0"], "--slo-scale: expected a positive number"),
        (["--port", "80"], "--port: expected a port in 1024-65000"),
        (["--rate", "2"], "unknown option --rate"),
        (["--conversations", "four"], "--conversations: expected counts like 4,8"),
        (["--stall-ms", "tpot"], "--stall-ms: expected milliseconds, got 'tpot'"),
    ],
)
def test_ab_demo_refuses_bad_options_before_starting_anything(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "ab-demo.sh"), *args, "--out", str(tmp_path / "ab")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "ab").exists()


def test_ab_demo_on_the_simulator_end_to_end(tmp_path: Path) -> None:
    """The one command's whole flow with simulated engines: files, the five sides (``--exact``: adaptive PD on the
    engines' KV cache events too; ``--stall-ms``: adaptive PD with local_max_stall_ms) measured on the mixed and the
    agent workload, everything stopped."""
    out, port = tmp_path / "ab", _ab_port_base()
    proc = _ab_demo(out, port, "--rates", "4,8", "-n", "6", "--conversations", "2", "--exact", "--stall-ms", "20",
                    "--no-png")  # fmt: skip
    try:
        stdout, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            _kill_script(proc, out)
    assert proc.returncode == 0, stdout
    assert f"Results in {out}" in stdout and "Traceback" not in stdout
    runs = json.loads((out / "ab.json").read_text())
    sides = ("colocated", "pd", "adaptive", "exact", "stall")
    assert [(r["label"], r["request_rate"]) for r in runs] == [(side, rate) for rate in (4.0, 8.0) for side in sides]
    assert all(r["completed"] == 6 and r["failed"] == 0 for r in runs)
    adaptive = [r["pdctl"]["paths"] for r in runs if r["label"] in ("adaptive", "exact", "stall")]
    assert all(set(paths) <= {"local", "disagg"} for paths in adaptive) and any("local" in p for p in adaptive)
    agent = json.loads((out / "agent-2.json").read_text())
    assert [r["label"] for r in agent] == list(sides)
    assert all(r["failed"] == 0 and set(r["pdctl"]["turn_groups"]) == {"1", "2+"} for r in agent)
    assert agent[2]["pdctl"]["paths"].get("local", 0) > 0  # later turns served by the decode holding them
    assert agent[3]["pdctl"]["paths"].get("local", 0) > 0
    exact = agent[3]["pdctl"]["kv_transfer"]
    assert exact["view_exact_cached_tokens"] > 0  # judged by the simulated engines' own KV cache events
    assert agent[2]["pdctl"]["kv_transfer"]["view_exact_cached_tokens"] == 0  # the approximate side's
    agreement = json.loads((out / "agreement.json").read_text())  # greedy answers of every side against colocated's
    assert agreement["reference"] == "colocated" and set(agreement["verdicts"]) == set(sides[1:])
    assert all(v == {"identical": 12} for v in agreement["verdicts"].values()), agreement["verdicts"]
    assert agreement["paths"]["adaptive"]["long+followup: local"] == 4  # the decode holding the long prompt
    assert all(set(r["pdctl"]["by_kind"]) == {"short", "long"} for r in runs)
    for run in runs:
        engines = run["pdctl"]["engine"]
        # both engines seen on both sides: PD sends every request through both, colocated spreads them
        disagg = run["pdctl"]["paths"].get("disagg", 0)
        assert sum(e["requests"] for e in engines.values()) == 6 + disagg, engines
        assert run["pdctl"]["engine_gauges"], run["label"]
        kv = run["pdctl"]["kv_transfer"]["kv_transfers"]
        assert kv == disagg
    page = (out / "report.html").read_text()
    assert "own view (vLLM /metrics)" in page and "Highest swept rate within the SLOs" in page
    assert "<td>prefill</td>" in page and "<td>decode</td>" in page
    plots = {p.name for p in (out / "plots").iterdir()}
    assert {
        "goodput-vs-rate.svg",
        "ttft-cdf-4-req-s.svg",
        "tpot-over-time-8-req-s.svg",
        "itl-over-time-8-req-s.svg",
        "running-8-req-s.svg",
    } <= plots
    for when in ("before", "after"):
        for role in ("prefill", "decode"):
            assert "vllm:num_requests_running" in (out / "metrics" / f"{when}-{role}.txt").read_text()
    machine = (out / "machine.txt").read_text()
    assert "== before" in machine and "== after" in machine and "load average" in machine
    assert "[long] TTFT p50 /" in (out / "bench.txt").read_text()  # a narrow metric column wraps the rest
    # the SLOs: 3 x the unloaded long-prompt TTFT and short-request TPOT, measured first on the colocated side
    unloaded = json.loads((out / "unloaded.json").read_text())
    assert unloaded["max_concurrency"] == 1 and unloaded["completed"] == 8
    slo = runs[0]["goodput"]
    assert slo == runs[-1]["goodput"]
    assert slo["ttft"] >= 3 * unloaded["pdctl"]["by_kind"]["long"]["ttft"]["median"]
    assert slo["tpot"] >= 3 * unloaded["pdctl"]["by_kind"]["short"]["tpot"]["median"]
    _nothing_left(out, port)


@pytest.mark.timeout(900)
def test_ab_demo_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    """Ctrl-C while the bench runs: exit 130 within 3 minutes (a loaded machine's stop), no traceback, nothing
    left (-n 600 at 1 req/s: a bench that went on after the interrupt would take 10 minutes more)."""
    out, port = tmp_path / "ab", _ab_port_base()
    proc = _ab_demo(out, port, "--rates", "1", "-n", "600", "--no-png")
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + 400
    try:
        while "[6/8]" not in seen and time.monotonic() < deadline and proc.poll() is None:
            seen += proc.stdout.readline()
        assert "[6/8]" in seen, seen
        time.sleep(2)  # the bench is running
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        try:
            rest, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired as exc:
            partial = exc.output.decode() if isinstance(exc.output, bytes) else exc.output or ""
            pytest.fail(f"still running 180 s after Ctrl-C:\n{seen}{partial}")
    finally:
        if proc.poll() is None:
            _kill_script(proc, out)
    assert proc.returncode == 130, seen + rest
    assert "Traceback" not in seen + rest
    _nothing_left(out, port)


@pytest.mark.real
@pytest.mark.timeout(1500)
def test_ab_demo_smoke_on_real_vllm(tmp_path: Path) -> None:
    """The one command on real vLLM CPU engines, tiny model, two short rates and two conversations: it runs,
    measures the three sides through both engines, writes the report and the plots (PNG too where Chromium is
    installed), stops all."""
    require_engine()
    out, port = tmp_path / "ab", _ab_port_base()
    proc = _ab_demo(out, port, "--rates", "1,2", "-n", "6", "--conversations", "2", engine="vllm")
    try:
        stdout, _ = proc.communicate(timeout=1400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout[-6000:]
    runs = json.loads((out / "ab.json").read_text())
    assert [r["label"] for r in runs] == ["colocated", "pd", "adaptive"] * 2
    assert all(r["completed"] == 6 for r in runs), [r["pdctl"]["error_counts"] for r in runs]
    for run in runs:
        engines = run["pdctl"]["engine"]
        disagg = run["pdctl"]["paths"].get("disagg", 0)
        assert sum(e["requests"] for e in engines.values()) == 6 + disagg, engines
        # vLLM's own TPOT and the client's agree to the order of magnitude (same decode steps, other clocks)
        decode_tpots = [e["tpot_ms"] for e in engines.values() if "tpot_ms" in e]
        assert decode_tpots and all(0.2 < t / run["mean_tpot_ms"] < 5 for t in decode_tpots), (engines, run)
    pd_kv = [r["pdctl"]["kv_transfer"] for r in runs if r["label"] == "pd"]
    assert all(k["external_kv_tokens"] > 0 and k["kv_failed_transfers"] == 0 for k in pd_kv), pd_kv
    assert (out / "plots" / "goodput-vs-rate.svg").is_file()
    if shutil.which("chromium") or shutil.which("rsvg-convert"):
        assert (out / "plots" / "goodput-vs-rate.png").stat().st_size > 1000
    _nothing_left(out, port)


def test_test_sh_says_the_demo_may_stay_up_and_runs_every_stage(tmp_path: Path) -> None:
    up = json.dumps({"status": "ready", "supervisor_running": True})
    (tmp_path / "up").mkdir()
    proc = _test_sh(tmp_path / "up", fast_rc=0, real_rc=0, demo=up)
    assert proc.returncode == 0 and "all stages passed" in proc.stdout, proc.stdout + proc.stderr
    assert "demo's deployment (examples/cpu) is up; the tests run beside it" in proc.stdout
    calls = (tmp_path / "up" / "calls.log").read_text()
    assert "pdctl status --json -c examples/cpu/config.toml" in calls and "-m real" in calls
    assert "pdctl down" not in calls  # the note only says how; test.sh never stops the demo
    for state in (json.dumps({"status": "stopped", "supervisor_running": False}), "error: damaged"):
        (tmp_path / "x").mkdir()
        quiet = _test_sh(tmp_path / "x", fast_rc=0, real_rc=0, demo=state)
        assert quiet.returncode == 0 and "demo's deployment" not in quiet.stdout + quiet.stderr
        shutil.rmtree(tmp_path / "x")
