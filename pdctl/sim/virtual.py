"""Run simulator engines on a virtual clock: timers fire at once and the clock jumps, so a minute of simulated
GPU time runs in seconds of CPU and the numbers do not depend on how busy the machine is.

``VirtualClockLoop`` is an asyncio selector loop whose ``time()`` is virtual. When the loop would block
waiting for its next timer, it first polls real I/O briefly (the KV side channel is a real loopback TCP
connection) and, if nothing arrived, advances the clock to the timer instead of sleeping. Peers must run in
the same loop (e.g. a prefill and a decode engine in one process): their loopback writes are in the kernel
before the loop polls, so a zero-timeout poll sees them.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["VirtualClockLoop", "run_virtual"]

T = TypeVar("T")


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock only moves when every task is waiting for a timer."""

    def __init__(self) -> None:
        self._virtual_now = 0.0
        super().__init__(selectors.DefaultSelector())
        real_select = self._selector.select  # type: ignore[attr-defined]

        def select(timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
            events: list[tuple[selectors.SelectorKey, int]] = real_select(0)
            if events or (timeout is not None and timeout <= 0):
                return events
            if timeout is None:
                waited: list[tuple[selectors.SelectorKey, int]] = real_select(None)  # nothing scheduled: real I/O
                return waited
            self._virtual_now += timeout
            return []

        self._selector.select = select  # type: ignore[attr-defined]

    def time(self) -> float:
        """The virtual clock (seconds since the loop was created)."""
        return self._virtual_now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh ``VirtualClockLoop``."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
