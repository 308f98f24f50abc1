"""The simulated engine's KV connector: NIXL-like (``params``: pull over the side channel, leases) or shared storage.

PD over a NIXL-like connector (``NixlConnector`` and its kin)::

    prefill (do_remote_decode)                               decode (do_remote_prefill)
    publish(): hold the KV under a lease, return   ------->  admit(): WAITING_FOR_REMOTE_KVS, pull it from the
    kv_transfer_params (host, side port, block ids)          prefill's side channel (handshake once per engine),
    lease expires unread: released, counted                  wait on the shared link, then WAITING; on failure
                                                             failure_policy: recompute (WAITING) or fail (500)

Shared storage (``SharedStorageConnector``, vLLM's example): a producer writes each prompt's full blocks to
``shared_storage_path``; a consumer that finds them injects them and computes only the rest.

:class:`KVSettings` (:mod:`pdctl.sim.request`) is what of ``--kv-transfer-config`` the simulator acts on;
:class:`KVConnector` is the connector of one engine, calling back into its scheduler (the
:class:`~pdctl.sim.request.Scheduler` protocol, which :class:`~pdctl.sim.engine.SimEngine` implements) to queue or
fail a request.
The bytes, the lease store and the side channel themselves are in :mod:`pdctl.sim.kv`.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Mapping
from typing import Any

from pdctl.sim import kv as kvmod
from pdctl.sim import logfmt as L
from pdctl.sim.request import KVSettings, Scheduler, SimRequest
from pdctl.vllm.protocol import REQUIRED_DECODE_FIELDS

__all__ = ["KVConnector", "KVSettings", "SideChannelInUse"]


class SideChannelInUse(Exception):
    """The side-channel port is taken: vLLM's listener thread died on it (its traceback is printed) and its
    engine waits for it, never ready."""


class KVConnector:
    """The KV connector of one engine: its lease store and side channel, transfers in and out, their metrics."""

    def __init__(self, engine: Scheduler) -> None:
        self._engine = engine
        self.cfg = cfg = engine.cfg
        self.faults = engine.faults
        self.log = engine.log
        self.metrics = engine.metrics
        self.store = kvmod.KVStore(cfg.block_size, on_expire=self._on_expire, on_release=engine.update_gauges)
        self.compat = kvmod.compat_hash(
            cfg.model, cfg.dtype, cfg.profile.model.kv_heads, cfg.profile.model.head_dim, cfg.profile.model.layers
        )
        self.side: kvmod.SideChannelServer | None = None
        self.side_port: int | None = None
        self._handshaken: set[str] = set()
        self._xfer_window: list[tuple[float, int]] = []
        self._link_free_at = 0.0
        self._xfer_failed_window = 0

    async def start(self) -> None:
        """For NIXL-like connectors: listen on the side channel and start the lease reaper."""
        k = self.cfg.kv
        if k.kind != "params":
            return
        self.side = kvmod.SideChannelServer(
            self.store,
            k.engine_id,
            self.compat,
            # A consumer corrupts what it receives (in _pull); everyone else what it sends.
            corrupt=lambda: k.role != "kv_consumer" and self.faults.fires("corrupt-kv"),
            drop_handshake=lambda: self.faults.fires("handshake-fail"),
            on_message=lambda _m: self.log.debug(L.W_RECV_MSG, "Received message for pp rank 0, tp rank 0"),
        )
        try:
            self.side_port = await self.side.start(k.side_host, k.side_port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            self._log_listening(k.side_port)
            self.log.thread_died("nixl_handshake_listener", L.LISTENER_FRAMES, "zmq.error.ZMQError: Address "
                                 f"already in use (addr='tcp://{k.side_host}:{k.side_port}')")  # fmt: skip
            raise SideChannelInUse(k.side_port) from None
        self._log_listening(self.side_port)
        self.log.debug(
            L.W_COMPAT_HASH,
            f"NIXL compatibility hash: {self.compat} (model={self.cfg.model}, dtype={self.cfg.dtype}, "
            f"num_kv_heads={self.cfg.profile.model.kv_heads}, cache_dtype=auto, attn_backend=FLASH_ATTN)",
        )
        self._engine.spawn(self.store.expire_loop())

    def _log_listening(self, port: int) -> None:
        k = self.cfg.kv
        self.log.info(L.W_NIXL_SCHED, f"Initializing NIXL Scheduler {k.engine_id}")
        self.log.debug(L.W_LISTEN, f"Starting listening on path: tcp://{k.side_host}:{port}")

    async def close(self) -> None:
        """Stop listening on the side channel."""
        if self.side is not None:
            await self.side.close()

    def admit(self, req: SimRequest) -> bool:
        """Act on a new request's ``kv_transfer_params``; True when the connector holds it (pulling its KV).

        Otherwise the request is the scheduler's to queue, its prompt's stored blocks injected (shared storage).
        """
        params = req.kv_params or {}
        k = self.cfg.kv
        if k.kind == "params" and params.get("do_remote_decode"):
            req.remote_decode = True
        if k.kind == "params" and params.get("do_remote_prefill"):
            missing = [f for f in REQUIRED_DECODE_FIELDS if params.get(f) in (None, "", [])]
            if missing:
                self.log.warning(
                    L.W_INVALID_PARAMS,
                    f"Got invalid KVTransferParams: {dict(params)}. This request will not utilize KVTransfer",
                )
            else:
                req.state = "WAITING_FOR_REMOTE_KVS"
                self._engine.remote_wait.add(req)
                self.log.debug(
                    L.W_START_LOAD,
                    f"start_load_kv for request {req.request_id} from remote engine "
                    f"{params.get('remote_engine_id')}. Num local_block_ids: 1. Num remote_block_ids: "
                    f"{len(params.get('remote_block_ids') or [])}. ",
                )
                self._engine.spawn(self._pull(req, params))
                self._engine.update_gauges()
                return True
        if k.kind == "shared_storage" and k.role in ("kv_consumer", "kv_both", None):
            self._load_shared(req)
        return False

    def publish(self, r: SimRequest, data: bytes) -> None:
        """Hand a finished prefill's KV ``data`` on: held for a remote decode, or written to shared storage."""
        k = self.cfg.kv
        if r.remote_decode:
            if self.faults.fires("no-kv-params"):
                r.result_params = None
            else:
                held = self.store.hold(r.request_id, data, r.prompt_len, k.lease_s)
                r.result_params = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": [held.block_ids],
                    "remote_engine_id": k.engine_id,
                    "remote_request_id": r.request_id,
                    "remote_host": k.side_host,
                    "remote_port": self.side_port,
                    "tp_size": self.cfg.tensor_parallel_size,
                    "dcp_size": 1,
                    "pp_size": 1,
                    "remote_num_tokens": r.prompt_len,
                    "remote_blocks_expiry_time": None,
                    "transfer_mode": "pull",
                    "remote_prefill_cached_tokens": r.cached_tokens,
                }
                self.log.debug(
                    L.W_WAIT_RELEASE,
                    f"NIXLConnector request_finished({r.request_id}) waiting for {k.lease_s:g} seconds before "
                    "releasing blocks",
                )
        elif k.kind == "shared_storage" and k.role in ("kv_producer", "kv_both"):
            bs = self.cfg.block_size
            aligned = (r.prompt_len // bs) * bs
            if aligned and not r.kv_prefix:
                root = k.shared_storage_path or "/tmp/pdctl-kv"
                kvmod.write_shared(root, r.prompt_ids[:aligned], data[: aligned * self.cfg.per_token_bytes])

    def _load_shared(self, req: SimRequest) -> None:
        root = self.cfg.kv.shared_storage_path or "/tmp/pdctl-kv"
        bs = self.cfg.block_size
        aligned = (req.prompt_len // bs) * bs
        if aligned == 0:
            return
        data = kvmod.read_shared(root, req.prompt_ids[:aligned])
        if data is None:
            return
        self.log.info(L.W_SS_HIT, "External Cache Hit!")
        if self.faults.fires("corrupt-kv"):
            data = kvmod._flip(data)
        self.log.info(L.W_SS_INJECT, f"Inject KV cache of {aligned} tokens to the paged memory")
        req.kv_prefix = data
        req.num_computed = max(req.num_computed, aligned)
        self._engine.count_sources(req, external=aligned - req.cached_tokens if aligned > req.cached_tokens else 0)
        req.cached_tokens = aligned

    async def _pull(self, req: SimRequest, params: Mapping[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        remote_engine = str(params.get("remote_engine_id"))
        host, port = str(params.get("remote_host")), int(params.get("remote_port") or 0)
        start = req.cached_tokens
        try:
            if self.faults.fires("handshake-fail"):
                raise kvmod.KVPullError("handshake_setup_failed", "injected handshake failure")
            if remote_engine not in self._handshaken:
                self.log.debug(
                    L.W_QUERY_META, f"Querying metadata on path: tcp://{host}:{port} at remote pp rank 0, tp rank 0"
                )
            res = await kvmod.pull_kv(
                host, port, str(params.get("remote_request_id")), start, self.cfg.kv.engine_id, self.compat,
                expected_engine_id=remote_engine, timeout_s=max(5.0, self.cfg.kv.lease_s),
            )  # fmt: skip
            if remote_engine not in self._handshaken:
                self._handshaken.add(remote_engine)
                self.log.debug(L.W_META_TOOK, f"NIXL handshake: get metadata took: {res.handshake_s}")
                self.log.info(L.W_COMPAT_OK, f"NIXL compatibility check passed (hash: {self.compat})")
            self.log.debug(
                L.W_READ_BLOCKS,
                f"Remote agent {remote_engine} available, calling _read_blocks on remote rank 0 with remote "
                f"block size {self.cfg.block_size} for req {req.request_id}",
            )
            full_bytes = (req.prompt_len - start) * self.cfg.profile.model.kv_bytes_per_token
            # Transfers share the link: each waits for the bytes queued before it (saturation).
            link = self.cfg.link
            begin = max(t0, self._link_free_at)
            self._link_free_at = begin + full_bytes / link.bandwidth / self.cfg.speed
            sim_end = self._link_free_at + link.latency_s / self.cfg.speed
            slow = self.faults.get("slow-kv")
            if slow is not None and slow.fires():
                sim_end += slow.num(0.0) / self.cfg.speed
            await self._engine.sleep_until(sim_end)
            data = res.data
            if self.cfg.kv.role == "kv_consumer" and self.faults.fires("corrupt-kv"):
                data = kvmod._flip(data)
        except kvmod.KVPullError as e:
            self._kv_failure(req, params, e)
            return
        if req.state == "FINISHED":
            return
        xfer_s = loop.time() - t0
        self._engine.remote_wait.discard(req)
        m = self.metrics
        m.h(m.nixl_xfer).observe(xfer_s)
        m.h(m.nixl_post).observe(xfer_s)
        m.h(m.nixl_bytes).observe(full_bytes)
        self._xfer_window.append((xfer_s, full_bytes))
        self.log.debug(
            L.W_GET_FINISHED, "Rank 0, get_finished: 0 requests done sending and 1 requests done recving (0 failed)"
        )
        self.log.debug(L.W_FINISHED_RECV, f"Finished recving KV transfer for request {req.request_id}")
        req.kv_prefix = (self._engine.kv_bytes(req)[: start * self.cfg.per_token_bytes] if start else b"") + data
        req.kv_ready = True
        req.num_computed = req.prompt_len
        self._engine.count_sources(req, external=req.prompt_len - start)
        self._engine.enqueue(req)

    def _kv_failure(self, req: SimRequest, params: Mapping[str, Any], e: kvmod.KVPullError) -> None:
        self._engine.remote_wait.discard(req)
        self.metrics.c(self.metrics.nixl_failed).inc()
        self._xfer_failed_window += 1
        ctx = {
            "failure_type": e.kind,
            "request_id": req.request_id,
            "engine_id": self.cfg.kv.engine_id,
            "remote_engine_id": params.get("remote_engine_id"),
            "remote_request_id": params.get("remote_request_id"),
            "remote_host": params.get("remote_host"),
            "remote_port": params.get("remote_port"),
            "error": str(e),
        }
        where = L.W_HS_SETUP_FAIL if e.kind.startswith("handshake") else L.W_XFER_FAIL
        self.log.error(where, f"NIXL transfer failure: {e.kind} | Context: {ctx}")
        self.log.debug(
            L.W_GET_FINISHED, "Rank 0, get_finished: 0 requests done sending and 1 requests done recving (1 failed)"
        )
        if req.state == "FINISHED":
            return
        if self.cfg.kv.failure_policy == "recompute":
            self.log.warning(
                L.W_RECOMPUTE,
                f"Recovered from KV load failure: 1 request(s) rescheduled ({req.prompt_len} tokens affected).",
            )
            self._engine.enqueue(req)
            return
        self.log.error(
            L.W_KV_LOAD_FAIL,
            f"Failing 1 request(s) due to KV load failure (failure_policy=fail, {req.prompt_len} tokens "
            f"affected). Request IDs: {{{req.request_id!r}}}",
        )
        self.log.debug(L.W_FINISHED_RECV, f"Finished recving KV transfer for request {req.request_id}")
        self._engine.finish(req, "error", status=500, message="Internal server error")

    def _on_expire(self, held: kvmod.HeldKV) -> None:
        self.metrics.c(self.metrics.nixl_expired).inc()
        self.log.warning(
            L.W_EXPIRED,
            f"Releasing expired KV blocks for request {held.request_id} which were retrieved by 0 remote "
            "worker(s) before lease expired.",
        )
        self.log.debug(L.W_FINISHED_SEND, f"Finished sending KV transfer for request {held.request_id}")
        self._engine.update_gauges()

    def flush_metrics(self) -> None:
        """Log vLLM's ``KV Transfer metrics`` line for the transfers since the last one (if any)."""
        window, failed = self._xfer_window, self._xfer_failed_window
        if not window and not failed:
            return
        self._xfer_window, self._xfer_failed_window = [], 0
        times = sorted(t * 1000 for t, _ in window)
        n = len(times)
        avg = sum(times) / n if n else 0
        p90 = times[min(n - 1, int(0.9 * n))] if n else 0
        mb = sum(b for _, b in window) / 1e6
        thr = mb / (sum(times) / 1000) if n and sum(times) > 0 else 0
        self.log.info(
            L.W_KV_METRICS,
            f"KV Transfer metrics: Num successful transfers={n}, Avg xfer time (ms)={avg:.3f}, "
            f"P90 xfer time (ms)={p90:.3f}, Avg post time (ms)={avg:.3f}, P90 post time (ms)={p90:.3f}, "
            f"Avg MB per transfer={mb / n if n else 0:.3f}, Throughput (MB/s)={thr:.3f}, "
            f"Avg number of descriptors=2.0, Num failed transfers={failed}, Num KV expired reqs=0, "
            "Num notifs after expiry=0",
        )
