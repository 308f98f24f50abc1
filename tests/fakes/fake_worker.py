"""A stand-in for a vLLM worker: stdlib only, started by tests through the real process/supervisor code.

Serves /health, /v1/models, /v1/completions, /v1/chat/completions (SSE when "stream": true) and /metrics,
and misbehaves on request:

  --startup-delay S      sleep before listening (a slow engine load)
  --exit-after S         exit with --exit-code after S seconds, before listening (a crash at start)
  --exit-code N          the exit code used by --exit-after / --crash-after-ready (default 1)
  --ignore-sigterm       ignore SIGTERM (only SIGKILL stops it)
  --spawn-grandchild     start a sleeping grandchild (like vLLM's EngineCore); it leaves the group
                         with --grandchild-new-session so only a descendant sweep can find it
  --print-lines N        print N numbered lines at start
  --crash-after-ready S  exit with --exit-code S seconds after it starts answering
  --fail-line TEXT       print TEXT (e.g. a vLLM error line) just before exiting
  --crash-once-file PATH --crash-after-ready applies only to the first start (PATH records it)
  --prefill              answer like a prefill: kv_transfer_params in replies when asked for them
  --fail-kv N            answer the first N requests carrying kv_transfer_params with HTTP 500
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COUNTS = {"requests": 0, "kv_requests": 0}
LOCK = threading.Lock()


def log(msg: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    # One write per line: print() writes the text and its newline apart, and two threads' lines then interleave.
    sys.stdout.write(f"(APIServer pid={os.getpid()}) INFO {stamp} [fake_worker.py:1] {msg}\n")
    sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    args: argparse.Namespace

    def log_message(self, format: str, *a: Any) -> None:
        log(f'{self.address_string()} "{self.requestline}" {a[1] if len(a) > 1 else ""}')

    def _json(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.args.model, "object": "model"}]})
        elif self.path == "/metrics":
            running = int(bool(self.args.busy_file) and os.path.exists(self.args.busy_file))
            body = f"vllm:num_requests_running {running}\nfake_requests_total {COUNTS['requests']}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        rid = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        kv = body.get("kv_transfer_params")
        with LOCK:
            COUNTS["requests"] += 1
            if kv is not None:
                COUNTS["kv_requests"] += 1
            n_kv = COUNTS["kv_requests"]
        log(f"Received request {rid}: kv_transfer_params={json.dumps(kv)}")
        if kv is not None and n_kv <= self.args.fail_kv:
            log(f"NIXL transfer failure: handshake_setup_failed | Context: {{'request_id': '{rid}'}}")
            self._json(500, {"error": {"message": "KV load failure", "code": 500}})
            return
        chat = self.path.endswith("/chat/completions")
        out_kv = None
        if self.args.prefill and kv is not None and kv.get("do_remote_decode"):
            out_kv = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2]],
                "remote_engine_id": self.args.engine_id,
                "remote_request_id": f"cmpl-{rid}-0-00000000",
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
            }
        text = "hello"
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for tok in ("hel", "lo"):
                delta = {"delta": {"content": tok}} if chat else {"text": tok}
                chunk = {"id": f"cmpl-{rid}", "choices": [{"index": 0, **delta}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            return
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        self._json(
            200,
            {
                "id": f"cmpl-{rid}",
                "object": "chat.completion" if chat else "text_completion",
                "model": self.args.model,
                "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                "kv_transfer_params": out_kv,
            },
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="fake")
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--exit-after", type=float, default=None)
    p.add_argument("--exit-code", type=int, default=1)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--spawn-grandchild", action="store_true")
    p.add_argument("--grandchild-new-session", action="store_true")
    p.add_argument("--print-lines", type=int, default=0)
    p.add_argument("--crash-after-ready", type=float, default=None)
    p.add_argument("--fail-line", default=None)
    p.add_argument("--crash-once-file", default=None)
    # Print this line and never serve, as vLLM after its NIXL listener died; with --crash-once-file only on the
    # run after the crash.
    p.add_argument("--hang-line", default=None)
    p.add_argument("--prefill", action="store_true")
    p.add_argument("--fail-kv", type=int, default=0)
    p.add_argument("--engine-id", default=str(uuid.uuid4()))
    # A thread that keeps a core busy while the worker is idle, as NIXL's UCX progress thread does in vLLM CPU.
    p.add_argument("--spin-thread", action="store_true")
    # While this file exists, /metrics reports one request running and the main thread runs, as a forward pass does.
    p.add_argument("--busy-file", default=None)
    args, _unknown = p.parse_known_args()

    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log(f"fake worker starting on port {args.port}")
    for i in range(args.print_lines):
        print(f"line {i} [bold]not markup[/bold]", flush=True)
    if args.spawn_grandchild:
        gc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
            ],
            start_new_session=args.grandchild_new_session,
        )
        log(f"spawned grandchild pid={gc.pid}")
    if args.exit_after is not None:
        time.sleep(args.exit_after)
        if args.fail_line:
            print(args.fail_line, flush=True)
        sys.exit(args.exit_code)
    time.sleep(args.startup_delay)
    if args.hang_line and (args.crash_once_file is None or os.path.exists(args.crash_once_file)):
        print(args.hang_line, flush=True)
        time.sleep(3600)
    if args.spin_thread:

        def spin() -> None:
            log(f"spin thread tid={threading.get_native_id()}")
            block = bytes(4 << 20)
            while True:  # hashing releases the GIL, as NIXL's native thread holds none: the others run unhindered
                hashlib.sha256(block)

        threading.Thread(target=spin, name="spin", daemon=True).start()
    Handler.args = args
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    log(f"Started server process on http://{args.host}:{args.port}")
    if args.crash_once_file is not None and not os.path.exists(args.crash_once_file):
        open(args.crash_once_file, "w").close()
    elif args.crash_once_file is not None:
        args.crash_after_ready = None
    if args.crash_after_ready is not None:

        def crash() -> None:
            time.sleep(args.crash_after_ready)
            if args.fail_line:
                print(args.fail_line, flush=True)
            log("crashing on purpose")
            os._exit(args.exit_code)

        threading.Thread(target=crash, daemon=True).start()
    if args.busy_file:
        # vLLM's worker runs its forward pass on its main thread: so does this one, its server on another.
        threading.Thread(target=server.serve_forever, daemon=True).start()
        while True:
            if os.path.exists(args.busy_file):
                sum(range(100_000))
            else:
                time.sleep(0.1)
    server.serve_forever()


if __name__ == "__main__":
    main()
