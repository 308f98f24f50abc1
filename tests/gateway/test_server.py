"""The gateway's server process (:mod:`pdctl.gateway.server`): what it sets up once it serves."""

from __future__ import annotations

import asyncio
import gc

import httpx

from pdctl.gateway.app import create_app
from pdctl.gateway.server import GC_YOUNG_THRESHOLD, make_server
from pdctl.testing import free_port
from tests.fakes.gateway_harness import KEY, make_settings


def test_a_started_gateway_froze_its_startup_heap_and_collects_young_objects_less_often() -> None:
    before = gc.get_threshold()
    gc.unfreeze()
    port = free_port()
    # Workers that refuse connections: the models are known, so the gateway listens without them.
    app = create_app(make_settings(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]), KEY)
    server = make_server(app, "127.0.0.1", port)
    seen: dict[str, object] = {}

    async def go() -> None:
        task = asyncio.ensure_future(server.serve())
        try:
            while not server.started:
                assert not task.done(), "the server stopped before it started"
                await asyncio.sleep(0.01)
            seen["frozen"] = gc.get_freeze_count()
            seen["threshold"] = gc.get_threshold()
            async with httpx.AsyncClient() as client:
                seen["health"] = (await client.get(f"http://127.0.0.1:{port}/health")).status_code
        finally:
            server.should_exit = True
            await task

    try:
        asyncio.run(go())
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert seen["health"] == 200
    assert isinstance(seen["frozen"], int) and seen["frozen"] > 10_000  # the app, its settings, uvicorn, pdctl
    assert seen["threshold"] == (GC_YOUNG_THRESHOLD, *before[1:])
    assert GC_YOUNG_THRESHOLD > before[0]
