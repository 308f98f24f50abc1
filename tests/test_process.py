"""ManagedProcess on the fake worker: start, readiness, crash reports, SIGTERM -> SIGKILL, descendant sweep."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pdctl.errors import LaunchError
from pdctl.logs import LogLine
from pdctl.process import ManagedProcess, ProcessExitedError, child_env
from pdctl.testing import alive, free_port, kill_groups
from tests.fakes.helpers import fake_spec


@pytest.fixture
def started():
    procs: list[ManagedProcess] = []
    yield procs
    kill_groups([p.pid for p in procs if p.pid])


def test_start_ready_stop_and_log_file(tmp_path: Path, started: list[ManagedProcess]) -> None:
    lines: list[LogLine] = []
    spec = fake_spec("prefill", "prefill", "--print-lines", "3", "--startup-delay", "0.3")
    p = ManagedProcess(spec, tmp_path / "logs", lines.append)
    p.start()
    started.append(p)
    assert os.getpgid(p.pid) == p.pid  # its own group
    p.wait_ready(60)
    assert p.alive
    killed = p.stop(10)
    assert killed == []  # exited on SIGTERM within the grace period
    assert not alive(p.pid)
    text = (tmp_path / "logs" / "prefill.log").read_text()
    assert "line 2 [bold]not markup[/bold]" in text
    assert any(ln.text == "line 0 [bold]not markup[/bold]" and ln.name == "prefill" for ln in lines)


def test_environment_is_explicit_and_secret_free(tmp_path: Path, started: list[ManagedProcess]) -> None:
    base = {"PATH": os.environ["PATH"], "MY_API_KEY": "sk-secret-123", "KEEP": "1"}
    spec = fake_spec("decode", "decode", env={"CUDA_VISIBLE_DEVICES": "1"}, unset_env=("MY_API_KEY",))
    assert child_env(spec, base) == {"PATH": os.environ["PATH"], "KEEP": "1", "CUDA_VISIBLE_DEVICES": "1"}
    p = ManagedProcess(spec, tmp_path, env_base=base)
    p.start()
    started.append(p)
    p.wait_ready(60)
    environ = Path(f"/proc/{p.pid}/environ").read_bytes()
    assert b"sk-secret-123" not in environ and b"MY_API_KEY" not in environ
    assert b"CUDA_VISIBLE_DEVICES=1" in environ
    assert os.readlink(f"/proc/{p.pid}/fd/0") == "/dev/null"
    p.stop(10)


def test_crash_at_start_reports_code_tail_and_diagnosis(tmp_path: Path, started: list[ManagedProcess]) -> None:
    spec = fake_spec(
        "prefill",
        "prefill",
        "--print-lines",
        "50",
        "--exit-after",
        "0.2",
        "--exit-code",
        "3",
        "--fail-line",
        "OSError: [Errno 98] error while attempting to bind on address: address already in use",
    )
    p = ManagedProcess(spec, tmp_path)
    p.start()
    started.append(p)
    with pytest.raises(ProcessExitedError) as err:
        p.wait_ready(60)
    info = err.value.info
    assert info.returncode == 3
    assert len(info.tail) == 40
    assert info.tail[-1].startswith("OSError: [Errno 98]")
    assert info.diagnosis is not None and info.diagnosis.code == "port_in_use"
    assert "exit code 3" in str(err.value) and "last 40 lines" in str(err.value)
    assert err.value.hint is not None and "port" in err.value.hint


def test_not_ready_before_deadline(tmp_path: Path, started: list[ManagedProcess]) -> None:
    p = ManagedProcess(fake_spec("slow", "prefill", "--startup-delay", "30"), tmp_path)
    p.start()
    started.append(p)
    with pytest.raises(LaunchError, match="did not answer 200"):
        p.wait_ready(0.5)
    p.stop(5)
    assert not alive(p.pid)


def test_missing_program_is_a_launch_error(tmp_path: Path) -> None:
    spec = fake_spec("x", "prefill")
    from dataclasses import replace

    p = ManagedProcess(replace(spec, argv=("/nonexistent/vllm", "serve")), tmp_path)
    with pytest.raises(LaunchError, match="cannot run"):
        p.start()


def test_ignore_sigterm_gets_sigkill_after_grace(tmp_path: Path, started: list[ManagedProcess]) -> None:
    p = ManagedProcess(fake_spec("stubborn", "decode", "--ignore-sigterm"), tmp_path)
    p.start()
    started.append(p)
    p.wait_ready(60)
    killed = p.stop(1.0)
    assert p.pid in killed
    assert p.poll() == -9
    assert not alive(p.pid)


@pytest.mark.parametrize("new_session", [False, True])
def test_grandchild_is_swept(tmp_path: Path, started: list[ManagedProcess], new_session: bool) -> None:
    args = ["--spawn-grandchild"] + (["--grandchild-new-session"] if new_session else [])
    p = ManagedProcess(fake_spec("engine", "prefill", *args), tmp_path)
    p.start()
    started.append(p)
    p.wait_ready(60)
    p.refresh_descendants()
    kids = [d.pid for d in p.descendants() if d.pid != p.pid]
    assert len(kids) == 1
    started.extend([])
    try:
        p.stop(2.0)
        deadline = time.monotonic() + 10
        while alive(kids[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(kids[0])
    finally:
        kill_groups(kids)


def test_port_is_free_after_stop(tmp_path: Path, started: list[ManagedProcess]) -> None:
    from pdctl.testing import port_free

    port = free_port()
    p = ManagedProcess(fake_spec("w", "prefill", "--spawn-grandchild", port=port), tmp_path)
    p.start()
    started.append(p)
    p.wait_ready(60)
    assert not port_free(port)
    p.stop(5)
    assert port_free(port)


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (
            "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8100): address already in use",
            "port_in_use",
        ),
        (
            "ValueError: Available memory on node 0 (7.27/8.59 GiB) on startup is less than desired CPU memory "
            "utilization (0.92, 7.90 GiB).",
            "cpu_memory_utilization",
        ),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", "cuda_oom"),
        (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: "
            "Cannot allocate memory",
            "cpu_oom",
        ),
        ("ValueError: Unsupported connector type P2pNcclConnector", "unknown_connector"),
        ("RuntimeError: NIXL is not available", "nixl_missing"),
        ("ModuleNotFoundError: No module named 'nixl'", "nixl_missing"),
        ("RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2", "cpu_attention"),
        (
            "OSError: models/nope is not a local folder and is not a valid model identifier listed on "
            "'https://huggingface.co/models'",
            "model_not_found",
        ),
    ],
)
def test_diagnoses(line: str, code: str) -> None:
    from pdctl.diagnose import diagnose

    found = diagnose(["INFO starting", "Traceback (most recent call last):", line])
    assert found is not None and found.code == code and found.line == line and found.hint


def test_no_diagnosis_for_unknown_crash() -> None:
    from pdctl.diagnose import diagnose

    assert diagnose(["INFO starting", "RuntimeError: something else entirely"]) is None
