"""The gateway's server process (:mod:`pdctl.gateway.server`): what it sets up once it serves."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

import httpx
import pytest

from pdctl.gateway.app import create_app
from pdctl.gateway.direct import HttpProtocol
from pdctl.gateway.server import GC_YOUNG_THRESHOLD, configure_logging, make_server
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


def test_the_gateways_server_runs_the_protocol_that_tells_a_request_of_a_disconnect() -> None:
    app = create_app(make_settings(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]), KEY)
    assert make_server(app, "127.0.0.1", free_port()).config.http_protocol_class is HttpProtocol


def test_log_lines_carry_their_own_second_and_the_pid_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """The time of day is formatted once a second, each line still with its own second; with several processes
    each line names its pid. The logging module's switches are put back after (they are the process's)."""
    saved = (logging._srcfile, logging.logThreads, logging.logProcesses, logging.logMultiprocessing)  # type: ignore[attr-defined]
    log = logging.getLogger("pdctl.gateway")
    handlers, level, propagate = log.handlers[:], log.level, log.propagate
    try:
        for with_pid in (False, True):
            configure_logging("info", with_pid=with_pid)
            for created in (1_000.1, 1_000.9, 1_001.2):
                record = log.makeRecord(log.name, logging.INFO, __file__, 1, "at %s", (created,), None)
                record.created = created
                log.handle(record)
        lines = capsys.readouterr().out.splitlines()
    finally:
        logging._srcfile, logging.logThreads, logging.logProcesses, logging.logMultiprocessing = saved  # type: ignore[attr-defined]
        log.handlers[:], log.level, log.propagate = handlers, level, propagate
    stamp = [time.strftime("%H:%M:%S", time.localtime(t)) for t in (1_000.1, 1_000.9, 1_001.2)]
    assert lines[:3] == [f"{stamp[i]} INFO pdctl.gateway at {t}" for i, t in enumerate((1_000.1, 1_000.9, 1_001.2))]
    assert lines[3:] == [
        f"{stamp[i]} INFO pdctl.gateway[{os.getpid()}] at {t}" for i, t in enumerate((1_000.1, 1_000.9, 1_001.2))
    ]
