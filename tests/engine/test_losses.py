"""Losses, GGN factors and Monte-Carlo signals of :mod:`normflat.engine.losses` (method §6–§7).

Everything is checked against a straightforward float64 formula: the textbook
normalization, ``scipy.special.log_softmax``, ``diag(p) − ppᵀ`` and the
normalization's Jacobian from ``jax.jacfwd``. The namespace-generic code is run
under numpy, ``array_api_compat``'s torch namespace and ``jax.numpy``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy.special import log_softmax as scipy_log_softmax

from normflat.engine import losses, validate_options
from tests.engine._fakes import naive_normalize, nsce_jacobian, softmax

RNG = np.random.default_rng(42)


def _opts(**kw):
    kw.setdefault("estimator", "ggn")  # these tests call the signal functions of a resolved estimator
    return validate_options(progress=False, **kw)


def _hessian_blocks(p):
    return np.stack([np.diag(r) - np.outer(r, r) for r in p])


# ----------------------------------------------------------------------------- normalization


@pytest.mark.parametrize("temperature", [1.0, 0.3, 2.5])
def test_normalize_logits_equals_naive_formula(temperature):
    z = RNG.normal(size=(7, 5)) * 3 + 10
    u, zhat, sigma = losses.normalize_logits(np, z, temperature)
    zc = z - z.mean(-1, keepdims=True)
    ref_sigma = np.sqrt((zc**2).mean(-1, keepdims=True) + 1e-12)
    np.testing.assert_allclose(u, naive_normalize(z, temperature), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(zhat, zc / ref_sigma, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(sigma, ref_sigma, rtol=1e-14)
    assert sigma.shape == (7, 1)


def test_normalize_logits_keeps_epsilon_for_small_logits():
    # Centred RMS 1e-6 = √ε: the ε term halves 1/σ², which a formula without ε would miss.
    z = np.array([[1e-6, -1e-6, 1e-6, -1e-6]])
    u, _, sigma = losses.normalize_logits(np, z)
    np.testing.assert_allclose(sigma, np.sqrt(2e-12), rtol=1e-14)
    np.testing.assert_allclose(u, z / np.sqrt(2e-12), rtol=1e-14)


@pytest.mark.parametrize("scale", [1e30, 1e20, 1e-3, 1e-20, 1e-24, 1e-30])
def test_normalize_logits_float32_extreme_magnitudes(scale):
    # The float32 result must match float64 arithmetic on the same float32 values to
    # a few float32 ulps, without a floating-point warning: naive float32 arithmetic
    # overflows (1e20² = inf) or loses the ε term (m² is subnormal below ~1e-19).
    z32 = (RNG.normal(size=(6, 4)) * scale).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow warning is a bug even if the value survives
        u, zhat, sigma = losses.normalize_logits(np, z32)
    assert u.dtype == np.float32 and sigma.dtype == np.float32
    z64 = z32.astype(np.float64)
    zc = z64 - z64.mean(-1, keepdims=True)
    ref_sigma = np.sqrt((zc**2).mean(-1, keepdims=True) + 1e-12)
    ref_u = naive_normalize(z64)
    np.testing.assert_allclose(sigma, ref_sigma, rtol=1e-6)
    np.testing.assert_allclose(u, ref_u, rtol=1e-6, atol=1e-6 * np.abs(ref_u).max())


def test_normalize_logits_constant_rows():
    u, zhat, sigma = losses.normalize_logits(np, np.full((2, 3), 4.0))
    assert np.all(u == 0) and np.all(zhat == 0)
    np.testing.assert_allclose(sigma, 1e-6, rtol=1e-14)


# ----------------------------------------------------------------------------- loss


@pytest.mark.parametrize("loss,temperature", [("ce", 1.0), ("nsce", 1.0), ("nsce", 2.0)])
def test_loss_sum_equals_scipy(loss, temperature):
    z = RNG.normal(size=(9, 4)) * 2
    y = RNG.integers(0, 4, size=9)
    got = losses.loss_sum(np, z, y, _opts(loss=loss, temperature=temperature))
    u = naive_normalize(z, temperature) if loss == "nsce" else z
    ref = -scipy_log_softmax(u, axis=-1)[np.arange(9), y].sum()
    assert got == pytest.approx(ref, rel=1e-14)


def test_loss_sum_large_logits_is_finite():
    z = np.array([[1000.0, -1000.0, 0.0]])
    got = losses.loss_sum(np, z, np.array([1]), _opts(loss="ce"))
    assert got == pytest.approx(2000.0, rel=1e-14)


def test_one_hot():
    got = losses.one_hot(np, np.array([2, 0]), 3, np.float64)
    np.testing.assert_array_equal(got, [[0, 0, 1], [1, 0, 0]])


# ----------------------------------------------------------------------------- GGN factor


@pytest.mark.parametrize("c", [2, 3, 7])
def test_ggn_factor_outer_products(c):
    p = softmax(RNG.normal(size=(5, c)) * 2)
    s = losses.ggn_factor(np, p)
    assert s.shape == (c - 1, 5, c)  # C − 1 signals: the null vector √p is removed
    np.testing.assert_allclose(np.einsum("jna,jnb->nab", s, s), _hessian_blocks(p), rtol=0, atol=1e-14)


def test_ggn_factor_peaked_distribution():
    # p_C ≈ 1: the Householder vector's norm stays >= √2, no cancellation.
    p = softmax(np.array([[-30.0, -25.0, 40.0], [40.0, -30.0, -30.0]]))
    s = losses.ggn_factor(np, p)
    np.testing.assert_allclose(np.einsum("jna,jnb->nab", s, s), _hessian_blocks(p), rtol=0, atol=1e-14)


# ----------------------------------------------------------------------------- output signals


@pytest.mark.parametrize("loss,temperature", [("ce", 1.0), ("nsce", 1.0), ("nsce", 1.7)])
def test_output_signals_equal_jt_h_j(loss, temperature):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    z = RNG.normal(size=(4, 5)) * 2
    sig = losses.output_signals(np, z, _opts(loss=loss, temperature=temperature))
    assert sig.shape == (1, 4, 4, 5)
    got = np.einsum("kjna,kjnb->nab", sig, sig)

    def normalize(row):
        zc = row - jnp.mean(row)
        return temperature * zc / jnp.sqrt(jnp.mean(zc**2) + 1e-12)

    with jax.enable_x64(True):
        for i, row in enumerate(z):
            if loss == "nsce":
                jac = np.asarray(jax.jacfwd(normalize)(jnp.asarray(row, jnp.float64)))
                u = np.asarray(normalize(jnp.asarray(row, jnp.float64)))
            else:
                jac, u = np.eye(5), row
            p = softmax(u)
            ref = jac.T @ (np.diag(p) - np.outer(p, p)) @ jac
            np.testing.assert_allclose(got[i], ref, rtol=1e-12, atol=1e-14)
            # the analytic Jacobian of the test helpers is the same
            if loss == "nsce":
                np.testing.assert_allclose(nsce_jacobian(row, temperature), jac, rtol=1e-12, atol=1e-14)


def test_output_signals_ggn_mc_needs_uniforms():
    with pytest.raises(ValueError, match="uniforms"):
        losses.output_signals(np, RNG.normal(size=(2, 3)), _opts(estimator="ggn-mc"))


# ----------------------------------------------------------------------------- Monte-Carlo signals


def test_mc_signals_converge_to_the_hessian():
    p = softmax(RNG.normal(size=(3, 4)))
    draws = 40000
    u = np.random.default_rng(7).random((3, draws))
    sig = losses.mc_signals(np, p, u, 1)
    assert sig.shape == (1, draws, 3, 4)
    est = np.einsum("kmna,kmnb->nab", sig, sig)  # 1/√m scaling: the sum is the average
    ref = _hessian_blocks(p)
    # Each entry is a mean of `draws` terms bounded by 1: its standard error is at most
    # 1/√draws = 0.005; a wrong class distribution (say uniform) is off by > 0.05.
    np.testing.assert_allclose(est, ref, rtol=0, atol=0.02)
    classes = np.argmax(sig[0] * math.sqrt(draws) + p[None], axis=-1)  # (draws, n): e_ỹ recovered
    freq = np.stack([np.bincount(classes[:, i], minlength=4) for i in range(3)]) / draws
    np.testing.assert_allclose(freq, p, atol=5 * np.sqrt(0.25 / draws))


def test_mc_signals_group_scaling():
    p = softmax(RNG.normal(size=(2, 3)))
    u = RNG.random((2, 7))
    sig = losses.mc_signals(np, p, u, 3)
    assert sig.shape == (3, 3, 2, 3)  # K groups of ceil(7/3) members (zero padded)
    cls = (np.cumsum(p, -1)[:, None, :2] <= u[:, :, None]).sum(-1)  # (n, draws)
    e = np.eye(3)[cls] - p[:, None, :]  # (n, draws, C)
    for k in range(3):
        members = list(range(k, 7, 3))
        for m in range(3):
            want = e[:, members[m]] / math.sqrt(len(members)) if m < len(members) else np.zeros_like(p)
            np.testing.assert_allclose(sig[k, m], want, rtol=1e-15, atol=1e-16)
        # the group's sum of squares is the average over its members
        got = np.einsum("mna,mnb->nab", sig[k], sig[k])
        ref = np.mean([np.einsum("na,nb->nab", e[:, d], e[:, d]) for d in members], axis=0)
        np.testing.assert_allclose(got, ref, rtol=1e-14, atol=1e-16)


def test_mc_signals_exact_classes_at_cumulative_boundaries():
    p = np.array([[0.25, 0.25, 0.5], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]])
    below, above = np.nextafter(0.25, 0), 0.25
    cases = {  # uniform -> class, per row
        0: [(0.0, 0), (below, 0), (above, 1), (np.nextafter(0.5, 0), 1), (0.5, 2), (np.nextafter(1.0, 0), 2)],
        1: [(np.nextafter(0.5, 0), 0), (0.5, 2)],  # class 1 has probability 0: never drawn
        2: [(np.nextafter(1.0, 0), 1)],  # the last class has probability 0
    }
    for row, items in cases.items():
        u = np.array([[v for v, _ in items]])
        sig = losses.mc_signals(np, p[row:row + 1], u, 1)  # (1, S, 1, C)
        got = np.argmax(sig[0, :, 0] * math.sqrt(len(items)) + p[row], axis=-1)
        assert got.tolist() == [c for _, c in items], row


@pytest.mark.parametrize("classes", [2, 7, 1000])
def test_draws_compared_in_batches_draw_the_same_classes(classes, monkeypatch):
    """The draws are compared with the cumulative probabilities some at a time
    (``losses.draws_per_comparison``): every batch width, a short last batch included, draws
    each class a one-at-a-time comparison draws, for few and many classes (two at a time at
    least)."""
    p = softmax(RNG.normal(size=(3, classes)) * 3)
    u = np.random.default_rng(11).random((3, 23))
    cum = np.cumsum(p, axis=-1)
    want = np.minimum((cum[:, None, :] <= u[:, :, None] * cum[:, -1:, None]).sum(-1), classes - 1)
    default = losses.draws_per_comparison(classes)
    assert default == max(2, losses.DRAW_COMPARISON_ENTRIES // (classes - 1))
    for entries in (1, 3 * (classes - 1), 5 * (classes - 1), losses.DRAW_COMPARISON_ENTRIES):
        monkeypatch.setattr(losses, "DRAW_COMPARISON_ENTRIES", entries)
        got = losses._draw(np, p, u)
        assert got.shape == (3, 23)
        np.testing.assert_array_equal(got, want, err_msg=f"{entries} entries")


# ----------------------------------------------------------------------------- logit checks


def _check(z, loss="nsce", classes=None, dtype_eps=np.finfo(np.float64).eps, **kw):
    options = _opts(loss=loss, **kw) if isinstance(loss, str) else _opts(loss=loss, estimator="exact")
    stats = losses.logit_stats(np, np.asarray(z))
    losses.check_logit_stats(stats, options, 3, classes or np.asarray(z).shape[1], dtype_eps)


def test_logit_stats_values():
    z = np.array([[1.0, 2.0, 6.0], [0.0, -3.0, 3.0]])
    stats = losses.logit_stats(np, z)
    rms = [np.sqrt(np.mean((r - r.mean()) ** 2)) for r in z]
    gaps = [6.0 - 2.0, 3.0 - 0.0]
    np.testing.assert_allclose(stats, [1.0, -3.0, 8.0, min(rms), 6.0, min(gaps), min(np.divide(gaps, rms))],
                               rtol=1e-15)
    assert len(stats) == losses.LOGIT_STATS
    assert losses.logit_stats(np, np.array([[1.0, np.nan]]))[0] == 0
    # A tie for the top has no gap; one class has none either; a constant row neither.
    assert losses.logit_stats(np, np.array([[5.0, 5.0, 1.0], [9.0, 0.0, 1.0]]))[5] == 0
    assert losses.logit_stats(np, np.array([[5.0], [7.0]]))[5:].tolist() == [0.0, 0.0]
    assert losses.logit_stats(np, np.array([[2.0, 2.0, 2.0], [9.0, 0.0, 1.0]]))[5:].tolist() == [0.0, 0.0]


def _exact_one_minus_top(u):
    """``1 − p_top`` of each row of ``u`` from the log-sum-exp of the others (no rounding to 1)."""
    u = np.asarray(u, dtype=np.float64)
    top = u.max(axis=-1, keepdims=True)
    rest = np.where(u == top, -np.inf, u - top)
    log_rest = np.log(np.sum(np.exp(rest), axis=-1))
    return np.exp(log_rest - np.log1p(np.exp(log_rest)))


@pytest.mark.parametrize("classes", [2, 10, 1000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_saturation_bounds_one_minus_top(classes, dtype):
    """Saturated (>= 0) only where every row's 1 − p_top is at most ε, checked against the
    exact 1 − p_top; rows just past the threshold are saturated, rows well before it are not."""
    eps = float(np.finfo(dtype).eps)
    rng = np.random.default_rng(classes)
    threshold = math.log((classes - 1) / eps)
    for gap in (threshold - 5, threshold - 0.01, threshold + 0.01, threshold + 30):
        z = rng.normal(size=(8, classes)) * 0.01
        z[np.arange(8), rng.integers(0, classes, 8)] = z.max() + gap  # top class by at least ``gap``
        stats = losses.logit_stats(np, z.astype(dtype))
        value = losses.softmax_saturation(stats, _opts(loss="ce"), classes, eps)
        if value >= 0:
            assert np.all(_exact_one_minus_top(z.astype(dtype)) <= eps)
        if gap > threshold + 0.02:  # past the threshold by more than the noise: saturated
            assert value >= 0
        if gap < threshold - 1:
            assert value < 0 and np.any(_exact_one_minus_top(z) > eps / 10)


def test_softmax_saturation_of_nsce_uses_the_normalized_gap():
    """nsce sees τ ẑ: a row (√(C−1), −1/√(C−1), …) has the largest normalized gap C/√(C−1);
    raw logits scaled by any factor give the same value; a smaller temperature lowers it."""
    c = 2000
    z = np.full((2, c), -1.0)
    z[:, 0] = c - 1.0
    eps = float(np.finfo(np.float32).eps)
    values = [losses.softmax_saturation(losses.logit_stats(np, z * scale), _opts(loss="nsce"), c, eps)
              for scale in (1.0, 1e-3, 1e6)]
    np.testing.assert_allclose(values, c / math.sqrt(c - 1) - math.log((c - 1) / eps), rtol=1e-12)
    assert values[0] >= 0
    cooler = losses.softmax_saturation(losses.logit_stats(np, z), _opts(loss="nsce", temperature=0.5), c, eps)
    assert cooler < 0
    # Unscaled, the raw logits are far more saturated under ce.
    assert losses.softmax_saturation(losses.logit_stats(np, z), _opts(loss="ce"), c, eps) > values[0]
    # A custom loss and one class are never called saturated.
    custom = _opts(loss=lambda logits, y: logits.mean(), estimator="exact")
    assert losses.softmax_saturation(losses.logit_stats(np, z), custom, c, eps) == -math.inf
    assert losses.check_logit_stats(losses.logit_stats(np, z), custom, 0, c, eps) == -math.inf


def test_saturation_warning_text():
    assert losses.saturation_warning(-0.5, _opts(loss="ce")) is None
    assert losses.saturation_warning(math.inf, _opts(loss="ce")) is None  # no batch checked
    assert losses.saturation_warning(-math.inf, _opts(loss="ce")) is None
    assert "loss='nsce'" in losses.saturation_warning(0.0, _opts(loss="ce"))
    assert "temperature" in losses.saturation_warning(3.0, _opts(loss="nsce"))


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_probabilities_refused(loss):
    p = softmax(RNG.normal(size=(4, 3)))
    with pytest.raises(ValueError, match="Batch 3: the model's outputs are .* probabilities"):
        _check(p, loss)
    _check(p, lambda logits, y: logits.mean())  # a custom loss may take probabilities


def test_probabilities_float32_rounding_still_detected():
    p = softmax(RNG.normal(size=(4, 10))).astype(np.float32)
    with pytest.raises(ValueError, match="probabilities"):
        _check(p, dtype_eps=float(np.finfo(np.float32).eps))


def test_constant_logits_refused_with_nsce_only():
    z = np.zeros((3, 4))
    z[0] = [1.0, -2.0, 0.5, 3.0]  # only one row needs to be constant
    with pytest.raises(ValueError, match=r"nearly\) equal across classes"):
        _check(z, "nsce")
    _check(z, "ce")
    _check(z, lambda logits, y: logits.mean())
    # nearly constant: centred RMS 1e-5 < √(1e4 ε) = 1e-4
    with pytest.raises(ValueError, match=r"nearly\) equal across classes"):
        _check(np.array([[1.0, 1.0 + 2e-5, 1.0 - 2e-5]]), "nsce")
    _check(np.array([[1.0, 1.0 + 1e-3, 1.0 - 1e-3]]), "nsce")


def test_constant_logits_relative_to_magnitude():
    # At 1e12 the float64 resolution is ~1e-4: an RMS of 1e-3 is rounding noise only.
    with pytest.raises(ValueError, match="nearly"):
        _check(np.array([[1e12, 1e12 + 2 ** -9, 1e12 - 2 ** -9]]), "nsce")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_refused_for_every_loss(bad):
    z = RNG.normal(size=(2, 3))
    z[1, 2] = bad
    for loss in ("nsce", "ce", lambda logits, y: logits.mean()):
        with pytest.raises(ValueError, match="Batch 3: the model's logits contain NaN"):
            _check(z, loss)


def test_check_output_shape():
    o = _opts()
    assert losses.check_output_shape((5, 3), o, 0, 5) == 3
    with pytest.raises(ValueError, match=r"output has shape \(5, 3, 2, 2\)"):
        losses.check_output_shape((5, 3, 2, 2), o, 0, 5)
    with pytest.raises(ValueError, match=r"output has shape \(5,\)"):
        losses.check_output_shape((5,), o, 0, 5)
    with pytest.raises(ValueError, match="returned 4 rows of logits for 5 samples"):
        losses.check_output_shape((4, 3), o, 0, 5)
    for loss in ("nsce", "ce"):
        with pytest.raises(ValueError, match="single output unit"):
            losses.check_output_shape((5, 1), _opts(loss=loss), 0, 5)
    assert losses.check_output_shape((5, 1), _opts(loss=lambda z, y: z.mean(), estimator="exact"), 0, 5) == 1


def test_numpy_namespace_complete():
    assert losses.namespace_check(np) == []

    class Partial:
        mean = sum = np.sum

    missing = losses.namespace_check(Partial)
    assert "exp" in missing and "permute_dims" in missing and "cumulative_sum" in missing


# ----------------------------------------------------------------------------- other namespaces


def _namespaces():
    out = []
    try:
        import array_api_compat
        import torch

        out.append(pytest.param(("torch", array_api_compat.array_namespace(torch.zeros(1))), id="torch"))
    except ImportError:
        pass
    try:
        import jax.numpy as jnp

        out.append(pytest.param(("jax", jnp), id="jax"))
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("ns", _namespaces())
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_same_numbers_in_other_namespaces(ns, loss):
    name, xp = ns
    z = RNG.normal(size=(5, 4)) * 2
    y = RNG.integers(0, 4, size=5)
    u = RNG.random((5, 6))
    o_ggn, o_mc = _opts(loss=loss, temperature=1.3), _opts(loss=loss, estimator="ggn-mc", samples=6)
    ref = {
        "norm": losses.normalize_logits(np, z, 1.3)[0],
        "loss": losses.loss_sum(np, z, y, o_ggn),
        "ggn": losses.output_signals(np, z, o_ggn),
        "mc": losses.output_signals(np, z, o_mc, u),
        "stats": losses.logit_stats(np, z),
        "factor": losses.ggn_factor(np, softmax(z)),
    }

    def run(to, back):
        return {
            "norm": back(losses.normalize_logits(xp, to(z), 1.3)[0]),
            "loss": back(losses.loss_sum(xp, to(z), to(y), o_ggn)),
            "ggn": back(losses.output_signals(xp, to(z), o_ggn)),
            "mc": back(losses.output_signals(xp, to(z), o_mc, to(u))),
            "stats": back(losses.logit_stats(xp, to(z))),
            "factor": back(losses.ggn_factor(xp, to(softmax(z)))),
        }

    if name == "torch":
        import torch

        assert losses.namespace_check(xp) == []
        got = run(lambda a: torch.as_tensor(a), lambda t: t.numpy())
    else:
        import jax
        import jax.numpy as jnp

        with jax.enable_x64(True):
            assert losses.namespace_check(xp) == []
            got = run(lambda a: jnp.asarray(a), np.asarray)
            # and under jit, as the backends use it
            jitted = jax.jit(lambda a: losses.output_signals(jnp, a, o_ggn))
            np.testing.assert_allclose(np.asarray(jitted(jnp.asarray(z))), ref["ggn"], rtol=1e-13, atol=1e-15)
    for key in ref:
        assert np.asarray(got[key]).dtype == np.float64, key
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-13, atol=1e-15, err_msg=key)


def test_check_loss_value():
    custom = _opts(loss=lambda z, y: z.mean(), estimator="exact")
    losses.check_loss_value((), True, 0, custom)
    losses.check_loss_value((1,), True, 0, custom)
    with pytest.raises(TypeError, match=r"Batch 4: the loss callable returned an array of shape \(8,\)"):
        losses.check_loss_value((8,), True, 4, custom)
    for options in (custom, _opts()):
        with pytest.raises(ValueError, match="Batch 2: the loss is NaN or infinite"):
            losses.check_loss_value((), False, 2, options)


def test_one_sample_error_names_the_weights_and_quotes_the_framework():
    """The error for a model that fails on one sample alone (method §6, "Samples apart") names the
    weights that run per sample (the first five, then a count), says ``fast=False`` where that sent
    them there, and quotes the framework's error on one line: Keras' bold escapes, its wrapper line and
    the arguments it appends, and TensorFlow's op names and graph locations removed, a long message
    cut."""
    keras_like = RuntimeError(
        "Exception encountered when calling M.call().\n\n\x1b[1m{{function_node __wrapped__Reshape_device_/job:"
        "localhost/replica:0/task:0/device:CPU:0}} Input to reshape is a tensor with 5 values [Op:Reshape]\x1b[0m\n\n"
        "Arguments received by M.call():\n  • x=tf.Tensor(shape=(1, 6))")
    err = losses.one_sample_error("keras", keras_like, [f"w{i}" for i in range(7)], fast=True)
    text = str(err)
    assert isinstance(err, ValueError)
    assert "(RuntimeError: Input to reshape is a tensor with 5 values)" in text
    assert "w0, w1, w2, w3, w4 and 2 more: the generic path" in text
    assert "\x1b" not in text and "Arguments received" not in text and "Exception encountered" not in text
    assert text.endswith("Make the model's forward accept a batch of one sample.")
    off = str(losses.one_sample_error("torch", TypeError("x" * 1000), ["a"], fast=False))
    assert "(TypeError: " + "x" * 400 + " …)" in off and "fast=False: every weight on the generic path" in off
    assert off.endswith("or analyze with fast=True where every weight has a fast rule.")
    graph = RuntimeError(  # TensorFlow's error from a compiled step: the node and where it was created
        'Graph execution error:\n\nDetected at node model/dense/MatMul defined at (most recent call last):\n'
        '  File "/x/run.py", line 7, in <module>\n\n  File "/x/keras/layers/core/dense.py", line 224, in call\n\n'
        "Matrix size-incompatible: In[0]: [2,7], In[1]: [8,16]\n\t [[{{node model/dense/MatMul}}]] "
        "[Op:__inference_step_161]")
    assert losses.quoted_error(graph) == "RuntimeError: Matrix size-incompatible: In[0]: [2,7], In[1]: [8,16]"
    jax_text = str(losses.one_sample_error("jax", ValueError("")))
    assert "(ValueError: no message)" in jax_text and "the JAX backend traces the model per example" in jax_text
