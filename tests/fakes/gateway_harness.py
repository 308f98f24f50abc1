"""Test harness for the gateway: fake processes in their own process groups, the gateway on a thread."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from pdctl.config import GatewayConfig, LoggingConfig, RateLimitConfig, RoutingConfig, SLOConfig
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.direct import HttpProtocol
from pdctl.gateway.settings import GatewaySettings, InstanceSpec, LocalModel
from pdctl.testing import free_port, kill_groups
from pdctl.testing.asgi import one_body
from pdctl.vllm.promtext import metric_value, samples

HERE = Path(__file__).resolve().parent
KEY = "sk-test-client-key-0123456789"
UPSTREAM_KEY = "sk-test-upstream-key-9876543210"


class FakeProc:
    """A fake worker/upstream subprocess."""

    def __init__(self, script: str, spec: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / script), "--port", "0", "--spec", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("PORT "):
                break
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"{script} exited with {self.proc.returncode}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=10).json()

    def log(self) -> list[dict[str, Any]]:
        return list(self.get("/_log"))

    def completions(self) -> list[dict[str, Any]]:
        return [e for e in self.log() if e["path"].endswith("completions")]

    def control(self, **spec: Any) -> None:
        httpx.post(self.url + "/_control", json=spec, timeout=10)

    def metric(self, name: str) -> float:
        value = metric_value(samples(httpx.get(self.url + "/metrics", timeout=10).text, (name,)), name)
        if value is None:
            raise KeyError(name)
        return value

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        kill_groups([self.proc.pid])
        self.proc.wait(timeout=10)


def make_settings(
    prefill: list[str],
    decode: list[str],
    *,
    upstream: str | None = None,
    connector: str | None = "NixlConnector",
    strategy: str = "pd_disagg",
    models: tuple[LocalModel, ...] = (LocalModel("tiny", 2048),),
    request_timeout_s: float = 10.0,
    max_retries: int = 2,
    rate_limit: RateLimitConfig | None = None,
    slo: SLOConfig | None = None,
    max_body_bytes: int = 1 << 20,
    fallback: str = "none",
    **extra: Any,
) -> GatewaySettings:
    gateway = GatewayConfig(
        listen_host="127.0.0.1",
        listen_port=0,
        upstream_base_url=upstream,
        request_timeout_s=request_timeout_s,
        max_retries=max_retries,
        max_body_bytes=max_body_bytes,
        rate_limit=rate_limit or RateLimitConfig(),
        drain_timeout_s=5.0,
        fallback=fallback,  # type: ignore[arg-type]
    )
    routing = RoutingConfig(tuple(prefill), tuple(decode), strategy, connector)  # type: ignore[arg-type]
    p = tuple(
        InstanceSpec(f"prefill-{i}" if len(prefill) > 1 else "prefill", "prefill", u) for i, u in enumerate(prefill)
    )
    d = tuple(InstanceSpec(f"decode-{i}" if len(decode) > 1 else "decode", "decode", u) for i, u in enumerate(decode))
    base = GatewaySettings(
        gateway=gateway,
        routing=routing,
        slo=slo or SLOConfig(admission=False),
        logging=LoggingConfig(),
        prefill=p,
        decode=d,
        models=models,
        connector=connector,
        kv_timeout_s=2.0,
        health_interval_s=0.3,
    )
    return replace(base, **extra)


class GatewayThread:
    """The gateway app under uvicorn on a background thread, with the gateway's own HTTP protocol (``http``:
    ``"httptools"`` for uvicorn's, under which the app watches for disconnects with a task)."""

    def __init__(
        self,
        settings: GatewaySettings,
        key: str = KEY,
        upstream_key: str | None = None,
        http: type[asyncio.Protocol] | str = HttpProtocol,
    ) -> None:
        self.app: Gateway = create_app(settings, key, upstream_key)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            http=http,
            loop="asyncio",
            lifespan="on",
            access_log=False,
            log_level="warning",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)

    def client(self, key: str | None = KEY, timeout: float = 30) -> httpx.Client:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def metric(self, name: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            mname, _, rest = head.partition("{")
            if mname != name:
                continue
            got = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if p)
            if all(got.get(k) == f'"{v}"' for k, v in labels.items()):
                total += float(value)
        del want
        return total

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def wait_for(cond: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


@dataclass
class AsgiReply:
    """What an in-process ASGI call answered."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


def run_app(app: Gateway, test: Callable[[Gateway], Awaitable[None]]) -> Gateway:
    """Start ``app`` in a new event loop, run ``test`` on it, shut it down (no server, no socket)."""

    async def main() -> None:
        await app.startup()
        try:
            await test(app)
        finally:
            await app.shutdown()

    asyncio.run(main())
    return app


async def asgi_request(
    app: Any,
    path: str,
    body: dict[str, Any],
    *,
    key: str = KEY,
    request_id: str | None = None,
    disconnect_after_chunks: int | None = None,
    disconnect_after_s: float | None = None,
    extra_headers: dict[str, str] | None = None,
) -> AsgiReply:
    """POST ``body`` to the ASGI ``app`` in this event loop (no server, no socket); the client may leave after
    ``disconnect_after_chunks`` non-empty body messages or ``disconnect_after_s`` seconds."""
    raw = json.dumps(body).encode()
    headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode())]  # fmt: skip
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra_headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    out = AsgiReply()
    gone = asyncio.Event()
    receive = one_body(raw, gone)
    chunks = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal chunks
        if gone.is_set():
            raise OSError("the client is gone")
        if message["type"] == "http.response.start":
            out.status = message["status"]
            out.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message.get("body"):
            out.body += message["body"]
            chunks += 1
            if disconnect_after_chunks is not None and chunks >= disconnect_after_chunks:
                gone.set()

    timer = asyncio.get_running_loop().call_later(disconnect_after_s, gone.set) if disconnect_after_s else None
    try:
        await app(scope, receive, send)
    finally:
        if timer is not None:
            timer.cancel()
        gone.set()
    return out
