"""`pdctl up / status / logs / down` end to end: real CLI processes, simulator workers, the real gateway."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from pdctl.testing import alive, free_port, kill_groups, port_free
from tests.conftest import REPO

KEY_VAR = "PDCTL_H4_TEST_KEY"
KEY = "sk-h4-never-in-argv-0123456789"


def write_deployment(
    d: Path, *, prefill_extra: list[str] = (), decode_extra: list[str] = (), supervisor: str = ""
) -> dict[str, int]:
    ports = {n: free_port() for n in ("prefill", "decode", "gateway", "p_side", "d_side")}
    (d / "config.toml").write_text(f"""
[prefill]
model = "sim-model"
engine = "sim"
side_channel_port = {ports["p_side"]}
extra_args = {json.dumps(list(prefill_extra))}

[decode]
model = "sim-model"
engine = "sim"
side_channel_port = {ports["d_side"]}
extra_args = {json.dumps(list(decode_extra))}

[connector]
kv_connector = "NixlConnector"

[supervisor]
ready_timeout_s = 120
stop_timeout_s = 5
warmup_timeout_s = 60
{supervisor}
""")
    (d / "settings.json").write_text(
        json.dumps(
            {
                "gateway": {"listen": f"127.0.0.1:{ports['gateway']}", "api_key_env": KEY_VAR, "drain_timeout_s": 2},
                "routing": {
                    "prefill_endpoint": f"http://127.0.0.1:{ports['prefill']}",
                    "decode_endpoint": f"http://127.0.0.1:{ports['decode']}",
                },
            }
        )
    )
    return ports


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update({KEY_VAR: KEY, "NO_COLOR": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    return e


def pdctl(d: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdctl", *args], cwd=d, env=env(), capture_output=True, text=True, timeout=timeout
    )


def state(d: Path) -> dict[str, Any]:
    return json.loads((d / ".pdctl" / "state.json").read_text())


def recorded_pids(d: Path) -> list[int]:
    try:
        s = state(d)
    except (OSError, ValueError):
        return []
    pids = [s["supervisor_pid"], s["watchdog_pid"]]
    for p in s["processes"]:
        pids.append(p["pid"])
        pids.extend(pid for pid, _ in p.get("descendants", []))
    return [p for p in pids if p]


@pytest.fixture
def deploy_dir(tmp_path: Path):
    yield tmp_path
    kill_groups(recorded_pids(tmp_path))


def wait_for(pred, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def all_tree_pids(d: Path) -> set[int]:
    out: set[int] = set()
    for pid in recorded_pids(d):
        with contextlib.suppress(psutil.Error):
            out.add(pid)
            out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    return out


def test_detached_up_status_logs_down(deploy_dir: Path) -> None:
    d = deploy_dir
    ports = write_deployment(d, decode_extra=["--sim-fault", "orphan-child"])
    r = pdctl(d, "up", "-d")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all processes are ready" in r.stdout
    assert "warm-up prefill->decode request pdctl-warmup-" in r.stdout
    # The gateway starts with the workers, held; it is released (and listens) only after the warm-up passed.
    out = r.stdout
    held = out.index("started gateway (pid ")
    assert "held: it listens once the workers are ready" in out
    assert held < out.index("prefill is ready") and held < out.index("decode is ready")
    assert out.index("decode is ready") < out.index("warm-up probe passed") < out.index("released gateway")
    assert out.index("released gateway") < out.index("gateway is ready")
    assert (d / ".pdctl" / "gateway.go").exists()
    assert f'-H "Authorization: Bearer ${KEY_VAR}"' in r.stdout  # curl commands name the variable
    assert KEY not in r.stdout + r.stderr
    s = state(d)
    assert s["status"] == "ready" and s["detached"] is True
    procs = {p["name"]: p for p in s["processes"]}
    assert set(procs) == {"prefill", "decode", "gateway"}

    # Secrets: no argv carries the key; only the gateway's environment has it.
    tree = all_tree_pids(d)
    for pid in tree:
        with contextlib.suppress(OSError):
            assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    for name in ("prefill", "decode"):
        environ = Path(f"/proc/{procs[name]['pid']}/environ").read_bytes()
        assert KEY.encode() not in environ and KEY_VAR.encode() not in environ
    assert KEY.encode() in Path(f"/proc/{procs['gateway']['pid']}/environ").read_bytes()

    # One request through the gateway, then status/logs see it.
    gw = f"http://127.0.0.1:{ports['gateway']}"
    resp = httpx.post(
        f"{gw}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "h4-req-1"},
        json={"model": "sim-model", "prompt": "hello there", "max_tokens": 3},
        timeout=60,
    )
    assert resp.status_code == 200 and resp.headers["x-pd-path"] == "disagg"

    r = pdctl(d, "status", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["status"] == "ready" and st["supervisor_running"] is True
    rows = {p["name"]: p for p in st["processes"]}
    assert all(rows[n]["health"] == "ok" and rows[n]["alive"] for n in rows)
    assert rows["decode"]["rss_bytes"] > 0 and rows["decode"]["restarts"] == 0
    assert sum(st["gateway_requests"].values()) >= 1
    r = pdctl(d, "status")
    assert "prefill" in r.stdout and "gateway requests" in r.stdout
    r = pdctl(d, "up", "-d")
    assert r.returncode == 1 and "already running" in r.stderr and "pdctl down" in r.stderr

    gw_log = d / ".pdctl" / "logs" / "gateway.log"
    wait_for(lambda: "h4-req-1" in gw_log.read_text(), 30, "the gateway's access line")
    r = pdctl(d, "logs", "--request", "h4-req-1")
    assert r.returncode == 0 and "gateway" in r.stdout and "h4-req-1" in r.stdout
    r = pdctl(d, "logs", "--kv", "--json")
    events = [json.loads(x) for x in r.stdout.splitlines()]
    assert {e["process"] for e in events} >= {"prefill", "decode"}
    assert "start_load_kv" in {e["phase"] for e in events}
    r = pdctl(d, "logs", "decode", "-n", "2")
    assert r.returncode == 0 and all(" decode | " in ln for ln in r.stdout.splitlines())
    assert KEY not in (d / ".pdctl" / "logs" / "gateway.log").read_text()

    tree = all_tree_pids(d)
    assert len(tree) >= 6  # supervisor, watchdog, 3 processes, the orphan-prone child
    r = pdctl(d, "down")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: not any(alive(p) for p in tree), 30, "every process of the run to exit")
    assert all(port_free(p) for p in ports.values())
    assert state(d)["status"] == "stopped"
    events = (d / ".pdctl" / "logs" / "pdctl.log").read_text()
    stops = [
        n for ln in events.splitlines() for n in ("gateway", "decode", "prefill") if f"sending SIGTERM to {n} " in ln
    ]
    assert stops == ["gateway", "decode", "prefill"]
    r = pdctl(d, "down")  # nothing left: still a clean answer
    assert r.returncode == 0


def _start_foreground(d: Path) -> subprocess.Popen[str]:
    # Output to a file, not a pipe: an unread pipe would block pdctl's writes.
    # The child holds its own copy of the descriptor, so the parent's closes at once.
    with (d / "foreground.out").open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pdctl", "up"], cwd=d, env=env(), stdout=out, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip


def _output(d: Path, proc: subprocess.Popen[str]) -> str:
    proc.wait(timeout=120)
    return (d / "foreground.out").read_text()


def _wait_ready(d: Path, proc: subprocess.Popen[str]) -> None:
    def ready() -> bool:
        assert proc.poll() is None, (d / "foreground.out").read_text()
        try:
            return state(d)["status"] == "ready"
        except (OSError, ValueError):
            return False

    wait_for(ready, 180, "state ready")


def test_foreground_multiplexed_view_ctrl_c(deploy_dir: Path) -> None:
    d = deploy_dir
    write_deployment(d)
    proc = _start_foreground(d)
    try:
        _wait_ready(d, proc)
        tree = all_tree_pids(d)
        view = d / "foreground.out"
        wait_for(lambda: all(s in view.read_text() for s in (" prefill | ", " decode  | ", "all processes are ready")),
                 60, "both workers' lines and the ready line in the view")  # fmt: skip
        proc.send_signal(signal.SIGINT)
        out = _output(d, proc)
    finally:
        kill_groups([proc.pid])
    assert proc.returncode == 0, out
    lines = out.splitlines()
    assert any(" prefill | " in ln for ln in lines) and any(" decode  | " in ln for ln in lines)
    assert any(" pdctl   | all processes are ready" in ln for ln in lines)
    assert "\x1b[" not in out  # not a TTY: no colour
    assert "SIGINT: stopping" in out
    assert "process" in out and "GPUs/cores" in out  # the summary table
    wait_for(lambda: not any(alive(p) for p in tree), 30, "children to exit")
    assert state(d)["status"] == "stopped"


def test_sigkill_of_foreground_pdctl_takes_children_down(deploy_dir: Path) -> None:
    d = deploy_dir
    write_deployment(d, prefill_extra=["--sim-fault", "orphan-child"], decode_extra=["--sim-fault", "ignore-sigterm"])
    proc = _start_foreground(d)
    try:
        _wait_ready(d, proc)
        # prefill's orphan-to-be child is in state.json once a refresh has recorded descendants
        wait_for(lambda: any(p.get("descendants") for p in state(d)["processes"] if p["name"] == "prefill"), 60,
                 "prefill's child recorded in state.json")  # fmt: skip
        tree = all_tree_pids(d) - {proc.pid}
        s = state(d)
        workers = [p["pid"] for p in s["processes"]]
        assert all(alive(p) for p in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # The watchdog sees its pipe close: SIGTERM, 3 s, SIGKILL (decode ignores SIGTERM).
        wait_for(lambda: not any(alive(p) for p in tree), 20, "children of a SIGKILLed pdctl to exit")
    finally:
        kill_groups([proc.pid])


def test_port_conflict_caught_before_starting(deploy_dir: Path) -> None:
    d = deploy_dir
    ports = write_deployment(d)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports["d_side"]))
        s.listen()
        r = pdctl(d, "up", "-d")
    assert r.returncode == 1
    assert f"port {ports['d_side']} (decode side channel) is already in use" in r.stderr
    assert "nothing was started" in r.stderr
    assert not (d / ".pdctl" / "state.json").exists()


def _failed_and_cleaned_up(d: Path) -> None:
    """The run's state says it failed, and every process it recorded is gone within 30 s."""
    assert state(d)["status"] == "failed"
    wait_for(lambda: not any(alive(p) for p in recorded_pids(d)), 30, "cleanup after a failed start")


@pytest.mark.parametrize(
    ("port", "ended", "finding"),
    [
        # vLLM's NIXL listener dies and its engine waits on (the simulator does the same): the line ends the start
        ("d_side", "decode still runs but can never become ready",
         "error PD018 config.toml:11: decode.side_channel_port: port {} (decode side channel) is already in use"),
        ("decode", "decode exited (exit code 3)",  # uvicorn's startup failure
         "error PD018 settings.json:1: routing.decode_endpoint: port {} (decode) is already in use"),
    ],
)  # fmt: skip
def test_a_port_taken_after_the_check_fails_the_start_at_once_with_pd018(
    deploy_dir: Path, port: str, ended: str, finding: str
) -> None:
    d = deploy_dir
    ports = write_deployment(d)
    cfg = d / "config.toml"
    cfg.write_text(cfg.read_text().replace("ready_timeout_s = 120", "ready_timeout_s = 900"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[port]))
        s.listen()
        t0 = time.monotonic()
        r = pdctl(d, "up", "-d", "--no-check")  # --no-check: the port is taken between check and the bind
        took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout
    assert took < 240, took  # the line ends the start, not ready_timeout_s (900 s)
    err = " ".join(r.stderr.split())  # rich wraps long lines
    assert ended in err and str(d / ".pdctl" / "logs" / "decode.log") in err
    assert f"127.0.0.1:{ports[port]}" in err.split("last ")[1]  # the log line that said so, quoted
    assert finding.format(ports[port]) + " on 127.0.0.1" in err  # check's PD018 for that port, and its hint:
    assert f"stop what listens on 127.0.0.1:{ports[port]}" in err
    _failed_and_cleaned_up(d)


def test_crash_at_start_reports_and_cleans_up(deploy_dir: Path) -> None:
    d = deploy_dir
    write_deployment(d, decode_extra=["--sim-fault", "fail-start:3"])
    r = pdctl(d, "up", "-d")
    assert r.returncode == 1, r.stdout
    assert "decode exited (exit code 3)" in r.stderr
    assert "last " in r.stderr and "decode.log" in r.stderr
    _failed_and_cleaned_up(d)


def test_warmup_retries_a_failed_handshake_and_fails_without_kv_params(deploy_dir: Path) -> None:
    d = deploy_dir
    write_deployment(d, decode_extra=["--sim-fault", "handshake-fail"])
    proc = _start_foreground(d)
    try:
        _wait_ready(d, proc)
        tree = all_tree_pids(d)
        r = pdctl(d, "down")  # from another process: the foreground supervisor stops everything in order
        assert r.returncode == 0, r.stderr
        out = _output(d, proc)
    finally:
        kill_groups([proc.pid])
    assert proc.returncode == 0
    assert "SIGTERM: stopping" in out
    wait_for(lambda: not any(alive(p) for p in tree), 30, "every process of the run to exit")
    attempts = [ln for ln in out.splitlines() if "warm-up prefill->decode request" in ln]
    assert len(attempts) >= 2 and "failed: decode" in attempts[0] and attempts[-1].endswith("passed"), out
    assert attempts[0].split()[6] != attempts[-1].split()[6]  # a fresh request id each time

    d2 = d / "second"
    d2.mkdir()
    write_deployment(d2, prefill_extra=["--sim-fault", "no-kv-params"])
    r = pdctl(d2, "up", "-d")
    assert r.returncode == 1
    assert "warm-up probe prefill->decode failed" in r.stderr and "kv_transfer_params" in r.stderr
    assert not any(alive(p) for p in recorded_pids(d2)[2:])


def test_prefill_restart_then_disagg_still_works(deploy_dir: Path) -> None:
    d = deploy_dir
    # Request 1 is the warm-up, 2 and 3 are ours; the prefill engine exits after the third.
    ports = write_deployment(d, prefill_extra=["--sim-fault", "crash-after:3"],
                             supervisor='restart = "on-failure"\nstart_secs = 1')  # fmt: skip
    r = pdctl(d, "up", "-d")
    assert r.returncode == 0, r.stdout + r.stderr
    first = {p["name"]: p["pid"] for p in state(d)["processes"]}
    gw = f"http://127.0.0.1:{ports['gateway']}"
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "sim-model", "prompt": "tell me about kv caches", "max_tokens": 3}
    for _ in range(2):
        assert httpx.post(f"{gw}/v1/completions", headers=headers, json=body, timeout=60).status_code == 200

    def restarted() -> bool:
        rec = {p["name"]: p for p in state(d)["processes"]}["prefill"]
        return rec["restarts"] == 1 and rec["state"] == "ready" and rec["pid"] != first["prefill"]

    wait_for(restarted, 120, "prefill restarted and ready")
    wait_for(lambda: "re-warm-up prefill->decode request" in (d / ".pdctl/logs/pdctl.log").read_text(), 60,
             "the re-warm-up probe")  # fmt: skip
    events = (d / ".pdctl/logs/pdctl.log").read_text()
    assert "prefill exited (exit code 1)" in events and "restarting prefill in 1 s" in events
    # The gateway may hold the restarted instance back for its breaker cooldown (503 + Retry-After).
    resp = httpx.post(f"{gw}/v1/completions", headers=headers, json=body, timeout=60)
    deadline = time.monotonic() + 90
    while resp.status_code == 503 and time.monotonic() < deadline:
        time.sleep(1.0)
        resp = httpx.post(f"{gw}/v1/completions", headers=headers, json=body, timeout=60)
    assert resp.status_code == 200 and resp.headers["x-pd-path"] == "disagg", resp.text
    st = json.loads(pdctl(d, "status", "--json").stdout)
    assert {p["name"]: p["restarts"] for p in st["processes"]} == {"prefill": 1, "decode": 0, "gateway": 0}
    assert not alive(first["prefill"])
    assert pdctl(d, "down").returncode == 0


def test_down_checks_pid_ownership(deploy_dir: Path) -> None:
    from pdctl.runtime.rundir import RunState, kill_recorded, owned_process, write_state

    me = psutil.Process()
    assert owned_process(me.pid, me.create_time(), me.cmdline()) is not None
    assert owned_process(me.pid, me.create_time() - 5, me.cmdline()) is None  # a reused pid
    assert owned_process(me.pid, me.create_time(), ["/usr/bin/other", "x"]) is None
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        ct = psutil.Process(bystander.pid).create_time()
        rec = {"name": "prefill", "pid": bystander.pid, "create_time": ct - 10, "argv": bystander.args}
        st = RunState(run_dir=str(deploy_dir / ".pdctl"), config_path="c", settings_path="s", status="ready",
                      supervisor_pid=bystander.pid, supervisor_create_time=ct - 10, processes=[rec])  # fmt: skip
        write_state(deploy_dir / ".pdctl", st)
        assert kill_recorded(st, grace_s=1) == []
        r = pdctl(deploy_dir, "down", "--run-dir", str(deploy_dir / ".pdctl"))
        assert r.returncode == 0
        assert bystander.poll() is None  # not ours any more: never signalled
    finally:
        bystander.kill()
        bystander.wait()


def test_status_reads_tree_resources_and_gpu_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdctl.runtime.process import ManagedProcess
    from pdctl.runtime.rundir import RunState, collect_status
    from tests.fakes.helpers import fake_spec

    p = ManagedProcess(fake_spec("decode", "decode", "--spawn-grandchild"), tmp_path / "logs")
    p.start()
    try:
        p.wait_ready(60)
        p.refresh_descendants()
        child = next(d.pid for d in p.descendants() if d.pid != p.pid)
        # A stand-in for nvidia-smi's compute-apps query: the grandchild holds 1000 MiB, a stranger 5 MiB.
        bindir = tmp_path / "bin"
        bindir.mkdir()
        smi = bindir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{child}, 1000'\necho '1, 5'\n")
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
        rec = {"name": "decode", "role": "decode", "state": "ready", "pid": p.pid, "create_time": p.create_time,
               "argv": list(p.spec.argv), "ready_url": p.spec.ready_url, "url": p.spec.url, "restarts": 2,
               "started_at": p.started_wall}  # fmt: skip
        gone = dict(rec, name="prefill", role="prefill", create_time=p.create_time - 100)
        st = RunState(run_dir=str(tmp_path), config_path="c", settings_path="s", processes=[rec, gone])
        rows = {r.name: r for r in collect_status(st)}
        d = rows["decode"]
        assert d.alive and d.health == "ok" and d.restarts == 2 and d.gpu_mem_mib == 1000.0
        assert d.rss_bytes is not None and d.rss_bytes > 0 and d.uptime_s is not None
        assert rows["prefill"].state == "gone" and not rows["prefill"].alive and rows["prefill"].health == "-"
    finally:
        p.stop(5)


def test_docs_describe_every_flag() -> None:
    import typer.main

    from pdctl.cli import app

    doc = (REPO / "docs" / "lifecycle.md").read_text()
    group = typer.main.get_command(app)
    for name in ("up", "down", "status", "logs"):
        cmd = group.commands[name]  # type: ignore[attr-defined]
        assert f"### `pdctl {name}" in doc
        section = doc.split(f"### `pdctl {name}", 1)[1].split("\n### ", 1)[0]
        for param in cmd.params:
            for opt in param.opts:
                if opt.startswith("-") and opt != "--help":
                    assert f"`{opt}" in section, f"pdctl {name} {opt} missing from docs/lifecycle.md"


def test_up_refuses_a_decode_that_tokenizes_differently(deploy_dir: Path) -> None:
    """Reliability case S6: never ready when decode serves another tokenizer; the mismatch is named; all torn down."""
    d = deploy_dir
    write_deployment(d, decode_extra=["--sim-fault", "tokenizer"])
    r = pdctl(d, "up", "-d")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "do not serve the same model" in r.stderr and "/tokenize differs" in r.stderr
    assert "§5.4" in r.stderr
    wait_for(lambda: not any(alive(p) for p in recorded_pids(d)[2:]), 30, "every process of the run to exit")


def test_exit_without_teardown_keeps_output_and_exit_code(tmp_path: Path) -> None:
    """The console script's fast exit (as ``up -d`` uses it): output flushed, the command's exit code kept, and
    the interpreter's teardown (atexit handlers included) skipped."""
    script = (
        "import atexit, typer\n"
        "from pdctl.cli._app import app, exit_without_teardown, run\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "@app.command('fast-exit-probe')\n"
        "def probe(code: int = 0) -> None:\n"
        "    print('x' * 70000)\n"  # more than a pipe holds: only a flush gets it all out
        "    exit_without_teardown()\n"
        "    raise typer.Exit(code)\n"
        "run()\n"
    )
    for code in (0, 3):
        r = subprocess.run([sys.executable, "-c", script, "fast-exit-probe", "--code", str(code)],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
        assert r.returncode == code, r.stderr
        assert r.stdout.count("x") == 70000 and "teardown ran" not in r.stdout


def _status_json(run_dir: Path) -> tuple[int, dict[str, Any]]:
    from typer.testing import CliRunner

    from pdctl.cli import app

    r = CliRunner().invoke(app, ["status", "--json", "--run-dir", str(run_dir)])
    assert "Traceback" not in r.output
    return r.exit_code, json.loads(r.stdout)


def _write_raw_state(run_dir: Path, text: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "state.json").write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"status": "ready"}',
        '{"run_dir": "r", "config_path": "c", "settings_path": "s", "processes": [{"pid": 1}]}',
        '{"run_dir": "r", "config_path": "c", "settings_path": "s", "supervisor_pid": "12"}',
    ],
)
def test_status_json_of_a_damaged_state_file(tmp_path: Path, text: str) -> None:
    rd = tmp_path / ".pdctl"
    _write_raw_state(rd, text)
    code, out = _status_json(rd)
    assert code == 1
    assert out["status"] == "unreadable" and out["supervisor_running"] is False and out["processes"] == []
    assert out["error"].startswith(f"cannot read {rd / 'state.json'}") and "remove" in out["hint"]


def test_status_of_a_damaged_state_file_is_an_error_with_a_hint(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pdctl.cli import app

    rd = tmp_path / ".pdctl"
    _write_raw_state(rd, "[]")
    r = CliRunner().invoke(app, ["status", "--run-dir", str(rd)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "cannot read" in r.output and "not a JSON object" in r.output and "hint:" in r.output


def test_status_json_when_nothing_ran(tmp_path: Path) -> None:
    code, out = _status_json(tmp_path / "never")
    assert code == 1 and out["status"] == "not running" and out["supervisor_pid"] is None
    assert "does not exist" in out["error"] and "pdctl up" in out["hint"]


def test_status_json_of_a_dead_supervisor_without_logs(tmp_path: Path) -> None:
    from pdctl.runtime.rundir import RunState, write_state

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rd = tmp_path / ".pdctl"
    rec = {"name": "prefill", "role": "prefill", "pid": gone.pid, "create_time": 1.0, "state": "ready"}
    write_state(rd, RunState(run_dir=str(rd), config_path="c", settings_path="s", status="ready",
                             supervisor_pid=gone.pid, supervisor_create_time=1.0, processes=[rec]))  # fmt: skip
    assert not (rd / "logs").exists()
    code, out = _status_json(rd)
    assert code == 0 and out["status"] == "supervisor gone" and out["error"] is None
    assert [(p["name"], p["state"], p["alive"]) for p in out["processes"]] == [("prefill", "gone", False)]
    st = RunState.from_json(json.loads((rd / "state.json").read_text()))
    st.status = "stopped"
    write_state(rd, st)
    assert _status_json(rd) == (0, {**out, "status": "stopped"})


def test_down_after_a_killed_supervisor_removes_the_workers_ipc_folders(tmp_path: Path) -> None:
    from pdctl.runtime.rundir import RunState, write_state

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rd = tmp_path / ".pdctl"
    ipc = rd / "ipc" / "decode"
    ipc.mkdir(parents=True)
    (ipc / "0b5c2f64-6a41-4b3e-9d3c-1d6e0c7a9f10").touch()  # what a killed engine left
    rec = {"name": "decode", "role": "decode", "pid": gone.pid, "create_time": 1.0, "state": "ready",
           "ipc_dir": str(ipc)}  # fmt: skip
    write_state(rd, RunState(run_dir=str(rd), config_path="c", settings_path="s", status="ready",
                             supervisor_pid=gone.pid, supervisor_create_time=1.0, processes=[rec]))  # fmt: skip
    r = pdctl(tmp_path, "down", "--run-dir", str(rd))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not ipc.exists() and json.loads((rd / "state.json").read_text())["status"] == "stopped"


def test_curl_commands_are_the_recipe_requests() -> None:
    from pdctl.cli.run_cmds import curl_commands
    from pdctl.config import load
    from pdctl.config.recipe import RECIPE_REQUESTS

    data = REPO / "pdctl" / "data"
    dep = load(data / "config.toml", data / "settings.json")
    cmds = curl_commands(dep)
    assert [c.split()[1] for c in cmds] == ["-N" if r.stream else "-s" for r in RECIPE_REQUESTS]
    for cmd, r in zip(cmds, RECIPE_REQUESTS, strict=True):
        body = json.loads(cmd.split(" -d '", 1)[1].rstrip("'"))
        assert body == r.body(dep.decode[0].model_name)
        assert f"${dep.gateway.api_key_env}" in cmd
