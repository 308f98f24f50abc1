"""Discovery (``pdctl.gateway.discovery``) on in-memory workers, with names served by the test DNS server.

The gateway app runs in the test's event loop; the health/discovery interval is long, so each test drives the
rounds itself with ``app.discovery.refresh()``. Workers are :class:`~pdctl.gateway.memory.MemoryWorker`s named
``<endpoint>@<address>`` as discovery names its instances.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import pytest

from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.discovery import DNS_SERVER_ENV, is_dns_name, resolver_from_env
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from pdctl.vllm.protocol import REQUIRED_DECODE_FIELDS
from tests.fakes.dns_server import DnsServer
from tests.fakes.gateway_harness import KEY, AsgiReply, asgi_request, make_settings, run_app

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait on the event loop until ``cond()`` holds (the test fails at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def _prefill(delay_s: float = 0.0) -> MemoryReply:
    params: dict[str, Any] = {f: f"p-{f}" for f in REQUIRED_DECODE_FIELDS}
    params.update(remote_block_ids=[1], remote_port=5600, do_remote_prefill=True, do_remote_decode=False)
    return MemoryReply.json({"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params},
                            delay_s=delay_s)  # fmt: skip


def _decoded(delay_s: float = 0.0) -> MemoryReply:
    return MemoryReply.json({"id": "cmpl-d", "choices": [{"index": 0, "message": {"content": "hi"}}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 1}}, delay_s=delay_s)  # fmt: skip


@pytest.fixture
def dns_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[DnsServer]:
    with DnsServer({"decode.pods.test": ["127.0.0.3"]}) as server:
        monkeypatch.setenv(DNS_SERVER_ENV, server.address)
        yield server


def _run(workers: MemoryWorkers, decode_url: str, test: Callable[[Gateway], Awaitable[None]]) -> Gateway:
    settings = make_settings(["http://prefill.invalid"], [decode_url], health_interval_s=600.0)
    return run_app(create_app(settings, KEY, clients=workers), test)


async def _ready(app: Gateway) -> dict[str, str]:
    """``GET /ready``'s instance set: name -> state."""
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "path": "/ready", "method": "GET", "headers": []}, receive, send)
    data = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    return {i["name"]: i["state"] for i in data["instances"]}


def _states(app: Gateway, role: str = "decode") -> dict[str, float]:
    return {
        s: app.metrics.registry.get_sample_value("pdctl_instances", {"role": role, "state": s}) or 0.0
        for s in ("warming", "serving", "draining")
    }


def test_which_hosts_are_discovered() -> None:
    assert is_dns_name("decode") and is_dns_name("decode.pods.svc.cluster.local")
    assert not any(is_dns_name(h) for h in ("127.0.0.3", "::1", "localhost", "decode.invalid", ""))


def test_resolver_setting_is_host_and_port() -> None:
    r = resolver_from_env({DNS_SERVER_ENV: "127.0.0.1:5353"})
    assert (r.nameservers, r.port) == (["127.0.0.1"], 5353)
    with pytest.raises(ValueError, match="HOST:PORT"):
        resolver_from_env({DNS_SERVER_ENV: "127.0.0.1"})


def test_static_endpoints_are_not_looked_up(dns_server: DnsServer) -> None:
    workers = MemoryWorkers()

    async def test(app: Gateway) -> None:
        assert await _ready(app) == {"prefill": "serving", "decode": "serving"}

    _run(workers, "http://decode.invalid", test)
    assert dns_server.queries == 0


def test_a_name_without_any_dns_answer_stays_one_static_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a "DNS server" that never answers
    silent.bind(("127.0.0.1", 0))
    monkeypatch.setenv(DNS_SERVER_ENV, f"127.0.0.1:{silent.getsockname()[1]}")
    workers = MemoryWorkers()

    async def test(app: Gateway) -> None:
        assert await _ready(app) == {"prefill": "serving", "decode": "serving"}
        assert not app.discovery.active

    try:
        _run(workers, "http://gpu-box-2:8200", test)
    finally:
        silent.close()


def test_a_service_without_pods_yet_is_found_later(dns_server: DnsServer) -> None:
    workers = MemoryWorkers()

    async def test(app: Gateway) -> None:
        assert await _ready(app) == {"prefill": "serving"} and not app.pool.ready()
        dns_server.set("later.pods.test", ["127.0.0.7"])
        workers["prefill"].script(_prefill())
        workers["decode@127.0.0.7"].script(_decoded())
        await app.discovery.refresh()
        assert await _ready(app) == {"prefill": "serving", "decode@127.0.0.7": "serving"} and app.pool.ready()

    _run(workers, "http://later.pods.test:8200", test)


def test_a_new_address_gets_traffic_only_after_its_warm_up(dns_server: DnsServer) -> None:
    workers = MemoryWorkers()
    # Startup: decode@127.0.0.3 warms up through the static prefill (two legs), then serves.
    workers["prefill"].script(_prefill())
    workers["decode@127.0.0.3"].script(_decoded())
    new = workers["decode@127.0.0.4"]
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        assert await _ready(app) == {"prefill": "serving", "decode@127.0.0.3": "serving"}
        dns_server.set("decode.pods.test", ["127.0.0.3", "127.0.0.4"])
        new.healthy = False
        await app.discovery.refresh()
        assert (await _ready(app))["decode@127.0.0.4"] == "warming"
        assert _states(app) == {"warming": 1.0, "serving": 1.0, "draining": 0.0}
        new.healthy = True
        workers["prefill"].script(_prefill())
        new.script(MemoryReply(500, (b"handshake_setup_failed",)))  # the warm-up's decode leg fails
        await app.discovery.refresh()
        assert (await _ready(app))["decode@127.0.0.4"] == "warming"
        for _ in range(3):  # traffic meanwhile: all to the serving decode
            workers["prefill"].script(_prefill())
            workers["decode@127.0.0.3"].script(_decoded())
            replies.append(await asgi_request(app, CHAT, BODY))
        workers["prefill"].script(_prefill())
        new.script(_decoded())
        await app.discovery.refresh()
        assert (await _ready(app))["decode@127.0.0.4"] == "serving"
        assert _states(app) == {"warming": 0.0, "serving": 2.0, "draining": 0.0}

    _run(workers, "http://decode.pods.test:8200", test)
    assert [r.status for r in replies] == [200, 200, 200]
    assert {r.headers["x-pd-decode"] for r in replies} == {"decode@127.0.0.3"}
    warmups = new.completions()
    assert len(warmups) == 2 and all((c.request_id or "").startswith("pdctl-warmup-") for c in warmups)


def test_a_vanished_address_drains_its_in_flight_request(dns_server: DnsServer) -> None:
    dns_server.set("decode.pods.test", ["127.0.0.3", "127.0.0.4"])
    workers = MemoryWorkers()
    workers["prefill"].script(_prefill(), _prefill())  # startup: each new decode warms up through prefill
    gone = workers["decode@127.0.0.4"].script(_decoded())
    stays = workers["decode@127.0.0.3"].script(_decoded())
    replies: list[AsgiReply] = []

    async def test(app: Gateway) -> None:
        assert await _ready(app) == {"prefill": "serving", "decode@127.0.0.3": "serving", "decode@127.0.0.4": "serving"}
        # One slow request on .4 (the other decode is busy, so least-loaded picks .4).
        stays.script(_decoded(delay_s=0.5))
        gone.script(_decoded(delay_s=1.0))
        workers["prefill"].script(_prefill(), _prefill())

        def decoding() -> int:
            return sum(i.in_flight for i in app.pool.instances if i.name.startswith("decode@"))

        first = asyncio.ensure_future(asgi_request(app, CHAT, BODY))
        await _until(lambda: decoding() == 1)
        second = asyncio.ensure_future(asgi_request(app, CHAT, BODY))
        await _until(lambda: decoding() == 2)
        dns_server.set("decode.pods.test", ["127.0.0.3"])
        await app.discovery.refresh()
        assert (await _ready(app))["decode@127.0.0.4"] == "draining"
        assert next(i for i in app.pool.instances if i.name == "decode@127.0.0.4").in_flight == 1
        assert _states(app) == {"warming": 0.0, "serving": 1.0, "draining": 1.0}
        workers["prefill"].script(_prefill())
        stays.script(_decoded())
        replies.append(await asgi_request(app, CHAT, BODY))  # new work goes elsewhere
        replies.extend(await asyncio.gather(first, second))
        await app.discovery.refresh()
        assert "decode@127.0.0.4" not in await _ready(app)
        assert _states(app) == {"warming": 0.0, "serving": 1.0, "draining": 0.0}

    _run(workers, "http://decode.pods.test:8200", test)
    assert [r.status for r in replies] == [200, 200, 200]
    assert replies[0].headers["x-pd-decode"] == "decode@127.0.0.3"
    assert sorted(r.headers["x-pd-decode"] for r in replies[1:]) == [
        "decode@127.0.0.3",
        "decode@127.0.0.4",
    ]
