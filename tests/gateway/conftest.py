"""Fixtures shared by the gateway's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fakes.gateway_harness import FakeProc, GatewayThread


@pytest.fixture
def procs() -> Iterator[tuple[list[FakeProc], list[GatewayThread]]]:
    """Lists a test appends its fake workers and in-process gateways to; all stopped after the test."""
    fakes: list[FakeProc] = []
    gws: list[GatewayThread] = []
    yield fakes, gws
    for g in gws:
        g.stop()
    for f in fakes:
        f.kill()
