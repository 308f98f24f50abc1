"""``gateway.workers = 2``: two gateway processes on one port, their limits, metrics and stop (issue 19).

Real processes throughout: simulator workers, ``python -m pdctl gateway`` as users run it. New connections are
spread over the processes by the kernel (SO_REUSEPORT), so the tests open one connection per request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from pdctl.config import RateLimitConfig
from pdctl.gateway.keys import add_key
from pdctl.gateway.ratelimit import share_of
from pdctl.testing import SimProcess, free_port, start_sim
from pdctl.testing.invariants import check_n1, gateway_outcomes
from pdctl.vllm.promtext import metric_value, samples
from tests.conftest import REPO, stopped_at_teardown
from tests.fakes.gateway_harness import wait_for

KEY = "sk-test-processes"
ROOT = REPO


def _body(max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
            "stream": stream}  # fmt: skip


@pytest.fixture
def pair(sim_procs: list[SimProcess], tmp_path: Path) -> tuple[SimProcess, SimProcess]:
    args = ["--max-model-len", "1024", "--sim-profile", "h100"]
    p = start_sim(args, str(tmp_path), name="prefill", role="kv_producer")
    sim_procs.append(p)
    d = start_sim(args, str(tmp_path), name="decode", role="kv_consumer")
    sim_procs.append(d)
    return p, d


class Gateway:
    """``pdctl gateway`` with ``gateway.workers = 2`` in its own process group; output in ``log``."""

    def __init__(
        self, tmp_path: Path, pair: tuple[SimProcess, SimProcess], routing: dict[str, Any] | None = None, **gateway: Any
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = {
            "gateway": {"listen": f"127.0.0.1:{self.port}", "workers": 2, "api_key_env": "PDCTL_TEST_KEY",
                        "drain_timeout_s": 20, **gateway},
            "routing": {"prefill_endpoint": pair[0].url, "decode_endpoint": pair[1].url,
                        "kv_connector": "NixlConnector", **(routing or {})},
            "logging": {"level": "info"},
        }  # fmt: skip
        (tmp_path / "settings.json").write_text(json.dumps(settings))
        self.log = tmp_path / "gateway.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PDCTL_TEST_KEY": KEY}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "pdctl", "gateway", "-s", "settings.json"],
                                         cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        assert wait_for(self._listening, timeout=60), self.log.read_text()
        self.children = psutil.Process(self.proc.pid).children()
        assert wait_for(self._ready, timeout=60), self.log.read_text()

    def _listening(self) -> bool:
        """Both processes listen on the port (each its own socket)."""
        try:
            children = psutil.Process(self.proc.pid).children()
            return len(children) == 2 and all(
                any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in p.net_connections("tcp"))
                for p in children
            )
        except psutil.Error:
            return False

    def _ready(self) -> bool:
        """Several connections in a row find a ready process (the kernel spreads them over both)."""
        try:
            return all(httpx.get(self.url + "/ready", timeout=5).status_code == 200 for _ in range(8))
        except httpx.TransportError:
            return False

    def post(self, key: str = KEY, **body: Any) -> httpx.Response:
        """One request on a connection of its own."""
        with httpx.Client(timeout=30) as c:
            return c.post(self.url + "/v1/chat/completions", json=_body(**body),
                          headers={"authorization": f"Bearer {key}"})  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def gateways() -> Iterator[list[Gateway]]:
    yield from stopped_at_teardown(Gateway.stop)


def _total(text: str, name: str, **labels: str) -> float:
    return metric_value(samples(text), name, **labels) or 0.0


def test_shares_of_a_limit_sum_to_the_limit() -> None:
    for limit in (1, 2, 3, 7, 100):
        for n in (1, 2, 3, 4):
            parts = [share_of(RateLimitConfig(limit, limit * 10, limit), (i, n)) for i in range(n)]
            assert sum(p.requests_per_minute or 0 for p in parts) == limit
            assert sum(p.tokens_per_minute or 0 for p in parts) == limit * 10
            assert sum(p.max_concurrency or 0 for p in parts) == limit
    assert share_of(RateLimitConfig(), (1, 2)) == RateLimitConfig()


def test_two_processes_serve_one_port_and_metrics_total_both(
    pair: tuple[SimProcess, SimProcess], tmp_path: Path, gateways: list[Gateway]
) -> None:
    gw = Gateway(tmp_path, pair)
    gateways.append(gw)
    assert len(gw.children) == 2
    codes = [gw.post().status_code for _ in range(30)]
    assert codes == [200] * 30
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    assert _total(text, "pdctl_requests_total", path="disagg", status="200") == 30
    assert _total(text, "pdctl_accepted_total") == 30
    assert _total(text, "pdctl_key_requests_total", key="default", status="200") == 30
    n1 = check_n1(gateway_outcomes(text))  # accepted = answered, nothing in flight, over both processes
    assert n1.ok, n1.detail
    # Both processes served: each access line names its process.
    pids = {line.split("pdctl.gateway.access[")[1].split("]")[0] for line in gw.log.read_text().splitlines()
            if "pdctl.gateway.access[" in line}  # fmt: skip
    assert pids == {str(c.pid) for c in gw.children}
    assert KEY not in gw.log.read_text()


def test_a_keys_limit_holds_across_two_processes(
    pair: tuple[SimProcess, SimProcess], tmp_path: Path, gateways: list[Gateway]
) -> None:
    alice = add_key(tmp_path / "keys.json", "alice", RateLimitConfig(requests_per_minute=4), None, True)
    gw = Gateway(tmp_path, pair, keys_file="keys.json")
    gateways.append(gw)
    answers = [gw.post(alice) for _ in range(20)]
    codes = [r.status_code for r in answers]
    # 20 connections over 2 processes: each admits its share (2 of 4) and refuses the rest.
    assert codes.count(200) == 4 and codes.count(429) == 16, codes
    refused = next(r for r in answers if r.status_code == 429)
    assert "gateway.workers = 2" in refused.json()["error"]["message"] and refused.headers["retry-after"]
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    assert _total(text, "pdctl_key_requests_total", key="alice", status="200") == 4
    assert _total(text, "pdctl_key_requests_total", key="alice", status="429") == 16


def test_every_process_judges_by_the_engines_kv_events(
    sim_procs: list[SimProcess], tmp_path: Path, gateways: list[Gateway]
) -> None:
    """prefix_view "exact" with two processes: the parent binds the events port and relays to both, so a follow-up
    goes to decode alone whichever process its connection lands on (the approximate view is per process)."""
    events = free_port()
    pair = []
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{events}", "topic": name}
        args = ["--max-model-len", "1024", "--kv-events-config", json.dumps(config)]
        pair.append(start_sim(args, str(tmp_path), name=name, role=role))
        sim_procs.append(pair[-1])
    routing = {"pd_mode": "adaptive", "prefix_view": "exact", "kv_events_port": events, "local_max_uncached_tokens": 64}
    gw = Gateway(tmp_path, (pair[0], pair[1]), routing=routing)
    gateways.append(gw)
    history = list(range(1000, 1300))  # token ids: exact for any model

    def complete(prompt: list[int]) -> httpx.Response:
        with httpx.Client(timeout=30) as c:  # a connection of its own: either process
            r = c.post(gw.url + "/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 2},
                       headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
        assert r.status_code == 200, r.text
        return r

    assert complete(history).headers["x-pd-path"] == "disagg"

    def stored() -> bool:  # both processes applied decode's events (the metric sums the processes)
        text = httpx.get(gw.url + "/metrics", timeout=10).text
        return _total(text, "pdctl_kv_events_total", instance="decode", event="BlockStored") >= 2

    assert wait_for(stored, timeout=30), gw.log.read_text()
    paths = [complete([*history, 7, 8, i]).headers["x-pd-path"] for i in range(16)]
    assert paths == ["local"] * 16, paths
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    assert _total(text, "pdctl_pd_view_cached_tokens_total", view="exact") >= 16 * 288  # 18 blocks of 16 each
    pids = {line.split("pdctl.gateway.access[")[1].split("]")[0] for line in gw.log.read_text().splitlines()
            if "pdctl.gateway.access[" in line and "view=exact" in line}  # fmt: skip
    assert pids == {str(c.pid) for c in gw.children}  # both processes decided by the exact view


@pytest.mark.parametrize("to", ["parent", "group"])
def test_sigterm_drains_every_process_mid_stream(
    to: str, pair: tuple[SimProcess, SimProcess], tmp_path: Path, gateways: list[Gateway]
) -> None:
    """SIGTERM to the parent (``kill``, Kubernetes) or to the whole group (``pdctl down``): one drain each,
    every stream ends with ``[DONE]``, every process is gone."""
    gw = Gateway(tmp_path, pair)
    gateways.append(gw)
    bodies: list[bytes] = []
    started = threading.Semaphore(0)

    def stream() -> None:
        with httpx.Client(timeout=60) as c, c.stream("POST", gw.url + "/v1/chat/completions",
                                                     json=_body(max_tokens=300, stream=True),
                                                     headers={"authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
            data = b""
            for chunk in r.iter_bytes():
                if not data:
                    started.release()
                data += chunk
            bodies.append(data)

    threads = [threading.Thread(target=stream) for _ in range(6)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=30)
    if to == "parent":
        gw.proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(gw.proc.pid, signal.SIGTERM)
    assert gw.proc.wait(timeout=60) == 0
    for t in threads:
        t.join(timeout=30)
    assert len(bodies) == 6
    assert all(b.rstrip().endswith(b"data: [DONE]") for b in bodies)  # the drain let every stream finish
    assert not [c.pid for c in gw.children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert "stopping 2 gateway process(es)" in gw.log.read_text()


def test_processes_stop_when_their_parent_is_killed(
    pair: tuple[SimProcess, SimProcess], tmp_path: Path, gateways: list[Gateway]
) -> None:
    gw = Gateway(tmp_path, pair, drain_timeout_s=2)
    gateways.append(gw)
    os.kill(gw.proc.pid, signal.SIGKILL)
    gw.proc.wait(timeout=10)
    _, alive = psutil.wait_procs(gw.children, timeout=30)
    assert not alive


def test_a_process_that_dies_stops_the_others_and_the_parent_fails(
    pair: tuple[SimProcess, SimProcess], tmp_path: Path, gateways: list[Gateway]
) -> None:
    """Fail-fast, as a single gateway that dies: ``pdctl up``'s restart policy then restarts the whole gateway."""
    gw = Gateway(tmp_path, pair, drain_timeout_s=2)
    gateways.append(gw)
    dead, other = gw.children
    dead.kill()
    assert gw.proc.wait(timeout=30) == 1
    other.wait(timeout=10)
    assert f"gateway process {dead.pid} exited" in gw.log.read_text()
