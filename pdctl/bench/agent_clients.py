"""The ``claude-code`` and ``codex`` workloads: sessions sent the way the coding agents send them.

Sizes come from the ``agent`` workload's flags: ``--conversations`` sessions, ``--turns`` requests of the main agent
each, a system prompt of ``--system-len`` tokens (the tool definitions take about as many again), a project file of
``--context-len`` tokens read into the first turn (lognormal per session, as ``agent``), tool outputs of
``--user-len`` tokens, answers of ``--answer-len`` (``max_tokens``; no ``ignore_eos``, which neither API has).
Each turn carries the whole session so far, the previous answers as they streamed back, as the clients do.

**claude-code** (``POST /v1/messages``, header ``x-claude-code-session-id``), as Claude Code sends it
(anthropics/claude-code#40652, #24168; sgl-project/sglang#36877; vllm-project/vllm#48874):

* ``system``: the billing line ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli; cch=<5 hex>;`` with
  a new ``cch`` every request, then ``You are Claude Code, ...`` and the long system prompt, each with
  ``cache_control``; ``tools``: eight tools (``Task``, ``Bash``, ``Glob``, ``Grep``, ``Read``, ``Edit``, ``Write``,
  ``TodoWrite``) with long descriptions and JSON schemas;
* turn 1: a ``<system-reminder>`` block (the project file as ``claudeMd``) and the task; each answer is followed by a
  ``tool_use`` block and the next turn opens with its ``tool_result`` (the tool output) and a short
  ``<system-reminder>``; the ``cache_control`` breakpoint sits on the newest block only (it rolls every turn); from
  turn 2 on a trailing ``system`` message (a token budget that changes every turn) ends the request;
* one sub-agent per session of at least two turns: after main turn ``(turns - 1) // 2 + 1`` the main agent calls
  ``Task``, and a sub-agent of ``turns // 2`` turns runs before the main agent goes on (its last answer is the
  ``Task`` result). The sub-agent sends the same system blocks and tools (the parent's prefix) with messages of its
  own, the parent's session id and ``x-claude-code-agent-id`` / ``x-claude-code-parent-agent-id``.

**codex** (``POST /v1/responses``, header ``session-id``), as Codex sends it (openai/codex ``codex-rs/core``):
``instructions`` (the system prompt), function ``tools`` (``shell``, ``apply_patch``, ``update_plan``,
``view_image``), ``input`` items: the project file as ``<user_instructions>`` (AGENTS.md), an
``<environment_context>`` and the task, then per turn the answer (an assistant ``message``), a ``function_call`` and
its ``function_call_output``; ``store: false`` (stateless: the whole ``input`` every turn), ``prompt_cache_key`` the
session id, ``max_output_tokens`` the answer's length. No sub-agents.

The run's tag ``[bench RUN-ID SEED]`` starts the long system prompt (``instructions``), the same for every session of
a run and no other run. Results: ``turn`` is the request's place in its session (1, 2, ...: a sub-agent's requests
count in the session, kind ``subagent``), ``conversation`` the session.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdctl.bench.conversation import context_lengths
from pdctl.bench.workload import BenchRequest, RequestKind, WorkloadSpec, estimate_tokens, random_words

__all__ = ["CLIENTS", "AgentSession", "ClientPlan", "billing_line", "plan_clients"]

#: The workloads of this module.
CLIENTS = ("claude-code", "codex")

_CLAUDE_TOOLS = ("Task", "Bash", "Glob", "Grep", "Read", "Edit", "Write", "TodoWrite")
_CODEX_TOOLS = ("shell", "apply_patch", "update_plan", "view_image")
#: The main agent's tool calls, in turn (Task is the sub-agent's spawn).
_CALLS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("Read", {"file_path": "/repo/src/app.py"}),
    ("Grep", {"pattern": "def test_", "path": "/repo/tests"}),
    ("Bash", {"command": "pytest -x -q", "description": "Run the tests"}),
    ("Edit", {"file_path": "/repo/src/app.py", "old_string": "return None", "new_string": "return value"}),
)
_EPHEMERAL = {"type": "ephemeral"}


def billing_line(rng: random.Random) -> str:
    """Claude Code's attribution line with a version suffix and ``cch`` of its own (new for every request)."""
    return (f"x-anthropic-billing-header: cc_version=2.1.177.{rng.randrange(16**3):03x}; cc_entrypoint=cli; "
            f"cch={rng.randrange(16**5):05x};")  # fmt: skip


@dataclass(frozen=True, slots=True)
class AgentSession:
    """One session: its id, the project file, the task, the tool outputs and each request's answer budget."""

    index: int
    first: int  # the request index of its first request (indices run over all sessions' requests)
    session_id: str
    context: str
    task: str
    outputs: tuple[str, ...]  # a tool output per request after the first (the main agent's, then the sub-agent's)
    answers: tuple[int, ...]  # ``max_tokens`` per request, in the session's order
    turns: int  # the main agent's requests
    sub_turns: int  # the sub-agent's (0: none)

    @property
    def steps(self) -> int:
        """How many requests the session sends."""
        return self.turns + self.sub_turns

    @property
    def spawn(self) -> int:
        """The main turn (0-based) whose tool call starts the sub-agent (meaningless without one)."""
        return (self.turns - 1) // 2

    def role(self, k: int) -> tuple[bool, int]:
        """Request ``k`` of the session: (by the sub-agent?, its turn within its agent, 0-based)."""
        if self.sub_turns and self.spawn < k <= self.spawn + self.sub_turns:
            return True, k - self.spawn - 1
        return False, k if not self.sub_turns or k <= self.spawn else k - self.sub_turns


@dataclass(frozen=True, slots=True)
class ClientPlan:
    """A run's sessions of one client behind its system prompt and tools (:func:`plan_clients`)."""

    client: str
    system: str
    tools: tuple[dict[str, Any], ...]
    sessions: tuple[AgentSession, ...]
    seed: int

    @property
    def total(self) -> int:
        """How many requests the run sends when every request succeeds."""
        return sum(s.steps for s in self.sessions)

    def steps(self) -> list[int]:
        """Per session, its requests (:class:`pdctl.bench.conversation.TurnSource`)."""
        return [s.steps for s in self.sessions]

    def request(self, session: int, k: int, answers: Sequence[str]) -> BenchRequest:
        """Request ``k`` of ``session``, given the answers to its requests before it."""
        s = self.sessions[session]
        sub, _ = s.role(k)
        kind: RequestKind = "subagent" if sub else "claude-code" if self.client == "claude-code" else "codex"
        # A billing line of its own for every request, the same for the same seed (as the rest of the request).
        rng = random.Random(f"{self.client}-{self.seed}-{session}-{k}")
        if self.client == "claude-code":
            body, headers = self._claude(s, k, answers, rng)
        else:
            body, headers = self._codex(s, k, answers)
        text = "\n".join(_strings(body))
        return BenchRequest(s.first + k, text, s.answers[k], estimate_tokens(text), kind, conversation=session,
                            turn=k + 1, body=body, headers=headers,
                            route="messages" if self.client == "claude-code" else "responses")  # fmt: skip

    # ------------------------------------------------------------------------------------------- claude-code

    def _claude(
        self, s: AgentSession, k: int, answers: Sequence[str], rng: random.Random
    ) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
        sub, turn = s.role(k)
        own = [j for j in range(k + 1) if s.role(j)[0] == sub]  # this agent's requests so far, this one last
        messages: list[dict[str, Any]] = []
        for n, j in enumerate(own):
            if n == 0:
                first = s.task if not sub else f"Find where the failing tests of session {s.index} are defined."
                blocks = [{"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can "
                           f"use the following context:\n# claudeMd\n{s.context}\n</system-reminder>"},
                          {"type": "text", "text": first}]  # fmt: skip
                messages.append({"role": "user", "content": blocks})
            else:
                prev = own[n - 1]
                result = s.outputs[prev]
                if not sub and s.sub_turns and prev == s.spawn:  # the Task call's result: the sub-agent's last answer
                    result = answers[s.spawn + s.sub_turns] or "Done."
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": self._tool_id(s, prev), "content": result},
                    {"type": "text", "text": "<system-reminder>\nThe TodoWrite tool hasn't been used recently.\n"
                                             "</system-reminder>"}]})  # fmt: skip
            if j == k:
                break
            content: list[dict[str, Any]] = [{"type": "text", "text": answers[j]}] if answers[j] else []
            name, args = self._call(s, j)
            content.append({"type": "tool_use", "id": self._tool_id(s, j), "name": name, "input": args})
            messages.append({"role": "assistant", "content": content})
        messages[-1]["content"][-1]["cache_control"] = dict(_EPHEMERAL)  # the rolling breakpoint: newest block only
        if turn >= 1:
            messages.append({"role": "system", "content": f"Token budget: {200_000 - 1_000 * k} tokens left."})
        body: dict[str, Any] = {
            "max_tokens": s.answers[k],
            "system": [{"type": "text", "text": billing_line(rng)},
                       {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                        "cache_control": dict(_EPHEMERAL)},
                       {"type": "text", "text": self.system, "cache_control": dict(_EPHEMERAL)}],
            "tools": [dict(t) for t in self.tools],
            "messages": messages,
            "metadata": {"user_id": f"user_bench_account__session_{s.session_id}"},
        }  # fmt: skip
        headers: tuple[tuple[str, str], ...] = (("x-claude-code-session-id", s.session_id),
                                                ("anthropic-version", "2023-06-01"))  # fmt: skip
        if sub:
            headers += (("x-claude-code-agent-id", f"{s.session_id}-agent-1"),
                        ("x-claude-code-parent-agent-id", s.session_id))  # fmt: skip
        return body, headers

    def _tool_id(self, s: AgentSession, j: int) -> str:
        return f"toolu_{s.session_id.replace('-', '')[:16]}{j:04d}"

    def _call(self, s: AgentSession, j: int) -> tuple[str, dict[str, Any]]:
        sub, turn = s.role(j)
        if not sub and s.sub_turns and j == s.spawn:
            return "Task", {"description": "Find the tests", "subagent_type": "general-purpose",
                            "prompt": f"Find where the failing tests of session {s.index} are defined."}  # fmt: skip
        return _CALLS[turn % len(_CALLS)]

    # ------------------------------------------------------------------------------------------------- codex

    def _codex(
        self, s: AgentSession, k: int, answers: Sequence[str]
    ) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
        def said(text: str) -> dict[str, Any]:
            return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}

        items: list[dict[str, Any]] = [
            said(f"<user_instructions>\n# AGENTS.md\n{s.context}\n</user_instructions>"),
            said("<environment_context>\n  <cwd>/repo</cwd>\n  <approval_policy>on-request</approval_policy>\n"
                 "  <sandbox_mode>workspace-write</sandbox_mode>\n  <shell>bash</shell>\n</environment_context>"),
            said(s.task),
        ]  # fmt: skip
        for j in range(k):
            if answers[j]:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": answers[j]}]})  # fmt: skip
            call = f"call_{s.session_id.replace('-', '')[:16]}{j:04d}"
            command = ["bash", "-lc", ("cat src/app.py", "rg -n 'def test_' tests", "pytest -x -q")[j % 3]]
            items.append({"type": "function_call", "name": "shell", "call_id": call,
                          "arguments": json.dumps({"command": command, "workdir": "/repo"})})  # fmt: skip
            output = {"output": s.outputs[j], "metadata": {"exit_code": 0, "duration_seconds": 0.1}}
            items.append({"type": "function_call_output", "call_id": call, "output": json.dumps(output)})
        body: dict[str, Any] = {
            "instructions": self.system, "input": items, "tools": [dict(t) for t in self.tools],
            "tool_choice": "auto", "parallel_tool_calls": False, "store": False, "include": [],
            "prompt_cache_key": s.session_id, "max_output_tokens": s.answers[k],
        }  # fmt: skip
        return body, (("session-id", s.session_id), ("originator", "codex_cli_rs"))


def _strings(value: Any) -> list[str]:
    """The text in a body, in order (what the prompt-length estimate counts; the JSON syntax would inflate it)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _tools(client: str, rng: random.Random, n_tokens: int) -> tuple[dict[str, Any], ...]:
    names = _CLAUDE_TOOLS if client == "claude-code" else _CODEX_TOOLS
    each = max(1, n_tokens // len(names) - 16)  # a schema costs about 16 tokens
    out: list[dict[str, Any]] = []
    for name in names:
        props = {"command": {"type": "string", "description": f"The {name} argument."}, "timeout": {"type": "number"}}
        schema = {"type": "object", "required": ["command"], "properties": props}
        text = f"{name}: " + random_words(rng, each)
        if client == "claude-code":
            out.append({"name": name, "description": text, "input_schema": schema})
        else:
            out.append({"type": "function", "name": name, "description": text, "strict": False, "parameters": schema})
    return tuple(out)


def plan_clients(spec: WorkloadSpec, run_id: str = "") -> ClientPlan:
    """The run's sessions of ``spec.name`` (a client of :data:`CLIENTS`), the same for the same spec; only the
    system prompt's tag and the session ids depend on ``run_id``."""
    rng = random.Random(f"{spec.name}-{spec.seed}")
    tag = ""
    if spec.unique:
        tag = f"[bench {run_id} {spec.seed}] " if run_id else f"[bench {spec.seed}] "
    system = tag + random_words(rng, spec.system_len - (estimate_tokens(tag) if tag else 0))
    tools = _tools(spec.name, rng, spec.system_len)
    contexts = context_lengths(spec.conversations, spec.context_len, rng)
    sessions: list[AgentSession] = []
    first = 0
    for i, n_context in enumerate(contexts):
        turns = rng.randint(*spec.turns)
        sub_turns = turns // 2 if spec.name == "claude-code" and turns >= 2 else 0
        steps = turns + sub_turns
        sid = str(uuid.UUID(int=random.Random(f"{run_id}-{spec.seed}-{i}").getrandbits(128), version=4))
        outputs = tuple(random_words(rng, rng.randint(*spec.user_len)) for _ in range(steps))
        answers = tuple(rng.randint(*spec.answer_len) for _ in range(steps))
        task = f"Fix the failing tests in session {i}: " + random_words(rng, 12)
        sessions.append(AgentSession(i, first, sid, random_words(rng, n_context), task, outputs, answers, turns,
                                     sub_turns))  # fmt: skip
        first += steps
    return ClientPlan(spec.name, system, tools, tuple(sessions), spec.seed)
