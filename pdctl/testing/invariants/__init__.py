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

One module per family, every public name re-exported here:

* ``result``        -- :class:`InvariantResult`, :class:`InvariantReport`; ``verdict`` (problems -> result)
* ``outcome``       -- N1: :func:`gateway_outcomes`, :func:`client_outcome`, :class:`ClientTally`, :func:`check_n1`
* ``quiescence``    -- N2: :func:`worker_load`, :func:`sample_workers`, :func:`check_n2`
* ``at_most_once``  -- N3: :func:`decode_requests_from_log`, :func:`client_id`, :func:`check_n3`
* ``orphans``       -- N4 and X4: :func:`run_census`, :func:`port_free`, :func:`check_n4`, :func:`check_loopback`
* ``exposure``      -- N5: :func:`check_n5`
* ``resources``     -- N6: :func:`sample_resources`, :func:`check_n6`

Each ``check_nX`` returns an :class:`InvariantResult`; :class:`InvariantReport` collects them. Nothing here
prints or exits; details never contain a secret.

Vocabulary: these are **invariants** (ok / FAIL / skip, after a run), not ``pdctl check``'s lint
**findings** nor ``pdctl verify``'s **checks**; docs/architecture.md.
"""

from __future__ import annotations

from pdctl.testing.invariants.at_most_once import check_n3, client_id, decode_requests_from_log
from pdctl.testing.invariants.exposure import check_n5
from pdctl.testing.invariants.orphans import RunCensus, check_loopback, check_n4, port_free, run_census
from pdctl.testing.invariants.outcome import (
    ClientTally,
    GatewayOutcomes,
    Outcome,
    check_n1,
    client_outcome,
    gateway_outcomes,
)
from pdctl.testing.invariants.quiescence import WorkerLoad, check_n2, sample_workers, worker_load
from pdctl.testing.invariants.resources import ResourceSample, check_n6, sample_resources
from pdctl.testing.invariants.result import InvariantReport, InvariantResult

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
