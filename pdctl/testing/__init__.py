"""Helpers for pdctl's tests and benchmarks: real processes, no mocks.

* ``ports``  -- :func:`free_port` (never the same twice), :func:`port_free`
* ``procs``  -- :func:`wait_until_ready` (GET a URL until 200), :func:`stop_group` (SIGTERM, grace, SIGKILL),
  :func:`kill_groups` (teardown), :func:`alive`
* ``sim``    -- :func:`start_sim`: a simulated vLLM worker (``python -m pdctl.sim``) on free ports, as a
  :class:`SimProcess`
"""

from __future__ import annotations

from pdctl.testing.ports import free_port, port_free
from pdctl.testing.procs import alive, kill_groups, stop_group, wait_until_ready
from pdctl.testing.sim import SimProcess, start_sim

__all__ = [
    "SimProcess",
    "alive",
    "free_port",
    "kill_groups",
    "port_free",
    "start_sim",
    "stop_group",
    "wait_until_ready",
]
