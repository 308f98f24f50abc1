"""``-w agent`` and ``-w shared-prefix`` against simulator workers (``python -m pdctl.sim``), through the gateway for PD.

What goes over the wire is read by an httpx transport that records each request body on its way to the real
server; the prefix-cache hits are the engines' own counters (``vllm:prefix_cache_*``). No timing assertions.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from pdctl.bench.plots import plot_groups
from pdctl.bench.report import result_json
from pdctl.bench.runner import BenchTarget, LoadShape, RunResult, run_async, run_once
from pdctl.bench.workload import WorkloadSpec, make_workload
from pdctl.testing import SimProcess
from tests.bench.test_on_sim import KEY, PD_ARGS, gateway, sims

__all__ = ["gateway", "sims"]  # the fixtures this module borrows

FAST = ["--sim-profile", "h100", "--sim-speed", "4", "--sim-kv-scale", "0.001"]


class Recording(httpx.AsyncHTTPTransport):
    """The real network, keeping each completion request's body by the request index its ``x-request-id`` ends with."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: dict[str, dict[str, Any]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/completions"):
            self.bodies[request.headers["x-request-id"]] = json.loads(request.content)
        return await super().handle_async_request(request)


def _run(target: BenchTarget, shape: LoadShape) -> RunResult:
    return run_async(run_once(target, shape))


def test_agent_turns_carry_the_growing_history_and_hit_the_prefix_cache(
    sims: Callable[..., SimProcess], gateway: Callable[..., str]
) -> None:
    p = sims(PD_ARGS, "prefill", connector="NixlConnector")
    d = sims(PD_ARGS, "decode", connector="NixlConnector")
    gw = gateway(p.url, d.url)
    spec = WorkloadSpec("agent", conversations=3, turns=(3, 3), system_len=64, context_len=80, user_len=(20, 30),
                        answer_len=(8, 12))  # fmt: skip
    wire = Recording()
    metrics = (f"{p.url}/metrics", f"{d.url}/metrics")
    target = BenchTarget(gw, "tiny", make_workload(spec), api_key=KEY, metrics_urls=metrics,
                         metrics_names={metrics[0]: "prefill", metrics[1]: "decode"}, transport=wire)  # fmt: skip
    run = _run(target, LoadShape(warmup=1, num_requests=None))
    assert (run.summary.completed, run.summary.failed) == (9, 0), run.warnings
    assert run.summary.paths == {"disagg": 9}

    bodies = {r.index: wire.bodies[r.request_id] for r in run.results}
    system = bodies[0]["messages"][0]["content"]
    assert system.startswith(f"[bench {run.run_id} 0] ")
    assert {b["messages"][0]["content"] for b in bodies.values()} == {system}  # one system prompt per run
    for conv in range(3):
        results = sorted((r for r in run.results if r.conversation == conv), key=lambda r: r.turn or 0)
        assert [r.turn for r in results] == [1, 2, 3]
        sent = [bodies[r.index]["messages"] for r in results]
        assert [len(m) for m in sent] == [2, 4, 6]
        for k in (0, 1):
            # turn k+1 starts with turn k's messages, then turn k's answer as it streamed back, then a new user turn
            assert sent[k + 1][: len(sent[k])] == sent[k]
            assert results[k].text and sent[k + 1][len(sent[k])] == {"role": "assistant", "content": results[k].text}
            assert sent[k + 1][-1]["role"] == "user"
        # the server counted the growing history
        assert results[0].prompt_tokens < results[1].prompt_tokens < results[2].prompt_tokens

    s = run.summary
    assert sorted(s.by_turn) == ["1", "2", "3"] and all(s.by_turn[k]["ttft"].count == 3 for k in s.by_turn)
    assert s.turn_groups["1"]["ttft"].count == 3 and s.turn_groups["2+"]["ttft"].count == 6
    out = result_json(run)["pdctl"]
    assert out["requests"]["turn"].count(1) == 3 and sorted(out["by_turn"]) == ["1", "2", "3"]
    caches = {v["name"]: v for v in out["prefix_cache"].values()}
    # Later turns find their history in prefill's cache: the engine's own counters say so.
    assert caches["prefill"]["hits"] > 0 and 0 < caches["prefill"]["hit_rate"] < 1, caches
    assert out["kv_transfer"]["kv_bytes"] > 0
    # the report's TTFT-by-turn plots, p50 and p90
    plots = dict(p for _, group in plot_groups([run]) for p in group)
    by_turn = plots["ttft-50-by-turn"]
    assert by_turn.startswith("<svg") and "TTFT p50 by turn" in by_turn and "ttft-90-by-turn" in plots

    again = _run(target, LoadShape(warmup=0, num_requests=None))
    systems = {wire.bodies[r.request_id]["messages"][0]["content"] for r in again.results}
    assert len(systems) == 1 and system not in systems  # the next run's system prompt is its own


def test_shared_prefix_groups_share_their_system_prompt_and_runs_share_nothing(
    sims: Callable[..., SimProcess],
) -> None:
    sp = sims(FAST, "colocated")
    spec = WorkloadSpec("shared-prefix", groups=2, prompts_per_group=3, system_len=64, question_len=12, output_len=4)
    wire = Recording()
    url = f"{sp.url}/metrics"
    target = BenchTarget(sp.url, "tiny", make_workload(spec), metrics_urls=(url,), transport=wire)
    runs = [_run(target, LoadShape(concurrency=1, num_requests=6, warmup=1)) for _ in range(2)]
    prompts = []
    for run in runs:
        assert (run.summary.completed, run.summary.failed) == (6, 0), run.warnings
        sent = [wire.bodies[r.request_id]["messages"][0]["content"] for r in run.results]
        assert len(set(sent)) == 6  # every prompt is its own ...
        systems = {text.split("\n\n")[0] for text in sent}
        assert len(systems) == 2 and all(f"[bench {run.run_id} 0-g" in s for s in systems)  # ... behind 2 groups
        prompts.append(set(sent))
        # from the second prompt of a group on, the engine finds the group's system prompt in its cache
        cache = result_json(run)["pdctl"]["prefix_cache"][url]
        assert cache["hits"] > 0 and cache["hit_rate"] < 1, cache
    assert not prompts[0] & prompts[1]  # the second run sends none of the first run's prompts
