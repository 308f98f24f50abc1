"""vLLM's log line format on stdout: ``(<Proc> pid=<N>) <LEVEL> <MM-DD HH:MM:SS> [<file>:<line>] <message>``.

At INFO the file is a base name (``[base_worker.py:1093]``); at DEBUG vLLM prints a relative path
(``[distributed/.../nixl/base_worker.py:1093]``), and so does this module. Call sites name the vLLM source
location whose message they reproduce, so pdctl's KV log classifier sees the same text as with real vLLM.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

__all__ = ["LEVELS", "LISTENER_FRAMES", "VllmLog", "Where"]

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}

Where = tuple[str, str, int]  # (process, relative file, line)

API = "APIServer"
ENGINE = "EngineCore"
WORKER = "Worker"


class VllmLog:
    """Writes vLLM-format lines to one stream, filtered by ``VLLM_LOGGING_LEVEL``."""

    def __init__(self, stream: TextIO | None = None, level: str | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        name = (level or os.environ.get("VLLM_LOGGING_LEVEL") or "INFO").upper()
        self.level = LEVELS.get(name, 20)
        self.pid = os.getpid()

    @property
    def debug_enabled(self) -> bool:
        """Whether DEBUG lines are written."""
        return self.level <= LEVELS["DEBUG"]

    def log(self, level: str, where: Where, message: str) -> None:
        """Write one line (several if ``message`` has newlines, each with the prefix)."""
        if LEVELS[level] < self.level:
            return
        proc, path, line = where
        shown = path if self.debug_enabled else path.rsplit("/", 1)[-1]
        stamp = time.strftime("%m-%d %H:%M:%S")
        prefix = f"({proc} pid={self.pid}) {level} {stamp} [{shown}:{line}] "
        text = "".join(prefix + part + "\n" for part in message.split("\n"))
        try:
            self.stream.write(text)
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass

    def thread_died(self, thread: str, frames: tuple[str, ...], error: str) -> None:
        """An exception that ended a thread, as Python's ``threading.excepthook`` prints it: no process prefix and
        no level (it is not a log record, so ``VLLM_LOGGING_LEVEL`` does not hide it), as real vLLM shows it."""
        lines = [f"Exception in thread {thread}:", "Traceback (most recent call last):", *frames, error]
        try:
            self.stream.write("".join(f"{line}\n" for line in lines))
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass

    def debug(self, where: Where, message: str) -> None:
        """A DEBUG line."""
        self.log("DEBUG", where, message)

    def info(self, where: Where, message: str) -> None:
        """An INFO line."""
        self.log("INFO", where, message)

    def warning(self, where: Where, message: str) -> None:
        """A WARNING line."""
        self.log("WARNING", where, message)

    def error(self, where: Where, message: str) -> None:
        """An ERROR line."""
        self.log("ERROR", where, message)


#: The frames of vLLM 0.32's NIXL handshake listener thread when its bind fails (the traceback's middle, as
#: seen with real vLLM CPU; site-packages paths shortened).
LISTENER_FRAMES = (
    '  File "threading.py", line 1045, in _bootstrap_inner',
    "    self.run()",
    '  File "threading.py", line 982, in run',
    "    self._target(*self._args, **self._kwargs)",
    '  File "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py", line 351, in '
    "_nixl_handshake_listener",
    "    with zmq_ctx(zmq.ROUTER, path) as sock:",
    '  File "vllm/distributed/kv_transfer/kv_connector/v1/nixl/utils.py", line 44, in zmq_ctx',
    "    yield make_zmq_socket(",
    '  File "vllm/utils/network_utils.py", line 402, in make_zmq_socket',
    "    socket.bind(path)",
    '  File "zmq/sugar/socket.py", line 322, in bind',
    "    super().bind(addr)",
)

# The vLLM 0.32 source locations of the messages the simulator reproduces.
W_ARGS: Where = (API, "entrypoints/.../utils/api_utils.py", 286)
W_SERVER_START: Where = (API, "entrypoints/.../entry.py", 140)
W_STATS: Where = (API, "v1/metrics/loggers.py", 335)
W_KV_METRICS: Where = (API, "distributed/.../v1/metrics.py", 103)
W_REQ_FAILED: Where = (API, "entrypoints/.../base/serving.py", 203)
W_ENGINE_INIT: Where = (ENGINE, "v1/engine/core.py", 133)
W_ENGINE_READY: Where = (ENGINE, "v1/engine/core.py", 402)
W_FATAL: Where = (ENGINE, "v1/engine/core.py", 1139)
W_SHUTDOWN: Where = (ENGINE, "v1/engine/core.py", 1454)
W_CONNECTOR: Where = (WORKER, "distributed/.../kv_connector/factory.py", 62)
W_NIXL_SCHED: Where = (ENGINE, "distributed/.../nixl/base_scheduler.py", 109)
W_LISTEN: Where = (ENGINE, "distributed/.../nixl/base_scheduler.py", 350)
W_RECV_MSG: Where = (ENGINE, "distributed/.../nixl/base_scheduler.py", 363)
W_COMPAT_HASH: Where = (WORKER, "distributed/.../nixl/metadata.py", 205)
W_QUERY_META: Where = (WORKER, "distributed/.../nixl/base_worker.py", 1032)
W_META_TOOK: Where = (WORKER, "distributed/.../nixl/base_worker.py", 1069)
W_COMPAT_OK: Where = (WORKER, "distributed/.../nixl/base_worker.py", 1093)
W_HS_SETUP_FAIL: Where = (WORKER, "distributed/.../nixl/base_worker.py", 1318)
W_HS_FAIL: Where = (WORKER, "distributed/.../nixl/base_worker.py", 1354)
W_XFER_FAIL: Where = (WORKER, "distributed/.../nixl/base_worker.py", 2711)
W_GET_FINISHED: Where = (WORKER, "distributed/.../nixl/base_worker.py", 2892)
W_EXPIRED: Where = (WORKER, "distributed/.../nixl/base_worker.py", 3032)
W_START_LOAD: Where = (WORKER, "distributed/.../nixl/pull_worker.py", 59)
W_READ_BLOCKS: Where = (WORKER, "distributed/.../nixl/pull_worker.py", 317)
W_REQ_FINISHED: Where = (ENGINE, "distributed/.../nixl/pull_scheduler.py", 202)
W_WAIT_RELEASE: Where = (ENGINE, "distributed/.../nixl/pull_scheduler.py", 258)
W_INVALID_PARAMS: Where = (ENGINE, "distributed/.../nixl/pull_scheduler.py", 70)
W_FINISHED_RECV: Where = (ENGINE, "v1/core/sched/scheduler.py", 3223)
W_FINISHED_SEND: Where = (ENGINE, "v1/core/sched/scheduler.py", 3233)
W_KV_LOAD_FAIL: Where = (ENGINE, "v1/core/sched/scheduler.py", 3417)
W_RECOMPUTE: Where = (ENGINE, "v1/core/sched/scheduler.py", 3426)
W_SS_PATH: Where = (WORKER, "distributed/.../v1/example_connector.py", 108)
W_SS_HIT: Where = (ENGINE, "distributed/.../v1/example_connector.py", 292)
W_SS_INJECT: Where = (WORKER, "distributed/.../v1/example_connector.py", 171)
W_SS_SAVE: Where = (WORKER, "distributed/.../v1/example_connector.py", 239)
W_RESET_API: Where = (API, "entrypoints/.../cache/api_router.py", 37)
W_RESET_FAILED: Where = (ENGINE, "v1/core/block_pool.py", 839)
W_RESET_OK: Where = (ENGINE, "v1/core/block_pool.py", 861)
W_KV_EVENTS_START: Where = (ENGINE, "distributed/kv_events.py", 379)
W_KV_EVENTS_DROP: Where = (ENGINE, "distributed/kv_events.py", 394)
W_KV_EVENTS_NO_PREFIX: Where = (API, "config/vllm.py", 1976)
W_KV_EVENTS_OFF: Where = (API, "config/vllm.py", 1986)
