"""The gateway's HTTP server alone: uvicorn's CPU per request, and what watching for a client's disconnect adds.

Each arm serves one trivial ASGI app in a process of its own (uvloop, uvicorn's httptools protocol or the gateway's
:class:`pdctl.gateway.direct.HttpProtocol`): it reads the body and answers at once with a short SSE stream (``--events``
events, then ``[DONE]``), so nearly all of its CPU is the server's per-request work. Closed-loop keep-alive streams
from the harness's lean client drive it; the arms alternate over ``--rounds`` and the server's user + system CPU per
request is printed per round.

* ``none``: no disconnect watching (the floor: uvicorn's own work per request);
* ``watcher-task``: a task per request blocked in ``receive()`` until ``http.disconnect`` (the ASGI way; the
  gateway's before it ran its own protocol);
* ``watch-callback``: :func:`pdctl.gateway.direct.watch_disconnect` under ``HttpProtocol`` (the gateway's way);
* ``floor``: no ASGI and no uvicorn: an asyncio ``Protocol`` on httptools' request parser that writes the same
  answer (uvicorn's headers, chunked) in one write per request. The least any Python server on uvloop and httptools
  could cost per request, so ``none`` minus ``floor`` bounds what a pdctl-own server protocol could save.

    .venv/bin/python -m benchmarks.server_cpu [--arms none,watcher-task,watch-callback] [--streams 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import psutil

from benchmarks import _harness as H
from pdctl.testing import free_port

ARMS = ("none", "watcher-task", "watch-callback", "floor")


def _serve_floor(port: int, answer: bytes) -> None:
    import email.utils
    import socket

    import httptools
    import uvloop

    class Floor(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.transport: Any = None
            self.health = False
            self.second = 0
            self.date = b""

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_url(self, url: bytes) -> None:
            self.health = url == b"/health"

        def on_message_complete(self) -> None:
            # uvicorn's own headers, the date formatted once a second as uvicorn's server does
            now = int(time.time())
            if now != self.second:
                self.second, self.date = now, email.utils.formatdate(now, usegmt=True).encode()
            date = self.date
            if self.health:
                self.transport.write(
                    b"HTTP/1.1 200 OK\r\ndate: %s\r\nserver: uvicorn\r\ncontent-length: 2\r\n\r\nok" % date
                )
                return
            self.transport.write(b"HTTP/1.1 200 OK\r\ndate: %s\r\nserver: uvicorn\r\n"
                                 b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                                 b"%x\r\n%s\r\n0\r\n\r\n" % (date, len(answer), answer))  # fmt: skip

    async def main() -> None:
        sock = socket.create_server(("127.0.0.1", port), backlog=4096)
        server = await asyncio.get_running_loop().create_server(Floor, sock=sock)
        await server.serve_forever()

    uvloop.run(main())


def _serve(arm: str, port: int, events: int) -> None:
    import uvicorn

    from pdctl.gateway.direct import HttpProtocol, watch_disconnect

    chunk = b'data: {"choices":[{"index":0,"text":"tok"}]}\n\n'
    body = chunk * events + b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % events
    if arm == "floor":
        _serve_floor(port, body)
        return
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}

    async def watcher(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        while (await receive()).get("more_body"):
            pass
        task = None
        if arm == "watcher-task":
            task = asyncio.ensure_future(watcher(receive))
        elif arm == "watch-callback":
            watch_disconnect(send, lambda: None)
        await send(start)
        await send({"type": "http.response.body", "body": body})
        if task is not None:
            task.cancel()
        elif arm == "watch-callback":
            watch_disconnect(send, None)

    http: Any = HttpProtocol if arm == "watch-callback" else "httptools"
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http=http, lifespan="off", access_log=False,
                log_level="warning", backlog=4096)  # fmt: skip


def _window(proc: H.Proc, args: argparse.Namespace) -> tuple[float, int]:
    target = H.Target(proc.port, H.Counter())
    w = H.run_loop(H.closed_loop(target, args.streams, warmup_s=args.warmup_s, measure_s=args.measure_s,
                                 tokens=(args.events, args.events), prompt_words=8, seed=0,
                                 cpu_probe=proc.cpu_s))  # fmt: skip
    if w.errors:
        raise SystemExit(f"{w.errors} failed requests, the first: {w.first_error}")
    return w.proxy_cpu_s / max(1, len(w.results)) * 1e6, len(w.results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--events", type=int, default=4, help="SSE events per answer")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup-s", type=float, default=1.5)
    ap.add_argument("--measure-s", type=float, default=5.0)
    ap.add_argument("--serve", nargs=2, metavar=("ARM", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results/server_cpu.json")
    args = ap.parse_args(argv)
    if args.serve:
        _serve(args.serve[0], int(args.serve[1]), args.events)
        return 0
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}: choose from {', '.join(ARMS)}")
    print(f"load average {psutil.getloadavg()}; {args.streams} streams, {args.events} events per answer")
    per: dict[str, list[float]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="pdbench-server-") as logs:
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else list(reversed(arms)):
                port = free_port()
                cmd = [H.PY, "-m", "benchmarks.server_cpu", "--events", str(args.events), "--serve", arm, str(port)]
                proc = H.start(arm, cmd, port, logs)
                try:
                    us, n = _window(proc, args)
                finally:
                    proc.stop()
                per[arm].append(us)
                print(f"round {r + 1} {arm:<16} {n / args.measure_s:7.0f} req/s | server CPU per request {us:6.1f} us")
    print("\n| arm | server CPU per request, median (per round) |\n|---|---|")
    for arm, values in per.items():
        print(f"| {arm} | {statistics.median(values):.1f} µs ({', '.join(f'{v:.1f}' for v in values)}) |")
    print(f"load average after {psutil.getloadavg()}")
    report = {"machine": H.machine(), "params": vars(args), "us_per_request": per}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
