"""The KV log classifier over the real vLLM CPU logs in tests/fixtures/vllm-cpu/ (and synthetic lines).

Each fixture's expected list was written by reading the file: (line number, phase, request id) of every KV
event, so an extra match (a startup "KV cache" line, a traceback line) fails as surely as a miss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.vllm.kvlog import (
    KV_PHASES,
    PHASES,
    base_request_id,
    classify,
    parse_prefix,
    parse_transfer_metrics,
    request_matches,
    scan,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-cpu"

SAVE, LOAD, WAIT, METRICS, FAIL, SETUP = (
    "save_kv_layer",
    "start_load_kv",
    "wait_for_layer_load",
    "kv_transfer_metrics",
    "kv_failure",
    "kv_setup",
)
R0_FAILED = "cmpl-r0-0-9dcc8ea1"
R0_RETRY = "cmpl-r0-0-aa6dc939"
ABORTED = "929f807a5e59bc01"

EXPECTED: dict[str, list[tuple[int, str, str | None]]] = {
    "nixl-prefill.info.log": [(63, SETUP, None), (73, SETUP, None)],
    "nixl-decode.info.log": [
        (63, SETUP, None),
        (73, SETUP, None),
        (124, LOAD, None),  # NIXL compatibility check passed
        (125, LOAD, None),  # Transfer plan
        (134, METRICS, None),
    ],
    "example-connector-prefill.log": [
        (58, SETUP, None),
        (61, SETUP, None),
        (63, SETUP, None),
        (66, SETUP, None),
    ],
    "example-connector-decode.log": [
        (58, SETUP, None),
        (61, SETUP, None),
        (63, SETUP, None),
        (66, SETUP, None),
        (115, LOAD, None),  # External Cache Hit!
        (116, WAIT, None),  # Inject KV cache of 640 tokens
        (119, LOAD, None),
        (120, WAIT, None),
        (123, LOAD, None),  # the 8-token prompt: a hit, but less than a block, nothing injected
        (126, LOAD, None),
        (129, LOAD, None),
        (130, WAIT, None),  # 256 tokens
        (133, LOAD, None),
        (134, WAIT, None),
    ],
    "nixl-prefill.debug-handshake-failure.log": [
        (166, SETUP, None),
        (187, SETUP, None),
        (192, SETUP, None),  # side channel listening
        (269, SAVE, "cmpl-r0-0-bc8265be"),  # waiting for 30 seconds before releasing blocks
        (272, SETUP, None),  # handshake message received
        (275, FAIL, "cmpl-r0-0-bc8265be"),  # Releasing expired KV blocks
        (276, SAVE, "cmpl-r0-0-bc8265be"),  # Finished sending KV transfer
        (278, SETUP, None),
        (281, METRICS, None),
        (292, SAVE, "cmpl-r0-0-b7efbbe5"),
        (297, FAIL, "cmpl-r0-0-b7efbbe5"),
        (298, SAVE, "cmpl-r0-0-b7efbbe5"),
        (308, FAIL, "cmpl-r0-0-b7efbbe5"),  # Potentially invalid KV blocks
        (309, FAIL, "cmpl-r0-0-bc8265be"),
        (312, SAVE, "cmpl-r1-0-9ccdb1f2"),
        (315, SAVE, None),  # get_finished: 1 requests done sending
        (317, SAVE, "cmpl-r1-0-9ccdb1f2"),
        (323, METRICS, None),
        (328, SAVE, "cmpl-r2-0-9789763b"),
        (330, SAVE, "cmpl-r2-0-9789763b"),  # Heartbeat extended lease
        (331, SAVE, None),
        (332, SAVE, "cmpl-r2-0-9789763b"),
    ],
    "nixl-decode.debug-handshake-failure.log": [
        (169, SETUP, None),
        (188, SETUP, None),
        (193, SETUP, None),
        (267, LOAD, R0_FAILED),  # start_load_kv for request
        (269, LOAD, None),  # Querying metadata
        (271, WAIT, R0_FAILED),  # WAITING_FOR_REMOTE_KVS
        (274, WAIT, R0_FAILED),
        (275, FAIL, None),  # handshake_setup_failed, 'request_id': None
        (300, FAIL, R0_FAILED),  # handshake_failed
        (332, FAIL, None),  # get_finished ... (1 failed)
        (333, FAIL, R0_FAILED),  # Skipping KV post-processing
        (334, FAIL, R0_FAILED),  # Failing 1 request(s) due to KV load failure
        (336, WAIT, R0_FAILED),  # Finished recving (of the failed one)
        (337, LOAD, None),  # the retried handshake
        (340, LOAD, None),
        (341, LOAD, None),
        (342, LOAD, None),
        (343, LOAD, ABORTED),
        (347, LOAD, None),
        (348, LOAD, None),
        (349, LOAD, None),
        (355, METRICS, None),
        (361, LOAD, R0_RETRY),
        (362, LOAD, R0_RETRY),  # _read_blocks
        (363, LOAD, ABORTED),
        (364, WAIT, None),  # 1 requests done recving
        (366, WAIT, R0_RETRY),
        (444, LOAD, "cmpl-r1-0-bff9332b"),
        (445, LOAD, "cmpl-r1-0-bff9332b"),
        (446, WAIT, None),
        (447, WAIT, "cmpl-r1-0-bff9332b"),
        (529, LOAD, "cmpl-r2-0-9150d319"),
        (530, LOAD, "cmpl-r2-0-9150d319"),
        (531, WAIT, None),
        (534, WAIT, "cmpl-r2-0-9150d319"),
        (612, METRICS, None),
    ],
}


def _lines(name: str) -> list[str]:
    # Split on "\n" only, so line numbers are the ones an editor or grep shows.
    return (FIXTURES / name).read_text(encoding="utf-8").split("\n")


def test_every_fixture_log_has_an_expectation() -> None:
    assert sorted(p.name for p in FIXTURES.glob("*.log")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_events_exactly(name: str) -> None:
    events = scan(_lines(name), source=name)
    assert [(e.lineno, e.phase, e.request_id) for e in events] == EXPECTED[name]
    for e in events:
        assert e.source == name
        assert e.phase in PHASES
        assert e.line == _lines(name)[e.lineno - 1]  # type: ignore[operator]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_events_carry_time_and_process(name: str) -> None:
    for e in scan(_lines(name), source=name):
        assert e.time is not None and e.time.startswith("11-30 ")
        assert e.process in ("APIServer", "EngineCore", "Worker")


def test_scan_without_setup_keeps_only_the_recipe_phases() -> None:
    events = scan(_lines("nixl-prefill.info.log"), source="p", setup=False)
    assert events == []
    events = scan(_lines("nixl-decode.info.log"), source="d", setup=False)
    assert [e.phase for e in events] == [LOAD, LOAD, METRICS]
    assert all(e.phase in KV_PHASES for e in events)


def test_transfer_metrics_numbers() -> None:
    (ev,) = [e for e in scan(_lines("nixl-decode.info.log")) if e.phase == METRICS]
    assert ev.metrics["num_successful_transfers"] == 3
    assert ev.metrics["avg_xfer_time_ms"] == pytest.approx(4.167)
    assert ev.metrics["throughput_mb_s"] == pytest.approx(49.992)
    assert ev.metrics["num_failed_transfers"] == 0
    assert ev.metrics["num_kv_expired_reqs"] == 0
    assert "3 transfer(s) ok" in ev.detail


def test_parse_transfer_metrics_handles_odd_parts() -> None:
    assert parse_transfer_metrics("Num successful transfers=2, bogus, Avg MB per transfer=x") == {
        "num_successful_transfers": 2.0
    }


def test_failure_details_name_the_kind() -> None:
    events = scan(_lines("nixl-decode.debug-handshake-failure.log"))
    fails = [e.detail for e in events if e.phase == FAIL]
    assert "NIXL transfer failure: handshake_setup_failed" in fails
    assert "NIXL transfer failure: handshake_failed" in fails
    assert any("739 tokens affected" in d for d in fails)


def test_transfer_failure_detail_carries_the_error() -> None:
    ev = classify(
        "(Worker pid=1) ERROR 11-30 10:00:00 [w.py:1] NIXL transfer failure: handshake_failed | Context: "
        "{'failure_type': 'handshake_failed', 'request_id': 'cmpl-b-0-0123abcd', 'error': 'NIXL compatibility "
        "hash mismatch: abc'}"
    )
    assert ev is not None and ev.phase == FAIL and ev.request_id == "cmpl-b-0-0123abcd"
    assert ev.detail == "NIXL transfer failure: handshake_failed (NIXL compatibility hash mismatch: abc)"


def test_prefix_parsing() -> None:
    p = parse_prefix(
        "(Worker_TP1 pid=42) WARNING 11-30 13:01:25 [distributed/.../nixl/base_worker.py:3032] Releasing x"
    )
    assert (p.process, p.pid, p.level, p.time, p.location, p.message) == (
        "Worker_TP1",
        42,
        "WARNING",
        "11-30 13:01:25",
        "distributed/.../nixl/base_worker.py:3032",
        "Releasing x",
    )
    plain = parse_prefix('INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK')
    assert plain.process is None and plain.level is None


@pytest.mark.parametrize(
    ("line", "phase", "request_id"),
    [
        # vLLM messages not present in the CPU fixtures (other versions / failure modes)
        (
            "(EngineCore pid=1) WARNING 11-30 10:00:00 [pull_scheduler.py:70] Got invalid KVTransferParams: "
            "{'remote_engine_id': None}. This request will not utilize KVTransfer",
            FAIL,
            None,
        ),
        (
            "(Worker pid=1) ERROR 11-30 10:00:00 [w.py:1] NIXL compatibility hash mismatch: a != b",
            FAIL,
            None,
        ),
        (
            "(Worker pid=1) ERROR 11-30 10:00:00 [w.py:2] NIXL transfer failure: transfer_failed | "
            "Context: {'failure_type': 'transfer_failed', 'request_id': 'cmpl-x-0-0123abcd'}",
            FAIL,
            "cmpl-x-0-0123abcd",
        ),
        (
            "(EngineCore pid=1) WARNING 11-30 10:00:00 [scheduler.py:3426] Recovered from KV load failure: "
            "1 request(s) rescheduled (12 tokens affected).",
            FAIL,
            None,
        ),
        # With the time stamp's milliseconds and ANSI colour left on
        (
            "\x1b[1;36m(Worker pid=7)\x1b[0m INFO 11-30 10:00:00.123 [base_worker.py:1093] "
            "NIXL compatibility check passed (hash: ab)",
            LOAD,
            None,
        ),
        # unknown connectors: keyword fallback
        (
            "(Worker pid=1) INFO 11-30 10:00:00 [lmcache_connector.py:80] Storing KV cache for 256 tokens "
            "for request cmpl-abc-0-12345678",
            SAVE,
            "cmpl-abc-0-12345678",
        ),
        (
            "(Worker pid=1) INFO 11-30 10:00:00 [mc.py:8] Pulling KV for req 0123456789abcdef",
            LOAD,
            "0123456789abcdef",
        ),
        (
            "(Worker pid=1) INFO 11-30 10:00:00 [mc.py:8] KV cache loaded for request cmpl-q-1",
            WAIT,
            "cmpl-q-1",
        ),
        (
            "(Worker pid=1) ERROR 11-30 10:00:00 [mc.py:8] KV transfer timed out after 30 s",
            FAIL,
            None,
        ),
    ],
)
def test_other_kv_lines(line: str, phase: str, request_id: str | None) -> None:
    ev = classify(line)
    assert ev is not None
    assert (ev.phase, ev.request_id) == (phase, request_id)


@pytest.mark.parametrize(
    "line",
    [
        "(Worker pid=1) INFO 11-30 10:00:00 [cw.py:2] Explicitly set (1.0/9.84) GiB for KV cache on node 0.",
        "(EngineCore pid=1) INFO 11-30 10:00:00 [kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens",
        "(Worker pid=1) WARNING 11-30 10:00:00 [ec.py:1] In connector.start_load_kv, but the attn_metadata is None",
        # An INFO line about a KV "error rate" is not a failure: failures only count at WARNING and above.
        "(APIServer pid=1) INFO 11-30 10:00:00 [loggers.py:1] KV transfer error rate: 0.0%",
        '(Worker pid=1) ERROR 11-30 10:00:00 [w.py:3]   File "x.py", line 1047, in _nixl_handshake',
        'INFO:     127.0.0.1:34844 - "POST /v1/completions HTTP/1.1" 200 OK',
        "",
    ],
)
def test_not_kv_events(line: str) -> None:
    assert classify(line) is None


def test_request_ids() -> None:
    assert base_request_id("cmpl-r0-0-9dcc8ea1") == "r0"
    assert base_request_id("chatcmpl-verify-abc-1f2e3d4c") == "verify-abc"
    assert base_request_id("cmpl-req-1-0-abcdef12") == "req-1"
    assert base_request_id("929f807a5e59bc01") == "929f807a5e59bc01"
    assert request_matches("cmpl-r0-0-9dcc8ea1", "r0")
    assert not request_matches("cmpl-r0-0-9dcc8ea1", "r1")
    assert not request_matches(None, "r0")
