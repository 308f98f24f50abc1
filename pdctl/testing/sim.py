"""Simulator workers as real subprocesses (for pdctl's tests and benchmarks).

Each worker gets free ports, its own process group (killed whole on ``stop``), and a log file.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from pdctl.testing.ports import free_port
from pdctl.testing.procs import stop_group

__all__ = ["SimProcess", "start_sim"]


@dataclass
class SimProcess:
    """A running ``python -m pdctl.sim``."""

    proc: subprocess.Popen[bytes]
    port: int
    side_port: int
    log_path: str
    argv: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Base URL of its HTTP server."""
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        """Everything it printed so far."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def wait_exit(self, timeout_s: float) -> int | None:
        """Its exit code, or None if it is still running after ``timeout_s``."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s`` (and its orphans in any case)."""
        stop_group(self.proc, grace_s)


def start_sim(
    args: Sequence[str],
    log_dir: str,
    *,
    name: str = "sim",
    model: str = "sim-model",
    connector: str | None = "NixlConnector",
    role: str = "kv_both",
    extra_config: Mapping[str, object] | None = None,
    kv_fields: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    wait_ready: bool = True,
    ready_timeout_s: float = 30.0,
    port: int | None = None,
) -> SimProcess:
    """Start a simulator worker on free ports and (by default) wait until ``/health`` answers 200; ``port``: the
    HTTP port instead of a free one (a worker restarted where it was)."""
    import json

    port, side = port or free_port(), free_port()
    argv = [sys.executable, "-m", "pdctl.sim", "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    if connector is not None:
        kv: dict[str, object] = {"kv_connector": connector, "kv_role": role}
        if extra_config:
            kv["kv_connector_extra_config"] = dict(extra_config)
        kv.update(kv_fields or {})
        argv += ["--kv-transfer-config", json.dumps(kv)]
    argv += list(args)
    full_env = dict(os.environ)
    full_env.update({"PYTHONUNBUFFERED": "1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)})
    full_env.update(env or {})
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    sp = SimProcess(proc, port, side, log_path, argv)
    if wait_ready:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sim {name} exited with {proc.returncode}:\n{sp.output()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{sp.url}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                sp.stop()
                raise RuntimeError(f"sim {name} not ready after {ready_timeout_s} s:\n{sp.output()[-2000:]}")
            time.sleep(0.05)
    return sp
