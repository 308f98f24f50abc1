"""Every ``--sim-fault``: one test each, against real simulator processes."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdctl.sim.faults import FaultSet, parse_fault
from pdctl.testing import SimProcess, start_sim
from pdctl.vllm.promtext import metric_value, samples
from pdctl.vllm.protocol import build_decode_body, build_prefill_body, check_kv_params

PROMPT = " ".join(f"fault{i % 11} case {i}." for i in range(30))


class Sims:
    """Starts workers for one test and stops them all afterwards."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.procs: list[SimProcess] = []

    def start(self, *args: str, **kw: Any) -> SimProcess:
        kw.setdefault("name", f"sim{len(self.procs)}")
        sp = start_sim(list(args), self.log_dir, **kw)
        self.procs.append(sp)
        return sp

    def stop(self) -> None:
        for sp in self.procs:
            sp.stop(grace_s=2.0)


@pytest.fixture
def sims(tmp_path: Any) -> Iterator[Sims]:
    s = Sims(str(tmp_path))
    try:
        yield s
    finally:
        s.stop()


def _body(**kw: Any) -> dict[str, Any]:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    body.update(kw)
    return body


def _completion(sp: SimProcess, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
    return httpx.post(
        sp.url + "/v1/completions", json=body, headers={"X-Request-Id": uuid.uuid4().hex}, timeout=timeout
    )


def _pd(prefill: SimProcess, decode: SimProcess, body: dict[str, Any]) -> httpx.Response:
    p = _completion(prefill, build_prefill_body(body))
    assert p.status_code == 200, p.text
    check = check_kv_params(p.json())
    assert check.usable, check
    return _completion(decode, build_decode_body(body, check.params))


def _metric(sp: SimProcess, name: str) -> float:
    value = metric_value(samples(httpx.get(sp.url + "/metrics").text), name)
    assert value is not None, name
    return value


def _wait_for(cond: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def _quiet_completion(sp: SimProcess) -> None:
    with contextlib.suppress(httpx.HTTPError):
        _completion(sp, _body(), timeout=30)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # Zombies of our own direct child still count as group members until reaped.
    return True


def test_parse_fault_forms_and_errors() -> None:
    f = parse_fault("corrupt-kv@after=2@p=1.0@times=1")
    assert (f.name, f.after, f.times) == ("corrupt-kv", 2, 1)
    assert [f.fires() for _ in range(5)] == [False, False, True, False, False]
    assert parse_fault("handshake-fail").times == 1
    assert parse_fault("slow-kv:0.5").num(0) == 0.5
    half = parse_fault("corrupt-kv@p=0.5", seed=3)
    hits = sum(half.fires() for _ in range(400))
    assert 120 < hits < 280
    for bad, msg in [
        ("nope", "unknown --sim-fault"),
        ("crash-after", "needs an argument"),
        ("slow-kv:fast", "not a number"),
        ("stall@when=3", "unknown modifier"),
        ("stall@p=2", "bad value"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_fault(bad)
    assert FaultSet(["stall:1", "tokenizer"]).has("tokenizer")


def test_fail_start_exits_with_code(sims: Sims) -> None:
    sp = sims.start("--sim-fault", "fail-start:3", wait_ready=False)
    assert sp.wait_exit(20) == 3
    assert "EngineCore failed to start" in sp.output()


def test_bad_flag_value_fails_like_vllm(sims: Sims) -> None:
    sp = sims.start("--sim-profile", "tpu9", wait_ready=False)
    assert sp.wait_exit(20) == 1
    assert "unknown --sim-profile 'tpu9'" in sp.output()
    sp2 = sims.start(kv_fields={"kv_ip": "10.0.0.1"}, wait_ready=False, name="removed")
    assert sp2.wait_exit(20) == 1
    assert "kv_ip: Extra inputs are not permitted" in sp2.output()


def test_tool_calling_flags_are_checked_like_vllm(sims: Sims) -> None:
    """PD032's fix starts on the simulator; the flag without a parser fails as vLLM's validate_parsed_serve_args."""
    sp = sims.start("--enable-auto-tool-choice", wait_ready=False)
    assert sp.wait_exit(20) == 1
    assert "--enable-auto-tool-choice requires --tool-call-parser" in sp.output()
    ok = sims.start("--enable-auto-tool-choice", "--tool-call-parser", "hermes", name="tools")
    assert ok.wait_exit(1) is None


def test_crash_after_n_requests(sims: Sims) -> None:
    sp = sims.start("--sim-fault", "crash-after:2")
    assert _completion(sp, _body()).status_code == 200
    assert _completion(sp, _body()).status_code == 200
    assert sp.wait_exit(20) == 1
    assert "EngineCore encountered a fatal error" in sp.output()


def test_crash_mid_stream(sims: Sims) -> None:
    sp = sims.start("--sim-fault", "crash-mid-stream:3")
    received: list[str] = []
    with contextlib.suppress(httpx.HTTPError):
        with httpx.stream("POST", sp.url + "/v1/completions", json=_body(stream=True, max_tokens=50), timeout=10) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    received.append(line)
    assert len(received) == 3
    assert "data: [DONE]" not in received
    assert sp.wait_exit(20) == 137


def test_stall_hangs_requests_but_health_stays_ok(sims: Sims) -> None:
    sp = sims.start("--sim-fault", "stall@after=1")
    assert _completion(sp, _body()).status_code == 200
    with pytest.raises(httpx.ReadTimeout):
        _completion(sp, _body(), timeout=1.5)
    assert httpx.get(sp.url + "/health").status_code == 200
    # While a client waits, the request shows as running (and it is dropped when the client gives up).
    waiter = threading.Thread(target=_quiet_completion, args=(sp,), daemon=True)
    waiter.start()
    assert _wait_for(lambda: _metric(sp, "vllm:num_requests_running") + _metric(sp, "vllm:num_requests_waiting") >= 1)


def test_stall_with_duration_recovers(sims: Sims) -> None:
    sp = sims.start("--sim-fault", "stall:1")
    t0 = time.monotonic()
    assert _completion(sp, _body()).status_code == 200
    assert time.monotonic() - t0 >= 1.0
    assert _completion(sp, _body()).status_code == 200


def test_slow_kv_adds_transfer_time(sims: Sims) -> None:
    prefill = sims.start(role="kv_producer")
    decode = sims.start("--sim-fault", "slow-kv:1.0", role="kv_consumer")
    r = _pd(prefill, decode, _body())
    assert r.status_code == 200
    assert _metric(decode, "vllm:nixl_xfer_time_seconds_sum") >= 1.0


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_handshake_fails_on_first_pull_only(sims: Sims, side: str) -> None:
    fault = ["--sim-fault", "handshake-fail"]
    prefill = sims.start(*(fault if side == "prefill" else []), role="kv_producer")
    decode = sims.start(*(fault if side == "decode" else []), role="kv_consumer")
    first = _pd(prefill, decode, _body())
    assert first.status_code == 500
    assert first.json()["error"]["code"] == 500
    out = decode.output()
    assert "NIXL transfer failure: handshake_setup_failed | Context: {'failure_type': 'handshake_setup_failed'" in out
    assert "Failing 1 request(s) due to KV load failure (failure_policy=fail" in out
    assert _metric(decode, "vllm:nixl_num_failed_transfers_total") == 1
    second = _pd(prefill, decode, _body(prompt=PROMPT + " again"))
    assert second.status_code == 200
    assert "NIXL compatibility check passed" in decode.output()


def test_recompute_policy_falls_back_to_local(sims: Sims) -> None:
    prefill = sims.start(role="kv_producer")
    decode = sims.start(
        "--sim-fault", "handshake-fail", role="kv_consumer", kv_fields={"kv_load_failure_policy": "recompute"}
    )
    r = _pd(prefill, decode, _body())
    assert r.status_code == 200
    ref = _completion(decode, _body(cache_salt="ref")).json()
    assert r.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in decode.output()


def test_model_name_fault(sims: Sims) -> None:
    sp = sims.start("--sim-fault", "model-name:other-model")
    models = httpx.get(sp.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["other-model"]
    r = _completion(sp, _body())
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `sim-model` does not exist."


def test_tokenizer_fault_changes_ids_and_output(sims: Sims) -> None:
    good = sims.start(role="kv_producer")
    bad = sims.start("--sim-fault", "tokenizer", role="kv_consumer")
    probe = {"model": "sim-model", "prompt": "Hello, KV cache!"}
    a = httpx.post(good.url + "/tokenize", json=probe).json()
    b = httpx.post(bad.url + "/tokenize", json=probe).json()
    assert a["count"] == b["count"] and a["tokens"] != b["tokens"]
    ref = _completion(good, _body()).json()["choices"][0]["token_ids"]
    assert _completion(bad, _body()).json()["choices"][0]["token_ids"] != ref


def test_ignore_sigterm(sims: Sims) -> None:
    sp = sims.start("--sim-fault", "ignore-sigterm")
    os.kill(sp.proc.pid, signal.SIGTERM)
    assert sp.wait_exit(1.5) is None
    assert httpx.get(sp.url + "/health").status_code == 200
    assert "ignoring it" in sp.output()
    os.kill(sp.proc.pid, signal.SIGKILL)
    assert sp.wait_exit(10) == -signal.SIGKILL


def test_sigterm_is_graceful_by_default(sims: Sims) -> None:
    sp = sims.start()
    os.kill(sp.proc.pid, signal.SIGTERM)
    assert sp.wait_exit(15) == 0
    out = sp.output()
    assert "[shutdown] EngineCore: trigger received signal=SIGTERM" in out
    assert "Application shutdown complete." in out


def test_orphan_child_survives_parent_sigkill(sims: Sims) -> None:
    sp = sims.start("--sim-fault", "orphan-child")
    assert _wait_for(lambda: "orphan child started" in sp.output())
    pgid = sp.proc.pid
    os.kill(sp.proc.pid, signal.SIGKILL)
    assert sp.wait_exit(10) == -signal.SIGKILL
    # The parent is reaped; the group lives on through the child.
    assert _group_alive(pgid)
    time.sleep(0.5)
    assert _group_alive(pgid)
    os.killpg(pgid, signal.SIGKILL)
    assert _wait_for(lambda: not _group_alive(pgid), 10)


def test_lease_expiry_releases_blocks(sims: Sims) -> None:
    prefill = sims.start(role="kv_producer", extra_config={"kv_lease_duration": 1})
    decode = sims.start(role="kv_consumer")
    body = _body()
    p = _completion(prefill, build_prefill_body(body)).json()
    assert _wait_for(lambda: "Releasing expired KV blocks for request" in prefill.output(), 10)
    assert p["kv_transfer_params"]["remote_request_id"] in prefill.output()
    assert _metric(prefill, "vllm:nixl_num_kv_expired_reqs_total") == 1
    r = _completion(decode, build_decode_body(body, p["kv_transfer_params"]))
    assert r.status_code == 500


def test_invalid_params_warn_and_compute_locally(sims: Sims) -> None:
    sp = sims.start()
    r = _completion(sp, _body(kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "x"}))
    assert r.status_code == 200
    assert "Got invalid KVTransferParams" in sp.output()
    assert "This request will not utilize KVTransfer" in sp.output()
