"""``ggn-topk``, ``auto`` and the structured signals of :mod:`normflat.engine.losses` (method §6.1–6.2).

References are float64 formulas: ``diag(p) − ppᵀ`` (pulled back through the
normalization's Jacobian for ``nsce``), its expectation over the draws computed
exactly by placing one uniform in the middle of every class's interval, and
plain matrix products for the signals through a dense head.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from normflat.engine import estimators, losses, validate_options
from normflat.engine.options import adopt_estimator, resolve_estimator
from tests.engine._fakes import nsce_jacobian, softmax

RNG = np.random.default_rng(7)


def _opts(**kw):
    return validate_options(progress=False, **kw)


def _hessian(z, loss):
    """Per-sample loss Hessians in the raw logits, ``(n, C, C)``."""
    if loss == "ce":
        return np.stack([np.diag(p) - np.outer(p, p) for p in softmax(z)])
    out = []
    for row in z:
        u, _, _ = losses.normalize_logits(np, row[None], 1.0)
        p = softmax(u)[0]
        jac = nsce_jacobian(row)
        out.append(jac.T @ (np.diag(p) - np.outer(p, p)) @ jac)
    return np.stack(out)


def _group_estimate(sig, options):
    """``(K, n, C, C)`` group estimates of the Hessian from ``(K', M, n, C)`` signals."""
    outer = np.einsum("gmnc,gmnd->gncd", sig, sig)
    if options.shared_group:
        return outer[0][None] + outer[1:]
    return outer


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_logit_hessian_diagonal_is_the_diagonal(loss):
    z = RNG.normal(size=(6, 9)) * 2
    want = np.einsum("ncc->nc", _hessian(z, loss))
    got = losses.logit_hessian_diagonal(np, z, _opts(loss=loss, estimator="ggn"))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss", ["ce", "nsce"])
@pytest.mark.parametrize("top,samples", [(2, 5), (1, 2), (3, 7)])
def test_topk_is_unbiased_exactly(loss, top, samples):
    """The expectation over the draws, computed exactly, is the Hessian of every group.

    Every group's draws see the same uniform here, so each group's estimate is the
    same function of it; its expectation is the sum over the classes ``c`` outside the
    top ones of ``q_c`` times the estimate at a uniform inside ``c``'s interval.
    """
    c = 6
    z = RNG.normal(size=(3, c)) * 2
    options = _opts(loss=loss, estimator="ggn-topk", top_classes=top, samples=samples)
    want = _hessian(z, loss)
    u_logits = losses.normalize_logits(np, z, 1.0)[0] if loss == "nsce" else z
    p = softmax(u_logits)
    for i in range(len(z)):
        order = np.argsort(-p[i], kind="stable")
        rest = np.ones(c, bool)
        rest[order[:top]] = False
        q = np.where(rest, p[i], 0.0)
        cum = np.cumsum(q)
        expect = 0.0
        for cls in np.flatnonzero(rest):
            mid = (cum[cls] - q[cls] / 2) / cum[-1]
            sig = losses.output_signals(np, z[i:i + 1], options, np.full((1, samples), mid))
            expect = expect + (q[cls] / cum[-1]) * _group_estimate(sig, options)[:, 0]
        np.testing.assert_allclose(expect, np.broadcast_to(want[i], expect.shape), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_topk_with_every_class_on_top_is_exact(loss):
    z = RNG.normal(size=(4, 5))
    options = _opts(loss=loss, estimator="ggn-topk", top_classes=5, samples=3)
    sig = losses.output_signals(np, z, options, RNG.random((4, 3)))
    assert sig.shape == (1 + options.groups, options.signals_per_group(5), 4, 5)
    np.testing.assert_allclose(_group_estimate(sig, options), np.broadcast_to(_hessian(z, loss), (3, 4, 5, 5)),
                               rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(sig[1:], 0.0)  # nothing left to draw


def test_topk_never_draws_a_top_class():
    z = np.array([[5.0, 4.0, 0.0, -1.0, -3.0]])
    options = _opts(loss="ce", estimator="ggn-topk", top_classes=2, samples=200)
    sig = losses.output_signals(np, z, options, RNG.random((1, 200)))
    p = softmax(z)[0]
    factor = losses.output_factor(np, z, options, RNG.random((1, 200)))
    drawn = factor.index[1:][factor.scale[1:] > 0]
    assert set(np.unique(drawn)) == {2.0, 3.0, 4.0}  # every class outside the top two, and only those
    assert set(np.unique(factor.index[0][factor.scale[0] > 0])) == {0.0, 1.0}
    del sig, p


@pytest.mark.parametrize("estimator,kw", [("ggn-topk", {"top_classes": 2, "samples": 4}),
                                          ("ggn-mc", {"samples": 4})])
def test_overflowing_logits_keep_every_class_index_in_range(estimator, kw):
    """Infinite logits make the probabilities NaN: the classes stay in range (the gathers that follow
    would fail inside a compiled step, or assert on a device); the logits' check refuses the batch."""
    z = np.array([[np.inf, 1.0, 0.0], [0.0, 1.0, 2.0]])
    options = _opts(loss="ce", estimator=estimator, **kw)
    with np.errstate(invalid="ignore"):
        factor = losses.output_factor(np, z, options, RNG.random((2, options.draws)))
    assert np.all((factor.index >= -1) & (factor.index <= 2))
    if estimator == "ggn-topk":
        assert set(np.unique(factor.index[0][:2, 1])) == {1.0, 2.0}  # the finite row: its top two classes


@pytest.mark.parametrize("loss", ["ce", "nsce"])
@pytest.mark.parametrize("estimator,kw", [("ggn", {}), ("ggn-topk", {"top_classes": 2, "samples": 7}),
                                          ("ggn-mc", {"samples": 5})])
def test_factor_is_the_signals_and_goes_through_a_head(loss, estimator, kw):
    z = RNG.normal(size=(5, 8)) * 2
    weight = RNG.normal(size=(8, 3))
    options = _opts(loss=loss, estimator=estimator, **kw)
    u = RNG.random((5, options.draws)) if options.draws else None
    dense = losses.output_signals(np, z, options, u)
    factor = losses.output_factor(np, z, options, u)
    np.testing.assert_allclose(factor.dense(np), dense, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(factor.through(np, weight), dense @ weight, rtol=1e-12, atol=1e-13)
    members = int(dense.shape[1])
    for start, stop in {(0, 1), (members // 2, members), (members - 1, members)}:  # a few members of every group
        part = factor.members(start, stop)
        np.testing.assert_allclose(part.dense(np), dense[:, start:stop], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(part.through(np, weight), dense[:, start:stop] @ weight, rtol=1e-12, atol=1e-13)


def test_factor_under_torch_and_jax():
    import array_api_compat
    import jax.numpy as jnp
    import torch

    z = RNG.normal(size=(4, 6))
    weight = RNG.normal(size=(6, 3))
    u = RNG.random((4, 10))
    options = _opts(loss="nsce", estimator="ggn-topk")
    want = losses.output_signals(np, z, options, u) @ weight
    zt, wt, ut = (torch.tensor(a) for a in (z, weight, u))
    got_t = losses.output_factor(array_api_compat.array_namespace(zt), zt, options, ut).through(
        array_api_compat.array_namespace(zt), wt)
    np.testing.assert_allclose(got_t.numpy(), want, rtol=1e-12, atol=1e-13)
    import jax

    with jax.enable_x64(True):
        got_j = losses.output_factor(jnp, jnp.asarray(z), options, jnp.asarray(u)).through(jnp, jnp.asarray(weight))
        np.testing.assert_allclose(np.asarray(got_j), want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_diagonal_signals_square_to_the_diagonal_in_group_zero(loss):
    z = RNG.normal(size=(4, 6))
    options = _opts(loss=loss, estimator="ggn-topk")
    sig = losses.diagonal_signals(np, z, options)
    assert sig.shape == (options.state_groups, 1, 4, 6)
    np.testing.assert_allclose(sig[0, 0] ** 2, np.einsum("ncc->nc", _hessian(z, loss)), rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(sig[1:], 0.0)


def test_signal_slots():
    options = _opts(estimator="ggn-topk", top_classes=2, samples=7)  # K = 5, M = 2
    slots = losses.signal_slots(options, 10)
    assert slots[:2] == [(0, 0), (0, 1)]
    assert sorted(slots[2:]) == sorted((1 + d % 5, d // 5) for d in range(7))
    assert losses.signal_slots(_opts(estimator="ggn"), 4) == [(0, 0), (0, 1), (0, 2)]


@pytest.mark.parametrize("estimator, kw", [
    ("ggn-topk", dict(top_classes=4, samples=7)), ("ggn-topk", dict(top_classes=2, samples=14)),
    ("ggn-topk", dict(top_classes=2, samples=10)), ("ggn-mc", dict(samples=13)), ("ggn", {}),
])
def test_padding_signals_are_the_zero_signals(estimator, kw):
    """padding_signals names exactly the signals of the layout that are zero for any logits: of the
    whole block, of a block of members, and of per-token windows (member m of token t at m·W + t)."""
    options = _opts(estimator=estimator, **kw)
    c, n = 9, 5
    z = RNG.normal(size=(n, c))
    u = RNG.uniform(size=(n, options.draws)) if options.draws else None
    sig = losses.output_signals(np, z, options, u)  # (K', M, n, C)
    flat = sig.reshape(-1, n * c)
    zero = [i for i in range(flat.shape[0]) if not np.any(flat[i])]
    assert losses.padding_signals(options, c) == zero
    np.testing.assert_array_equal(losses.real_signals(options, c), [i for i in range(flat.shape[0]) if i not in zero])
    expected = {"ggn-topk": 13 if kw.get("samples") == 7 else (2 if kw.get("samples") == 14 else 0),
                "ggn-mc": 7, "ggn": 0}[estimator]
    assert len(zero) == expected
    m = sig.shape[1]
    for lo, hi in ((0, 1), (1, m), (m - 1, m)):
        part = sig[:, lo:hi].reshape(-1, n * c)
        assert losses.padding_signals(options, c, members=(lo, hi)) == [
            i for i in range(part.shape[0]) if not np.any(part[i])]
    # Per token: a window of W tokens, each token's signals placed at its own position.
    t, w = 4, 3
    counted = np.ones((n, t))
    zt = RNG.normal(size=(n, t, c))
    ut = RNG.uniform(size=(n, t * options.draws)) if options.draws else None
    tok = losses.token_signals(np, zt, replace(options, sequence_signals=False) if options.draws else options,
                               counted, ut, tokens=(1, 1 + w))  # (K', M·W, n, T, C)
    flat = tok.reshape(tok.shape[0] * tok.shape[1], -1)
    assert losses.padding_signals(options, c, tokens=w) == [i for i in range(flat.shape[0]) if not np.any(flat[i])]
    np.testing.assert_array_equal(losses.real_signals(options, c, tokens=w),
                                  [i for i in range(flat.shape[0]) if np.any(flat[i])])


def test_options_of_topk_and_auto():
    o = _opts(estimator="ggn-topk")
    assert (o.samples, o.top_classes, o.groups, o.state_groups, o.draws) == (10, 2, 5, 6, 10)
    assert o.signals_per_group(1000) == 2 and o.stochastic and o.shared_group
    auto = _opts()
    assert auto.estimator == "auto" and (auto.samples, auto.top_classes) == (10, 2)
    assert resolve_estimator(auto, 25).estimator == "ggn"
    assert resolve_estimator(auto, 25).samples is None and resolve_estimator(auto, 25).top_classes is None
    big = resolve_estimator(auto, 26)
    assert (big.estimator, big.samples, big.top_classes) == ("ggn-topk", 10, 2)
    assert resolve_estimator(_opts(estimator="ggn-mc"), 1000).estimator == "ggn-mc"
    assert adopt_estimator(auto, "ggn-topk") == big
    # The rule counts the signals ggn-topk back-propagates, k + S, not its padded (K', M) layout:
    # top_classes=10 with 10 draws is 20 signals (60 slots), so the exact ggn up to 41 classes.
    wide = _opts(top_classes=10)
    assert resolve_estimator(wide, 41).estimator == "ggn" and resolve_estimator(wide, 42).estimator == "ggn-topk"
    with pytest.raises(ValueError, match="top_classes=3 has no meaning for estimator='ggn'"):
        _opts(estimator="ggn", top_classes=3)
    with pytest.raises(ValueError, match="top_classes must be >= 1"):
        _opts(estimator="ggn-topk", top_classes=0)
    with pytest.raises(ValueError, match="custom loss callable use estimator='exact'"):
        _opts(loss=lambda z, y: z.mean())  # auto is a GGN estimator


def test_finalize_adds_the_shared_group():
    options = _opts(estimator="ggn-topk", samples=4)  # K = 4 groups plus the shared one
    shared = np.full((2, 3), 1.0)
    draws = np.stack([np.full((2, 3), float(k)) for k in range(4)])

    def filled(owned):
        state = estimators.init(1, options)
        state.add(0, np.concatenate([shared[None], draws]), owned=owned)
        state.add(0, np.zeros((5, 2, 3)))  # a second contribution: the state's own sums
        return state

    for owned in (False, True):  # out of place, and in the state's own memory
        ((diag, groups),) = estimators.finalize(filled(owned), options, 2, None,
                                                lambda a: bool(np.isfinite(a).all()), ["fc"])
        np.testing.assert_allclose(np.stack(groups), (1.0 + draws) / 2)
        np.testing.assert_allclose(diag, (1.0 + 1.5) / 2)
    ((mean_only, none),) = estimators.finalize(filled(False), options, 2, None, lambda a: True, ["fc"],
                                               with_groups=False)
    assert none is None
    np.testing.assert_allclose(mean_only, diag)


def test_auto_sums_take_their_size_from_the_first_contribution():
    state = estimators.init(2, _opts())
    assert state.groups is None
    state.add(0, np.zeros((6, 2)))
    with pytest.raises(ValueError, match="has 1 groups, expected 6"):
        state.add(1, np.zeros((1, 2)))


def test_exact_layer_keeps_only_its_shared_sum():
    """A dense head under ggn-topk is exact: one sum instead of 1 + K, its groups all the mean; a
    later full contribution (its fast rule gave way to the generic path) turns it into 1 + K sums."""
    options = _opts(estimator="ggn-topk", samples=4)
    state = estimators.init(2, options)
    head = np.arange(6.0).reshape(1, 2, 3)
    state.add_exact(0, head)
    state.add_exact(0, head)
    assert state.sums[0].shape == (1, 2, 3)
    np.testing.assert_array_equal(head, np.arange(6.0).reshape(1, 2, 3))  # the caller's array is not written
    state.add_exact(1, head)
    full = np.ones((5, 2, 3))
    state.add(1, full)
    assert state.sums[1].shape == (5, 2, 3)
    (diag0, groups0), (diag1, groups1) = estimators.finalize(state, options, 2, None, lambda a: True, ["head", "x"])
    np.testing.assert_allclose(diag0, 2 * head[0] / 2)
    assert groups0.shape == (4, 2, 3)
    np.testing.assert_allclose(groups0, np.broadcast_to(diag0, (4, 2, 3)))
    np.testing.assert_allclose(groups1, (head[0] + 2.0)[None].repeat(4, 0) / 2)
    np.testing.assert_allclose(diag1, (head[0] + 2.0) / 2)
    assert state.sums == [None, None]  # released
