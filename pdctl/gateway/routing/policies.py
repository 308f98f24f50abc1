"""Per-pool routing policies (``routing.prefill_policy``, ``routing.decode_policy``): which instance of one pool a
request goes to.

Each policy is a function of the pool's available instances, the load this gateway process counts on them
(:attr:`~pdctl.gateway.routing.pool.Instance.in_flight` requests and
:attr:`~pdctl.gateway.routing.pool.Instance.in_flight_tokens` prompt tokens) and, for the request-aware ones, a score
per instance that :class:`pdctl.gateway.routing.chooser.Chooser` computes from its prefix views. Each returns a
:class:`Pick`: the instance, the rule that chose it and the candidates' scores, which the access log carries
(``<role>_pick=<policy>:<rule> <role>_scores=<name>:<score>,...``).

=============== ============================================ ==========================================================
policy          reads                                        chooses
=============== ============================================ ==========================================================
least_loaded    in-flight requests, then tokens              the fewest; ties rotate (under adaptive PD: among the
                                                             instances holding most of the prompt, :func:`prefix_first`)
power_of_two    in-flight requests, then tokens              two at random, the less loaded of them
round_robin     nothing                                      the next in turn
cache_aware     prefix view (share of the prompt held),      imbalanced pool: the least loaded; else the best match
                in-flight requests, the view's size, a       when it holds more than ``cache_threshold`` of the
                prefill's queued prompt tokens               prompt; else the smallest view (SGLang/vllm-router);
                                                             on prefill, a prompt with no match goes to an idle
                                                             instance rather than queue on the smallest view
kv_aware        exact view (events), in-flight tokens        the least Dynamo cost in blocks: prefill
                                                             ``max(in-flight + new - overlap, 0)``, decode
                                                             ``max(new - overlap, 0) + in-flight``; ties at random
=============== ============================================ ==========================================================

A session hint (:func:`pdctl.gateway.agent_sessions.session_hint`: ``x-session-id``, a Responses ``conversation``,
Anthropic's
``metadata.user_id``) only breaks ties, in favour of the instance that served the session last
(:class:`Sessions`); it never overrides a score (sticky sessions measured worse than KV-aware routing in
Dynamo's replay, ai-dynamo/dynamo ``docs/benchmarks/aiperf-session-routing-replay/README.md``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pdctl.config import RoutingConfig

__all__ = [
    "LOAD_POLICIES",
    "Pick",
    "Sessions",
    "by_load",
    "cache_aware",
    "imbalanced",
    "kv_aware",
    "least_loaded",
    "prefix_first",
]

#: The policies that read only the load (:meth:`pdctl.gateway.routing.chooser.Chooser.by_load` applies them with no
#: request).
LOAD_POLICIES = ("least_loaded", "power_of_two", "round_robin")


class Candidate(Protocol):
    """What a policy reads of an instance (:class:`pdctl.gateway.routing.pool.Instance` has it)."""

    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def in_flight_tokens(self) -> int: ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True, slots=True)
class Pick(Generic[C]):
    """One pool's choice for one request: the instance (None: none available), how, and every score seen."""

    instance: C | None
    policy: str
    rule: str
    """``load``, ``session`` (a tie the session hint broke), ``random``, ``turn``, ``imbalanced``, ``match``,
    ``smallest_view``, ``idle``, ``cost``, ``cached`` or ``none``."""
    scores: tuple[tuple[str, float], ...] = ()
    """(instance name, score) per candidate scored: in-flight requests, share of the prompt held, cost in blocks
    or cached tokens, by policy."""

    def log_fields(self, role: str) -> str:
        """The pick as access-log fields (no space inside a value: ``pdctl logs`` and ``pdctl trace`` split on it)."""
        scores = ",".join(f"{name}:{_show(s)}" for name, s in self.scores) or "-"
        return f"{role}_pick={self.policy}:{self.rule} {role}_scores={scores}"


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def _load(i: C) -> tuple[int, int]:
    return i.in_flight, i.in_flight_tokens


def _sticky(tied: Sequence[C], sticky: str | None) -> C | None:
    if sticky is None or len(tied) < 2:
        return None
    return next((i for i in tied if i.name == sticky), None)


def least_loaded(
    cands: Sequence[C], turn: int, sticky: str | None = None, policy: str = "least_loaded", rule: str = "load",
    scores: Sequence[tuple[str, float]] | None = None,
) -> Pick[C]:  # fmt: skip
    """Fewest in-flight requests, then tokens; a tie goes to ``sticky`` (the session's last instance) when tied,
    else rotates with ``turn``. ``scores``: what to log (default: in-flight requests)."""
    shown = tuple(scores) if scores is not None else tuple((i.name, float(i.in_flight)) for i in cands)
    lo = min(_load(i) for i in cands)
    held = _sticky([i for i in cands if _load(i) == lo], sticky)
    if held is not None:
        return Pick(held, policy, "session", shown)
    n = len(cands)
    inst = min(enumerate(cands), key=lambda p: (_load(p[1]), (p[0] - turn) % n))[1]
    return Pick(inst, policy, rule, shown)


def by_load(policy: str, cands: Sequence[C], turn: int, rng: random.Random, sticky: str | None = None) -> Pick[C]:
    """A load-only policy (:data:`LOAD_POLICIES`)."""
    if policy == "round_robin":
        return Pick(cands[turn % len(cands)], policy, "turn", tuple((i.name, float(i.in_flight)) for i in cands))
    if policy == "power_of_two":
        two = rng.sample(list(cands), 2) if len(cands) > 2 else list(cands)
        shown = tuple((i.name, float(i.in_flight)) for i in two)
        lo = min(_load(i) for i in two)
        tied = [i for i in two if _load(i) == lo]
        held = _sticky(tied, sticky)
        if held is not None:
            return Pick(held, policy, "session", shown)
        return Pick(rng.choice(tied), policy, "load" if len(tied) == 1 else "random", shown)
    return least_loaded(cands, turn, sticky)


def imbalanced(cands: Sequence[C], r: RoutingConfig) -> bool:
    """The cache-aware routers' escape: the busiest and idlest instance differ by more than
    ``balance_abs_threshold`` requests in flight and by more than ``balance_rel_threshold`` times."""
    loads = [i.in_flight for i in cands]
    lo, hi = min(loads), max(loads)
    return hi - lo > r.balance_abs_threshold and hi > lo * r.balance_rel_threshold


def prefix_first(
    cands: Sequence[C], cached: Callable[[C], float], r: RoutingConfig, turn: int, sticky: str | None = None
) -> Pick[C]:
    """Adaptive PD's ``least_loaded``: the least loaded among the instances holding the most cached tokens of the
    prompt (an imbalanced pool: among all)."""
    scores = {i: cached(i) for i in cands}
    shown = tuple((i.name, scores[i]) for i in cands)
    if imbalanced(cands, r):
        return least_loaded(cands, turn, sticky, "least_loaded", "imbalanced", shown)
    top = max(scores.values())
    best = [i for i in cands if scores[i] == top]
    return least_loaded(best, turn, sticky, "least_loaded", "cached", shown)


def cache_aware(
    cands: Sequence[C],
    share: Callable[[C], float],
    view_size: Callable[[C], float],
    r: RoutingConfig,
    turn: int,
    sticky: str | None = None,
    queued: Callable[[C], float] | None = None,
) -> Pick[C]:
    """SGLang's and vllm-router's ``cache_aware``: an imbalanced pool -> the least loaded; else the best match if
    it holds more than ``cache_threshold`` of the prompt; else the instance with the smallest view (the most room).
    Ties among the best: the least loaded, then the session, then in turn.

    ``queued`` (a prefill pool: the prompt tokens each instance still has to compute) adds pdctl's idle escape: a
    prompt no instance holds enough of, whose smallest view has work queued, goes to an instance with nothing queued
    (rule ``idle``): it is computed whole either way, so it need not wait. A match never escapes: sending it away
    trades the compute its cache saves for a shorter wait, which at saturation costs throughput (measured)."""
    scores = {i: share(i) for i in cands}
    shown = tuple((i.name, scores[i]) for i in cands)
    if imbalanced(cands, r):
        return least_loaded(cands, turn, sticky, "cache_aware", "imbalanced", shown)
    top = max(scores.values())
    if top > r.cache_threshold:
        return least_loaded([i for i in cands if scores[i] == top], turn, sticky, "cache_aware", "match", shown)
    sizes = {i: view_size(i) for i in cands}
    small = min(sizes.values())
    pick = least_loaded([i for i in cands if sizes[i] == small], turn, sticky, "cache_aware", "smallest_view", shown)
    chosen = pick.instance
    if queued is None or chosen is None or queued(chosen) == 0:
        return pick
    idle = [i for i in cands if queued(i) == 0]
    return least_loaded(idle, turn, sticky, "cache_aware", "idle", shown) if idle else pick


def kv_aware(cands: Sequence[C], cost: Callable[[C], float], rng: random.Random, sticky: str | None = None) -> Pick[C]:
    """Dynamo's KV router: the least cost (``cost``, in blocks); ties to the session's instance, else at random."""
    costs = {i: cost(i) for i in cands}
    shown = tuple((i.name, costs[i]) for i in cands)
    lo = min(costs.values())
    tied = [i for i in cands if costs[i] == lo]
    held = _sticky(tied, sticky)
    if held is not None:
        return Pick(held, "kv_aware", "session", shown)
    return Pick(rng.choice(tied), "kv_aware", "cost" if len(tied) == 1 else "random", shown)


class Sessions:
    """The instance each session last went to, per role: an LRU map of at most ``capacity`` sessions."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._last: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def last(self, role: str, session: str | None) -> str | None:
        """The name of the instance of ``role`` that ``session`` went to last (None: unknown)."""
        return self._last.get((role, session)) if session else None

    def remember(self, role: str, session: str | None, name: str) -> None:
        """``session`` went to instance ``name`` of ``role``."""
        if not session:
            return
        self._last[(role, session)] = name
        self._last.move_to_end((role, session))
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
