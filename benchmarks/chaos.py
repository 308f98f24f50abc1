"""Chaos on a running deployment: kill, hang or cut off a worker with streams in flight, and count what clients see.

    .venv/bin/python -m benchmarks.chaos                                   # simulator workers, 1P2D, every case
    .venv/bin/python -m benchmarks.chaos --engine vllm --decodes 2 --repeats 3 --streams 4 --out chaos.json
    .venv/bin/python -m benchmarks.chaos --set gateway.request_timeout_s=30   # any settings.json key, as JSON
    .venv/bin/python -m benchmarks.chaos --arm migration: --arm off:gateway.migration_limit=0   # side by side

``pdctl up`` starts one prefill, ``--decodes`` decodes and the gateway on free ports (``--engine vllm``: the tiny
random Qwen3 of ``pdctl model tiny`` on vLLM CPU, made under ``models/`` when missing; ``sim``: the simulator).
Then, for every case and repeat, ``--streams`` greedy streamed completions start through the gateway (temperature
0, ``ignore_eos``, top-k logprobs, ``return_token_ids``: verify's probe body), and once each has ``--fault-after``
tokens the fault strikes:

| case | fault |
|---|---|
| ``kill-decode`` | SIGKILL of the process group of the decode that serves the most of the streams |
| ``kill-prefill`` | SIGKILL of the prefill's process group (leg 1 of new requests; the streams are past it) |
| ``stop-decode`` | SIGSTOP of that decode's group (a hang), SIGCONT once the streams have ended or timed out |
| ``block-nixl`` | loopback packets to that decode's NIXL side-channel port dropped (iptables; root only) |

Counted for each stream against the same prompt's answer from a fault-free run before the cases: a
client-visible failure (an HTTP error, an error event, or a stream that ended short), duplicated or missing tokens
(more or fewer token ids than ``max_tokens`` in a stream that ended well), and the answer judged by verify's rule
(:func:`pdctl.verify.proof.first_divergence`: identical, a near-tie flip, or diverged with a clear margin). For
each fault: the time until a fresh request is served on both legs again, the time until every worker answers
``/health`` again (the next fault waits for it), and the prefill's KV cache usage once everything is idle again
(KV that a dead attempt left held). Requests of one case run while nothing else does;
the deployment stays up across cases (the supervisor restarts what died). The report is JSON (``--out``) and a
table on stdout. Not a test: the numbers are rates over repeats, docs/reliability.md records them.

``--arm NAME:KEY=JSON;KEY=JSON`` (repeatable) runs the whole sequence once per arm, one after the other in the same
run, each arm on its own fresh deployment with those settings on top of ``--set``'s; each arm's answers are
compared with its own fault-free run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdctl.testing import free_port
from pdctl.verify.link import greedy_body
from pdctl.verify.proof import Sample, first_divergence, parse_sample
from pdctl.vllm.promtext import metric_value, samples

ROOT = Path(__file__).resolve().parent.parent
KEY_VAR = "PDCTL_CHAOS_KEY"
KEY = "chaos-key-not-secret"
CASES = ("kill-decode", "kill-prefill", "stop-decode", "block-nixl")
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """What to run: the engine and shape, the cases and their load."""

    engine: str = "sim"
    decodes: int = 2
    cases: tuple[str, ...] = CASES
    repeats: int = 2
    streams: int = 4
    max_tokens: int = 48
    fault_after: int = 6
    prompt_words: int = 60
    sim_speed: float = 0.2
    settle_s: float = 12.0
    """How long the prefill is left idle before its KV usage is read (past a dead attempt's lease)."""
    """``[sim] speed``: below 1 the simulator is slower than its GPU profile, so streams last seconds."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Dotted settings.json keys set on top of the defaults (``gateway.migration_limit``: 2)."""
    arms: tuple[tuple[str, dict[str, Any]], ...] = (("default", {}),)
    """Named sets of settings, each run on its own deployment, on top of :attr:`settings`."""


@dataclass
class StreamOutcome:
    """One stream of one fault: how it ended and how its answer compares with the fault-free one."""

    status: str
    """``ok``, ``http_<code>``, ``error_event``, ``short`` (no final event) or ``exception``."""
    tokens: int
    verdict: str
    """``identical``, ``tie``, ``diverged``, or ``-`` when the stream failed."""
    decode: str | None = None
    error: str | None = None
    max_gap_s: float = 0.0
    """The longest wait between two events the client received (a migration's stall shows here)."""


@dataclass
class FaultRun:
    """One fault: the streams' outcomes, the recovery time and the KV the prefill still held after."""

    arm: str
    case: str
    repeat: int
    target: str
    streams: list[StreamOutcome]
    recovery_s: float | None
    """Seconds from the fault until a fresh request was served on both legs (another decode may serve at once)."""
    restored_s: float | None
    """Seconds from the fault until every worker answered ``/health`` again (the supervisor's restart)."""
    prefill_kv_usage_after: float | None
    migrations: float | None


# ------------------------------------------------------------------------------------------ the deployment


def _model_dir() -> Path:
    model = ROOT / "models" / "tiny-qwen3"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "pdctl", "model", "tiny", str(model)], check=True, timeout=900)
    return model


def _worker(engine: str, model: str, side: int, cpu: int | None) -> str:
    lines = [f'model = "{model}"', f'engine = "{engine}"', f"side_channel_port = {side}", "max_model_len = 1024"]
    if engine == "vllm":
        lines += ['served_model_name = "tiny"', "max_num_seqs = 8", 'dtype = "bfloat16"',
                  'env = { VLLM_CPU_KVCACHE_SPACE = "1" }']  # fmt: skip
        if cpu is not None:
            lines.append(f"cpu_ids = [{cpu}]")
    return "\n".join(lines)


def write_deployment(d: Path, cfg: ChaosConfig, arm: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.toml + settings.json for one prefill, ``cfg.decodes`` decodes and the gateway, all on free ports."""
    model = str(_model_dir()) if cfg.engine == "vllm" else "sim-model"
    cores = os.cpu_count() or 1
    prefill_port, gateway_port = free_port(), free_port()
    decode_ports = [free_port() for _ in range(cfg.decodes)]
    sides = {"prefill": free_port(), **{f"decode-{i}": free_port() for i in range(cfg.decodes)}}
    parts = ["[kv_transfer]\ntimeout_ms = 10000\n", "[prefill]\n" + _worker(cfg.engine, model, sides["prefill"], 0)]
    for i in range(cfg.decodes):
        cpu = (1 + i) % cores if cores > 1 else None
        parts.append("[[decode]]\n" + _worker(cfg.engine, model, sides[f"decode-{i}"], cpu))
    parts.append('[connector]\nkv_connector = "NixlConnector"\n')
    parts.append("[supervisor]\nrestart = \"on-failure\"\nmax_restarts = 20\nready_timeout_s = 900\n"
                 "stop_timeout_s = 10\nwarmup_timeout_s = 600\n")  # fmt: skip
    if cfg.engine == "sim":
        parts.append(f"[sim]\nspeed = {cfg.sim_speed}\n")
    (d / "config.toml").write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    settings: dict[str, Any] = {
        "gateway": {"listen": f"127.0.0.1:{gateway_port}", "api_key_env": KEY_VAR, "request_timeout_s": 120,
                    "max_retries": 2},
        "routing": {"prefill_endpoint": f"http://127.0.0.1:{prefill_port}",
                    "decode_endpoint": [f"http://127.0.0.1:{p}" for p in decode_ports],
                    "kv_connector": "NixlConnector"},
        "slo": {"admission": False},
        "logging": {"level": "debug"},
    }  # fmt: skip
    for dotted, value in {**cfg.settings, **(arm or {})}.items():
        section, _, leaf = dotted.partition(".")
        settings.setdefault(section, {})[leaf] = value
    (d / "settings.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    workers = [f"http://127.0.0.1:{p}" for p in (prefill_port, *decode_ports)]
    return {"gateway": f"http://127.0.0.1:{gateway_port}", "prefill": f"http://127.0.0.1:{prefill_port}",
            "workers": workers, "model": "tiny" if cfg.engine == "vllm" else model, "sides": sides}  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, KEY_VAR: KEY, "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}


def pdctl(d: Path, *args: str, timeout_s: float = 1200) -> subprocess.CompletedProcess[str]:
    """``python -m pdctl ARGS`` in the deployment's folder."""
    return subprocess.run([sys.executable, "-m", "pdctl", *args], cwd=d, env=_env(), capture_output=True,
                          text=True, timeout=timeout_s)  # fmt: skip


def _processes(d: Path) -> dict[str, dict[str, Any]]:
    state = json.loads((d / ".pdctl" / "state.json").read_text(encoding="utf-8"))
    return {p["name"]: p for p in state["processes"]}


# --------------------------------------------------------------------------------------------- the traffic


def _prompt(nonce: str, i: int, words: int) -> str:
    return f"Chaos {nonce}-{i}. " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))


def _merge(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed completion's events as one ``/v1/completions`` body (token ids, text and logprobs joined)."""
    ids: list[int] = []
    text: list[str] = []
    lps: list[Any] = []
    tops: list[Any] = []
    for ev in events:
        for c in ev.get("choices") or []:
            ids += c.get("token_ids") or []
            text.append(c.get("text") or "")
            lp = c.get("logprobs") or {}
            lps += lp.get("token_logprobs") or []
            tops += lp.get("top_logprobs") or []
    choice = {"token_ids": ids, "text": "".join(text), "logprobs": {"token_logprobs": lps, "top_logprobs": tops}}
    return {"choices": [choice]}


@dataclass
class _Stream:
    index: int
    events: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    status: str = "running"
    decode: str | None = None
    error: str | None = None
    last_at: float | None = None
    max_gap_s: float = 0.0


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], st: _Stream) -> None:
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            st.decode = r.headers.get("x-pd-decode")
            if r.status_code != 200:
                st.status = f"http_{r.status_code}"
                st.error = (await r.aread()).decode(errors="replace")[:300]
                return
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                now = time.monotonic()
                if st.last_at is not None:
                    st.max_gap_s = max(st.max_gap_s, now - st.last_at)
                st.last_at = now
                ev = json.loads(data)
                if "error" in ev:
                    st.status, st.error = "error_event", json.dumps(ev["error"])[:300]
                    return
                st.events.append(ev)
                st.tokens += sum(len(c.get("token_ids") or []) for c in ev.get("choices") or [])
            st.status = "ok" if done else "short"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        st.status, st.error = "exception", f"{type(exc).__name__}: {exc}"[:300]


def _body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {**greedy_body(model, prompt), "max_tokens": max_tokens, "stream": True}


async def _reference(url: str, model: str, prompts: list[str], max_tokens: int) -> list[Sample | None]:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(headers=headers, timeout=600) as client:
        out = []
        for p in prompts:
            st = _Stream(0)
            await _stream(client, url, _body(model, p, max_tokens), st)
            out.append(parse_sample(_merge(st.events)) if st.status == "ok" else None)
        return out


# ---------------------------------------------------------------------------------------------- the faults


def _iptables(action: str, port: int) -> None:
    subprocess.run(["iptables", action, "INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), "-j", "DROP"],
                   check=True, capture_output=True)  # fmt: skip


def _ready_on_both_legs(url: str, model: str, deadline_s: float) -> float | None:
    """Seconds until a fresh request is served on both legs (``x-pd-path: disagg``); None by the deadline."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": model, "prompt": f"recovery probe {uuid.uuid4().hex}", "max_tokens": 2, "temperature": 0}
    while time.monotonic() - started < deadline_s:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
            if r.status_code == 200 and r.headers.get("x-pd-path") == "disagg":
                return time.monotonic() - started
        time.sleep(0.5)
    return None


def _all_healthy(urls: list[str], started: float, deadline_s: float) -> float | None:
    """Seconds since ``started`` when every worker answered ``/health`` with 200; None by the deadline."""
    while time.monotonic() - started < deadline_s:
        ok = 0
        for u in urls:
            with contextlib.suppress(httpx.HTTPError):
                ok += httpx.get(f"{u}/health", timeout=5).status_code == 200
        if ok == len(urls):
            return time.monotonic() - started
        time.sleep(0.5)
    return None


def _scrape(url: str, name: str) -> float | None:
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
        return metric_value(samples(text, (name,)), name)
    return None


def _idle_kv(prefill_url: str, settle_s: float) -> float | None:
    """The prefill's KV cache usage once its running and waiting requests are gone (and ``settle_s`` passed)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        running = _scrape(prefill_url, "vllm:num_requests_running") or 0.0
        waiting = _scrape(prefill_url, "vllm:num_requests_waiting") or 0.0
        if running + waiting == 0:
            break
        time.sleep(1)
    time.sleep(settle_s)
    return _scrape(prefill_url, "vllm:kv_cache_usage_perc")


async def _fault_run(d: Path, dep: dict[str, Any], cfg: ChaosConfig, arm: str, case: str, repeat: int,
                     prompts: list[str], refs: list[Sample | None]) -> FaultRun:  # fmt: skip
    url, model = dep["gateway"], dep["model"]
    streams = [_Stream(i) for i in range(len(prompts))]
    migrations_before = _scrape(url, "pdctl_migrations_total")
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as client:
        tasks = [asyncio.create_task(_stream(client, url, _body(model, p, cfg.max_tokens), st))
                 for p, st in zip(prompts, streams, strict=True)]  # fmt: skip
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(s.tokens >= cfg.fault_after or s.status != "running"
                                                      for s in streams):  # fmt: skip
            await asyncio.sleep(0.02)
        procs = _processes(d)
        served = Counter(s.decode for s in streams if s.decode)
        decodes = sorted(n for n, p in procs.items() if p.get("role") == "decode")
        target = "prefill" if case == "kill-prefill" else (served.most_common(1)[0][0] if served else decodes[0])
        if target not in procs:
            target = next((n for n in decodes if n.endswith(target)), decodes[0])
        pgid = int(procs[target]["pgid"])
        side = dep["sides"].get(target) or dep["sides"].get(f"decode-{decodes.index(target)}")
        if case.startswith("kill-"):
            os.killpg(pgid, signal.SIGKILL)
        elif case == "stop-decode":
            os.killpg(pgid, signal.SIGSTOP)
        elif case == "block-nixl":
            _iptables("-I", side)
        # From the fault on: with another decode serving, the deployment may never stop serving fresh requests.
        struck = time.monotonic()
        recovering = asyncio.create_task(asyncio.to_thread(_ready_on_both_legs, url, model, 900))
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=400)
        except TimeoutError:
            for t in tasks:
                t.cancel()
        finally:
            if case == "stop-decode":
                os.killpg(pgid, signal.SIGCONT)
            elif case == "block-nixl":
                _iptables("-D", side)
    recovery = await recovering
    # The next fault strikes a whole deployment again: wait for the restarted (or resumed) worker.
    restored = await asyncio.to_thread(_all_healthy, dep["workers"], struck, 900)
    kv_after = await asyncio.to_thread(_idle_kv, dep["prefill"], cfg.settle_s)
    after = _scrape(url, "pdctl_migrations_total")
    moved = None if after is None else after - (migrations_before or 0.0)
    outcomes = []
    for st, ref in zip(streams, refs, strict=True):
        verdict = "-"
        if st.status == "ok" and ref is not None:
            got = parse_sample(_merge(st.events))
            div = first_divergence(ref, got) if got is not None else None
            verdict = "identical" if got is not None and div is None else (div.verdict if div else "diverged")
            verdict = "diverged" if verdict == "corruption" else verdict
        outcomes.append(StreamOutcome(st.status, st.tokens, verdict, st.decode, st.error, round(st.max_gap_s, 3)))
    return FaultRun(arm, case, repeat, target, outcomes, recovery, restored, kv_after, moved)


# ------------------------------------------------------------------------------------------------- report


def summarize(runs: list[FaultRun], max_tokens: int) -> list[dict[str, Any]]:
    """Per arm and case: streams, client-visible failures, duplicated/missing tokens, clear divergences, recovery,
    KV left held, migrations."""
    rows = []
    for arm, case in dict.fromkeys((r.arm, r.case) for r in runs):
        mine = [r for r in runs if r.case == case and r.arm == arm]
        outs = [o for r in mine for o in r.streams]
        recov = [r.recovery_s for r in mine if r.recovery_s is not None]
        rows.append({
            "arm": arm, "case": case, "faults": len(mine), "streams": len(outs),
            "client_failures": sum(o.status != "ok" for o in outs),
            "wrong_length": sum(o.status == "ok" and o.tokens != max_tokens for o in outs),
            "diverged": sum(o.verdict == "diverged" for o in outs),
            "ties": sum(o.verdict == "tie" for o in outs),
            "longest_gap_s": round(max((o.max_gap_s for o in outs), default=0.0), 1),
            "recovery_s_max": round(max(recov), 1) if recov else None,
            "restored_s_max": round(max((r.restored_s or 0.0) for r in mine), 1),
            "unrecovered": sum(r.recovery_s is None for r in mine),
            "prefill_kv_after_max": max((r.prefill_kv_usage_after or 0.0) for r in mine),
            "migrations": sum(r.migrations or 0.0 for r in mine),
        })  # fmt: skip
    return rows


def _run_arm(cfg: ChaosConfig, workdir: Path, arm: str, settings: dict[str, Any]) -> tuple[int, list[FaultRun]]:
    """One arm: its deployment up, the fault-free answers, every case ``repeats`` times, the deployment down."""
    workdir.mkdir(parents=True)
    dep = write_deployment(workdir, cfg, settings)
    up = pdctl(workdir, "up", "-d")
    if up.returncode != 0:
        raise SystemExit(f"pdctl up failed ({arm}):\n{up.stdout}\n{up.stderr}")
    runs = []
    try:
        nonce = uuid.uuid4().hex[:8]
        prompts = [_prompt(nonce, i, cfg.prompt_words) for i in range(cfg.streams)]
        refs = asyncio.run(_reference(dep["gateway"], dep["model"], prompts, cfg.max_tokens))
        for case in cfg.cases:
            for repeat in range(cfg.repeats):
                run = asyncio.run(_fault_run(workdir, dep, cfg, arm, case, repeat, prompts, refs))
                errors = Counter((o.error or "")[:80] for o in run.streams if o.error)
                print(f"{arm} {case} #{repeat}: target {run.target}, streams "
                      f"{dict(Counter(o.status for o in run.streams))}, verdicts "
                      f"{dict(Counter(o.verdict for o in run.streams))}, recovery "
                      f"{run.recovery_s and round(run.recovery_s, 1)} s, errors {dict(errors)}", flush=True)  # fmt: skip
                runs.append(run)
    finally:
        pdctl(workdir, "down", timeout_s=300)
    return sum(r is not None for r in refs), runs


def run_chaos(cfg: ChaosConfig, workdir: Path) -> dict[str, Any]:
    """Every arm in turn (:func:`_run_arm`), on deployments under ``workdir``."""
    if "block-nixl" in cfg.cases and (os.geteuid() != 0 or shutil.which("iptables") is None):
        raise SystemExit("block-nixl needs root and iptables; leave it out with --cases")
    references: dict[str, int] = {}
    runs: list[FaultRun] = []
    for arm, settings in cfg.arms:
        references[arm], mine = _run_arm(cfg, workdir / arm, arm, settings)
        runs += mine
    return {"config": asdict(cfg), "references": references, "summary": summarize(runs, cfg.max_tokens),
            "runs": [asdict(r) for r in runs]}  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    ap.add_argument("--decodes", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--fault-after", type=int, default=6, help="tokens every stream has before the fault")
    ap.add_argument("--sim-speed", type=float, default=0.2, help="[sim] speed (--engine sim)")
    ap.add_argument("--settle-s", type=float, default=12.0, help="idle seconds before reading prefill's KV usage")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a settings.json key (dotted)")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME:KEY=JSON;...",
                    help="an arm: its name and its settings keys (none: NAME:)")  # fmt: skip
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the deployment's folder (logs) after the run")
    a = ap.parse_args(argv)
    unknown = [c for c in a.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")

    def keys(items: list[str], flag: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for item in items:
            k, sep, v = item.partition("=")
            if not sep or "." not in k:
                ap.error(f"{flag} {item!r}: expected section.key=JSON, for example gateway.migration_limit=0")
            try:
                out[k] = json.loads(v)
            except json.JSONDecodeError:
                out[k] = v
        return out

    overrides = keys(a.set, "--set")
    arms = []
    for spec in a.arm:
        name, sep, rest = spec.partition(":")
        if not sep or not name:
            ap.error(f"--arm {spec!r}: expected NAME:KEY=JSON;KEY=JSON (or NAME: for the defaults)")
        arms.append((name, keys([x for x in rest.split(";") if x], "--arm")))
    cfg = ChaosConfig(a.engine, a.decodes, tuple(a.cases.split(",")), a.repeats, a.streams, a.max_tokens,
                      a.fault_after, sim_speed=a.sim_speed, settle_s=a.settle_s,
                      settings=overrides, arms=tuple(arms) or (("default", {}),))  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="pdctl-chaos-"))
    started = time.time()
    report = run_chaos(cfg, workdir)
    report["wall_s"] = round(time.time() - started, 1)
    report["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    report["command"] = "python -m benchmarks.chaos " + " ".join(sys.argv[1:] if argv is None else argv)
    print(_table(report["summary"]))
    if a.out:
        a.out.write_text(json.dumps(report, indent=2), encoding="utf-8")
        print(f"wrote {a.out}")
    if a.keep:
        print(f"deployment folder: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
