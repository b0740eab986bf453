"""Kendall's tau-b and Pearson's r against scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from normflat.study.stats import kendall_tau, pearson_r


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ties", [False, True])
def test_kendall_tau_matches_scipy(seed, ties):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 40))
    x = rng.normal(size=n)
    y = 0.5 * x + rng.normal(size=n)
    if ties:  # ties in both variables exercise the tau-b correction
        x, y = np.round(x), np.round(y * 2) / 2
    expected = stats.kendalltau(x, y).statistic  # tau-b by default
    assert kendall_tau(x, y) == pytest.approx(expected, abs=1e-12)
    assert pearson_r(x, y) == pytest.approx(stats.pearsonr(x, y).statistic, abs=1e-12)


def test_perfect_orders_and_degenerate_input():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    assert math.isnan(kendall_tau([1.0], [2.0]))
    assert math.isnan(kendall_tau([1.0, float("nan")], [1.0, 2.0]))
    assert math.isnan(pearson_r([2, 2, 2], [1, 2, 3]))
    with pytest.raises(ValueError, match="equal length"):
        kendall_tau([1, 2], [1, 2, 3])
