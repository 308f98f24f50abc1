"""The HTML report: one self-contained page (:func:`render_html`).

Tables first (per run, per request kind, KV transfer, the engines' own view from vLLM's /metrics against the
client's), then the plots of :func:`pdctl.bench.plots.plot_groups`, inline. Runs are named by side and load
(:func:`pdctl.bench.report.run_name`), never by URL.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

from pdctl import __version__
from pdctl.bench.engine_metrics import engine_summary, kv_summary
from pdctl.bench.metrics import SPIKE_FACTOR, Spikes, Stats
from pdctl.bench.plots import plot_groups
from pdctl.bench.report import best_swept_rate, engine_name, run_load, run_name
from pdctl.bench.runner import RunResult, SearchResult

__all__ = ["render_html"]


def _cell(st: Stats, q: float) -> str:
    if not st.count:
        return "-"
    return f"{st.percentiles.get(q, st.median if q == 50 else float('nan')):.1f}"


def _table(heads: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in heads) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _who(run: RunResult, with_side: bool) -> list[str]:
    return [run.target.label, run_load(run)] if with_side else [run_load(run)]


def _summary_table(runs: Sequence[RunResult], with_side: bool) -> str:
    heads = [*(["side"] if with_side else []), "load", "completed", "failed", "req/s", "goodput", "SLO att.",
             "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p90", "TPOT p99", "ITL p99", "ITL spikes",
             "paths"]  # fmt: skip
    rows = []
    for run in runs:
        s = run.summary
        rows.append([
            *_who(run, with_side), str(s.completed), str(s.failed), f"{s.request_throughput:.2f}",
            "-" if s.request_goodput is None else f"{s.request_goodput:.2f}",
            "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.0f}%",
            _cell(s.ttft, 50.0), _cell(s.ttft, 90.0), _cell(s.ttft, 99.0),
            _cell(s.tpot, 50.0), _cell(s.tpot, 90.0), _cell(s.tpot, 99.0), _cell(s.itl, 99.0),
            _spike_cell(s.itl_spikes), ", ".join(f"{k} {v}" for k, v in sorted(s.paths.items())),
        ])  # fmt: skip
    return _table(heads, rows)


def _spike_cell(sp: Spikes) -> str:
    return f"{sp.gaps} in {sp.requests} req" if sp.gaps else "0"


def _kind_table(runs: Sequence[RunResult], with_side: bool) -> str:
    """TTFT, TPOT and ITL per request kind (``short``/``long`` of ``mixed``), when a run has several kinds."""
    if not any(run.summary.by_kind for run in runs):
        return ""
    heads = [*(["side"] if with_side else []), "load", "kind", "requests", "TTFT p50", "TTFT p90", "TTFT p99",
             "TPOT p50", "TPOT p90", "TPOT p99", "ITL p99", "ITL max", "ITL spikes"]  # fmt: skip
    rows = []
    for run in runs:
        for kind, d in sorted(run.summary.by_kind.items(), key=lambda kv: kv[0] != "short"):
            ttft, tpot, itl = d["ttft"], d["tpot"], d["itl"]
            rows.append([
                *_who(run, with_side), kind, str(ttft.count), _cell(ttft, 50.0), _cell(ttft, 90.0),
                _cell(ttft, 99.0), _cell(tpot, 50.0), _cell(tpot, 90.0), _cell(tpot, 99.0), _cell(itl, 99.0),
                f"{itl.max:.1f}" if itl.count else "-", _spike_cell(run.summary.spikes_by_kind[kind]),
            ])  # fmt: skip
    threshold = next(r.summary.itl_spikes.threshold_ms for r in runs if r.summary.by_kind)
    return (
        "<h2>By request kind</h2>"
        f"<p>ITL spikes: gaps between chunks over {threshold:.0f} ms (the TPOT SLO, else {SPIKE_WORDS}), and in "
        "how many requests.</p>" + _table(heads, rows)
    )


SPIKE_WORDS = f"{SPIKE_FACTOR:g}× the run's ITL median"


def _engine_table(runs: Sequence[RunResult], with_side: bool) -> str:
    """vLLM's own view of each run, per endpoint: its latency histograms' means and its batch gauges, beside the
    client's means, so the two can be cross-checked."""
    rows = []
    for run in runs:
        engines = engine_summary(run.metric_deltas)
        s = run.summary
        client = ["client", f"{s.completed}", f"{s.ttft.mean:.1f}", f"{s.tpot.mean:.1f}", f"{s.itl.mean:.1f}",
                  f"{s.e2el.mean:.1f}", "-", "-", "-", "-"]  # fmt: skip
        if not engines and not run.gauges:
            continue
        rows.append([*_who(run, with_side), *client])
        for url in dict.fromkeys([*engines, *run.gauges]):
            e = engines.get(url, {})
            g = run.gauges[url].stats() if url in run.gauges else {}

            def ms(key: str, e: dict[str, float] = e) -> str:
                return f"{e[key]:.1f}" if key in e else "-"

            def gauge(key: str, g: dict[str, float] = g) -> str:
                return f"{g[key]:.1f}" if key in g else "-"

            seen_by = engine_name(run, url)
            rows.append([
                *_who(run, with_side), seen_by, f"{e.get('requests', 0):.0f}", ms("ttft_ms"), ms("tpot_ms"),
                ms("itl_ms"), ms("e2el_ms"), ms("queue_ms"), ms("prefill_ms"),
                gauge("running_mean") + " / " + gauge("running_max"), gauge("waiting_max"),
            ])  # fmt: skip
    if not rows:
        return ""
    heads = [*(["side"] if with_side else []), "load", "seen by", "requests", "TTFT mean", "TPOT mean", "ITL mean",
             "E2EL mean", "queue mean", "prefill mean", "running mean / max", "waiting max"]  # fmt: skip
    return (
        "<h2>The engines' own view (vLLM /metrics) against the client's</h2>"
        "<p>Means in ms from the deltas of vLLM's histograms over the run; running/waiting requests sampled "
        "every second while it ran. On PD, prefill's TTFT is its whole leg and decode's starts when decode "
        "received the request, so only the client's TTFT includes both. The workers keep their config names on a "
        "colocated side too, where each serves whole requests.</p>" + _table(heads, rows)
    )


def _kv_table(runs: Sequence[RunResult], with_side: bool) -> str:
    rows = []
    for run in runs:
        if run.metric_deltas:
            kv = kv_summary(run.metric_deltas)
            done = run.summary.completed
            rows.append([
                *_who(run, with_side), f"{kv['kv_transfers']:.0f}", f"{kv['kv_bytes'] / 1e6:.2f}",
                f"{kv['kv_xfer_ms_mean']:.2f}", f"{kv['kv_failed_transfers']:.0f}", f"{kv['external_kv_tokens']:.0f}",
                f"{kv['external_kv_tokens'] / done:.1f}" if done else "-",
            ])  # fmt: skip
    if not rows:
        return ""
    heads = [*(["side"] if with_side else []), "load", "transfers", "MB", "mean ms", "failed", "external KV tokens",
             "per completed request"]  # fmt: skip
    return "<h2>KV transfer during the run (workers' /metrics deltas)</h2>" + _table(heads, rows)


def _sections(runs: Sequence[RunResult]) -> str:
    return "".join(
        f"<h2>{html.escape(head)}</h2><div class='plots'>{''.join(image for _, image in plots)}</div>"
        for head, plots in plot_groups(runs)
    )


def render_html(
    runs: Sequence[RunResult],
    *,
    title: str = "pdctl bench",
    search: SearchResult | None = None,
    searches: Mapping[str, SearchResult] | None = None,
) -> str:
    """A self-contained HTML report of ``runs``: tables, then the plots of :func:`plot_groups`. ``searches``: one
    max-goodput search per side (``--ab --max-goodput``)."""
    with_side = any(r.target.label for r in runs)
    notes: list[str] = []
    for side, found in ([("", search)] if search is not None else []) + list((searches or {}).items()):
        best = "none of the probed rates" if found.best_rate is None else f"{found.best_rate:.3g} req/s"
        notes.append(
            f"<p><b>Max goodput rate{html.escape(' of ' + side if side else '')}</b> "
            f"(≥ {100 * found.attainment_target:.0f}% of requests within every SLO): {html.escape(best)}</p>"
        )
    swept = best_swept_rate(runs) if len({r.shape.rate for r in runs}) > 1 else {}
    for side, rate in swept.items():
        text = "none of the swept rates" if rate is None else f"{rate:g} req/s"
        notes.append(
            f"<p><b>Highest swept rate within the SLOs</b>{' (' + html.escape(side) + ')' if side else ''}: "
            f"{html.escape(text)}</p>"
        )
    for run in runs:
        for w in run.warnings:
            notes.append(f'<p class="warn">{html.escape(run_name(run))}: {html.escape(w)}</p>')
    slo = next((r.summary.slo for r in runs if r.summary.slo is not None), None)
    slo_text = "no SLO given" if slo is None else ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.as_dict().items())
    style = (
        "body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}"
        "td:first-child,th:first-child{text-align:left}h2{font-size:18px;margin:20px 0 6px}"
        ".plots{display:flex;flex-wrap:wrap;gap:12px;margin-bottom:8px}.warn{color:#a40}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>SLOs: {html.escape(slo_text)}. Latencies in ms; TTFT = send → first content chunk, "
        "TPOT = (E2EL − TTFT)/(output tokens − 1), ITL = gaps between chunks (vLLM definitions).</p>"
        + "".join(notes)
        + _summary_table(runs, with_side)
        + _kind_table(runs, with_side)
        + _kv_table(runs, with_side)
        + _engine_table(runs, with_side)
        + _sections(runs)
        + f"<p style='color:#888'>pdctl {html.escape(__version__)}</p></body></html>"
    )
