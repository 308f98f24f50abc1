"""A fake vLLM worker speaking the PD protocol, scriptable to misbehave (for the gateway's tests).

Run: python tests/fakes/fake_pd_worker.py --port 0 --spec '{"role": "prefill", ...}'; it prints
``PORT <n>`` when listening. Spec keys (all optional):

model, max_model_len, kv ("good" | "missing" | "partial"), chunks (stream events), chunk_delay (s),
delay (s before answering), fail_first (answer fail_status to the first N completions), fail_status,
reset_first (reset the connection of the first N completions), die_after (exit the process after N
stream chunks), stall_after (stop sending after N chunks), lease_s (prefill blocks expiry),
exit_after_replies (prefill: exit the process once N leg-1 replies went out), pull_fail_status (decode:
answer this status when the KV pull from the prefill fails, as vLLM's decode answers 500 when NIXL's
transfer from a dead prefill fails).

Introspection: GET /_log (requests seen: path, headers, body, aborted), GET /metrics
(``held_blocks``, ``num_requests_running``), POST /_control (merge JSON into the spec).
Decode "pulls" KV by POSTing ``/_pull`` to ``remote_host:remote_port`` (the prefill's HTTP port here),
which frees the prefill's held blocks, like NIXL's read notification.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx
from _http import Request, Response, chunk_event, completion_body, main

SPEC: dict[str, Any] = {}
LOG: list[dict[str, Any]] = []
HELD: dict[str, float] = {}
STATE = {"completions": 0, "running": 0, "port": 0}
CLIENT: dict[str, httpx.AsyncClient] = {}


def _record(req: Request) -> dict[str, Any]:
    entry = {
        "path": req.path,
        "headers": dict(req.headers),
        "body": req.json() if req.body else None,
        "aborted": False,
        "t": time.time(),
        "finished": False,
    }
    LOG.append(entry)
    return entry


def _expire() -> None:
    now = time.monotonic()
    for k, until in list(HELD.items()):
        if until <= now:
            del HELD[k]


async def handler(req: Request, res: Response) -> None:
    if req.path == "/health":
        await res.json(200, {})
    elif req.path == "/v1/models":
        await res.json(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": SPEC.get("model", "tiny"),
                        "object": "model",
                        "max_model_len": SPEC.get("max_model_len", 2048),
                    }
                ],
            },
        )
    elif req.path == "/metrics":
        _expire()
        text = f"held_blocks {len(HELD)}\nnum_requests_running {STATE['running']}\n"
        await res.send(200, text.encode(), "text/plain")
    elif req.path == "/_log":
        await res.json(200, LOG)
    elif req.path == "/_control":
        SPEC.update(req.json())
        await res.json(200, SPEC)
    elif req.path == "/_pull":
        HELD.pop(req.json()["remote_request_id"], None)
        await res.json(200, {})
    elif req.path in ("/v1/completions", "/v1/chat/completions"):
        await completion(req, res)
    else:
        await res.json(404, {"error": "not found"})


async def completion(req: Request, res: Response) -> None:
    entry = _record(req)
    STATE["completions"] += 1
    n = STATE["completions"]
    body = req.json()
    if n <= SPEC.get("reset_first", 0):
        res.reset()
        return
    if n <= SPEC.get("fail_first", 0):
        await res.json(SPEC.get("fail_status", 500), {"error": {"message": "scripted failure", "code": 500}})
        return
    STATE["running"] += 1
    try:
        await _answer(req, res, body, entry)
    finally:
        STATE["running"] -= 1


async def _wait_or_abort(req: Request, seconds: float) -> bool:
    """Sleep; True if the client went away meanwhile."""
    try:
        await asyncio.wait_for(req.aborted.wait(), timeout=seconds)
        return True
    except TimeoutError:
        return False


async def _answer(req: Request, res: Response, body: dict[str, Any], entry: dict[str, Any]) -> None:
    chat = req.path.endswith("chat/completions")
    rid = req.headers.get("x-request-id", uuid.uuid4().hex)
    kvp = body.get("kv_transfer_params") or {}
    if SPEC.get("delay") and await _wait_or_abort(req, SPEC["delay"]):
        entry["aborted"] = True
        return
    if kvp.get("do_remote_decode"):
        mode = SPEC.get("kv", "good")
        params: dict[str, Any] | None = None
        if mode != "missing":
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2]],
                "remote_engine_id": "fake-engine",
                "remote_request_id": f"cmpl-{rid}-0",
                "remote_host": "127.0.0.1",
                "remote_port": STATE["port"],
                "tp_size": 1,
            }
            if mode == "partial":
                del params["remote_block_ids"]
            HELD[params["remote_request_id"]] = time.monotonic() + SPEC.get("lease_s", 30.0)
        reply = {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
            "kv_transfer_params": params,
        }
        entry["finished"] = True
        await res.json(200, reply)
        STATE["replies"] = STATE.get("replies", 0) + 1
        if SPEC.get("exit_after_replies") and STATE["replies"] >= SPEC["exit_after_replies"]:
            asyncio.get_running_loop().call_later(0.05, os._exit, 3)
        return
    if kvp.get("remote_request_id"):
        try:
            if "client" not in CLIENT:
                CLIENT["client"] = httpx.AsyncClient()
            c = CLIENT["client"]
            await c.post(
                f"http://{kvp['remote_host']}:{kvp['remote_port']}/_pull",
                json={"remote_request_id": kvp["remote_request_id"]},
                timeout=5,
            )
        except httpx.HTTPError:
            if SPEC.get("pull_fail_status"):
                await res.json(SPEC["pull_fail_status"], {"error": {"message": "KV transfer failed", "code": 500}})
                return
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
    count = min(int(SPEC.get("chunks", 5)), int(max_tokens))
    delay = float(SPEC.get("chunk_delay", 0.0))
    oid = f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"
    if not body.get("stream"):
        if delay and await _wait_or_abort(req, delay * count):
            entry["aborted"] = True
            return
        entry["finished"] = True
        await res.json(200, completion_body(oid, body.get("model"), chat, "tok " * count, "length", 7, count))
        return
    await res.start_stream()
    try:
        for i in range(count):
            if SPEC.get("die_after") is not None and i >= SPEC["die_after"]:
                os._exit(3)
            if SPEC.get("stall_after") is not None and i >= SPEC["stall_after"]:
                await req.aborted.wait()
                entry["aborted"] = True
                return
            finish = "length" if i == count - 1 else None
            await res.chunk(chunk_event(oid, body.get("model"), chat, "tok ", finish))
            if delay and await _wait_or_abort(req, delay):
                entry["aborted"] = True
                return
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "id": oid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "choices": [],
                "usage": {"prompt_tokens": 7, "completion_tokens": count, "total_tokens": 7 + count},
            }
            await res.chunk(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await res.chunk(b"data: [DONE]\n\n")
        await res.end_stream()
        entry["finished"] = True
    except ConnectionError:
        entry["aborted"] = True


if __name__ == "__main__":
    main(handler, SPEC, lambda port: STATE.update(port=port))
