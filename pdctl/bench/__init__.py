"""``pdctl bench``: load generation and measurement for PD deployments.

* :mod:`~pdctl.bench.workload`  -- what to send (doc, random, mixed, ShareGPT, trace)
* :mod:`~pdctl.bench.arrivals`  -- when to send it (Poisson / gamma)
* :mod:`~pdctl.bench.client`    -- one async httpx client, SSE timing per request
* :mod:`~pdctl.bench.metrics`   -- pure functions: per-request results -> summary (vLLM definitions)
* :mod:`~pdctl.bench.runner`    -- runs, sweeps, max-goodput search, A/B, metric deltas
* :mod:`~pdctl.bench.report`    -- results JSON (vLLM keys), comparison, HTML report
"""

from __future__ import annotations
