"""Logits taken a block of rows at a time (:data:`normflat.engine.losses.LOGIT_BLOCK_ENTRIES`).

Where arrays are mutable (numpy, torch) the probabilities, the class selection, the
logit-Hessian diagonal and the logit checks take the ``n·T`` token rows of a large
vocabulary a block at a time, so that their temporaries are those of one block (method §9).
Every row's numbers depend on its own logits (and uniforms) only: each function gives the
same numbers blocked as whole, checked here with blocks of three rows (the last one shorter)
in float64, and on a whole analysis.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import normflat
from normflat.engine import losses, native, validate_options

RNG = np.random.default_rng(7)
C = 7


@pytest.fixture(params=["numpy", "torch"])
def lib(request):
    """``(xp, to, back)``: the namespace, numpy → native and native → numpy."""
    if request.param == "numpy":
        return np, np.asarray, np.asarray
    import array_api_compat

    return array_api_compat.array_namespace(torch.zeros(1)), torch.as_tensor, lambda t: t.numpy()


def _opts(**kw):
    kw.setdefault("estimator", "ggn")
    return validate_options(progress=False, **kw)


def _both(monkeypatch, fn):
    """``fn()`` with the rows whole, then in blocks of three rows (results as numpy)."""
    whole = fn()
    original = losses.LOGIT_BLOCK_ENTRIES
    monkeypatch.setattr(losses, "LOGIT_BLOCK_ENTRIES", 3 * C)
    blocked = fn()
    monkeypatch.setattr(losses, "LOGIT_BLOCK_ENTRIES", original)
    return whole, blocked


def _assert_same(whole, blocked):
    for a, b in zip(whole, blocked):
        np.testing.assert_allclose(b, a, rtol=1e-15, atol=0)


def test_blocks_only_where_arrays_are_mutable_and_large(monkeypatch):
    monkeypatch.setattr(losses, "LOGIT_BLOCK_ENTRIES", 3 * C)
    assert losses._row_blocks(np.zeros((11, C))) == [(0, 3), (3, 6), (6, 9), (9, 11)]
    assert losses._row_blocks(torch.zeros(11, C)) == [(0, 3), (3, 6), (6, 9), (9, 11)]
    assert losses._row_blocks(np.zeros((3, C))) is None  # one block: whole
    assert losses._row_blocks(np.zeros((2, 5, C))) is None  # rows only
    monkeypatch.setattr(losses, "LOGIT_BLOCK_ENTRIES", C - 1)  # a row wider than a block: one row each
    assert losses._row_blocks(np.zeros((3, C))) == [(0, 1), (1, 2), (2, 3)]
    import jax.numpy as jnp

    assert losses._row_blocks(jnp.zeros((11, C))) is None  # immutable: compiled code fuses


@pytest.mark.parametrize("loss", ["ce", "nsce"])
@pytest.mark.parametrize("estimator", ["ggn", "ggn-mc", "ggn-topk"])
def test_output_signals_and_factor_blocked(lib, monkeypatch, loss, estimator):
    xp, to, back = lib
    z = RNG.normal(size=(11, C)) * 2
    opts = _opts(loss=loss, estimator=estimator, samples=None if estimator == "ggn" else 5,
                 top_classes=2 if estimator == "ggn-topk" else None)
    u = RNG.random((11, 5)) if estimator != "ggn" else None
    weight = RNG.normal(size=(C, 3))

    def run():
        factor = losses.output_factor(xp, to(z), opts, None if u is None else to(u))
        projected = factor.projected(xp, to(weight))
        return (back(losses.output_signals(xp, to(z), opts, None if u is None else to(u))),
                back(factor.dense(xp)), back(factor.through(xp, to(weight), projected)),
                back(losses.logit_hessian_diagonal(xp, to(z), opts)),
                back(losses.diagonal_signals(xp, to(z), opts)))

    whole, blocked = _both(monkeypatch, run)
    _assert_same(whole, blocked)
    # The factor is the signals, and through the head their product with it.
    np.testing.assert_allclose(blocked[1], blocked[0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(blocked[2], blocked[0] @ weight, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("loss", ["ce", "nsce"])
@pytest.mark.parametrize("estimator", ["ggn-mc", "ggn-topk"])
def test_sequence_factor_blocked(lib, monkeypatch, loss, estimator):
    xp, to, back = lib
    n, t = 3, 4  # 12 token rows: blocks 3, 3, 3, 3
    z = RNG.normal(size=(n, t, C)) * 1.5
    counted = np.ones((n, t))
    counted[1, 2] = 0.0
    opts = _opts(loss=loss, estimator=estimator, samples=4, top_classes=2 if estimator == "ggn-topk" else None)
    u = RNG.random((n, opts.uniform_columns(t)))
    weight = RNG.normal(size=(C, 3))

    def run():
        factor = losses.sequence_factor(xp, to(z), opts, to(counted), to(u))
        classes = losses.sequence_classes(xp, to(z), opts, to(counted), to(u))
        return (back(factor.dense(xp)), back(factor.through(xp, to(weight))), back(classes.index),
                back(classes.scale), back(losses.token_signals(xp, to(z), opts, to(counted), to(u))))

    whole, blocked = _both(monkeypatch, run)
    _assert_same(whole, blocked)
    np.testing.assert_allclose(blocked[0].reshape(blocked[4].shape), blocked[4], rtol=1e-13, atol=1e-15)


def test_nsce_vector_one_is_a_view(lib, monkeypatch):
    """``nsce``'s shared vector 1 is one row broadcast (no array of the logits' size), and
    multiplied through a head once, as one row."""
    xp, to, back = lib
    z = RNG.normal(size=(11, C))
    factor = losses.output_factor(xp, to(z), _opts(loss="nsce"))
    ones = factor.vectors[-2]
    assert native.repeats_rows(ones) and back(ones).shape == (11, C) and np.all(back(ones) == 1)
    assert not native.repeats_rows(factor.vectors[0])
    weight = RNG.normal(size=(C, 3))
    projected = factor.projected(xp, to(weight))
    np.testing.assert_allclose(back(projected[-2]), np.ones((11, C)) @ weight, rtol=1e-14)


def test_logit_stats_blocked(lib, monkeypatch):
    """The blocks' numbers combine into the whole rows' (minimum, maximum, finite), so a bad
    row is found in whichever block it lies, and token logits ``(n, T, C)`` as rows."""
    xp, to, back = lib
    z = RNG.normal(size=(4, 5, C)) * 3
    z[2, 1] = 0.25  # a constant row: the smallest RMS, 0, in the fourth block
    whole, blocked = _both(monkeypatch, lambda: (back(losses.logit_stats(xp, to(z))),))
    _assert_same(whole, blocked)
    assert blocked[0][3] == 0 and blocked[0][0] == 1
    bad = z.copy()
    bad[3, 4, 2] = np.inf  # in the last block
    whole, blocked = _both(monkeypatch, lambda: (back(losses.logit_stats(xp, to(bad))),))
    _assert_same(whole, blocked)
    assert blocked[0][0] == 0


class _TokenModel(nn.Module):
    """Embedding, a dense layer per token and a dense head: token logits ``(n, T, C)``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(C, 5)
        self.proj = nn.Linear(5, 5)
        self.head = nn.Linear(5, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.emb(ids))))


@pytest.mark.parametrize("estimator", ["ggn", "ggn-topk"])
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_analysis_blocked(monkeypatch, estimator, loss):
    """A whole torch analysis of token logits (the head's exact squares, the signals started at
    its input, the deferred logit checks) gives the same diagonal with the rows in blocks."""
    torch.manual_seed(0)
    model = _TokenModel().double()
    ids = torch.randint(0, C, (3, 6), generator=torch.Generator().manual_seed(1))
    kw = {"samples": 4, "top_classes": 2} if estimator == "ggn-topk" else {}

    def run():
        diag = normflat.hessian_diagonal(model, (ids, ids), loss=loss, estimator=estimator, progress=False, **kw)
        return tuple(np.asarray(diag[k]) for k in sorted(diag))

    calls = []
    real = losses._row_blocks

    def spy(rows):
        out = real(rows)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(losses, "_row_blocks", spy)
    whole, blocked = _both(monkeypatch, run)
    assert any(calls)  # the analysis took its 18 token rows in blocks
    _assert_same(whole, blocked)
