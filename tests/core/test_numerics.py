"""Any finite float64 input gives the right value: extreme and mixed magnitudes (method §5).

Every test here turns all warnings into errors: an overflow that numpy only
warns about is exactly the silent wrong number these tests exist to catch.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import normflat
from normflat.core.measures import curvature_and_weight_matrices
from normflat.core.solver import solve_scaling
from tests.builders import require_frameworks
from tests.core.reference import brute_force_ns, kernel_sums, log_domain_ns


@pytest.fixture(autouse=True)
def _all_warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def layer(seed, shape=(5, 4, 3)):
    rng = np.random.default_rng(seed)
    return rng.normal(size=shape), rng.random(shape) + 0.05


def safe_log(x):
    x = np.asarray(x, float)
    return np.where(x > 0, np.log(np.where(x > 0, x, 1.0)), -np.inf)


def test_log_domain_reference_agrees_with_brute_force():
    # The reference used below is itself checked where both can run.
    W, H = layer(0)
    A, B = kernel_sums(W, H)
    assert math.exp(log_domain_ns(safe_log(A), safe_log(B))) == pytest.approx(brute_force_ns(A, B), rel=1e-10)


@pytest.mark.parametrize("w_factor, h_factor", [
    (1e200, 1.0), (1e-200, 1.0), (1.0, 1e200), (1.0, 1e-200),
    (1e200, 1e-200), (1e-200, 1e200), (1e200, 1e200), (1e-200, 1e-200), (1e150, 1e-300),
])
def test_uniform_scaling_by_1e200_scales_every_measure_as_predicted(w_factor, h_factor):
    # W -> cW, H -> dH: NS, the matrix-normalized sharpness and the element-wise bound are
    # all sqrt(Σ-weighted curvature) times |weights|, hence scale by c·sqrt(d); the trace by d.
    W, H = layer(1)
    A, B = kernel_sums(W, H)
    reference = brute_force_ns(A, B)  # scipy, on the unscaled problem
    base = normflat.normalized_sharpness(W, H)
    moved = normflat.normalized_sharpness(W * w_factor, H * h_factor)
    factor = w_factor * math.sqrt(h_factor)
    assert moved.value == pytest.approx(factor * reference, rel=1e-8)
    assert moved.value == pytest.approx(factor * base.value, rel=1e-12)
    assert moved.matrix_normalized_sharpness == pytest.approx(factor * base.matrix_normalized_sharpness, rel=1e-13)
    assert moved.elementwise_bound == pytest.approx(factor * base.elementwise_bound, rel=1e-13)
    assert moved.hessian_trace == pytest.approx(h_factor * base.hessian_trace, rel=1e-13)
    assert moved.converged and moved.degenerate_rows == () and moved.degenerate_cols == ()
    assert moved.elementwise_bound <= moved.value <= moved.matrix_normalized_sharpness


@pytest.mark.parametrize("a_factor, b_factor", [(1e300, 1.0), (1.0, 1e-300), (1e300, 1e-300), (1e-300, 1e-300)])
def test_solve_scaling_homogeneity_at_the_float64_limits(a_factor, b_factor):
    rng = np.random.default_rng(2)
    A, B = rng.random((4, 6)) + 0.1, rng.random((4, 6)) + 0.1
    reference = brute_force_ns(A, B)
    sol = solve_scaling(A * a_factor, B * b_factor)
    assert sol.value == pytest.approx(math.sqrt(a_factor) * math.sqrt(b_factor) * reference, rel=1e-9)
    # The row log-sigmas carry the scale: a shifts by ½ log(b_factor / a_factor).
    base = solve_scaling(A, B)
    np.testing.assert_allclose(sol.log_row_sigma - base.log_row_sigma,
                               0.5 * (math.log(b_factor) - math.log(a_factor)), rtol=0, atol=1e-8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_function_preserving_mixed_magnitudes_leave_the_value_unchanged(seed):
    # W -> D_out W D_in with factors spread over 1e±100 and 1e±50: the squared weights
    # span far more than float64 holds, yet NS is invariant (method §4).
    rng = np.random.default_rng(seed)
    W, H = layer(seed + 10)
    d_out = 10.0 ** rng.uniform(-100, 100, size=W.shape[0])
    d_in = 10.0 ** rng.uniform(-50, 50, size=W.shape[1])
    scale = (d_out[:, None] * d_in[None, :])[:, :, None]
    base = normflat.normalized_sharpness(W, H)
    moved = normflat.normalized_sharpness(W * scale, H / scale**2)
    assert moved.value == pytest.approx(base.value, rel=1e-11)
    assert moved.elementwise_bound == pytest.approx(base.elementwise_bound, rel=1e-11)
    assert moved.converged
    # The optimal log-variances move by exactly 2 log(d_i e_j), like W² (they may leave the
    # float64 range as variances, so compare the solver's logs).
    v_base = np.log(base.row_sigma)[:, None] + np.log(base.col_sigma)[None, :]
    A, B = kernel_sums(W, H)
    sol = solve_scaling(A / scale[:, :, 0] ** 2, B * scale[:, :, 0] ** 2)
    v_sol = sol.log_row_sigma[:, None] + sol.log_col_sigma[None, :]
    np.testing.assert_allclose(v_sol, v_base + 2 * np.log(scale[:, :, 0]), rtol=0, atol=1e-8)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_mixed_magnitude_rows_and_columns_against_log_domain_scipy(seed):
    # Rows of A and columns of B scaled independently by up to 1e±300: no symmetry
    # predicts the value, so compare with the log-domain scipy reference.
    rng = np.random.default_rng(seed)
    A0, B0 = rng.random((5, 4)) + 0.01, rng.random((5, 4)) + 0.01
    row = 10.0 ** rng.uniform(-300, 300, size=(5, 1))
    col = 10.0 ** rng.uniform(-300, 300, size=(1, 4))
    A, B = A0 * row, B0 * col
    sol = solve_scaling(A, B)
    assert sol.converged and math.isfinite(sol.value) and sol.value > 0
    assert math.log(sol.value) == pytest.approx(log_domain_ns(safe_log(A), safe_log(B)), abs=1e-9)
    # Optimality in log space: every row and column balanced to tol.
    s = sol.log_row_sigma[:, None] + sol.log_col_sigma[None, :]
    from scipy.special import logsumexp

    for axis in (0, 1):
        p, q = logsumexp(safe_log(A) + s, axis=axis), logsumexp(safe_log(B) - s, axis=axis)
        assert np.max(np.tanh(np.abs(p - q) / 2)) < 1e-9


def test_weights_spanning_1e400_against_log_domain_scipy():
    # |W| from 1e-200 to 1e200 by row: W² (1e-400 .. 1e400) fits no float64, so the
    # squared weights are formed in logs; the reference gets log B = 2 log|W| exactly.
    rng = np.random.default_rng(4)
    W0, H = rng.normal(size=(6, 5)), rng.random((6, 5)) + 0.05
    row = 10.0 ** np.linspace(-200, 200, 6)[:, None]
    W = W0 * row
    res = normflat.normalized_sharpness(W, H)
    log_b = 2 * (np.log(np.abs(W0)) + np.log(row))
    assert math.log(res.value) == pytest.approx(log_domain_ns(np.log(H), log_b), abs=1e-9)
    assert res.converged and res.degenerate_rows == ()
    # The element-wise bound, Σ sqrt(H)|W|, and the matrix measure, from the same logs.
    assert res.elementwise_bound == pytest.approx(np.sum(np.sqrt(H) * np.abs(W)), rel=1e-12)
    assert res.matrix_normalized_sharpness == pytest.approx(
        math.sqrt(H.sum()) * math.sqrt(np.sum((W0 / 1e200 * row) ** 2)) * 1e200, rel=1e-12)


def test_kernel_sums_beyond_float64():
    # Curvature entries of 1e308 whose kernel sums are finite but overflow in a plain
    # float64 sum (the first two terms already do): NS(W, cH) = sqrt(c) NS(W, H) holds.
    rng = np.random.default_rng(5)
    W = rng.normal(size=(2, 2, 4))
    pair_sums = np.array([[0.5, 0.8], [-0.6, 0.1]])  # one negative pair: clipped
    one = np.ones((2, 2))
    H = 10.0 * np.stack([one, one, -one, pair_sums - 1.0], axis=2)
    c = 1e307
    base = normflat.normalized_sharpness(W, H)
    moved = normflat.normalized_sharpness(W, H * c)
    assert moved.value == pytest.approx(math.sqrt(c) * base.value, rel=1e-12)
    assert moved.matrix_normalized_sharpness == pytest.approx(
        math.sqrt(c) * base.matrix_normalized_sharpness, rel=1e-12)
    assert moved.hessian_trace == pytest.approx(c * base.hessian_trace, rel=1e-12)
    assert moved.clipped == base.clipped == 1


def test_degenerate_rows_are_found_in_the_log_path():
    W, H = layer(6, shape=(5, 4))
    W = W * (10.0 ** np.array([-200, -100, 0, 100, 200]))[:, None]
    H[1] = 0.0  # dead unit
    W[:, 2] = 0.0  # pruned input
    res = normflat.normalized_sharpness(W, H)
    assert res.degenerate_rows == (1,) and res.degenerate_cols == (2,)
    assert res.row_sigma[1] == np.inf and res.col_sigma[2] == 0.0
    keep_r, keep_c = [0, 2, 3, 4], [0, 1, 3]
    log_b = 2 * safe_log(np.abs(W[np.ix_(keep_r, keep_c)]))
    assert math.log(res.value) == pytest.approx(log_domain_ns(safe_log(H[np.ix_(keep_r, keep_c)]), log_b), abs=1e-9)


def test_grouped_convolution_in_the_log_path_is_the_sum_of_its_blocks():
    W, H = layer(7, shape=(4, 2, 3))
    W = W * (10.0 ** np.array([-180.0, 0.0, 90.0, 180.0]))[:, None, None]
    res = normflat.normalized_sharpness(W, H, groups=2)
    blocks = [normflat.normalized_sharpness(W[2 * g : 2 * g + 2], H[2 * g : 2 * g + 2]) for g in range(2)]
    assert res.value == pytest.approx(sum(b.value for b in blocks), rel=1e-12)


def test_value_beyond_float64_is_refused_with_the_layer_name():
    W, H = np.full((3, 3), 1e200), np.full((3, 3), 1e300)  # NS about 1e350
    with pytest.raises(OverflowError, match=r"Layer 'huge'.*float64 range.*Divide the loss"):
        normflat.normalized_sharpness(W, H, name="huge")


def test_plain_matrices_beyond_float64_are_refused():
    W, H = np.full((2, 2), 1e200), np.ones((2, 2))
    with pytest.raises(OverflowError, match="B \\(squared weights\\) exceeds the float64 range"):
        curvature_and_weight_matrices(W, H)
    A, B, *_ = curvature_and_weight_matrices(W * 1e-100, H)
    np.testing.assert_allclose(B, np.full((2, 2), 1e200), rtol=1e-15)


def test_standard_errors_scale_with_the_layer():
    # With K group estimates the standard errors are linear in the estimates: scaling W by
    # c and every estimate by d scales each measure's error by c·sqrt(d) (trace: d).
    rng = np.random.default_rng(8)
    W = rng.normal(size=(4, 3, 2))
    samples = rng.random((5, 4, 3, 2)) + 0.1
    H = samples.mean(axis=0)
    base = normflat.analyze([normflat.LayerProblem("l", W, H, hessian_diag_samples=samples)])
    c, d = 1e150, 1e-250
    moved = normflat.analyze([normflat.LayerProblem("l", W * c, H * d, hessian_diag_samples=samples * d)])
    for m in normflat.MEASURES:
        expected = base.standard_error[m] * (d if m == "hessian_trace" else c * math.sqrt(d))
        assert base.standard_error[m] > 0
        assert moved.standard_error[m] == pytest.approx(expected, rel=1e-8), m
        assert moved.layers[0].standard_error[m] == pytest.approx(expected, rel=1e-8), m


def test_standard_errors_survive_an_extreme_function_preserving_rescaling():
    # Row 0's weights times 1e158 and its curvature (and every estimate of it) times
    # 1e-316: NS and its linearization are invariant, though the optimal variance of
    # that row (about 1e311) overflows float64.
    rng = np.random.default_rng(10)
    W = rng.normal(size=(3, 4))
    samples = rng.random((6, 3, 4)) * 1e10 + 1e9
    base = normflat.analyze([normflat.LayerProblem("l", W, samples.mean(axis=0), hessian_diag_samples=samples)])
    row = np.array([1e158, 1.0, 1.0])[:, None]
    moved_samples = samples / row / row
    moved = normflat.analyze([normflat.LayerProblem("l", W * row, moved_samples.mean(axis=0),
                                                    hessian_diag_samples=moved_samples)])
    assert moved.normalized_sharpness == pytest.approx(base.normalized_sharpness, rel=1e-11)
    for m in ("normalized_sharpness", "elementwise_bound"):
        assert moved.standard_error[m] == pytest.approx(base.standard_error[m], rel=1e-8), m


def test_mixed_magnitudes_with_array_api_strict():
    require_frameworks("array_api_strict")
    import array_api_strict as xps

    W, H = layer(9, shape=(4, 3, 2))
    W = W * (10.0 ** np.array([-200.0, -50.0, 60.0, 200.0]))[:, None, None]
    ref = normflat.normalized_sharpness(W, H)
    res = normflat.normalized_sharpness(xps.asarray(W), xps.asarray(H))
    assert res.value == pytest.approx(ref.value, rel=1e-12)
    A = xps.asarray(np.array([[1e300, 1.0], [1.0, 1e-300]]))
    B = xps.asarray(np.array([[1.0, 1e-300], [1e300, 1.0]]))
    assert solve_scaling(A, B).value == pytest.approx(
        math.exp(log_domain_ns(safe_log(np.asarray(A)), safe_log(np.asarray(B)))), rel=1e-9)


@pytest.mark.parametrize("scale", [1.0, 1e-250, 1e300])
def test_kernel_summed_samples_give_the_standard_errors_of_the_full_samples(scale):
    """Samples ``(K, out, in, 1, 1)``, the kernel sums of ``(K, out, in, kh, kw)`` ones (what the
    engine keeps of a convolution, method §6.2): every measure's standard error and group value
    is that of the full samples, also where the kernel sums are formed in units of 2^e."""
    rng = np.random.default_rng(11)
    W = rng.normal(size=(4, 3, 2, 2))
    samples = (rng.random((5, 4, 3, 2, 2)) + 0.1) * scale
    H = samples.mean(axis=0)
    full = normflat.analyze([normflat.LayerProblem("c", W, H, hessian_diag_samples=samples, groups=1)])
    summed_samples = samples.sum(axis=(3, 4), keepdims=True)
    summed = normflat.analyze([normflat.LayerProblem("c", W, H, hessian_diag_samples=summed_samples)])
    assert summed.normalized_sharpness == full.normalized_sharpness
    for m in normflat.MEASURES:
        assert full.standard_error[m] > 0
        assert summed.standard_error[m] == pytest.approx(full.standard_error[m], rel=1e-12), m
        np.testing.assert_allclose(summed.layers[0]._group_values[m], full.layers[0]._group_values[m], rtol=1e-12)


def test_float32_convolution_kernel_sums_are_formed_in_float64_blocks(monkeypatch):
    """A float32 layer with kernel axes is summed in float64 a block of rows at a time: the same
    measures as from a float64 copy, with blocks smaller than the layer."""
    from normflat.core import measures

    rng = np.random.default_rng(12)
    W = rng.normal(size=(7, 3, 3, 3)).astype(np.float32)
    H = (rng.random((7, 3, 3, 3)) - 0.45).astype(np.float32)  # some kernel sums clipped
    ref = normflat.normalized_sharpness(W.astype(np.float64), H.astype(np.float64))
    monkeypatch.setattr(measures, "_BLOCK_ENTRIES", 20)  # two rows of 9 entries per block
    got = normflat.normalized_sharpness(W, H)
    assert got.value == pytest.approx(ref.value, rel=1e-13)
    assert got.hessian_trace == pytest.approx(ref.hessian_trace, rel=1e-13)
    assert got.clipped == ref.clipped > 0
