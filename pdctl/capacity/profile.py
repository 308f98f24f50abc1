"""A deployment's measured profile: what one prefill engine, one decode engine and the KV link between them cost.

The terms are the gateway's per-request cost model's (prefill seconds per token, decode step time against the
running requests, KV transfer seconds per token), so one profile can feed both. Stored as JSON, schema version
:data:`SCHEMA_VERSION` (docs/multi-node.md, "Sizing"):

* ``prefill``: one point per probed prompt length: ``prompt_tokens``, ``prefill_s`` (the prefill leg, the
  gateway's ``x-pd-prefill-ms``) and ``ttft_s`` (at the client, through both legs), each the median of its probes;
* ``decode``: one point per probe of concurrent streams: ``running`` (the most seen running at once),
  ``context_tokens`` and ``step_s`` (the median inter-token time while that many ran);
* ``kv``: one point per prompt length: ``transfer_s`` = TTFT − prefill leg − one decode step at that context;
* fits (the cost model's terms): ``prefill_fixed_s`` + ``prefill_s_per_token``·n and ``kv_fixed_s`` +
  ``kv_s_per_token``·n (least squares), and ``decode_fixed_s`` + ``decode_per_seq_s``·running +
  ``decode_per_kv_token_s``·running·context (least squares in relative error, coefficients >= 0);
* ``prefill_max_batched_tokens`` / ``decode_max_num_seqs``: the engines' batch limits, from the config;
* ``prefix_cache_hit_rate``: the prefill engines' hit rate over the traffic they served before the probes (else
  null); ``local_share``: the share of P/D requests the gateway had served on decode alone (adaptive PD; else null).

:func:`decode_step_s` evaluates the decode fit, :func:`prefill_s` interpolates the prefill points, and
:func:`prefill_tokens_per_s` is V_P, the throughput of one prefill engine with a full batch. :func:`load` turns a
malformed file into a :class:`ProfileError` naming the file and the JSON path of the bad field, and so a profile whose
prefill does not grow with the prompt (noise: it would make V_P infinite).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from pdctl.errors import PdctlError

__all__ = [
    "SCHEMA_VERSION",
    "DecodePoint",
    "DeploymentProfile",
    "KVPoint",
    "PrefillPoint",
    "ProfileError",
    "decode_curve",
    "decode_step_s",
    "dump",
    "fit_decode",
    "fit_line",
    "kv_s",
    "load",
    "prefill_s",
    "prefill_tokens_per_s",
]

SCHEMA_VERSION = 1


class ProfileError(PdctlError):
    """A profile file that cannot be read or does not match the schema."""


class PrefillPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One probed prompt length: the prefill leg and the client's TTFT (medians, seconds)."""

    prompt_tokens: int
    prefill_s: float
    ttft_s: float


class DecodePoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One decode probe: ``running`` concurrent streams at about ``context_tokens`` each; median step seconds."""

    running: int
    context_tokens: int
    step_s: float


class KVPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """KV transfer (and hand-off) seconds for a prompt of ``tokens``."""

    tokens: int
    transfer_s: float


class DeploymentProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Schema version 1 (see the module docstring)."""

    source: str
    model: str
    measured_at: str
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    kv: list[KVPoint]
    prefill_fixed_s: float
    prefill_s_per_token: float
    kv_fixed_s: float
    kv_s_per_token: float
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_kv_token_s: float
    prefill_max_batched_tokens: int = 8192
    decode_max_num_seqs: int = 256
    gpus_per_engine: int = 1
    prefix_cache_hit_rate: float | None = None
    local_share: float | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise msgspec.ValidationError(f"schema_version {self.schema_version} is not {SCHEMA_VERSION}")
        if not self.decode:
            raise msgspec.ValidationError("decode: at least one point is needed")
        if self.prefill_s_per_token <= 0:
            raise msgspec.ValidationError("prefill_s_per_token must be > 0")
        for p in self.decode:
            if p.running < 1 or p.step_s <= 0:
                raise msgspec.ValidationError("decode: running must be >= 1 and step_s > 0")


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)``; one point gives ``(0, y/x)``; intercept clamped to >= 0."""
    if not xs:
        raise ValueError("no points to fit")
    if len(xs) == 1 or len(set(xs)) == 1:
        return 0.0, sum(ys) / sum(xs)
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    if intercept < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return intercept, slope


def prefill_s(p: DeploymentProfile, tokens: float) -> float:
    """Seconds one prefill engine takes for ``tokens`` uncached tokens alone: the measured points interpolated
    (attention makes long prompts dearer than the fit says), the fit below them, the last two points' slope
    above them."""
    tokens = max(tokens, 0.0)
    pts = sorted(p.prefill, key=lambda q: q.prompt_tokens)
    if len(pts) < 2 or tokens <= pts[0].prompt_tokens:
        return p.prefill_fixed_s + p.prefill_s_per_token * tokens
    return max(_interp([q.prompt_tokens for q in pts], [q.prefill_s for q in pts], tokens), 0.0)


def prefill_tokens_per_s(p: DeploymentProfile) -> float:
    """V_P: tokens/s of one prefill engine with its batch full (``prefill_max_batched_tokens`` a step)."""
    n = p.prefill_max_batched_tokens
    return n / prefill_s(p, n)


def kv_s(p: DeploymentProfile, tokens: float) -> float:
    """Seconds to hand a prompt's KV of ``tokens`` from prefill to decode."""
    return max(0.0, p.kv_fixed_s + p.kv_s_per_token * max(tokens, 0.0))


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def fit_decode(points: Sequence[DecodePoint]) -> tuple[float, float, float]:
    """``(fixed_s, per_seq_s, per_kv_token_s)`` of ``step = fixed + per_seq·n + per_kv_token·n·context``: least
    squares in relative error, every coefficient >= 0 (the best fit over the subsets of terms that keeps them so)."""
    rows = [(1.0, float(p.running), float(p.running) * p.context_tokens, p.step_s) for p in points]
    best: tuple[float, tuple[float, float, float]] | None = None
    for mask in ((1, 1, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1)):
        cols = [i for i in range(3) if mask[i]]
        if len(rows) < len(cols):
            continue
        a = [[r[i] / r[3] for i in cols] for r in rows]
        coef = _least_squares(a, [1.0] * len(rows))
        if coef is None or min(coef) < 0:
            continue
        full = [0.0, 0.0, 0.0]
        for i, c in zip(cols, coef, strict=True):
            full[i] = c
        err = sum((sum(f * x for f, x in zip(full, r[:3], strict=True)) / r[3] - 1) ** 2 for r in rows)
        if best is None or err < best[0]:
            best = (err, (full[0], full[1], full[2]))
    if best is None:
        raise ValueError("no decode points to fit")
    return best[1]


def _least_squares(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve the normal equations of ``a·x ≈ b`` (Gaussian elimination; None when singular)."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b, strict=True))]
         for i in range(n)]  # fmt: skip
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def decode_curve(p: DeploymentProfile) -> Callable[[float, float], float]:
    """``step(running, context)``: seconds of one decode step from the profile's fit
    (``decode_fixed_s + decode_per_seq_s·n + decode_per_kv_token_s·n·context``)."""
    fixed, per_seq, per_kv = p.decode_fixed_s, p.decode_per_seq_s, p.decode_per_kv_token_s

    def step(running: float, context: float) -> float:
        n = max(running, 1.0)
        return fixed + per_seq * n + per_kv * n * max(context, 0.0)

    return step


def decode_step_s(p: DeploymentProfile, running: float, context: float) -> float:
    """Seconds of one decode step with ``running`` streams at ``context`` tokens each (:func:`decode_curve`)."""
    return decode_curve(p)(running, context)


def load(path: Path) -> DeploymentProfile:
    """Read and validate a profile file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        prof = msgspec.json.decode(data, type=DeploymentProfile)
    except msgspec.ValidationError as exc:
        raise ProfileError(
            f"{path}: not a pdctl profile: {exc}", hint="write one with `pdctl profile -o FILE`"
        ) from None
    except msgspec.DecodeError as exc:
        raise ProfileError(f"{path}: not JSON: {exc}") from None
    if prefill_s(prof, prof.prefill_max_batched_tokens) <= 0:
        points = ", ".join(f"{q.prompt_tokens} tokens {q.prefill_s * 1000:.1f} ms" for q in prof.prefill)
        raise ProfileError(
            f"{path}: prefill: the longer prompts did not take longer ({points}), so a full batch of "
            f"{prof.prefill_max_batched_tokens} tokens extrapolates to no time: the probes measured noise, not prefill",
            hint="profile again on a quieter machine, with more --repeats or longer --prompt-lens",
        )
    return prof


def dump(p: DeploymentProfile) -> bytes:
    """The profile as indented JSON."""
    return msgspec.json.format(msgspec.json.encode(p), indent=2) + b"\n"
