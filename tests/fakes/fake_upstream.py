"""A fake OpenAI-compatible upstream API (for the gateway's upstream-channel tests).

Run: python tests/fakes/fake_upstream.py --port 0 --spec '{"script": [...], ...}'; prints ``PORT <n>``.
Spec: ``prefix`` (path prefix, default "/v1"), ``models`` (ids for GET {prefix}/models), ``key`` (the
expected bearer key; others get 401), ``script``: a list of answers used one per completion request (the
last one repeats), each ``{"status": 200|429|503|..., "retry_after": "7", "delay": s, "reset": true}``;
``chunks`` (stream events). GET /_log returns the requests seen (path, headers, body).
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _http import Request, Response, chunk_event, completion_body, main

SPEC: dict[str, Any] = {}
LOG: list[dict[str, Any]] = []


async def handler(req: Request, res: Response) -> None:
    prefix = SPEC.get("prefix", "/v1")
    if req.path == "/_log":
        await res.json(200, LOG)
        return
    LOG.append({"path": req.path, "headers": dict(req.headers), "body": req.json() if req.body else None})
    if SPEC.get("key") and req.headers.get("authorization") != f"Bearer {SPEC['key']}":
        await res.json(
            401,
            {
                "error": {
                    "message": "Incorrect API key provided: " + req.headers.get("authorization", "")[7:],
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
            },
        )
        return
    if req.path == f"{prefix}/models":
        await res.json(
            200,
            {
                "object": "list",
                "data": [{"id": m, "object": "model", "owned_by": "up"} for m in SPEC.get("models", [])],
            },
        )
        return
    if req.path not in (f"{prefix}/chat/completions", f"{prefix}/completions"):
        await res.json(404, {"error": {"message": f"no route {req.path}", "type": "invalid_request_error"}})
        return
    script = SPEC.get("script") or [{"status": 200}]
    n = sum(1 for e in LOG if e["path"] == req.path) - 1
    step = script[min(n, len(script) - 1)]
    if step.get("delay"):
        await asyncio.sleep(step["delay"])
    if step.get("reset"):
        res.reset()
        return
    status = step.get("status", 200)
    if status != 200:
        headers = {"retry-after": str(step["retry_after"])} if "retry_after" in step else None
        await res.json(status, {"error": {"message": f"scripted {status}", "type": "x", "code": None}}, headers)
        return
    body = req.json()
    chat = req.path.endswith("chat/completions")
    count = int(SPEC.get("chunks", 3))
    if not body.get("stream"):
        await res.json(200, completion_body("up-1", body.get("model"), chat, "up " * count, "stop", 3, count))
        return
    await res.start_stream()
    for i in range(count):
        await res.chunk(chunk_event("up-1", body.get("model"), chat, "up ", "stop" if i == count - 1 else None))
    await res.chunk(b"data: [DONE]\n\n")
    await res.end_stream()


if __name__ == "__main__":
    main(handler, SPEC)
