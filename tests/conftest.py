"""Fixtures shared by the tests, and the guard that keeps them off the machine's well-known ports.

* :func:`_hold_well_known_ports` (session-scoped, autouse): every port a shipped example listens on (its gateway, its
  workers, their NIXL side channels) is held for the whole test run, as a running demo holds them. A test that
  binds one fails to bind; a test that connects to one fails at teardown, naming the port. So a test that
  hard-codes 8000 or 5600 fails on every machine, not only beside the demo. A port already taken (the demo is
  up, or another pytest run on the machine holds it) is taken as soon as it is let go.
* :func:`pytest_configure`: SIGTERM ends the test run as Ctrl-C does, so each test's cleanup still stops what it
  started.
* :func:`recipe_files`, :func:`cli`, :func:`sim_procs`: the recipe's files in tmp_path, the CLI in-process,
  simulator workers stopped at teardown.
"""

from __future__ import annotations

import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from typer.testing import CliRunner

from pdctl.config import Deployment, load
from pdctl.testing import SimProcess, free_port
from pdctl.vllm.protocol import NIXL_CONNECTORS

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "tests" / "fixtures" / "recipe"
T = TypeVar("T")


def pytest_configure(config: pytest.Config) -> None:
    # CI cancels a job, and a supervisor stops one, with SIGTERM, which ends Python at once: the deployments the
    # running test started (in their own process groups) would outlive pytest. As KeyboardInterrupt, pytest runs
    # the test's finally blocks and teardowns, then stops the run.
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def well_known_ports() -> list[int]:
    """Every port the shipped examples listen on: gateway, workers and NIXL side channels (sorted)."""
    ports: set[int] = set()
    for example in sorted((REPO / "examples").iterdir()):
        for settings in sorted(example.glob("settings*.json")):
            ports.update(listened_ports(load(example / "config.toml", settings)))
    return sorted(ports)


def move_to_free_ports(example: Path) -> Deployment:
    """Move an example copied to ``example`` onto free ports; every other byte of its files stays as shipped.

    Each port of :func:`listened_ports` gets a :func:`free_port`, in config.toml's ``side_channel_port`` lines
    and in each settings*.json's ``host:port``; an example whose side channels are implicit (gpu-2p2d) is
    refused. Returns the deployment of ``settings.json`` as loaded.
    """
    config = example / "config.toml"
    old = {p for settings in example.glob("settings*.json") for p in listened_ports(load(config, settings))}
    new = {port: free_port() for port in sorted(old)}
    ctext = config.read_text(encoding="utf-8")
    for a, b in new.items():
        ctext = ctext.replace(f"side_channel_port = {a}\n", f"side_channel_port = {b}\n")
    config.write_text(ctext, encoding="utf-8")
    for settings in example.glob("settings*.json"):
        stext = settings.read_text(encoding="utf-8")
        for a, b in new.items():
            stext = stext.replace(f':{a}"', f':{b}"')
        settings.write_text(stext, encoding="utf-8")
        left = set(listened_ports(load(config, settings))) & old
        assert not left, f"{settings}: ports {sorted(left)} were not moved (a spelling move_to_free_ports misses?)"
    return load(config, example / "settings.json")


def listened_ports(dep: Deployment) -> list[int]:
    """The ports a deployment's processes listen on: gateway, workers, and side channels of NIXL workers."""
    nixl = [w.side_channel_port for w in dep.workers if dep.connector_for(w) in NIXL_CONNECTORS]
    return [dep.gateway.listen_port, *(w.port for w in dep.workers), *nixl]


class PortHolder:
    """Listens on 127.0.0.1 at each of ``ports`` that is free, and takes one that is busy as soon as it is free
    (a demo stopped, another pytest run ended); closes every connection at once and counts it per port."""

    RETRY_S = 0.5

    def __init__(self, ports: list[int]) -> None:
        self.wanted = list(ports)
        self.socks: dict[socket.socket, int] = {}
        self._lock = threading.Lock()
        self._take()
        self.connections: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="well-known-ports", daemon=True)
        self._thread.start()

    @property
    def held(self) -> list[int]:
        with self._lock:
            return sorted(self.socks.values())

    def _take(self) -> None:
        with self._lock:
            held = set(self.socks.values())
        for port in self.wanted:
            if port in held:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # Our own closed connections leave TIME_WAIT behind: the next pytest run must still bind the port.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            with self._lock:
                self.socks[s] = port

    def _serve(self) -> None:
        retry_at = time.monotonic() + self.RETRY_S
        while not self._stop.is_set():
            with self._lock:
                socks = list(self.socks)
            if socks:
                ready, _, _ = select.select(socks, [], [], 0.2)
            else:
                ready = []
                self._stop.wait(0.2)
            for s in ready:
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                conn.close()
                port = self.socks[s]
                self.connections[port] = self.connections.get(port, 0) + 1
            if len(socks) < len(self.wanted) and time.monotonic() >= retry_at:
                self._take()
                retry_at = time.monotonic() + self.RETRY_S

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            for s in self.socks:
                s.close()
            self.socks.clear()


@pytest.fixture(scope="session", autouse=True)
def _hold_well_known_ports() -> Iterator[PortHolder]:
    holder = PortHolder(well_known_ports())
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture(autouse=True)
def _no_well_known_port(_hold_well_known_ports: PortHolder) -> Iterator[None]:
    """Fails a test that connected to a well-known port: beside the demo it would have talked to the demo."""
    before = dict(_hold_well_known_ports.connections)
    yield
    after = _hold_well_known_ports.connections
    touched = sorted(p for p, n in after.items() if n > before.get(p, 0))
    if touched:
        pytest.fail(
            f"this test connected to the well-known port(s) {touched} (a running demo's): give its servers ports "
            "from pdctl.testing.free_port(), as tests/conftest.py:move_to_free_ports does for an example"
        )


@pytest.fixture
def recipe_files(tmp_path: Path) -> Callable[..., tuple[Path, Path]]:
    """Copy the recipe's two files into tmp_path, with optional text replacements, and return their paths."""

    def make(
        config_edits: dict[str, str] | None = None,
        settings_edits: dict[str, str] | None = None,
        config_append: str = "",
    ) -> tuple[Path, Path]:
        ctext = (RECIPE / "config.toml").read_text(encoding="utf-8")
        stext = (RECIPE / "settings.json").read_text(encoding="utf-8")
        for old, new in (config_edits or {}).items():
            assert old in ctext, old
            ctext = ctext.replace(old, new)
        for old, new in (settings_edits or {}).items():
            assert old in stext, old
            stext = stext.replace(old, new)
        cpath, spath = tmp_path / "config.toml", tmp_path / "settings.json"
        cpath.write_text(ctext + config_append, encoding="utf-8")
        spath.write_text(stext, encoding="utf-8")
        return cpath, spath

    return make


@pytest.fixture
def cli() -> Callable[..., object]:
    from pdctl.cli import app

    runner = CliRunner()

    def invoke(*args: str, env: dict[str, str] | None = None) -> object:
        return runner.invoke(app, list(args), env=env, catch_exceptions=False)

    return invoke


def stopped_at_teardown(stop: Callable[[T], object]) -> Iterator[list[T]]:
    """The body of a fixture that yields a list for the test to append what it starts; ``stop`` ends each at
    teardown, in the order started (``yield from stopped_at_teardown(SimProcess.stop)``)."""
    started: list[T] = []
    try:
        yield started
    finally:
        for item in started:
            stop(item)


@pytest.fixture
def sim_procs() -> Iterator[list[SimProcess]]:
    """Simulator processes a test starts (append them); stopped at teardown."""
    yield from stopped_at_teardown(SimProcess.stop)
