"""The per-layer solver against brute force, invariances, degenerate and extreme inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import normflat
from normflat.core.solver import solve_scaling
from tests.core.reference import brute_force_ns, kernel_sums


def random_layer(rng, shape, spread=1.0):
    W = rng.normal(size=shape) * np.exp(spread * rng.normal(size=shape))
    H = np.exp(spread * rng.normal(size=shape)) * rng.random(size=shape)
    return W, H


@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (1, 4), (4, 3), (7, 5), (3, 2, 2, 2), (4, 3, 3), (2, 3, 1, 3, 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_matches_scipy(shape, seed):
    rng = np.random.default_rng(seed)
    W, H = random_layer(rng, shape, spread=1.5)
    result = normflat.normalized_sharpness(W, H)
    A, B = kernel_sums(W, H)
    assert result.value == pytest.approx(brute_force_ns(A, B), rel=1e-8)
    assert result.converged and result.imbalance <= 1e-10


def test_optimal_point_balances_rows_and_columns():
    rng = np.random.default_rng(3)
    W, H = random_layer(rng, (6, 5, 3))
    res = normflat.normalized_sharpness(W, H)
    A, B = kernel_sums(W, H)
    v = np.outer(res.row_sigma, res.col_sigma)
    P, Q = A * v, B / v
    np.testing.assert_allclose(P.sum(axis=1), Q.sum(axis=1), rtol=1e-9)
    np.testing.assert_allclose(P.sum(axis=0), Q.sum(axis=0), rtol=1e-9)
    assert 0.5 * (P.sum() + Q.sum()) == pytest.approx(res.value, rel=1e-12)
    # Gauge: geometric mean of the column sigmas is 1.
    assert np.mean(np.log(res.col_sigma)) == pytest.approx(0.0, abs=1e-12)


def test_single_sigma_closed_form_and_sandwich():
    rng = np.random.default_rng(4)
    W, H = random_layer(rng, (5, 4, 2, 2))
    res = normflat.normalized_sharpness(W, H)
    A, B = kernel_sums(W, H)
    assert res.matrix_normalized_sharpness == pytest.approx(math.sqrt(A.sum() * B.sum()), rel=1e-13)
    # The single-sigma minimum equals the closed form: brute-force it in 1-D.
    sigmas = np.exp(np.linspace(-10, 10, 200001))
    assert np.min(0.5 * (sigmas * A.sum() + B.sum() / sigmas)) == pytest.approx(
        res.matrix_normalized_sharpness, rel=1e-8)
    assert res.elementwise_bound == pytest.approx(np.sqrt(A * B).sum(), rel=1e-13)
    assert res.elementwise_bound <= res.normalized_sharpness <= res.matrix_normalized_sharpness
    assert res.hessian_trace == pytest.approx(H.sum(), rel=1e-13)


def test_rank_one_problem_reaches_elementwise_bound():
    # If sqrt(B/A) is a rank-one product, the per-entry optimum is feasible.
    rng = np.random.default_rng(5)
    u, v = np.exp(rng.normal(size=4)), np.exp(rng.normal(size=3))
    A = np.exp(rng.normal(size=(4, 3)))
    B = A * np.outer(u, v) ** 2
    res = normflat.normalized_sharpness(np.sqrt(B), A)
    assert res.value == pytest.approx(np.sqrt(A * B).sum(), rel=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    out=st.integers(1, 6),
    inp=st.integers(1, 6),
    kernel=st.sampled_from([(), (2,), (3, 2)]),
)
def test_row_and_column_rescaling_invariance(seed, out, inp, kernel):
    rng = np.random.default_rng(seed)
    shape = (out, inp, *kernel)
    W, H = random_layer(rng, shape)
    d_out = np.exp(rng.uniform(-10, 10, size=out))
    d_in = np.exp(rng.uniform(-10, 10, size=inp))
    scale = (d_out[:, None] * d_in[None, :]).reshape((out, inp) + (1,) * len(kernel))
    # W -> D_out W D_in makes the loss Hessian diagonal scale by 1/(d_i d_j)^2.
    base = normflat.normalized_sharpness(W, H)
    moved = normflat.normalized_sharpness(W * scale, H / scale**2)
    assert moved.value == pytest.approx(base.value, rel=1e-9)
    assert moved.elementwise_bound == pytest.approx(base.elementwise_bound, rel=1e-9)


def test_layerwise_scaling_leaves_matrix_measure_and_changes_trace():
    rng = np.random.default_rng(6)
    W, H = random_layer(rng, (5, 4))
    base = normflat.normalized_sharpness(W, H)
    moved = normflat.normalized_sharpness(W * 1e3, H * 1e-6)
    assert moved.matrix_normalized_sharpness == pytest.approx(base.matrix_normalized_sharpness, rel=1e-12)
    assert moved.hessian_trace == pytest.approx(base.hessian_trace * 1e-6, rel=1e-12)


# ----------------------------------------------------------------------------- degenerate inputs


def test_dead_unit_row_with_zero_curvature():
    rng = np.random.default_rng(7)
    W, H = random_layer(rng, (5, 4))
    H[2] = 0.0  # dead ReLU unit: no curvature
    res = normflat.normalized_sharpness(W, H)
    A, B = kernel_sums(W, H)
    keep = [0, 1, 3, 4]
    assert res.value == pytest.approx(brute_force_ns(A[keep], B[keep]), rel=1e-8)
    assert res.degenerate_rows == (2,) and res.degenerate_cols == ()
    assert res.row_sigma[2] == np.inf
    assert np.all(np.isfinite(res.col_sigma))


def test_pruned_column_with_zero_weights():
    rng = np.random.default_rng(8)
    W, H = random_layer(rng, (4, 5, 2))
    W[:, 1] = 0.0
    res = normflat.normalized_sharpness(W, H)
    A, B = kernel_sums(W, H)
    keep = [0, 2, 3, 4]
    assert res.value == pytest.approx(brute_force_ns(A[:, keep], B[:, keep]), rel=1e-8)
    assert res.degenerate_cols == (1,) and res.col_sigma[1] == 0.0


def test_cascading_degeneracy():
    # Removing row 0 (zero weights) leaves column 0 with curvature only in row 0.
    A = np.array([[1.0, 2.0, 0.5], [0.0, 1.0, 3.0], [0.0, 2.0, 1.0]])
    B = np.array([[0.0, 0.0, 0.0], [1.0, 2.0, 1.0], [4.0, 1.0, 2.0]])
    res = normflat.normalized_sharpness(np.sqrt(B), A)
    assert res.degenerate_rows == (0,) and res.degenerate_cols == (0,)
    assert res.value == pytest.approx(brute_force_ns(A[1:, 1:], B[1:, 1:]), rel=1e-8)
    # The value is the infimum: approach it with explicit finite scalings.
    t = 30.0
    a = np.array([-2 * t, 0.0, 0.0]); b = np.array([t, 0.0, 0.0])  # a_0 + b_0 -> -inf too
    sub = normflat.normalized_sharpness(np.sqrt(B[1:, 1:]), A[1:, 1:])
    a[1:] = np.log(sub.row_sigma); b[1:] = np.log(sub.col_sigma)
    s = a[:, None] + b[None, :]
    approx = 0.5 * (A * np.exp(s) + B * np.exp(-s)).sum()
    assert approx == pytest.approx(res.value, rel=1e-8)


@pytest.mark.parametrize("case", ["zero_weights", "zero_curvature", "both_zero"])
def test_all_zero_layer_gives_zero(case):
    W = np.zeros((3, 4)) if case != "zero_curvature" else np.ones((3, 4))
    H = np.zeros((3, 4)) if case != "zero_weights" else np.ones((3, 4))
    res = normflat.normalized_sharpness(W, H)
    assert res.value == 0.0 and res.matrix_normalized_sharpness == 0.0
    assert len(res.degenerate_rows) == 3
    assert not np.any(np.isnan(res.row_sigma)) and not np.any(np.isnan(res.col_sigma))


def test_sparse_entries_inside_regular_rows():
    rng = np.random.default_rng(9)
    W, H = random_layer(rng, (6, 6))
    mask = rng.random((6, 6)) < 0.3
    np.fill_diagonal(mask, False)  # keep a positive diagonal in both: minimum attained
    W[mask] = 0.0
    H[mask.T] = 0.0
    res = normflat.normalized_sharpness(W, H)
    A, B = kernel_sums(W, H)
    assert res.value == pytest.approx(brute_force_ns(A, B), rel=1e-8)


@pytest.mark.parametrize("seed", [0, 1])
def test_extreme_magnitudes(seed):
    rng = np.random.default_rng(seed)
    shape = (5, 4, 3)
    W = rng.choice([-1, 1], size=shape) * 10.0 ** rng.uniform(-15, 15, size=shape)  # W² spans 1e-30..1e30
    H = 10.0 ** rng.uniform(-30, 30, size=shape)
    res = normflat.normalized_sharpness(W, H)
    A, B = kernel_sums(W, H)
    assert math.isfinite(res.value) and res.converged
    # Scaled reference: NS(sA·A', sB·B') = sqrt(sA sB) NS(A', B').
    sa, sb = A.max(), B.max()
    assert res.value == pytest.approx(math.sqrt(sa * sb) * brute_force_ns(A / sa, B / sb), rel=1e-8)


def test_uniform_huge_and_tiny_scales():
    rng = np.random.default_rng(10)
    W, H = random_layer(rng, (4, 4))
    base = normflat.normalized_sharpness(W, H).value
    for factor in (1e-150, 1e150):
        assert normflat.normalized_sharpness(W * factor, H).value == pytest.approx(base * factor, rel=1e-10)


def test_negative_curvature_clipped_after_kernel_sum():
    W = np.ones((2, 2, 2))
    H = np.array([[[3.0, -1.0], [-2.0, 1.0]], [[-1.0, -1.0], [2.0, 2.0]]])
    res = normflat.normalized_sharpness(W, H)
    # kernel sums: [[2, -1], [-2, 4]] -> two clipped entries
    assert res.clipped == 2
    assert res.hessian_trace == pytest.approx(H.sum())
    A, B = kernel_sums(W, H)
    assert res.elementwise_bound == pytest.approx(np.sqrt(A * B).sum())


def test_max_iter_reports_not_converged():
    rng = np.random.default_rng(11)
    W, H = random_layer(rng, (20, 20), spread=3)
    res = normflat.normalized_sharpness(W, H, max_iter=1)
    assert not res.converged and res.iterations == 1
    full = normflat.normalized_sharpness(W, H)
    assert res.value >= full.value


def test_solve_scaling_on_matrices():
    rng = np.random.default_rng(12)
    A, B = np.exp(rng.normal(size=(3, 4))), np.exp(rng.normal(size=(3, 4)))
    sol = solve_scaling(A, B)
    assert sol.value == pytest.approx(brute_force_ns(A, B), rel=1e-8)
    with pytest.raises(ValueError, match="one shape"):
        solve_scaling(A, B.T)


def test_grouped_convolution_is_the_sum_of_its_blocks():
    rng = np.random.default_rng(13)
    groups, out, cin = 3, 6, 2
    W, H = random_layer(rng, (out, cin, 3, 3))
    res = normflat.normalized_sharpness(W, H, groups=groups)
    blocks = [normflat.normalized_sharpness(W[2 * g : 2 * g + 2], H[2 * g : 2 * g + 2]) for g in range(groups)]
    assert res.value == pytest.approx(sum(b.value for b in blocks), rel=1e-12)
    assert res.col_sigma.shape == (groups * cin,)
    # Equivalent dense problem: the block-diagonal (out, in) weight with zeros
    # elsewhere; zero blocks have no weight and no curvature.
    W_full = np.zeros((out, groups * cin, 3, 3))
    H_full = np.zeros_like(W_full)
    for g in range(groups):
        W_full[2 * g : 2 * g + 2, g * cin : (g + 1) * cin] = W[2 * g : 2 * g + 2]
        H_full[2 * g : 2 * g + 2, g * cin : (g + 1) * cin] = H[2 * g : 2 * g + 2]
    A, B = kernel_sums(W_full, H_full)
    # Per-input-channel scaling of the real (block-diagonal) weight leaves NS unchanged.
    d_in = np.exp(rng.uniform(-5, 5, size=groups * cin))
    compact_scale = d_in.reshape(groups, 1, cin).repeat(2, axis=0).reshape(out, cin)[:, :, None, None]
    moved = normflat.normalized_sharpness(W * compact_scale, H / compact_scale**2, groups=groups)
    assert moved.value == pytest.approx(res.value, rel=1e-9)
    assert res.sigma.shape == (out, cin)
    v = np.outer(res.row_sigma, res.col_sigma)
    full = 0.5 * (A * v + B / np.where(v > 0, v, 1)).sum()
    assert full == pytest.approx(res.value, rel=1e-9)


@pytest.mark.parametrize("multiplier", [1, 2])
@pytest.mark.parametrize("case", ["regular", "dead_rows", "zero_weights", "extreme"])
def test_depthwise_convolution_solved_at_once_equals_its_blocks(multiplier, case):
    """One input channel per group (a depthwise convolution, channel multiplier 1 or 2) is solved as
    one problem: the same value, row and column sigmas and degenerate rows and columns as each
    block solved on its own (method §5)."""
    rng = np.random.default_rng(21)
    groups = 7
    W, H = random_layer(rng, (groups * multiplier, 1, 3, 3), spread=3.0 if case == "extreme" else 1.0)
    if case == "dead_rows":
        H[[0, 3]] = 0.0  # a whole group dead with multiplier 1; one of two rows with 2
        H[5 * multiplier:6 * multiplier] = 0.0  # a whole group dead in both
    if case == "zero_weights":
        W[2 * multiplier:3 * multiplier] = 0.0  # a pruned group: curvature only
        W[4] = 0.0
    res = normflat.normalized_sharpness(W, H, groups=groups)
    blocks = [normflat.normalized_sharpness(W[g * multiplier:(g + 1) * multiplier],
                                            H[g * multiplier:(g + 1) * multiplier]) for g in range(groups)]
    assert res.value == pytest.approx(math.fsum(b.value for b in blocks), rel=1e-12)
    np.testing.assert_allclose(res.row_sigma, np.concatenate([b.row_sigma for b in blocks]), rtol=1e-9)
    np.testing.assert_allclose(res.col_sigma, np.concatenate([b.col_sigma for b in blocks]), rtol=1e-9)
    assert res.degenerate_rows == tuple(g * multiplier + i for g, b in enumerate(blocks) for i in b.degenerate_rows)
    assert res.degenerate_cols == tuple(g for g, b in enumerate(blocks) if b.degenerate_cols)
    assert res.converged


def test_groups_must_divide_out_channels():
    with pytest.raises(ValueError, match="5 output channels cannot be split into 2 groups"):
        normflat.LayerProblem("g", np.ones((5, 1, 3)), np.ones((5, 1, 3)), groups=2)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 5), n=st.integers(1, 5), density=st.floats(0.2, 0.8))
def test_sparse_patterns_with_unattained_infimum(seed, m, n, density):
    """Random sparsity makes the infimum unattained in many patterns beyond dead
    rows/columns; the solver must still converge to the exact infimum."""
    from tests.core.reference import full_objective, recession_reference

    rng = np.random.default_rng(seed)
    A = rng.random((m, n)) * (rng.random((m, n)) < density)
    B = rng.random((m, n)) * (rng.random((m, n)) < density)
    sol = solve_scaling(A, B)
    assert sol.converged and math.isfinite(sol.value)
    ref_value, x, d = recession_reference(A, B)
    assert sol.value == pytest.approx(ref_value, rel=1e-8, abs=1e-12)
    # The infimum is approached along the recession direction.
    assert full_objective(A, B, x + 40.0 * d) == pytest.approx(sol.value, rel=1e-8, abs=1e-12)
    assert sol.value >= np.sqrt(A * B).sum() - 1e-12


def test_known_unattained_pattern():
    # No all-zero row or column, yet the infimum is not attained: the terms
    # B[1, 1] and B[2, 0] vanish along a recession direction.
    from tests.core.reference import full_objective, recession_reference

    A = np.array([[0.26, 0.0], [0.29, 0.0], [0.0, 0.0], [0.0, 0.53]])
    B = np.array([[0.79, 0.0], [0.42, 0.03], [0.17, 0.75], [0.0, 0.31]])
    sol = solve_scaling(A, B)
    ref_value, x, d = recession_reference(A, B)
    assert sol.converged and sol.iterations < 100
    assert sol.value == pytest.approx(ref_value, rel=1e-9)
    assert full_objective(A, B, x + 40 * d) == pytest.approx(sol.value, rel=1e-9)
    # Rows 0, 1 with column 0 and row 3 with column 1 form two independent blocks.
    assert sol.degenerate_rows == (2,) and sol.degenerate_cols == ()


# ----------------------------------------------------------------------------- blocks of the degenerate graph


def _graph_blocks(pos_a: np.ndarray, pos_b: np.ndarray):
    """The reference for the solver's peeling: the strongly connected components of the whole
    graph (an edge row → column per ``A > 0``, column → row per ``B > 0``, method §5), by scipy,
    without peeling or shortcuts. ``(rows, cols, partition of rows and columns into blocks, labels
    of the degenerate rows and columns)``."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    m, n = pos_a.shape
    ia, ja = np.nonzero(pos_a)
    ib, jb = np.nonzero(pos_b)
    graph = coo_matrix((np.ones(ia.size + ib.size), (np.r_[ia, m + jb], np.r_[m + ja, ib])), shape=(m + n, m + n))
    _, labels = connected_components(graph.tocsr(), directed=True, connection="strong")
    alive = np.bincount(labels)[labels] > 1
    rows, cols = np.flatnonzero(alive[:m]), np.flatnonzero(alive[m:])
    blocks = {frozenset([("r", int(i)) for i in rows if labels[i] == c] + [("c", int(j)) for j in cols
                                                                           if labels[m + j] == c])
              for c in set(labels[alive].tolist())}
    logs = []
    for axis, keep in ((1, alive[:m]), (0, alive[m:])):
        has_a, has_b = pos_a.any(axis=axis), pos_b.any(axis=axis)
        logs.append(np.where(~keep & has_b & ~has_a, np.inf, np.where(~keep & has_a & ~has_b, -np.inf, 0.0)))
    return rows, cols, blocks, logs


def _patterns(rng: np.random.Generator, kind: str, m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    if kind == "sparse":
        return rng.random((m, n)) < rng.uniform(0.2, 0.9), rng.random((m, n)) < rng.uniform(0.2, 0.9)
    if kind == "layer":  # dead units and inputs per sample in the curvature, a few zero weights
        active = rng.random((3, m)) < 0.6
        inputs = rng.random((3, n)) < 0.6
        pos_a = (active[:, :, None] & inputs[:, None, :]).any(axis=0)
        return pos_a, rng.random((m, n)) > rng.choice([0.0, 0.02, 0.3])
    # "blocks": independent diagonal blocks with a few terms between them (vanishing ones)
    split_r, split_c = rng.integers(1, m), rng.integers(1, n)
    pos_a, pos_b = np.zeros((m, n), bool), np.zeros((m, n), bool)
    for r, c in ((slice(0, split_r), slice(0, split_c)), (slice(split_r, m), slice(split_c, n))):
        pos_a[r, c] = rng.random(pos_a[r, c].shape) < 0.8
        pos_b[r, c] = rng.random(pos_b[r, c].shape) < 0.8
    pos_a[:split_r, split_c:] = rng.random((split_r, n - split_c)) < 0.3  # one direction only
    return pos_a, pos_b


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["sparse", "layer", "blocks"]),
       m=st.integers(2, 12), n=st.integers(2, 12))
def test_peeling_finds_the_components_of_the_whole_graph(seed, kind, m, n):
    """The solver peels the rows and columns that lie on no cycle, then decides one block by a
    search each way, and only then builds the graph: the same blocks, degenerate rows and
    columns and labels as the components of the whole graph (method §5, "Degenerate rows and
    columns")."""
    from normflat.core.solver import _peel_degenerate

    rng = np.random.default_rng(seed)
    pos_a, pos_b = _patterns(rng, kind, m, n)
    log_a, log_b = np.zeros(m), np.zeros(n)
    rows, cols, deg_rows, deg_cols, col_block, row_block, keep = _peel_degenerate(pos_a, pos_b, log_a, log_b)
    want_rows, want_cols, want_blocks, (want_log_a, want_log_b) = _graph_blocks(pos_a, pos_b)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(cols, want_cols)
    assert deg_rows == tuple(sorted(set(range(m)) - set(want_rows.tolist())))
    assert deg_cols == tuple(sorted(set(range(n)) - set(want_cols.tolist())))
    np.testing.assert_array_equal(log_a, want_log_a)
    np.testing.assert_array_equal(log_b, want_log_b)
    got_blocks = {frozenset([("r", int(i)) for i, b in zip(rows, row_block) if b == c]
                            + [("c", int(j)) for j, b in zip(cols, col_block) if b == c])
                  for c in set(row_block.tolist()) | set(col_block.tolist())}
    assert got_blocks == want_blocks
    want_keep = row_block[:, None] == col_block[None, :]
    assert (keep is None and want_keep.all()) or np.array_equal(keep, want_keep)


def test_a_dense_layer_with_dead_units_and_zero_weights_needs_no_graph(monkeypatch):
    """A large layer's pattern (dead units and inputs in the curvature, two weights exactly zero)
    is decided by peeling and the two searches: the graph of its terms is never built."""
    import scipy.sparse.csgraph

    def refuse(*args, **kwargs):
        raise AssertionError("the graph was built")

    monkeypatch.setattr(scipy.sparse.csgraph, "connected_components", refuse)
    rng = np.random.default_rng(0)
    m, n = 300, 500
    active, inputs = rng.random((4, m)) < 0.5, rng.random((4, n)) < 0.5
    H = (active[:, :, None] & inputs[:, None, :]).any(axis=0) * rng.random((m, n))
    W = rng.normal(size=(m, n))
    W[3, 7] = W[120, 400] = 0.0
    res = normflat.normalized_sharpness(W, H)
    assert res.converged and math.isfinite(res.value) and res.value > 0
    assert len(res.degenerate_rows) == int((~active.any(axis=0)).sum())
