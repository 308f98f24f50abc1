"""An ASGI client's ``receive`` for driving the gateway app in-process (tests, benchmarks/gateway_cpu.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["one_body"]


def one_body(raw: bytes, gone: asyncio.Event) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A ``receive`` that hands over ``raw`` as the whole request body, then reports a disconnect once ``gone`` is
    set (the client left, or the test is done with the response)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive
