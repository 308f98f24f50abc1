"""Workloads: what each benchmark request asks for.

Every workload produces :class:`BenchRequest` objects by index, deterministically for a seed, so a run can be
repeated exactly and a duration-bound run can draw as many requests as it needs. Prompts are made unique by a
leading tag unless ``unique=False``: a shared prefix would let vLLM's prefix cache skip prefill work and hide
exactly the cost that PD disaggregation moves. The tag carries the run's id (:func:`new_run_id`, three words),
so no two runs send the same prompt either: a sweep's second rate, an A/B's second side and a second
``pdctl bench`` against the same workers all start cold. Lengths and the text after the tag depend on the seed
alone.

* ``doc``      -- the recipe's two test prompts, alternating (32 and 256 output tokens).
* ``random``   -- input/output lengths drawn uniformly in ``[L(1-r), L(1+r)]``, optional shared prefix.
* ``mixed``    -- short chats plus a fraction of long prompts: the recipe's interference scenario.
* ``sharegpt`` -- a ShareGPT JSON file (first human turn -> prompt, the reply's length -> max_tokens).
* ``trace``    -- a JSONL trace of timestamps and lengths, replayed in time.
* ``shared-prefix`` -- SGLang's generated shared prefix: groups of prompts, each group behind one system prompt.
* ``agent``    -- multi-turn conversations, sent turn by turn by :mod:`pdctl.bench.conversation` (closed loop);
  this module only validates their spec and makes their warm-up prompts.
* ``claude-code``, ``codex`` -- sessions as those clients send them (``/v1/messages``, ``/v1/responses``), sent turn
  by turn like ``agent``, each request built by :mod:`pdctl.bench.agent_clients`.

The tag of a ``shared-prefix`` prompt names its group, not the request (``[bench RUN-ID SEED-gGROUP]``), and
starts the group's system prompt, so a group's prompts share that prompt within a run and no run shares it with
another. The ``agent`` workload's shared system prompt starts with ``[bench RUN-ID SEED]``, the same for every
conversation of a run.

Token counts of synthetic prompts are estimates (one common English word per token); the client records the
server's own ``usage.prompt_tokens`` when it reports one.
"""

from __future__ import annotations

import json
import math
import random
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pdctl.config.recipe import RECIPE_REQUESTS
from pdctl.errors import PdctlError
from pdctl.vllm.words import WORDS

__all__ = [
    "CONVERSATIONAL",
    "DOC_PROMPTS",
    "WARMUP_BASE",
    "WORDS",
    "WORKLOADS",
    "BenchRequest",
    "RequestKind",
    "Route",
    "Workload",
    "WorkloadError",
    "WorkloadSpec",
    "estimate_tokens",
    "make_workload",
    "new_run_id",
    "random_words",
]

RequestKind = Literal[
    "doc", "random", "short", "long", "sharegpt", "trace", "shared-prefix", "agent", "claude-code", "codex", "subagent"
]
WORKLOADS = ("doc", "random", "mixed", "sharegpt", "trace", "shared-prefix", "agent", "claude-code", "codex")
#: Workloads sent turn by turn (:mod:`pdctl.bench.conversation`).
CONVERSATIONAL = ("agent", "claude-code", "codex")
Route = Literal["", "messages", "responses"]

# The recipe's two verification requests (section 4), in its own words.
DOC_PROMPTS: tuple[tuple[str, int], ...] = tuple((r.prompt, r.max_tokens) for r in RECIPE_REQUESTS)


# Warm-up requests' indices start here, far above any run's own.
WARMUP_BASE = 10_000_000


class WorkloadError(PdctlError):
    """A workload option or input file is unusable (the message names the file/field and the fix)."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: the prompt, the output budget, and (for traces) its arrival time."""

    index: int
    prompt: str
    max_tokens: int
    prompt_len: int
    kind: RequestKind
    arrival_s: float | None = None
    ignore_eos: bool = False
    # A chat history ``(role, content), ...`` to send instead of ``prompt`` (``prompt`` then holds its text).
    messages: tuple[tuple[str, str], ...] = ()
    conversation: int | None = None
    turn: int | None = None
    # An agent client's request: its API (``""``: the client's ``--endpoint``), its JSON body less ``model`` and
    # ``stream``, and its own headers (the session's).
    route: Route = ""
    body: dict[str, Any] | None = None
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The parameters of a workload, as given on the command line (``--workload`` and friends)."""

    name: str = "doc"
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    long_fraction: float = 0.1
    long_len: int = 4096
    long_output_len: int = 16
    short_len: int = 128
    path: str | None = None
    trace_speed: float = 1.0
    unique: bool = True
    seed: int = 0
    # agent: conversations, requests per conversation (min, max), shared system prompt, per-conversation context
    # (lognormal mean), user turn and answer tokens (min, max); shared-prefix: groups, prompts per group, the
    # group's system prompt (``system_len``) and the question.
    conversations: int = 24
    turns: tuple[int, int] = (6, 9)
    system_len: int = 500
    context_len: int = 1000
    user_len: tuple[int, int] = (120, 160)
    answer_len: tuple[int, int] = (80, 120)
    groups: int = 64
    prompts_per_group: int = 16
    question_len: int = 128
    extra: dict[str, Any] = field(default_factory=dict)


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate: one token per word or punctuation mark, one per CJK character."""
    return max(1, len(re.findall(r"[\u3000-\u9fff\uac00-\ud7af]|[A-Za-z0-9_]+|[^\sA-Za-z0-9_]", text)))


def new_run_id() -> str:
    """A fresh id for one run's prompt tags: three common words (one token each, so every id costs the same).

    About 10⁷ ids: two runs share one with odds of 10⁻⁷.
    """
    return " ".join(secrets.choice(WORDS) for _ in range(3))


def random_words(rng: random.Random, n: int) -> str:
    """``n`` common words drawn by ``rng``, space-separated (about one token each)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(0, n)))


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    lo = max(1, math.floor(mean * (1.0 - ratio)))
    hi = max(lo, math.ceil(mean * (1.0 + ratio)))
    return rng.randint(lo, hi)


class Workload:
    """A deterministic source of :class:`BenchRequest` by index (see the module docstring for the kinds)."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._items: list[tuple[str, int, float | None]] = []
        self._prefix = ""
        if spec.name == "random" and spec.prefix_len > 0:
            self._prefix = random_words(random.Random(f"prefix-{spec.seed}"), spec.prefix_len) + " "
        self._order: list[int] = []
        if spec.name == "shared-prefix":
            # SGLang shuffles the groups' prompts together (unless --gsp-ordered).
            self._order = list(range(spec.groups * spec.prompts_per_group))
            random.Random(spec.seed).shuffle(self._order)
        if spec.name == "sharegpt":
            self._items = _load_sharegpt(spec)
        elif spec.name == "trace":
            self._items = _load_trace(spec)

    @property
    def name(self) -> str:
        """The workload's name (``doc``, ``random``, ...)."""
        return self.spec.name

    @property
    def size(self) -> int | None:
        """How many distinct requests a file-based or shared-prefix workload holds (None: unbounded)."""
        if self.spec.name == "shared-prefix":
            return len(self._order)
        return len(self._items) if self.spec.name in ("sharegpt", "trace") else None

    @property
    def conversational(self) -> bool:
        """True for ``agent``, ``claude-code`` and ``codex``: their requests come turn by turn from
        :mod:`pdctl.bench.conversation`."""
        return self.spec.name in CONVERSATIONAL

    @property
    def timed(self) -> bool:
        """True for a trace, whose own timestamps set the arrivals."""
        return self.spec.name == "trace"

    def _tag(self, index: int, run_id: str) -> str:
        if not self.spec.unique:
            return ""
        return f"[bench {run_id} {self.spec.seed}-{index}] " if run_id else f"[bench {self.spec.seed}-{index}] "

    def warmup_request(self, k: int, run_id: str = "") -> BenchRequest:
        """The ``k``-th warm-up request: like the run's own, but for ``agent`` and ``shared-prefix`` a lone prompt
        with a tag of its own, so the warm-up does not put a shared system prompt into a cache before the run (for
        ``claude-code`` and ``codex`` on their own API)."""
        spec = self.spec
        index = WARMUP_BASE + k
        if spec.name not in (*CONVERSATIONAL, "shared-prefix"):
            return self.request(index, run_id)
        agent = spec.name in CONVERSATIONAL
        n_in = spec.user_len[0] if agent else spec.question_len
        n_out = spec.answer_len[0] if agent else spec.output_len
        kind: RequestKind = "agent" if agent else "shared-prefix"
        prompt = self._tag(index, run_id) + random_words(random.Random(f"warmup-{spec.seed}-{k}"), n_in)
        if spec.name == "claude-code":
            body = {"max_tokens": n_out, "messages": [{"role": "user", "content": prompt}]}
            return BenchRequest(index, prompt, n_out, estimate_tokens(prompt), "claude-code", route="messages",
                                body=body)  # fmt: skip
        if spec.name == "codex":
            body = {"max_output_tokens": n_out, "input": prompt, "store": False}
            return BenchRequest(index, prompt, n_out, estimate_tokens(prompt), "codex", route="responses", body=body)
        return BenchRequest(index, prompt, n_out, estimate_tokens(prompt), kind, ignore_eos=True)

    def group_prompt(self, group: int, run_id: str = "") -> str:
        """``shared-prefix``: the system prompt of ``group`` in the run ``run_id`` (its tag first)."""
        spec = self.spec
        tag = ""
        if spec.unique:
            tag = f"[bench {run_id} {spec.seed}-g{group}] " if run_id else f"[bench {spec.seed}-g{group}] "
        n_body = spec.system_len - (estimate_tokens(tag) if tag else 0)
        return tag + random_words(random.Random(f"group-{spec.seed}-{group}"), n_body)

    def request(self, index: int, run_id: str = "") -> BenchRequest:
        """The request at ``index`` of the run ``run_id`` (the same every time for the same spec and run id)."""
        spec = self.spec
        rng = random.Random(spec.seed * 1_000_003 + index)
        if spec.name in CONVERSATIONAL:
            raise WorkloadError(f"{spec.name} requests come turn by turn from pdctl.bench.conversation, not by index")
        if spec.name == "shared-prefix":
            group, nth = divmod(self._order[index % len(self._order)], spec.prompts_per_group)
            question = random_words(random.Random(f"question-{spec.seed}-{group}-{nth}"), spec.question_len)
            prompt = f"{self.group_prompt(group, run_id)}\n\n{question}"
            n_in = spec.system_len + spec.question_len
            return BenchRequest(index, prompt, spec.output_len, n_in, "shared-prefix", ignore_eos=True)
        tag = self._tag(index, run_id)
        if spec.name == "doc":
            text, max_tokens = DOC_PROMPTS[index % len(DOC_PROMPTS)]
            prompt = tag + text
            return BenchRequest(index, prompt, max_tokens, estimate_tokens(prompt), "doc")
        if spec.name == "random":
            n_in = _lengths(rng, spec.input_len, spec.range_ratio)
            n_out = _lengths(rng, spec.output_len, spec.range_ratio)
            n_body = n_in - spec.prefix_len - (estimate_tokens(tag) if tag else 0)
            body = random_words(rng, n_body)
            prompt = (self._prefix + tag + body) if self._prefix else (tag + body)
            return BenchRequest(index, prompt, n_out, max(1, n_in), "random", ignore_eos=True)
        if spec.name == "mixed":
            is_long = rng.random() < spec.long_fraction
            mean_in = spec.long_len if is_long else spec.short_len
            n_in = _lengths(rng, mean_in, spec.range_ratio)
            n_out = spec.long_output_len if is_long else _lengths(rng, spec.output_len, spec.range_ratio)
            prompt = tag + random_words(rng, n_in - estimate_tokens(tag) if tag else n_in)
            return BenchRequest(index, prompt, n_out, n_in, "long" if is_long else "short", ignore_eos=True)
        if not self._items:
            raise WorkloadError(f"workload {spec.name!r} has no requests")
        text, n_out, at = self._items[index % len(self._items)]
        prompt = tag + text
        kind: RequestKind = "trace" if spec.name == "trace" else "sharegpt"
        arrival = None
        if at is not None:
            laps = index // len(self._items)
            span = self._items[-1][2] or 0.0
            arrival = (at + laps * span) / spec.trace_speed
        n_in = estimate_tokens(prompt)
        return BenchRequest(index, prompt, n_out, n_in, kind, arrival, ignore_eos=kind == "trace")


def make_workload(spec: WorkloadSpec) -> Workload:
    """Validate ``spec`` and build its :class:`Workload`."""
    if spec.name not in WORKLOADS:
        raise WorkloadError(
            f"unknown workload {spec.name!r}",
            hint="use one of doc, random, mixed, sharegpt:FILE, trace:FILE, shared-prefix, agent, claude-code, codex",
        )
    if spec.name in CONVERSATIONAL:
        _check_agent(spec)
    elif spec.name == "shared-prefix":
        _check_shared_prefix(spec)
    if spec.input_len < 1 or spec.output_len < 1 or spec.long_len < 1 or spec.short_len < 1:
        raise WorkloadError("input/output lengths must be >= 1")
    if not 0.0 <= spec.range_ratio < 1.0:
        raise WorkloadError(f"--range-ratio must be in [0, 1), got {spec.range_ratio}")
    if not 0.0 <= spec.long_fraction <= 1.0:
        raise WorkloadError(f"--long-fraction must be in [0, 1], got {spec.long_fraction}")
    shortest = spec.input_len * (1 - spec.range_ratio)
    if spec.prefix_len < 0 or (spec.name == "random" and spec.prefix_len >= shortest):
        raise WorkloadError(
            f"--prefix-len {spec.prefix_len} must be >= 0 and shorter than the shortest input",
            hint="lower --prefix-len or raise --input-len",
        )
    if spec.trace_speed <= 0:
        raise WorkloadError(f"--trace-speed must be > 0, got {spec.trace_speed}")
    if spec.name in ("sharegpt", "trace") and not spec.path:
        raise WorkloadError(f"workload {spec.name} needs a file", hint=f"use --workload {spec.name}:PATH")
    return Workload(spec)


def _at_least(flag: str, value: int, low: int, hint: str) -> None:
    if value < low:
        raise WorkloadError(f"{flag} {value}: must be at least {low}", hint=hint)


def _check_range(flag: str, value: tuple[int, int], low: int, hint: str) -> None:
    lo, hi = value
    shown = f"{lo}:{hi}" if lo != hi else str(lo)
    if lo < low:
        raise WorkloadError(f"{flag} {shown}: must be at least {low}", hint=hint)
    if hi < lo:
        raise WorkloadError(f"{flag} {shown}: MIN is above MAX", hint=hint)


def _check_agent(spec: WorkloadSpec) -> None:
    _at_least("--conversations", spec.conversations, 1, "e.g. --conversations 24")
    _check_range("--turns", spec.turns, 1, "requests per conversation, e.g. --turns 6:9 or --turns 3")
    _at_least("--system-len", spec.system_len, 8, "the shared system prompt's tokens, e.g. --system-len 500")
    _at_least("--context-len", spec.context_len, 0, "the mean per-conversation context, e.g. --context-len 1000")
    _check_range("--user-len", spec.user_len, 1, "tokens per user turn, e.g. --user-len 120:160")
    _check_range("--answer-len", spec.answer_len, 1, "tokens per answer, e.g. --answer-len 80:120")


def _check_shared_prefix(spec: WorkloadSpec) -> None:
    _at_least("--groups", spec.groups, 1, "e.g. --groups 64")
    _at_least("--prompts-per-group", spec.prompts_per_group, 1, "e.g. --prompts-per-group 16")
    _at_least("--system-len", spec.system_len, 8, "the group's system prompt tokens, e.g. --system-len 2048")
    _at_least("--question-len", spec.question_len, 1, "e.g. --question-len 128")


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: not UTF-8 text") from None


def _load_sharegpt(spec: WorkloadSpec) -> list[tuple[str, int, float | None]]:
    path = spec.path or ""
    try:
        data = json.loads(_read(path))
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: expected a JSON list of conversations (ShareGPT format)")
    items: list[tuple[str, int, float | None]] = []
    for conv in data:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, reply = first.get("value"), second.get("value")
        if not isinstance(prompt, str) or not isinstance(reply, str) or not prompt.strip():
            continue
        items.append((prompt, max(1, estimate_tokens(reply)), None))
    if not items:
        raise WorkloadError(
            f"{path}: no usable conversation",
            hint='each entry needs "conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]',
        )
    random.Random(spec.seed).shuffle(items)
    return items


def _trace_int(path: str, lineno: int, row: dict[str, Any], *names: str) -> int:
    for name in names:
        value = row.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    raise WorkloadError(f"{path}:{lineno}: {names[0]}: expected an integer >= 1, got {row.get(names[0])!r}")


def _load_trace(spec: WorkloadSpec) -> list[tuple[str, int, float | None]]:
    path = spec.path or ""
    rows: list[tuple[float, int, int]] = []
    for lineno, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{path}:{lineno}: expected a JSON object per line")
        if isinstance(row.get("timestamp_ms"), int | float):
            at = float(row["timestamp_ms"]) / 1000.0
        elif isinstance(row.get("timestamp"), int | float):
            at = float(row["timestamp"])
        else:
            raise WorkloadError(
                f"{path}:{lineno}: timestamp: missing or not a number",
                hint='each line needs "timestamp" (seconds) or "timestamp_ms", "input_len", "output_len"',
            )
        n_in = _trace_int(path, lineno, row, "input_len", "input_length")
        n_out = _trace_int(path, lineno, row, "output_len", "output_length")
        rows.append((at, n_in, n_out))
    if not rows:
        raise WorkloadError(f"{path}: the trace has no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    items: list[tuple[str, int, float | None]] = []
    for i, (at, n_in, n_out) in enumerate(rows):
        rng = random.Random(spec.seed * 1_000_003 + i)
        items.append((random_words(rng, n_in), n_out, at - t0))
    return items
