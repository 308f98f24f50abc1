"""The gateway's own CPU per PD request, in-process: the ASGI app on scripted in-memory workers, no sockets.

What it isolates: everything the gateway does per request besides the network (auth, body, validation, routing,
limits, both legs' bookkeeping, the relay loop over 10 SSE chunks, metrics, the access log line written to a file
through the tree's own ``configure_logging``), as CPU time (``time.process_time``), so a loaded machine moves it far
less than wall-clock latency. Three kinds of request: a short chat request, streamed and not, and a coding agent's
40 KB turn, streamed. Each checkout named in ``--trees`` runs in its own interpreter, the trees alternating over
``--rounds``; the medians are printed. The workers are a minimal client object set on each instance
(``Instance.client``), so older checkouts without :mod:`pdctl.gateway.memory` can be measured too.

    .venv/bin/python benchmarks/gateway_cpu.py [--trees .,/path/to/other/checkout] [--rounds 6] [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# This checkout's ASGI receive (pdctl/testing/asgi.py, no imports of pdctl), loaded by path: the child runs on the
# measured tree's pdctl, which may predate it.
_asgi_spec = importlib.util.spec_from_file_location(
    "_pdctl_testing_asgi", Path(__file__).resolve().parents[1] / "pdctl" / "testing" / "asgi.py"
)
assert _asgi_spec is not None and _asgi_spec.loader is not None
_asgi = importlib.util.module_from_spec(_asgi_spec)
_asgi_spec.loader.exec_module(_asgi)
one_body = _asgi.one_body

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
STREAM = [EVENT] * 8 + [b'data: {"choices":[],"usage":{"completion_tokens":8}}\n\n', b"data: [DONE]\n\n"]
KEY = "sk-bench-0123456789"
P_URL, D_URL = "http://prefill.invalid", "http://decode.invalid"


class _Response:
    def __init__(self, parts: list[bytes]) -> None:
        self.status = 200
        self._parts = parts

    async def read(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data

    async def json(self) -> Any:
        return json.loads(await self.read())

    async def chunk(self) -> bytes:
        return self._parts.pop(0) if self._parts else b""

    def stall_timeout(self, read_s: float) -> None:
        pass  # every part is there already: nothing stalls

    def close(self) -> None:
        pass


class _Worker:
    def __init__(self, role: str, prefill_reply: bytes) -> None:
        self.role = role
        self.prefill_reply = prefill_reply

    async def request(self, method: str, path: str, *, body: bytes | None = None, **_: Any) -> _Response:
        if path == "/health":
            return _Response([])
        if path == "/v1/models":
            return _Response([b'{"data":[{"id":"tiny","max_model_len":2048}]}'])
        if self.role == "prefill":
            return _Response([self.prefill_reply])
        streamed = body is not None and b'"stream":true' in body
        return _Response(list(STREAM) if streamed else [b'{"id":"d","usage":{"completion_tokens":8}}'])

    async def aclose(self) -> None:
        pass


async def _one(app: Any, raw: bytes) -> None:
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-length", str(len(raw)).encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    done = asyncio.Event()
    receive = one_body(raw, done)

    status: list[int] = []
    body: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif len(body) < 4:
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    done.set()
    if status != [200]:  # a run of errors would measure the error path, not a PD request
        raise RuntimeError(f"the gateway answered {status}: {b''.join(body)[:300]!r}")


async def _child(requests: int) -> dict[str, float]:
    from pdctl.gateway.server import configure_logging

    # INFO as shipped, through the tree's own logging set-up, into a file as under `pdctl up` (the gateway's stdout
    # is its log file there): the access line's formatting and write are part of a request's cost.
    with tempfile.TemporaryFile("w") as logfile:
        sys.stdout = logfile
        try:
            configure_logging("info")
        finally:
            sys.stdout = sys.__stdout__
        return await _measure(requests)


async def _measure(requests: int) -> dict[str, float]:
    from pdctl.config import GatewayConfig, LoggingConfig, RoutingConfig, SLOConfig
    from pdctl.gateway.app import create_app
    from pdctl.gateway.settings import GatewaySettings, InstanceSpec, LocalModel
    from pdctl.vllm.protocol import REQUIRED_DECODE_FIELDS

    kv: dict[str, Any] = {f: f"x-{f}" for f in REQUIRED_DECODE_FIELDS}
    kv.update(remote_block_ids=[1, 2, 3], remote_port=5600, do_remote_prefill=True)
    reply = json.dumps({"id": "p", "choices": [], "usage": {"prompt_tokens": 5}, "kv_transfer_params": kv}).encode()
    settings = GatewaySettings(
        gateway=GatewayConfig(listen_host="127.0.0.1", listen_port=0),
        # *.invalid: static instances (pdctl.gateway.discovery would look other names up in DNS, find nothing,
        # and leave the pool empty).
        routing=RoutingConfig((P_URL,), (D_URL,), "pd_disagg", "NixlConnector"),
        slo=SLOConfig(admission=False), logging=LoggingConfig(),
        prefill=(InstanceSpec("prefill", "prefill", P_URL),), decode=(InstanceSpec("decode", "decode", D_URL),),
        models=(LocalModel("tiny", 32768),), connector="NixlConnector", health_interval_s=60.0,
    )  # fmt: skip
    app = create_app(settings, KEY)
    for inst in app.pool.instances:
        inst.client = _Worker(inst.role, reply)
    await app.startup()
    try:  # the heap as the gateway's server leaves it once started (older checkouts have no settle_heap)
        from pdctl.gateway.server import settle_heap
    except ImportError:
        pass
    else:
        settle_heap()
    out: dict[str, float] = {}
    short = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 8}
    kinds = (("stream_us", {**short, "stream": True}, requests), ("json_us", {**short, "stream": False}, requests),
             ("agent_us", _agent_body(), max(1, requests // 10)))  # fmt: skip
    for key, body, n in kinds:
        raw = json.dumps(body).encode()
        for _ in range(max(20, n // 15)):  # warm-up
            await _one(app, raw)
        t = time.process_time()
        for _ in range(n):
            await _one(app, raw)
        out[key] = (time.process_time() - t) / n * 1e6
    await app.shutdown()
    return out


def _agent_body() -> dict[str, Any]:
    """A coding agent's turn, streamed: 40 rounds of a user message, a tool call and its result, and 12 tool
    definitions (about 40 KB of JSON, as the client's httpx writes it: non-ASCII escaped)."""
    messages: list[dict[str, Any]] = []
    for i in range(40):
        ask = f"Look at src/module_{i}.py and fix the timeout that handle_request ignores (超时). "
        messages += [
            {"role": "user", "content": ask * 3},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                "name": "read_file", "arguments": json.dumps({"path": f"src/module_{i}.py", "start": 1})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "def handle_request(req, timeout=30):\n" * 10},
        ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does one useful thing. " * 3,
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
             for i in range(12)]  # fmt: skip
    return {"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 512, "stream": True}


def _profile(requests: int, top: int) -> None:
    """cProfile over the request kinds (the gateway's set-up included, its imports not): deterministic, so it
    inflates code made of many small calls; read it as where the calls go, not as microseconds."""
    import cProfile
    import pstats

    import pdctl.gateway.app
    import pdctl.gateway.server  # noqa: F401  # imported before the profile starts: a request's cost, not start-up's

    profile = cProfile.Profile()

    async def go() -> None:
        profile.enable()
        try:
            await _child(requests)
        finally:
            profile.disable()

    asyncio.run(go())
    stats = pstats.Stats(profile)
    rows = stats.stats  # type: ignore[attr-defined]  # pstats keeps its table here
    total = sum(row[2] for row in rows.values())
    shares: dict[str, float] = {}
    for (path, _, _), row in rows.items():
        lib = next(
            (k for k in ("pdctl", "prometheus_client", "json", "logging", "asyncio") if f"/{k}/" in path), "other"
        )
        shares[lib] = shares.get(lib, 0.0) + row[2]
    print(
        "own time by package: "
        + ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(shares.items(), key=lambda x: -x[1]))
    )
    stats.sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=".", help="comma list of checkouts (each one's pdctl is measured)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="instead: this checkout under cProfile, its N functions of most own time, and each library's "
                    "share of it")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(_child(args.requests))))
        return 0
    if args.profile:
        _profile(args.requests, args.profile)
        return 0
    trees = [str(Path(t).resolve()) for t in args.trees.split(",") if t]
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else reversed(trees):
            env = {**os.environ, "PYTHONPATH": tree}
            cmd = [sys.executable, __file__, "--child", "--requests", str(args.requests)]
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(done.stdout.splitlines()[-1]))
    print("| tree | streamed request, CPU µs (median; all) | non-streamed request, CPU µs (median; all) | "
          "agent's 40 KB streamed request, CPU µs (median; all) |")  # fmt: skip
    print("|---|---:|---:|---:|")
    for tree, rs in runs.items():
        cells = []
        for key in ("stream_us", "json_us", "agent_us"):
            values = [x[key] for x in rs]
            cells.append(f"{statistics.median(values):.1f} ({', '.join(f'{v:.0f}' for v in values)})")
        print(f"| {tree} | {' | '.join(cells)} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
