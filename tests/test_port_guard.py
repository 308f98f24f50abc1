"""The guards in tests/conftest.py: the examples' ports held for the whole test run, example copies on free ports, and a
SIGTERM that still lets each test clean up.

A test that needs 8000 or 5600 to be free passes on a quiet machine and fails beside the demo (issue 15);
these tests prove the guard makes it fail everywhere, and that the real tests' copies keep the shipped files.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdctl.config import load
from pdctl.testing import alive, free_port, port_free
from tests.conftest import REPO, PortHolder, listened_ports, move_to_free_ports, well_known_ports


def test_every_examples_port_is_taken_during_the_session(_hold_well_known_ports: PortHolder) -> None:
    ports = well_known_ports()
    assert {8000, 8100, 8200, 5600, 5700} <= set(ports)  # examples/cpu, the demo's
    assert set(_hold_well_known_ports.held) <= set(ports)
    # Held by this run or by someone else (a running demo, another pytest run): either way a test cannot
    # bind it. One that someone else let go of is this run's within PortHolder.RETRY_S.
    deadline = time.monotonic() + 10 * PortHolder.RETRY_S
    while (free := [p for p in ports if port_free(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free == []


def test_the_holder_counts_connections_per_port_and_frees_the_port() -> None:
    port = free_port()
    holder = PortHolder([port])
    try:
        assert holder.held == [port] and not port_free(port)
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                assert c.recv(1) == b""  # closed at once: a client fails fast instead of hanging
        assert holder.connections == {port: 2}
        other = PortHolder([port])
        try:
            assert other.held == []  # taken: left alone...
            holder.close()
            deadline = time.monotonic() + 10 * PortHolder.RETRY_S
            while not other.held and time.monotonic() < deadline:
                time.sleep(0.05)
            assert other.held == [port]  # ...until it is let go (a demo stopped, another pytest run ended)
        finally:
            other.close()
    finally:
        holder.close()
    assert port_free(port)


@pytest.mark.parametrize("example", ["cpu", "cpu-shared-storage", "cpu-ab"])
def test_an_example_copy_moves_only_its_port_numbers(tmp_path: Path, example: str) -> None:
    d = tmp_path / example
    shutil.copytree(REPO / "examples" / example, d, ignore=shutil.ignore_patterns(".pdctl"))  # a demo run dir
    dep = move_to_free_ports(d)
    assert dep.gateway.url == f"http://127.0.0.1:{dep.gateway.listen_port}"
    assert not set(listened_ports(dep)) & set(well_known_ports())
    for name in sorted(p.name for p in d.iterdir()):
        shipped, moved = (f.read_text(encoding="utf-8") for f in (REPO / "examples" / example / name, d / name))
        assert _ports_blanked(moved) == _ports_blanked(shipped), name
        assert moved != shipped or not name.startswith("settings"), name
    for settings in d.glob("settings*.json"):
        assert not set(listened_ports(load(d / "config.toml", settings))) & set(well_known_ports())


def _ports_blanked(text: str) -> str:
    return re.sub(r'(side_channel_port = |:)\d+(\n|")', r"\1PORT\2", text)


def test_an_example_with_implicit_side_channels_is_refused(tmp_path: Path) -> None:
    shutil.copytree(REPO / "examples" / "gpu-2p2d", tmp_path / "x", ignore=shutil.ignore_patterns(".pdctl"))
    with pytest.raises(AssertionError, match=r"ports \[5600, 5700, 5800, 5900\] were not moved"):
        move_to_free_ports(tmp_path / "x")


def test_sigterm_ends_the_session_after_the_running_test_cleaned_up(tmp_path: Path) -> None:
    """CI cancels with SIGTERM: the running test's finally still stops the process group it started."""
    pid_file = tmp_path / "child.pid"
    (tmp_path / "test_inner.py").write_text(
        "import os, signal, subprocess, sys, time\n"
        "def test_holds_a_child():\n"
        "    child = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "    try:\n"
        f"        open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "        time.sleep(120)\n"
        "    finally:\n"
        "        os.killpg(child.pid, signal.SIGKILL)\n"
        "        child.wait()\n"
        "def test_never_runs():\n"
        "    pass\n"
    )
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert inner.poll() is None and time.monotonic() < deadline, inner.communicate()[0]
            time.sleep(0.1)
        child = int(pid_file.read_text())
        inner.send_signal(signal.SIGTERM)
        out = inner.communicate(timeout=60)[0]
    finally:
        if inner.poll() is None:
            inner.kill()
    assert inner.returncode == 2, out  # pytest's "interrupted"
    assert "KeyboardInterrupt" in out and "1 passed" not in out, out
    assert not alive(child), out
