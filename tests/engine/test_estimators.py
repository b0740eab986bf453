"""The ``(init, update, finalize)`` estimator state of :mod:`normflat.engine.estimators` (method §6)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from normflat.engine import estimators, validate_options

SHAPES = [(3, 2), (2, 2, 3)]


def _zeros(options):
    return lambda i: np.zeros((options.groups,) + SHAPES[i])


def _finite(a):
    return bool(np.all(np.isfinite(a)))


def _finalize(state, options, examples):
    return estimators.finalize(state, options, examples, _zeros(options), _finite, ["first", "second"])


@pytest.mark.parametrize("estimator,samples,groups", [
    ("ggn", None, 1), ("exact", None, 1), ("ggn-mc", 1, 1), ("ggn-mc", 3, 3), ("hutchinson", 1, 1),
    ("hutchinson", 7, 7), ("hutchinson", 100, 10), ("ggn-mc", 25, 10),
])
def test_groups(estimator, samples, groups):
    options = validate_options(estimator=estimator, samples=samples)
    assert options.groups == groups
    state = estimators.init(2, options)
    assert state.groups == groups and state.sums == [None, None]


def test_hutchinson_divisors_are_probes_per_group():
    options = validate_options(estimator="hutchinson", samples=25)  # 10 groups of 3 or 2 probes
    np.testing.assert_array_equal(estimators.divisors(options, 6), 6.0 * np.array([3] * 5 + [2] * 5))


@pytest.mark.parametrize("estimator,samples", [("ggn-mc", 25), ("ggn-mc", 1), ("ggn", None), ("exact", None)])
def test_other_divisors_are_examples(estimator, samples):
    # ggn-mc signals are already scaled by 1/√m_k (losses.mc_signals)
    options = validate_options(estimator=estimator, samples=samples)
    np.testing.assert_array_equal(estimators.divisors(options, 6), np.full(options.groups, 6.0))


def test_update_and_finalize_hutchinson():
    rng = np.random.default_rng(0)
    options = validate_options(estimator="hutchinson", samples=13)  # 10 groups: 2,2,2,1,...
    k = options.groups
    state = estimators.init(2, options)
    parts = [rng.normal(size=(k, 3, 2)) for _ in range(3)]
    for part in parts:
        assert estimators.update(state, 0, part) is state
    results = _finalize(state, options, examples=5)
    counts = np.array([2, 2, 2] + [1] * 7)
    groups_ref = sum(parts) / (5.0 * counts[:, None, None])
    diag, groups = results[0]
    assert len(groups) == k
    np.testing.assert_allclose(np.stack(groups), groups_ref, rtol=1e-15)
    np.testing.assert_allclose(diag, groups_ref.mean(0), rtol=1e-14)
    # the untouched layer: zeros of its shape, with K zero group estimates
    diag2, groups2 = results[1]
    assert diag2.shape == SHAPES[1] and not np.any(diag2)
    assert len(groups2) == k and all(g.shape == SHAPES[1] and not np.any(g) for g in groups2)


def test_finalize_deterministic_single_group():
    options = validate_options(estimator="ggn")
    state = estimators.init(2, options)
    a, b = np.arange(6.0).reshape(1, 3, 2), np.ones((1, 3, 2))
    state.add(0, a)
    state.add(0, b)
    (diag, groups), (diag2, groups2) = _finalize(state, options, examples=4)
    assert groups is None and groups2 is None
    np.testing.assert_allclose(diag, (a[0] + b[0]) / 4, rtol=1e-15)
    assert diag2.shape == SHAPES[1] and not np.any(diag2)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("pooled", [False, True])
def test_one_sum_is_divided_in_the_states_memory_and_never_in_the_callers(library, pooled):
    """A layer's one sum (one group, or every group pooled) becomes its mean in the state's own
    memory when the state owns it, and never writes into a caller's array it was handed."""
    xp = pytest.importorskip(library)
    options = validate_options(estimator="ggn-mc" if pooled else "ggn", samples=4 if pooled else None)
    if pooled:  # hessian_diagonal's options: the groups' sums pooled into one
        options = dataclasses.replace(options, group_estimates=False)
        assert options.pooled
    state = estimators.init(1, options)
    given = xp.asarray(np.arange(6.0).reshape(1, 3, 2))
    state.add(0, given)  # not owned: the caller's array
    (diag, _), = estimators.finalize(state, options, 2, None, lambda a: True, ["fc"], with_groups=False)
    np.testing.assert_allclose(np.asarray(diag), np.arange(6.0).reshape(3, 2) / 2, rtol=1e-15)
    np.testing.assert_array_equal(np.asarray(given), np.arange(6.0).reshape(1, 3, 2))
    state = estimators.init(1, options)
    fresh = xp.asarray(np.arange(6.0).reshape(1, 3, 2))
    state.add(0, fresh, owned=True)
    (diag, _), = estimators.finalize(state, options, 2, None, lambda a: True, ["fc"], with_groups=False)
    np.testing.assert_allclose(np.asarray(diag), np.arange(6.0).reshape(3, 2) / 2, rtol=1e-15)
    np.testing.assert_array_equal(np.asarray(fresh[0]), np.asarray(diag))  # no new weight-sized array


def test_finalize_ggn_mc_groups():
    options = validate_options(estimator="ggn-mc", samples=3)
    state = estimators.init(2, options)
    v = np.arange(18.0).reshape(3, 3, 2)
    state.add(0, v)
    diag, groups = _finalize(state, options, examples=2)[0]
    np.testing.assert_allclose(np.stack(groups), v / 2, rtol=1e-15)
    np.testing.assert_allclose(diag, v.mean(0) / 2, rtol=1e-15)


def test_update_does_not_alias_the_first_contribution():
    # The first contribution becomes the sum; adding later ones must not write into the
    # caller's array (the state adds out of place).
    options = validate_options(estimator="ggn")
    state = estimators.init(1, options)
    first = np.ones((1, 3, 2))
    state.add(0, first)
    state.add(0, np.ones((1, 3, 2)))
    np.testing.assert_array_equal(first, 1.0)


def test_wrong_group_count():
    options = validate_options(estimator="ggn-mc", samples=4)
    state = estimators.init(2, options)
    with pytest.raises(ValueError, match="has 1 groups, expected 4"):
        state.add(0, np.zeros((1, 3, 2)))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_diagonal_names_the_layer(bad):
    options = validate_options(estimator="ggn")
    state = estimators.init(2, options)
    state.add(0, np.ones((1, 3, 2)))
    v = np.ones((1, 2, 2, 3))
    v[0, 1, 0, 2] = bad
    state.add(1, v)
    with pytest.raises(ValueError, match="Layer 'second': the Hessian diagonal is not finite"):
        _finalize(state, options, examples=3)


# ----------------------------------------------------------------- kernel-summed group sums


def _run_state(options, contributions, kernel_axes=None, exact=()):
    """Feed ``[(layer, value)]`` (an ``exact`` index: :meth:`SumState.add_exact`) and finalize."""
    state = estimators.init(2, options, kernel_axes=kernel_axes)
    for j, (layer, value) in enumerate(contributions):
        (state.add_exact if j in exact else state.add)(layer, value.copy(), owned=True)
    return state, _finalize(state, options, examples=5)


@pytest.mark.parametrize("estimator,samples,top", [
    ("ggn-mc", 4, None), ("hutchinson", 7, None), ("hutchinson", 13, None), ("ggn-topk", 5, 1),
])
@pytest.mark.parametrize("exact", [(), (0,), (0, 2), (1, 2)])
def test_kernel_summed_groups_equal_the_kernel_sums_of_the_full_groups(estimator, samples, top, exact):
    """A layer with kernel axes keeps its group sums as kernel sums and the diagonal's numerator at
    full size (method §6.2): the same diagonal, and groups that are the full groups' kernel sums,
    for even and uneven groups (Hutchinson's probes per group), ggn-topk's shared sum and its exact
    contributions before, between and after full ones."""
    options = validate_options(estimator=estimator, samples=samples, top_classes=top)
    if estimator != "ggn-topk":
        exact = ()
    rng = np.random.default_rng(3)
    s = options.state_groups
    contributions = []
    for j in range(4):
        value = rng.normal(size=(s,) + SHAPES[1])
        contributions.append((1, value[:1] if j in exact else value))
        contributions.append((0, rng.normal(size=(s,) + SHAPES[0])))
    full_state, full = _run_state(options, contributions, exact={2 * j for j in exact})
    state, summed = _run_state(options, contributions, kernel_axes=lambda i: (2,) if i == 1 else (),
                               exact={2 * j for j in exact})
    assert not state.means and state.sums == [None, None]  # finalize released everything
    np.testing.assert_allclose(summed[0][0], full[0][0], rtol=1e-14)  # a matrix: kept whole
    np.testing.assert_allclose(np.stack(summed[0][1]), np.stack(full[0][1]), rtol=1e-14)
    np.testing.assert_allclose(summed[1][0], full[1][0], rtol=1e-13, atol=1e-15)
    groups = np.stack(summed[1][1])
    assert groups.shape == (options.groups, 2, 2, 1)
    np.testing.assert_allclose(groups, np.stack(full[1][1]).sum(axis=3, keepdims=True), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(groups.mean(0), summed[1][0].sum(axis=2, keepdims=True), rtol=1e-13, atol=1e-15)


def test_kernel_summed_state_holds_less_and_never_the_contribution():
    """What a kernel-summed layer holds: one full-size numerator and ``K'`` kernel sums; the
    caller's contribution is not kept (nor written into); only the mean is ever full size."""
    options = validate_options(estimator="ggn-mc", samples=4)
    state = estimators.init(2, options, kernel_axes=lambda i: (2,))
    first = np.ones((4, 2, 2, 3))
    state.add(1, first)
    state.add(1, np.ones((4, 2, 2, 3)))
    np.testing.assert_array_equal(first, 1.0)
    assert state.sums[1].shape == (4, 2, 2, 1) and state.means[1].shape == (2, 2, 3)
    np.testing.assert_allclose(state.means[1], 2.0)  # Σ_k sums_k / K over two contributions
    np.testing.assert_allclose(state.sums[1], 6.0)
    assert state.accumulator(1) is None  # the kernels may not add into kernel sums


def test_mean_weights():
    np.testing.assert_allclose(estimators.mean_weights(validate_options(estimator="ggn-mc", samples=4)), [0.25] * 4)
    np.testing.assert_allclose(estimators.mean_weights(validate_options(estimator="ggn-topk", samples=4)),
                               [1.0] + [0.25] * 4)
    # 7 probes in 7 groups of one; 13 probes in 10 groups: 2, 2, 2, then 1
    np.testing.assert_allclose(estimators.mean_weights(validate_options(estimator="hutchinson", samples=13)),
                               [0.1] * 3 + [0.2] * 7)


def test_hessian_diagonal_keeps_no_kernel_sums():
    """Without the group estimates (hessian_diagonal) the state does not ask for kernel axes."""
    options = validate_options(estimator="ggn-mc", samples=4)
    options = dataclasses.replace(options, group_estimates=False)
    asked = []
    state = estimators.init(1, options, kernel_axes=lambda i: asked.append(i) or (1,))
    state.add(0, np.ones((4, 2, 3)))
    assert not asked and not state.means
