"""``python -m pdctl.sim``: a simulated vLLM OpenAI server (see docs/simulator.md).

Accepts the vLLM flags pdctl's plan emits plus ``--sim-*`` options; reads ``VLLM_NIXL_SIDE_CHANNEL_PORT`` and
``VLLM_NIXL_SIDE_CHANNEL_HOST``; logs in vLLM's format on stdout. ``--kv-events-config`` publishes the prefix
cache's KV events over ZMQ as vLLM does (:mod:`pdctl.sim.kv_events`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn
import zmq

from pdctl.sim import logfmt as L
from pdctl.sim.engine import EngineConfig, KVSettings, SideChannelInUse, SimEngine
from pdctl.sim.faults import FaultSet
from pdctl.sim.kv_events import KVEventsSettings, create_publisher, parse_config
from pdctl.sim.metrics import SimMetrics
from pdctl.sim.server import SimApp
from pdctl.sim.timing import PROFILES, get_link, get_profile
from pdctl.vllm.modelinfo import context_length
from pdctl.vllm.protocol import NIXL_CONNECTORS

__all__ = ["build_parser", "default_max_model_len", "main"]

# vLLM rejects unknown KVTransferConfig keys (pydantic extra="forbid"); so does the simulator.
_KV_FIELDS = {
    "kv_connector", "kv_role", "kv_buffer_device", "engine_id", "kv_connector_extra_config",
    "kv_load_failure_policy", "kv_port", "kv_connector_module_path", "enable_permute_local_kv",
    "kv_ip", "kv_buffer_size", "kv_rank", "kv_parallel_size",
}  # fmt: skip
_REMOVED_KV_FIELDS = {"kv_ip", "kv_buffer_size", "kv_rank", "kv_parallel_size"}
_KNOWN_CONNECTORS = {
    "NixlConnector", "NixlPullConnector", "NixlPushConnector", "ExampleConnector", "MooncakeConnector",
    "LMCacheConnectorV1",
    "MultiConnector", "OffloadingConnector", "DecodeBenchConnector",
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The accepted flags (vLLM's subset plus ``--sim-*``)."""
    p = argparse.ArgumentParser(prog="python -m pdctl.sim", description="Simulated vLLM OpenAI server.")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="model (as in `vllm serve MODEL`)")
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-transfer-config", default=None)
    p.add_argument("--kv-events-config", default=None, help="vLLM's KVEventsConfig as JSON (KV cache events)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="simulator: the prefix cache's capacity in blocks")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-chunked-prefill", dest="chunked", action="store_true", default=None)
    p.add_argument("--no-enable-chunked-prefill", dest="chunked", action="store_false")
    p.add_argument("--enable-prefix-caching", dest="prefix", action="store_true", default=True)
    p.add_argument("--no-enable-prefix-caching", dest="prefix", action="store_false")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--enable-log-requests", action="store_true")
    p.add_argument("--disable-log-requests", action="store_true")
    p.add_argument("--enable-request-id-headers", action="store_true")
    # Accepted (and checked as vLLM checks them) so PD032's fix starts here; the simulator fakes tool calls anyway.
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--sim-profile", default="fast", help=" | ".join(PROFILES))
    p.add_argument("--sim-speed", type=float, default=1.0, help="divide every simulated time by this")
    p.add_argument("--sim-kv-scale", type=float, default=1.0, help="fraction of the model's KV bytes to move")
    p.add_argument("--sim-seed", type=int, default=0)
    p.add_argument("--sim-link", default="loopback")
    p.add_argument("--sim-fault", action="append", default=[], metavar="SPEC")
    return p


def _model_context(model: str) -> int | None:
    local = model.startswith((".", "/", "~")) or os.path.isdir(model)
    return context_length(model, local=local).tokens


def default_max_model_len(model: str, profile: str) -> int:
    """The simulator's ``max_model_len`` when none is given: the model's context length as vLLM derives it
    (:mod:`pdctl.vllm.modelinfo`), else 32768 for the ``fast`` profile and Qwen3-8B's 40960 for the others."""
    found = _model_context(model)
    return found if found is not None else (32768 if profile == "fast" else 40960)


class _Fatal(Exception):
    """A startup error: printed as a vLLM error line, exit code ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _kv_settings(raw: str | None, log: L.VllmLog) -> KVSettings:
    if raw is None:
        return KVSettings()
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise _Fatal(f"--kv-transfer-config is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _Fatal("--kv-transfer-config must be a JSON object")
    unknown = sorted(set(cfg) - _KV_FIELDS)
    removed = sorted(set(cfg) & _REMOVED_KV_FIELDS)
    if unknown or removed:
        bad = unknown + removed
        raise _Fatal(f"1 validation error for KVTransferConfig: {bad[0]}: Extra inputs are not permitted")
    name = cfg.get("kv_connector")
    if name is not None and name not in _KNOWN_CONNECTORS:
        raise _Fatal(f"ValueError: Unsupported connector type: {name}")
    if name is not None and cfg.get("kv_role") not in ("kv_producer", "kv_consumer", "kv_both"):
        raise _Fatal(
            "KVTransferConfig: kv_role must be one of kv_producer, kv_consumer, kv_both when a connector is set"
        )
    extra = cfg.get("kv_connector_extra_config") or {}
    side_port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
    side_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    if side_host == "localhost":
        side_host = "127.0.0.1"
    kw: dict[str, Any] = {}
    if cfg.get("engine_id"):
        kw["engine_id"] = str(cfg["engine_id"])
    if name in NIXL_CONNECTORS and cfg.get("kv_role") == "kv_both":
        log.warning(L.W_ARGS, "kv_role='kv_both' is deprecated for NixlConnector; use kv_producer / kv_consumer")
    return KVSettings(
        connector=name,
        role=cfg.get("kv_role"),
        failure_policy=str(cfg.get("kv_load_failure_policy", "fail")),
        lease_s=float(extra.get("kv_lease_duration", 30)),
        shared_storage_path=extra.get("shared_storage_path"),
        side_host=side_host,
        side_port=side_port,
        **kw,
    )


def _engine_config(args: argparse.Namespace, log: L.VllmLog) -> EngineConfig:
    model = args.model or args.model_pos
    if not model:
        raise _Fatal("no model given: pass --model NAME")
    try:
        profile = get_profile(args.sim_profile)
        link = get_link(args.sim_link)
    except ValueError as e:
        raise _Fatal(str(e)) from None
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise _Fatal("TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser")
    if args.sim_speed <= 0:
        raise _Fatal("--sim-speed must be > 0")
    if not 0 < args.sim_kv_scale <= 1:
        raise _Fatal("--sim-kv-scale must be in (0, 1]")
    if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 1:
        raise _Fatal("--num-gpu-blocks-override must be >= 1", code=2)
    served = (args.served_model_name or [model])[0]
    chunked = True if args.chunked is None else bool(args.chunked)
    max_len = args.max_model_len or default_max_model_len(model, profile.name)
    derived = _model_context(model)
    allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").lower() in ("1", "true")
    if args.max_model_len and derived is not None and args.max_model_len > derived and not allow_long:
        raise _Fatal(
            f"User-specified max_model_len ({args.max_model_len}) is greater than the derived max_model_len "
            f"({derived} in model's config.json). To allow overriding this maximum, set the env var "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        )
    batched = args.max_num_batched_tokens or (8192 if chunked else max(8192, max_len))
    if not chunked and batched < max_len:
        raise _Fatal(
            f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({max_len}). This effectively "
            "limits the maximum sequence length to max_num_batched_tokens and makes vLLM reject longer "
            "sequences. Please increase max_num_batched_tokens or decrease max_model_len."
        )
    return EngineConfig(
        model=model,
        served_model_name=served,
        profile=profile,
        link=link,
        speed=args.sim_speed,
        kv_scale=args.sim_kv_scale,
        seed=args.sim_seed,
        max_num_seqs=args.max_num_seqs or 256,
        max_num_batched_tokens=batched,
        max_model_len=max_len,
        block_size=args.block_size,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=args.prefix,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype="bfloat16" if args.dtype == "auto" else args.dtype,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv=_kv_settings(args.kv_transfer_config, log),
    )


def _kv_events_settings(raw: str | None) -> KVEventsSettings | None:
    """``--kv-events-config`` -> settings; a rejected config is a usage error (exit 2), as vLLM's argparse makes it."""
    if raw is None:
        return None
    try:
        return parse_config(raw)
    except ValueError as e:
        raise _Fatal(f"argument --kv-events-config: {e}", code=2) from None


class _Server(uvicorn.Server):
    """uvicorn's server with vLLM's shutdown lines and the ignore-SIGTERM fault."""

    def __init__(self, config: uvicorn.Config, engine: SimEngine, log: L.VllmLog, ignore_term: bool) -> None:
        super().__init__(config)
        self.engine = engine
        self.vlog = log
        self.ignore_term = ignore_term

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and self.ignore_term:
            self.vlog.warning(L.W_SHUTDOWN, "[shutdown] received SIGTERM, ignoring it (sim fault ignore-sigterm)")
            return
        name = signal.Signals(sig).name
        self.vlog.info(L.W_SHUTDOWN, f"[shutdown] EngineCore: trigger received signal={name}")
        self.engine.abort_all()
        super().handle_exit(sig, frame)
        # Exit with 0 after a graceful stop instead of re-raising the signal once uvicorn is done.
        self._captured_signals.clear()


def _log_config() -> dict[str, Any]:
    # uvicorn's own format ("INFO:     ..."), on stdout like vLLM's lines.
    fmt = {"()": "uvicorn.logging.DefaultFormatter", "fmt": "%(levelprefix)s %(message)s", "use_colors": False}
    acc = {
        "()": "uvicorn.logging.AccessFormatter",
        "fmt": '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s',
        "use_colors": False,
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": fmt, "access": acc},
        "handlers": {
            "default": {"formatter": "default", "class": "logging.StreamHandler", "stream": "ext://sys.stdout"},
            "access": {"formatter": "access", "class": "logging.StreamHandler", "stream": "ext://sys.stdout"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False},
        },
    }


def _spawn_orphan() -> None:
    """A child in our process group that ignores SIGTERM and lives on if only the parent is killed."""
    code = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "stamp = time.strftime('%m-%d %H:%M:%S')\n"
        "sys.stdout.write(f'(EngineCore pid={os.getpid()}) INFO {stamp} [core.py:700] orphan child started\\n')\n"
        "sys.stdout.flush()\n"
        "time.sleep(3600)\n"
    )
    subprocess.Popen([sys.executable, "-c", code], start_new_session=False)


async def _serve(
    cfg: EngineConfig, faults: FaultSet, log: L.VllmLog, args: argparse.Namespace, events: KVEventsSettings | None
) -> None:
    reported = cfg.served_model_name
    f = faults.get("model-name")
    if f is not None and f.arg:
        reported = f.arg
    metrics = SimMetrics(reported)

    def dropped(n: int) -> None:
        if n == 1 or n % 1000 == 0:
            log.warning(L.W_KV_EVENTS_DROP, f"KV event queue full (max_queue_size): {n} batches dropped (simulator)")

    try:
        publisher = create_publisher(events, dropped)
    except zmq.ZMQError as e:
        assert events is not None
        raise _Fatal(f"zmq.error.ZMQError: {e} (addr='{events.endpoint}')") from None
    if events is not None and events.active:
        log.info(L.W_KV_EVENTS_START, "Starting ZMQ publisher thread")
    engine = SimEngine(cfg, faults, log, metrics, kv_events=publisher)
    try:
        await _run_engine(engine, cfg, faults, log, args, reported)
    finally:
        publisher.shutdown()


async def _run_engine(
    engine: SimEngine, cfg: EngineConfig, faults: FaultSet, log: L.VllmLog, args: argparse.Namespace, reported: str
) -> None:
    try:
        await engine.start()
    except SideChannelInUse:
        # As vLLM: its engine core waits for the dead listener (VLLM_ENGINE_READY_TIMEOUT_S), never healthy.
        await asyncio.Event().wait()
    if engine.connector.side_port is not None:
        log.info(L.W_CONNECTOR, f"Creating v1 connector with name: NixlPullConnector and engine_id: {cfg.kv.engine_id}")
    elif cfg.kv.kind == "shared_storage":
        log.info(
            L.W_CONNECTOR, f"Creating v1 connector with name: {cfg.kv.connector} and engine_id: {cfg.kv.engine_id}"
        )
        log.info(L.W_SS_PATH, f"Shared storage path is {cfg.kv.shared_storage_path or '/tmp/pdctl-kv'}")
    mib = cfg.per_token_bytes * 2048 / 2**20
    if mib > 64:
        log.warning(
            L.W_ENGINE_READY,
            f"simulated KV is {mib:.0f} MiB per 2048 tokens (--sim-kv-scale {cfg.kv_scale:g}); set [sim] kv_scale "
            "(e.g. 0.001) to keep the simulator fast. Transfer times still use the full model size.",
        )
    log.info(L.W_ENGINE_READY, "init engine (profile, create kv cache, warmup model) took 0.01 s")
    if faults.has("orphan-child"):
        _spawn_orphan()
    app = SimApp(engine, reported, on_crash=engine.crash)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop="none",
        http="httptools",
        lifespan="on",
        log_config=_log_config(),
        access_log=True,
        timeout_graceful_shutdown=5,
        backlog=4096,
    )
    server = _Server(config, engine, log, faults.has("ignore-sigterm"))
    log.info(L.W_SERVER_START, f"Starting vLLM server on http://{args.host}:{args.port}")
    try:
        await server.serve()
    finally:
        engine.connector.flush_metrics()
        await engine.stop()
    if not server.started:
        raise _Fatal(f"could not bind http://{args.host}:{args.port}", code=1)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulator; returns the exit code."""
    args = build_parser().parse_args(argv)
    log = L.VllmLog()
    try:
        faults = FaultSet(args.sim_fault, args.sim_seed)
        cfg = _engine_config(args, log)
        events = _kv_events_settings(args.kv_events_config)
    except (ValueError, _Fatal) as e:
        log.error(L.W_ARGS, str(e))
        return e.code if isinstance(e, _Fatal) else 2
    if events is not None and events.enable_kv_cache_events and not cfg.enable_prefix_caching:
        log.warning(L.W_KV_EVENTS_NO_PREFIX, "KV cache events are on, but prefix caching is not enabled. Use "
                    "--enable-prefix-caching to enable.")  # fmt: skip
    if events is not None and events.publisher != "null" and not events.enable_kv_cache_events:
        log.warning(L.W_KV_EVENTS_OFF, "KV cache events are disabled, but the scheduler is configured to publish "
                    "them. Modify KVEventsConfig.enable_kv_cache_events to True to enable.")  # fmt: skip
    non_default = {"host": args.host, "port": args.port, "model": cfg.model, "max_model_len": cfg.max_model_len,
                   "served_model_name": [cfg.served_model_name], "sim_profile": cfg.profile.name}  # fmt: skip
    log.info(L.W_ARGS, f"non-default args: {non_default}")
    fail = faults.get("fail-start")
    if fail is not None and fail.fires():
        log.error(L.W_FATAL, "EngineCore failed to start. (sim fault fail-start)")
        log.error(L.W_FATAL, "RuntimeError: Engine core initialization failed. See root cause above.")
        return int(fail.num(1))
    log.info(
        L.W_ENGINE_INIT,
        f"Initializing a V1 LLM engine (v0.32.0) with config: model={cfg.model!r}, dtype={cfg.dtype}, "
        f"max_seq_len={cfg.max_model_len}, tensor_parallel_size={cfg.tensor_parallel_size}, "
        f"enable_prefix_caching={cfg.enable_prefix_caching}, enable_chunked_prefill={cfg.enable_chunked_prefill}",
    )
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        loop_factory = asyncio.new_event_loop
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_serve(cfg, faults, log, args, events))
    except _Fatal as e:
        log.error(L.W_FATAL, str(e))
        return e.code
    except OSError as e:
        log.error(L.W_FATAL, f"{type(e).__name__}: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
