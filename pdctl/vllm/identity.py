"""Do a prefill and a decode worker serve the same model? (recipe §5.4; reliability case S6)

NIXL's handshake hash covers the model string, dtype and shapes, but not the tokenizer or the chat template,
and shared-storage connectors check nothing at all. Both ``up`` (before the warm-up probe) and ``verify``
compare what the workers themselves report: ``/v1/models`` id, root and ``max_model_len``, ``/version``, and
the ``/tokenize`` output for one probe string.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["WorkerIdentity", "fetch_identity", "identity_problems"]


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What one worker says it serves; ``None`` where it did not answer."""

    model_id: str | None
    root: str | None
    max_model_len: int | None
    version: str | None
    tokens: tuple[int, ...] | None


def _json(client: httpx.Client, method: str, url: str, timeout_s: float, body: Any = None) -> Any:
    try:
        r = client.request(method, url, json=body, timeout=timeout_s)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def fetch_identity(client: httpx.Client, url: str, model_name: str, probe_text: str,
                   timeout_s: float = 30.0) -> WorkerIdentity:  # fmt: skip
    """Ask the worker at ``url`` what it serves and how it tokenizes ``probe_text``."""
    models = _json(client, "GET", f"{url}/v1/models", timeout_s)
    entry: Mapping[str, Any] = {}
    if isinstance(models, Mapping) and isinstance(models.get("data"), list) and models["data"]:
        first = models["data"][0]
        entry = first if isinstance(first, Mapping) else {}
    version = _json(client, "GET", f"{url}/version", timeout_s)
    tok = _json(client, "POST", f"{url}/tokenize", timeout_s, {"model": model_name, "prompt": probe_text})
    tokens = tok.get("tokens") if isinstance(tok, Mapping) else None
    mml = entry.get("max_model_len")
    return WorkerIdentity(
        model_id=entry.get("id"),
        root=entry.get("root"),
        max_model_len=int(mml) if isinstance(mml, int) else None,
        version=version.get("version") if isinstance(version, Mapping) else None,
        tokens=tuple(int(t) for t in tokens) if isinstance(tokens, list) else None,
    )


def identity_problems(
    a_name: str, a: WorkerIdentity, b_name: str, b: WorkerIdentity, *, require_tokenize: bool = True
) -> list[str]:
    """Human-readable differences between two workers; empty when they serve the same model the same way.

    With ``require_tokenize`` a worker without ``/tokenize`` is a problem too (verify must prove equality);
    without it only an actual difference counts (``up`` must not refuse a server it cannot question).
    """
    problems = []
    for field in ("model_id", "root", "max_model_len", "version"):
        va, vb = getattr(a, field), getattr(b, field)
        if va != vb:
            problems.append(f"{field.replace('model_id', 'id')}: {a_name} {va!r} != {b_name} {vb!r}")
    if a.tokens is None or b.tokens is None:
        if not require_tokenize:
            return problems
        missing = [n for n, w in ((a_name, a), (b_name, b)) if w.tokens is None]
        problems.append("/tokenize unavailable on " + ", ".join(missing))
    elif a.tokens != b.tokens:
        problems.append(f"/tokenize differs ({len(a.tokens)} vs {len(b.tokens)} tokens)")
    return problems
