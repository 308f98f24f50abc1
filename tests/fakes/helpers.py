"""Fake-worker process specs (ports, process groups and cleanup are in :mod:`pdctl.testing`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pdctl.plan import ProcessSpec
from pdctl.testing import free_port

FAKE_WORKER = str(Path(__file__).with_name("fake_worker.py"))


def fake_spec(
    name: str, role: str = "prefill", *args: str, wave: int = 0, port: int | None = None, **kw: Any
) -> ProcessSpec:
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    return ProcessSpec(
        name=name,
        role=role,  # type: ignore[arg-type]
        argv=(sys.executable, FAKE_WORKER, "--port", str(port), *args),
        env=kw.pop("env", {"PYTHONUNBUFFERED": "1"}),
        url=url,
        ready_url=f"{url}/health",
        wave=wave,
        ports=(port,),
        **kw,
    )
