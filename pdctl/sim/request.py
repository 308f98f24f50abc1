"""What the simulated scheduler works on: its configuration (:class:`EngineConfig`, with the KV connector's
:class:`KVSettings`), one request (:class:`SimRequest`) and what it streams (:class:`StreamEvent`), and the
:class:`Scheduler` protocol by which the KV connector (:mod:`pdctl.sim.connector`) calls back into the engine
(:class:`pdctl.sim.engine.SimEngine`) to queue, fail or count a request. Below both, so neither imports the other
to name these.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pdctl.sim import logfmt as L
from pdctl.sim.faults import FaultSet
from pdctl.sim.metrics import SimMetrics
from pdctl.sim.timing import Link, Profile
from pdctl.vllm.protocol import connector_kind

__all__ = ["EngineConfig", "KVSettings", "Scheduler", "SimRequest", "State", "StreamEvent"]


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


class Scheduler(Protocol):
    """What the KV connector uses of its engine: its parts, its waiting room and the scheduler's own steps."""

    cfg: EngineConfig
    faults: FaultSet
    log: L.VllmLog
    metrics: SimMetrics
    remote_wait: set[SimRequest]
    """Requests held while their KV is pulled (``WAITING_FOR_REMOTE_KVS``)."""

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of the engine (cancelled when it closes)."""

    def update_gauges(self) -> None:
        """Publish the running, waiting and KV-usage gauges."""

    def count_sources(self, req: SimRequest, external: int = 0) -> None:
        """Count ``req``'s prompt tokens by source (``external``: pulled over the connector)."""

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until the loop's time ``deadline``."""

    def kv_bytes(self, req: SimRequest, start: int = 0) -> bytes:
        """The KV bytes of ``req``'s prompt from token ``start``, as this engine computes them."""

    def enqueue(self, req: SimRequest) -> None:
        """Queue ``req`` for the scheduler (``WAITING``)."""

    def finish(self, r: SimRequest, reason: str, status: int = 0, message: str = "") -> None:
        """End ``r``."""
