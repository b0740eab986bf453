"""Kendall's tau-b and Pearson's r against scipy, the bootstrap interval of tau against a loop, and Psi by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from normflat.study.stats import granulated_kendall, kendall_tau, kendall_tau_ci, pearson_r


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


# ----- Kendall's tau with a bootstrap confidence interval -----------------------------


def _loop_bootstrap(x, y, resamples, seed, level=0.95):
    """Reference: one kendall_tau per resample, on the draws kendall_tau_ci documents."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    draws = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
    taus = np.array([kendall_tau(x[d], y[d]) for d in draws])
    taus = taus[np.isfinite(taus)]
    return np.quantile(taus, [(1 - level) / 2, (1 + level) / 2])


@pytest.mark.parametrize("ties", [False, True])
def test_kendall_tau_ci_matches_a_loop_over_resamples(ties):
    rng = np.random.default_rng(7)
    x = rng.normal(size=12)
    y = x + rng.normal(size=12)
    if ties:  # few distinct values: many resamples are tied, some have an undefined tau
        x, y = np.round(x), np.round(y)
    tau, lo, hi = kendall_tau_ci(x, y, resamples=300, seed=3, level=0.9)
    assert tau == pytest.approx(stats.kendalltau(x, y).statistic, abs=1e-12)
    np.testing.assert_allclose([lo, hi], _loop_bootstrap(x, y, 300, 3, level=0.9), atol=1e-12)


def test_kendall_tau_ci_contains_tau_is_reproducible_and_narrows():
    rng = np.random.default_rng(0)
    x = rng.normal(size=200)
    y = x + rng.normal(size=200)
    tau, lo, hi = kendall_tau_ci(x[:20], y[:20])
    assert lo <= tau <= hi and -1 <= lo < hi <= 1
    assert kendall_tau_ci(x[:20], y[:20]) == (tau, lo, hi)             # same seed, same interval
    assert kendall_tau_ci(x[:20], y[:20], seed=1)[1:] != (lo, hi)      # another seed, other resamples
    wide = kendall_tau_ci(x[:20], y[:20], level=0.99)
    assert wide[1] <= lo and hi <= wide[2]
    tau2, lo2, hi2 = kendall_tau_ci(x, y, resamples=500)
    assert lo2 <= tau2 <= hi2 and hi2 - lo2 < 0.6 * (hi - lo)         # 10x the points: ~1/sqrt(10) the width


def test_kendall_tau_ci_leaves_the_global_random_state_alone():
    np.random.seed(123)
    state = np.random.get_state()
    kendall_tau_ci([1, 2, 3, 4, 5], [2, 1, 4, 3, 5], resamples=50)
    after = np.random.get_state()
    assert state[0] == after[0] and np.array_equal(state[1], after[1]) and state[2:] == after[2:]


def test_kendall_tau_ci_degenerate_input():
    assert kendall_tau_ci([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 1.0, 1.0)  # every resample concordant
    tau, lo, hi = kendall_tau_ci([1.0, 2.0], [1.0, 2.0])                   # < 3 points: no interval
    assert tau == 1.0 and math.isnan(lo) and math.isnan(hi)
    assert all(math.isnan(v) for v in kendall_tau_ci([1, 1, 1, 1], [1, 2, 3, 4]))
    assert all(math.isnan(v) for v in kendall_tau_ci([1, 2, float("nan")], [1, 2, 3]))
    with pytest.raises(ValueError, match="level"):
        kendall_tau_ci([1, 2, 3], [1, 2, 3], level=1.0)
    with pytest.raises(ValueError, match="resamples"):
        kendall_tau_ci([1, 2, 3], [1, 2, 3], resamples=0)


# ----- The granulated Kendall coefficient Psi (Jiang et al. 2020, eq. 4-5) -------------


def test_psi_on_a_two_axis_grid_by_hand():
    # Axis a: within each b, measure a - b and gap a + b both grow with a: tau_a = 1.
    # Axis b: within each a, the gap grows with b and the measure falls: tau_b = -1.
    grid = [{"a": a, "b": b} for a in (0, 1, 2) for b in (0, 1)]
    grid.append({"a": 3, "b": 0})  # alone in its b-group (a = 3): skipped for axis b
    measure = [h["a"] - h["b"] for h in grid]
    gap = [h["a"] + h["b"] for h in grid]
    out = granulated_kendall(measure, gap, grid)
    assert out == {"psi": 0.0, "per_axis": {"a": 1.0, "b": -1.0}}
    # Psi is not the pooled tau: over all seven models the measure and the gap agree mostly.
    assert kendall_tau(measure, gap) > 0.5


def test_psi_averages_groups_and_holds_the_seed_fixed():
    # Two seeds; within each seed the measure orders the ratios (tau 1 and 1/3), but
    # seed 1 shifts the measure down, so pooled over seeds tau is only 0.30.
    hps = [{"ratio": r, "seed": s} for s in (0, 1) for r in (0.0, 0.5, 1.0)]
    gap = [0.0, 0.5, 1.0, 0.0, 0.5, 1.0]
    measure = [10, 11, 12, 1, 3, 2]
    out = granulated_kendall(measure, gap, hps)
    assert out["per_axis"] == {"ratio": pytest.approx((1.0 + 1 / 3) / 2)}   # no "seed" axis
    assert out["psi"] == pytest.approx(2 / 3)
    assert kendall_tau(measure, gap) == pytest.approx(0.298, abs=1e-3)
    # Treated as a hyperparameter, the seed becomes an axis (groups of one ratio, two seeds).
    as_axis = granulated_kendall(measure, gap, hps, replicates=())
    assert set(as_axis["per_axis"]) == {"ratio", "seed"}
    assert as_axis["per_axis"]["seed"] is None  # the gap is constant within each of those groups


def test_psi_skips_unusable_groups_and_axes():
    hps = [{"a": 0, "b": 0}, {"a": 1, "b": 0}, {"a": 2, "b": 1}]
    out = granulated_kendall([1.0, 2.0, 5.0], [0.1, 0.2, 0.3], hps)
    assert out == {"psi": 1.0, "per_axis": {"a": 1.0, "b": None}}  # every b-group has one model
    none = granulated_kendall([1.0, 2.0], [0.1, 0.2], [{"a": 0, "seed": 0}, {"a": 0, "seed": 1}])
    assert none == {"psi": None, "per_axis": {}}  # no axis takes two values
    constant = granulated_kendall([1.0, 1.0, 1.0], [0.1, 0.2, 0.3], [{"a": 0}, {"a": 1}, {"a": 2}])
    assert constant == {"psi": None, "per_axis": {"a": None}}
    with pytest.raises(ValueError, match="same hyperparameter keys"):
        granulated_kendall([1, 2], [1, 2], [{"a": 0}, {"b": 1}])
    with pytest.raises(ValueError, match="one measure value"):
        granulated_kendall([1, 2], [1, 2], [{"a": 0}])
