"""Arrival generator: rate and burstiness checked statistically (fixed seeds, wide tolerances)."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from pdctl.bench.arrivals import ArrivalError, arrival_offsets, parse_rates


def gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(offsets)]


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_rate_and_burstiness(burstiness: float, cv: float) -> None:
    rate = 8.0
    g = gaps(arrival_offsets(20000, rate, burstiness, seed=7, rescale=False))
    mean = statistics.fmean(g)
    assert mean == pytest.approx(1.0 / rate, rel=0.05)
    # Gamma(k, 1/(rate k)): coefficient of variation 1/sqrt(k)
    assert statistics.pstdev(g) / mean == pytest.approx(cv, rel=0.1)


def test_rescaled_last_arrival_is_n_over_rate() -> None:
    offsets = arrival_offsets(500, 5.0, 1.0, seed=1)
    assert offsets[-1] == pytest.approx(100.0)
    assert offsets == sorted(offsets)
    assert all(t >= 0 for t in offsets)


def test_deterministic_for_a_seed() -> None:
    assert arrival_offsets(50, 3.0, 0.5, seed=4) == arrival_offsets(50, 3.0, 0.5, seed=4)
    assert arrival_offsets(50, 3.0, 0.5, seed=4) != arrival_offsets(50, 3.0, 0.5, seed=5)


def test_infinite_rate_and_constant_spacing() -> None:
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    assert gaps(arrival_offsets(5, 2.0, math.inf)) == pytest.approx([0.5] * 4)


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_values(rate: float, burst: float) -> None:
    with pytest.raises(ArrivalError):
        arrival_offsets(10, rate, burst)


def test_parse_rates() -> None:
    assert parse_rates("2") == [2.0]
    assert parse_rates("1, 2,4") == [1.0, 2.0, 4.0]
    assert parse_rates("1:3:0.5") == [1.0, 1.5, 2.0, 2.5, 3.0]
    assert parse_rates("inf") == [math.inf]
    for bad in ("", "0", "x", "3:1:1", "1:2:0"):
        with pytest.raises(ArrivalError):
            parse_rates(bad)
