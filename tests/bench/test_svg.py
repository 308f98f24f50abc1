"""The report's plot axes: ends that cover the data closely, with round tick labels."""

from __future__ import annotations

import re

import pytest

from pdctl.bench.svg import lines, nice_max, ticks


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
