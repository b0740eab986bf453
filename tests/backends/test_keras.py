"""Keras 3 / TensorFlow backend: estimators against brute-force autodiff references.

References are computed independently of the backend: the full Hessian of the
mean loss over all kernels (nested ``tape.jacobian``), and ``Jᵀ H J`` from
full per-sample Jacobians of the (normalized) logits. Everything in float64.
"""

from __future__ import annotations

from typing import Any

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import normflat  # noqa: E402
from normflat.engine.options import NSCE_EPS  # noqa: E402

L = keras.layers
F64 = "float64"


# ----------------------------------------------------------------------------- references


def _canonical(layer, kernel: np.ndarray) -> np.ndarray:
    """Variable layout -> canonical (out, in, *k), written out per layer type."""
    if isinstance(layer, L.Dense):
        return kernel.T
    if isinstance(layer, (L.DepthwiseConv2D,)):
        kh, kw, cin, m = kernel.shape
        return kernel.transpose(2, 3, 0, 1).reshape(cin * m, 1, kh, kw)
    r = kernel.ndim - 2
    return kernel.transpose((r + 1, r) + tuple(range(r)))


def _loss(z, y, loss):
    if loss == "nsce":
        zc = z - tf.reduce_mean(z, axis=1, keepdims=True)
        z = zc / tf.sqrt(tf.reduce_mean(zc**2, axis=1, keepdims=True) + NSCE_EPS)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(tf.constant(y), z))


def _u(z, loss):
    if loss == "nsce":
        zc = z - tf.reduce_mean(z, axis=1, keepdims=True)
        return zc / tf.sqrt(tf.reduce_mean(zc**2, axis=1, keepdims=True) + NSCE_EPS)
    return z


def full_hessian_diag(model, layers, x, y, loss="ce"):
    """Diagonal of the full Hessian over all kernels jointly (one big jacobian)."""
    variables = [layer.kernel.value for layer in layers]
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            value = _loss(model(x, training=False), y, loss)
        grads = inner.gradient(value, variables)
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)
    total = int(flat.shape[0])
    jac = outer.jacobian(flat, variables)
    hess = tf.concat([tf.reshape(j, [total, -1]) for j in jac], 1).numpy()
    assert np.allclose(hess, hess.T, atol=1e-10)
    diag, out, start = np.diag(hess), {}, 0
    for layer, v in zip(layers, variables):
        size = int(np.prod(v.shape))
        out[layer.name] = _canonical(layer, diag[start:start + size].reshape(v.shape))
        start += size
    return out


def brute_ggn_diag(model, layers, x, loss="ce"):
    """diag(Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n) / N from full per-sample Jacobians."""
    variables = [layer.kernel.value for layer in layers]
    with tf.GradientTape() as tape:
        u = _u(model(x, training=False), loss)
    jac = tape.jacobian(u, variables)
    p = tf.nn.softmax(u).numpy()
    hess = np.einsum("na,ab->nab", p, np.eye(p.shape[1])) - np.einsum("na,nb->nab", p, p)
    out = {}
    for layer, v, j in zip(layers, variables, jac):
        j = j.numpy().reshape(p.shape[0], p.shape[1], -1)
        d = np.einsum("nai,nab,nbi->i", j, hess, j) / p.shape[0]
        out[layer.name] = _canonical(layer, d.reshape(v.shape))
    return out


def batches(x, y, size):
    """A list of (x, y) batches of ``size`` (the last one shorter)."""
    return [(x[a:a + size], y[a:a + size]) for a in range(0, len(y), size)]


def _diag(model, data, **kw):
    kw.setdefault("progress", False)
    return {k: v.numpy() for k, v in normflat.hessian_diagonal(model, data, **kw).items()}


def _assert_same(got, ref, rtol=1e-8, atol=1e-12):
    assert list(got) == list(ref)
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        np.testing.assert_allclose(got[name], ref[name], rtol=rtol, atol=atol, err_msg=name)


# ----------------------------------------------------------------------------- models


def _seed(s):
    keras.utils.set_random_seed(s)


def tanh_mlp(seed=0):
    _seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype=F64),
        L.Dense(6, activation="tanh", dtype=F64, name="d1"),
        L.Dropout(0.5, dtype=F64),
        L.Dense(4, activation="tanh", dtype=F64, name="d2"),
        L.Dense(3, dtype=F64, name="d3"),
    ], name="tanh_mlp")


def relu_mlp(seed=1):
    _seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype=F64),
        L.Dense(7, activation="relu", dtype=F64, name="r1"),
        L.Dense(6, dtype=F64, name="r2"),
        L.ReLU(dtype=F64),
        L.Dense(3, dtype=F64, name="r3"),
    ], name="relu_mlp")


def relu_cnn(seed=2):
    _seed(seed)
    inp = keras.Input((6, 6, 2), dtype=F64)
    h = L.Conv2D(3, 3, padding="same", activation="relu", dtype=F64, name="c1")(inp)
    h = L.MaxPooling2D(2, dtype=F64)(h)
    h = L.Conv2D(4, 2, strides=1, padding="valid", dtype=F64, name="c2")(h)
    h = L.ReLU(dtype=F64)(h)
    h = L.Flatten(dtype=F64)(h)
    out = L.Dense(3, dtype=F64, name="head")(h)
    return keras.Model(inp, out, name="relu_cnn")


def bn_residual_cnn(seed=3):
    """Conv-BN-tanh, residual conv block with BN, dropout, dense head."""
    _seed(seed)
    inp = keras.Input((5, 5, 2), dtype=F64)
    h = L.Conv2D(3, 3, padding="same", use_bias=False, dtype=F64, name="stem")(inp)
    h = L.BatchNormalization(dtype=F64, name="bn0")(h)
    h = L.Activation("tanh", dtype=F64)(h)
    r = L.Conv2D(3, 3, padding="same", dtype=F64, name="body")(h)
    r = L.BatchNormalization(dtype=F64, name="bn1")(r)
    h = L.Add(dtype=F64)([h, r])
    h = L.GlobalAveragePooling2D(dtype=F64)(h)
    h = L.Dropout(0.3, dtype=F64)(h)
    out = L.Dense(3, dtype=F64, name="head")(h)
    model = keras.Model(inp, out, name="bn_residual_cnn")
    rng = np.random.default_rng(seed)
    for bn in (model.get_layer("bn0"), model.get_layer("bn1")):  # non-trivial inference statistics
        bn.set_weights([1 + 0.2 * rng.normal(size=3), 0.1 * rng.normal(size=3), 0.1 * rng.normal(size=3),
                        0.5 + rng.random(3)])
    return model


def kernels(model):
    return [l for l in model._flatten_layers(include_self=False) if hasattr(l, "kernel")]


def data_for(model, n=10, seed=0, classes=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *model.inputs[0].shape[1:]))
    return x, rng.integers(0, classes, size=n)


# ----------------------------------------------------------------------------- exact / ggn correctness


@pytest.mark.parametrize("make", [tanh_mlp, bn_residual_cnn])
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_exact_equals_full_hessian_diagonal(make, loss):
    model = make()
    x, y = data_for(model)
    ref = full_hessian_diag(model, kernels(model), x, y, loss)
    # Uneven batches (4, 4, 2): the Hessian is that of the mean over all samples.
    got = _diag(model, batches(x, y, 4), loss=loss, estimator="exact")
    _assert_same(got, ref)


def test_exact_with_layernorm_matches_finite_differences():
    """LayerNorm's TF moments stop a gradient; normflat must still get second derivatives right."""
    _seed(4)
    model = keras.Sequential([keras.Input((4,), dtype=F64), L.Dense(5, use_bias=False, dtype=F64, name="a"),
                              L.LayerNormalization(epsilon=0.0, dtype=F64), L.Activation("tanh", dtype=F64),
                              L.Dense(3, dtype=F64, name="b")])
    x, y = data_for(model, n=8)
    got = _diag(model, (x, y), loss="ce", estimator="exact")["a"]
    kernel = model.get_layer("a").kernel

    def loss_at(w):
        kernel.assign(w)
        return float(_loss(model(x, training=False), y, "ce"))

    w0, h = kernel.numpy().copy(), 1e-4
    try:
        for i, o in [(0, 0), (2, 3), (3, 4)]:
            e = np.zeros_like(w0)
            e[i, o] = h
            fd = (loss_at(w0 + e) - 2 * loss_at(w0) + loss_at(w0 - e)) / h**2
            assert got[o, i] == pytest.approx(fd, rel=1e-5, abs=1e-7)
    finally:
        kernel.assign(w0)


@pytest.mark.parametrize("make", [relu_mlp, relu_cnn])
def test_ggn_equals_hessian_on_relu_nets_with_ce(make):
    model = make()
    x, y = data_for(model, n=9)
    ref = full_hessian_diag(model, kernels(model), x, y, "ce")
    _assert_same(_diag(model, batches(x, y, 4), loss="ce", estimator="ggn"), ref)


def conv_zoo(seed=5):
    """Convolutions of every rank/padding/stride/dilation/groups, Dense on a sequence, LayerNorm."""
    _seed(seed)
    inp = keras.Input((9, 4), dtype=F64)
    h = L.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="tanh", dtype=F64, name="c1d")(inp)
    h = L.Conv1D(4, 2, strides=2, padding="same", groups=2, dtype=F64, name="c1d_grouped")(h)
    h = L.Dense(5, activation="tanh", dtype=F64, name="seq_dense")(h)  # (n, 5, 5) input
    h = L.LayerNormalization(dtype=F64)(h)
    h = L.Reshape((5, 5, 1), dtype=F64)(h)
    h = L.Conv2D(4, (3, 2), strides=(2, 1), padding="same", activation="tanh", dtype=F64, name="c2d")(h)
    h = L.Conv2D(4, 2, dilation_rate=(1, 2), groups=2, dtype=F64, name="c2d_grouped")(h)
    h = L.DepthwiseConv2D(2, depth_multiplier=2, padding="same", dtype=F64, name="depthwise")(h)
    h = L.Reshape((2, 2, 3, 4), dtype=F64)(h)
    h = L.Conv3D(3, 2, padding="same", activation="tanh", dtype=F64, name="c3d")(h)
    h = L.Flatten(dtype=F64)(h)
    out = L.Dense(3, dtype=F64, name="head")(h)
    return keras.Model(inp, out, name="zoo")


def ungrouped_reference(model):
    """Same function with grouped convolutions as dense block-diagonal ones.

    TensorFlow cannot differentiate grouped convolutions on CPU; the GGN diagonal
    of a grouped kernel entry equals that of the same entry of the block-diagonal
    kernel, so the reference is taken there and the blocks are read back.
    """
    def clone(layer):
        config = layer.get_config()
        if config.get("groups", 1) > 1:
            config["groups"] = 1
        return type(layer).from_config(config)

    ref = keras.models.clone_model(model, clone_function=clone)
    for src, dst in zip(model.layers, ref.layers):
        weights = src.get_weights()
        groups = getattr(src, "groups", 1)
        if groups > 1:
            k = weights[0]
            cin_g, cout = k.shape[-2], k.shape[-1]
            full = np.zeros(k.shape[:-2] + (cin_g * groups, cout))
            cout_g = cout // groups
            for g in range(groups):
                full[..., g * cin_g:(g + 1) * cin_g, g * cout_g:(g + 1) * cout_g] = k[..., g * cout_g:(g + 1) * cout_g]
            weights[0] = full
        dst.set_weights(weights)
    return ref


def regroup(model, diag):
    out = {}
    for name, value in diag.items():
        layer = model.get_layer(name)
        groups = getattr(layer, "groups", 1)
        if groups > 1:
            cout, cin = value.shape[:2]
            cin_g, cout_g = cin // groups, cout // groups
            value = np.concatenate([value[g * cout_g:(g + 1) * cout_g, g * cin_g:(g + 1) * cin_g]
                                    for g in range(groups)], axis=0)
        out[name] = value
    return out


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_ggn_equals_brute_force_jthj_on_smooth_nets(loss):
    model = conv_zoo()
    x, _ = data_for(model, n=6)
    y = np.arange(6) % 3
    reference = ungrouped_reference(model)
    np.testing.assert_allclose(reference(x).numpy(), model(x).numpy(), rtol=1e-12)
    ref = regroup(model, brute_ggn_diag(reference, kernels(reference), x, loss))
    report = normflat.analyze(model, batches(x, y, 4), loss=loss, estimator="ggn", progress=False)
    paths = {l.name: l.details["path"] for l in report.layers}
    assert paths["c2d"] == paths["c1d"] == paths["seq_dense"] == paths["c1d_grouped"] == "fast"
    assert paths["depthwise"] == "fast"
    _assert_same(_diag(model, batches(x, y, 4), loss=loss), ref)
    # The generic per-sample Jacobian path gives the same numbers.
    _assert_same(_diag(model, (x, y), loss=loss, chunk_size=4, fast=False), ref)


def test_ggn_on_bn_residual_nsce_and_separable_conv():
    model = bn_residual_cnn()
    x, y = data_for(model, n=7)
    _assert_same(_diag(model, (x, y), loss="nsce", chunk_size=3), brute_ggn_diag(model, kernels(model), x, "nsce"))
    _seed(6)
    inp = keras.Input((5, 5, 2), dtype=F64)
    sep = L.SeparableConv2D(3, 3, depth_multiplier=2, activation="tanh", dtype=F64, name="sep")
    out = L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(sep(inp)))
    model = keras.Model(inp, out)
    x, y = data_for(model, n=5)
    got = _diag(model, (x, y), loss="ce")
    assert list(got) == ["sep/depthwise", "sep/pointwise", "head"]
    with tf.GradientTape() as tape:
        u = model(x, training=False)
    ws = [sep.depthwise_kernel.value, sep.pointwise_kernel.value]
    p = tf.nn.softmax(u).numpy()
    hess = np.einsum("na,ab->nab", p, np.eye(3)) - np.einsum("na,nb->nab", p, p)
    dw, pw = [(np.einsum("nai,nab,nbi->i", j, hess, j) / 5).reshape(w.shape)
              for j, w in zip([j.numpy().reshape(5, 3, -1) for j in tape.jacobian(u, ws)], ws)]
    np.testing.assert_allclose(got["sep/depthwise"], dw.transpose(2, 3, 0, 1).reshape(4, 1, 3, 3), rtol=1e-8)
    np.testing.assert_allclose(got["sep/pointwise"], pw.transpose(3, 2, 0, 1), rtol=1e-8)


# ----------------------------------------------------------------------------- stochastic estimators


class _ReadsKernel(keras.layers.Layer):
    """Adds ``x @ other.kernel``: reads another layer's weight a second time (a hand-tied weight)."""

    def __init__(self, other, **kwargs):
        super().__init__(**kwargs)
        self.other = other

    def call(self, x):
        return x + keras.ops.matmul(x, self.other.kernel)


def _weight_read_twice(kind):
    """A model whose first layer's weight is also read by another layer: a square ``Dense``, or a
    ``Conv1D`` / ``EinsumDense`` of one feature map, through ``_ReadsKernel``."""
    _seed(7)
    if kind == "conv":
        inp = keras.Input((3, 4), dtype=F64)
        first = keras.layers.Conv1D(4, 1, activation="tanh", dtype=F64, name="first")
        h = first(inp)
        h = _ReadsKernelConv(first, dtype=F64, name="reuse")(h)
        h = keras.layers.Flatten(dtype=F64)(h)
    else:
        inp = keras.Input((4,), dtype=F64)
        first = (keras.layers.Dense(4, activation="tanh", dtype=F64, name="first") if kind == "dense" else
                 keras.layers.EinsumDense("ab,bc->ac", output_shape=4, activation="tanh", dtype=F64, name="first"))
        h = first(inp)
        h = _ReadsKernel(first, dtype=F64, name="reuse")(h)
    out = keras.layers.Dense(3, dtype=F64, name="head")(h)
    return keras.Model(inp, out), first


class _ReadsKernelConv(keras.layers.Layer):
    """Adds the 1×1 convolution of ``other``'s kernel to its input (a second read of it)."""

    def __init__(self, other, **kwargs):
        super().__init__(**kwargs)
        self.other = other

    def call(self, x):
        return x + keras.ops.matmul(x, self.other.kernel[0])


@pytest.mark.parametrize("kind", ["dense", "conv", "einsum"])
def test_weight_also_read_outside_its_layer_takes_the_generic_path(kind):
    """A fast rule forms a weight's squares from its own layer's input and pre-activation: a
    weight another layer reads too would miss that use's share of every per-sample gradient (a
    silent wrong diagonal). The first forward sees the second read (the layer's own read carries
    no gradient then) and sends the weight to the generic path, exact against brute force."""
    model, first = _weight_read_twice(kind)
    x, y = data_for(model, n=5)
    report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    details = report.layer("first").details
    assert details["path"] == "generic"
    assert "also used outside its layer's call" in details["generic_reason"]
    assert report.layer("head").details["path"] == "fast"
    got = _diag(model, batches(x, y, 2), loss="ce", estimator="ggn")
    ref = brute_ggn_diag(model, [first, model.get_layer("head")], x)
    _assert_same(got, ref, rtol=1e-10, atol=1e-13)


def test_ggn_mc_is_unbiased_and_reports_standard_errors():
    model = tanh_mlp()
    x, y = data_for(model, n=6)
    ggn = _diag(model, (x, y), loss="nsce")
    # 6 examples × 1500 draws: a relative standard deviation of about 2 % per entry, inside the 12 %.
    # The report's trace against its own standard error: fewer draws suffice (5 standard errors at any count).
    mc = normflat.analyze(model, (x, y), loss="nsce", estimator="ggn-mc", samples=300, progress=False)
    mc_diag = _diag(model, (x, y), loss="nsce", estimator="ggn-mc", samples=1500)
    for name in ggn:
        np.testing.assert_allclose(mc_diag[name], ggn[name], rtol=0.12, atol=2e-3 * np.abs(ggn[name]).max())
    assert mc.standard_error is not None and mc.standard_error["hessian_trace"] > 0
    exact_trace = sum(v.sum() for v in ggn.values())
    assert abs(mc.hessian_trace - exact_trace) < 5 * mc.standard_error["hessian_trace"]
    # Same seed, same numbers; another seed, other numbers (a few draws suffice to tell).
    few = _diag(model, (x, y), loss="nsce", estimator="ggn-mc", samples=20)
    again = _diag(model, (x, y), loss="nsce", estimator="ggn-mc", samples=20)
    other = _diag(model, (x, y), loss="nsce", estimator="ggn-mc", samples=20, seed=1)
    np.testing.assert_array_equal(again["d1"], few["d1"])
    assert not np.array_equal(other["d1"], few["d1"])
    one = normflat.analyze(model, (x, y), estimator="ggn-mc", progress=False)  # samples=1: no error bars
    assert one.standard_error is None


def test_hutchinson_is_unbiased_with_standard_errors():
    model = tanh_mlp()
    x, y = data_for(model, n=6)
    exact = _diag(model, (x, y), loss="ce", estimator="exact")
    rep = normflat.analyze(model, batches(x, y, 4), loss="ce", estimator="hutchinson", samples=300,
                           progress=False)
    exact_trace = sum(v.sum() for v in exact.values())
    se = rep.standard_error["hessian_trace"]
    assert se > 0 and abs(rep.hessian_trace - exact_trace) < 5 * se
    for layer in rep.layers:
        assert abs(layer.hessian_trace - exact[layer.name].sum()) < 5 * layer.standard_error["hessian_trace"]


# ----------------------------------------------------------------------------- model kinds, data forms


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="sub", dtype=F64)
        self.d1 = L.Dense(6, activation="tanh", dtype=F64, name="d1")
        self.drop = L.Dropout(0.5, dtype=F64)
        self.d2 = L.Dense(4, activation="tanh", dtype=F64, name="d2")
        self.d3 = L.Dense(3, dtype=F64, name="d3")

    def call(self, x, training=False):
        return self.d3(self.d2(self.drop(self.d1(x), training=training)))


def test_sequential_functional_subclassed_nested_agree():
    seq = tanh_mlp()
    weights = seq.get_weights()
    x, y = data_for(seq)
    ref = _diag(seq, (x, y))
    inp = keras.Input((5,), dtype=F64)
    h = inp
    for layer in (L.Dense(6, activation="tanh", dtype=F64, name="d1"),
                  L.Dense(4, activation="tanh", dtype=F64, name="d2"), L.Dense(3, dtype=F64, name="d3")):
        h = layer(h)
    functional = keras.Model(inp, h)
    functional.set_weights(weights)
    sub = Subclassed()
    sub(x[:1])
    sub.set_weights(weights)
    inner = keras.Sequential([keras.Input((6,), dtype=F64), L.Dense(4, activation="tanh", dtype=F64, name="d2"),
                              L.Dense(3, dtype=F64, name="d3")], name="inner")
    outer_in = keras.Input((5,), dtype=F64)
    nested = keras.Model(outer_in, inner(L.Dense(6, activation="tanh", dtype=F64, name="d1")(outer_in)))
    nested.set_weights(weights)
    for model in (functional, sub):
        _assert_same(_diag(model, (x, y)), ref, rtol=1e-12)
    got = _diag(nested, (x, y))
    assert list(got) == ["d1", "inner/d2", "inner/d3"]
    for (name, value), expected in zip(got.items(), ref.values()):
        np.testing.assert_allclose(value, expected, rtol=1e-12, err_msg=name)


def test_data_forms_and_label_encodings_agree():
    model = tanh_mlp()
    x, y = data_for(model, n=11)
    ref = _diag(model, (x, y))
    onehot = np.eye(3)[y]
    forms = [
        tf.data.Dataset.from_tensor_slices((x, y)).batch(4),
        tf.data.Dataset.from_tensor_slices((x, onehot)).batch(5),
        [(x[:3], y[:3]), (x[3:], y[3:])],
        (tf.constant(x), tf.constant(y.reshape(-1, 1))),
        (x, y.astype(np.float32)),
        ((xb, yb) for xb, yb in [(x[:6], onehot[:6]), (x[6:], onehot[6:])]),
    ]
    for data in forms:
        _assert_same(_diag(model, data), ref, rtol=1e-12)
    report = normflat.analyze(model, batches(x, y, 4), max_batches=2, progress=False)
    assert report.metadata["examples"] == 8 and report.metadata["batches"] == 2
    # A two-input functional model fed a dict of arrays, and a list of arrays.
    a_in, b_in = keras.Input((2,), dtype=F64, name="a"), keras.Input((3,), dtype=F64, name="b")
    merged = L.Concatenate(dtype=F64)([a_in, b_in])
    two = keras.Model({"a": a_in, "b": b_in}, model.layers[-1](model.layers[-2](model.layers[0](merged))))
    got = _diag(two, ({"a": x[:, :2], "b": x[:, 2:]}, y), chunk_size=4)
    _assert_same(got, {k: ref[k] for k in ("d1", "d2", "d3")}, rtol=1e-12)


def test_final_softmax_is_stripped():
    logits_model = tanh_mlp()
    x, y = data_for(logits_model)
    softmax_model = keras.Sequential([keras.Input((5,), dtype=F64)] + logits_model.layers[:-1]
                                     + [L.Dense(3, activation="softmax", dtype=F64, name="d3")])
    softmax_model.layers[-1].set_weights(logits_model.layers[-1].get_weights())
    layer_model = keras.Sequential([keras.Input((5,), dtype=F64), logits_model, L.Softmax(dtype=F64)])
    ref = _diag(logits_model, (x, y), estimator="exact")
    for model in (softmax_model, layer_model):
        rep = normflat.analyze(model, (x, y), estimator="exact", progress=False)
        assert rep.metadata["backend"]["stripped_softmax"]
        got = {l.name.split("/")[-1]: l.hessian_trace for l in rep.layers}
        for name, value in ref.items():
            assert got[name] == pytest.approx(value.sum(), rel=1e-10)
    assert softmax_model.layers[-1].activation is keras.activations.softmax  # restored
    np.testing.assert_allclose(softmax_model(x).numpy().sum(1), 1.0)

    class Probabilities(keras.Model):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def call(self, x):
            return tf.nn.softmax(self.inner(x))

    with pytest.raises(ValueError, match="probabilities"):
        normflat.analyze(Probabilities(logits_model), (x, y), progress=False)


def test_float32_model_close_to_float64():
    model64 = relu_cnn()
    _seed(2)
    inp = keras.Input((6, 6, 2))
    h = L.Conv2D(3, 3, padding="same", activation="relu", name="c1")(inp)
    h = L.MaxPooling2D(2)(h)
    h = L.ReLU()(L.Conv2D(4, 2, name="c2")(h))
    model32 = keras.Model(inp, L.Dense(3, name="head")(L.Flatten()(h)))
    model32.set_weights([w.astype(np.float32) for w in model64.get_weights()])
    x, y = data_for(model64, n=8)
    for estimator in ("ggn", "exact"):
        r64 = normflat.analyze(model64, (x, y), estimator=estimator, progress=False)
        r32 = normflat.analyze(model32, (x.astype(np.float32), y), estimator=estimator, progress=False)
        assert r32.metadata["dtype"] == "float32"
        assert r32.normalized_sharpness == pytest.approx(r64.normalized_sharpness, rel=1e-4)
    h32 = normflat.hessian_diagonal(model32, (x, y), progress=False)
    assert all(v.dtype == tf.float32 for v in h32.values())


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_policy_is_analyzed_in_the_variables_dtype(policy):
    """Layers under a mixed precision policy (float32 variables, half-precision compute) are analyzed
    in float32, as PyTorch under an enclosing autocast: every estimator, the hessian diagonal and the
    measures equal the float32 model's exactly, and the policies are back afterwards (the model
    computes in half precision again). Before, the analysis ran in half precision (1e-4 to 4e-3 off)
    and reported float32."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 6, 6, 2)).astype(np.float32), rng.integers(0, 3, 24)

    def make(dtype):
        _seed(3)
        inp = keras.Input((6, 6, 2))
        h = L.Conv2D(3, 3, activation="tanh", dtype=dtype, name="conv")(inp)
        h = L.LayerNormalization(dtype=dtype, name="norm")(L.Flatten(dtype=dtype)(h))
        h = L.Dense(5, activation="tanh", dtype=dtype, name="hidden")(h)
        return keras.Model(inp, L.Dense(3, dtype=dtype, name="head")(h))

    plain, mixed = make("float32"), make(policy)
    mixed.set_weights(plain.get_weights())
    half = mixed(x[:2])
    assert half.dtype == policy.split("_")[1] and plain(x[:2]).dtype == "float32"
    # Every estimator under one policy, the GGN under the other (the suite's time).
    for estimator in ("ggn", "hutchinson", "exact") if policy == "mixed_bfloat16" else ("ggn",):
        want = normflat.analyze(plain, (x, y), estimator=estimator, progress=False)
        got = normflat.analyze(mixed, (x, y), estimator=estimator, progress=False)
        assert got.metadata["dtype"] == "float32"
        assert got.normalized_sharpness == want.normalized_sharpness
        assert got.hessian_trace == want.hessian_trace
    want_diag = normflat.hessian_diagonal(plain, (x, y), progress=False)
    got_diag = normflat.hessian_diagonal(mixed, (x, y), progress=False)
    assert all(np.array_equal(got_diag[k].numpy(), want_diag[k].numpy()) for k in want_diag)
    measures = ["fisher_rao_norm", "adaptive_sharpness"]
    want_m = normflat.measures(plain, (x, y), measures, progress=False)
    got_m = normflat.measures(mixed, (x, y), measures, progress=False)
    assert [got_m[m] for m in measures] == [want_m[m] for m in measures]
    assert all(layer.dtype_policy.name == policy for layer in mixed.layers[1:])
    np.testing.assert_array_equal(np.asarray(mixed(x[:2])), np.asarray(half))


def test_register_layer_and_on_unsupported():
    from normflat.backends import keras as kb

    class Scale(L.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 3), dtype=F64)

        def call(self, x):
            return x @ self.w

    class Mix(L.Layer):  # unregistered too, with a weight matrix
        def build(self, shape):
            self.m = self.add_weight(shape=(shape[-1], 5), dtype=F64)

        def call(self, x):
            return x @ self.m

    _seed(7)
    inp = keras.Input((4,), dtype=F64)
    einsum = Mix(dtype=F64, name="einsum")
    scale = Scale(dtype=F64, name="scale")
    model = keras.Model(inp, scale(L.Dense(4, activation="tanh", dtype=F64, name="d")(einsum(inp))))
    x, y = data_for(model, n=5)
    with pytest.raises(ValueError, match="einsum.*scale|scale.*einsum"):
        normflat.analyze(model, (x, y), on_unsupported="error", progress=False)
    with pytest.warns(UserWarning, match="einsum"):
        rep = normflat.analyze(model, (x, y), on_unsupported="warn", progress=False)
    assert [l.name for l in rep.layers] == ["d"]
    kb.register_layer(Scale, lambda layer: [kb.KerasWeight(layer.w, lambda t: tf.transpose(t), "dense")])
    try:
        got = _diag(model, (x, y), on_unsupported="skip", loss="ce")
    finally:
        kb.layers.REGISTRY.unregister(Scale)
    assert list(got) == ["d", "scale"]
    with tf.GradientTape() as tape:
        u = model(x, training=False)
    jac = tape.jacobian(u, [model.get_layer("d").kernel.value, scale.w.value])
    p = tf.nn.softmax(u).numpy()
    hess = np.einsum("na,ab->nab", p, np.eye(3)) - np.einsum("na,nb->nab", p, p)
    j = jac[1].numpy().reshape(5, 3, -1)
    ref = (np.einsum("nai,nab,nbi->i", j, hess, j) / 5).reshape(4, 3).T
    np.testing.assert_allclose(got["scale"], ref, rtol=1e-8)


# ----------------------------------------------------------------------------- guarantees and errors


def _snapshot(model):
    return ([v.numpy().copy() for v in model.variables], [l.trainable for l in model._flatten_layers()],
            [v.numpy().copy() for v in model.optimizer.variables],
            {id(l): dict(l.__dict__) for l in model._flatten_layers()})


def _assert_snapshot(model, snap):
    weights, trainable, opt, dicts = snap
    for a, b in zip(weights, [v.numpy() for v in model.variables]):
        np.testing.assert_array_equal(a, b)
    assert trainable == [l.trainable for l in model._flatten_layers()]
    for a, b in zip(opt, [v.numpy() for v in model.optimizer.variables]):
        np.testing.assert_array_equal(a, b)
    for layer in model._flatten_layers():
        before = dicts[id(layer)]
        assert set(layer.__dict__) == set(before), layer.name
        for key in ("call", "activation", "convolution_op"):
            assert layer.__dict__.get(key) is before.get(key), (layer.name, key)


def test_model_untouched_also_after_errors():
    model = bn_residual_cnn()
    x, y = data_for(model, n=8)
    model.get_layer("body").trainable = False  # a frozen kernel is analyzed too, and stays frozen
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(True))
    model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    snap = _snapshot(model)
    rng_before = tf.random.uniform([3], seed=None)  # global RNG streams are not reseeded
    for estimator, kw in [("ggn", {}), ("ggn-mc", {"samples": 3}), ("hutchinson", {"samples": 3}), ("exact", {})]:
        rep = normflat.analyze(model, (x, y), estimator=estimator, progress=False, **kw)
        assert [l.name for l in rep.layers] == ["stem", "body", "head"]
        assert rep.layers[1].hessian_trace != 0
        _assert_snapshot(model, snap)
    with pytest.raises(ValueError, match="class indices in"):
        normflat.analyze(model, (x, y + 5), progress=False)
    _assert_snapshot(model, snap)
    assert not model.get_layer("body").trainable
    assert not np.array_equal(tf.random.uniform([3]).numpy(), rng_before.numpy())


def test_bad_inputs_have_clear_errors():
    model = tanh_mlp()
    x, y = data_for(model)
    unbuilt = keras.Sequential([L.Dense(3)])
    with pytest.raises(ValueError, match="not built"):
        normflat.analyze(unbuilt, (x, y), progress=False)
    with pytest.raises(ValueError, match="empty"):
        normflat.analyze(model, tf.data.Dataset.from_tensor_slices((x, y)).take(0).batch(2), progress=False)
    with pytest.raises(ValueError, match=r"class indices in \[0, 2\]"):
        normflat.analyze(model, (x, y + 1), progress=False)
    with pytest.raises(ValueError, match="class indices in"):
        normflat.analyze(model, (x, -y - 1), progress=False)
    bad = x.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        normflat.analyze(model, (bad, y), progress=False)
    with pytest.raises(ValueError, match=r"Unknown layer name.*nope.*d1"):
        normflat.analyze(model, (x, y), layers=["d1", "nope"], progress=False)
    assert [l.name for l in normflat.analyze(model, (x, y), layers=["d2"], progress=False).layers] == ["d2"]
    with pytest.raises(TypeError, match="Unknown Keras backend option"):
        normflat.analyze(model, (x, y), batchsize=3, progress=False)
    with pytest.raises(ValueError, match="labels have shape"):
        normflat.analyze(model, (x, np.zeros((10, 4))), progress=False)
    with pytest.raises(TypeError, match=r"\(x, y\) pair"):
        normflat.analyze(model, [x[:2], x[2:4], x[4:]], progress=False)
    with pytest.raises(ValueError, match="force=True"):
        normflat.analyze(model, (x, y), estimator="exact", max_exact_params=10, progress=False)
    assert normflat.analyze(model, (x, y), estimator="exact", max_exact_params=10, force=True,
                            progress=False).hessian_trace != 0
    with pytest.raises(ValueError, match="Unknown estimator"):
        normflat.analyze(model, (x, y), estimator="nope", progress=False)


def test_custom_loss_callable():
    model = tanh_mlp()
    x, y = data_for(model)

    def my_ce(logits, labels):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    got = _diag(model, (x, y), loss=my_ce, estimator="exact")
    _assert_same(got, full_hessian_diag(model, kernels(model), x, y, "ce"))


def test_progress_bar_runs(capsys):
    model = tanh_mlp()
    x, y = data_for(model)
    normflat.analyze(model, batches(x, y, 4), progress=True)
    assert "normflat ggn" in capsys.readouterr().err


def _run_in_python(code: str, timeout: int, **env: str) -> Any:
    """``code`` run by a fresh interpreter at the repository root with ``env`` added to the environment."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_keras_on_the_torch_backend_gets_a_clear_error():
    """Keras' torch backend is refused with the cause and the fix (its JAX backend is analyzed:
    ``tests/backends/test_keras_on_jax.py``)."""
    code = (
        "import keras, numpy as np, normflat\n"
        "m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "try:\n"
        "    normflat.analyze(m, (np.ones((4, 3)), np.array([0, 1, 0, 1])), progress=False)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    out = _run_in_python(code, 180, KERAS_BACKEND="torch")
    assert "ERR" in out.stdout, out.stderr[-2000:]
    assert "'torch'" in out.stdout and "KERAS_BACKEND=tensorflow" in out.stdout and "jax" in out.stdout


@pytest.mark.parametrize("estimator, options", [("ggn-mc", dict(samples=6)), ("hutchinson", dict(samples=7))])
def test_convolution_groups_kept_as_kernel_sums_give_the_full_groups_report(monkeypatch, estimator, options):
    """analyze keeps the groups of a convolution, a depthwise and a separable one as kernel sums
    (method §6.2, memory of the groups), on the GGN path (canonical sums) and the Hessian-vector
    products' (the variable's layout): the report is the one from the full groups."""
    from normflat.backends import keras as kb
    from normflat.backends.keras.session import KerasSession
    from normflat.engine.options import validate_options

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6, 6, 3)), keras.layers.Conv2D(4, 3, padding="same", dtype="float64"),
        keras.layers.DepthwiseConv2D(3, dtype="float64"), keras.layers.SeparableConv2D(3, 2, dtype="float64"),
        keras.layers.Flatten(dtype="float64"), keras.layers.Dense(12, dtype="float64"),
    ])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6, 6, 3)), rng.integers(0, 12, 16)
    data = [(x[:8], y[:8]), (x[8:], y[8:])]
    kw = dict(loss="ce", estimator=estimator, progress=False, **options)
    problems, _ = kb.layer_problems(model, data, validate_options(**kw))
    summed = normflat.analyze(problems)
    k = validate_options(**kw).groups
    assert [tuple(p.hessian_diag_samples.shape) for p in problems] == [
        (k, 4, 3, 1, 1), (k, 4, 1, 1, 1), (k, 4, 1, 1, 1), (k, 3, 4, 1, 1), (k, 12, 27)]
    monkeypatch.setattr(KerasSession, "kernel_axes", lambda self, layer: ())
    full = normflat.analyze(model, data, **kw)
    for a, b in zip(summed.layers, full.layers):
        assert a.normalized_sharpness == pytest.approx(b.normalized_sharpness, rel=1e-13)
        for m, se in b.standard_error.items():
            assert se > 0
            assert a.standard_error[m] == pytest.approx(se, rel=1e-12), (a.name, m)


def test_generic_embedding_beside_attention_runs_and_equals_the_fast_path():
    """An embedding on the generic path beside an attention layer (a 2000-row table of 128 features,
    32 tokens): TensorFlow's vectorized per-sample gradients of that lookup crashed the process with
    its default oneDNN kernels (a segmentation fault); the generic path now takes one sample at a
    time, through its own forward. In a subprocess with those kernels on, so a crash fails this
    test instead of the run, and with the fast path's numbers."""
    code = (
        "import keras, numpy as np, normflat\n"
        "keras.utils.set_random_seed(0)\n"
        "ids = keras.Input((32,), dtype='int32')\n"
        "h = keras.layers.Embedding(2000, 128, name='emb')(ids)\n"
        "h = keras.layers.MultiHeadAttention(2, 64, name='mha')(h, h)\n"
        "m = keras.Model(ids, keras.layers.Dense(10, name='head')(h[:, 0]))\n"
        "g = np.random.default_rng(0)\n"
        "data = (g.integers(0, 2000, (2, 32)).astype('int32'), g.integers(0, 10, 2))\n"
        "slow = normflat.hessian_diagonal(m, data, estimator='ggn', progress=False, fast=False)\n"
        "fast = normflat.hessian_diagonal(m, data, estimator='ggn', progress=False)\n"
        "print('DIFF', max(float(np.abs(np.asarray(fast[k]) - np.asarray(slow[k])).max()"
        " / np.abs(np.asarray(slow[k])).max()) for k in fast))\n"
    )
    # TensorFlow's default oneDNN kernels, which the crash was in (the test session turns them off).
    out = _run_in_python(code, 300, KERAS_BACKEND="tensorflow", TF_ENABLE_ONEDNN_OPTS="1")
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    diff = float(out.stdout.split("DIFF")[-1])
    assert diff < 1e-4, diff  # float32, the two paths' own orders of summation


@pytest.mark.parametrize("kind", ["plain", "attention", "recurrent"])
def test_generic_path_forms_each_samples_gradients_from_its_own_forward(kind, monkeypatch):
    """The generic path's per-sample gradients come from each sample's own forward, one sample at a
    time (``ggn._generic_squares``): the step traces the model on the chunk (its fast layers'
    signals) and once more on one sample, never on the chunk's signals through all its samples;
    the numbers those of the fast path. Beside an attention layer, an embedding on the generic path,
    a recurrent layer (whose vectorized per-sample gradients crashed TensorFlow or compiled for
    longer than they ran)."""
    from normflat.backends.keras import ggn as kggn

    L = keras.layers
    keras.utils.set_random_seed(5)
    ids = keras.Input((4,), dtype="int32")
    emb = L.Embedding(10, 4, dtype="float64", name="emb")
    h = emb(ids)
    if kind == "attention":
        h = L.MultiHeadAttention(1, 2, dtype="float64", name="mha")(h, h)
    elif kind == "recurrent":
        h = L.SimpleRNN(3, return_sequences=True, dtype="float64", name="rnn")(h)
    h = L.Dense(4, activation="tanh", dtype="float64", name="mix")(L.Flatten(dtype="float64")(h))
    model = keras.Model(ids, L.Dense(3, dtype="float64", name="head")(h))
    rng = np.random.default_rng(5)
    x, y = rng.integers(0, 10, (5, 4)).astype("int32"), rng.integers(0, 3, 5)
    rows = []
    logits = kggn.model_logits
    monkeypatch.setattr(kggn, "model_logits", lambda model, x, *a, **k: (
        rows.append(tf.nest.flatten(x)[0].shape[0]), logits(model, x, *a, **k))[1])
    generic = normflat.hessian_diagonal(model, (x, y), loss="ce", fast=False, progress=False)
    assert None in rows and 1 in rows and set(rows) <= {None, 1, 5}, rows  # chunk (open batch), one sample
    fast = normflat.hessian_diagonal(model, (x, y), loss="ce", progress=False)
    for name in fast:
        np.testing.assert_allclose(np.asarray(generic[name]), np.asarray(fast[name]), rtol=1e-10,
                                   atol=1e-14 * np.abs(np.asarray(fast[name])).max(), err_msg=name)
