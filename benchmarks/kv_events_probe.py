"""Real vLLM CPU: record the KV cache events one engine publishes over ZMQ, and the token ids its answers carry.

One engine (prefix caching on, ``--kv-events-config`` with the ZMQ publisher and a replay endpoint, all on
127.0.0.1, its own process group, core 0) and a SUB socket that is listening before the first request. Steps:

a. ``/v1/completions``, a prompt of about 300 tokens (two full 128-token blocks and a partial one),
   ``return_token_ids``, not streamed;
b. the same prompt again, streamed (a prefix hit: does it publish anything?);
c. ``/v1/chat/completions`` with another text of about 300 tokens, ``return_token_ids``, streamed;
d. the same chat again, not streamed (a prefix hit);
e. a's prompt extended to about 420 tokens (a hit on a's two blocks, a third block stored: its parent hash);
f. ``POST /reset_prefix_cache`` (served only with ``VLLM_SERVER_DEV_MODE=1``, which the probe sets);
g. a's prompt once more (the engine publishes only after a model step: the reset's event comes with this one);
h. a replay request on the ROUTER socket from sequence 0.

After each step the probe waits until the events have been quiet for ``--quiet-s`` and labels what arrived
with that step. Written to ``--out``:

- ``kv-events.jsonl``: every multipart message from the PUB socket, one a line: the step, the number of
  frames, the topic, seq (the 8-byte big-endian frame as an int and as hex) and the payload (base64);
- ``kv-replay.jsonl``: the replay socket's answer, the same shape (its last message is the end marker);
- ``responses.json``: each request's body and answer (JSON, or a streamed answer's SSE ``data:`` lines);
- ``engine.json``: the engine's command line, the environment the probe added, the vLLM version, the date;
- ``engine.log``: the engine's output (not a fixture: large).

Needs vLLM CPU in .venv; the tiny model is generated into a temporary folder unless ``--model`` names one.
Takes a few minutes on the 2-core machine; run it under ``flock /tmp/pdctl-real.lock`` beside other real work.

    .venv/bin/python -m benchmarks.kv_events_probe --out /tmp/kv-probe
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import json
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import zmq

from benchmarks import _harness as H
from pdctl.testing import free_port, stop_group
from pdctl.vllm.sse import sse_events
from pdctl.vllm.tiny_model import generate_tiny_model

TOPIC = "kv"
SERVED = "tiny"
# Two texts of different words, so the completion's and the chat's blocks share nothing.
_TEXT_A = (
    "The quick brown fox jumps over the lazy dog while the river runs past the old mill and the bell rings "
    "twice at noon. "
)
_TEXT_B = (
    "Seven sailors mended the torn sail before the storm, and the lighthouse keeper counted the waves one by "
    "one until dawn. "
)


def _prompt(model: Path, start: str, unit: str, tokens: int) -> str:
    """``start`` extended with ``unit`` until the model's tokenizer counts at least ``tokens`` tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    out = start
    while len(tok.encode(out, add_special_tokens=False).ids) < tokens:
        out += unit
    return out


class Recorder:
    """A SUB socket bound where the engine's PUB connects; a thread records each message with the current step."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.bind(endpoint)
        self.step = "startup"
        self.messages: list[dict[str, Any]] = []
        self.last_at = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            frames = self.sock.recv_multipart()
            with self._lock:
                self.messages.append(_record(self.step, frames, time.time()))
                self.last_at = time.monotonic()

    def settle(self, quiet_s: float, max_s: float) -> None:
        """Wait until nothing has arrived for ``quiet_s`` (at most ``max_s``)."""
        start = time.monotonic()
        while time.monotonic() - start < max_s:
            with self._lock:
                idle = time.monotonic() - max(self.last_at, start)
            if idle >= quiet_s:
                return
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _record(step: str, frames: list[bytes], at: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"step": step, "frames": len(frames), "received_at": round(at, 3)}
    if len(frames) == 3:
        topic, seq, payload = frames
        rec |= {
            "topic": topic.decode("utf-8", "replace"),
            "seq": int.from_bytes(seq, "big", signed=True),
            "seq_hex": seq.hex(),
            "payload_b64": base64.b64encode(payload).decode(),
        }
    else:
        rec["frames_b64"] = [base64.b64encode(f).decode() for f in frames]
    return rec


def _replay(ctx: zmq.Context[Any], endpoint: str, start_seq: int, timeout_s: float) -> list[dict[str, Any]]:
    """Ask the ROUTER socket for everything from ``start_seq``; read until the end marker (seq -1)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[dict[str, Any]] = []
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(500):
                continue
            frames = sock.recv_multipart()
            body = frames[1:] if frames and frames[0] == b"" else frames  # the DEALER's empty delimiter
            rec = _record("replay", body, time.time())
            out.append(rec)
            if rec.get("seq") == -1:
                break
    finally:
        sock.close()
    return out


def _call(client: httpx.Client, base: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
    streamed = bool(body and body.get("stream"))
    t0 = time.monotonic()
    resp = client.post(base + path, json=body) if body is not None else client.post(base + path)
    rec: dict[str, Any] = {"path": path, "request": body, "status": resp.status_code}
    if streamed:
        rec["sse_data"] = sse_events(resp.content)
    else:
        try:
            rec["response"] = resp.json()
        except ValueError:
            rec["response_text"] = resp.text
    rec["elapsed_s"] = round(time.monotonic() - t0, 2)
    return rec


def run(out: Path, model: Path, ready_timeout_s: float, request_timeout_s: float, quiet_s: float) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    http, pub, rep = free_port(), free_port(), free_port()
    pub_ep, rep_ep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub_ep,
        "replay_endpoint": rep_ep,
        "topic": TOPIC,
    }
    argv = [
        H.PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(http), "--max-model-len", "1024", "--dtype", "bfloat16",
        "--gpu-memory-utilization", "0.2", "--enable-prefix-caching",
        "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # serves POST /reset_prefix_cache
    }
    prompt_a = _prompt(model, _TEXT_A, _TEXT_A, 300)
    prompt_b = _prompt(model, _TEXT_B, _TEXT_B, 300)
    prompt_a_ext = _prompt(model, prompt_a, _TEXT_B, 420)  # a's two full blocks and a third
    meta: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "vllm_cpu": importlib.metadata.version("vllm-cpu"),
        "pyzmq": zmq.__version__,
        "argv": [Path(a).name if a == H.PY else a for a in argv],
        "env_added": env,
        "sub_socket": f"SUB bound at {pub_ep} (the engine's PUB connects: the endpoint has no '*'), subscribed to {TOPIC!r}",
        "replay_socket": f"DEALER connected to {rep_ep} (the engine's ROUTER binds)",
        "model": "pdctl model tiny (seed 0)",
    }
    ctx: zmq.Context[Any] = zmq.Context()
    rec = Recorder(ctx, pub_ep)  # listening before the engine starts, so nothing is missed
    proc: H.Proc | None = None
    responses: list[dict[str, Any]] = []
    replay: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        proc = H.start("engine", argv, http, str(out), env=env, ready_timeout_s=ready_timeout_s)
        meta["ready_s"] = round(time.monotonic() - t0, 1)
        rec.settle(quiet_s, 30)
        base = proc.url
        steps: list[tuple[str, str, dict[str, Any] | None]] = [
            ("a_completion", "/v1/completions", {"model": SERVED, "prompt": prompt_a, "max_tokens": 8,
                                                 "temperature": 0, "return_token_ids": True}),
            ("b_completion_again_streamed", "/v1/completions", {"model": SERVED, "prompt": prompt_a, "max_tokens": 8,
                                                                "temperature": 0, "return_token_ids": True,
                                                                "stream": True}),
            ("c_chat_streamed", "/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": prompt_b}],
                                                         "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                                                         "stream": True}),
            ("d_chat_again", "/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": prompt_b}],
                                                      "max_tokens": 8, "temperature": 0, "return_token_ids": True}),
            ("e_completion_extended", "/v1/completions", {"model": SERVED, "prompt": prompt_a_ext, "max_tokens": 8,
                                                          "temperature": 0, "return_token_ids": True}),
            ("f_reset_prefix_cache", "/reset_prefix_cache", None),
            ("g_completion_after_reset", "/v1/completions", {"model": SERVED, "prompt": prompt_a, "max_tokens": 8,
                                                             "temperature": 0, "return_token_ids": True}),
        ]  # fmt: skip
        with httpx.Client(timeout=request_timeout_s) as client:
            for step, path, body in steps:
                rec.step = step
                r = _call(client, base, path, body)
                r["step"] = step
                responses.append(r)
                print(f"{step}: HTTP {r['status']} in {r['elapsed_s']} s", flush=True)
                rec.settle(quiet_s, 30)
        rec.step = "after"
        replay = _replay(ctx, rep_ep, 0, 30)
        rec.settle(quiet_s, 10)
    finally:
        if proc is not None:
            meta["engine_exit"] = stop_group(proc.popen, grace_s=20)  # SIGTERM, then SIGKILL the group
        rec.close()
        ctx.term()
    (out / "kv-events.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rec.messages))
    (out / "kv-replay.jsonl").write_text("".join(json.dumps(m) + "\n" for m in replay))
    (out / "responses.json").write_text("[\n" + ",\n".join(json.dumps(r) for r in responses) + "\n]\n")  # one a line
    (out / "engine.json").write_text(json.dumps(meta, indent=1) + "\n")
    counts: dict[str, int] = {}
    for m in rec.messages:
        counts[m["step"]] = counts.get(m["step"], 0) + 1
    return {"out": str(out), "messages_by_step": counts, "replay_messages": len(replay), **meta}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the recordings")
    ap.add_argument("--model", help="a tiny model folder (default: generated into a temporary folder)")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--quiet-s", type=float, default=3.0, help="no events for this long ends a step")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdctl-kv-probe-") as tmp:
        model = Path(args.model) if args.model else generate_tiny_model(Path(tmp) / "tiny").path
        summary = run(Path(args.out), model, args.ready_timeout_s, args.request_timeout_s, args.quiet_s)
    json.dump(summary, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
