"""Inline SVG plots for the HTML report: no plotting library, no script, text only.

* :func:`cdf`       -- empirical CDFs of several samples, one curve each;
* :func:`spans`     -- one horizontal segment per request (its decode window at its TPOT), with vertical marker
  lines (long-prompt arrivals);
* :func:`lines`     -- lines through points (goodput or attainment against the rate), optionally a y = x guide.

Every plot is a :class:`Frame` (size, axes, grid) with its legend *below* the axes, so no curve is ever hidden
behind it. Colours come from the caller, one per series name, so a side keeps its colour on every plot.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdctl.bench.metrics import percentile

__all__ = ["PALETTE", "Frame", "cdf", "lines", "nice_max", "spans", "ticks"]

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")
MARKER_COLOUR = "#e377c2"
# Roughly the advance of one character of the 11 px sans-serif font: enough to lay out legend rows.
_CHAR_PX = 6.2
_ML, _MR, _MT, _MB = 60, 24, 28, 40
_LEGEND_ROW_PX = 15


@dataclass(frozen=True, slots=True)
class Frame:
    """The geometry of one plot: outer size and the axes' ranges; maps data to pixels."""

    width: int
    height: int
    xmax: float
    ymax: float

    @property
    def plot_w(self) -> float:
        """Width of the axes box in pixels."""
        return self.width - _ML - _MR

    @property
    def plot_h(self) -> float:
        """Height of the axes box in pixels."""
        return self.height - _MT - _MB

    def xy(self, x: float, y: float) -> tuple[float, float]:
        """Pixel position of a data point (clipped to the axes box)."""
        fx = min(max(x / self.xmax, 0.0), 1.0)
        fy = min(max(y / self.ymax, 0.0), 1.0)
        return _ML + fx * self.plot_w, _MT + self.plot_h - fy * self.plot_h


def _steps(v: float) -> list[float]:
    """Tick steps of 1, 2, 2.5 and 5 times a power of ten, ascending, from a tenth of ``v``'s decade."""
    exp = 10 ** (math.floor(math.log10(v)) - 1)
    return [m * exp * 10**k for k in range(3) for m in (1, 2, 2.5, 5)]


def nice_max(v: float) -> float:
    """The axis end for data up to ``v``: the smallest multiple of a 1/2/2.5/5 step that covers ``v`` in at most
    five steps (so 63 s ends at 80, not 100, and every tick label is round)."""
    if not v > 0 or not math.isfinite(v):
        return 1.0
    for step in _steps(v):
        n = math.ceil(v / step - 1e-9)
        if n <= 5:
            return float(n * step)
    return float(10 ** math.ceil(math.log10(v)))


def ticks(end: float) -> list[float]:
    """Tick values from 0 to ``end``: the finest round step that divides ``end`` into 3 to 6 parts (0, 0.5 .. 2.5
    rather than 0, 0.625 .. 2.5), else quarters."""
    if end > 0 and math.isfinite(end):
        for step in _steps(end):
            n = end / step
            if 3 <= round(n) <= 6 and abs(n - round(n)) < 1e-6:
                return [step * i for i in range(round(n) + 1)]
    return [end * i / 4 for i in range(5)]


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _legend_rows(entries: Sequence[tuple[str, str, str]], width: int) -> list[list[tuple[str, str, str, float]]]:
    rows: list[list[tuple[str, str, str, float]]] = [[]]
    x = float(_ML)
    for name, colour, kind in entries:
        item_w = 18 + _CHAR_PX * len(name) + 14
        if rows[-1] and x + item_w > width - _MR:
            rows.append([])
            x = float(_ML)
        rows[-1].append((name, colour, kind, x))
        x += item_w
    return [r for r in rows if r]


def _svg(
    title: str,
    xlabel: str,
    ylabel: str,
    frame: Frame,
    body: Sequence[str],
    legend: Sequence[tuple[str, str, str]],
) -> str:
    """Axes, grid, labels, ``body`` and the legend (entries: name, colour, ``box`` or ``line``)."""
    rows = _legend_rows(legend, frame.width)
    total_h = frame.height + _LEGEND_ROW_PX * len(rows) + (4 if rows else 0)
    pw, ph = frame.plot_w, frame.plot_h
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{frame.width}" height="{total_h}" '
        f'viewBox="0 0 {frame.width} {total_h}" font-family="sans-serif" font-size="11">',
        f'<text x="{frame.width / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">'
        f"{html.escape(title)}</text>",
        f'<rect x="{_ML}" y="{_MT}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
    ]
    for v in ticks(frame.ymax):
        y = _MT + ph - v / frame.ymax * ph
        parts.append(f'<line x1="{_ML}" y1="{y:.1f}" x2="{_ML + pw}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{_ML - 4}" y="{y + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    for v in ticks(frame.xmax):
        x = _ML + v / frame.xmax * pw
        parts.append(f'<text x="{x:.1f}" y="{_MT + ph + 14}" text-anchor="middle">{_fmt(v)}</text>')
    parts.append(f'<text x="{_ML + pw / 2}" y="{frame.height - 6}" text-anchor="middle">{html.escape(xlabel)}</text>')
    parts.append(
        f'<text x="14" y="{_MT + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {_MT + ph / 2})">'
        f"{html.escape(ylabel)}</text>"
    )
    parts.extend(body)
    for r, row in enumerate(rows):
        y = frame.height + 4 + _LEGEND_ROW_PX * r + 8
        for name, colour, kind, x in row:
            if kind == "line":
                parts.append(f'<line x1="{x:.0f}" y1="{y - 3}" x2="{x + 12:.0f}" y2="{y - 3}" stroke="{colour}" '
                             'stroke-width="2" stroke-dasharray="3,2"/>')  # fmt: skip
            else:
                parts.append(f'<rect x="{x:.0f}" y="{y - 8}" width="10" height="10" fill="{colour}"/>')
            parts.append(f'<text x="{x + 16:.0f}" y="{y + 1}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def cdf(
    title: str,
    xlabel: str,
    series: Mapping[str, Sequence[float]],
    colours: Mapping[str, str],
    *,
    ylabel: str = "fraction of requests",
    size: tuple[int, int] = (420, 260),
) -> str:
    """Empirical CDFs as steps (x clipped at the largest p99, so one outlier cannot flatten the others)."""
    nonempty = {k: sorted(v) for k, v in series.items() if v}
    xmax = nice_max(max((percentile(v, 99.0) for v in nonempty.values()), default=1.0) * 1.05)
    frame = Frame(size[0], size[1], xmax, 1.0)
    body: list[str] = []
    for name, values in nonempty.items():
        n = len(values)
        step = max(1, n // 400)
        # A step function from 0: each value lifts the curve by 1/n (by step/n when thinned to ~400 steps).
        pts = [frame.xy(values[0], 0.0)]
        for j in range(0, n, step):
            pts += [frame.xy(values[j], j / n), frame.xy(values[j], min(j + step, n) / n)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        body.append(f'<polyline fill="none" stroke="{colours[name]}" stroke-width="1.5" points="{path}"/>')
    legend = [(name, colours[name], "box") for name in nonempty]
    return _svg(title, xlabel, ylabel, frame, body, legend)


def spans(
    title: str,
    ylabel: str,
    series: Mapping[str, Sequence[tuple[float, float, float]]],
    colours: Mapping[str, str],
    markers: Sequence[float],
    *,
    marker_label: str = "long-prompt arrival",
    y_percentile: float = 99.5,
    size: tuple[int, int] = (420, 260),
) -> str:
    """Horizontal segments ``(x_start, x_end, y)`` (a request's decode window at its TPOT, or one gap between two
    tokens at its length; y clipped at its ``y_percentile``), with a vertical line at each of ``markers``.

    Each series is one path of the segments as drawn (:func:`_drawn`): a run's tens of thousands of short gaps
    between tokens overlap on a few pixel rows, and one element per gap made a plot of several hundred KB."""
    all_spans = [p for pts in series.values() for p in pts]
    ymax = nice_max(percentile([p[2] for p in all_spans], y_percentile) * 1.1 if all_spans else 1.0)
    xmax = nice_max(max([p[1] for p in all_spans] + list(markers) + [1e-9]) * 1.02)
    frame = Frame(size[0], size[1], xmax, ymax)
    body: list[str] = []
    for t in markers:
        x, _ = frame.xy(t, 0.0)
        body.append(
            f'<line x1="{x:.1f}" y1="{_MT}" x2="{x:.1f}" y2="{_MT + frame.plot_h}" stroke="{MARKER_COLOUR}" '
            'stroke-opacity="0.6" stroke-dasharray="3,2"/>'
        )
    for name, pts in series.items():
        if pts:
            d = "".join(f"M{a:.1f} {h:.1f}H{b:.1f}" for a, b, h in _drawn(pts, frame))
            body.append(f'<path d="{d}" fill="none" stroke="{colours[name]}" stroke-width="2" '
                        'stroke-opacity="0.6"/>')  # fmt: skip
    legend = [(name, colours[name], "box") for name in series]
    if markers:
        legend.append((marker_label, MARKER_COLOUR, "line"))
    return _svg(title, "time since the run started (s)", ylabel, frame, body, legend)


def _drawn(pts: Sequence[tuple[float, float, float]], frame: Frame) -> list[tuple[float, float, float]]:
    """``(x_start, x_end, y)`` in pixels, at least 1 px wide, y on half pixels; the segments of a row that overlap
    or lie within a pixel of each other merged into one (the same picture, with fewer segments)."""
    rows: dict[float, list[tuple[float, float]]] = {}
    for x0, x1, y in pts:
        (a, h), (b, _) = frame.xy(x0, y), frame.xy(x1, y)
        rows.setdefault(round(h * 2) / 2, []).append((a, max(b, a + 1)))
    out: list[tuple[float, float, float]] = []
    for h, segs in rows.items():
        segs.sort()
        start, end = segs[0]
        for a, b in segs[1:]:
            if a <= end + 1:
                end = max(end, b)
            else:
                out.append((start, end, h))
                start, end = a, b
        out.append((start, end, h))
    return out


def lines(
    title: str,
    xlabel: str,
    ylabel: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    colours: Mapping[str, str],
    *,
    ymax: float | None = None,
    diagonal: str | None = None,
    size: tuple[int, int] = (560, 300),
) -> str:
    """Lines with point markers; ``ymax`` fixes the y axis (100 for a percentage), ``diagonal`` labels y = x."""
    pts_all = [p for pts in series.values() for p in pts if math.isfinite(p[0])]
    xmax = nice_max(max((p[0] for p in pts_all), default=1.0) * 1.05)
    top = ymax if ymax is not None else nice_max(max((p[1] for p in pts_all), default=1.0) * 1.1)
    frame = Frame(size[0], size[1], xmax, top)
    body: list[str] = []
    legend: list[tuple[str, str, str]] = []
    if diagonal is not None:
        (x0, y0), (x1, y1) = frame.xy(0.0, 0.0), frame.xy(min(xmax, top), min(xmax, top))
        body.append(f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y1:.1f}" stroke="#aaa" '
                    'stroke-dasharray="3,2"/>')  # fmt: skip
        legend.append((diagonal, "#aaa", "line"))
    for name, pts in series.items():
        xy = [frame.xy(x, y) for x, y in sorted(pts) if math.isfinite(x)]
        body.append(
            f'<polyline fill="none" stroke="{colours[name]}" stroke-width="1.5" '
            f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in xy)}"/>'
        )
        body.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colours[name]}"/>' for x, y in xy)
    legend = [(name, colours[name], "box") for name in series] + legend
    return _svg(title, xlabel, ylabel, frame, body, legend)
