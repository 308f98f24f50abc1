"""pdctl bench against simulator workers (``python -m pdctl.sim``) and the gateway (``python -m pdctl gateway``).

Timing check: with the ``h100`` profile slowed 4x (``--sim-speed 0.25``) the simulator's formulas give the
expected prefill time and decode step; the measured TTFT and TPOT (concurrency 1) must match them within a
generous tolerance (TTFT: -20 % / +50 % + 40 ms; TPOT: -15 % / +30 % + 5 ms), because HTTP, the event loops
and a shared 2-core machine add time but can never remove it. ``--sim-kv-scale 0.001`` keeps the simulator
from spending CPU on building full-size KV bytes, which would otherwise land in TTFT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.bench.engine_metrics import kv_summary
from pdctl.bench.metrics import SLO
from pdctl.bench.runner import BenchTarget, LoadShape, run_ab, run_async, run_once
from pdctl.bench.workload import WorkloadSpec, make_workload
from pdctl.sim.timing import get_profile
from pdctl.testing import SimProcess, free_port, start_sim, stop_group

SLOW = ["--sim-profile", "h100", "--sim-speed", "0.25", "--sim-kv-scale", "0.001"]
PD_ARGS = ["--sim-profile", "h100", "--sim-speed", "0.5", "--sim-kv-scale", "0.001"]
KEY = "bench-test-key-not-secret"


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[Callable[..., SimProcess]]:
    started: list[SimProcess] = []

    def start(args: list[str], name: str, connector: str | None = None, model: str = "tiny") -> SimProcess:
        sp = start_sim(args, str(tmp_path), name=name, model=model, connector=connector)
        started.append(sp)
        return sp

    yield start
    for sp in started:
        sp.stop()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Callable[..., str]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(prefill: str, decode: str, *, admission: bool = False, name: str = "gw", **routing: object) -> str:
        port = free_port()
        settings = {
            "gateway": {"listen": f"127.0.0.1:{port}", "api_key_env": "BENCH_TEST_KEY", "request_timeout_s": 60},
            "routing": {"prefill_endpoint": prefill, "decode_endpoint": decode, "strategy": "pd_disagg",
                        "kv_connector": "NixlConnector", **routing},
            "slo": {"ttft_ms": 400, "tpot_ms": 40, "p90": True, "admission": admission},
        }  # fmt: skip
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(settings))
        env = dict(os.environ, BENCH_TEST_KEY=KEY)
        with open(tmp_path / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdctl", "gateway", "-s", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"gateway exited {proc.returncode}: {(tmp_path / f'{name}.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("gateway not ready after 60 s")
            time.sleep(0.1)

    yield start
    for proc in procs:
        stop_group(proc, 10)


def test_measured_ttft_and_tpot_are_no_shorter_than_the_sim_profile(sims: Callable[..., SimProcess]) -> None:
    """The simulator waits its profile's prefill and decode steps, and bench measures at least that wait. How
    close to the profile wall time comes depends on the machine: no upper bound here (the virtual-time proof is
    tests/sim/test_timing.py; benchmarks/bench_agreement.py compares bench's times with vLLM's own client)."""
    sp = sims(SLOW, "colo")
    wl = make_workload(WorkloadSpec("random", input_len=512, output_len=32))
    run = run_async(run_once(BenchTarget(sp.url, "tiny", wl), LoadShape(concurrency=1, num_requests=6, warmup=1)))
    s = run.summary
    assert (s.completed, s.failed) == (6, 0), run.warnings
    profile = get_profile("h100")
    prompt = run.results[0].prompt_tokens
    assert prompt >= 500  # the simulator counted the prompt we meant to send
    expected_ttft_ms = profile.prefill_s(prompt) * 1000 / 0.25
    expected_tpot_ms = profile.decode_step_s(1, prompt + 16) * 1000 / 0.25
    assert s.ttft.median >= 0.8 * expected_ttft_ms, (s.ttft, expected_ttft_ms)
    assert s.tpot.median >= 0.85 * expected_tpot_ms, (s.tpot, expected_tpot_ms)
    assert all(r.output_tokens == 32 for r in run.results)  # ignore_eos + usage chunk
    assert s.itl.count == 6 * 31


def test_cli_run_json_html_and_compare(
    sims: Callable[..., SimProcess], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    sp = sims(["--sim-profile", "fast"], "fast")
    out, page = tmp_path / "a.json", tmp_path / "a.html"
    result = cli(
        "bench", "--gateway", sp.url, "-w", "doc", "-n", "6", "--rate", "20", "--seed", "3",
        "--goodput", "ttft:5000", "tpot:1000", "--percentiles", "50,90,99.9", "-o", str(out), "--html", str(page),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "SLO attainment" in result.output and "100.0% met" in result.output
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["failed"] == 0 and data["model_id"] == "tiny"
    assert data["goodput"] == {"ttft": 5000.0, "tpot": 1000.0}
    assert "p99.9_ttft_ms" in data and data["request_goodput"] > 0
    assert data["pdctl"]["workload"]["name"] == "doc"
    assert page.read_text().count("<svg") >= 5

    other = tmp_path / "b.json"
    result = cli("bench", "--gateway", sp.url, "-w", "doc", "-n", "4", "--concurrency", "2", "-o", str(other))
    assert result.exit_code == 0, result.output
    assert json.loads(other.read_text())["max_concurrency"] == 2
    result = cli("bench", "--compare", str(out), "--compare", str(other))
    assert result.exit_code == 0, result.output
    assert "B/A" in result.output and "mean_ttft_ms" in result.output


def test_cli_errors_are_one_line(cli: Callable[..., Any], tmp_path: Path) -> None:
    result = cli("bench", "--gateway", "http://127.0.0.1:9", "--model", "m", "-w", "nope")
    assert result.exit_code == 1 and "unknown workload" in result.output and "Traceback" not in result.output
    result = cli("bench", "--gateway", "http://127.0.0.1:9", "--model", "m", "--goodput", "ttft:x")
    assert result.exit_code == 1 and "--goodput" in result.output
    result = cli("bench", "--gateway", "http://127.0.0.1:9", "--model", "m", "--rate", "0")
    assert result.exit_code == 1 and "--rate" in result.output
    result = cli("bench", "--compare", str(tmp_path / "missing.json"), "--compare", str(tmp_path / "x.json"))
    assert result.exit_code == 1 and "cannot read" in result.output


def test_unreachable_server_is_counted_as_failures(cli: Callable[..., Any], tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    port = free_port()
    result = cli(
        "bench", "--gateway", f"http://127.0.0.1:{port}", "--model", "m", "-n", "3", "--warmup", "0",
        "--timeout", "5", "-o", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["completed"] == 0 and data["failed"] == 3
    assert all("ConnectError" in e for e in data["errors"])


def test_ab_mixed_runs_both_sides_and_pd_moves_every_requests_kv(
    sims: Callable[..., SimProcess], gateway: Callable[..., str]
) -> None:
    """An A/B of colocated against PD on the mixed workload: both sides complete every request, each PD request
    takes the disaggregated path and moves its KV. Which side is faster in wall time depends on the machine; the
    recipe's claim (long prompts stall colocated decode, not PD's) is proven on virtual time in
    tests/sim/test_timing.py and measured by ``python -m benchmarks.sim_interference --clock wall``."""
    p = sims(PD_ARGS, "prefill", connector="NixlConnector")
    d = sims(PD_ARGS, "decode", connector="NixlConnector")
    colocated = sims(PD_ARGS, "colocated")
    gw = gateway(p.url, d.url)
    wl = make_workload(
        WorkloadSpec("mixed", short_len=128, long_len=8192, long_fraction=0.25, output_len=32, long_output_len=4)
    )
    shape = LoadShape(rate=4.0, num_requests=30, warmup=1, slo=SLO(ttft_ms=2000, tpot_ms=25))
    pd_target = BenchTarget(
        gw, "tiny", wl, api_key=KEY, label="pd", metrics_urls=(f"{p.url}/metrics", f"{d.url}/metrics")
    )
    pair = run_async(run_ab(BenchTarget(colocated.url, "tiny", wl, label="colocated"), pd_target, shape, [4.0]))
    col, pd = pair.a[0].summary, pair.b[0].summary
    assert (col.failed, pd.failed) == (0, 0), (pair.a[0].warnings, pair.b[0].warnings)
    assert pd.paths == {"disagg": 30}
    for side in (col, pd):  # both kinds of request measured on both sides, every request counted once
        counts = {k: side.by_kind[k]["ttft"].count for k in ("short", "long")}
        assert min(counts.values()) > 0 and sum(counts.values()) == 30, counts
    kv = kv_summary(pair.b[0].metric_deltas)
    assert kv["kv_transfers"] >= 30 and kv["external_kv_tokens"] > 0
    assert kv["kv_failed_transfers"] == 0
    assert not any("fallback" in w for w in pair.b[0].warnings)


def test_three_sides_colocated_always_pd_and_adaptive_in_one_run(
    sims: Callable[..., SimProcess], gateway: Callable[..., str], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    """``--ab --ab-side adaptive=URL``: the three sides over the same workers, rate by rate in one run. Under
    adaptive PD the short prompts go to decode alone and the long ones take both legs; always-PD disaggregates
    every request."""
    p = sims(PD_ARGS, "prefill", connector="NixlConnector")
    d = sims(PD_ARGS, "decode", connector="NixlConnector")
    pd = gateway(p.url, d.url, name="pd")
    adaptive = gateway(p.url, d.url, name="adaptive", pd_mode="adaptive", local_max_uncached_tokens=512)
    colocated = gateway(p.url, d.url, name="colocated", strategy="colocated")
    out = tmp_path / "ab3.json"
    result = cli(
        "bench", "--gateway", pd, "--ab", "--ab-gateway", colocated, "--ab-side", f"adaptive={adaptive}",
        "-w", "mixed", "--rate", "4,8", "-n", "12", "--short-len", "64", "--long-len", "2048", "--long-fraction",
        "0.25", "--output-len", "8", "--long-output-len", "4", "--no-progress", "-o", str(out),
        env={"PDCTL_API_KEY": KEY},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "adaptive vs colocated" in result.output and "pd vs colocated" in result.output
    runs = json.loads(out.read_text())
    assert [(r["label"], r["request_rate"]) for r in runs] == [
        (side, rate) for rate in (4.0, 8.0) for side in ("colocated", "pd", "adaptive")
    ]
    for r in runs:
        assert r["completed"] == 12, r
        paths = r["pdctl"]["paths"]
        if r["label"] == "pd":
            assert paths == {"disagg": 12}
        elif r["label"] == "adaptive":
            kinds = r["pdctl"]["by_kind"]
            assert paths.get("local", 0) == kinds["short"]["ttft"]["count"] > 0, (paths, kinds)
            assert paths.get("disagg", 0) == kinds["long"]["ttft"]["count"] > 0, (paths, kinds)
    bad = cli("bench", "--gateway", pd, "--ab", "--ab-gateway", colocated, "--ab-side", "pd=" + adaptive, "-n", "1")
    assert bad.exit_code != 0 and "taken" in bad.output
    bad = cli("bench", "--gateway", pd, "--ab-side", "x=" + adaptive, "-n", "1")
    assert bad.exit_code != 0 and "--ab-side needs --ab" in bad.output


def test_sweep_moves_the_same_kv_per_request_at_every_rate(
    sims: Callable[..., SimProcess], gateway: Callable[..., str], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    """Each rate of a sweep sends prompts of its own: no rate finds the previous ones in a prefix cache."""
    p = sims(PD_ARGS, "prefill", connector="NixlConnector")
    d = sims(PD_ARGS, "decode", connector="NixlConnector")
    gw = gateway(p.url, d.url)
    out = tmp_path / "sweep.json"
    result = cli(
        "bench", "--gateway", gw, "-w", "mixed", "--rate", "2,4,8", "-n", "12", "--short-len", "128",
        "--long-len", "1024", "--long-fraction", "0.25", "--output-len", "8", "--long-output-len", "4",
        "--metrics-url", f"{p.url}/metrics", "--metrics-url", f"{d.url}/metrics", "--no-progress", "-o", str(out),
        env={"PDCTL_API_KEY": KEY},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "[long] TTFT p50 / p90 / p99 (ms)" in result.output and "[short] ITL max (ms)" in result.output
    runs = json.loads(out.read_text())
    assert [r["request_rate"] for r in runs] == [2.0, 4.0, 8.0] and all(r["completed"] == 12 for r in runs)
    kv = [r["pdctl"]["kv_transfer"] for r in runs]
    per_request = [k["external_kv_tokens"] / r["completed"] for k, r in zip(kv, runs, strict=True)]
    assert per_request[0] > 128 and per_request == [per_request[0]] * 3, kv
    assert all(k["local_cache_hit_tokens"] == 0 for k in kv), kv
    assert len({r["pdctl"]["workload"]["run_id"] for r in runs}) == 3


def test_cli_admission_and_ab_modes(sims: Callable[..., SimProcess], tmp_path: Path, cli: Callable[..., Any]) -> None:
    a = sims(["--sim-profile", "fast"], "a")
    b = sims(["--sim-profile", "fast"], "b")
    out = tmp_path / "adm.json"
    result = cli(
        "bench", "--gateway", a.url, "--admission-off-gateway", b.url, "-w", "random", "--input-len", "32",
        "--output-len", "8", "--rate", "20,40", "-n", "5", "--goodput", "ttft:2000", "-o", str(out), "--no-progress",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Admission control under load" in result.output
    runs = json.loads(out.read_text())
    assert [(r["label"], r["request_rate"]) for r in runs] == [
        ("admission off", 20.0), ("admission on", 20.0), ("admission off", 40.0), ("admission on", 40.0),
    ]  # fmt: skip
    assert runs[0]["pdctl"]["base_url"] == b.url and runs[1]["pdctl"]["base_url"] == a.url

    result = cli("bench", "--gateway", a.url, "--ab", "-n", "2")
    assert result.exit_code == 1 and "--ab-gateway" in result.output
    result = cli("bench", "--gateway", a.url, "--ab", "--ab-gateway", b.url, "-n", "3", "--rate", "50")
    assert result.exit_code == 0, result.output
    assert "pd vs colocated" in result.output and "B/A" in result.output


def test_cli_reads_model_slo_and_key_from_the_config(
    sims: Callable[..., SimProcess],
    tmp_path: Path,
    cli: Callable[..., Any],
    recipe_files: Callable[..., tuple[Path, Path]],
) -> None:
    model = "Qwen/Qwen3-8B"  # the recipe's config.toml; the simulator serves whatever name it is given
    sp = sims(["--sim-profile", "fast"], "qwen", model=model)
    cpath, spath = recipe_files()
    out = tmp_path / "r.json"
    result = cli(
        "bench", "-c", str(cpath), "-s", str(spath), "--gateway", sp.url, "-n", "3", "--no-metrics",
        "-o", str(out), env={"TAOTOKEN_API_KEY": "sk-never-written-anywhere"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = out.read_text()
    data = json.loads(text)
    assert data["model_id"] == model and data["completed"] == 3
    assert data["goodput"] == {"ttft": 400.0, "tpot": 40.0}  # slo.* from settings.json
    assert data["pdctl"]["slo"]["attainment_target"] == 0.9  # slo.p90 = true
    assert "sk-never-written-anywhere" not in text and "sk-never-written-anywhere" not in result.output


def test_cli_max_goodput_search(sims: Callable[..., SimProcess], tmp_path: Path, cli: Callable[..., Any]) -> None:
    sp = sims(["--sim-profile", "fast"], "search")
    out = tmp_path / "s.json"
    result = cli(
        "bench", "--gateway", sp.url, "-w", "random", "--input-len", "16", "--output-len", "4", "-n", "5",
        "--max-goodput", "--search-start", "10", "--search-max", "40", "--goodput", "ttft:10000", "-o", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "max goodput rate" in result.output
    runs = json.loads(out.read_text())
    assert [r["request_rate"] for r in runs] == [10.0, 20.0, 40.0]
    assert all(r["pdctl"]["max_goodput_rate"] == 40.0 for r in runs)


def test_cli_ab_max_goodput_searches_each_side(
    sims: Callable[..., SimProcess], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    a = sims(["--sim-profile", "fast"], "pd")
    b = sims(["--sim-profile", "fast"], "colocated")
    out, html = tmp_path / "s.json", tmp_path / "s.html"
    result = cli(
        "bench", "--gateway", a.url, "--ab", "--ab-gateway", b.url, "-w", "random", "--input-len", "16",
        "--output-len", "4", "-n", "4", "--max-goodput", "--search-start", "10", "--search-max", "20",
        "--goodput", "ttft:10000", "--no-progress", "-o", str(out), "--html", str(html),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "max goodput rate of colocated" in result.output and "max goodput rate of pd" in result.output
    runs = json.loads(out.read_text())
    assert sorted((r["label"], r["request_rate"]) for r in runs) == [
        ("colocated", 10.0), ("colocated", 20.0), ("pd", 10.0), ("pd", 20.0),
    ]  # fmt: skip
    assert all(r["pdctl"]["max_goodput_rate"] == 20.0 for r in runs)
    # the colocated side is scraped too: its own /metrics (the simulator's vLLM histograms)
    assert all(r["pdctl"]["engine"] for r in runs if r["label"] == "colocated")
    assert "Max goodput rate of colocated" in html.read_text()
