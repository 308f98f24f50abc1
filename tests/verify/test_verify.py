"""``pdctl verify`` against simulated deployments: a healthy pair passes; each fault fails the right check.

The workers (and the gateway) are started from ``build_plan`` (the argv
``pdctl up`` would run), each in its own process group on free ports, with its output in
``<run_dir>/logs/<name>.log`` like ``up`` writes it. Faults are the simulator's ``--sim-fault`` flags, put in
the worker's ``extra_args``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest

from pdctl import config
from pdctl.config import Deployment
from pdctl.runtime.plan import GATEWAY_HOLD_ENV, ProcessSpec, build_plan
from pdctl.testing import free_port, kill_groups, wait_until_ready
from pdctl.verify import CheckResult, VerifyReport, link, metric_total, proof, run_verify
from pdctl.vllm import kvlog
from tests.conftest import REPO
from tests.real_engine import require_engine

KEY_ENV = "PDCTL_VERIFY_TEST_KEY"
KEY = "test-key-0123456789"
FIXTURES = REPO / "tests" / "fixtures" / "vllm-cpu"


@dataclass
class Cluster:
    """A running simulated deployment: its Deployment, processes and run directory."""

    dep: Deployment
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def stop(self, name: str) -> None:
        proc = self.procs[name]
        kill_groups([proc.pid])
        proc.wait(10)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def verify(self, **kw: object) -> VerifyReport:
        kw.setdefault("api_key", KEY)
        kw.setdefault("timeout_s", 60.0)
        return run_verify(self.dep, logs_dir=self.logs, **kw)  # type: ignore[arg-type]


def _worker_section(role: str, model: str, args: Sequence[str]) -> str:
    """``[prefill]`` or ``[decode]``: a simulated worker on its own side-channel port."""
    return f"""[{role}]
model = "{model}"
engine = "sim"
max_model_len = 1024
side_channel_port = {free_port()}
extra_args = {json.dumps(list(args))}
"""


def _write_files(
    folder: Path,
    *,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    decode_model: str = "sim/tiny-qwen3",
    decode_connector: str | None = None,
    connector: str = "NixlConnector",
    debug: bool = True,
    routing: dict[str, object] | None = None,
) -> tuple[Path, Path]:
    pp, dp, gp = free_port(), free_port(), free_port()
    decode_extra = f'kv_connector = "{decode_connector}"\n' if decode_connector else ""
    ctext = f"""
[cluster]
name = "verify-test"

[kv_transfer]
backend = "nixl"
shared_storage_path = "{folder / "kvstore"}"

{_worker_section("prefill", "sim/tiny-qwen3", prefill_args)}
{_worker_section("decode", decode_model, decode_args)}{decode_extra}
[connector]
kv_connector = "{connector}"

[supervisor]
run_dir = "run"

[sim]
profile = "fast"
speed = 20
"""
    settings = {
        "gateway": {"listen": f"127.0.0.1:{gp}", "api_key_env": KEY_ENV, "request_timeout_s": 30},
        "routing": {
            "prefill_endpoint": f"http://127.0.0.1:{pp}",
            "decode_endpoint": f"http://127.0.0.1:{dp}",
            "strategy": "pd_disagg",
            **(routing or {}),
        },
        "slo": {"ttft_ms": 400, "tpot_ms": 40},
        "logging": {"level": "debug" if debug else "info", "log_kv_transfer": True},
    }
    cpath, spath = folder / "config.toml", folder / "settings.json"
    cpath.write_text(ctext, encoding="utf-8")
    spath.write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return cpath, spath


def _spawn(spec: ProcessSpec, logs: Path, extra_env: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in spec.unset_env}
    env.update(spec.env)
    # Started by hand after the workers (as `pdctl plan --format sh` does): nothing will release a held gateway.
    env.pop(GATEWAY_HOLD_ENV, None)
    env.update(extra_env)
    with (logs / f"{spec.name}.log").open("wb") as out:
        return subprocess.Popen(
            list(spec.argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


def _wait_ready(spec: ProcessSpec, proc: subprocess.Popen[bytes], logs: Path) -> None:
    wait_until_ready(proc, spec.ready_url, 60.0, name=spec.name, log=logs / f"{spec.name}.log")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    started: list[Cluster] = []

    def start(*, gateway: bool = True, **kw: object) -> Cluster:
        cpath, spath = _write_files(tmp_path, **kw)  # type: ignore[arg-type]
        dep = config.load(cpath, spath)
        logs = dep.run_dir / "logs"
        logs.mkdir(parents=True)
        c = Cluster(dep, logs)
        started.append(c)
        plan = build_plan(dep)
        for spec in plan.workers:
            c.procs[spec.name] = _spawn(spec, logs, {})
        for spec in plan.workers:
            _wait_ready(spec, c.procs[spec.name], logs)
        if gateway:
            spec = plan.get("gateway")
            c.procs["gateway"] = _spawn(spec, logs, {KEY_ENV: KEY})
            _wait_ready(spec, c.procs["gateway"], logs)
        return c

    yield start
    for c in started:
        c.stop_all()


def _by_name(report: VerifyReport) -> dict[str, CheckResult]:
    return {c.name: c for c in report.checks}


def _failed(report: VerifyReport) -> set[str]:
    return {c.name for c in report.checks if c.ok is False}


PAIR = "[prefill->decode]"
LINK = ("identity", "kv_params", "kv_metrics", "kv_logs", "kv_correctness")


# ------------------------------------------------------------------------------------- healthy pair


def test_healthy_pair_workers_only(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False)
    report = c.verify()
    checks = _by_name(report)
    # No gateway here: its checks fail (the gateway is part of the deployment) but the link is proven.
    assert checks["gateway"].ok is False
    assert "pdctl up" in (checks["gateway"].next_step or "")
    assert checks["workers"].ok is True
    for name in LINK:
        assert checks[name + PAIR].ok is True, checks[name + PAIR]
    correctness = checks["kv_correctness" + PAIR]
    assert "token ids identical" in correctness.detail
    # each PD decode and each reference ran alone on its worker, and compared top-k logprobs came back
    for probe in correctness.data["probes"]:
        assert probe["divergence"] is None and probe["pd_tokens"] == probe["ref_tokens"]
        assert probe["batch"] == {"prefill_before": 0.0, "decode_before": 0.0, "reference_before": 0.0}
    assert report.exit_code == 1
    # The classifier reads the simulator's lines like vLLM's: each probe saved on prefill, loaded on decode.
    probes = {f"pdctl-verify-{n}" for n in ("short", "typical", "long")}

    def phases(name: str) -> set[tuple[str, str]]:
        lines = (c.logs / f"{name}.log").read_text().split("\n")
        out = set()
        for e in kvlog.scan(lines, name):
            if e.request_id:
                base = kvlog.base_request_id(e.request_id)
                out.add((e.phase, re.sub(r"-[0-9a-f]{8}-0-0-", "-", base)))
        return out

    for probe in probes:
        assert ("save_kv_layer", probe) in phases("prefill")
        assert ("start_load_kv", probe) in phases("decode")
        assert ("wait_for_layer_load", probe) in phases("decode")


def test_healthy_pair_passes_everything(cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    report = c.verify(compare_colocated=True)
    assert report.ok, [c.to_json() for c in report.checks if c.ok is not True]
    assert report.exit_code == 0
    checks = _by_name(report)
    assert checks["stream"].data["ttft_ms"] > 0
    assert checks["gateway_pd_path"].detail.startswith("x-pd-path chat: disagg")
    assert checks["compare_colocated"].ok is True
    agent = checks["agent_session"].detail  # pd_mode always: both turns on both legs, the decode's own cache hits
    assert "turn 2 (new billing line): x-pd-path disagg, decode prefix-cache hits +" in agent, agent
    assert set(report.to_json()) == {"ok", "checks"}
    assert {"name", "ok", "detail", "duration_ms"} <= set(report.to_json()["checks"][0])


def test_adaptive_pd_shows_its_decision_and_still_proves_the_link(cluster: Callable[..., Cluster]) -> None:
    c = cluster(routing={"pd_mode": "adaptive", "local_max_uncached_tokens": 256})
    report = c.verify()
    assert report.ok, [c.to_json() for c in report.checks if c.ok is not True]
    checks = _by_name(report)
    # the recipe's short requests went to decode alone; the pair probes still took both legs and moved KV
    assert checks["gateway_pd_path"].detail.startswith("x-pd-path chat: local")
    detail = checks["adaptive_decision"].detail
    assert "short" in detail and "x-pd-path local (expected local), identical" in detail
    assert "long" in detail and "x-pd-path disagg (expected disagg), identical" in detail
    agent = checks["agent_session"]  # turn 2 of a Claude Code session (a new billing line) judged cached: local
    assert agent.ok is True and "turn 1 (" in agent.detail and "x-pd-path disagg;" in agent.detail
    assert "turn 2 (new billing line): x-pd-path local" in agent.detail, agent.detail
    for name in LINK:
        assert checks[name + PAIR].ok is True, checks[name + PAIR]


def test_the_slo_autopilot_passes_verify_and_the_pair_probes_still_take_both_legs(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(routing={"pd_mode": "auto"})
    report = c.verify()
    assert report.ok, [c.to_json() for c in report.checks if c.ok is not True]
    checks = _by_name(report)
    # an idle decode serves the recipe's short requests alone; the probes call the workers, prefill then decode
    assert checks["gateway_pd_path"].detail.startswith("x-pd-path chat: local")
    assert "adaptive_decision" not in checks
    for name in LINK:
        assert checks[name + PAIR].ok is True, checks[name + PAIR]


def test_adaptive_decision_fails_when_the_gateway_always_takes_both_legs(cluster: Callable[..., Cluster]) -> None:
    # the gateway runs with pd_mode "always"; verify is told the deployment is adaptive
    c = cluster(routing={"local_max_uncached_tokens": 256})
    c.dep = replace(c.dep, routing=replace(c.dep.routing, pd_mode="adaptive"))
    report = c.verify()
    check = _by_name(report)["adaptive_decision"]
    assert check.ok is False and "x-pd-path disagg (expected local)" in check.detail
    assert "decision=" in (check.next_step or "")
    assert _failed(report) == {"adaptive_decision", "agent_session"}
    assert "cache_break=" in (_by_name(report)["agent_session"].next_step or "")


def test_healthy_example_connector_pair(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False, connector="ExampleConnector")
    checks = _by_name(c.verify())
    assert checks["kv_params" + PAIR].ok is None  # shared storage returns no params
    assert "no kv_transfer_params" in checks["kv_params" + PAIR].detail
    metrics = checks["kv_metrics" + PAIR]
    assert metrics.ok is True and "under one" in metrics.detail
    assert checks["kv_correctness" + PAIR].ok is True
    assert checks["identity" + PAIR].ok is True


def test_info_level_logs_pass_on_the_handshake_line_without_request_ids(cluster: Callable[..., Cluster]) -> None:
    """At INFO no line names a probe's request, yet the decode's NIXL handshake line shows the link in use:
    kv_logs passes on it (saying so) rather than failing or skipping."""
    c = cluster(gateway=False, debug=False)
    checks = _by_name(c.verify())
    logs = checks["kv_logs" + PAIR]
    assert logs.ok is True, logs.detail
    assert "decode start_load_kv 0, decode wait_for_layer_load 0" in logs.detail, logs.detail
    assert logs.detail.endswith("decode lines without request ids: start_load_kv 1"), logs.detail
    assert checks["kv_metrics" + PAIR].ok is True


# ------------------------------------------------------------------------------------------- faults


def test_no_kv_params_is_a_silent_fallback(cluster: Callable[..., Cluster]) -> None:
    c = cluster(prefill_args=["--sim-fault", "no-kv-params"])
    report = c.verify()
    checks = _by_name(report)
    # the gateway still answers 200, but says it ran decode alone
    assert checks["chat"].ok is True
    assert checks["gateway_pd_path"].ok is False
    assert "fallback" in checks["gateway_pd_path"].detail
    assert "silent fallback" in (checks["gateway_pd_path"].cause or "")
    assert checks["kv_params" + PAIR].ok is False
    assert "silent fallback" in (checks["kv_params" + PAIR].cause or "")
    assert checks["kv_metrics" + PAIR].ok is False
    assert "external_kv_transfer" in (checks["kv_metrics" + PAIR].cause or "")
    # decode recomputed: the answers match, which proves nothing about the link
    assert checks["kv_correctness" + PAIR].ok is None
    assert report.exit_code == 1


def test_corrupted_kv_fails_correctness(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False, prefill_args=["--sim-fault", "corrupt-kv"])
    checks = _by_name(c.verify())
    res = checks["kv_correctness" + PAIR]
    assert res.ok is False
    assert "corrupted" in (res.cause or "")
    assert checks["identity" + PAIR].ok is True
    assert checks["kv_metrics" + PAIR].ok is True  # the bytes did move
    # the report names the position, both token ids with their text, and the margins: no mojibake excerpt
    assert re.search(r'first difference at output token 0: reference id \d+ " \w+" \(margin \d\.\d{3} nats', res.detail)
    assert re.search(r'PD id \d+ " \w+" \(margin \d\.\d{3}\)', res.detail)
    divs = [p["divergence"] for p in res.data["probes"]]
    assert all(d["verdict"] == "corruption" and d["ref_margin"] >= 0.5 for d in divs), divs
    # A corrupted KV changes the first token, except when the simulator's new pick is by chance the same word
    # (1 in 77 per probe, each run's prompts differ by verify's nonce): then the difference shows one token later.
    assert min(d["position"] for d in divs) == 0, divs


def test_a_near_tie_once_is_re_run_and_passes(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False, decode_args=["--sim-fault", "near-tie:2@times=1"])
    res = _by_name(c.verify())["kv_correctness" + PAIR]
    assert res.ok is True, res
    assert "short: token ids identical (re-run after a tie: first difference at output token 2" in res.detail
    short = res.data["probes"][0]
    assert short["first_tie"]["verdict"] == "tie" and short["first_tie"]["ref_margin"] == pytest.approx(0.01)
    assert len(short["request_ids"]) == 2 and short["divergence"] is None


def test_a_near_tie_twice_is_inconclusive_not_a_failure(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False, decode_args=["--sim-fault", "near-tie"])
    checks = _by_name(c.verify())
    res = checks["kv_correctness" + PAIR]
    assert res.ok is None and res.detail.startswith("inconclusive at a numerical tie, twice"), res
    assert "short: first difference at output token 0" in res.detail
    assert all(p["divergence"]["verdict"] == "tie" and p["first_tie"] for p in res.data["probes"])
    assert checks["kv_metrics" + PAIR].ok is True and checks["identity" + PAIR].ok is True


def test_different_model_fails_identity_with_5_4(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False, decode_model="sim/other-model")
    checks = _by_name(c.verify())
    res = checks["identity" + PAIR]
    assert res.ok is False
    assert "§5.4" in (res.cause or "")
    assert "identical --model" in (res.next_step or "")
    # like vLLM, the simulator's handshake refuses a different model: the decode legs fail
    assert "§5.4" in (checks["kv_metrics" + PAIR].cause or "")
    logs = checks["kv_logs" + PAIR]
    assert logs.ok is False and "hash mismatch" in logs.detail and "§5.4" in (logs.cause or "")


def test_reported_model_name_mismatch_fails_identity(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False, decode_args=["--sim-fault", "model-name:someone-else"])
    res = _by_name(c.verify())["identity" + PAIR]
    assert res.ok is False and "id:" in res.detail and "§5.4" in (res.cause or "")


def test_dead_decode(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False)
    c.stop("decode")
    report = c.verify()
    checks = _by_name(report)
    assert checks["workers"].ok is False
    assert "decode" in (checks["workers"].cause or "") and "not answering" in (checks["workers"].cause or "")
    assert all(checks[n + PAIR].ok is None for n in LINK)
    assert report.exit_code == 1


def test_dead_decode_with_oom_in_its_log_names_5_3(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False)
    c.stop("decode")
    with (c.logs / "decode.log").open("a") as f:
        f.write("(EngineCore pid=1) ERROR 11-30 10:00:00 [core.py:1] torch.OutOfMemoryError: CUDA out of memory.\n")
    res = _by_name(c.verify())["workers"]
    assert res.ok is False and "§5.3" in (res.cause or "") and "max_num_batched_tokens" in (res.next_step or "")


def test_nothing_running_exits_2(tmp_path: Path) -> None:
    cpath, spath = _write_files(tmp_path)
    dep = config.load(cpath, spath)
    report = run_verify(dep, api_key=KEY, timeout_s=5.0)
    assert not report.reachable
    assert report.exit_code == 2
    assert [c.name for c in report.checks] == ["gateway", "workers"]


def test_connector_mismatch_is_5_1(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False, decode_connector="ExampleConnector")
    checks = _by_name(c.verify())
    res = checks["identity" + PAIR]
    assert res.ok is False
    assert "§5.1" in (res.cause or "") and "ExampleConnector" in (res.cause or "")
    assert checks["kv_metrics" + PAIR].ok is False
    assert "§5.1" in (checks["kv_metrics" + PAIR].cause or "")


def test_handshake_failure_shows_in_logs(cluster: Callable[..., Cluster]) -> None:
    c = cluster(gateway=False, decode_args=["--sim-fault", "handshake-fail"])
    checks = _by_name(c.verify())
    res = checks["kv_logs" + PAIR]
    assert res.ok is False
    assert "handshake" in res.detail and "§5.1" in (res.cause or "")


def test_wrong_key_is_5_2(cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    report = c.verify(api_key="not-the-key", probes=("short",))
    checks = _by_name(report)
    assert checks["chat"].ok is False and "§5.2" in (checks["chat"].cause or "")
    assert KEY_ENV in (checks["chat"].next_step or "")
    assert checks["stream"].ok is False and "§5.2" in (checks["stream"].cause or "")
    assert checks["auth"].ok is True  # the gateway does refuse unknown keys
    assert "not-the-key" not in json.dumps(report.to_json())


def test_missing_key_in_verify_env(cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    res = _by_name(c.verify(api_key=None, probes=("short",)))["chat"]
    assert res.ok is False and KEY_ENV in (res.cause or "") and "export" in (res.next_step or "")


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_json_and_exit_code(cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from pdctl.cli import app

    c = cluster()
    monkeypatch.setenv(KEY_ENV, KEY)
    result = CliRunner().invoke(
        app, ["verify", "-c", c.dep.config_path, "-s", c.dep.settings_path, "--json", "--timeout", "60"]
    )
    data = json.loads(result.output)
    assert data["ok"] is True and result.exit_code == 0
    assert KEY not in result.output


def test_cli_checklist_on_failure(cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from pdctl.cli import app

    c = cluster(gateway=False, prefill_args=["--sim-fault", "corrupt-kv"])
    monkeypatch.setenv(KEY_ENV, KEY)
    result = CliRunner().invoke(app, ["verify", "-c", c.dep.config_path, "-s", c.dep.settings_path])
    assert result.exit_code == 1
    assert "✗ kv_correctness[prefill->decode]" in result.output
    assert "cause:" in result.output and "next:" in result.output
    assert "verify: FAIL" in result.output


def test_cli_unreachable_exits_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pdctl.cli import app

    cpath, spath = _write_files(tmp_path)
    result = CliRunner().invoke(app, ["verify", "-c", str(cpath), "-s", str(spath), "--timeout", "5"])
    assert result.exit_code == 2
    assert "cannot reach the deployment" in result.output


# ------------------------------------------------------------------------------------------ metrics


def test_metric_total_reads_the_real_fixture() -> None:
    text = (FIXTURES / "nixl-decode.metrics.txt").read_text()
    assert metric_total(text, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}) == 1049
    assert metric_total(text, "vllm:nixl_xfer_time_seconds_count") == 3
    example = (FIXTURES / "example-connector-decode.metrics.txt").read_text()
    assert metric_total(example, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}) == 1792
    assert metric_total(example, "vllm:nixl_xfer_time_seconds_count") is None


# -------------------------------------------------------------------------------------- the proof's verdict


def _reply(ids: Sequence[int], tops: Sequence[dict[int, float]] | None) -> dict[str, object]:
    """A /v1/completions reply in vLLM 0.32's shape (logprobs with return_tokens_as_token_ids)."""
    logprobs = None
    if tops is not None:
        logprobs = {
            "text_offset": list(range(len(ids))),
            "token_logprobs": [top[t] for t, top in zip(ids, tops, strict=True)],
            "tokens": [f"token_id:{t}" for t in ids],
            "top_logprobs": [{f"token_id:{k}": v for k, v in top.items()} for top in tops],
        }
    return {"choices": [{"index": 0, "text": "x", "logprobs": logprobs, "token_ids": list(ids)}]}


def _sample(ids: Sequence[int], tops: Sequence[dict[int, float]] | None) -> proof.Sample:
    sample = proof.parse_sample(_reply(ids, tops))
    assert sample is not None
    return sample


SURE = {1: -0.1, 9: -3.0}


def test_identical_tokens_are_proven() -> None:
    ref = _sample([1, 1], [SURE, SURE])
    assert proof.first_divergence(ref, _sample([1, 1], [SURE, {1: -0.12, 9: -2.9}])) is None


def test_a_near_tie_that_breaks_the_other_way_is_a_tie() -> None:
    ref = _sample([1, 5, 6], [SURE, {5: -1.00, 6: -1.03, 9: -4.0}, {6: -0.5, 9: -2.0}])
    pd = _sample([1, 6, 6], [SURE, {6: -1.01, 5: -1.02, 9: -4.0}, {6: -0.5, 9: -2.0}])
    div = proof.first_divergence(ref, pd)
    assert div is not None and div.verdict == "tie"
    assert (div.position, div.ref_token, div.pd_token) == (1, 5, 6)
    assert div.ref_margin == pytest.approx(0.03) and div.pd_margin == pytest.approx(0.01)
    assert div.drift == pytest.approx(0.02)  # token 5: -1.00 on the reference, -1.02 on PD


def test_a_clear_margin_is_corruption_even_when_both_tokens_are_in_the_top_k() -> None:
    ref = _sample([1, 5], [SURE, {5: -0.2, 6: -1.5}])
    pd = _sample([1, 6], [SURE, {6: -0.3, 5: -1.4}])
    div = proof.first_divergence(ref, pd)
    assert div is not None and div.verdict == "corruption" and div.ref_gap == pytest.approx(1.3)


def test_a_token_outside_the_reference_top_k_is_corruption() -> None:
    div = proof.first_divergence(_sample([5], [{5: -0.01, 6: -0.02}]), _sample([7], [{7: -0.1, 8: -0.2}]))
    assert div is not None and div.verdict == "corruption" and div.ref_gap is None
    assert div.ref_margin == pytest.approx(0.01)  # a near-tie on one side only does not excuse a foreign token


def test_without_logprobs_a_difference_stays_a_failure() -> None:
    div = proof.first_divergence(_sample([5, 6], None), _sample([5, 7], None))
    assert div is not None and div.verdict == "corruption" and div.ref_margin is None
    assert "margin n/a" in link.describe(div, {})


def test_tokens_are_shown_by_id_and_escaped_text() -> None:
    assert proof.show_token(5, "\ufffd\n") == 'id 5 "\\ufffd\\n"'
    assert proof.show_token(7, "缓存") == 'id 7 "缓存"'
    div = proof.first_divergence(_sample([5], [{5: -0.1, 6: -2.0}]), _sample([6], [{6: -0.1, 5: -2.0}]))
    assert div is not None
    text = link.describe(div, {5: "\ufffd", 6: "ag"})
    assert "\ufffd" not in text and "output token 0" in text and 'id 5 "\\ufffd"' in text and 'id 6 "ag"' in text
    assert "margin 1.900 nats" in text


def _pair_and_probe(tmp_path: Path, div: proof.Divergence | None, first_tie: proof.Divergence | None) -> str:
    from pdctl.verify.wire import Http

    cpath, spath = _write_files(tmp_path)
    dep = config.load(cpath, spath)
    with httpx.Client() as client:
        pair = link.Pair(Http(client, 1.0), dep.prefill[0], dep.decode[0], "NixlConnector", "NixlConnector", "n")
    sample = _sample([5], [{5: -0.1, 6: -0.12}])
    probe = link.Probe("short", ("r",), "p", 3, external_delta=3.0, pd=sample, ref=sample)
    res = link.judge_correctness(pair, [replace(probe, divergence=div, first_tie=first_tie)], True)
    return f"{res.ok} {res.detail}"


def test_a_second_tie_is_inconclusive_not_a_failure(tmp_path: Path) -> None:
    tie = proof.first_divergence(_sample([5], [{5: -1.0, 6: -1.01}]), _sample([6], [{6: -1.0, 5: -1.01}]))
    assert tie is not None and tie.verdict == "tie"
    out = _pair_and_probe(tmp_path, tie, tie)
    assert out.startswith("None inconclusive at a numerical tie") and "output token 0" in out
    settled = _pair_and_probe(tmp_path, None, tie)
    assert settled.startswith("True short: token ids identical (re-run after a tie: first difference")


# ------------------------------------------------------------------------------- real vLLM: a broken link


@pytest.mark.real
@pytest.mark.timeout(2400)
def test_real_decode_with_other_weights_fails_correctness_as_corruption(tmp_path: Path) -> None:
    """Decode serves seed-1 weights under prefill's model path, name and tokenizer: only the output can tell.

    Runs benchmarks/verify_false_alarms.py's broken case (examples/cpu on free ports) without taking
    /tmp/pdctl-real.lock itself: wrap the real suite in it (``flock /tmp/pdctl-real.lock ...``).
    """
    require_engine(("vllm-cpu", "nixl"))
    out = tmp_path / "broken.json"
    script = REPO / "benchmarks" / "verify_false_alarms.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), "--runs", "0", "--broken", "1", "--lock", "", "--models", str(tmp_path),
         "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(script.parent.parent)},
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=2300)
    finally:
        if proc.poll() is None:  # a timeout: SIGTERM lets the benchmark stop its two engines
            proc.terminate()
            proc.wait(120)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    assert "error" not in run, run
    assert run["identity_ok"] is True, run["identity"]  # same root, name, tokenizer and vLLM: identity cannot tell
    assert run["kv_correctness"]["ok"] is False and run["detected"] is True, run["kv_correctness"]
    assert "corrupted" in run["kv_correctness"]["cause"]
    for probe in run["probes"]:
        div = probe["divergence"]
        assert div is not None and div["verdict"] == "corruption", probe
    assert "first difference at output token" in run["kv_correctness"]["detail"]
