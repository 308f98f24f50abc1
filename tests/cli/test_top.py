"""`pdctl top`: the data layer on recorded metrics (real vLLM bodies, the gateway's own registry), and the live
view in a real terminal (tmux) over a simulator deployment.

* rates come from the deltas between scrapes, over the last few seconds; a counter that went down restarted;
* the gateway's TTFT/TPOT quantiles come from bucket deltas over the last minute (older observations drop out);
* an endpoint that does not answer is a "down" cell, never an exception;
* tmux runs `pdctl top` beside a loaded deployment: worker rows, numbers that move, `q` exits 0 to the shell.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdctl.gateway.metrics import GatewayMetrics
from pdctl.runtime.top import (
    Frame,
    GatewaySample,
    Scraper,
    Target,
    Unreachable,
    Watch,
    WorkerSample,
    bucket_quantile,
    counter_delta,
    parse_gateway,
    parse_worker,
)
from pdctl.testing import free_port, kill_groups
from tests.cli.test_run_cmds import KEY, KEY_VAR, env, pdctl, recorded_pids, write_deployment
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "vllm-cpu"
NIXL_DECODE = (FIXTURES / "nixl-decode.metrics.txt").read_text(encoding="utf-8")
EXAMPLE_DECODE = (FIXTURES / "example-connector-decode.metrics.txt").read_text(encoding="utf-8")
WORKERS = [Target("prefill", "prefill", "http://127.0.0.1:1"), Target("decode", "decode", "http://127.0.0.1:2")]
GATEWAY = Target("gateway", "gateway", "http://127.0.0.1:3")


def with_values(text: str, **values: float) -> str:
    """A recorded vLLM body with some samples changed: ``generation_tokens_total=...`` sets
    ``vllm:generation_tokens_total{...}`` (the one engine's line)."""
    out = []
    for line in text.splitlines():
        name = line.split("{", 1)[0].removeprefix("vllm:")
        if not line.startswith("#") and name in values:
            line = f"{line.rsplit(' ', 1)[0]} {values[name]}"
        out.append(line)
    return "\n".join(out) + "\n"


def gateway_body(m: GatewayMetrics) -> GatewaySample:
    return parse_gateway(m.render().decode())


def frame(at: float, decode: WorkerSample | Unreachable, gateway: GatewaySample | Unreachable) -> Frame:
    return Frame(at, {"prefill": Unreachable("down"), "decode": decode}, gateway)


# ---- parsing -------------------------------------------------------------------------------------------------------


def test_parse_worker_reads_vllm_gauges_and_counters() -> None:
    s = parse_worker(NIXL_DECODE)
    assert (s.running, s.waiting, s.kv_usage) == (0.0, 0.0, 0.0)  # not vllm:num_requests_waiting_by_reason
    assert s.counters == {"prompt_tokens": 2098.0, "generation_tokens": 96.0, "transfers": 3.0}
    # ExampleConnector has no NIXL histogram: transfers are unknown, not zero.
    assert "transfers" not in parse_worker(EXAMPLE_DECODE).counters
    assert parse_worker("not prometheus {{{") == WorkerSample(None, None, None, {})


# ---- worker rates --------------------------------------------------------------------------------------------------


def test_rates_from_two_scrapes() -> None:
    w = Watch(WORKERS, GATEWAY)
    before = parse_worker(with_values(NIXL_DECODE, num_requests_running=0))
    after = parse_worker(
        with_values(NIXL_DECODE, num_requests_running=3, num_requests_waiting=1, kv_cache_usage_perc=0.25,
                    prompt_tokens_total=2098 + 400, generation_tokens_total=96 + 60, nixl_xfer_time_seconds_count=7)
    )  # fmt: skip
    w.add(frame(100.0, before, Unreachable("down")))
    first = w.view().workers[1]
    assert first.running == 0 and first.prompt_tps is None  # one scrape: no rate yet
    w.add(frame(102.0, after, Unreachable("down")))
    row = w.view().workers[1]
    assert (row.down, row.running, row.waiting, row.kv_usage) == (None, 3.0, 1.0, 0.25)
    assert row.prompt_tps == pytest.approx(200.0)
    assert row.generation_tps == pytest.approx(30.0)
    assert row.transfers_ps == pytest.approx(2.0)


def test_rates_cover_the_last_seconds_and_survive_a_restart() -> None:
    w = Watch(WORKERS, GATEWAY, rate_window_s=2.0)
    for at, gen in ((0.0, 0), (1.0, 1000), (2.0, 1010), (3.0, 1030)):
        w.add(frame(at, parse_worker(with_values(NIXL_DECODE, generation_tokens_total=gen)), Unreachable("down")))
    # Only the last two seconds: (1030 - 1000) / 2.
    assert w.view().workers[1].generation_tps == pytest.approx(15.0)
    # The worker restarted: its counter starts again from zero and counts as 6 tokens, not -1024.
    w.add(frame(4.0, parse_worker(with_values(NIXL_DECODE, generation_tokens_total=6)), Unreachable("down")))
    assert w.view().workers[1].generation_tps == pytest.approx((20 + 6) / 2)
    assert counter_delta({"a": 10.0, "gone": 1.0}, {"a": 4.0, "b": 2.0}) == {"a": 4.0, "b": 2.0}


def test_a_worker_that_does_not_answer_is_a_down_row() -> None:
    w = Watch(WORKERS, GATEWAY)
    w.add(frame(0.0, parse_worker(NIXL_DECODE), Unreachable("HTTP 401")))
    w.add(frame(1.0, Unreachable("timeout"), Unreachable("HTTP 401")))
    view = w.view()
    assert [(r.name, r.down, r.running, r.generation_tps) for r in view.workers] == [
        ("prefill", "down", None, None),
        ("decode", "timeout", None, None),
    ]
    assert view.gateway.down == "HTTP 401" and view.gateway.paths == []
    # Back up: the rate skips the pair it was down in (no rate until two good scrapes).
    w.add(frame(2.0, parse_worker(NIXL_DECODE), Unreachable("down")))
    assert w.view().workers[1].down is None and w.view().workers[1].generation_tps is None


# ---- gateway quantiles ---------------------------------------------------------------------------------------------


def test_bucket_quantile_interpolates_like_prometheus() -> None:
    inf = float("inf")
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 above 0.2.
    buckets = {0.1: 4.0, 0.2: 8.0, inf: 10.0}
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.125)  # rank 5: a quarter into (0.1, 0.2]
    assert bucket_quantile(0.2, buckets) == pytest.approx(0.05)
    assert bucket_quantile(0.9, buckets) == pytest.approx(0.2)  # in +Inf: the highest finite bound
    assert bucket_quantile(0.5, {0.1: 0.0, inf: 0.0}) is None
    assert bucket_quantile(0.5, {}) is None


def test_gateway_paths_errors_and_quantiles_over_the_last_minute() -> None:
    m = GatewayMetrics()
    old = m.ttft.labels("disagg")
    for _ in range(50):  # before top started: never in the view
        old.observe(5.0)
        m.requests.labels("disagg", "200").inc()
    w = Watch(WORKERS, GATEWAY)
    w.add(frame(0.0, Unreachable("down"), gateway_body(m)))
    for v in (0.03, 0.03, 0.03, 0.15):  # at t=10: disagg TTFT
        m.ttft.labels("disagg").observe(v)
        m.tpot.labels("disagg").observe(0.015)
        m.requests.labels("disagg", "200").inc()
    m.ttft.labels("local").observe(0.004)
    m.requests.labels("local", "200").inc()
    m.requests.labels("rejected", "429").inc()
    m.requests.labels("disagg", "499").inc()  # a client that left: not an error
    m.requests.labels("disagg", "stream_error").inc()
    m.fallbacks.labels("no_kv_params").inc()
    w.add(frame(10.0, Unreachable("down"), gateway_body(m)))

    gw = w.view().gateway
    assert gw.down is None and gw.window_s == pytest.approx(10.0) and gw.fallbacks == 1.0 and gw.in_flight == 0.0
    rows = {r.path: r for r in gw.paths}
    assert list(rows) == ["disagg", "local", "rejected"]  # busiest first
    assert (rows["disagg"].requests, rows["disagg"].errors) == (6.0, 1.0)
    assert (rows["rejected"].requests, rows["rejected"].errors) == (1.0, 1.0)
    # disagg: 3 of 4 in (0.025, 0.05], 1 in (0.1, 0.2]; the 50 old 5 s observations are not in the deltas.
    assert rows["disagg"].ttft[0.5] == pytest.approx(0.025 + 0.025 * (2 / 3))
    assert rows["disagg"].ttft[0.9] == pytest.approx(0.1 + 0.1 * (0.6 / 1))
    assert rows["disagg"].tpot[0.5] == pytest.approx(0.01 + 0.01 * 0.5)
    assert rows["local"].tpot[0.5] is None and rows["rejected"].ttft[0.5] is None
    assert gw.total is not None and gw.total.requests == 8.0 and gw.total.errors == 2.0
    assert gw.total.ttft[0.5] == pytest.approx(0.025 + 0.025 * (1.5 / 3))  # 5 observations, rank 2.5

    # A minute later with nothing new, the window holds no requests (the frames of t=0 and t=10 are gone).
    for at in range(20, 80, 10):
        w.add(frame(float(at), Unreachable("down"), gateway_body(m)))
    gw = w.view().gateway
    assert gw.window_s == pytest.approx(60.0) and gw.paths == []
    assert gw.total is not None and gw.total.requests == 0 and gw.total.ttft[0.9] is None
    assert len(w.frames) <= 8


def test_agent_sessions_cache_breaks_in_the_window_by_where() -> None:
    from rich.console import Console

    from pdctl.cli.top_cmd import _gateway_part

    m = GatewayMetrics()
    m.cache_breaks.labels("system").inc()  # before top started: not in the window
    w = Watch(WORKERS, GATEWAY)
    w.add(frame(0.0, Unreachable("down"), gateway_body(m)))
    m.cache_breaks.labels("system").inc(2)
    m.cache_breaks.labels("trailing_system").inc()
    w.add(frame(10.0, Unreachable("down"), gateway_body(m)))
    gw = w.view().gateway
    assert gw.cache_breaks == {"system": 2.0, "trailing_system": 1.0}
    console = Console(width=200, record=True)
    console.print(_gateway_part(gw, (400.0, 40.0), "PDCTL_API_KEY"))
    assert "cache breaks 3 (system 2, trailing_system 1)" in console.export_text()


def test_the_autopilots_error_in_the_window_is_shown_as_its_median() -> None:
    """pd_mode = auto: observed / predicted TTFT and TPOT per request; top shows each median over the window (the
    observations before it left out) and nothing for a gateway that exports no predictor."""
    from rich.console import Console

    from pdctl.cli.top_cmd import _gateway_part

    m = GatewayMetrics()
    w = Watch(WORKERS, GATEWAY)
    w.add(frame(0.0, Unreachable("down"), gateway_body(m)))
    assert w.view().gateway.predictor == {}  # no autopilot: no line
    m.autopilot_ttft_ratio.labels("local").observe(3.5)  # before top's window
    w.add(frame(5.0, Unreachable("down"), gateway_body(m)))
    for ratio in (0.95, 0.95, 1.05):
        m.autopilot_ttft_ratio.labels("local").observe(ratio)
    m.autopilot_ttft_ratio.labels("disagg").observe(0.95)
    w.add(frame(10.0, Unreachable("down"), gateway_body(m)))
    w.frames.popleft()
    gw = w.view().gateway
    ttft = gw.predictor["TTFT"]
    assert ttft is not None and 0.9 < ttft <= 1.0 and gw.predictor.get("TPOT") is None
    console = Console(width=200, record=True)
    console.print(_gateway_part(gw, (400.0, 40.0), "PDCTL_API_KEY"))
    assert f"autopilot observed/predicted p50 TTFT {ttft:.2f}x" in console.export_text()


def test_the_gateways_sizing_advice_is_a_line_with_now_and_recommended() -> None:
    """slo.capacity_profile: the advisor's gauges, as the gateway exports them, become top's advice line; a gateway
    without a profile shows none."""
    from rich.console import Console

    from pdctl.capacity.advisory import advise_counts
    from pdctl.capacity.model import Histogram, Workload
    from pdctl.cli.top_cmd import _gateway_part
    from pdctl.config import SLOConfig
    from pdctl.gateway.advisor import Advisor
    from tests.capacity.conftest import timing_profile

    m = GatewayMetrics()
    w = Watch(WORKERS, GATEWAY)
    w.add(frame(0.0, Unreachable("down"), gateway_body(m)))
    assert w.view().gateway.advice is None
    advisor = Advisor(timing_profile(), SLOConfig(advise_window_s=120.0), m, lambda: (1, 1))
    workload = Workload(Histogram(((1800.0, 1.0),)), Histogram(((12.0, 1.0),)), 40.0)
    advice = advise_counts(advisor.profile, workload, advisor.slo, 40.0, 400, 1, 1)
    assert advice.recommended is not None and advice.current is not None
    advisor.publish(advice)
    w.add(frame(5.0, Unreachable("down"), gateway_body(m)))
    shown = w.view().gateway.advice
    assert shown is not None and shown.status == advice.status and shown.window == "120s"
    assert shown.current == (1, 1) and shown.recommended == (advice.recommended_prefill, advice.recommended_decode)
    assert shown.ttft_p90 == (pytest.approx(advice.current.ttft_p90_s), pytest.approx(advice.recommended.ttft_p90_s))
    console = Console(width=240, record=True)
    console.print(_gateway_part(w.view().gateway, (400.0, 40.0), "PDCTL_API_KEY"))
    text = console.export_text()
    assert "prefill short for the TTFT SLO" in text or "prefill and decode short" in text
    assert f"1P1D -> {advice.recommended_prefill}P{advice.recommended_decode}D" in text
    assert f"{advice.recommended.ttft_p90_s * 1000:.0f} ms" in text


# ---- scraping ------------------------------------------------------------------------------------------------------


def test_scraper_sends_the_key_to_the_gateway_only_and_never_raises() -> None:
    seen: dict[str, str | None] = {}
    m = GatewayMetrics()
    m.requests.labels("disagg", "200").inc()

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.host + str(request.url.port)] = request.headers.get("authorization")
        if request.url.port == 1:
            raise httpx.ConnectError("refused", request=request)
        if request.url.port == 2:
            return httpx.Response(200, text=NIXL_DECODE)
        return httpx.Response(200, content=m.render())

    with Scraper(WORKERS, GATEWAY, api_key="sk-top", transport=httpx.MockTransport(handler)) as s:
        f = s.scrape()
    assert f.workers["prefill"] == Unreachable("down")
    assert isinstance(f.workers["decode"], WorkerSample) and f.workers["decode"].counters["generation_tokens"] == 96
    assert isinstance(f.gateway, GatewaySample) and f.gateway.requests == {("disagg", "200"): 1.0}
    assert seen == {"127.0.0.12": None, "127.0.0.13": "Bearer sk-top", "127.0.0.11": None}

    with Scraper(WORKERS, GATEWAY, transport=httpx.MockTransport(lambda r: httpx.Response(401))) as s:
        assert s.scrape().gateway == Unreachable("HTTP 401")


def test_once_on_a_deployment_that_is_not_running_shows_down_cells(tmp_path: Path) -> None:
    """Nothing listens on the deployment's ports: one frame, every endpoint down, exit 0."""
    write_deployment(tmp_path)
    r = pdctl(tmp_path, "top", "--once", "--interval", "0.2", timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.split()[:3] == ["prefill", "prefill", "down"] for ln in lines), r.stdout
    assert any(ln.split()[:3] == ["decode", "decode", "down"] for ln in lines), r.stdout
    assert "gateway http://127.0.0.1:" in r.stdout and "down" in r.stdout.split("gateway http", 1)[1]
    assert "Traceback" not in r.stdout + r.stderr


# ---- a real terminal -----------------------------------------------------------------------------------------------

TMUX = shutil.which("tmux")


def tmux(*args: str, socket: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, timeout=30)


def wait_for_screen(socket: str, pred: object, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux("capture-pane", "-p", "-t", "top", socket=socket).stdout
        if pred(screen):  # type: ignore[operator]
            return screen
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; the pane shows:\n{screen}")


def row(screen: str, name: str) -> list[str]:
    for line in screen.splitlines():
        cells = line.split()
        if cells[:2] == [name, name]:
            return cells
    return []


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[tuple[Path, dict[str, int]]]:
    ports = write_deployment(tmp_path, prefill_extra=["--sim-profile", "h100"], decode_extra=["--sim-profile", "h100"])
    try:
        r = pdctl(tmp_path, "up", "-d")
        assert r.returncode == 0, r.stdout + r.stderr
        yield tmp_path, ports
    finally:
        pdctl(tmp_path, "down", timeout=120)
        kill_groups(recorded_pids(tmp_path))


@pytest.fixture
def tmux_socket(tmp_path: Path) -> Iterator[str]:
    socket = f"pdctl-top-{free_port()}"
    try:
        yield socket
    finally:
        tmux("kill-server", socket=socket)


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (Debian package `tmux`; .ci/run installs it)")
def test_top_in_tmux_shows_the_load_and_quits_on_q(deployment: tuple[Path, dict[str, int]], tmux_socket: str) -> None:
    d, ports = deployment
    shell_env = env()
    exports = " ".join(f"{k}={v}" for k, v in shell_env.items() if k in (KEY_VAR, "PYTHONUNBUFFERED"))
    # A plain shell in a 160x50 terminal; `top` runs in it, then the shell prints its exit status.
    r = tmux("new-session", "-d", "-s", "top", "-x", "160", "-y", "50", "-c", str(d),
             "env", "-u", "NO_COLOR", "-u", "COLUMNS", "PS1=$ ", "bash", "--norc", "--noprofile", socket=tmux_socket)  # fmt: skip
    assert r.returncode == 0, r.stderr
    tmux("send-keys", "-t", "top", f"{exports} {sys.executable} -m pdctl top; echo top-exit=$?", "Enter",
         socket=tmux_socket)  # fmt: skip
    screen = wait_for_screen(tmux_socket, lambda s: row(s, "decode") and "TTFT p90" in s, 60, "the first frame")
    assert row(screen, "prefill")[2] == "up" and row(screen, "decode")[2] == "up"
    assert "q: quit" in screen

    stop = threading.Event()

    def load() -> None:
        url = f"http://127.0.0.1:{ports['gateway']}/v1/completions"
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    body = {"model": "sim-model", "prompt": "tell me a story " * 20, "max_tokens": 64, "stream": True}
                    with client.stream("POST", url, json=body) as resp:
                        for _ in resp.iter_bytes():
                            pass

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        # The decode's generation rate and the gateway's disagg row move while the load runs.
        screen = wait_for_screen(
            tmux_socket,
            lambda s: len(row(s, "decode")) > 7 and row(s, "decode")[7] not in ("-", "0.0") and "disagg" in s,
            90,
            "decode's gen tok/s above zero and the gateway's disagg row",
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=70)
    disagg = next(line.split() for line in screen.splitlines() if line.split()[:1] == ["disagg"])
    assert float(disagg[1]) >= 1  # requests in the last minute
    assert disagg[4] != "-" and float(disagg[4]) > 0  # TTFT p50 (ms) from the bucket deltas

    tmux("send-keys", "-t", "top", "q", socket=tmux_socket)
    # The typed line reads "top-exit=$?"; the shell's answer has the number.
    screen = wait_for_screen(tmux_socket, lambda s: re.search(r"top-exit=\d", s), 30, "top to exit on q")
    assert "top-exit=0" in screen
    assert "Traceback" not in screen
    # Back to a normal shell: the alternate screen is gone and the shell still echoes what is typed.
    assert "q: quit" not in screen and "TTFT p90" not in screen
    tmux("send-keys", "-t", "top", "echo shell-is-back", "Enter", socket=tmux_socket)
    wait_for_screen(tmux_socket, lambda s: s.count("shell-is-back") >= 2, 30, "the shell to answer")

    # stdin not a terminal: no `q` (the title says so), Ctrl-C still ends it, with 130 and no traceback.
    tmux("send-keys", "-t", "top", f"clear; {sys.executable} -m pdctl top < /dev/null; echo top-exit=$?", "Enter",
         socket=tmux_socket)  # fmt: skip
    screen = wait_for_screen(tmux_socket, lambda s: row(s, "decode") and "TTFT p90" in s, 60, "the frame")
    assert "q: quit" not in screen
    tmux("send-keys", "-t", "top", "C-c", socket=tmux_socket)
    screen = wait_for_screen(tmux_socket, lambda s: re.search(r"top-exit=\d", s), 30, "top to exit on Ctrl-C")
    assert "top-exit=130" in screen and "Traceback" not in screen and "TTFT p90" not in screen
