"""``-w claude-code`` and ``-w codex``: each request as the client sends it, and end to end through adaptive PD.

The shape tests read the requests a plan builds (no network). The end-to-end test runs ``pdctl bench -w claude-code``
through a gateway with ``pd_mode = "adaptive"`` over two simulator workers (which drop the billing line before
rendering, as vLLM 0.32 does), and a recording transport shows what went over the wire for both clients.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pdctl.bench.agent_clients import plan_clients
from pdctl.bench.report import result_json
from pdctl.bench.runner import BenchTarget, LoadShape, run_async, run_once
from pdctl.bench.workload import WorkloadSpec, make_workload
from pdctl.testing import SimProcess
from tests.bench.test_on_sim import KEY, gateway, sims
from tests.bench.test_workloads_on_sim import FAST

__all__ = ["gateway", "sims"]  # the fixtures this module borrows

SIZES = {"conversations": 2, "turns": (4, 4), "system_len": 200, "context_len": 300, "user_len": (20, 20),
         "answer_len": (8, 8)}  # fmt: skip
FLAGS = ["--conversations", "2", "--turns", "4", "--system-len", "200", "--context-len", "300", "--user-len", "20",
         "--answer-len", "8"]  # fmt: skip
BILLING = re.compile(
    r"^x-anthropic-billing-header: cc_version=2\.1\.177\.[0-9a-f]{3}; cc_entrypoint=cli; cch=[0-9a-f]{5};$"
)


def _walk(plan_spec: WorkloadSpec, run_id: str = "red blue green") -> list[list[Any]]:
    plan = plan_clients(plan_spec, run_id)
    out = []
    for i, steps in enumerate(plan.steps()):
        answers: list[str] = []
        reqs = []
        for k in range(steps):
            reqs.append(plan.request(i, k, answers))
            answers.append(f"answer {i}.{k}")
        out.append(reqs)
    return out


def test_claude_code_requests_are_shaped_as_claude_code_sends_them() -> None:
    sessions = _walk(WorkloadSpec("claude-code", **SIZES))  # type: ignore[arg-type]
    assert [len(s) for s in sessions] == [6, 6]  # 4 main turns + a sub-agent of 2
    lines = set()
    for s in sessions:
        assert [r.turn for r in s] == [1, 2, 3, 4, 5, 6]
        assert [r.kind for r in s] == ["claude-code", "claude-code", "subagent", "subagent", "claude-code",
                                       "claude-code"]  # fmt: skip
        assert {r.route for r in s} == {"messages"}
        sid = dict(s[0].headers)["x-claude-code-session-id"]
        for k, r in enumerate(s):
            body, headers = r.body or {}, dict(r.headers)
            assert headers["x-claude-code-session-id"] == sid and body["max_tokens"] == 8
            system = body["system"]
            assert BILLING.match(system[0]["text"]) and "cache_control" not in system[0]
            lines.add(system[0]["text"])
            assert system[2]["text"].startswith("[bench red blue green 0] ") and system[2]["cache_control"]
            assert [t["name"] for t in body["tools"]] == ["Task", "Bash", "Glob", "Grep", "Read", "Edit", "Write",
                                                          "TodoWrite"]  # fmt: skip
            assert len(json.dumps(body["tools"])) > 1000
            msgs = body["messages"]
            # the rolling breakpoint: on the newest block of the conversation only
            marked = [(i, j) for i, m in enumerate(msgs) if isinstance(m["content"], list)
                      for j, b in enumerate(m["content"]) if "cache_control" in b]  # fmt: skip
            last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
            assert marked == [(last_user, len(msgs[last_user]["content"]) - 1)]
            assert "<system-reminder>" in msgs[last_user]["content"][-1]["text"] or k in (0, 2)
            first_of_agent = k in (0, 2)
            assert (msgs[-1]["role"] == "system") is not first_of_agent  # the trailing system turn, from turn 2 on
            if k == 2:  # the sub-agent: the parent's system and tools, messages of its own, its agent ids
                assert headers["x-claude-code-parent-agent-id"] == sid and headers["x-claude-code-agent-id"]
                assert len(msgs) == 1 and "Find where" in msgs[0]["content"][1]["text"]
            if k in (1, 4):  # tool_use answered by tool_result; after the Task call, the sub-agent's last answer
                uses = [b for m in msgs if m["role"] == "assistant" for b in m["content"] if b["type"] == "tool_use"]
                result = msgs[last_user]["content"][0]
                assert result["type"] == "tool_result" and result["tool_use_id"] == uses[-1]["id"]
                if k == 4:
                    assert uses[-1]["name"] == "Task" and result["content"] == f"answer {s[0].conversation}.3"
    assert len(lines) == 12  # a new billing line every request


def test_codex_requests_are_shaped_as_codex_sends_them() -> None:
    sessions = _walk(WorkloadSpec("codex", **SIZES))  # type: ignore[arg-type]
    assert [len(s) for s in sessions] == [4, 4]  # no sub-agents
    for s in sessions:
        sid = dict(s[0].headers)["session-id"]
        for k, r in enumerate(s):
            body = r.body or {}
            assert r.route == "responses" and r.kind == "codex" and dict(r.headers)["session-id"] == sid
            assert body["instructions"].startswith("[bench red blue green 0] ") and body["store"] is False
            assert body["prompt_cache_key"] == sid and body["max_output_tokens"] == 8
            assert [t["name"] for t in body["tools"]] == ["shell", "apply_patch", "update_plan", "view_image"]
            types = [i["type"] for i in body["input"]]
            assert types == ["message"] * 3 + ["message", "function_call", "function_call_output"] * k
            if k:  # each turn starts with the one before it (stateless: the whole input again)
                assert body["input"][: len(s[k - 1].body["input"])] == s[k - 1].body["input"]  # type: ignore[index]


class Recording(httpx.AsyncHTTPTransport):
    """The real network, keeping each agent request's path, headers and body by its ``x-request-id``."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, tuple[str, dict[str, str], dict[str, Any]]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            rid = request.headers["x-request-id"]
            self.sent[rid] = (request.url.path, dict(request.headers), json.loads(request.content))
        return await super().handle_async_request(request)


def test_claude_code_bench_through_adaptive_pd_on_the_simulator(
    sims: Callable[..., SimProcess], gateway: Callable[..., str], cli: Callable[..., Any], tmp_path: Path
) -> None:
    p = sims(FAST, "prefill", connector="NixlConnector")
    d = sims(FAST, "decode", connector="NixlConnector")
    gw = gateway(p.url, d.url, pd_mode="adaptive")
    out = tmp_path / "cc.json"
    result = cli("bench", "--gateway", gw, "--model", "tiny", "-w", "claude-code", *FLAGS, "--no-progress",
                 "--metrics-url", f"{d.url}/metrics", "-o", str(out), env={"PDCTL_API_KEY": KEY})  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["completed"], data["failed"]) == (12, 0), data["errors"]
    assert data["endpoint_type"] == "anthropic-messages" and len(data["ttfts"]) == 12 and min(data["ttfts"]) > 0
    reqs = data["pdctl"]["requests"]
    assert sorted(data["pdctl"]["by_turn"]) == ["1", "2", "3", "4", "5", "6"]
    assert reqs["turn"].count(1) == 2 and set(reqs["kind"]) == {"claude-code", "subagent"}
    assert data["pdctl"]["workload"]["name"] == "claude-code"
    # Every session's first request goes over both legs; the main agent's later turns find their history on the
    # decode (the gateway ignores the billing line, as the engine does) and stay there.
    rows = list(zip(reqs["turn"], reqs["kind"], reqs["pd_path"], reqs["request_id"], strict=True))
    assert {path for turn, _, path, _ in rows if turn == 1} == {"disagg"}
    later = [(path, rid) for turn, kind, path, rid in rows if turn > 1 and kind == "claude-code"]
    assert len(later) == 6 and {path for path, _ in later} == {"local"}, rows
    log = (tmp_path / "gw.log").read_text()
    for _, rid in later:
        line = next(x for x in log.splitlines() if f"request_id={rid} " in x)
        assert "path=local" in line and "decision=cached" in line and "session=" in line, line

    # On the wire: the billing line changes every request, tools and the session headers are there, both clients.
    wire = Recording()
    for name, route in (("claude-code", "/v1/messages"), ("codex", "/v1/responses")):
        wl = make_workload(WorkloadSpec(name, **SIZES))  # type: ignore[arg-type]
        run = run_async(run_once(BenchTarget(gw, "tiny", wl, api_key=KEY, transport=wire), LoadShape(warmup=0,
                                 num_requests=None)))  # fmt: skip
        assert (run.summary.completed, run.summary.failed) == (12 if name == "claude-code" else 8, 0), run.warnings
        sent = [wire.sent[r.request_id] for r in run.results]
        assert {path for path, _, _ in sent} == {route}
        assert all(r.ttft_s > 0 and r.output_tokens == 8 and r.prompt_tokens > 0 for r in run.results)
        assert result_json(run)["pdctl"]["requests"]["turn"] == [r.turn for r in run.results]
        if name == "claude-code":
            assert all(h["x-claude-code-session-id"] for _, h, _ in sent)
            assert len({b["system"][0]["text"] for _, _, b in sent}) == 12
            assert all(BILLING.match(b["system"][0]["text"]) and len(b["tools"]) == 8 for _, _, b in sent)
            assert sum("x-claude-code-parent-agent-id" in h for _, h, _ in sent) == 4
        else:
            assert len({h["session-id"] for _, h, _ in sent}) == 2 and all(len(b["tools"]) == 4 for _, _, b in sent)
        # each answer as it streamed back is in the next turn's history
        texts = {(r.conversation, r.turn): r.text for r in run.results}
        assert all(texts.values())
        assert json.dumps(texts[(0, 1)])[1:-1] in json.dumps(sent[1][2])
