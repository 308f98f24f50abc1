"""Workloads: determinism, uniqueness, lengths, ShareGPT and trace files, shared prefix, agent conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from pdctl.bench.conversation import context_lengths, plan_conversations
from pdctl.bench.workload import (
    DOC_PROMPTS,
    WorkloadError,
    WorkloadSpec,
    estimate_tokens,
    make_workload,
    new_run_id,
)


def test_doc_alternates_the_recipe_prompts_and_is_unique() -> None:
    wl = make_workload(WorkloadSpec("doc"))
    reqs = [wl.request(i) for i in range(4)]
    assert [r.max_tokens for r in reqs] == [32, 256, 32, 256]
    assert reqs[0].prompt.endswith(DOC_PROMPTS[0][0]) and reqs[1].prompt.endswith(DOC_PROMPTS[1][0])
    assert len({r.prompt for r in reqs}) == 4
    same = make_workload(WorkloadSpec("doc", unique=False))
    assert same.request(0).prompt == same.request(2).prompt == DOC_PROMPTS[0][0]


def test_random_lengths_range_and_determinism() -> None:
    spec = WorkloadSpec("random", input_len=200, output_len=50, range_ratio=0.5, seed=3)
    wl = make_workload(spec)
    reqs = [wl.request(i) for i in range(300)]
    assert all(100 <= r.prompt_len <= 300 for r in reqs)
    assert all(25 <= r.max_tokens <= 75 for r in reqs)
    assert min(r.max_tokens for r in reqs) < 35 and max(r.max_tokens for r in reqs) > 65
    assert all(r.ignore_eos for r in reqs)
    # the text is about as long as asked (one word per token estimate)
    assert all(abs(estimate_tokens(r.prompt) - r.prompt_len) <= 1 for r in reqs)
    again = make_workload(spec)
    assert [again.request(i) for i in range(300)] == reqs
    other = make_workload(WorkloadSpec("random", input_len=200, output_len=50, range_ratio=0.5, seed=4))
    assert other.request(0).prompt != reqs[0].prompt
    assert len({r.prompt for r in reqs}) == 300


@pytest.mark.parametrize("name", ["doc", "random", "mixed"])
def test_a_run_id_changes_the_tag_only(name: str) -> None:
    wl = make_workload(WorkloadSpec(name, input_len=60, short_len=30, long_len=90, long_fraction=0.5))
    ids = {new_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i.split()) == 3 for i in ids)
    a, b = sorted(ids)[:2]
    for i in range(20):
        ra, rb = wl.request(i, a), wl.request(i, b)
        assert ra.prompt != rb.prompt and ra.prompt.startswith(f"[bench {a} 0-{i}] ")
        assert ra.prompt.split("] ", 1)[1] == rb.prompt.split("] ", 1)[1]
        assert (ra.prompt_len, ra.max_tokens, ra.kind) == (rb.prompt_len, rb.max_tokens, rb.kind)
        assert estimate_tokens(ra.prompt) == estimate_tokens(rb.prompt)
    same = make_workload(WorkloadSpec(name, unique=False))
    assert same.request(3, a).prompt == same.request(3, b).prompt


def test_random_shared_prefix() -> None:
    wl = make_workload(WorkloadSpec("random", input_len=100, prefix_len=40))
    a, b = wl.request(0).prompt.split(), wl.request(1).prompt.split()
    assert a[:40] == b[:40]
    assert a[40:] != b[40:]


def test_mixed_fraction_of_long_prompts() -> None:
    wl = make_workload(WorkloadSpec("mixed", long_fraction=0.2, long_len=1000, short_len=50, long_output_len=4))
    reqs = [wl.request(i) for i in range(1000)]
    longs = [r for r in reqs if r.kind == "long"]
    assert 0.15 < len(longs) / len(reqs) < 0.25
    assert all(r.prompt_len == 1000 and r.max_tokens == 4 for r in longs)
    assert all(r.prompt_len == 50 for r in reqs if r.kind == "short")


def test_sharegpt_file(tmp_path: Path) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi " * 9}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "second"}, {"from": "gpt", "value": "x y"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    wl = make_workload(WorkloadSpec("sharegpt", path=str(path)))
    assert wl.size == 2
    got = sorted((wl.request(i).prompt.split("] ", 1)[1], wl.request(i).max_tokens) for i in range(2))
    assert got == [("hello there", 9), ("second", 2)]


def test_sharegpt_order_matches_vllm_bench_serve(tmp_path: Path) -> None:
    # vllm bench serve's ShareGPT dataset does `random.seed(seed); random.shuffle(data)`: with the same file and
    # seed both clients send the same prompts in the same order (benchmarks/bench_agreement.py --prompts same).
    prompts = [f"prompt number {i}" for i in range(50)]
    data = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "a b c"}]} for p in prompts]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    wl = make_workload(WorkloadSpec("sharegpt", path=str(path), seed=7, unique=False))
    state = random.getstate()
    try:
        random.seed(7)
        random.shuffle(data)
    finally:
        random.setstate(state)
    assert [wl.request(i).prompt for i in range(50)] == [d["conversations"][0]["value"] for d in data]
    assert {wl.request(i).max_tokens for i in range(50)} == {3}


def test_sharegpt_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(WorkloadError, match=r"bad.json:1: invalid JSON"):
        make_workload(WorkloadSpec("sharegpt", path=str(bad)))
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(WorkloadError, match="no usable conversation"):
        make_workload(WorkloadSpec("sharegpt", path=str(empty)))
    with pytest.raises(WorkloadError, match="cannot read"):
        make_workload(WorkloadSpec("sharegpt", path=str(tmp_path / "missing.json")))


def test_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 12.0, "input_len": 30, "output_len": 5},
        {"timestamp": 10.0, "input_len": 20, "output_len": 3},
        {"timestamp_ms": 10500, "input_length": 10, "output_length": 2},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    wl = make_workload(WorkloadSpec("trace", path=str(path), trace_speed=2.0))
    assert wl.timed and wl.size == 3
    reqs = [wl.request(i) for i in range(3)]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.25, 1.0])
    assert [r.max_tokens for r in reqs] == [3, 2, 5]


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 1, "input_len": 3, "output_len": 2}\n{"timestamp": 2, "input_len": 0}\n')
    with pytest.raises(WorkloadError, match=r"t.jsonl:2: input_len"):
        make_workload(WorkloadSpec("trace", path=str(path)))


@pytest.mark.parametrize(
    "spec",
    [
        WorkloadSpec("nope"),
        WorkloadSpec("random", range_ratio=1.0),
        WorkloadSpec("random", input_len=10, prefix_len=10),
        WorkloadSpec("mixed", long_fraction=1.5),
        WorkloadSpec("trace"),
    ],
)
def test_bad_specs(spec: WorkloadSpec) -> None:
    with pytest.raises(WorkloadError):
        make_workload(spec)


def test_agent_plan_is_vllms_shape_and_the_same_for_a_seed() -> None:
    spec = WorkloadSpec("agent")  # the defaults: vLLM's generate_multi_turn.json
    plan = plan_conversations(spec, "red blue green")
    assert len(plan.conversations) == 24
    assert plan.system.startswith("[bench red blue green 0] ")
    assert estimate_tokens(plan.system) == 500
    assert all(6 <= len(c.users) <= 9 for c in plan.conversations)
    assert all(120 <= estimate_tokens(u) <= 160 for c in plan.conversations for u in c.users)
    assert all(80 <= n <= 120 for c in plan.conversations for n in c.answers)
    contexts = [estimate_tokens(c.context) for c in plan.conversations]
    assert abs(sum(contexts) / len(contexts) - 1000) < 2 and max(contexts) <= 5000 and len(set(contexts)) > 12
    assert [c.first for c in plan.conversations[:2]] == [0, len(plan.conversations[0].users)]
    assert plan.total == sum(len(c.users) for c in plan.conversations)
    other = plan_conversations(spec, "old new big")
    assert other.conversations == plan.conversations and other.system != plan.system  # only the tag differs
    assert plan_conversations(WorkloadSpec("agent", unique=False)).system.startswith("[bench") is False


def test_context_lengths_are_lognormal_rescaled_to_the_mean_and_capped() -> None:
    lengths = context_lengths(2000, 1000, random.Random(1))
    assert abs(sum(lengths) / len(lengths) - 1000) < 5  # the cap at 5x takes a little off, as in vLLM
    median = sorted(lengths)[1000]
    assert 750 < median < 950  # vLLM's median ratio 0.85
    assert max(lengths) <= 5000
    assert context_lengths(3, 0, random.Random(1)) == [0, 0, 0]


def test_shared_prefix_groups_prompts_behind_one_system_prompt_each() -> None:
    spec = WorkloadSpec("shared-prefix", groups=3, prompts_per_group=4, system_len=40, question_len=10, output_len=7)
    wl = make_workload(spec)
    assert wl.size == 12
    reqs = [wl.request(i, "a b c") for i in range(12)]
    systems = [r.prompt.split("\n\n")[0] for r in reqs]
    assert sorted(systems.count(s) for s in set(systems)) == [4, 4, 4]
    assert all(s.startswith("[bench a b c 0-g") and estimate_tokens(s) == 40 for s in systems)
    assert len({r.prompt for r in reqs}) == 12 and all(r.max_tokens == 7 and r.ignore_eos for r in reqs)
    assert [r.prompt.split("\n\n")[0] for r in reqs[:4]] != [systems[0]] * 4  # shuffled, as SGLang sends them
    assert not {r.prompt for r in reqs} & {wl.request(i, "d e f").prompt for i in range(12)}
    warm = wl.warmup_request(0, "a b c")
    assert not any(warm.prompt.startswith(s) for s in systems)


@pytest.mark.parametrize(
    ("spec", "flag"),
    [
        (WorkloadSpec("agent", turns=(0, 0)), "--turns 0"),
        (WorkloadSpec("agent", turns=(5, 3)), "--turns 5:3"),
        (WorkloadSpec("agent", conversations=0), "--conversations 0"),
        (WorkloadSpec("agent", answer_len=(0, 4)), "--answer-len 0:4"),
        (WorkloadSpec("agent", context_len=-1), "--context-len -1"),
        (WorkloadSpec("shared-prefix", groups=0), "--groups 0"),
        (WorkloadSpec("shared-prefix", question_len=0), "--question-len 0"),
    ],
)
def test_agent_and_shared_prefix_sizes_are_checked(spec: WorkloadSpec, flag: str) -> None:
    with pytest.raises(WorkloadError) as err:
        make_workload(spec)
    assert str(err.value).startswith(flag) and err.value.hint


def test_cli_names_the_flag_of_a_bad_agent_or_shared_prefix_size(cli: Any) -> None:
    base = ("bench", "--gateway", "http://127.0.0.1:9", "--model", "m", "--no-metrics")
    for args, expected in (
        (("-w", "agent", "--turns", "0"), "--turns 0: must be"),
        (("-w", "agent", "--turns", "six"), "--turns: cannot read 'six'"),
        (("-w", "agent", "--user-len", "9:3"), "--user-len 9:3"),
        (("-w", "agent", "-n", "5"), "-n/--num-requests does not apply to -w agent"),
        (("-w", "claude-code", "-n", "5"), "-n/--num-requests does not apply to -w claude-code"),
        (("-w", "codex", "--endpoint", "completions"), "--endpoint completions does not apply to -w codex"),
        (("-w", "codex", "--turns", "0"), "--turns 0: must be"),
        (("-w", "shared-prefix", "--prompts-per-group", "0"), "--prompts-per-group 0"),
    ):
        result = cli(*base, *args)
        assert result.exit_code == 1, result.output
        assert expected in result.output and "Traceback" not in result.output, result.output
