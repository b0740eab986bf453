"""Float32 dense layers are measured from their own arrays, a block of rows at a time (method §5).

A model's layer problems are float32 (the model's dtype). For a dense layer (no kernel
axes) the core forms the float64 entries of ``A = max(H, 0)`` and ``B = W²`` a block of
rows at a time wherever they are used (the solver's matrix-vector products, the sums, the
standard errors' linear terms), never as float64 arrays of the layer's size. Every number
must be that of the same problem given in float64: float32 squares are exact in float64, so
only the order of the additions differs.
"""

from __future__ import annotations

import tracemalloc
import warnings

import numpy as np
import pytest

import normflat
from normflat.core import measures, solver
from normflat.core.measures import evaluate_layer
from normflat.core.problem import LayerProblem


@pytest.fixture(autouse=True)
def _all_warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows, so that every layer below spans several of them."""
    monkeypatch.setattr(solver, "DERIVED_BLOCK_ENTRIES", 64)
    monkeypatch.setattr(solver, "PASS_BLOCK_ENTRIES", 64)
    monkeypatch.setattr(measures, "PASS_BLOCK_ENTRIES", 64)


def _pair(problem32: LayerProblem) -> tuple[normflat.LayerResult, normflat.LayerResult]:
    def up(a):
        return None if a is None else np.asarray(a, dtype=np.float64)

    problem64 = LayerProblem(problem32.name, up(problem32.weight), up(problem32.hessian_diag),
                             groups=problem32.groups, hessian_diag_samples=up(problem32.hessian_diag_samples))
    return evaluate_layer(problem32), evaluate_layer(problem64)


def _assert_same(got: normflat.LayerResult, ref: normflat.LayerResult) -> None:
    for m in normflat.MEASURES:
        assert getattr(got, m) == pytest.approx(getattr(ref, m), rel=1e-13, abs=0.0), m
    for got_sigma, ref_sigma in ((got.row_sigma, ref.row_sigma), (got.col_sigma, ref.col_sigma)):
        np.testing.assert_array_equal(np.isfinite(got_sigma), np.isfinite(ref_sigma))
        finite = np.isfinite(ref_sigma)
        np.testing.assert_allclose(got_sigma[finite], ref_sigma[finite], rtol=1e-12)
        np.testing.assert_array_equal(got_sigma[~finite], ref_sigma[~finite])
    assert (got.clipped, got.degenerate_rows, got.degenerate_cols, got.iterations) == (
        ref.clipped, ref.degenerate_rows, ref.degenerate_cols, ref.iterations)
    assert (got.standard_error is None) == (ref.standard_error is None)
    if ref.standard_error is not None:
        for m in normflat.MEASURES:
            assert got.standard_error[m] == pytest.approx(ref.standard_error[m], rel=1e-11), m


def _float32(*arrays):
    return tuple(a.astype(np.float32) for a in arrays)


def test_dense_layer_with_clipped_curvature(small_blocks):
    rng = np.random.default_rng(0)
    W, H = _float32(rng.normal(size=(30, 17)), rng.random((30, 17)) - 0.1)
    got, ref = _pair(LayerProblem("fc", W, H))
    assert got.clipped > 0
    _assert_same(got, ref)


def test_dead_rows_and_pruned_columns_take_the_blocks_of_the_remaining_ones(small_blocks):
    rng = np.random.default_rng(1)
    W, H = _float32(rng.normal(size=(25, 19)), rng.random((25, 19)))
    H[:4] = 0.0  # dead units: no curvature
    W[:, 3] = 0.0  # a pruned input
    got, ref = _pair(LayerProblem("fc", W, H))
    assert len(got.degenerate_rows) == 4 and len(got.degenerate_cols) == 1
    _assert_same(got, ref)


def test_sparse_pattern_with_vanishing_terms(small_blocks):
    """Sparse curvature and weights: the strongly connected blocks mask the entries (method §5)."""
    rng = np.random.default_rng(2)
    W, H = _float32(rng.normal(size=(20, 16)), rng.random((20, 16)))
    W[rng.random(W.shape) < 0.8] = 0.0
    H[rng.random(H.shape) < 0.8] = 0.0
    got, ref = _pair(LayerProblem("fc", W, H))
    _assert_same(got, ref)


def _with_extremes(W, H):
    """Rows of huge curvature and tiny weights next to the opposite (the iteration's first row
    step is absorbed into the kernels)."""
    W[0] *= 1e-40
    H[0] *= 1e37
    W[1] *= 1e36
    H[1] *= 1e-40
    return W, H


def _count_absorptions(monkeypatch) -> list:
    """A list that gets an entry whenever the iteration absorbs its working point."""
    absorbed = []
    original = solver._Iteration._absorb

    def counting(self, *point):
        absorbed.append(True)
        return original(self, *point)

    monkeypatch.setattr(solver._Iteration, "_absorb", counting)
    return absorbed


def test_float32_extremes_absorbed_into_the_kernels(small_blocks, monkeypatch):
    """Rows of huge curvature and tiny weights next to the opposite: the iteration absorbs its
    working point into the kernels (formed from the entries' logarithms), on the derived entries too."""
    rng = np.random.default_rng(3)
    W, H = _float32(*_with_extremes(rng.normal(size=(12, 9)), rng.random((12, 9))))
    absorbed = _count_absorptions(monkeypatch)
    got = evaluate_layer(LayerProblem("fc", W, H))
    assert absorbed
    ref = evaluate_layer(LayerProblem("fc", W.astype(np.float64), H.astype(np.float64)))
    _assert_same(got, ref)


@pytest.mark.parametrize("extremes", [False, True])
def test_one_pass_sweeps_give_the_four_products_numbers(small_blocks, monkeypatch, extremes):
    """A sweep over float32 kernels forms each block once (solver._sweep_products): row sums, row
    step and column sums of a block together. Its results are those of the four products in
    turn up to the order of the additions, also where a sweep's rows fail their checks and its
    column sums are thrown away (the extremes: the first row step is absorbed)."""
    rng = np.random.default_rng(4)
    W, H = rng.normal(size=(23, 11)), rng.random((23, 11))
    if extremes:
        W, H = _with_extremes(W, H)
    W, H = _float32(W, H)
    one_pass = []
    sweep = solver._sweep_products

    def counted(K_A, K_B, *args):
        one_pass.append(K_A.entries is not None and K_B.entries is not None)
        return sweep(K_A, K_B, *args)

    def four_products(K_A, K_B, eb, emb, xp):
        row_a, row_b = K_A.times(eb), K_B.times(emb)
        a = 0.5 * (xp.log(row_b) - xp.log(row_a))
        ea = xp.exp(a)
        return row_a, row_b, a, K_A.times_left(ea), K_B.times_left(1.0 / ea)

    absorbed = _count_absorptions(monkeypatch)
    monkeypatch.setattr(solver, "_sweep_products", counted)
    got = evaluate_layer(LayerProblem("fc", W, H))
    assert any(one_pass) and bool(absorbed) == extremes
    monkeypatch.setattr(solver, "_sweep_products", four_products)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        ref = evaluate_layer(LayerProblem("fc", W, H))
    for m in normflat.MEASURES:
        assert getattr(got, m) == pytest.approx(getattr(ref, m), rel=1e-14, abs=0.0), m
    np.testing.assert_allclose(got.row_sigma, ref.row_sigma, rtol=1e-13)
    assert got.iterations == ref.iterations


def test_grouped_pointwise_convolution(small_blocks):
    """A 1×1 grouped convolution has no kernel axes to sum either: each group's rows are its block."""
    rng = np.random.default_rng(4)
    W, H = _float32(rng.normal(size=(24, 5, 1, 1)), rng.random((24, 5, 1, 1)))
    got, ref = _pair(LayerProblem("conv", W, H, groups=4))
    _assert_same(got, ref)


def test_standard_errors_from_group_samples(small_blocks):
    rng = np.random.default_rng(5)
    W = rng.normal(size=(40, 13)).astype(np.float32)
    samples = (rng.random((5, 40, 13)) * np.exp(rng.normal(size=(1, 40, 1))) - 0.02).astype(np.float32)
    samples[:, :3] = 0.0  # dead units
    got, ref = _pair(LayerProblem("fc", W, samples.mean(axis=0), hessian_diag_samples=samples))
    assert all(v > 0 for v in got.standard_error.values())
    _assert_same(got, ref)


@pytest.mark.parametrize("weight_dtype,diag_dtype", [("float32", "float32"), ("bfloat16", "float16")])
def test_torch_lower_precision_tensors(small_blocks, weight_dtype, diag_dtype):
    torch = pytest.importorskip("torch")  # the suite requires every backend (tests/conftest.py)
    rng = np.random.default_rng(6)
    W = torch.tensor(rng.normal(size=(21, 11))).to(getattr(torch, weight_dtype))
    H = torch.tensor(rng.random((21, 11)) - 0.05).to(getattr(torch, diag_dtype))
    got = evaluate_layer(LayerProblem("fc", W, H))
    ref = evaluate_layer(LayerProblem("fc", W.double(), H.double()))
    _assert_same(got, ref)


def test_no_float64_array_of_the_layers_size(monkeypatch):
    """The peak of a float32 dense layer's report, standard errors included, stays far below one
    float64 array of the layer (the plain path held five of them at once)."""
    # blocks of 512 KiB, far smaller than this layer
    monkeypatch.setattr(solver, "DERIVED_BLOCK_ENTRIES", 1 << 16)
    rng = np.random.default_rng(7)
    out, inp = 1500, 1000
    W = rng.normal(size=(out, inp)).astype(np.float32)
    samples = rng.random((3, out, inp), dtype=np.float32)
    H = samples.mean(axis=0)
    evaluate_layer(LayerProblem("warm-up", W[:50], H[:50], hessian_diag_samples=samples[:, :50]))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = evaluate_layer(LayerProblem("fc", W, H, hessian_diag_samples=samples))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.normalized_sharpness > 0
    float64_layer = out * inp * 8
    # What remains: the solver's boolean supports (one byte per entry each) and blocks.
    assert peak < 0.5 * float64_layer, f"peak {peak / 2**20:.1f} MiB, a float64 layer {float64_layer / 2**20:.1f} MiB"
