"""`pdctl trace`: one request's timeline, from recorded log lines (real vLLM CPU formats and the gateway's access
line) and end to end on a simulator deployment."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from datetime import date
from pathlib import Path

import httpx
import pytest

from pdctl.runtime.logs import LogLine, line_time
from pdctl.runtime.trace import RequestNotFound, build_trace, line_matches, parse_access, trace_request
from tests.cli.test_run_cmds import KEY, deploy_dir, pdctl, state, write_deployment

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu"
DAY = date(2025, 11, 30)
__all__ = ["deploy_dir"]  # the fixture, imported for the end-to-end test


def lines(name: str, texts: list[str]) -> list[LogLine]:
    out, last = [], 0.0
    for t in texts:
        ts = line_time(t, DAY)
        last = ts if ts is not None else last
        out.append(LogLine(name, t, last))
    return out


def fixture(name: str, upto: int | None = None) -> list[str]:
    return (FIXTURES / name).read_text(encoding="utf-8").splitlines()[:upto]


def merged(*groups: list[LogLine]) -> list[LogLine]:
    return sorted((ln for g in groups for ln in g), key=lambda ln: ln.ts)


def stages(rows: list) -> list[str]:  # type: ignore[type-arg]
    out: list[str] = []
    for r in rows:
        if not out or out[-1] != r.stage:
            out.append(r.stage)
    return out


def test_parse_access_with_and_without_pid() -> None:
    a = parse_access("13:02:04 INFO pdctl.gateway.access[812] request_id=r1 model=tiny path=disagg status=200")
    assert a == {"request_id": "r1", "model": "tiny", "path": "disagg", "status": "200"}
    assert parse_access("13:02:04 WARNING pdctl.gateway request r1: leg 1 failed") is None


def test_ids_match_vllm_and_retries_not_prefixes() -> None:
    assert line_matches("start_load_kv for request cmpl-r1-0-bff9332b from remote", "r1")
    assert line_matches("Finished recving KV transfer for request chatcmpl-r1-retry1-0123abcd", "r1")
    assert not line_matches("start_load_kv for request cmpl-r10-0-bff9332b from remote", "r1")
    assert not line_matches("request_finished(cmpl-ref1-0-afd2dfb4)", "r1")


def test_disaggregated_request_from_real_nixl_lines() -> None:
    gw = lines("gateway", [
        "13:02:04 INFO pdctl.gateway.access request_id=r1 model=tiny path=disagg prefill=prefill decode=decode "
        "status=200 ttft_ms=612.0 prefill_ms=180.5 prompt_tokens=8 tokens=16 duration_ms=2400.0 "
        "kv_engine=96a606ed-94d1-4c6c-8cdd-3042d7580da3 kv_blocks=1 kv_remote=127.0.0.1:5600",
    ])  # fmt: skip
    # the gateway's line is written at the end: move it after decode's last line for this request
    gw = [LogLine("gateway", gw[0].text, gw[0].ts + 2.4)]
    logs = merged(gw, lines("prefill", fixture("nixl-prefill.debug-handshake-failure.log")),
                  lines("decode", fixture("nixl-decode.debug-handshake-failure.log")))  # fmt: skip
    t = build_trace("r1", logs, slo_ttft_ms=400, slo_tpot_ms=40)
    assert stages(t.rows) == ["arrival", "decision", "prefill", "kv", "decode", "stall", "end"]
    ev = [(r.stage, r.event) for r in t.rows]
    assert ("prefill", "KV saved") in ev and ("kv", "KV load started") in ev and ("kv", "KV loaded") in ev
    assert (
        ev.index(("prefill", "prefill start"))
        < ev.index(("prefill", "KV saved"))
        < ev.index(("prefill", "prefill end"))
    )
    assert ("stall", "TTFT over SLO") in ev and ("stall", "TPOT over SLO") in ev
    handoff = next(r for r in t.rows if r.event == "KV handoff")
    assert "blocks=1 remote=127.0.0.1:5600" in handoff.detail and handoff.at_ms == 180.5 and handoff.exact
    first = next(r for r in t.rows if r.event == "first token")
    assert first.at_ms == 612.0 and first.exact
    end = t.rows[-1]
    assert end.stage == "end" and end.at_ms == 2400.0 and "status=200" in end.detail
    assert set(t.worker_ids) >= {"cmpl-r1-0-9ccdb1f2", "cmpl-r1-0-bff9332b"}
    assert not any("ref1" in (r.line or "") or "cmpl-r10" in (r.line or "") for r in t.rows)
    doc = t.to_json()
    assert doc["path"] == "disagg" and doc["ttft_ms"] == 612.0 and doc["prompt_tokens"] == 8.0
    assert doc["rows"][0]["stage"] == "arrival" and doc["rows"][0]["at_ms"] == 0.0


def test_local_adaptive_request() -> None:
    gw = lines("gateway", [
        "14:00:01 INFO pdctl.gateway.access request_id=loc-7 model=tiny path=local prefill=- decode=decode "
        "status=200 ttft_ms=35.2 prefill_ms=- prompt_tokens=300 tokens=4 duration_ms=80.0 "
        "decision=cached cached_tokens=256 uncached_tokens=44",
    ])  # fmt: skip
    t = build_trace("loc-7", gw, slo_ttft_ms=400, slo_tpot_ms=40)
    ev = [(r.stage, r.event) for r in t.rows]
    assert ev == [("arrival", "arrival"), ("decision", "decision"), ("prefill", "no prefill leg"),
                  ("decode", "first token"), ("stall", "stalls between tokens"), ("end", "end")]  # fmt: skip
    assert "x-pd-path: local; decision=cached cached_tokens=256 uncached_tokens=44" in t.rows[1].detail
    assert "not recorded" in t.rows[4].detail


def test_autopilot_request_shows_each_path_predicted() -> None:
    gw = lines("gateway", [
        "14:00:01 INFO pdctl.gateway.access request_id=auto-3 model=tiny path=colocated prefill=- decode=prefill "
        "status=200 ttft_ms=35.2 prefill_ms=- prompt_tokens=300 tokens=4 duration_ms=80.0 "
        "decision=auto cached_tokens=0 uncached_tokens=300 auto=whole auto_local=decode:40.1/31.0/30.2 "
        "auto_whole=prefill:38.0/12.0/- auto_disagg=prefill:41.5/31.0/30.0",
    ])  # fmt: skip
    t = build_trace("auto-3", gw, slo_ttft_ms=400, slo_tpot_ms=25)
    detail = t.rows[1].detail
    assert "x-pd-path: colocated; decision=auto" in detail
    assert "auto chose whole (predicted ttft/tpot/others' tpot ms: local decode:40.1/31.0/30.2; whole " in detail
    assert "disagg prefill:41.5/31.0/30.0)" in detail
    assert t.rows[2].event == "no prefill leg"


def test_failed_request_shows_the_kv_failure() -> None:
    gw = lines("gateway", [
        "13:01:25 WARNING pdctl.gateway request r0: decode failed before any output (KV load failure); ...",
        "13:01:25 INFO pdctl.gateway.access request_id=r0 model=tiny path=disagg prefill=prefill decode=decode "
        "status=500 ttft_ms=- prefill_ms=95.0 prompt_tokens=739 tokens=- duration_ms=30100.0 error=internal_error",
    ])  # fmt: skip
    logs = merged(gw, lines("prefill", fixture("nixl-prefill.debug-handshake-failure.log", 280)),
                  lines("decode", fixture("nixl-decode.debug-handshake-failure.log", 340)))  # fmt: skip
    t = build_trace("r0", logs)
    ev = [(r.stage, r.event) for r in t.rows]
    assert ("kv", "KV failure") in ev and ("decision", "gateway") in ev
    fail = [r for r in t.rows if r.event == "KV failure"]
    assert any("handshake_failed" in r.detail for r in fail) and any("request(s) failed" in r.detail for r in fail)
    assert "status=500" in t.rows[-1].detail and "error=internal_error" in t.rows[-1].detail
    first = next(r for r in t.rows if r.event == "first token")
    assert first.at_ms is None and "not recorded" in first.detail


def test_unknown_request_names_the_logs(tmp_path: Path) -> None:
    (tmp_path / "gateway.log").write_text("13:00:00 INFO pdctl.gateway.access request_id=other path=local\n")
    with pytest.raises(RequestNotFound) as e:
        trace_request({"gateway": tmp_path / "gateway.log"}, "nope")
    assert f"request nope not found in {tmp_path / 'gateway.log'}" in str(e.value)


def test_trace_on_a_simulator_deployment(deploy_dir: Path) -> None:
    d = deploy_dir
    ports = write_deployment(d)
    # The simulator follows VLLM_LOGGING_LEVEL only (not vLLM's logging config file): DEBUG for its per-request KV lines
    settings = json.loads((d / "settings.json").read_text())
    settings["logging"] = {"level": "debug"}
    (d / "settings.json").write_text(json.dumps(settings))
    try:
        r = pdctl(d, "up", "-d")
        assert r.returncode == 0, r.stdout + r.stderr
        resp = httpx.post(
            f"http://127.0.0.1:{ports['gateway']}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "trace-e2e-1"},
            json={
                "model": "sim-model",
                "messages": [{"role": "user", "content": "hi " * 40}],
                "max_tokens": 4,
                "stream": True,
            },
            timeout=60,
        )
        assert resp.status_code == 200 and resp.headers["x-pd-path"] == "disagg"
        deadline = time.monotonic() + 15
        while True:  # the access line is written when the stream ends; the log reader copies it shortly after
            r = pdctl(d, "trace", "trace-e2e-1", "--json")
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert doc["path"] == "disagg" and doc["status"] == "200" and doc["prefill"] == "prefill"
        assert doc["ttft_ms"] is not None and doc["duration_ms"] >= doc["ttft_ms"]
        order = [(row["stage"], row["event"]) for row in doc["rows"]]
        wanted = [("arrival", "arrival"), ("prefill", "prefill start"), ("prefill", "prefill end"),
                  ("kv", "KV handoff"), ("kv", "KV loaded"), ("decode", "first token"), ("end", "end")]  # fmt: skip
        assert [o for o in order if o in wanted] == wanted, order
        assert any(w.startswith("chatcmpl-trace-e2e-1") for w in doc["worker_request_ids"])
        r = pdctl(d, "trace", "trace-e2e-1")
        assert r.returncode == 0 and "first token" in r.stdout and "x-pd-path: disagg" in r.stdout, r.stdout
        r = pdctl(d, "trace", "no-such-request")
        assert r.returncode == 1 and "request no-such-request not found in" in r.stdout + r.stderr
        assert "gateway.log" in r.stdout + r.stderr
    finally:
        pdctl(d, "down")
        with contextlib.suppress(OSError, ValueError, KeyError):
            for p in state(d)["processes"]:
                with contextlib.suppress(OSError):
                    os.killpg(p["pid"], signal.SIGKILL)


def test_an_agent_sessions_cache_break_is_traced() -> None:
    """The access log's session fields (pdctl.gateway.agent_sessions) in the decision row and the JSON."""
    gw = lines("gateway", [
        "14:00:01 INFO pdctl.gateway.access request_id=cc-2 model=tiny path=disagg prefill=prefill decode=decode "
        "status=200 ttft_ms=35.2 prefill_ms=20.0 prompt_tokens=1500 tokens=4 duration_ms=80.0 "
        "decision=uncached_tokens cached_tokens=200 uncached_tokens=1300 session=cc-1 agent=sub-1 "
        "cache_break=system reused_tokens=190",
    ])  # fmt: skip
    t = build_trace("cc-2", gw, slo_ttft_ms=400, slo_tpot_ms=40)
    assert "session=cc-1 agent=sub-1; cache break at system, reused_tokens=190" in t.rows[1].detail
    doc = t.to_json()
    assert (doc["session"], doc["cache_break"], doc["reused_tokens"]) == ("cc-1", "system", 190)
