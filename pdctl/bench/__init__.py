"""``pdctl bench``: load generation and measurement for PD deployments.

* :mod:`~pdctl.bench.workload`           -- what to send (doc, random, mixed, ShareGPT, trace)
* :mod:`~pdctl.bench.arrivals`           -- when to send it (Poisson / gamma)
* :mod:`~pdctl.bench.client`             -- one async httpx client, SSE timing per request
* :mod:`~pdctl.bench.aiohttp_transport`  -- httpx's API over aiohttp, the client's default transport
* :mod:`~pdctl.bench.metrics`            -- pure functions: per-request results -> summary (vLLM definitions)
* :mod:`~pdctl.bench.runner`             -- runs, sweeps, max-goodput search, A/B, model discovery
* :mod:`~pdctl.bench.engine_metrics`     -- /metrics deltas around a run, batch gauges sampled during it
* :mod:`~pdctl.bench.report`             -- results JSON (vLLM keys), comparison, runs' names
* :mod:`~pdctl.bench.html`               -- the HTML report
* :mod:`~pdctl.bench.plots`              -- its plots (inline SVG, or files)
* :mod:`~pdctl.bench.svg`                -- the SVG drawing underneath
"""

from __future__ import annotations
