"""The SLO search finds the highest rate that holds by bisection, and says where it could not."""

from __future__ import annotations

import math

import pytest

from bench.rate_search import highest_rate


def test_bisection_brackets_the_threshold_within_the_tolerance() -> None:
    threshold = 137.0
    result = highest_rate(lambda rate: rate <= threshold, 10.0, 400.0, tolerance=0.05)
    assert result.bounded and result.held <= threshold < result.failed
    assert result.failed / result.held <= 1.05 * 1.01  # within the tolerance (rates kept to 3 digits)
    rates = [rate for rate, _ in result.probes]
    assert rates[:2] == [10.0, 400.0] and len(set(rates)) == len(rates)  # the bounds first, no rate twice
    assert all(held == (rate <= threshold) for rate, held in result.probes)
    assert len(rates) <= 2 + math.ceil(math.log2(math.log(40) / math.log(1.05)))


def test_a_low_bound_that_misses_or_a_high_bound_that_holds_ends_the_search() -> None:
    low_fails = highest_rate(lambda rate: rate <= 5.0, 10.0, 400.0)
    assert (low_fails.held, low_fails.failed, low_fails.probes) == (None, 10.0, [(10.0, False)])
    high_holds = highest_rate(lambda rate: True, 10.0, 400.0)
    assert (high_holds.held, high_holds.failed) == (400.0, None) and not high_holds.bounded


def test_bounds_must_be_ordered_and_positive() -> None:
    for low, high in ((0.0, 10.0), (20.0, 10.0)):
        with pytest.raises(ValueError):
            highest_rate(lambda rate: True, low, high)
