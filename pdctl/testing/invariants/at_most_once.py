"""N3, at most once: at most one decode request per pipeline id, at most one retry pipeline per client request.

:func:`decode_requests_from_log` counts the ``start_load_kv`` lines of a DEBUG decode log per request id,
:func:`client_id` maps a gateway pipeline id back to the client's, :func:`check_n3` judges the counts.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping

from pdctl.testing.invariants.result import InvariantResult, verdict

__all__ = ["check_n3", "client_id", "decode_requests_from_log"]


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
    return verdict("N3", problems, f"{total} decode requests for {len(per_client)} client requests, {retried} retried")
