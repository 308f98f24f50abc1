"""Fault injection for the simulator: ``--sim-fault NAME[:ARG][@MOD...]`` (repeatable, combinable).

=====================  =========================================================================  ==========
name[:ARG]             effect                                                                     default
=====================  =========================================================================  ==========
fail-start[:CODE]      log an engine error and exit with CODE before binding any port             CODE 1
crash-after:N          exit (code 1, like a dead EngineCore) once N requests have finished       --
crash-mid-stream[:K]   die (SIGKILL-like ``os._exit(137)``) after K streamed tokens of a request   K 3
stall[:SECONDS]        the engine stops stepping for SECONDS (forever if omitted); /health stays OK forever
no-kv-params           a prefill leg returns ``kv_transfer_params: null`` (the silent fallback)   --
corrupt-kv             KV bytes are corrupted (when served by prefill, or when received by decode) --
slow-kv:SECONDS        every KV transfer takes SECONDS (simulated) longer                         --
handshake-fail         the NIXL handshake fails (decode: ``handshake_setup_failed``, HTTP 500)    first pull
near-tie[:N]           output token N of every request is a near-tie (0.01 nats); a request whose  N 0
                       KV was pulled from prefill takes the runner-up (a batch-shape rounding
                       difference); an opportunity is one such request
model-name:NAME        /v1/models and responses report NAME instead of the served name           --
tokenizer[:VARIANT]    a different tokenizer: other token ids for the same text                   VARIANT 1
ignore-sigterm         SIGTERM is logged and ignored (only SIGKILL stops the worker)              --
orphan-child           spawn a child in the same process group that outlives a SIGKILL of the     --
                       worker unless the whole group is killed (like VLLM::EngineCore)
=====================  =========================================================================  ==========

Modifiers, each ``@key=value``: ``@p=F`` fires with probability F per opportunity (seeded by ``--sim-seed``);
``@after=N`` skips the first N opportunities; ``@times=N`` fires at most N times. An opportunity is one request
(or one KV pull for the KV faults). Example: ``--sim-fault corrupt-kv@after=1@p=0.5``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["FAULT_NAMES", "Fault", "FaultSet", "parse_fault"]

FAULT_NAMES = (
    "fail-start",
    "crash-after",
    "crash-mid-stream",
    "stall",
    "no-kv-params",
    "corrupt-kv",
    "slow-kv",
    "handshake-fail",
    "near-tie",
    "model-name",
    "tokenizer",
    "ignore-sigterm",
    "orphan-child",
)
_NEEDS_ARG = {"crash-after", "slow-kv", "model-name"}
_DEFAULT_TIMES = {"handshake-fail": 1}


@dataclass(slots=True)
class Fault:
    """One parsed ``--sim-fault``; ``fires()`` decides each opportunity."""

    name: str
    arg: str | None = None
    p: float = 1.0
    after: int = 0
    times: int | None = None
    seen: int = 0
    fired: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def fires(self) -> bool:
        """Count one opportunity and say whether the fault applies to it."""
        self.seen += 1
        if self.seen <= self.after:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        if self.p < 1.0 and self.rng.random() >= self.p:
            return False
        self.fired += 1
        return True

    def num(self, default: float) -> float:
        """``arg`` as a number (``default`` if absent)."""
        return default if self.arg is None else float(self.arg)


def parse_fault(spec: str, seed: int = 0) -> Fault:
    """Parse one ``NAME[:ARG][@key=value...]`` (ValueError with the accepted forms)."""
    head, *mods = spec.strip().split("@")
    name, _, arg = head.partition(":")
    name = name.strip()
    if name not in FAULT_NAMES:
        raise ValueError(f"unknown --sim-fault {name!r}; known faults: {', '.join(FAULT_NAMES)}")
    if name in _NEEDS_ARG and not arg:
        raise ValueError(f"--sim-fault {name} needs an argument: {name}:VALUE")
    fault = Fault(name, arg or None, times=_DEFAULT_TIMES.get(name), rng=random.Random(f"{seed}:{spec}"))
    try:
        if name in ("fail-start", "crash-after", "crash-mid-stream", "tokenizer", "near-tie") and arg:
            int(arg)
        if name in ("stall", "slow-kv") and arg:
            float(arg)
    except ValueError:
        raise ValueError(f"--sim-fault {spec!r}: {arg!r} is not a number") from None
    for mod in mods:
        key, _, value = mod.partition("=")
        try:
            if key == "p":
                fault.p = float(value)
                if not 0.0 <= fault.p <= 1.0:
                    raise ValueError
            elif key == "after":
                fault.after = int(value)
            elif key == "times":
                fault.times = int(value)
            else:
                raise KeyError(key)
        except KeyError:
            raise ValueError(f"--sim-fault {spec!r}: unknown modifier @{key}; use @p=F, @after=N, @times=N") from None
        except ValueError:
            raise ValueError(f"--sim-fault {spec!r}: bad value in @{mod}") from None
    return fault


class FaultSet:
    """All faults of one worker, looked up by name."""

    def __init__(self, specs: list[str], seed: int = 0) -> None:
        self.faults = [parse_fault(s, seed) for s in specs]

    def get(self, name: str) -> Fault | None:
        """The first fault called ``name``, if configured."""
        for f in self.faults:
            if f.name == name:
                return f
        return None

    def has(self, name: str) -> bool:
        """Whether a fault called ``name`` is configured."""
        return self.get(name) is not None

    def fires(self, name: str) -> bool:
        """Whether the fault ``name`` is configured and fires for this opportunity."""
        f = self.get(name)
        return f is not None and f.fires()
