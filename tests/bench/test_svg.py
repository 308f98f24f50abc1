"""The report's plot axes: ends that cover the data closely, with round tick labels."""

from __future__ import annotations

import re

import pytest

from pdctl.bench.svg import Frame, lines, nice_max, spans, ticks


@pytest.mark.parametrize(
    ("data_max", "end", "expected_ticks"),
    [
        (63.0, 80.0, [0, 20, 40, 60, 80]),  # a 60 s run: the time axis ends at 80 s, not 100 s
        (5.0, 5.0, [0, 1, 2, 3, 4, 5]),  # requests running: whole numbers only
        (2.1, 2.5, [0, 0.5, 1, 1.5, 2, 2.5]),  # request rates 0.5..2: no 0.625 or 1.875
        (1.0, 1.0, [0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        (1244.0, 1250.0, [0, 250, 500, 750, 1000, 1250]),
    ],
)
def test_axis_end_and_ticks_are_round(data_max: float, end: float, expected_ticks: list[float]) -> None:
    assert nice_max(data_max) == pytest.approx(end)
    assert ticks(nice_max(data_max)) == pytest.approx(expected_ticks)


@pytest.mark.parametrize("v", [0.003, 0.7, 9.9, 10.0, 10.1, 333.0, 4321.0, 99_999.0])
def test_axis_end_covers_the_data_in_at_most_five_steps(v: float) -> None:
    end = nice_max(v)
    steps = ticks(end)
    assert end >= v
    assert steps[0] == 0 and steps[-1] == pytest.approx(end)
    assert 4 <= len(steps) <= 7
    # no more than one step of empty space above the data
    assert end - v < (steps[1] - steps[0]) + 1e-9


def test_plot_labels_are_the_ticks() -> None:
    svg = lines("goodput", "rate (req/s)", "req/s", {"pd": [(0.5, 0.4), (1.0, 0.9), (2.0, 1.7)]}, {"pd": "#000"})
    labels = re.findall(r'text-anchor="middle">([0-9.,]+)</text>', svg)
    assert labels == ["0", "0.5", "1", "1.5", "2", "2.5"]


def _segments(svg: str) -> list[tuple[float, float, float]]:
    d = re.findall(r'<path d="([^"]*)" fill="none"', svg)
    return [(float(a), float(b), float(h)) for p in d for a, h, b in re.findall(r"M([0-9.]+) ([0-9.]+)H([0-9.]+)", p)]


def test_spans_merge_what_overlaps_on_a_pixel_row_and_keep_what_stands_apart() -> None:
    # 5,000 overlapping 10 ms gaps over 50 s, and one 400 ms stall at 20 s
    gaps = [(i * 0.01, i * 0.01 + 0.01, 10.0) for i in range(5000)] + [(20.0, 20.4, 400.0)]
    svg = spans("gaps", "ms", {"pd": gaps}, {"pd": "#000"}, [20.0])
    segs = _segments(svg)
    assert len(segs) == 2  # one row of merged gaps, and the stall
    low, stall = sorted(segs, key=lambda s: -s[2])
    frame = Frame(420, 260, nice_max(50.0 * 1.02), 1.0)  # the default size; x reaches 50 s plus 2 %
    # from 0 s to 50 s, as the 5,000 segments drew it
    assert (low[0], low[1]) == pytest.approx(
        (frame.xy(0.0, 0)[0], frame.xy(50.0, 0)[0]), abs=1.0
    )  # segments are 1 px wide at least
    assert stall[1] - stall[0] > 2 and stall[2] < low[2]  # the stall: wider than a pixel, higher up
    assert len(svg) < 3000
    # segments on one row with a gap of several pixels between them stay apart
    apart = spans("gaps", "ms", {"pd": [(1.0, 1.01, 10.0), (30.0, 30.01, 10.0)]}, {"pd": "#000"}, [])
    assert len(_segments(apart)) == 2
