"""The "nothing lost" invariants N1–N6, checkable by any test, soak or benchmark (docs/reliability.md).

=====  =====================  ===========================================================================
N1     terminal outcome       gateway counters ``accepted = succeeded + errored + cancelled``, nothing in
                              flight; client side: every answer is a full success, one OpenAI-shaped error
                              or a cancel the client made (:func:`client_outcome`)
N2     upstream quiescence    each worker's /metrics: running and waiting 0, KV usage back at its baseline
                              (fake workers: ``held_blocks``), within a bounded wait
N3     at most once           per request id at most one decode request (``start_load_kv`` lines of a
                              DEBUG decode log), at most one retry pipeline per client request
N4     no orphans             no recorded pid alive, no process left in a recorded process group or
                              session, every configured port free
N5     no secret exposure     no secret in log files, captured output, response bodies, metrics, any
                              ``/proc/<pid>/cmdline``, or the workers' ``/proc/<pid>/environ``
N6     bounded resources      gateway fds, RSS, threads and asyncio tasks within a tolerance of a warm
                              baseline
=====  =====================  ===========================================================================

Each ``check_nX`` returns an :class:`InvariantResult`; :class:`InvariantReport` collects them. Nothing here
prints or exits; details never contain a secret.

Vocabulary: these are **invariants** (ok / FAIL / skip, after a run), not ``pdctl check``'s lint
**findings** nor ``pdctl verify``'s **checks**; docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil

from pdctl.vllm.promtext import metric_value, samples
from pdctl.vllm.sse import sse_events

__all__ = [
    "ClientTally",
    "GatewayOutcomes",
    "InvariantReport",
    "InvariantResult",
    "Outcome",
    "ResourceSample",
    "RunCensus",
    "WorkerLoad",
    "check_loopback",
    "check_n1",
    "check_n2",
    "check_n3",
    "check_n4",
    "check_n5",
    "check_n6",
    "client_id",
    "client_outcome",
    "decode_requests_from_log",
    "gateway_outcomes",
    "port_free",
    "run_census",
    "sample_resources",
    "sample_workers",
    "worker_load",
]

OutcomeKind = Literal["succeeded", "errored", "cancelled"]


@dataclass(frozen=True, slots=True)
class InvariantResult:
    """One invariant's verdict; ``detail`` says what was measured (or what broke)."""

    name: str
    ok: bool
    detail: str
    skipped: bool = False


@dataclass(frozen=True, slots=True)
class InvariantReport:
    """The verdicts of one check run, in order."""

    results: tuple[InvariantResult, ...]

    @property
    def ok(self) -> bool:
        """True when no invariant failed (skipped ones do not fail)."""
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> tuple[InvariantResult, ...]:
        """The invariants that failed."""
        return tuple(r for r in self.results if not r.ok)

    def get(self, name: str) -> InvariantResult:
        """The result called ``name`` (KeyError if it was not checked)."""
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def render(self) -> str:
        """One line per invariant: ``N1 ok   detail``."""
        return "\n".join(
            f"{r.name} {'skip' if r.skipped else 'ok  ' if r.ok else 'FAIL'} {r.detail}" for r in self.results
        )

    def to_json(self) -> list[dict[str, Any]]:
        """Plain dicts."""
        return [asdict(r) for r in self.results]


def _result(name: str, problems: Sequence[str], ok_detail: str) -> InvariantResult:
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        return InvariantResult(name, False, shown)
    return InvariantResult(name, True, ok_detail)


# ------------------------------------------------------------------------------------------- metrics

# ------------------------------------------------------------------------------------------------ N1


@dataclass(frozen=True, slots=True)
class GatewayOutcomes:
    """The gateway's own accounting, from ``pdctl_accepted_total`` and ``pdctl_requests_total{status}``."""

    accepted: float
    succeeded: float
    errored: float
    cancelled: float
    in_flight: float
    by_status: Mapping[str, float] = field(default_factory=dict)

    def minus(self, before: GatewayOutcomes) -> GatewayOutcomes:
        """What happened since ``before`` (counters subtract, the in-flight gauge does not)."""
        statuses = set(self.by_status) | set(before.by_status)
        return GatewayOutcomes(
            self.accepted - before.accepted,
            self.succeeded - before.succeeded,
            self.errored - before.errored,
            self.cancelled - before.cancelled,
            self.in_flight,
            {s: self.by_status.get(s, 0.0) - before.by_status.get(s, 0.0) for s in statuses},
        )


def gateway_outcomes(metrics_text: str) -> GatewayOutcomes | None:
    """Parse the gateway's /metrics; None when it has no ``pdctl_accepted_total`` (not a pdctl gateway)."""
    parsed = samples(metrics_text, ("pdctl_accepted_total", "pdctl_requests_total", "pdctl_gateway_in_flight"))
    accepted = metric_value(parsed, "pdctl_accepted_total")
    if accepted is None:
        return None
    by_status: dict[str, float] = {}
    for name, labels, value in parsed:
        if name == "pdctl_requests_total":
            status = labels.get("status", "?")
            by_status[status] = by_status.get(status, 0.0) + value
    succeeded = by_status.get("200", 0.0)
    cancelled = by_status.get("499", 0.0)
    errored = sum(v for s, v in by_status.items() if s not in ("200", "499"))
    in_flight = metric_value(parsed, "pdctl_gateway_in_flight") or 0.0
    return GatewayOutcomes(accepted, succeeded, errored, cancelled, in_flight, by_status)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one client request ended in, as the client saw it; ``violation`` breaks N1."""

    kind: OutcomeKind
    status: int
    violation: str | None = None


def _openai_error(obj: Any) -> str | None:
    """None if ``obj`` is ``{"error": {"message": str, "type": str, "param": str|None, "code": str|None}}``."""
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return "not an OpenAI error object"
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)} != ['code', 'message', 'param', 'type']"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return "error.message and error.type must be strings"
    for k in ("param", "code"):
        if err[k] is not None and not isinstance(err[k], str):
            return f"error.{k} must be a string or null, got {type(err[k]).__name__}"
    return None


def _finish_reason_set(obj: Any) -> bool:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def client_outcome(status: int, body: bytes, *, stream: bool, cancelled: bool = False) -> Outcome:
    """Classify one response the way N1 does; a truncated or doubled answer is a violation.

    ``cancelled`` means the client itself gave up (closed the connection): whatever arrived is fine.
    A stream must end either in a finish_reason plus ``[DONE]``, or in exactly one error event without
    ``[DONE]``; an error status must carry an OpenAI-shaped error body.
    """
    if cancelled:
        return Outcome("cancelled", status)
    if status != 200:
        try:
            problem = _openai_error(json.loads(body))
        except ValueError:
            problem = "error body is not JSON"
        return Outcome("errored", status, f"HTTP {status}: {problem}" if problem else None)
    if not stream:
        try:
            obj = json.loads(body)
        except ValueError:
            return Outcome("errored", status, "HTTP 200 with a body that is not JSON")
        if not _finish_reason_set(obj):
            return Outcome("errored", status, "HTTP 200 without a finish_reason")
        return Outcome("succeeded", status)
    try:
        payloads = [e.strip().encode() for e in sse_events(body)]
    except UnicodeDecodeError:
        return Outcome("errored", status, "stream: not valid UTF-8")
    if not payloads:
        return Outcome("errored", status, "stream: no event at all: truncated")
    done = payloads.count(b"[DONE]")
    errors: list[int] = []
    finished = False
    for i, p in enumerate(payloads):
        if p == b"[DONE]":
            continue
        try:
            obj = json.loads(p)
        except ValueError:
            return Outcome("errored", status, "stream: an event is not JSON")
        if isinstance(obj, dict) and "error" in obj:
            errors.append(i)
            problem = _openai_error(obj)
            if problem:
                return Outcome("errored", status, f"stream: error event: {problem}")
        elif _finish_reason_set(obj):
            finished = True
    if errors:
        if len(errors) > 1:
            return Outcome("errored", status, f"stream: {len(errors)} error events")
        if done:
            return Outcome("errored", status, "stream: an error event and [DONE]")
        if errors[0] != len(payloads) - 1:
            return Outcome("errored", status, "stream: events after the error event")
        return Outcome("errored", status)
    if done != 1 or payloads[-1] != b"[DONE]":
        return Outcome("errored", status, f"stream ended without one final [DONE] ({done} seen): truncated")
    if not finished:
        return Outcome("errored", status, "stream ended with [DONE] but no finish_reason")
    return Outcome("succeeded", status)


@dataclass(slots=True)
class ClientTally:
    """Client-side counts for N1 (a test records each request's :class:`Outcome`)."""

    sent: int = 0
    succeeded: int = 0
    errored: int = 0
    cancelled: int = 0
    hung: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def record(self, outcome: Outcome, label: str = "") -> None:
        """Count one finished request."""
        self.sent += 1
        self.statuses[outcome.status] += 1
        setattr(self, outcome.kind, getattr(self, outcome.kind) + 1)
        if outcome.violation:
            self.violations.append(f"{label}: {outcome.violation}" if label else outcome.violation)

    def record_hang(self, label: str, waited_s: float) -> None:
        """A request that had no answer within its deadline (a hang breaks N1)."""
        self.sent += 1
        self.hung += 1
        self.violations.append(f"{label}: no answer within {waited_s:.0f}s")


def check_n1(outcomes: GatewayOutcomes | None, client: ClientTally | None = None) -> InvariantResult:
    """Every accepted request ended exactly once, and what clients saw agrees with the gateway."""
    if outcomes is None:
        return InvariantResult("N1", False, "the gateway's /metrics has no pdctl_accepted_total")
    o = outcomes
    problems: list[str] = []
    ended = o.succeeded + o.errored + o.cancelled
    if o.accepted != ended:
        problems.append(
            f"accepted {o.accepted:g} != succeeded {o.succeeded:g} + errored {o.errored:g} + cancelled {o.cancelled:g}"
        )
    if o.in_flight != 0:
        problems.append(f"{o.in_flight:g} request(s) still in flight at the gateway")
    if client is not None:
        problems.extend(client.violations)
        if client.succeeded > o.succeeded:
            problems.append(f"clients saw {client.succeeded} successes, the gateway counted {o.succeeded:g}")
        if client.errored > o.errored:
            problems.append(f"clients saw {client.errored} errors, the gateway counted {o.errored:g}")
        if o.accepted > client.sent:
            problems.append(f"the gateway accepted {o.accepted:g} requests, clients sent {client.sent}")
        if o.accepted < client.sent - client.cancelled:
            problems.append(
                f"clients sent {client.sent} requests ({client.cancelled} cancelled), the gateway accepted "
                f"{o.accepted:g}"
            )  # fmt: skip
    detail = f"accepted {o.accepted:g} = {o.succeeded:g} ok + {o.errored:g} errors + {o.cancelled:g} cancelled"
    if client is not None:
        detail += f"; client: {client.succeeded} ok, {client.errored} errors, {client.cancelled} cancelled"
    return _result("N1", problems, detail)


# ------------------------------------------------------------------------------------------------ N2


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker's load from its /metrics (vLLM names, or the fake worker's ``held_blocks``)."""

    running: float
    waiting: float
    kv_usage: float | None = None
    held_blocks: float | None = None

    @property
    def idle(self) -> bool:
        """No request running or waiting."""
        return self.running == 0 and self.waiting == 0


_LOAD_METRICS = (
    "vllm:num_requests_running", "num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "held_blocks",
)  # fmt: skip


def worker_load(metrics_text: str) -> WorkerLoad:
    """Read ``vllm:num_requests_running/waiting`` and ``vllm:kv_cache_usage_perc`` (or the fake's names)."""
    s = samples(metrics_text, _LOAD_METRICS)
    running = metric_value(s, "vllm:num_requests_running")
    if running is None:
        running = metric_value(s, "num_requests_running")
    return WorkerLoad(
        running=running or 0.0,
        waiting=metric_value(s, "vllm:num_requests_waiting") or 0.0,
        kv_usage=metric_value(s, "vllm:kv_cache_usage_perc"),
        held_blocks=metric_value(s, "held_blocks"),
    )


def sample_workers(urls: Mapping[str, str], timeout_s: float = 5.0) -> dict[str, WorkerLoad | None]:
    """Each worker's current load (None when its /metrics does not answer)."""
    out: dict[str, WorkerLoad | None] = {}
    with httpx.Client(timeout=timeout_s) as client:
        for name, url in urls.items():
            try:
                r = client.get(url.rstrip("/") + "/metrics")
                out[name] = worker_load(r.text) if r.status_code == 200 else None
            except httpx.HTTPError:
                out[name] = None
    return out


def _quiet(load: WorkerLoad | None, base: WorkerLoad | None, tol: float) -> str | None:
    if load is None:
        return "/metrics unreachable"
    if not load.idle:
        return f"running {load.running:g}, waiting {load.waiting:g}"
    base_kv = base.kv_usage if base is not None and base.kv_usage is not None else 0.0
    if load.kv_usage is not None and load.kv_usage > base_kv + tol:
        return f"kv_cache_usage_perc {load.kv_usage:.4f} > baseline {base_kv:.4f}"
    base_held = base.held_blocks if base is not None and base.held_blocks is not None else 0.0
    if load.held_blocks is not None and load.held_blocks > base_held:
        return f"held_blocks {load.held_blocks:g} > baseline {base_held:g}"
    return None


def check_n2(
    urls: Mapping[str, str],
    baseline: Mapping[str, WorkerLoad | None] | None = None,
    *,
    timeout_s: float = 35.0,
    kv_tolerance: float = 1e-6,
    poll_s: float = 0.25,
) -> InvariantResult:
    """Wait (at most ``timeout_s``, e.g. ``kv_lease_duration + 5``) for every worker to be idle at baseline."""
    start = time.monotonic()
    problems: dict[str, str] = {}
    while True:
        loads = sample_workers(urls)
        problems = {}
        for name, load in loads.items():
            why = _quiet(load, (baseline or {}).get(name), kv_tolerance)
            if why is not None:
                problems[name] = why
        if not problems or time.monotonic() - start >= timeout_s:
            break
        time.sleep(poll_s)
    waited = time.monotonic() - start
    return _result(
        "N2",
        [f"{n}: {why} after {waited:.1f}s" for n, why in problems.items()],
        f"{len(urls)} worker(s) idle at KV baseline after {waited:.1f}s",
    )


# ------------------------------------------------------------------------------------------------ N3

_START_LOAD = re.compile(r"start_load_kv for request (?P<req>\S+) from remote engine")
_VLLM_ID = re.compile(r"^(?:chatcmpl|cmpl)-(?P<base>.+?)(?:-\d+)?-[0-9a-f]{8}$")
_PIPELINE_SUFFIX = re.compile(r"-(?:retry\d+|release)$")


def decode_requests_from_log(lines: Iterable[str]) -> Counter[str]:
    """``X-Request-Id`` -> number of decode requests that pulled KV for it (a DEBUG decode log's lines).

    vLLM (and the simulator) print ``start_load_kv for request cmpl-<id>-0-<8 hex>`` once per decode
    request with usable ``kv_transfer_params``; at INFO there is no such line.
    """
    out: Counter[str] = Counter()
    for line in lines:
        m = _START_LOAD.search(line)
        if m is not None:
            vid = m["req"].rstrip(".")
            b = _VLLM_ID.match(vid)
            out[b["base"] if b else vid] += 1
    return out


def client_id(request_id: str) -> str:
    """The client's request id behind a gateway pipeline id (``<id>-retry1``, ``<id>-release``)."""
    return _PIPELINE_SUFFIX.sub("", request_id)


def check_n3(decode_requests: Mapping[str, int], *, retries: float = 0.0, max_pipelines: int = 2) -> InvariantResult:
    """At most one decode request per pipeline id, ``max_pipelines`` per client request, retries counted.

    ``retries`` is the gateway's ``pdctl_retries_total`` (a retry is a new pipeline with a fresh id).
    """
    if not decode_requests:
        return InvariantResult("N3", True, "no decode request ids seen (decode log not at DEBUG?)", skipped=True)
    problems = [f"{rid}: {n} decode requests for one pipeline" for rid, n in decode_requests.items() if n > 1]
    per_client: Counter[str] = Counter(client_id(rid) for rid in decode_requests)
    problems += [f"{cid}: {n} pipelines reached decode" for cid, n in per_client.items() if n > max_pipelines]
    retried = sum(1 for rid in decode_requests if re.search(r"-retry\d+$", rid))
    if retried > retries:
        problems.append(f"{retried} retry pipelines reached decode, the gateway counted {retries:g} retries")
    total = sum(decode_requests.values())
    return _result("N3", problems, f"{total} decode requests for {len(per_client)} client requests, {retried} retried")


# ------------------------------------------------------------------------------------------------ N4


@dataclass(frozen=True, slots=True)
class RunCensus:
    """Everything a run directory says pdctl started: pids (with create times), groups, ports."""

    pids: Mapping[int, float]
    pgids: frozenset[int]
    ports: frozenset[int]
    gateway_pid: int | None = None
    worker_pids: Mapping[str, int] = field(default_factory=dict)
    worker_urls: Mapping[str, str] = field(default_factory=dict)
    log_files: tuple[Path, ...] = ()

    def merge(self, other: RunCensus) -> RunCensus:
        """Union of two censuses (take one while running and one after each restart)."""
        return RunCensus(
            {**self.pids, **other.pids},
            self.pgids | other.pgids,
            self.ports | other.ports,
            other.gateway_pid or self.gateway_pid,
            {**self.worker_pids, **other.worker_pids},
            {**self.worker_urls, **other.worker_urls},
            tuple(dict.fromkeys((*self.log_files, *other.log_files))),
        )


def run_census(run_dir: Path) -> RunCensus:
    """Read ``state.json`` (empty census when there is none); live children of recorded pids are added."""
    try:
        state = json.loads((run_dir / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return RunCensus({}, frozenset(), frozenset())
    pids: dict[int, float] = {}
    for key, ct in (("supervisor_pid", "supervisor_create_time"), ("watchdog_pid", None)):
        pid = int(state.get(key) or 0)
        if pid > 0:
            pids[pid] = float(state.get(ct) or 0.0) if ct else 0.0
    pgids: set[int] = set()
    ports: set[int] = set()
    workers: dict[str, int] = {}
    urls: dict[str, str] = {}
    gateway: int | None = None
    logs: list[Path] = []
    for rec in state.get("processes", []):
        pid = int(rec.get("pid") or 0)
        if pid > 0:
            pids[pid] = float(rec.get("create_time") or 0.0)
            if rec.get("role") == "gateway":
                gateway = pid
            else:
                workers[rec["name"]] = pid
                if rec.get("url"):
                    urls[rec["name"]] = rec["url"]
        if rec.get("pgid"):
            pgids.add(int(rec["pgid"]))
        ports.update(int(p) for p in rec.get("ports", []))
        for dpid, dct in rec.get("descendants", []):
            pids[int(dpid)] = float(dct)
        if rec.get("log_file"):
            logs.append(Path(rec["log_file"]))
    for pid in list(pids):
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(pid).children(recursive=True):
                pids.setdefault(c.pid, c.create_time())
    log_dir = run_dir / "logs"
    if log_dir.is_dir():
        logs.extend(p for p in sorted(log_dir.iterdir()) if p.is_file() and p not in logs)
    return RunCensus(pids, frozenset(pgids), frozenset(ports), gateway, workers, urls, tuple(logs))


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nobody listens on ``port`` (bound like a server, with SO_REUSEADDR: TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _alive(pid: int, create_time: float) -> bool:
    try:
        p = psutil.Process(pid)
        if create_time and abs(p.create_time() - create_time) > 0.05:
            return False  # the pid was reused by someone else
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group_members(pgids: frozenset[int]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "name"]):
        pid = p.info["pid"]
        if pid == me:
            continue
        try:
            if os.getpgid(pid) in pgids or os.getsid(pid) in pgids:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append((pid, str(p.info["name"])))
        except (OSError, psutil.Error):
            continue
    return out


def check_n4(census: RunCensus, *, extra_ports: Iterable[int] = (), timeout_s: float = 10.0) -> InvariantResult:
    """After a stop: no recorded pid alive, no member of a recorded group/session, every port free."""
    ports = sorted(census.ports | set(extra_ports))
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid, ct in census.pids.items() if _alive(pid, ct)]
        members = _group_members(census.pgids)
        busy = [p for p in ports if not port_free(p)]
        if not (alive or members or busy) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    problems = [f"pid {pid} still alive" for pid in alive]
    problems += [f"pid {pid} ({name}) left in a recorded process group or session" for pid, name in members]
    problems += [f"port {p} still in use" for p in busy]
    detail = f"{len(census.pids)} pids, {len(census.pgids)} groups gone; {len(ports)} ports free"
    return _result("N4", problems, detail)


def check_loopback(census: RunCensus, *, allowed: Iterable[int] = ()) -> InvariantResult:
    """X4: every listening TCP socket of the run's live processes is bound to loopback, except ``allowed`` ports."""
    ok_ports = set(allowed)
    problems: list[str] = []
    seen = 0
    pids = set(census.pids)
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error as exc:
        return InvariantResult("X4", True, f"cannot list sockets: {exc}", skipped=True)
    for c in conns:
        if c.status != psutil.CONN_LISTEN or c.pid is None:
            continue
        try:
            in_run = c.pid in pids or os.getpgid(c.pid) in census.pgids
        except OSError:
            continue
        if not in_run:
            continue
        seen += 1
        ip, port = str(getattr(c.laddr, "ip", "")), int(getattr(c.laddr, "port", 0))
        if ip not in ("127.0.0.1", "::1") and port not in ok_ports:
            problems.append(f"pid {c.pid} listens on {ip}:{port}")
    return _result("X4", problems, f"{seen} listening socket(s), all on loopback")


# ------------------------------------------------------------------------------------------------ N5


def _proc_bytes(pid: int, what: str) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return None


def check_n5(
    secrets: Sequence[str],
    *,
    files: Iterable[Path] = (),
    texts: Mapping[str, str | bytes] | None = None,
    environ_pids: Iterable[int] = (),
    all_cmdlines: bool = True,
    cmdline_pids: Iterable[int] = (),
    exclude_pids: Iterable[int] = (),
) -> InvariantResult:
    """Search every place a secret could leak; the detail names places, never the secret.

    ``files`` may contain directories (searched recursively). ``environ_pids`` are processes that must not
    carry a secret even in their environment (the workers; the gateway legitimately has the key there).
    With ``all_cmdlines`` every readable ``/proc/*/cmdline`` on the host is searched, except
    ``exclude_pids`` (a test's own fakes, which may be handed a key on purpose).
    """
    needles = [s.encode() for s in secrets if s]
    if not needles:
        return InvariantResult("N5", True, "no secret given", skipped=True)
    problems: list[str] = []
    searched = 0

    def scan(where: str, data: bytes) -> None:
        nonlocal searched
        searched += 1
        for i, n in enumerate(needles, start=1):
            if n in data:
                problems.append(f"secret #{i} in {where}")

    paths: list[Path] = []
    for f in files:
        f = Path(f)
        if f.is_dir():
            paths.extend(p for p in sorted(f.rglob("*")) if p.is_file())
        elif f.is_file():
            paths.append(f)
    for p in paths:
        with contextlib.suppress(OSError):
            scan(str(p), p.read_bytes())
    for name, text in (texts or {}).items():
        scan(name, text.encode("utf-8", "replace") if isinstance(text, str) else text)
    pids = set(cmdline_pids)
    if all_cmdlines:
        pids.update(psutil.pids())
    for pid in sorted(pids - set(exclude_pids)):
        data = _proc_bytes(pid, "cmdline")
        if data is not None:
            scan(f"/proc/{pid}/cmdline", data)
    for pid in environ_pids:
        data = _proc_bytes(pid, "environ")
        if data is not None:
            scan(f"/proc/{pid}/environ", data)
    return _result("N5", problems, f"{len(needles)} secret(s) absent from {searched} files, texts and /proc entries")


# ------------------------------------------------------------------------------------------------ N6


@dataclass(frozen=True, slots=True)
class ResourceSample:
    """A process's open fds, RSS and threads, plus the gateway's asyncio task count when known."""

    fds: int
    rss_bytes: int
    threads: int
    tasks: int | None = None


def sample_resources(pid: int, metrics_text: str | None = None) -> ResourceSample:
    """Measure ``pid`` now; ``tasks`` from ``pdctl_asyncio_tasks`` in ``metrics_text`` when given."""
    p = psutil.Process(pid)
    with p.oneshot():
        fds, rss, threads = p.num_fds(), p.memory_info().rss, p.num_threads()
    tasks: int | None = None
    if metrics_text is not None:
        v = metric_value(samples(metrics_text, ("pdctl_asyncio_tasks",)), "pdctl_asyncio_tasks")
        tasks = int(v) if v is not None else None
    return ResourceSample(fds, rss, threads, tasks)


def check_n6(
    baseline: ResourceSample,
    after: ResourceSample,
    *,
    tolerance: float = 0.10,
    fd_slack: int = 4,
    rss_slack_bytes: int = 4 << 20,
    thread_slack: int = 2,
) -> InvariantResult:
    """``after`` within ``tolerance`` (+ a small absolute slack, for tiny baselines) of the warm ``baseline``.

    asyncio tasks must be back at (or below) the baseline exactly: a leaked task never finishes.
    """
    problems: list[str] = []

    def bound(what: str, base: int, now: int, slack: int) -> None:
        limit = base * (1 + tolerance) + slack
        if now > limit:
            problems.append(f"{what} {now} > {limit:.0f} (baseline {base})")

    bound("open fds", baseline.fds, after.fds, fd_slack)
    bound("RSS bytes", baseline.rss_bytes, after.rss_bytes, rss_slack_bytes)
    bound("threads", baseline.threads, after.threads, thread_slack)
    if baseline.tasks is not None and after.tasks is not None and after.tasks > baseline.tasks:
        problems.append(f"asyncio tasks {after.tasks} > baseline {baseline.tasks}")
    mib = 1 << 20
    detail = (
        f"fds {baseline.fds}->{after.fds}, RSS {baseline.rss_bytes / mib:.1f}->{after.rss_bytes / mib:.1f} MiB, "
        f"threads {baseline.threads}->{after.threads}, tasks {baseline.tasks}->{after.tasks}"
    )
    return _result("N6", problems, detail)
