"""The analysis loop :func:`normflat.engine.driver.run` with a numpy session.

:class:`tests.engine._fakes.LinearSession` analyzes ``z = x Wᵀ``, whose GGN
diagonal is ``mean_n G_n[c, c] x_nd²`` with ``G_n = Jᵀ (diag p − ppᵀ) J`` in
closed form (``J = I`` for ``ce``; the normalization's Jacobian for ``nsce``),
and for ``ce`` equals the Hessian diagonal (a linear model).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from normflat.core.problem import LayerProblem
from normflat.engine import DETAIL_KEYS, METADATA_KEYS, driver, losses, validate_options
from normflat.engine import random as nf_random
from tests.engine._fakes import LinearSession, linear_full_hessian, linear_ggn_diagonal

RNG = np.random.default_rng(3)
W = RNG.normal(size=(3, 4))
X = RNG.normal(size=(11, 4))
Y = RNG.integers(0, 3, size=11)


def _batches(sizes):
    out, start = [], 0
    for n in sizes:
        out.append((X[start:start + n], Y[start:start + n]))
        start += n
    assert start == len(X)
    return out


def _run(data, session_kw=None, **options):
    options.setdefault("progress", False)
    opts = validate_options(**options)
    holder = {}

    def make():
        holder["session"] = LinearSession(W, opts, **(session_kw or {}))
        return holder["session"]

    try:
        return driver.run(make, data, opts), holder["session"]
    finally:
        _run.last = holder.get("session")  # the session of the last call, also after an error


@pytest.mark.parametrize("loss,temperature", [("ce", 1.0), ("nsce", 1.0), ("nsce", 0.5)])
def test_ggn_equals_brute_force(loss, temperature):
    res, session = _run(_batches([4, 4, 3]), loss=loss, temperature=temperature)
    np.testing.assert_allclose(res.diags[0], linear_ggn_diagonal(W, X, loss, temperature), rtol=1e-13)
    assert res.diags[1].shape == (4, 3, 2, 2) and not np.any(res.diags[1])  # never reached: curvature 0
    assert res.samples == [None, None]
    np.testing.assert_array_equal(res.weights[0], W)
    assert session.closed == 1


def test_ce_ggn_is_the_hessian_of_a_linear_model():
    res, _ = _run((X, Y), loss="ce")
    np.testing.assert_allclose(res.diags[0].ravel(), np.diag(linear_full_hessian(W, X)), rtol=1e-13)


def test_hutchinson_divides_by_probes_per_group():
    samples = 13  # 10 groups of 2, 2, 2, 1, ... probes
    res, _ = _run(_batches([5, 6]), loss="ce", estimator="hutchinson", samples=samples, seed=4)
    h = linear_full_hessian(W, X)
    v = nf_random.rademacher(4, 0, range(samples), W.shape).reshape(samples, -1).astype(np.float64)
    est = v * (v @ h)  # v ⊙ H v per probe
    groups = np.stack([est[k::10].mean(0) for k in range(10)]).reshape(10, *W.shape)
    np.testing.assert_allclose(np.stack(res.samples[0]) if isinstance(res.samples[0], list) else res.samples[0],
                               groups, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(res.diags[0], groups.mean(0), rtol=1e-12, atol=1e-15)
    assert res.samples[1].shape == (10, 4, 3, 2, 2) and not np.any(res.samples[1])


def test_hutchinson_is_unbiased():
    res, _ = _run((X, Y), loss="ce", estimator="hutchinson", samples=3000)
    h = linear_full_hessian(W, X)
    # The error of entry i is the mean of ±H_ij over j != i and 3000 probes.
    off = np.sqrt((h**2).sum(1) - np.diag(h) ** 2)
    np.testing.assert_array_less(np.abs(res.diags[0].ravel() - np.diag(h)), 5 * off / np.sqrt(3000) + 1e-15)


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_ggn_mc_independent_of_the_split_and_unbiased(loss):
    one, _ = _run((X, Y), loss=loss, estimator="ggn-mc", samples=4, seed=9)
    three, _ = _run(_batches([2, 5, 4]), loss=loss, estimator="ggn-mc", samples=4, seed=9)
    np.testing.assert_allclose(three.diags[0], one.diags[0], rtol=1e-13)
    np.testing.assert_allclose(three.samples[0], one.samples[0], rtol=1e-13)
    other, _ = _run((X, Y), loss=loss, estimator="ggn-mc", samples=4, seed=10)
    assert not np.allclose(other.diags[0], one.diags[0], rtol=1e-3)
    many, _ = _run((X, Y), loss=loss, estimator="ggn-mc", samples=4000, seed=1)
    ref = linear_ggn_diagonal(W, X, loss)
    np.testing.assert_allclose(many.diags[0], ref, rtol=0.1, atol=0.02 * ref.max())


def test_empty_batches_do_not_change_anything():
    empty = (np.zeros((0, 4)), np.zeros(0, dtype=np.int64))
    a, _ = _run(_batches([4, 7]), estimator="ggn-mc", samples=2)
    b, _ = _run([empty, (X[:4], Y[:4]), empty, (X[4:], Y[4:]), empty], estimator="ggn-mc", samples=2)
    np.testing.assert_array_equal(a.diags[0], b.diags[0])
    assert a.metadata["batches"] == b.metadata["batches"] == 2


def test_metadata_and_details():
    res, _ = _run(_batches([4, 7]), loss="nsce", estimator="ggn-mc", samples=3, seed=5, temperature=2.0)
    meta = res.metadata
    assert set(meta) == set(METADATA_KEYS)
    assert meta["framework"] == "numpy" and meta["framework_version"] == np.__version__
    assert (meta["loss"], meta["estimator"], meta["samples"], meta["seed"], meta["temperature"]) == (
        "nsce", "ggn-mc", 3, 5, 2.0)
    assert (meta["examples"], meta["batches"], meta["world_size"]) == (11, 2, 1)
    assert (meta["dtype"], meta["device"], meta["chunk_size"], meta["memory_budget"]) == ("float64", "cpu", 7, None)
    assert meta["unsupported"] == ["odd (Odd: no extractor)"]
    assert meta["backend"] == {"kernel": "einsum", "note": "extra"}  # extras land under "backend"
    det, _ = _run((X, Y), loss="ce")
    assert det.metadata["seed"] is None and det.metadata["temperature"] is None and det.metadata["samples"] is None


def test_layer_problems_pass_groups_and_details():
    opts = validate_options(loss="ce", progress=False)
    problems, meta = driver.layer_problems(lambda: LinearSession(W, opts), (X, Y), opts)
    assert [type(p) for p in problems] == [LayerProblem, LayerProblem]
    assert [p.name for p in problems] == ["fc", "unused"]
    assert [p.kind for p in problems] == ["dense", "conv2d"]
    assert problems[1].groups == 2 and problems[0].groups == 1
    for p in problems:
        assert tuple(p.details)[: len(DETAIL_KEYS)] == DETAIL_KEYS
    assert problems[1].details["generic_reason"] == "test" and problems[1].details["path"] == "generic"
    assert problems[0].details == {"param": "fc.weight", "path": "fast", "groups": 1}
    assert set(meta) == set(METADATA_KEYS)
    diags = driver.hessian_diagonal(lambda: LinearSession(W, opts), (X, Y), opts)
    assert list(diags) == ["fc", "unused"]
    np.testing.assert_allclose(diags["fc"], linear_ggn_diagonal(W, X, "ce"), rtol=1e-13)


def test_stochastic_problems_carry_group_samples():
    opts = validate_options(estimator="hutchinson", samples=4, loss="ce", progress=False)
    problems, _ = driver.layer_problems(lambda: LinearSession(W, opts), (X, Y), opts)
    assert problems[0].hessian_diag_samples.shape == (4, 3, 4)


def test_close_after_success_error_and_interrupt():
    _, session = _run(_batches([4, 7]))
    assert session.closed == 1
    with pytest.raises(ValueError, match="update failed on batch 1"):
        _run(_batches([4, 7]), session_kw={"fail_on": 1})
    assert _run.last.closed == 1 and _run.last.updates == [0, 1]
    with pytest.raises(KeyboardInterrupt):
        _run(_batches([4, 7]), session_kw={"interrupt_on": 0})
    assert _run.last.closed == 1 and _run.last.updates == [0]


def test_a_later_batch_the_model_fails_on_gets_the_first_forwards_error():
    """A later batch whose inputs the model does not take (one feature fewer) fails inside the
    session's update; the model's own forward fails on it too, so the driver raises the first
    forward's error for that batch, the model's error chained. An update that fails where the model's
    forward runs keeps its error, and so do normflat's own errors (the session's label check)."""
    narrow = X[4:, :3]
    with pytest.raises(ValueError, match=r"The numpy model fails on the inputs of batch 1 \(float64 \(7, 3\)\): "
                                         r"ValueError: matmul") as info:
        _run([(X[:4], Y[:4]), (narrow, Y[4:])])
    assert isinstance(info.value.__cause__, ValueError) and "matmul" in str(info.value.__cause__)
    assert _run.last.closed == 1 and _run.last.updates == [0, 1]
    with pytest.raises(ValueError, match="^update failed on batch 1$"):
        _run(_batches([4, 7]), session_kw={"fail_on": 1})
    with pytest.raises(ValueError, match=r"^Batch 1: labels must be class indices"):
        _run([(X[:4], Y[:4]), (X[4:], np.full(7, 3))])


def test_close_after_data_errors():
    def gen():
        yield X[:4], Y[:4]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(gen())
    assert _run.last.closed == 1
    bad = X[4:].copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="Batch 1: the inputs contain NaN"):
        _run([(X[:4], Y[:4]), (bad, Y[4:])])
    assert _run.last.closed == 1
    with pytest.raises(ValueError, match="The data is empty"):
        _run([])
    assert _run.last.closed == 1
    with pytest.raises(ValueError, match="4 inputs but 3 labels"):
        _run((X[:4], Y[:3]))
    assert _run.last.closed == 1


def test_session_checks_reach_the_user():
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 2\]"):
        _run((X, np.full(11, 3)))
    assert _run.last.closed == 1
    with pytest.raises(ValueError, match="soft or smoothed"):
        _run((X, np.full((11, 3), 1 / 3)))


def test_make_session_failure_propagates():
    opts = validate_options(progress=False)

    def make():
        raise TypeError("no layers")

    with pytest.raises(TypeError, match="no layers"):
        driver.run(make, (X, Y), opts)


def test_non_finite_diagonal_names_the_layer():
    with np.errstate(over="ignore"), pytest.raises(ValueError, match="Layer 'fc': the Hessian diagonal is not finite"):
        _run((X * 1e160, Y), loss="ce")
    assert _run.last.closed == 1


def test_max_batches():
    res, session = _run(_batches([4, 4, 3]), max_batches=2, loss="ce")
    assert session.updates == [0, 1] and res.metadata["batches"] == 2 and res.metadata["examples"] == 8
    np.testing.assert_allclose(res.diags[0], linear_ggn_diagonal(W, X[:8], "ce"), rtol=1e-13)


def test_progress_false_prints_nothing(capsys):
    _run(_batches([4, 4, 3]), progress=False)
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_progress_true_shows_a_bar(capsys):
    _run(_batches([4, 4, 3]), progress=True)
    out, err = capsys.readouterr()
    assert "normflat ggn" in out + err  # "auto" resolved to ggn on the first batch


def test_saturated_softmax_on_every_sample_warns_once():
    """Logits so far apart that every p_top rounds to 1: the analysis warns (method §7) and
    still returns the true, tiny curvature; one batch that is not saturated silences it."""
    big = [(X[:6] * 1e4, Y[:6]), (X[6:] * 1e4, Y[6:])]
    assert losses.softmax_saturation(losses.logit_stats(np, X @ W.T * 1e4), validate_options(loss="ce"), 3,
                                     float(np.finfo(np.float64).eps)) >= 0
    with pytest.warns(UserWarning, match="saturated on every sample") as caught:
        res, _ = _run(big, loss="ce")
    assert len([w for w in caught if "saturated" in str(w.message)]) == 1
    assert caught[0].filename == __file__  # attributed to the caller
    np.testing.assert_allclose(res.diags[0], linear_ggn_diagonal(W, X * 1e4, "ce"), rtol=1e-9, atol=1e-300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run([big[0], (X[6:], Y[6:])], loss="ce")
        _run([(X, Y)], loss="ce")
