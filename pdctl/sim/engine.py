"""The simulated engine: a continuous-batching scheduler stepping on the timing model, plus the KV connector.

Request life cycle (vLLM V1's states)::

    add() --(do_remote_prefill)--> WAITING_FOR_REMOTE_KVS --pull ok--> WAITING --> RUNNING --> FINISHED
      \\-------------------------------------------------------------> WAITING --> RUNNING --> FINISHED

Each step takes running decodes first (one token each), then prefill chunks, within ``max_num_batched_tokens``
and ``max_num_seqs``; without chunked prefill a prompt runs whole or waits. The step's duration comes from
``Profile.step_s`` over everything in the batch, so a long prefill in a colocated worker stretches the decode
tokens of the same step: the interference PD removes.

Generated token *i* = hash(seed, sha256(KV bytes of the prompt), i): the output depends on the KV bytes the
engine holds, computed locally or pulled from a prefill, so intact KV gives colocated output exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import secrets
import uuid
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdctl.sim import kv as kvmod
from pdctl.sim import logfmt as L
from pdctl.sim import logprobs as lp
from pdctl.sim.faults import FaultSet
from pdctl.sim.metrics import SimMetrics
from pdctl.sim.text import Tokenizer
from pdctl.sim.timing import Link, Profile
from pdctl.vllm.protocol import REQUIRED_DECODE_FIELDS, connector_kind

__all__ = ["EngineConfig", "KVSettings", "SideChannelInUse", "SimEngine", "SimRequest", "StreamEvent"]

State = Literal["WAITING_FOR_REMOTE_KVS", "WAITING", "RUNNING", "FINISHED"]


class SideChannelInUse(Exception):
    """The side-channel port is taken: vLLM's listener thread died on it (its traceback is printed) and its
    engine waits for it, never ready."""


@dataclass(frozen=True, slots=True)
class KVSettings:
    """The parts of ``--kv-transfer-config`` the simulator acts on."""

    connector: str | None = None
    role: str | None = None
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    failure_policy: str = "fail"
    lease_s: float = 30.0
    shared_storage_path: str | None = None
    side_host: str = "127.0.0.1"
    side_port: int = 5600

    @property
    def kind(self) -> str:
        """``params`` (NIXL-like), ``shared_storage`` or ``none``."""
        if self.connector is None:
            return "none"
        k = connector_kind(self.connector)
        return "none" if k == "unknown" else k


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine needs, parsed from the vLLM-style flags."""

    model: str
    served_model_name: str
    profile: Profile
    link: Link
    speed: float = 1.0
    kv_scale: float = 1.0
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    block_size: int = 16
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    kv: KVSettings = field(default_factory=KVSettings)

    @property
    def per_token_bytes(self) -> int:
        """Bytes of simulated KV per token actually produced and moved (scaled)."""
        return max(16, round(self.profile.model.kv_bytes_per_token * self.kv_scale))


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """What the engine tells the HTTP layer: a token, the end, or an error."""

    kind: Literal["token", "finish", "error"]
    token: int = 0
    reason: str = ""
    status: int = 0
    message: str = ""


@dataclass(eq=False)
class SimRequest:
    """One request inside the engine."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    eos_allowed: bool = False
    cache_salt: str | None = None
    kv_params: Mapping[str, Any] | None = None
    state: State = "WAITING"
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_scores: list[int] = field(default_factory=list)  # each token's hash: fixes its logprobs
    near_ties: dict[int, int] = field(default_factory=dict)  # position -> the runner-up 0.01 nats behind
    digest: bytes = b""
    kv_prefix: bytes = b""
    kv_ready: bool = False
    remote_decode: bool = False
    result_params: dict[str, Any] | None = None
    finish_reason: str | None = None
    arrival: float = 0.0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    nonce: bytes = b""
    cached_tokens: int = 0

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_ids)


class SimEngine:
    """Scheduler, step loop, prefix cache and KV connector of one simulated vLLM instance."""

    def __init__(
        self,
        cfg: EngineConfig,
        faults: FaultSet | None = None,
        log: L.VllmLog | None = None,
        metrics: SimMetrics | None = None,
        on_crash: Callable[[int], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.faults = faults or FaultSet([])
        self.log = log or L.VllmLog()
        self.metrics = metrics or SimMetrics(cfg.served_model_name)
        tok_fault = self.faults.get("tokenizer")
        self.tokenizer = Tokenizer(int(tok_fault.num(1)) if tok_fault else 0)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.remote_wait: set[SimRequest] = set()
        self._wakeup = asyncio.Event()
        self._target = 0.0
        self._prefix: OrderedDict[bytes, None] = OrderedDict()
        self._prefix_cap_blocks = max(1024, cfg.profile.kv_capacity_tokens // cfg.block_size)
        self.store = kvmod.KVStore(cfg.block_size, on_expire=self._on_expire, on_release=self._update_gauges)
        self.compat = kvmod.compat_hash(
            cfg.model, cfg.dtype, cfg.profile.model.kv_heads, cfg.profile.model.head_dim, cfg.profile.model.layers
        )
        self.side: kvmod.SideChannelServer | None = None
        self.side_port: int | None = None
        self._handshaken: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_crash = on_crash or (lambda code: os._exit(code))
        self.finished_count = 0
        self.total_generated = 0
        self.total_computed = 0
        self._stall_until = 0.0
        self._xfer_window: list[tuple[float, int]] = []
        self._link_free_at = 0.0
        self._xfer_failed_window = 0
        self._seed_bytes = f"{cfg.seed}".encode()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the step loop, the lease reaper and (for NIXL-like connectors) the side channel."""
        k = self.cfg.kv
        if k.kind == "params":
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
                self.log.info(L.W_NIXL_SCHED, f"Initializing NIXL Scheduler {k.engine_id}")
                self.log.debug(L.W_LISTEN, f"Starting listening on path: tcp://{k.side_host}:{k.side_port}")
                self.log.thread_died("nixl_handshake_listener", L.LISTENER_FRAMES, "zmq.error.ZMQError: Address "
                                     f"already in use (addr='tcp://{k.side_host}:{k.side_port}')")  # fmt: skip
                raise SideChannelInUse(k.side_port) from None
            self.log.info(L.W_NIXL_SCHED, f"Initializing NIXL Scheduler {k.engine_id}")
            self.log.debug(L.W_LISTEN, f"Starting listening on path: tcp://{k.side_host}:{self.side_port}")
            self.log.debug(
                L.W_COMPAT_HASH,
                f"NIXL compatibility hash: {self.compat} (model={self.cfg.model}, dtype={self.cfg.dtype}, "
                f"num_kv_heads={self.cfg.profile.model.kv_heads}, cache_dtype=auto, attn_backend=FLASH_ATTN)",
            )
            self._spawn(self.store.expire_loop())
        self._spawn(self._loop())
        self._spawn(self._stats_loop())

    async def stop(self) -> None:
        """Abort every request and stop background work."""
        self.abort_all()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t
        if self.side is not None:
            await self.side.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    def _now() -> float:
        # The event loop's clock, so a virtual-time loop (pdctl.sim.virtual) times requests too.
        return asyncio.get_running_loop().time()

    # ------------------------------------------------------------------ requests
    def new_request_id(self, base: str) -> str:
        """vLLM's internal id: ``<response id>-0-<8 hex>``."""
        return f"{base}-0-{secrets.token_hex(4)}"

    def add(self, req: SimRequest) -> None:
        """Queue a request (the HTTP layer then reads ``req.events``)."""
        req.arrival = self._now()
        stall = self.faults.get("stall")
        if stall is not None and self._stall_until == 0.0 and stall.fires():
            now = asyncio.get_running_loop().time()
            self._stall_until = float("inf") if stall.arg is None else now + stall.num(0) / self.cfg.speed
        if req.temperature > 0 and req.seed is None:
            req.nonce = secrets.token_bytes(8)
        elif req.seed is not None and req.temperature > 0:
            req.nonce = f"seed{req.seed}".encode()
        params = req.kv_params or {}
        k = self.cfg.kv
        if k.kind == "params" and params.get("do_remote_decode"):
            req.remote_decode = True
        hits = self._prefix_hits(req)
        req.cached_tokens = hits
        req.num_computed = hits
        if k.kind == "params" and params.get("do_remote_prefill"):
            missing = [f for f in REQUIRED_DECODE_FIELDS if params.get(f) in (None, "", [])]
            if missing:
                self.log.warning(
                    L.W_INVALID_PARAMS,
                    f"Got invalid KVTransferParams: {dict(params)}. This request will not utilize KVTransfer",
                )
            else:
                req.state = "WAITING_FOR_REMOTE_KVS"
                self.remote_wait.add(req)
                self.log.debug(
                    L.W_START_LOAD,
                    f"start_load_kv for request {req.request_id} from remote engine "
                    f"{params.get('remote_engine_id')}. Num local_block_ids: 1. Num remote_block_ids: "
                    f"{len(params.get('remote_block_ids') or [])}. ",
                )
                self._spawn(self._pull(req, params))
                self._update_gauges()
                return
        if k.kind == "shared_storage" and k.role in ("kv_consumer", "kv_both", None):
            self._load_shared(req)
        self._enqueue(req)

    def _enqueue(self, req: SimRequest) -> None:
        req.state = "WAITING"
        self.waiting.append(req)
        self._update_gauges()
        self._wakeup.set()

    def abort(self, req: SimRequest) -> None:
        """Drop a request whose client went away."""
        if req.state == "FINISHED":
            return
        with contextlib.suppress(ValueError):
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.remote_wait.discard(req)
        self._finish(req, "abort")

    def abort_all(self) -> None:
        """Abort everything (shutdown)."""
        for r in [*self.waiting, *self.running, *self.remote_wait]:
            self.abort(r)

    # ------------------------------------------------------------------ prefix cache
    def _block_keys(self, req: SimRequest) -> list[bytes]:
        bs = self.cfg.block_size
        h = hashlib.blake2b((req.cache_salt or "").encode(), digest_size=16).digest()
        keys = []
        raw = array("Q", req.prompt_ids).tobytes()
        step = bs * 8
        for b in range(len(req.prompt_ids) // bs):
            h = hashlib.blake2b(h + raw[b * step : (b + 1) * step], digest_size=16).digest()
            keys.append(h)
        return keys

    def _prefix_hits(self, req: SimRequest) -> int:
        if not self.cfg.enable_prefix_caching:
            return 0
        n = 0
        for key in self._block_keys(req):
            if key not in self._prefix:
                break
            self._prefix.move_to_end(key)
            n += 1
        # vLLM always computes at least the last prompt token.
        return min(n * self.cfg.block_size, max(0, req.prompt_len - 1))

    def _remember(self, req: SimRequest) -> None:
        if not self.cfg.enable_prefix_caching:
            return
        for key in self._block_keys(req):
            self._prefix[key] = None
            self._prefix.move_to_end(key)
        while len(self._prefix) > self._prefix_cap_blocks:
            self._prefix.popitem(last=False)

    # ------------------------------------------------------------------ KV
    def _kv_bytes(self, req: SimRequest, start: int = 0) -> bytes:
        return kvmod.compute_kv(self.cfg.seed, self.cfg.model, req.prompt_ids, self.cfg.per_token_bytes, start)

    def _set_digest(self, data: bytes) -> bytes:
        return hashlib.sha256(data).digest()

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
        self._count_sources(req, external=aligned - req.cached_tokens if aligned > req.cached_tokens else 0)
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
            await self._sleep_until(sim_end)
            data = res.data
            if self.cfg.kv.role == "kv_consumer" and self.faults.fires("corrupt-kv"):
                data = kvmod._flip(data)
        except kvmod.KVPullError as e:
            self._kv_failure(req, params, e)
            return
        if req.state == "FINISHED":
            return
        xfer_s = loop.time() - t0
        self.remote_wait.discard(req)
        m = self.metrics
        m.h(m.nixl_xfer).observe(xfer_s)
        m.h(m.nixl_post).observe(xfer_s)
        m.h(m.nixl_bytes).observe(full_bytes)
        self._xfer_window.append((xfer_s, full_bytes))
        self.log.debug(
            L.W_GET_FINISHED, "Rank 0, get_finished: 0 requests done sending and 1 requests done recving (0 failed)"
        )
        self.log.debug(L.W_FINISHED_RECV, f"Finished recving KV transfer for request {req.request_id}")
        req.kv_prefix = (self._kv_bytes(req)[: start * self.cfg.per_token_bytes] if start else b"") + data
        req.kv_ready = True
        req.num_computed = req.prompt_len
        self._count_sources(req, external=req.prompt_len - start)
        self._enqueue(req)

    def _kv_failure(self, req: SimRequest, params: Mapping[str, Any], e: kvmod.KVPullError) -> None:
        self.remote_wait.discard(req)
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
                f"Recomputing 1 request(s) after KV load failure (failure_policy=recompute, "
                f"{req.prompt_len} tokens affected). Request IDs: {{{req.request_id!r}}}",
            )
            self._enqueue(req)
            return
        self.log.error(
            L.W_KV_LOAD_FAIL,
            f"Failing 1 request(s) due to KV load failure (failure_policy=fail, {req.prompt_len} tokens "
            f"affected). Request IDs: {{{req.request_id!r}}}",
        )
        self.log.debug(L.W_FINISHED_RECV, f"Finished recving KV transfer for request {req.request_id}")
        self._finish(req, "error", status=500, message="Internal server error")

    def _on_expire(self, held: kvmod.HeldKV) -> None:
        self.metrics.c(self.metrics.nixl_expired).inc()
        self.log.warning(
            L.W_EXPIRED,
            f"Releasing expired KV blocks for request {held.request_id} which were retrieved by 0 remote "
            "worker(s) before lease expired.",
        )
        self.log.debug(L.W_FINISHED_SEND, f"Finished sending KV transfer for request {held.request_id}")
        self._update_gauges()

    def _count_sources(self, req: SimRequest, external: int = 0) -> None:
        m = self.metrics
        local = req.prompt_len - req.cached_tokens - external
        m.c(m.by_source, source="local_cache_hit").inc(req.cached_tokens)
        m.c(m.by_source, source="external_kv_transfer").inc(external)
        m.c(m.by_source, source="local_compute").inc(max(0, local))
        self.total_computed += max(0, local)

    # ------------------------------------------------------------------ scheduling
    async def _sleep_until(self, deadline: float) -> None:
        delay = deadline - asyncio.get_running_loop().time()
        await asyncio.sleep(max(0.0, delay))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self._stall_until > loop.time():
                if self._stall_until == float("inf"):
                    await asyncio.Event().wait()
                await self._sleep_until(self._stall_until)
            prefill, decode = self._schedule()
            if not prefill and not decode:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            dt = self.cfg.profile.step_s(
                [(c, r.num_computed) for r, c in prefill], [r.prompt_len + len(r.output_ids) for r in decode]
            )
            now = loop.time()
            self._target = max(self._target, now) + dt / self.cfg.speed
            await asyncio.sleep(max(0.0, self._target - now))
            self._apply(prefill, decode)

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], list[SimRequest]]:
        budget = self.cfg.max_num_batched_tokens
        decode: list[SimRequest] = []
        prefill: list[tuple[SimRequest, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            if r.num_computed >= r.prompt_len:
                decode.append(r)
                budget -= 1
        for r in self.running:
            if r.num_computed < r.prompt_len and budget > 0:
                chunk = min(r.prompt_len - r.num_computed, budget)
                prefill.append((r, chunk))
                budget -= chunk
        capacity = self.cfg.profile.kv_capacity_tokens
        used = self._used_tokens()
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget > 0:
            r = self.waiting[0]
            remaining = r.prompt_len - r.num_computed
            if used + r.prompt_len + r.max_tokens > capacity and self.running:
                break
            if remaining == 0:
                decode.append(r)
                budget -= 1
            else:
                chunk = min(remaining, budget)
                if chunk < remaining and not self.cfg.enable_chunked_prefill:
                    break
                prefill.append((r, chunk))
                budget -= chunk
            self.waiting.popleft()
            r.state = "RUNNING"
            r.scheduled_at = self._now()
            self.metrics.h(self.metrics.queue).observe(r.scheduled_at - r.arrival)
            self.running.append(r)
            used += r.prompt_len + r.max_tokens
        self._update_gauges()
        return prefill, decode

    def _used_tokens(self) -> int:
        return sum(r.prompt_len + len(r.output_ids) for r in self.running) + self.store.held_tokens

    def _apply(self, prefill: Sequence[tuple[SimRequest, int]], decode: Sequence[SimRequest]) -> None:
        for r, chunk in prefill:
            if r.state != "RUNNING":
                continue
            r.num_computed += chunk
            if r.num_computed >= r.prompt_len:
                self._prefill_done(r)
                self._emit(r)
        for r in decode:
            if r.state == "RUNNING":
                if not r.digest:
                    self._prefill_done(r)
                self._emit(r)
        self._update_gauges()

    def _prefill_done(self, r: SimRequest) -> None:
        if r.kv_prefix:
            start = len(r.kv_prefix) // self.cfg.per_token_bytes
            data = r.kv_prefix + (self._kv_bytes(r, start) if start < r.prompt_len else b"")
        else:
            data = self._kv_bytes(r)
            if not r.kv_ready:
                self._count_sources(r)
        r.digest = self._set_digest(data)
        self._remember(r)
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

    def _token(self, r: SimRequest, i: int) -> tuple[int, int]:
        h = hashlib.blake2b(self._seed_bytes + r.digest + r.nonce + i.to_bytes(4, "little"), digest_size=8)
        v = int.from_bytes(h.digest(), "little")
        return self.tokenizer.word_ids[v % len(self.tokenizer.word_ids)], v

    def _emit(self, r: SimRequest) -> None:
        now = self._now()
        i = len(r.output_ids)
        tid, v = self._token(r, i)
        tie = self.faults.get("near-tie")
        if tie is not None and i == int(tie.num(0)):
            other = lp.runner_up(self.tokenizer, tid, v)
            if r.kv_ready and tie.fires():  # the KV came from prefill: the near-tie rounds the other way
                tid, other = other, tid
            r.near_ties[i] = other
        r.output_ids.append(tid)
        r.output_scores.append(v)
        m = self.metrics
        m.c(m.generation_tokens).inc()
        self.total_generated += 1
        if r.first_token_at is None:
            r.first_token_at = now
            m.h(m.ttft).observe(now - r.arrival)
        elif r.last_token_at is not None:
            m.h(m.itl).observe(now - r.last_token_at)
        r.last_token_at = now
        r.events.put_nowait(StreamEvent("token", token=tid))
        if len(r.output_ids) >= r.max_tokens:
            self._finish(r, "length")
        elif r.eos_allowed and i >= 15 and (v >> 32) % 48 == 0:
            self._finish(r, "stop")

    def _finish(self, r: SimRequest, reason: str, status: int = 0, message: str = "") -> None:
        if r.state == "FINISHED":
            return
        prev = r.state
        r.state = "FINISHED"
        r.finish_reason = reason
        if r in self.running:
            self.running.remove(r)
        m = self.metrics
        m.c(m.success, finished_reason=reason).inc()
        if reason == "error":
            r.events.put_nowait(StreamEvent("error", status=status, message=message))
        else:
            r.events.put_nowait(StreamEvent("finish", reason=reason))
        if prev == "RUNNING" or reason != "abort":
            now = self._now()
            m.h(m.e2e).observe(now - r.arrival)
            m.c(m.prompt_tokens).inc(r.prompt_len)
            m.h(m.req_prompt_tokens).observe(r.prompt_len)
            m.h(m.req_gen_tokens).observe(len(r.output_ids))
            if r.first_token_at is not None and r.scheduled_at is not None:
                m.h(m.prefill_time).observe(r.first_token_at - r.scheduled_at)
                m.h(m.decode_time).observe(now - r.first_token_at)
                if len(r.output_ids) > 1:
                    m.h(m.tpot).observe((now - r.first_token_at) / (len(r.output_ids) - 1))
        self._update_gauges()
        self.finished_count += 1
        crash = self.faults.get("crash-after")
        if crash is not None and self.finished_count == int(crash.num(0)):
            # Let the N-th response reach its client first.
            asyncio.get_running_loop().call_later(0.05, self.crash, 1)

    def crash(self, code: int) -> None:
        """Die like a dead EngineCore (the fatal error line, then exit ``code``)."""
        self.log.error(L.W_FATAL, "EngineCore encountered a fatal error.")
        self._on_crash(code)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.g(m.running).set(len(self.running))
        m.g(m.waiting).set(len(self.waiting) + len(self.remote_wait))
        m.g(m.kv_usage).set(min(1.0, self._used_tokens() / self.cfg.profile.kv_capacity_tokens))

    async def _stats_loop(self, period_s: float = 10.0) -> None:
        """vLLM's periodic stats lines, including ``KV Transfer metrics`` when there was traffic."""
        last_prompt = last_gen = 0
        while True:
            await asyncio.sleep(period_s)
            prompt, gen = self.total_computed, self.total_generated
            self.log.info(
                L.W_STATS,
                f"Engine 000: Avg prompt throughput: {(prompt - last_prompt) / period_s:.1f} tokens/s, "
                f"Avg generation throughput: {(gen - last_gen) / period_s:.1f} tokens/s, Running: "
                f"{len(self.running)} reqs, Waiting: {len(self.waiting) + len(self.remote_wait)} reqs, "
                f"GPU KV cache usage: {100 * self._used_tokens() / self.cfg.profile.kv_capacity_tokens:.1f}%, "
                "Prefix cache hit rate: 0.0%",
            )
            last_prompt, last_gen = prompt, gen
            self.flush_kv_metrics()

    def flush_kv_metrics(self) -> None:
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
