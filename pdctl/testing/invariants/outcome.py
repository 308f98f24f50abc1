"""N1, terminal outcome: every accepted request ended exactly once, as the gateway and its clients agree.

* gateway side: :func:`gateway_outcomes` reads ``pdctl_accepted_total`` and ``pdctl_requests_total{status}``
  into :class:`GatewayOutcomes` (``minus`` for what happened since a baseline)
* client side: :func:`client_outcome` classifies one response (a full success, one OpenAI-shaped error, or a
  cancel the client made) into an :class:`Outcome`; :class:`ClientTally` counts them, and hangs
* :func:`check_n1` compares the two
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pdctl.testing.invariants.result import InvariantResult, verdict
from pdctl.vllm.promtext import metric_value, samples
from pdctl.vllm.sse import sse_events

__all__ = ["ClientTally", "GatewayOutcomes", "Outcome", "OutcomeKind", "check_n1", "client_outcome", "gateway_outcomes"]


OutcomeKind = Literal["succeeded", "errored", "cancelled"]


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
    return verdict("N1", problems, detail)
