"""ManagedProcess on the fake worker: start, readiness, crash reports, SIGTERM -> SIGKILL, descendant sweep."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pdctl.errors import LaunchError
from pdctl.runtime.logs import LogLine
from pdctl.runtime.plan import ProcessSpec
from pdctl.runtime.process import ManagedProcess, NeverReadyError, ProcessExitedError, child_env
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
    from pdctl.vllm.diagnose import diagnose

    found = diagnose(["INFO starting", "Traceback (most recent call last):", line])
    assert found is not None and found.code == code and found.line == line and found.hint


def test_no_diagnosis_for_unknown_crash() -> None:
    from pdctl.vllm.diagnose import diagnose

    assert diagnose(["INFO starting", "RuntimeError: something else entirely"]) is None


ZMQ_LINE = "(EngineCore_DP0 pid=4242) zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5700')"


@pytest.mark.parametrize(
    ("line", "port"),
    [
        (ZMQ_LINE, 5700),  # vLLM's NIXL listener thread on a taken side-channel port, with a process prefix
        ("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:20581')", 20581),  # as vLLM CPU 0.32
        ("(APIServer pid=7) OSError: [Errno 98] Address already in use", None),  # vLLM's HTTP socket
        ("OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8100): address already in use",
         8100),
    ],
)  # fmt: skip
def test_a_dead_end_line_names_the_port_it_can(line: str, port: int | None) -> None:
    from pdctl.vllm.diagnose import dead_end

    found = dead_end(line)
    assert found is not None and found.code == "port_in_use" and found.port == port and found.line == line
    assert (f"port {port} is already in use" if port else "its port is already in use") == found.message


@pytest.mark.parametrize(
    "line",
    [
        "(EngineCore_DP0 pid=1) INFO 12-01 10:00:00 [base_scheduler.py:350] Starting listening on path: tcp://x:5700",
        "(APIServer pid=1) WARNING Port 8100 is already in use, trying port 8101",  # a retry, not an end
        "ValueError: Unsupported connector type P2pNcclConnector",  # a crash: the exit reports it
    ],
)
def test_other_lines_are_no_dead_end(line: str) -> None:
    from pdctl.vllm.diagnose import dead_end

    assert dead_end(line) is None


def test_a_running_process_that_printed_a_dead_end_fails_its_wait_at_once(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    p = ManagedProcess(fake_spec("decode", "decode", "--hang-line", ZMQ_LINE), tmp_path)
    p.start()
    started.append(p)
    t0 = time.monotonic()
    with pytest.raises(NeverReadyError) as err:
        p.wait_ready(600)
    assert time.monotonic() - t0 < 120  # the line ends the wait, not the 600 s deadline
    info = err.value.info
    assert info.returncode is None and p.alive  # vLLM's engine would wait on: the supervisor stops it
    assert info.diagnosis is not None and info.diagnosis.port == 5700 and info.tail[-1] == ZMQ_LINE
    assert str(err.value).startswith("decode still runs but can never become ready\ndiagnosis: port 5700 is")
    assert info.log_file == str(tmp_path / "decode.log")
    p.stop(5)
    assert not alive(p.pid)


# A child that does what vLLM CPU's NIXL worker does: one thread widens its own affinity to every CPU, and a
# grandchild (EngineCore's place) is started after; both report their masks, then wait.
_WIDENS = """
import os, subprocess, sys, threading, time
print("spawned", sorted(os.sched_getaffinity(0)), flush=True)
def widen():
    os.sched_setaffinity(0, range(os.cpu_count()))
    print("widened", sorted(os.sched_getaffinity(0)), flush=True)
    time.sleep(60)
threading.Thread(target=widen, daemon=True).start()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
time.sleep(60)
"""


def _tree_masks(pid: int) -> dict[int, set[int]]:
    root = psutil.Process(pid)
    out: dict[int, set[int]] = {}
    for p in [root, *root.children(recursive=True)]:
        for t in p.threads():
            out[t.id] = os.sched_getaffinity(t.id)
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell cores apart")
def test_cpu_ids_bind_the_tree_at_spawn_and_pin_moves_threads_back(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    core = min(os.sched_getaffinity(0))
    spec = ProcessSpec("decode", "decode", (sys.executable, "-c", _WIDENS), {"PYTHONUNBUFFERED": "1"},
                       "http://127.0.0.1:9", "http://127.0.0.1:9/health", 0, cpu_ids=(core,))  # fmt: skip
    before = os.sched_getaffinity(0)
    p = ManagedProcess(spec, tmp_path / "logs")
    p.start()
    started.append(p)
    assert os.sched_getaffinity(0) == before  # the spawning thread got its own mask back
    log = tmp_path / "logs" / "decode.log"
    deadline = time.monotonic() + 30
    while "widened" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    text = log.read_text()
    assert f"spawned [{core}]" in text  # bound from its first instruction
    assert any(m != {core} for m in _tree_masks(p.pid).values())  # the child moved a thread off its core
    moved = p.pin_threads()
    assert moved and all(len(cpus) > 1 for _, _, cpus in moved)
    masks = _tree_masks(p.pid)
    assert len(masks) >= 3 and all(m == {core} for m in masks.values())  # main, widened thread, grandchild
    assert p.pin_threads() == []  # nothing left to move
    p.stop(5)


def test_cpu_ids_outside_the_machine_are_a_launch_error(tmp_path: Path) -> None:
    spec = ProcessSpec("decode", "decode", (sys.executable, "-c", "pass"), {}, "http://127.0.0.1:9",
                       "http://127.0.0.1:9/health", 0, cpu_ids=(4095,))  # fmt: skip
    with pytest.raises(LaunchError, match=r"cannot bind to cpu_ids \[4095\]") as err:
        ManagedProcess(spec, tmp_path / "logs").start()
    assert err.value.hint and "cpu_ids" in err.value.hint


def test_files_are_written_before_start(tmp_path: Path, started: list[ManagedProcess]) -> None:
    cfg = tmp_path / "run" / "vllm-logging.json"
    spec = ProcessSpec("decode", "decode", (sys.executable, "-c", f"print(open({str(cfg)!r}).read())"),
                       {"PYTHONUNBUFFERED": "1"}, "http://127.0.0.1:9", "http://127.0.0.1:9/health", 0,
                       files={str(cfg): '{"version": 1}\n'})  # fmt: skip
    p = ManagedProcess(spec, tmp_path / "logs")
    p.start()
    started.append(p)
    p.wait_exit(30)
    assert p.exit_info().returncode == 0 and '{"version": 1}' in p.exit_info().tail


_BIND_A_SOCKET = """
import os, socket, sys, time
folder = os.environ["VLLM_RPC_BASE_PATH"]
print(sorted(os.listdir(folder)), flush=True)
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(folder, "0b5c2f64-6a41-4b3e-9d3c-1d6e0c7a9f10"))  # as zmq binds ipc://<folder>/<uuid4>
print("bound", flush=True)
time.sleep(60)
"""


def test_the_ipc_folder_is_fresh_at_start_and_gone_after_stop(tmp_path: Path, started: list[ManagedProcess]) -> None:
    short = Path(tempfile.mkdtemp(prefix="r"))  # pytest's tmp_path can be too long for a socket's path
    ipc = short / "ipc" / "decode"
    ipc.mkdir(parents=True)
    (ipc / "left-by-a-killed-run").touch()
    lines: list[LogLine] = []
    spec = ProcessSpec("decode", "decode", (sys.executable, "-c", _BIND_A_SOCKET),
                       {"PYTHONUNBUFFERED": "1", "VLLM_RPC_BASE_PATH": str(ipc)}, "http://127.0.0.1:9",
                       "http://127.0.0.1:9/health", 0, ipc_dir=str(ipc))  # fmt: skip
    p = ManagedProcess(spec, tmp_path / "logs", lines.append)
    p.start()
    started.append(p)
    deadline = time.monotonic() + 30
    while not any(ln.text == "bound" for ln in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [ln.text for ln in lines][:2] == ["[]", "bound"]  # emptied before the start
    assert (ipc / "0b5c2f64-6a41-4b3e-9d3c-1d6e0c7a9f10").is_socket()
    assert ipc.stat().st_mode & 0o777 == 0o700
    p.stop(10)
    assert not ipc.exists()  # the socket the process left goes with its folder
    shutil.rmtree(short)
