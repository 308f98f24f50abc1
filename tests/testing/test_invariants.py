"""The invariant checker (pdctl/testing/invariants/) against real processes: each check passes when the invariant
holds and fails, naming the culprit, when it is broken on purpose."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.testing import SimProcess, free_port, start_sim
from pdctl.testing.invariants import (
    ClientTally,
    GatewayOutcomes,
    InvariantReport,
    ResourceSample,
    check_loopback,
    check_n1,
    check_n2,
    check_n3,
    check_n4,
    check_n5,
    check_n6,
    client_id,
    client_outcome,
    decode_requests_from_log,
    gateway_outcomes,
    run_census,
    sample_resources,
    sample_workers,
)
from pdctl.vllm.protocol import build_prefill_body
from tests.fakes.gateway_harness import KEY, GatewayThread, make_settings

PROMPT = " ".join(f"invariant{i % 7} word {i}." for i in range(40))


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[list[SimProcess]]:
    procs: list[SimProcess] = []
    yield procs
    for sp in procs:
        sp.stop(grace_s=2.0)


@pytest.fixture
def pd_gateway(tmp_path: Path, sims: list[SimProcess]) -> Iterator[tuple[GatewayThread, SimProcess, SimProcess]]:
    debug = {"VLLM_LOGGING_LEVEL": "DEBUG"}
    prefill = start_sim([], str(tmp_path), name="prefill", role="kv_producer", env=debug,
                        extra_config={"kv_lease_duration": 2})  # fmt: skip
    sims.append(prefill)
    decode = start_sim([], str(tmp_path), name="decode", role="kv_consumer", env=debug)
    sims.append(decode)
    from pdctl.gateway.settings import LocalModel

    gw = GatewayThread(make_settings([prefill.url], [decode.url], models=(LocalModel("sim-model", 4096),)))
    yield gw, prefill, decode
    gw.stop()


def _post(gw: GatewayThread, body: dict[str, Any], key: str | None = KEY, rid: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if rid:
        headers["x-request-id"] = rid
    return httpx.post(gw.url + "/v1/completions", json=body, headers=headers, timeout=60)


# ---------------------------------------------------------------------------------------------- N1


def test_n1_counters_balance_on_a_real_gateway(pd_gateway: tuple[GatewayThread, SimProcess, SimProcess]) -> None:
    gw, _, _ = pd_gateway
    before = gateway_outcomes(gw.metrics_text())
    assert before is not None
    tally = ClientTally()
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
    for i in range(3):
        r = _post(gw, body, rid=f"inv-ok-{i}")
        tally.record(client_outcome(r.status_code, r.content, stream=False), f"inv-ok-{i}")
    r = _post(gw, {**body, "stream": True, "stream_options": {"include_usage": True}})
    tally.record(client_outcome(r.status_code, r.content, stream=True))
    r = _post(gw, body, key="sk-wrong")
    tally.record(client_outcome(r.status_code, r.content, stream=False))
    r = _post(gw, {**body, "max_tokens": -1})
    tally.record(client_outcome(r.status_code, r.content, stream=False))

    after = gateway_outcomes(gw.metrics_text())
    assert after is not None
    delta = after.minus(before)
    assert (delta.accepted, delta.succeeded, delta.errored, delta.cancelled) == (6, 4, 2, 0)
    assert delta.by_status["401"] == 1 and delta.by_status["400"] == 1
    result = check_n1(delta, tally)
    assert result.ok, result.detail
    assert (tally.succeeded, tally.errored, tally.violations) == (4, 2, [])

    # A gateway that lost one request, or clients that saw more successes than it counted, fail N1.
    lost = GatewayOutcomes(delta.accepted + 1, delta.succeeded, delta.errored, delta.cancelled, 0)
    assert not check_n1(lost).ok and "accepted 7" in check_n1(lost).detail
    stuck = GatewayOutcomes(delta.accepted, delta.succeeded, delta.errored, delta.cancelled, 1)
    assert "still in flight" in check_n1(stuck).detail
    tally.succeeded += 1
    assert "clients saw 5 successes" in check_n1(delta, tally).detail
    assert not check_n1(None).ok


def _sse(*events: str) -> bytes:
    return b"".join(f"data: {e}\n\n".encode() for e in events)


CHUNK = '{"choices":[{"index":0,"text":"a","finish_reason":null}]}'
LAST = '{"choices":[{"index":0,"text":"b","finish_reason":"length"}]}'
ERR = '{"error":{"message":"decode died","type":"upstream_error","param":null,"code":"upstream_error"}}'
VLLM_ERR = '{"error":{"message":"boom","type":"Internal Server Error","param":null,"code":500}}'


@pytest.mark.parametrize(
    ("status", "body", "stream", "kind", "violation"),
    [
        (200, _sse(CHUNK, LAST, "[DONE]"), True, "succeeded", None),
        (200, _sse(CHUNK, LAST, "[DONE]").replace(b"\n", b"\r\n"), True, "succeeded", None),
        (200, _sse(CHUNK, ERR), True, "errored", None),
        (200, _sse(CHUNK, LAST), True, "errored", "truncated"),
        (200, _sse(CHUNK, "[DONE]"), True, "errored", "no finish_reason"),
        (200, _sse(CHUNK, ERR, "[DONE]"), True, "errored", "an error event and [DONE]"),
        (200, _sse(CHUNK, ERR, ERR), True, "errored", "2 error events"),
        (200, _sse(CHUNK, ERR, CHUNK), True, "errored", "events after the error event"),
        (200, _sse(CHUNK, VLLM_ERR), True, "errored", "must be a string or null"),
        (200, _sse(LAST, "[DONE]", "[DONE]"), True, "errored", "2 seen"),
        (200, json.dumps({"choices": [{"text": "x", "finish_reason": "stop"}]}).encode(), False, "succeeded", None),
        (200, json.dumps({"choices": [{"text": "x", "finish_reason": None}]}).encode(), False, "errored", "finish"),
        (503, ERR.encode(), False, "errored", None),
        (401, b'{"error": "Unauthorized"}', False, "errored", "not an OpenAI error object"),
        (500, b"Internal Server Error", False, "errored", "not JSON"),
    ],
)
def test_client_outcome_classifies_terminal_outcomes(
    status: int, body: bytes, stream: bool, kind: str, violation: str | None
) -> None:
    out = client_outcome(status, body, stream=stream)
    assert out.kind == kind
    if violation is None:
        assert out.violation is None
    else:
        assert out.violation is not None and violation in out.violation
    assert client_outcome(status, body[:3], stream=stream, cancelled=True).kind == "cancelled"


# ---------------------------------------------------------------------------------------------- N2


def test_n2_waits_for_the_lease_to_free_prefill_kv(tmp_path: Path, sims: list[SimProcess]) -> None:
    prefill = start_sim([], str(tmp_path), name="p", role="kv_producer", extra_config={"kv_lease_duration": 2})
    sims.append(prefill)
    urls = {"prefill": prefill.url}
    baseline = sample_workers(urls)
    assert baseline["prefill"] is not None and baseline["prefill"].kv_usage == 0.0
    body = build_prefill_body({"model": "sim-model", "prompt": PROMPT * 4, "max_tokens": 8}, "params")
    r = httpx.post(prefill.url + "/v1/completions", json=body, headers={"x-request-id": uuid.uuid4().hex}, timeout=30)
    assert r.status_code == 200 and r.json()["kv_transfer_params"]
    held = sample_workers(urls)["prefill"]
    assert held is not None and held.idle and held.kv_usage is not None and held.kv_usage > 0.0

    early = check_n2(urls, baseline, timeout_s=0.2)  # decode never pulled: blocks held until the lease ends
    assert not early.ok and "kv_cache_usage_perc" in early.detail
    late = check_n2(urls, baseline, timeout_s=2 + 5)
    assert late.ok, late.detail


def test_n2_prefill_kv_freed_as_soon_as_decode_pulls(tmp_path: Path, sims: list[SimProcess]) -> None:
    # A 30 s lease: only decode's pull can bring prefill back to its baseline within the 3 s allowed here.
    prefill = start_sim([], str(tmp_path), name="p", role="kv_producer", extra_config={"kv_lease_duration": 30})
    sims.append(prefill)
    decode = start_sim([], str(tmp_path), name="d", role="kv_consumer")
    sims.append(decode)
    urls = {"prefill": prefill.url, "decode": decode.url}
    baseline = sample_workers(urls)
    from pdctl.gateway.settings import LocalModel

    gw = GatewayThread(make_settings([prefill.url], [decode.url], models=(LocalModel("sim-model", 4096),)))
    try:
        for i in range(3):
            r = _post(gw, {"model": "sim-model", "prompt": PROMPT * 3, "max_tokens": 4}, rid=f"pull-{i}")
            assert r.status_code == 200 and r.headers["x-pd-path"] == "disagg", r.text
    finally:
        gw.stop()
    result = check_n2(urls, baseline, timeout_s=3.0)
    assert result.ok, result.detail


def test_n2_unreachable_worker_fails() -> None:
    port = free_port()
    r = check_n2({"decode": f"http://127.0.0.1:{port}"}, timeout_s=0.3)
    assert not r.ok and "decode: /metrics unreachable" in r.detail


# ---------------------------------------------------------------------------------------------- N3


def test_n3_counts_decode_requests_from_the_debug_log(pd_gateway: tuple[GatewayThread, SimProcess, SimProcess]) -> None:
    gw, _, decode = pd_gateway
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 3}
    for i in range(3):
        assert _post(gw, body, rid=f"n3-{i}").status_code == 200
    chat = httpx.post(
        gw.url + "/v1/chat/completions",
        timeout=60,
        headers={"authorization": f"Bearer {KEY}", "x-request-id": "n3-chat"},
        json={"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2},
    )
    assert chat.status_code == 200, chat.text
    counts = decode_requests_from_log(decode.output().splitlines())
    assert counts == {"n3-0": 1, "n3-1": 1, "n3-2": 1, "n3-chat": 1}
    result = check_n3(counts)
    assert result.ok, result.detail

    # The same pipeline id decoded twice (replayed kv_transfer_params), or an uncounted retry: N3 fails.
    replay = (
        decode.output()
        + decode.output().split("\n")[
            next(i for i, ln in enumerate(decode.output().split("\n")) if "start_load_kv for request cmpl-n3-1-" in ln)
        ]
    )
    assert "n3-1: 2 decode requests" in check_n3(decode_requests_from_log(replay.splitlines())).detail
    retried = {**counts, "n3-0-retry1": 1}
    assert "the gateway counted 0 retries" in check_n3(retried, retries=0).detail
    assert check_n3(retried, retries=1).ok
    assert "3 pipelines" in check_n3({"a": 1, "a-retry1": 1, "a-retry2": 1}, retries=2).detail
    assert check_n3({}).skipped
    assert client_id("x-1-retry1") == client_id("x-1-release") == "x-1"


# ---------------------------------------------------------------------------------------------- N4


def _fake_run_dir(d: Path, proc: subprocess.Popen[bytes], port: int) -> Path:
    import psutil

    run = d / ".pdctl"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "w.log").write_text("hello\n")
    rec = {"name": "w", "role": "decode", "pid": proc.pid, "pgid": os.getpgid(proc.pid),
           "create_time": psutil.Process(proc.pid).create_time(), "ports": [port], "url": "http://x",
           "log_file": str(run / "logs" / "w.log"), "descendants": []}  # fmt: skip
    (run / "state.json").write_text(json.dumps({"supervisor_pid": 0, "watchdog_pid": 0, "processes": [rec]}))
    return run


def test_n4_finds_group_members_and_busy_ports(tmp_path: Path) -> None:
    # A worker that listens and leaves a grandchild (setsid'd group, like VLLM::EngineCore) behind.
    script = (
        "import socket, subprocess, sys, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('up', flush=True); time.sleep(60)\n"
    )
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", script, str(port)], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
        census = run_census(_fake_run_dir(tmp_path, proc, port))
        assert census.worker_pids == {"w": proc.pid} and census.worker_urls == {"w": "http://x"}
        assert len(census.pids) == 2  # the live grandchild was added
        running = check_n4(census, timeout_s=0.3)
        assert not running.ok
        assert f"pid {proc.pid} still alive" in running.detail and f"port {port} still in use" in running.detail
        grandchild = next(p for p in census.pids if p != proc.pid)
        # SIGKILL of the worker's pid only (the vLLM orphan hazard): the grandchild stays in the group.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        orphan = check_n4(census, timeout_s=0.5)
        assert not orphan.ok and f"pid {grandchild}" in orphan.detail and "still alive" in orphan.detail
        assert "left in a recorded process group" in orphan.detail
        os.killpg(proc.pid, signal.SIGKILL)
        clean = check_n4(census, timeout_s=10)
        assert clean.ok, clean.detail
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(("host", "ok"), [("127.0.0.1", True), ("0.0.0.0", False)])
def test_x4_listening_sockets_must_be_loopback(tmp_path: Path, host: str, ok: bool) -> None:
    script = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, host], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        census = run_census(_fake_run_dir(tmp_path, proc, port))
        result = check_loopback(census)
        assert result.ok is ok, result.detail
        if not ok:
            assert f"listens on 0.0.0.0:{port}" in result.detail
            assert check_loopback(census, allowed=[port]).ok  # e.g. a gateway meant to be public
        else:
            assert "1 listening socket(s)" in result.detail
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------------------------------------- N5


def test_n5_names_each_leak_without_printing_the_secret(tmp_path: Path) -> None:
    secret = "sk-invariant-" + uuid.uuid4().hex
    other = "sk-upstream-" + uuid.uuid4().hex
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "ok.log").write_text("Authorization: Bearer ***\n")
    clean = check_n5([secret, other], files=[logs], texts={"response": b'{"ok": true}'})
    assert clean.ok, clean.detail

    (logs / "sub").mkdir()
    (logs / "sub" / "gateway.log").write_text(f"header authorization=Bearer {secret}\n")
    leaky_env = {**os.environ, "LEAKY": other}
    holder = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(30)", f"--api-key={secret}"],
                              env=leaky_env, start_new_session=True)  # fmt: skip
    try:
        time.sleep(0.2)
        r = check_n5([secret, other], files=[logs], texts={"body of req 7": f"echo {other}"},
                     environ_pids=[holder.pid])  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert not r.ok
    assert f"secret #1 in {logs / 'sub' / 'gateway.log'}" in r.detail
    assert "secret #2 in body of req 7" in r.detail
    assert f"secret #1 in /proc/{holder.pid}/cmdline" in r.detail
    assert f"secret #2 in /proc/{holder.pid}/environ" in r.detail
    assert secret not in r.detail and other not in r.detail
    assert check_n5([]).skipped


# ---------------------------------------------------------------------------------------------- N6


def test_n6_bounds_fds_and_tasks() -> None:
    base = sample_resources(os.getpid())
    files = [open(os.devnull) for _ in range(40)]
    try:
        grown = sample_resources(os.getpid())
        r = check_n6(base, grown)
        assert not r.ok and "open fds" in r.detail
    finally:
        for f in files:
            f.close()
    assert check_n6(base, sample_resources(os.getpid())).ok
    tasks = check_n6(ResourceSample(10, 1 << 20, 2, 5), ResourceSample(10, 1 << 20, 2, 6))
    assert not tasks.ok and "asyncio tasks 6 > baseline 5" in tasks.detail
    rss = check_n6(ResourceSample(10, 100 << 20, 2, 5), ResourceSample(10, 120 << 20, 2, 5))
    assert not rss.ok and "RSS bytes" in rss.detail


def test_n6_reads_gateway_tasks_from_metrics(pd_gateway: tuple[GatewayThread, SimProcess, SimProcess]) -> None:
    gw, _, _ = pd_gateway
    sample = sample_resources(os.getpid(), gw.metrics_text())
    assert sample.tasks is not None and sample.tasks >= 1


def test_report_render_and_lookup() -> None:
    rep = InvariantReport((check_n6(ResourceSample(1, 1, 1), ResourceSample(1, 1, 1)), check_n3({})))
    assert rep.ok and rep.get("N3").skipped and "N6 ok" in rep.render() and "N3 skip" in rep.render()
    assert rep.to_json()[0]["name"] == "N6"
