"""Bad input to the core is refused with the cause and the valid range, never run silently."""

from __future__ import annotations

import numpy as np
import pytest

import normflat
from normflat.core.measures import analyze_problems, evaluate_layer
from normflat.core.solver import check_solver_options, solve_scaling


def _problem(**kwargs):
    rng = np.random.default_rng(0)
    return normflat.LayerProblem("l", rng.normal(size=(3, 2)), rng.random((3, 2)) + 0.1, **kwargs)


ENTRY_POINTS = {
    "solve_scaling": lambda **kw: solve_scaling(np.ones((2, 3)), np.ones((2, 3)), **kw),
    "normalized_sharpness": lambda **kw: normflat.normalized_sharpness(np.ones((2, 3)), np.ones((2, 3)), **kw),
    "analyze_problems": lambda **kw: analyze_problems([_problem()], **kw),
    "evaluate_layer": lambda **kw: evaluate_layer(_problem(), **kw),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("tol", [-1.0, 0.0, float("nan"), float("inf"), -float("inf")])
def test_tol_out_of_range(entry, tol):
    with pytest.raises(ValueError, match=r"tol must be finite and > 0"):
        ENTRY_POINTS[entry](tol=tol)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("tol", [True, "1e-8", None, [1e-8]])
def test_tol_of_wrong_type(entry, tol):
    with pytest.raises(TypeError, match=r"tol must be a real number"):
        ENTRY_POINTS[entry](tol=tol)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("max_iter", [0, -3])
def test_max_iter_out_of_range(entry, max_iter):
    # max_iter=0 used to end in an UnboundLocalError inside the solver.
    with pytest.raises(ValueError, match=r"max_iter must be an int >= 1"):
        ENTRY_POINTS[entry](max_iter=max_iter)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("max_iter", [2.5, 3.0, True, "10", None])
def test_max_iter_of_wrong_type(entry, max_iter):
    with pytest.raises(TypeError, match=r"max_iter must be an int >= 1"):
        ENTRY_POINTS[entry](max_iter=max_iter)


def test_valid_options_of_numpy_types_and_the_smallest_budget():
    assert check_solver_options(np.float32(1e-6), np.int64(7)) == (pytest.approx(1e-6), 7)
    res = normflat.normalized_sharpness(np.ones((2, 3)), np.ones((2, 3)), tol=1.0, max_iter=1)
    assert res.iterations == 1 and res.converged


def test_solve_scaling_rejects_negative_and_non_finite_entries():
    with pytest.raises(ValueError, match="A has negative entries.*clip negative curvature"):
        solve_scaling(-np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="B contains NaN or infinite"):
        solve_scaling(np.ones((2, 2)), np.array([[1.0, np.inf], [1.0, 1.0]]))


# ----------------------------------------------------------------------------- hessian_diag_samples


def test_samples_whose_mean_is_the_diagonal_are_accepted():
    rng = np.random.default_rng(1)
    samples = rng.normal(size=(4, 3, 2)) * 100.0 + 1.0  # large spread around a small mean
    p = normflat.LayerProblem("l", rng.normal(size=(3, 2)), samples.mean(axis=0), hessian_diag_samples=samples)
    assert p.hessian_diag_samples is samples
    # float32 estimates whose mean was taken in float32 pass with float32 rounding.
    s32 = samples.astype(np.float32)
    normflat.LayerProblem("l", np.ones((3, 2)), s32.mean(axis=0), hessian_diag_samples=s32)
    # All-zero diagonals (e.g. a dead layer) pass, and a difference within 1e-6 of max|diag|.
    normflat.LayerProblem("z", np.ones((3, 2)), np.zeros((3, 2)), hessian_diag_samples=np.zeros((2, 3, 2)))
    diag = samples.mean(axis=0)
    normflat.LayerProblem("l", np.ones((3, 2)), diag + 1e-7 * np.max(np.abs(diag)), hessian_diag_samples=samples)


@pytest.mark.parametrize("case", ["sum", "other_layer", "slightly_off", "transposed_layout"])
def test_samples_whose_mean_is_not_the_diagonal_are_refused(case):
    rng = np.random.default_rng(2)
    samples = rng.random((5, 3, 3)) + 0.5
    diag = samples.mean(axis=0)
    if case == "sum":
        diag = samples.sum(axis=0)
    elif case == "other_layer":
        samples = rng.random((5, 3, 3)) + 0.5
    elif case == "slightly_off":
        diag = diag * (1 + 1e-4)
    else:
        samples = np.swapaxes(samples, 1, 2)
    with pytest.raises(ValueError, match=r"'L': hessian_diag must be the mean over the K=5 estimates"):
        normflat.LayerProblem("L", np.ones((3, 3)), diag, hessian_diag_samples=samples)


def test_a_producer_that_forms_the_mean_may_skip_the_samples_check():
    """check_samples=False (what the engine passes after finalize formed the mean) skips only the
    O(K·size) value checks; the shape is still checked, and the default still refuses."""
    rng = np.random.default_rng(4)
    samples = rng.random((4, 3, 2)) + 0.5
    problem = normflat.LayerProblem("L", np.ones((3, 2)), samples.sum(axis=0), hessian_diag_samples=samples,
                                    check_samples=False)
    assert problem.hessian_diag_samples is samples
    with pytest.raises(ValueError, match="must be the mean"):
        normflat.LayerProblem("L", np.ones((3, 2)), samples.sum(axis=0), hessian_diag_samples=samples)
    with pytest.raises(ValueError, match=r"expected \(K, 3, 2\)"):
        normflat.LayerProblem("L", np.ones((3, 2)), samples.mean(axis=0), hessian_diag_samples=samples[:, :2],
                              check_samples=False)


def test_samples_check_holds_at_the_float64_limits():
    rng = np.random.default_rng(3)
    samples = (rng.random((3, 2, 2)) + 0.5) * 1e308  # a plain mean would overflow
    mean = (samples / 4).mean(axis=0) * 4
    normflat.LayerProblem("l", np.ones((2, 2)), mean, hessian_diag_samples=samples)
    with pytest.raises(ValueError, match="must be the mean"):
        normflat.LayerProblem("l", np.ones((2, 2)), mean * 0.75, hessian_diag_samples=samples)
    tiny = (rng.random((3, 2, 2)) + 0.5) * 1e-300
    with pytest.raises(ValueError, match="must be the mean"):
        normflat.LayerProblem("l", np.ones((2, 2)), tiny.mean(axis=0) * 2, hessian_diag_samples=tiny)
