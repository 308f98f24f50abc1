"""The ``agent`` workload: multi-turn conversations, each a closed loop of turns.

Shaped on vLLM's multi-turn generator (benchmarks/multi_turn/bench_dataset.py with generate_multi_turn.json). Its
defaults are pdctl's: 24 conversations; 6 to 9 requests each (vLLM counts 12 to 18 messages, user and assistant);
a system prompt of 500 tokens shared by every conversation; a per-conversation context drawn from a lognormal
distribution with mean 1,000 tokens (median 0.85 of the mean, the sample rescaled to the mean, capped at 5x, as
vLLM draws it); user turns uniform in 120-160 tokens; answers uniform in 80-120 tokens (``max_tokens`` with
``ignore_eos``). All lengths are drawn from the seed, so every run sends the same shapes.

Each request carries the whole history as chat messages: ``system`` (the shared prompt, which starts with the run's
tag ``[bench RUN-ID SEED]``), ``user`` (the conversation's context, then its first message), then ``assistant`` and
``user`` alternating, each assistant message being the answer's text as it streamed back. Turn k+1 is sent when turn
k's answer has ended. A failed turn ends its conversation: its later turns would need its answer. On the
completions endpoint the prompt is the messages' contents joined by blank lines, which grows the same way.

The loop itself (:func:`run_conversations`) takes any :class:`TurnSource`: this module's :class:`ConversationPlan`,
or the agent clients' sessions (:class:`pdctl.bench.agent_clients.ClientPlan`), which build each request from the
answers before it.

Arrivals: conversations start at the run's arrival times (``--rate`` conversations per second, ``--burstiness``)
or all at once (no rate); ``--concurrency N`` lets at most N conversations run at once, the wait for a slot being
the first turn's queue time; ``--duration S`` sends no turn after S seconds.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdctl.bench.arrivals import arrival_offsets
from pdctl.bench.client import BenchClient, RequestResult, raise_if_cancelled
from pdctl.bench.workload import BenchRequest, WorkloadSpec, estimate_tokens, random_words

__all__ = [
    "Conversation",
    "ConversationPlan",
    "TurnSource",
    "context_lengths",
    "plan_conversations",
    "run_conversations",
]

# vLLM's lognormal "average" form: median = 0.85 x mean, and no sample above MAX_FACTOR x the mean.
MEDIAN_RATIO = 0.85
MAX_FACTOR = 5


class TurnSource(Protocol):
    """Conversations sent turn by turn: how many requests each has, and each request given the answers before it."""

    @property
    def total(self) -> int:
        """How many requests the run sends when every turn succeeds."""
        ...

    def steps(self) -> list[int]:
        """Per conversation, how many requests it sends."""
        ...

    def request(self, conversation: int, k: int, answers: Sequence[str]) -> BenchRequest:
        """Request ``k`` (0-based) of ``conversation``; ``answers``: the texts of its requests before ``k``."""
        ...


@dataclass(frozen=True, slots=True)
class Conversation:
    """One conversation: its context, its user turns and each turn's answer budget (``max_tokens``)."""

    index: int
    first: int  # the request index of its first turn (indices run over all conversations' turns)
    context: str
    users: tuple[str, ...]
    answers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    """A run's conversations behind one shared system prompt."""

    system: str
    conversations: tuple[Conversation, ...]

    @property
    def total(self) -> int:
        """How many requests the run sends when every turn succeeds."""
        return sum(len(c.users) for c in self.conversations)

    def steps(self) -> list[int]:
        """Per conversation, its turns."""
        return [len(c.users) for c in self.conversations]

    def request(self, conversation: int, k: int, answers: Sequence[str]) -> BenchRequest:
        """Turn ``k`` of ``conversation``: the system prompt, then user and assistant messages alternating."""
        conv = self.conversations[conversation]
        history: tuple[tuple[str, str], ...] = (("system", self.system),)
        for j in range(k + 1):
            user = conv.users[j]
            history += (("user", f"{conv.context}\n\n{user}" if j == 0 and conv.context else user),)
            if j < k:
                history += (("assistant", answers[j]),)
        return _turn_request(conv, k, history)


def context_lengths(n: int, mean: int, rng: random.Random) -> list[int]:
    """``n`` per-conversation context lengths: lognormal with median ``0.85 x mean``, rescaled so the sample's
    mean is ``mean``, each capped at ``5 x mean`` (vLLM's ``LognormalDistribution(average=...)``)."""
    if mean <= 0:
        return [0] * n
    sigma = math.sqrt(2.0 * math.log(1.0 / MEDIAN_RATIO))
    raw = [rng.lognormvariate(math.log(MEDIAN_RATIO * mean), sigma) for _ in range(n)]
    scale = mean / (sum(raw) / n)
    return [round(min(x * scale, MAX_FACTOR * mean)) for x in raw]


def plan_conversations(spec: WorkloadSpec, run_id: str = "") -> ConversationPlan:
    """The run's conversations, the same for the same spec; only the system prompt's tag depends on ``run_id``."""
    rng = random.Random(f"agent-{spec.seed}")
    tag = ""
    if spec.unique:
        tag = f"[bench {run_id} {spec.seed}] " if run_id else f"[bench {spec.seed}] "
    system = tag + random_words(rng, spec.system_len - (estimate_tokens(tag) if tag else 0))
    contexts = context_lengths(spec.conversations, spec.context_len, rng)
    conversations: list[Conversation] = []
    first = 0
    for i, n_context in enumerate(contexts):
        turns = rng.randint(*spec.turns)
        users = tuple(random_words(rng, rng.randint(*spec.user_len)) for _ in range(turns))
        answers = tuple(rng.randint(*spec.answer_len) for _ in range(turns))
        conversations.append(Conversation(i, first, random_words(rng, n_context), users, answers))
        first += turns
    return ConversationPlan(system, tuple(conversations))


def _turn_request(conv: Conversation, k: int, history: tuple[tuple[str, str], ...]) -> BenchRequest:
    text = "\n\n".join(content for _, content in history)
    return BenchRequest(
        conv.first + k, text, conv.answers[k], estimate_tokens(text), "agent", ignore_eos=True,
        messages=history, conversation=conv.index, turn=k + 1,
    )  # fmt: skip


async def run_conversations(
    plan: TurnSource,
    client: BenchClient,
    *,
    t0: float,
    rate: float,
    burstiness: float,
    seed: int,
    concurrency: int | None,
    duration_s: float | None,
    request_id_prefix: str,
    on_send: Callable[[], None],
    record: Callable[[RequestResult], None],
) -> None:
    """Send every conversation's turns in order (see the module docstring), handing each result to ``record``."""
    steps = plan.steps()
    n = len(steps)
    offsets = [0.0] * n if math.isinf(rate) else arrival_offsets(n, rate, burstiness, seed)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    deadline = t0 + duration_s if duration_s is not None else math.inf

    async def turns(conv: int, offset: float, waited: float) -> None:
        answers: list[str] = []
        for k in range(steps[conv]):
            now = time.perf_counter()
            if now >= deadline:
                return
            req = plan.request(conv, k, answers)
            on_send()
            res = await client.send(
                req,
                t0=t0,
                scheduled_s=offset if k == 0 else now - t0,
                request_id=f"{request_id_prefix}-{req.index}",
                queue_s=waited if k == 0 else 0.0,
                keep_text=True,
            )
            record(res)
            raise_if_cancelled()
            if not res.success:
                return
            answers.append(res.text)

    async def converse(conv: int, offset: float) -> None:
        # The event loop's timer may wake up to a millisecond early: never start before the schedule.
        while (delay := t0 + offset - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        if slots is None:
            await turns(conv, offset, 0.0)
            return
        before = time.perf_counter()
        async with slots:
            await turns(conv, offset, time.perf_counter() - before)

    await asyncio.gather(*(converse(c, off) for c, off in enumerate(offsets)))
