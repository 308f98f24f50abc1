"""A FastAPI + httpx PD proxy in the shape of vLLM's ``toy_proxy_server.py`` (the peer to beat).

vllm-project/vllm:tests/v1/kv_connector/nixl_integration/toy_proxy_server.py: a FastAPI ``lifespan`` opens
one ``httpx.AsyncClient(base_url=..., timeout=None)`` per prefill and decode instance, instances are
picked round-robin, leg 1 forces ``max_tokens=1, stream=False`` and returns ``kv_transfer_params``, then
decode's answer is streamed back with ``StreamingResponse`` over ``aiter_bytes()``. Runs in its own venv
(fastapi, uvicorn[standard], httpx) without pdctl; ``gateway_overhead.py`` starts it.

    python benchmarks/toy_proxy.py --port P --prefiller-url URL --decoder-url URL
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

ARGS: argparse.Namespace


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.prefill = [httpx.AsyncClient(timeout=None, base_url=u) for u in ARGS.prefiller_url]
    app.state.decode = [httpx.AsyncClient(timeout=None, base_url=u) for u in ARGS.decoder_url]
    app.state.p_rr = itertools.cycle(app.state.prefill)
    app.state.d_rr = itertools.cycle(app.state.decode)
    yield
    for c in app.state.prefill + app.state.decode:
        await c.aclose()


app = FastAPI(lifespan=lifespan)


async def send_request_to_service(client: httpx.AsyncClient, endpoint: str, req_data: dict[str, Any]) -> Any:
    req_data = req_data.copy()
    req_data["kv_transfer_params"] = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip
    req_data["stream"] = False
    req_data["max_tokens"] = 1
    if "max_completion_tokens" in req_data:
        req_data["max_completion_tokens"] = 1
    req_data.pop("stream_options", None)
    response = await client.post(endpoint, json=req_data)
    response.raise_for_status()
    return response


async def stream_service_response(client: httpx.AsyncClient, endpoint: str, req_data: dict[str, Any]) -> Any:
    async with client.stream("POST", endpoint, json=req_data) as response:
        response.raise_for_status()
        async for chunk in response.aiter_bytes():
            yield chunk


async def _handle(request: Request, api: str) -> Any:
    req_data = await request.json()
    prefill_client = next(app.state.p_rr)
    response = await send_request_to_service(prefill_client, api, req_data)
    response_json = response.json()
    kv_transfer_params = response_json.get("kv_transfer_params", {})
    if kv_transfer_params:
        req_data["kv_transfer_params"] = kv_transfer_params
    decode_client = next(app.state.d_rr)

    async def generate_stream() -> AsyncIterator[bytes]:
        async for chunk in stream_service_response(decode_client, api, req_data):
            yield chunk

    return StreamingResponse(generate_stream(), media_type="application/json")


@app.post("/v1/completions")
async def handle_completions(request: Request) -> Any:
    return await _handle(request, "/v1/completions")


@app.post("/v1/chat/completions")
async def handle_chat_completions(request: Request) -> Any:
    return await _handle(request, "/v1/chat/completions")


@app.get("/health")
async def health() -> Any:
    return JSONResponse({"status": "ok"})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--prefiller-url", nargs="+", required=True)
    ap.add_argument("--decoder-url", nargs="+", required=True)
    ARGS = ap.parse_args()
    uvicorn.run(app, host=ARGS.host, port=ARGS.port, log_level="warning")
