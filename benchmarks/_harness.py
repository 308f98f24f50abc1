"""Shared pieces of the benchmarks: a lean streaming load client, process handling, statistics.

The load client is a raw asyncio ``Protocol`` per keep-alive connection with httptools' C response parser:
one connection per stream, no per-chunk JSON parsing, no per-chunk allocation beyond the bytes the loop
hands over. It costs a few microseconds of CPU per chunk, so on this 2-core machine it is never the part
that saturates first (``gateway_overhead.py`` reports its CPU next to the proxy's).

Timing (``time.perf_counter``): TTFT = send -> the first body bytes holding an SSE ``data:`` event; a chunk
= one SSE event other than ``[DONE]``. The same definitions are applied to every arm, so differences are
the proxy's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import httpx
import psutil

from pdctl.bench.metrics import percentile
from pdctl.testing import free_port, stop_group

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
KEY = "pdbench-key-not-secret"
MODEL = "sim-model"


# ---------------------------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A started server process (own process group, output to a log file)."""

    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ps(self) -> psutil.Process:
        return psutil.Process(self.popen.pid)

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process and its children (threads included)."""
        try:
            p = self.ps()
            total = sum(p.cpu_times()[:2])
            for c in p.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += sum(c.cpu_times()[:2])
            return float(total)
        except psutil.Error:
            return 0.0

    def rss_mb(self) -> tuple[float, float]:
        """(current RSS, peak RSS) in MiB, summed over the process tree."""
        cur = peak = 0.0
        try:
            procs = [self.ps(), *self.ps().children(recursive=True)]
        except psutil.Error:
            return 0.0, 0.0
        for p in procs:
            with contextlib.suppress(psutil.Error, OSError):
                cur += p.memory_info().rss / 2**20
                with open(f"/proc/{p.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peak += int(line.split()[1]) / 1024
        return round(cur, 1), round(peak, 1)

    def tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return Path(self.log_path).read_text(errors="replace")[-n:]
        return ""

    def stop(self, grace_s: float = 5.0) -> None:
        stop_group(self.popen, grace_s)


def start(
    name: str,
    argv: Sequence[str],
    port: int,
    log_dir: str,
    *,
    env: Mapping[str, str] | None = None,
    ready_path: str = "/health",
    ready_timeout_s: float = 60.0,
    cwd: str | None = None,
) -> Proc:
    """Start ``argv`` in its own session; wait until GET ``ready_path`` answers 200."""
    full_env = dict(os.environ)
    full_env.update({"PYTHONUNBUFFERED": "1"})
    full_env.update(env or {})
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
            start_new_session=True, cwd=cwd,
        )  # fmt: skip
    proc = Proc(name, popen, port, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited with {popen.returncode}:\n{proc.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(proc.url + ready_path, timeout=2.0).status_code == 200:
                return proc
        if time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"{name} not ready after {ready_timeout_s:.0f} s:\n{proc.tail()}")
        time.sleep(0.1)


def start_nixl_sim(name: str, role: str, log_dir: str, model: str, flags: Sequence[str]) -> Proc:
    """``python -m pdctl.sim`` serving ``model`` as NixlConnector's ``role`` on a free port and side channel;
    ``flags``: its other arguments."""
    port, side = free_port(), free_port()
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": role})
    argv = [PY, "-m", "pdctl.sim", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--kv-transfer-config", kv, *flags]  # fmt: skip
    return start(name, argv, port, log_dir, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)})


def start_sim(name: str, role: str, log_dir: str, speed: float, extra: Sequence[str] = ()) -> Proc:
    """A fast-profile simulator worker speaking NixlConnector's protocol."""
    flags = ["--sim-profile", "fast", "--sim-speed", repr(speed), "--max-num-seqs", "1024", "--max-model-len", "4096"]
    return start_nixl_sim(name, role, log_dir, MODEL, [*flags, *extra])


def write_settings(
    path: Path, prefill: str, decode: str, strategy: str, port: int, level: str = "info", workers: int = 1,
    otlp: str | None = None,
) -> Path:  # fmt: skip
    """A gateway settings.json pointing at the simulator workers (``workers``: gateway processes; ``otlp``: an
    OTLP/HTTP traces endpoint, tracing on)."""
    settings = {
        "gateway": {"listen": f"127.0.0.1:{port}", "api_key_env": "PDBENCH_API_KEY", "request_timeout_s": 300,
                    "workers": workers},
        "routing": {"prefill_endpoint": prefill, "decode_endpoint": decode, "strategy": strategy,
                    "kv_connector": "NixlConnector"},
        # Admission off: under a deliberately saturating load it would (rightly) turn requests away, and the
        # peers have no such feature; the overhead measured is that of relaying.
        "slo": {"ttft_ms": 60000, "tpot_ms": 10000, "p90": True, "admission": False},
        "logging": {"level": level, "log_kv_transfer": True, **({"otlp_traces_endpoint": otlp} if otlp else {})},
    }  # fmt: skip
    path.write_text(json.dumps(settings, indent=2))
    return path


def start_pdctl_gateway(
    name: str,
    log_dir: str,
    prefill: str,
    decode: str,
    strategy: str,
    level: str = "info",
    tree: str | None = None,
    workers: int = 1,
    python: str | None = None,
    otlp: str | None = None,
) -> Proc:
    """``python -m pdctl gateway -s settings.json`` as users run it (``tree``: another checkout's pdctl;
    ``workers``: gateway processes, whose CPU :meth:`Proc.cpu_s` counts with the parent's; ``python``: another
    interpreter, with the gateway's dependencies installed, instead of this checkout's venv)."""
    port = free_port()
    settings = write_settings(
        Path(log_dir) / f"{name}.settings.json", prefill, decode, strategy, port, level, workers, otlp
    )
    argv = [python or PY, "-m", "pdctl", "gateway", "-s", str(settings)]
    env = {"PDBENCH_API_KEY": KEY}
    if tree:
        env["PYTHONPATH"] = tree
    return start(name, argv, port, log_dir, env=env, ready_path="/ready", cwd=tree or str(ROOT))


def start_gateway_with(
    name: str, log_dir: str, port: int, settings: Mapping[str, Any], key: str, *, extra: Sequence[str] = (),
    tree: str | None = None,
) -> Proc:  # fmt: skip
    """``python -m pdctl gateway -s <log_dir>/<name>.settings.json`` holding ``settings`` (listening on ``port``),
    ``key`` in ``PDCTL_API_KEY``; ``extra``: more arguments; ``tree``: another checkout's pdctl."""
    path = Path(log_dir) / f"{name}.settings.json"
    path.write_text(json.dumps(settings, indent=2))
    env = {"PDCTL_API_KEY": key, **({"PYTHONPATH": tree} if tree else {})}
    argv = [PY, "-m", "pdctl", "gateway", "-s", str(path), *extra]
    return start(name, argv, port, log_dir, env=env, ready_path="/ready", cwd=tree or str(ROOT))


def run_pdctl_bench(flags: Sequence[str], key: str, out: Path, timeout_s: float) -> dict[str, Any]:
    """``pdctl bench FLAGS -o OUT`` with ``key`` in ``PDCTL_API_KEY``: its (first) run's JSON; raises with the
    output's tail when it fails."""
    argv = [PY, "-m", "pdctl", "bench", *flags, "-o", str(out)]
    env = dict(os.environ, PDCTL_API_KEY=key)
    done = subprocess.run(argv, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pdctl bench exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    runs = json.loads(out.read_text())
    return runs[0] if isinstance(runs, list) else runs


@contextlib.contextmanager
def stopping() -> Iterator[list[Proc]]:
    """A list for the processes started inside; leaving stops them, the last started first."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def write_report(out: str, module: str, argv: Sequence[str] | None, started: float, fields: Mapping[str, Any]) -> Path:
    """``fields`` as JSON at ``out``, after the run's start (``started``: epoch seconds) and command."""
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "command": " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])]),
        **fields,
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


# -------------------------------------------------------------------------------------------- load client


class _Call:
    """One HTTP exchange on a connection."""

    __slots__ = ("body", "done", "events", "first_at", "keep", "status", "stream", "tail")

    def __init__(self, done: asyncio.Future[None], stream: bool) -> None:
        self.done = done
        self.stream = stream
        self.status = 0
        self.first_at = 0.0
        self.events = 0
        self.tail = b""
        self.body: list[bytes] = []
        self.keep = True


class Counter:
    """Chunks received by all connections (read by the runner at window edges)."""

    __slots__ = ("chunks",)

    def __init__(self) -> None:
        self.chunks = 0


class _Conn(asyncio.Protocol):
    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.call: _Call | None = None
        self.lost = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.call is not None and not self.call.done.done():
                self.call.done.set_exception(ConnectionError(f"bad HTTP: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.call is not None and not self.call.done.done():
            self.call.done.set_exception(ConnectionError("connection lost"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        if self.call is not None:
            self.call.status = self.parser.get_status_code()
            self.call.keep = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        call = self.call
        if call is None:
            return
        if not call.stream or call.status != 200:
            call.body.append(body)
            return
        buf = call.tail + body
        n = buf.count(b"data:") - call.tail.count(b"data:")
        if n:
            if not call.first_at:
                call.first_at = time.perf_counter()
            call.events += n
            self.counter.chunks += n
        call.tail = buf[-16:]

    def on_message_complete(self) -> None:
        call = self.call
        if call is not None and not call.done.done():
            call.done.set_result(None)


@dataclass
class Result:
    """One request as the client saw it."""

    start: float
    ttft_s: float
    end: float
    chunks: int
    ok: bool
    error: str = ""


#: A connection idle this long is not reused: below uvicorn's 5 s keep-alive (the simulator's and vLLM's), so no
#: POST goes out on a connection the worker is closing (at 1,024 slow-paced streams direct-pd's prefill connections
#: idle for a whole decode, and lost requests to that race).
IDLE_S = 4.0


class Client:
    """Keep-alive connections to one host; ``request`` sends one POST and waits for the whole answer."""

    def __init__(self, port: int, counter: Counter, api_key: str = KEY) -> None:
        self.port = port
        self.counter = counter
        self._head = f"Host: 127.0.0.1:{port}\r\nAuthorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
        self._idle: list[_Conn] = []

    async def _conn(self) -> _Conn:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._idle:
            c = self._idle.pop()
            if not c.lost and now - c.idle_since < IDLE_S:
                return c
            if c.transport is not None:
                c.transport.close()
        _, proto = await loop.create_connection(lambda: _Conn(self.counter), "127.0.0.1", self.port)
        return proto

    async def request(self, path: str, body: bytes, stream: bool) -> _Call:
        conn = await self._conn()
        call = _Call(asyncio.get_running_loop().create_future(), stream)
        conn.call = call
        assert conn.transport is not None
        conn.transport.write(f"POST {path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            await call.done
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise
        conn.call = None
        if call.keep and not conn.lost:
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()
        return call

    def close(self) -> None:
        for c in self._idle:
            if c.transport is not None:
                c.transport.close()
        self._idle.clear()


def completion_body(prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                            "ignore_eos": True}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class Target:
    """Where a stream's requests go: one endpoint (a proxy or a worker), or the client runs both PD legs."""

    def __init__(self, port: int, counter: Counter, *, pd_prefill_port: int | None = None) -> None:
        self.main = Client(port, counter)
        self.prefill = Client(pd_prefill_port, counter) if pd_prefill_port else None

    async def run(self, body: dict[str, Any]) -> Result:
        t0 = time.perf_counter()
        try:
            dbody = body
            if self.prefill is not None:
                # The protocol's minimum: the client itself runs leg 1 and leg 2 (no proxy at all).
                from pdctl.vllm.protocol import build_decode_body, build_prefill_body

                leg = await self.prefill.request(
                    "/v1/completions", json.dumps(build_prefill_body(body)).encode(), stream=False
                )
                if leg.status != 200:
                    return Result(t0, 0.0, time.perf_counter(), 0, False, f"prefill HTTP {leg.status}")
                reply = json.loads(b"".join(leg.body))
                dbody = build_decode_body(body, reply.get("kv_transfer_params"))
            call = await self.main.request("/v1/completions", json.dumps(dbody).encode(), stream=True)
        except (ConnectionError, OSError) as exc:
            return Result(t0, 0.0, time.perf_counter(), 0, False, str(exc))
        end = time.perf_counter()
        if call.status != 200:
            msg = b"".join(call.body)[:200].decode(errors="replace")
            return Result(t0, 0.0, end, 0, False, f"HTTP {call.status}: {msg}")
        ok = call.first_at > 0 and b"[DONE]" in call.tail + b"".join(call.body[-1:])
        # [DONE] is not a chunk; usage is (one per request with include_usage).
        return Result(t0, call.first_at - t0 if call.first_at else 0.0, end, max(0, call.events - 1), ok)

    def close(self) -> None:
        self.main.close()
        if self.prefill is not None:
            self.prefill.close()


@dataclass
class Window:
    """What one closed-loop run measured inside its measurement window."""

    streams: int
    seconds: float
    chunks: int
    results: list[Result] = field(default_factory=list)
    proxy_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    errors: int = 0
    first_error: str = ""

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.seconds if self.seconds > 0 else 0.0

    def ttfts_ms(self) -> list[float]:
        return [r.ttft_s * 1000 for r in self.results if r.ok]

    def tpots_ms(self) -> list[float]:
        """Per request: the time from its first chunk to its end over the chunks after the first (what a client
        sees as time per output token when each token is one chunk)."""
        return [(r.end - r.start - r.ttft_s) * 1000 / (r.chunks - 1) for r in self.results if r.ok and r.chunks > 1]


async def closed_loop(
    target: Target,
    streams: int,
    *,
    warmup_s: float,
    measure_s: float,
    tokens: tuple[int, int],
    prompt_words: int,
    seed: int,
    cpu_probe: Callable[[], float] | None = None,
) -> Window:
    """``streams`` concurrent streams back to back; results of requests started inside the window."""
    counter = target.main.counter
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    me = psutil.Process()
    loop_start = time.perf_counter()
    t_measure = loop_start + warmup_s
    t_end = t_measure + measure_s
    results: list[Result] = []
    errors: list[str] = []

    async def stream(i: int) -> None:
        r = random.Random(seed * 1000 + i)
        while time.perf_counter() < t_end:
            n = r.randint(*tokens)
            prompt = " ".join(r.choice(words) for _ in range(prompt_words))
            res = await target.run(completion_body(prompt, n))
            if res.start >= t_measure and res.end <= t_end:
                results.append(res)
            if not res.ok:
                errors.append(res.error)
                await asyncio.sleep(0.05)

    del rng
    tasks = [asyncio.ensure_future(stream(i)) for i in range(streams)]
    await asyncio.sleep(max(0.0, t_measure - time.perf_counter()))
    c0, cpu0, me0 = counter.chunks, cpu_probe() if cpu_probe else 0.0, sum(me.cpu_times()[:2])
    w0 = time.perf_counter()
    await asyncio.sleep(max(0.0, t_end - time.perf_counter()))
    c1, cpu1, me1 = counter.chunks, cpu_probe() if cpu_probe else 0.0, sum(me.cpu_times()[:2])
    w1 = time.perf_counter()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    target.close()
    return Window(streams, w1 - w0, c1 - c0, results, cpu1 - cpu0, me1 - me0, len(errors), errors[0] if errors else "")


def run_loop(coro: Any) -> Any:
    """Run on uvloop (the client's own per-chunk cost is lowest there)."""
    import uvloop

    return uvloop.run(coro)


# --------------------------------------------------------------------------------------------- statistics


def machine() -> dict[str, Any]:
    """nproc, CPU model, load averages, Python and the kernel."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "kernel": platform.release(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def pct(xs: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (linear interpolation); NaN when there is no sample."""
    return percentile(xs, p, empty=float("nan"))


def fmt(x: float | None, nd: int = 2, *, grouped: bool = False) -> str:
    """``x`` with ``nd`` decimals (``grouped``: thousands separated), ``-`` for none or NaN."""
    if x is None or x != x:
        return "-"
    return f"{x:,.{nd}f}" if grouped else f"{x:.{nd}f}"


def pct_cell(x: float | None) -> str:
    """A share as a whole percentage, ``-`` for none."""
    return "-" if x is None else f"{100 * x:.0f} %"


def md_table(columns: Sequence[str], align: str, rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table's lines: ``columns`` the heads, ``align`` one of ``l``/``r`` per column, each row its cells."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


class TraceSink:
    """An OTLP/HTTP traces receiver that accepts and drops every export (for the tracing-on arm): 200, no parsing."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sink = self
        self.posts = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                sink.posts += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
