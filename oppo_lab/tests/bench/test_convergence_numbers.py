"""`bench convergence`'s numbers (`oppo_lab.convergence.numbers`), computed by hand."""

from __future__ import annotations

import pytest

from oppo_lab import convergence
from oppo_lab.convergence.numbers import permutation_p


def test_ks_distance_is_the_largest_gap_between_empirical_cdfs():
    # at 3: 4/4 of the first are <= 3, 2/4 of the second
    assert convergence.ks_distance([2, 2, 2, 3], [2, 2, 5, 5]) == 0.5
    assert convergence.ks_distance([1, 2, 3], [3, 2, 1]) == 0.0
    assert convergence.ks_distance([1, 2], [7, 8, 9]) == 1.0
    assert convergence.ks_distance([], [1]) is None


def test_moving_average_needs_a_full_window():
    assert convergence.moving_average([0.0, 0.3, 0.6, 0.9], 3) == [None, None, pytest.approx(0.3), pytest.approx(0.6)]
    assert convergence.moving_average([0.0, None, 0.6, 0.9, 0.3], 3) == [None, None, None, None, pytest.approx(0.6)]


def test_permutation_p_counts_the_splits_as_extreme_as_the_observed_one():
    # 20 splits of 6 values into 3 + 3; only {1,2,3} | {4,5,6} and its mirror are 3 apart
    assert permutation_p([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)
    # the 20 splits of 1..6 into 3 + 3 have gaps of means 3 (2 splits), 7/3 (2), 5/3 (4), 1 (6), 1/3 (6)
    assert permutation_p([1, 2, 4], [3, 5, 6]) == pytest.approx(4 / 20)  # observed 7/3
    assert permutation_p([1, 3, 5], [2, 4, 6]) == pytest.approx(14 / 20)  # observed 1
    assert permutation_p([0.5, 0.5], [0.5, 0.5]) == 1.0
    assert permutation_p([1.0], [1.0, 2.0]) is None


def test_permutation_p_samples_splits_past_the_limit_with_a_seed():
    a, b = [float(v) for v in range(10)], [float(v) + 5 for v in range(10)]  # C(20, 10) = 184,756 splits
    p = permutation_p(a, b, limit=2_000)
    assert p == permutation_p(a, b, limit=2_000) and 0 < p < 0.01
