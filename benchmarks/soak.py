"""The bounded soak (reliability case L1): ``pdctl up`` with simulator workers, traffic at concurrency 32
with random client disconnects, one SIGKILL of decode's process group and one of prefill's, then the
"nothing lost" invariants N1–N6 (pdctl/testing/invariants/, docs/reliability.md) and ``pdctl down``.

    .venv/bin/python -m benchmarks.soak                          # 500 requests, the documented long soak
    .venv/bin/python -m benchmarks.soak --requests 2000 --seed 7 --json soak.json
    .venv/bin/python -m benchmarks.soak --pd-mode adaptive       # the gateway decides local or both legs

The traffic mixes three kinds of request: short fresh prompts, long prompts (over
``routing.local_max_uncached_tokens``, so both legs under ``pd_mode = "adaptive"``) and the turns of
conversations (each next turn carries the whole history and the answer streamed back, so adaptive serves it on
the decode alone).

Every wait is bounded; the seed fixes the request mix, the disconnects and the fault points. Exit status 0
when every invariant holds, 1 otherwise. ``tests/test_soak.py`` runs a short form of the same code in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdctl.config.settings import PdMode
from pdctl.testing import free_port
from pdctl.testing import invariants as inv
from pdctl.vllm.promtext import metric_value, samples
from pdctl.vllm.sse import sse_events

KEY_VAR = "PDCTL_SOAK_KEY"
LEASE_S = 5
WORDS = ("kv", "cache", "prefill", "decode", "lease", "block", "token", "stream", "nixl", "gateway", "soak", "seed")
#: About six characters a word: a long prompt (or a conversation's first turn) of 400+ words is some 600 estimated
#: tokens, past the default ``routing.local_max_uncached_tokens`` (512); a short one of at most 120 words is not.
LONG_WORDS = (400, 560)
#: Turns per conversation, the first included; a finished conversation makes room for a new one.
TURNS = 4


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """One soak run's knobs (the defaults are the documented long soak)."""

    requests: int = 500
    concurrency: int = 32
    disconnect_p: float = 0.10
    seed: int = 1
    warm_requests: int = 32
    kill_decode_at: float = 1 / 3
    kill_prefill_at: float = 2 / 3
    sim_speed: float = 4.0
    outage_requests: int = 8
    request_timeout_s: float = 20.0
    recovery_timeout_s: float = 90.0
    pd_mode: PdMode = "always"
    """``routing.pd_mode``: ``adaptive`` serves the later turns and short prompts on the decode alone."""
    long_p: float = 0.2
    """Share of long prompts (both legs under either mode)."""
    turn_p: float = 0.4
    """Share of conversation turns (a new conversation's first turn when none waits for its next)."""


@dataclass(slots=True)
class SoakReport:
    """What a soak did and whether N1–N6 held."""

    config: SoakConfig
    duration_s: float = 0.0
    client: inv.ClientTally = field(default_factory=inv.ClientTally)
    """What the clients saw: the traffic's own tally, the one N1 is checked against."""
    faults: list[str] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    gateway: dict[str, float] = field(default_factory=dict)
    paths: dict[str, int] = field(default_factory=dict)
    """The answers' ``x-pd-path`` (``local``, ``disagg``, ``fallback``, ...), as the clients saw them."""
    invariants: inv.InvariantReport | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every invariant held."""
        return self.invariants is not None and self.invariants.ok

    def render(self) -> str:
        """A plain-text report."""
        c, t = self.config, self.client
        lines = [
            f"soak: {t.sent} requests at concurrency {c.concurrency}, seed {c.seed}, "
            f"{c.disconnect_p:.0%} client disconnects, pd_mode {c.pd_mode}, {self.duration_s:.1f} s",
            f"  client outcomes: {t.succeeded} succeeded, {t.errored} errored, {t.cancelled} cancelled, {t.hung} hung",
            "  HTTP statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(self._statuses().items())),
            "  faults: " + ("; ".join(self.faults) or "none"),
            "  restarts: " + ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())),
            "  gateway: " + ", ".join(f"{k} {v:g}" for k, v in self.gateway.items()),
            "  x-pd-path: " + ", ".join(f"{k} {v}" for k, v in sorted(self.paths.items())),
        ]
        lines += [f"  note: {n}" for n in self.notes]
        if self.invariants is not None:
            lines += ["  " + ln for ln in self.invariants.render().splitlines()]
        lines.append("result: " + ("nothing lost (N1-N6 hold)" if self.ok else "INVARIANT VIOLATED"))
        return "\n".join(lines)

    def _statuses(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(self.client.statuses.items())}

    def to_json(self) -> dict[str, Any]:
        """A plain dict (for ``--json``): the client counts at the top level, beside the faults and invariants."""
        t = self.client
        return {
            "config": asdict(self.config),
            "duration_s": self.duration_s,
            **{k: getattr(t, k) for k in ("sent", "succeeded", "errored", "cancelled", "hung")},
            "statuses": self._statuses(),
            "faults": self.faults,
            "restarts": self.restarts,
            "gateway": self.gateway,
            "paths": self.paths,
            "notes": self.notes,
            "invariants": self.invariants.to_json() if self.invariants is not None else None,
            "ok": self.ok,
        }


def write_deployment(d: Path, cfg: SoakConfig) -> dict[str, int]:
    """config.toml + settings.json for two simulator workers and the gateway on free ports."""
    ports = {n: free_port() for n in ("prefill", "decode", "gateway", "p_side", "d_side")}
    (d / "config.toml").write_text(f"""
[kv_transfer]
timeout_ms = {LEASE_S * 1000}

[prefill]
model = "sim-model"
engine = "sim"
side_channel_port = {ports["p_side"]}
max_model_len = 4096

[decode]
model = "sim-model"
engine = "sim"
side_channel_port = {ports["d_side"]}
max_model_len = 4096
extra_args = ["--sim-fault", "orphan-child"]

[connector]
kv_connector = "NixlConnector"

[sim]
speed = {cfg.sim_speed}
seed = {cfg.seed}

[supervisor]
restart = "on-failure"
start_secs = 1
max_restarts = 3
ready_timeout_s = 120
stop_timeout_s = 5
warmup_timeout_s = 60
""")
    (d / "settings.json").write_text(
        json.dumps(
            {
                "gateway": {
                    "listen": f"127.0.0.1:{ports['gateway']}",
                    "api_key_env": KEY_VAR,
                    "request_timeout_s": cfg.request_timeout_s,
                    "drain_timeout_s": 2,
                },
                "routing": {
                    "prefill_endpoint": f"http://127.0.0.1:{ports['prefill']}",
                    "decode_endpoint": f"http://127.0.0.1:{ports['decode']}",
                    "pd_mode": cfg.pd_mode,
                },
                "slo": {"admission": False},
                "logging": {"level": "debug"},
            },
            indent=2,
        )
    )
    return ports


def _env(key: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update({KEY_VAR: key, "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"})
    return e


def pdctl(d: Path, key: str, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pdctl ARGS`` in ``d``."""
    return subprocess.run(
        [sys.executable, "-m", "pdctl", *args], cwd=d, env=_env(key), capture_output=True, text=True, timeout=timeout_s
    )


def _state(d: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((d / ".pdctl" / "state.json").read_text(encoding="utf-8"))
    return data


def _procs(d: Path) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in _state(d)["processes"]}


Conversation = list[dict[str, str]]
"""A conversation's messages so far (its next turn appends the answer and a new user message)."""


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _body(
    rng: random.Random, i: int, cfg: SoakConfig, waiting: list[Conversation]
) -> tuple[str, dict[str, Any], bool, Conversation | None]:
    """Request ``i``: its path, body, whether it streams, and the conversation it is a turn of (or None).

    A turn continues a conversation from ``waiting`` (taken out of it until its answer is back) or starts one."""
    stream = rng.random() < 0.6
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": rng.randint(2, 24), "stream": stream}
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    kind = rng.random()
    chat = rng.random() < 0.5
    if kind < cfg.turn_p:
        if waiting:
            conversation = waiting.pop(rng.randrange(len(waiting)))
        else:
            conversation = [{"role": "system", "content": f"conversation {i}: {_words(rng, *LONG_WORDS)}"}]
        conversation.append({"role": "user", "content": f"turn {len(conversation) // 2 + 1}: {_words(rng, 4, 40)}"})
        body["messages"] = list(conversation)
        return "/v1/chat/completions", body, stream, conversation
    words = _words(rng, *LONG_WORDS) if kind < cfg.turn_p + cfg.long_p else _words(rng, 8, 120)
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i}: {words}"}]
        return "/v1/chat/completions", body, stream, None
    body["prompt"] = f"request {i}: {words}"
    return "/v1/completions", body, stream, None


def _answer(data: bytes, stream: bool) -> str | None:
    """A chat answer's text (a stream's deltas joined); None when there is none."""
    try:
        if not stream:
            return str(json.loads(data)["choices"][0]["message"]["content"])
        parts = []
        for event in sse_events(data):
            if event.strip() != "[DONE]":
                choices = json.loads(event).get("choices") or [{}]
                parts.append(str(choices[0].get("delta", {}).get("content") or ""))
        return "".join(parts)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, UnicodeDecodeError):
        return None


class Traffic:
    """Sends requests, classifies every outcome (N1 on the client side) and keeps the bodies (N5)."""

    def __init__(self, gateway_url: str, key: str, cfg: SoakConfig, rng: random.Random) -> None:
        self.url = gateway_url
        self.key = key
        self.cfg = cfg
        self.rng = rng
        self.tally = inv.ClientTally()
        self.bodies: list[bytes] = []
        self.started = 0
        self.waiting: list[Conversation] = []
        """Conversations whose last turn was answered, ready for their next."""
        self.paths: Counter[str] = Counter()
        """``x-pd-path`` of the answered requests."""

    async def one(self, client: httpx.AsyncClient, i: int, label: str) -> int:
        path, body, stream, conversation = _body(self.rng, i, self.cfg, self.waiting)
        cancel_after = self.rng.uniform(0.005, 0.4) if self.rng.random() < self.cfg.disconnect_p else None
        headers = {"authorization": f"Bearer {self.key}", "x-request-id": f"{label}-{i}"}
        status = 0
        data = bytearray()
        resp_headers: httpx.Headers | None = None

        async def go() -> None:
            nonlocal status, resp_headers
            async with client.stream("POST", self.url + path, json=body, headers=headers) as resp:
                status, resp_headers = resp.status_code, resp.headers
                async for chunk in resp.aiter_raw():
                    data.extend(chunk)

        self.started += 1
        deadline = self.cfg.request_timeout_s + 15.0
        try:
            if cancel_after is not None:
                try:
                    await asyncio.wait_for(go(), timeout=cancel_after)
                except TimeoutError:
                    self.tally.record(inv.client_outcome(status, bytes(data), stream=stream, cancelled=True))
                    return 499
            else:
                await asyncio.wait_for(go(), timeout=deadline)
        except (TimeoutError, httpx.TimeoutException):
            self.tally.record_hang(f"{label}-{i}", deadline)
            return 0
        except httpx.HTTPError as exc:
            self.tally.sent += 1
            self.tally.violations.append(f"{label}-{i}: transport error from the gateway: {type(exc).__name__}")
            return 0
        self.bodies.append(bytes(data))
        outcome = inv.client_outcome(status, bytes(data), stream=stream)
        self.tally.record(outcome, f"{label}-{i}")
        if resp_headers is not None:
            self.paths[resp_headers.get("x-pd-path", "-")] += 1
        answer = _answer(bytes(data), stream) if outcome.kind == "succeeded" and conversation else None
        if conversation is not None and answer is not None and len(conversation) < 2 * TURNS:
            conversation.append({"role": "assistant", "content": answer})
            self.waiting.append(conversation)
        if status in (429, 503) and (resp_headers is None or "retry-after" not in resp_headers):
            self.tally.violations.append(f"{label}-{i}: HTTP {status} without Retry-After")
        return status

    async def run(self, n: int, label: str, hooks: dict[int, tuple[Callable[[], None], bool]] | None = None) -> None:
        """``n`` requests, ``concurrency`` at a time.

        ``hooks[k] = (fn, block)`` runs ``fn`` in a thread once k requests started; with ``block`` no further
        request starts until it returns (used to wait for a restarted worker).
        """
        limits = httpx.Limits(max_connections=self.cfg.concurrency * 2, max_keepalive_connections=self.cfg.concurrency)
        timeout = httpx.Timeout(self.cfg.request_timeout_s + 10.0, connect=5.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            sem = asyncio.Semaphore(self.cfg.concurrency)
            pending: list[asyncio.Future[Any]] = []
            for i in range(n):
                await sem.acquire()
                if hooks and i in hooks:
                    fn, block = hooks[i]
                    job = asyncio.ensure_future(asyncio.to_thread(fn))
                    if block:
                        await job
                    pending.append(job)
                task = asyncio.ensure_future(self.one(client, i, label))
                task.add_done_callback(lambda _t: sem.release())
                pending.append(task)
            await asyncio.gather(*pending)


def _kill_group(d: Path, name: str, report: SoakReport) -> None:
    rec = _procs(d)[name]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(int(rec["pgid"]), signal.SIGKILL)
    report.faults.append(f"SIGKILL of {name}'s process group (pid {rec['pid']})")


def _wait(pred: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if pred():
                return True
        time.sleep(0.25)
    return False


def _serving(d: Path, gw_url: str, name: str) -> bool:
    """``name`` was restarted and is ready, and the gateway routes to every worker again (/ready 200)."""
    rec = _procs(d)[name]
    if rec["restarts"] < 1 or rec["state"] != "ready":
        return False
    ready = httpx.get(gw_url + "/ready", timeout=5)
    return ready.status_code == 200 and all(i["healthy"] and not i["breaker_open"] for i in ready.json()["instances"])


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def run_soak(cfg: SoakConfig, workdir: Path, key: str) -> SoakReport:
    """Run one soak in ``workdir`` (it gets config.toml, settings.json and .pdctl/); always ends with down."""
    report = SoakReport(cfg)
    rng = random.Random(cfg.seed)
    write_deployment(workdir, cfg)
    t0 = time.monotonic()
    up = pdctl(workdir, key, "up", "-d")
    captured = {"pdctl up output": up.stdout + up.stderr}
    census = inv.run_census(workdir / ".pdctl")
    try:
        if up.returncode != 0:
            report.notes.append(f"pdctl up failed ({up.returncode}): {(up.stdout + up.stderr)[-1500:]}")
            return report
        state = _state(workdir)
        gw_url = str(state["gateway_url"])
        gw_pid = census.gateway_pid
        assert gw_pid is not None
        worker_urls = dict(census.worker_urls)
        kv_base = inv.sample_workers(worker_urls)
        traffic = Traffic(gw_url, key, cfg, rng)

        asyncio.run(traffic.run(cfg.warm_requests, "warm"))
        _wait(lambda: inv.gateway_outcomes(_metrics(gw_url)).in_flight == 0, 30)  # type: ignore[union-attr]
        warm = inv.sample_resources(gw_pid, _metrics(gw_url))

        censuses: list[inv.RunCensus] = [census]

        def kill(name: str) -> Callable[[], None]:
            def hook() -> None:
                censuses.append(inv.run_census(workdir / ".pdctl"))
                _kill_group(workdir, name, report)

            return hook

        def back(name: str) -> Callable[[], None]:
            def hook() -> None:
                if not _wait(lambda: _serving(workdir, gw_url, name), cfg.recovery_timeout_s):
                    report.notes.append(f"{name} not back within {cfg.recovery_timeout_s:g} s")

            return hook

        # Each kill lands among requests in flight; `outage_requests` more go out while the worker is down
        # (they must fail fast with 503 + Retry-After), then traffic waits until it serves again.
        hooks: dict[int, tuple[Callable[[], None], bool]] = {}
        for name, at in (("decode", cfg.kill_decode_at), ("prefill", cfg.kill_prefill_at)):
            k = int(cfg.requests * at)
            hooks[k] = (kill(name), False)
            hooks[k + cfg.outage_requests] = (back(name), True)
        asyncio.run(traffic.run(cfg.requests, "soak", hooks))

        def recovered() -> bool:
            procs = _procs(workdir)
            return all(procs[n]["restarts"] >= 1 and procs[n]["state"] == "ready" for n in ("prefill", "decode"))

        if not _wait(recovered, cfg.recovery_timeout_s):
            report.notes.append(f"workers not restarted and ready within {cfg.recovery_timeout_s:g} s")
        censuses.append(inv.run_census(workdir / ".pdctl"))
        # Recovery: after the restarts (and the gateway's breaker cooldown) requests succeed again.
        ok_again = False
        deadline = time.monotonic() + cfg.recovery_timeout_s
        n_recovery = 0
        while not ok_again and time.monotonic() < deadline:
            before = traffic.tally.succeeded
            asyncio.run(traffic.run(4, f"recover{n_recovery}"))
            n_recovery += 1
            ok_again = traffic.tally.succeeded - before == 4
            if not ok_again:
                time.sleep(1.0)
        if not ok_again:
            report.notes.append("no clean batch of 4 requests after the restarts")

        # N2 uses the restarted workers' URLs (same ports); their KV baseline is an idle engine's: 0.
        x4 = inv.check_loopback(inv.run_census(workdir / ".pdctl"))
        n2 = inv.check_n2(worker_urls, kv_base, timeout_s=LEASE_S + 5.0)
        _wait(lambda: inv.gateway_outcomes(_metrics(gw_url)).in_flight == 0, 30)  # type: ignore[union-attr]
        text = _metrics(gw_url)
        outcomes = inv.gateway_outcomes(text)
        n1 = inv.check_n1(outcomes, traffic.tally)
        parsed = samples(text, ("pdctl_retries_total", "pdctl_kv_release_total", "pdctl_pd_decisions_total"))
        retries = metric_value(parsed, "pdctl_retries_total") or 0.0
        decode_log = Path(_procs(workdir)["decode"]["log_file"]).read_text(encoding="utf-8", errors="replace")
        n3 = inv.check_n3(inv.decode_requests_from_log(decode_log.splitlines()), retries=retries)
        after = _settled(gw_pid, gw_url, warm)
        n6 = inv.check_n6(warm, after)
        status = pdctl(workdir, key, "status", "--json")
        captured["pdctl status output"] = status.stdout + status.stderr
        with contextlib.suppress(ValueError):
            report.restarts = {p["name"]: p["restarts"] for p in json.loads(status.stdout)["processes"]}
        workers_now = [p["pid"] for p in _procs(workdir).values() if p["role"] != "gateway"]
        bodies = {f"response body {i}": b for i, b in enumerate(traffic.bodies)}
        n5_pre = inv.check_n5([key], files=[workdir / ".pdctl"], texts={**captured, **bodies, "gateway /metrics": text},
                              environ_pids=workers_now)  # fmt: skip
        report.client = traffic.tally
        if outcomes is not None:
            report.gateway = {"accepted": outcomes.accepted, "succeeded": outcomes.succeeded,
                              "errored": outcomes.errored, "cancelled": outcomes.cancelled, "retries": retries,
                              "kv_release_legs": metric_value(parsed, "pdctl_kv_release_total") or 0.0}  # fmt: skip
            for path in ("local", "disagg"):
                report.gateway[f"pd_{path}"] = metric_value(parsed, "pdctl_pd_decisions_total", path=path) or 0.0
        report.paths = dict(traffic.paths)
        census = census.merge(inv.run_census(workdir / ".pdctl"))
        for c in censuses:
            census = census.merge(c)
    finally:
        down = pdctl(workdir, key, "down")
        captured["pdctl down output"] = down.stdout + down.stderr
        if down.returncode != 0:
            report.notes.append(f"pdctl down exited {down.returncode}: {down.stderr[-500:]}")
        report.duration_s = time.monotonic() - t0
    if report.client.sent == 0:
        return report
    n4 = inv.check_n4(census, timeout_s=15.0)
    n5_post = inv.check_n5([key], files=[workdir / ".pdctl"], texts=captured, all_cmdlines=False)
    n5 = n5_pre if not n5_pre.ok else n5_post
    if n5_pre.ok and n5_post.ok:
        n5 = inv.InvariantResult("N5", True, f"while running: {n5_pre.detail}; after down: {n5_post.detail}")
    report.invariants = inv.InvariantReport((n1, n2, n3, n4, n5, n6, x4))
    return report


def _settled(pid: int, url: str, warm: inv.ResourceSample) -> inv.ResourceSample:
    """Resources once the gateway settles (closed client connections and finished tasks take a moment)."""
    after = inv.sample_resources(pid, _metrics(url))
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not inv.check_n6(warm, after).ok:
        time.sleep(0.5)
        after = inv.sample_resources(pid, _metrics(url))
    return after


_DEFAULT = SoakConfig()


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.soak``: run the soak, print the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=_DEFAULT.requests)
    p.add_argument("--concurrency", type=int, default=_DEFAULT.concurrency)
    p.add_argument("--disconnect-p", type=float, default=_DEFAULT.disconnect_p)
    p.add_argument("--seed", type=int, default=_DEFAULT.seed)
    p.add_argument("--sim-speed", type=float, default=_DEFAULT.sim_speed)
    p.add_argument("--pd-mode", choices=["always", "adaptive"], default=_DEFAULT.pd_mode,
                   help="routing.pd_mode (adaptive: per request, the decode alone or both legs)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="keep config, state and logs here (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    args = p.parse_args(argv)
    cfg = SoakConfig(requests=args.requests, concurrency=args.concurrency, disconnect_p=args.disconnect_p,
                     seed=args.seed, sim_speed=args.sim_speed, pd_mode=args.pd_mode)  # fmt: skip
    key = "sk-soak-" + os.urandom(12).hex()
    with tempfile.TemporaryDirectory(prefix="pdctl-soak-") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report = run_soak(cfg, work, key)
    print(report.render())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
