"""Rules about tracing: the options that only mean something with a collector.

- :func:`without_collector` PD037: ``logging.trace_content`` or ``logging.collect_detailed_traces`` set while
  ``logging.otlp_traces_endpoint`` is not, so no span is made to hold them.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdctl.check.findings import SETTINGS, Ctx, Finding


def without_collector(c: Ctx) -> Iterable[Finding]:
    """PD037: span options with no OTLP endpoint to send spans to."""
    log = c.dep.logging
    if log.otlp_traces_endpoint:
        return
    if log.trace_content:
        yield c.at("PD037", "info", "settings", "logging.trace_content",
                   "trace_content = true changes nothing without logging.otlp_traces_endpoint: the gateway makes no "
                   "spans to hold the prompt and the answer",
                   fixes=({f"{SETTINGS}logging.trace_content": None},))  # fmt: skip
    if log.collect_detailed_traces:
        yield c.at("PD037", "info", "settings", "logging.collect_detailed_traces",
                   "collect_detailed_traces changes nothing without logging.otlp_traces_endpoint: the workers get "
                   "no --otlp-traces-endpoint, so pdctl does not pass --collect-detailed-traces either",
                   fixes=({f"{SETTINGS}logging.collect_detailed_traces": None},))  # fmt: skip
