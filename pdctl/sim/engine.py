"""The simulated engine: a continuous-batching scheduler stepping on the timing model.

Request life cycle (vLLM V1's states)::

    add() --(do_remote_prefill)--> WAITING_FOR_REMOTE_KVS --pull ok--> WAITING --> RUNNING --> FINISHED
      \\-------------------------------------------------------------> WAITING --> RUNNING --> FINISHED

Each step takes running decodes first (one token each), then prefill chunks, within ``max_num_batched_tokens``
and ``max_num_seqs``; without chunked prefill a prompt runs whole or waits. The step's duration comes from
``Profile.step_s`` over everything in the batch, so a long prefill in a colocated worker stretches the decode
tokens of the same step: the interference PD removes.

Generated token = hash(seed, context state[, sampling nonce, i]): the context state is the KV chain's last value
when the prompt's KV bytes the engine holds (computed locally or pulled from a prefill) are intact, and advances
with each generated token as the chain does (:func:`pdctl.sim.kv.context_state`); corrupted KV gives a digest of
the bytes instead. So intact KV gives colocated output exactly, and greedy output is causal: a request re-issued
with the tokens generated so far appended to its prompt continues token for token (what the gateway's
mid-stream migration relies on). A seeded sampled request draws from its seed's stream by output index, as
vLLM's per-request generator does, so a re-issued one draws afresh.

Beside the scheduler, each engine has its prefix cache (:mod:`pdctl.sim.prefix_cache`) and its KV connector
(:mod:`pdctl.sim.connector`: NIXL-like pulls and leases, or shared storage), which holds a request while its KV
is pulled and takes each finished prefill's KV.

Prefix caching follows vLLM's ``KVCacheManager.cache_blocks``: at each step a request's full blocks whose KV is
computed by then enter the cache, the prompt's chunk by chunk, then the generated tokens' as the decode fills
them (a block's last token is computed one step after it is sampled, so the final token never is); a decode
whose KV came from a prefill caches the pulled blocks at its first step. Each step that changed the cache
publishes one batch of KV events (:mod:`pdctl.sim.kv_events`), as vLLM's scheduler does after a model step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdctl.sim import kv as kvmod
from pdctl.sim import logfmt as L
from pdctl.sim import logprobs as lp
from pdctl.sim.connector import KVConnector, KVSettings, SideChannelInUse
from pdctl.sim.faults import FaultSet
from pdctl.sim.kv_events import NullEventPublisher, Publisher
from pdctl.sim.metrics import SimMetrics
from pdctl.sim.prefix_cache import PrefixCache
from pdctl.sim.text import Tokenizer
from pdctl.sim.timing import Link, Profile
from pdctl.vllm.kv_events import KVEventBatch

__all__ = ["EngineConfig", "KVSettings", "SideChannelInUse", "SimEngine", "SimRequest", "StreamEvent"]

State = Literal["WAITING_FOR_REMOTE_KVS", "WAITING", "RUNNING", "FINISHED"]


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
    num_gpu_blocks_override: int | None = None
    """The prefix cache's capacity in blocks (default: the profile's KV capacity, at least 1024 blocks)."""
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
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks so far
    cached_blocks: int = 0  # leading blocks in the prefix cache: hit or stored by this request

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_ids)


class SimEngine:
    """Scheduler and step loop of one simulated vLLM instance, with its prefix cache and KV connector."""

    def __init__(
        self,
        cfg: EngineConfig,
        faults: FaultSet | None = None,
        log: L.VllmLog | None = None,
        metrics: SimMetrics | None = None,
        on_crash: Callable[[int], None] | None = None,
        kv_events: Publisher | None = None,
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
        self.kv_events: Publisher = kv_events or NullEventPublisher()
        self.prefix = PrefixCache(
            cfg.block_size,
            cfg.num_gpu_blocks_override or max(1024, cfg.profile.kv_capacity_tokens // cfg.block_size),
            enabled=cfg.enable_prefix_caching,
            record_events=kv_events is not None and not isinstance(kv_events, NullEventPublisher),
        )
        self.metrics.cache_config(cfg.block_size, self.prefix.capacity_blocks, cfg.enable_prefix_caching)
        self.connector = KVConnector(self)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_crash = on_crash or (lambda code: os._exit(code))
        self.finished_count = 0
        self.total_generated = 0
        self.total_computed = 0
        self._stall_until = 0.0
        self._seed_bytes = f"{cfg.seed}".encode()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the connector (for NIXL-like ones the side channel and the lease reaper) and the step loop."""
        await self.connector.start()
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
        await self.connector.close()

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
        req.block_keys = self.prefix.block_keys(req.prompt_ids, req.cache_salt) if self.prefix.enabled else []
        hits = self.prefix.hits(req.prompt_ids, req.cache_salt, req.block_keys)
        req.cached_blocks = hits // self.cfg.block_size
        req.cached_tokens = hits
        req.num_computed = hits
        if self.prefix.enabled:
            # vLLM counts each admitted prompt's tokens as queries and its locally cached ones as hits.
            self.metrics.c(self.metrics.prefix_queries).inc(req.prompt_len)
            self.metrics.c(self.metrics.prefix_hits).inc(hits)
        if self.connector.admit(req):
            return
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

    # ------------------------------------------------------------------ KV
    def _kv_bytes(self, req: SimRequest, start: int = 0) -> bytes:
        return kvmod.compute_kv(self.cfg.seed, self.cfg.model, req.prompt_ids, self.cfg.per_token_bytes, start)

    def _set_digest(self, r: SimRequest, data: bytes) -> bytes:
        return kvmod.context_state(self.cfg.seed, self.cfg.model, r.prompt_ids, self.cfg.per_token_bytes, data)

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
        return sum(r.prompt_len + len(r.output_ids) for r in self.running) + self.connector.store.held_tokens

    def _apply(self, prefill: Sequence[tuple[SimRequest, int]], decode: Sequence[SimRequest]) -> None:
        for r, chunk in prefill:
            if r.state != "RUNNING":
                continue
            r.num_computed += chunk
            self._cache_blocks(r, min(r.num_computed, r.prompt_len))
            if r.num_computed >= r.prompt_len:
                self._prefill_done(r)
                self._emit(r)
        for r in decode:
            if r.state == "RUNNING":
                if not r.digest:
                    if r.kv_ready:
                        # vLLM caches pulled blocks less the last prompt token, which the first step recomputes.
                        self._cache_blocks(r, r.prompt_len - 1)
                    self._prefill_done(r)
                # This step computes the KV of the last token sampled (or of the prompt's end).
                self._cache_blocks(r, r.prompt_len + len(r.output_ids))
                self._emit(r)
        self._update_gauges()
        self._publish_events()

    def _cache_blocks(self, r: SimRequest, num_tokens: int) -> None:
        """The request's full blocks within its first ``num_tokens`` tokens enter the prefix cache."""
        full = num_tokens // self.cfg.block_size
        if not self.prefix.enabled or full <= r.cached_blocks:
            return
        tokens = r.prompt_ids if num_tokens <= r.prompt_len else r.prompt_ids + r.output_ids
        if len(r.block_keys) < full:
            self.prefix.block_keys(tokens[: full * self.cfg.block_size], r.cache_salt, r.block_keys)
        r.cached_blocks = self.prefix.store(tokens, r.block_keys[:full], r.cached_blocks, r.cache_salt)

    def _publish_events(self) -> None:
        events = self.prefix.take_events()
        if events:
            self.kv_events.publish(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))

    def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache``: drop the cache unless a request still holds blocks (vLLM's
        ``BlockPool.reset_prefix_cache``); AllBlocksCleared goes out with the next step's events."""
        held = sum(r.prompt_len + len(r.output_ids) for r in [*self.waiting, *self.running, *self.remote_wait])
        held += self.connector.store.held_tokens
        if held:
            blocks = -(-held // self.cfg.block_size)
            self.log.warning(L.W_RESET_FAILED, f"Failed to reset prefix cache because some blocks ({blocks}) are "
                             "not freed yet")  # fmt: skip
            return False
        self.prefix.reset()
        self.log.info(L.W_RESET_OK, "Successfully reset prefix cache")
        return True

    def _prefill_done(self, r: SimRequest) -> None:
        if r.kv_prefix:
            start = len(r.kv_prefix) // self.cfg.per_token_bytes
            data = r.kv_prefix + (self._kv_bytes(r, start) if start < r.prompt_len else b"")
        else:
            data = self._kv_bytes(r)
            if not r.kv_ready:
                self._count_sources(r)
        r.digest = self._set_digest(r, data)
        self.connector.publish(r, data)

    def _token(self, r: SimRequest, i: int) -> tuple[int, int]:
        draw = r.nonce + i.to_bytes(4, "little") if r.nonce else b""
        h = hashlib.blake2b(self._seed_bytes + r.digest + draw, digest_size=8)
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
        r.digest = kvmod.next_state(r.digest, tid)
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
            self.connector.flush_metrics()
