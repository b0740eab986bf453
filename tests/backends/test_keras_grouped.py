"""Keras grouped and depthwise convolutions on the fast GGN path (normflat issue 12, item 4), and the
per-sample squares and signal products of the fast layers.

The per-sample squares of a grouped ``Conv1D``/``Conv2D`` and of a
``DepthwiseConv1D/2D`` kernel are one batched matmul with the groups as a batch
axis (a rank-one product at a single output position), and a grouped convolution
with many small groups runs as one depthwise convolution while analyzing
(``normflat.backends.keras.calls``). Both are checked in float64 against a
brute-force reference built from full per-sample Jacobians, against the generic
per-sample-Jacobian path, and (second derivatives through the depthwise form)
against the full Hessian; the depthwise form gets its function-preserving
rescalings (method §8). The squares' loop and pairs of positions, and the product a
fast ``Dense`` back-propagates its signals through (``ggn.dense_product``), are checked
against the same brute force in each of their forms.
"""

from __future__ import annotations

import functools
import gc
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import normflat  # noqa: E402
from normflat.backends.keras import calls  # noqa: E402
from normflat.backends.keras import ggn as kggn  # noqa: E402
from tests.backends.test_keras import ungrouped_reference  # noqa: E402

L = keras.layers
F64 = "float64"


@pytest.fixture(params=["depthwise-form", "per-group-form"])
def grouped_form(request, monkeypatch):
    """Run every grouped convolution with ``in/groups > 1`` in one of the two forms of the call.

    (Groups of one input channel always take the depthwise form.)
    """
    monkeypatch.setattr(calls, "DEPTHWISE_GROUPS_PER_CHANNEL", 0 if request.param == "depthwise-form" else 10**6)
    return request.param


@pytest.fixture(params=["chunks", "one-sample", "one-signal", "pairs"])
def squares_loop(request, monkeypatch):
    """Form the per-sample gradients of the squares a few samples at a time (the default for these
    small layers), one sample at a time, or one signal at a time (``ggn._summed_squares``); or
    take every ungrouped convolution's and ``Dense``'s squares with 2 to 16 positions by pairs of
    positions (``ggn._paired_squares``, chosen by cost for larger layers)."""
    if request.param == "one-sample":
        monkeypatch.setattr(kggn, "SQUARES_CHUNK_ENTRIES", 1)
    elif request.param == "one-signal":
        monkeypatch.setattr(kggn, "SIGNAL_SPLIT_ENTRIES", 0)
    elif request.param == "pairs":
        monkeypatch.setattr(kggn, "squares_by_pairs", lambda positions, *_: 1 < positions <= kggn.MAX_PAIR_POSITIONS)
    return request.param


# ----------------------------------------------------------------------------- models


def conv2d_net(seed=0):
    """Grouped Conv2D with groups 2, 4 and ``in`` (multiplier 2), DepthwiseConv2D, a 1×1-output grouped conv."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((7, 7, 4), dtype=F64)
    h = L.Conv2D(8, 3, strides=2, padding="same", groups=2, activation="tanh", dtype=F64, name="g2")(inp)  # 4×4
    h = L.Conv2D(8, 2, dilation_rate=2, groups=4, activation="tanh", dtype=F64, name="g4")(h)  # 2×2
    h = L.Conv2D(16, 3, padding="same", groups=8, activation="tanh", dtype=F64, name="gcin")(h)  # 2×2
    h = L.DepthwiseConv2D(2, depth_multiplier=2, padding="same", activation="tanh", dtype=F64, name="dw")(h)
    h = L.Conv2D(8, 2, groups=4, activation="tanh", dtype=F64, name="g4_1x1")(h)  # one output position
    h = L.Flatten(dtype=F64)(h)
    return keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h), name="conv2d_net")


def conv1d_net(seed=1):
    """Grouped Conv1D (causal depthwise form, strided), DepthwiseConv1D with stride and dilation."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((11, 4), dtype=F64)
    h = L.Conv1D(8, 3, padding="causal", dilation_rate=2, groups=4, activation="tanh", dtype=F64,
                 name="c_cin")(inp)  # groups = in, multiplier 2
    h = L.Conv1D(8, 2, strides=2, padding="same", groups=2, activation="tanh", dtype=F64, name="c2")(h)  # 6
    h = L.DepthwiseConv1D(2, strides=2, depth_multiplier=2, activation="tanh", dtype=F64, name="dw1")(h)  # 3
    h = L.DepthwiseConv1D(2, dilation_rate=2, padding="same", dtype=F64, name="dw2")(h)
    h = L.Flatten(dtype=F64)(h)
    return keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h), name="conv1d_net")


def small_maps_net(seed=2):
    """Ungrouped convolutions with 9 and 4 output positions, a ``Dense`` on 4 positions, shared by
    two branches (8 positions per sample), then on one."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((5, 5, 3), dtype=F64)
    h = L.Conv2D(6, 3, activation="tanh", dtype=F64, name="p9")(inp)  # 3×3
    h = L.Conv2D(8, 2, strides=1, padding="valid", activation="tanh", dtype=F64, name="p4")(h)  # 2×2
    h = L.Dense(5, activation="tanh", dtype=F64, name="dense_p4")(h)  # (n, 2, 2, 5)
    shared = L.Dense(4, activation="tanh", dtype=F64, name="shared")
    h = L.Concatenate(dtype=F64)([shared(h), shared(h[:, ::-1])])
    h = L.Flatten(dtype=F64)(h)
    return keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h), name="small_maps_net")


def _data(model, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, *model.inputs[0].shape[1:])), rng.integers(0, 3, size=n)


# ----------------------------------------------------------------------------- reference


def _is_depthwise(layer):
    return isinstance(layer, (L.DepthwiseConv1D, L.DepthwiseConv2D))


def _analyzed(model):
    return [l for l in model.layers if hasattr(l, "kernel")]


def _canonical(layer, value, groups):
    """A kernel-shaped array of ``layer`` (of the ungrouped reference) in the canonical layout."""
    if isinstance(layer, L.Dense):
        return value.T
    r = value.ndim - 2
    if _is_depthwise(layer):  # (*k, in, m) -> (in·m, 1, *k)
        t = value.transpose((r, r + 1) + tuple(range(r)))
        return t.reshape(t.shape[0] * t.shape[1], 1, *t.shape[2:])
    t = value.transpose((r + 1, r) + tuple(range(r)))  # (out, in, *k)
    if groups == 1:
        return t
    cin_g, cout_g = t.shape[1] // groups, t.shape[0] // groups
    return np.concatenate([t[g * cout_g:(g + 1) * cout_g, g * cin_g:(g + 1) * cin_g] for g in range(groups)])


def brute_force_ggn(model, x):
    """``diag(Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n) / N`` with full per-sample Jacobians of the logits."""
    ref = ungrouped_reference(model)
    np.testing.assert_allclose(ref(x).numpy(), model(x).numpy(), rtol=1e-12, atol=1e-14)
    layers = _analyzed(ref)
    variables = [l.kernel.value for l in layers]
    with tf.GradientTape() as tape:
        z = ref(x, training=False)
    jacobians = tape.jacobian(z, variables)
    p = tf.nn.softmax(z).numpy()
    hess = np.einsum("na,ab->nab", p, np.eye(p.shape[1])) - np.einsum("na,nb->nab", p, p)
    out = {}
    for src, layer, v, j in zip(_analyzed(model), layers, variables, jacobians):
        j = j.numpy().reshape(p.shape[0], p.shape[1], -1)
        d = np.einsum("nai,nab,nbi->i", j, hess, j).reshape(v.shape) / p.shape[0]
        out[src.name] = _canonical(layer, d, getattr(src, "groups", 1))
    return out


def full_hessian_diag(model, x, y):
    """Diagonal of the Hessian of the mean cross-entropy over all kernels (nested Jacobians)."""
    ref = ungrouped_reference(model)
    layers = _analyzed(ref)
    variables = [l.kernel.value for l in layers]
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(tf.constant(y), ref(x)))
        flat = tf.concat([tf.reshape(g, [-1]) for g in inner.gradient(loss, variables)], 0)
    jac = outer.jacobian(flat, variables)
    hess = tf.concat([tf.reshape(j, [int(flat.shape[0]), -1]) for j in jac], 1).numpy()
    diag, out, start = np.diag(hess), {}, 0
    for src, layer, v in zip(_analyzed(model), layers, variables):
        size = int(np.prod(v.shape))
        out[src.name] = _canonical(layer, diag[start:start + size].reshape(v.shape), getattr(src, "groups", 1))
        start += size
    return out


def _diag(model, data, **kw):
    return {k: v.numpy() for k, v in normflat.hessian_diagonal(model, data, loss="ce", progress=False, **kw).items()}


def _assert_close(got, ref, rtol=1e-10):
    assert list(got) == list(ref)
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        np.testing.assert_allclose(got[name], ref[name], rtol=rtol, atol=1e-14 * np.abs(ref[name]).max(),
                                   err_msg=name)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("make", [conv2d_net, conv1d_net, small_maps_net])
def test_fast_grouped_and_depthwise_squares_equal_brute_force(make, grouped_form, squares_loop):
    model = make()
    x, y = _data(model, 5)
    ref = brute_force_ggn(model, x)
    _assert_close(_diag(model, [(x[:3], y[:3]), (x[3:], y[3:])]), ref)
    if grouped_form == "depthwise-form":
        report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
        assert {l.name: l.details["path"] for l in report.layers} == {l.name: "fast" for l in _analyzed(model)}
        # The generic per-sample-Jacobian path (through the same replaced calls) agrees.
        _assert_close(_diag(model, (x, y), fast=False), ref)


@pytest.mark.parametrize("conv_groups", [1, 3])
@pytest.mark.parametrize("chunk_entries, split_entries", [(1 << 16, 1 << 22), (1, 1 << 22), (200, 0), (1, 0)])
def test_summed_squares_equal_the_per_sample_gradients_squared(conv_groups, chunk_entries, split_entries,
                                                               monkeypatch):
    # 7 samples: chunks of 2 or 3 samples leave a shorter last chunk (200 entries: 96 per signal).
    monkeypatch.setattr(kggn, "SQUARES_CHUNK_ENTRIES", chunk_entries)
    monkeypatch.setattr(kggn, "SIGNAL_SPLIT_ENTRIES", split_entries)
    rng = np.random.default_rng(0)
    n, positions, signals, out, width = 7, 5, 4, 6, 4 * conv_groups
    gs = [rng.normal(size=(n, positions, out)) for _ in range(signals)]
    a = rng.normal(size=(n, positions, width))
    # Reference: each signal's per-sample gradients, each output channel against its group's inputs.
    out_g, width_g = out // conv_groups, width // conv_groups
    expected = np.zeros((conv_groups, signals * out_g, width_g))
    for b, g in enumerate(gs):
        for k in range(conv_groups):
            grads = np.einsum("npo,npw->now", g[..., k * out_g:(k + 1) * out_g], a[..., k * width_g:(k + 1) * width_g])
            expected[k, b * out_g:(b + 1) * out_g] = (grads ** 2).sum(0)
    if conv_groups == 1:
        inputs, expected = a, expected[0]
    else:
        inputs = a.reshape(n, positions, conv_groups, width_g).transpose(0, 2, 1, 3)  # (n, G, P, W/G)
    run = functools.partial(kggn._summed_squares, conv_groups=conv_groups)
    np.testing.assert_allclose(run(tf.constant(inputs), [tf.constant(g) for g in gs]).numpy(), expected, rtol=1e-12)
    # Traced as in the compiled step: the number of samples unknown.
    traced = tf.function(run, input_signature=[tf.TensorSpec([None, *inputs.shape[1:]], tf.float64),
                                               [tf.TensorSpec([None, *g.shape[1:]], tf.float64) for g in gs]])
    np.testing.assert_allclose(traced(tf.constant(inputs), [tf.constant(g) for g in gs]).numpy(), expected,
                               rtol=1e-12)


@pytest.mark.parametrize("estimator", ["ggn-mc", "ggn-topk"])
def test_squares_by_pairs_with_groups_agree_with_the_generic_path(estimator, monkeypatch):
    # Several sums per layer (K' groups of signals), each signal's products summed into its group.
    monkeypatch.setattr(kggn, "squares_by_pairs", lambda positions, *_: 1 < positions <= kggn.MAX_PAIR_POSITIONS)
    model = small_maps_net(seed=5)
    x, y = _data(model, 5, seed=3)
    kw = dict(estimator=estimator, samples=3, seed=11)
    report = normflat.analyze(model, (x, y), loss="ce", progress=False, **kw)
    assert {l.name: l.details["path"] for l in report.layers} == {l.name: "fast" for l in _analyzed(model)}
    _assert_close(_diag(model, (x, y), **kw), _diag(model, (x, y), fast=False, **kw))


def test_squares_by_pairs_keep_normalized_sharpness_under_rescaling(monkeypatch):
    # The pairs route (forced) for a Conv2D on 4 positions and a Dense on 4 positions: a factor per
    # channel between them (relu), another between the Dense and the head (method §8).
    from tests.arch.test_keras_rescalings import _clone, _factors, assert_rescaling_invariant
    from tests.arch.test_keras_layers import _randomize, _rng

    monkeypatch.setattr(kggn, "squares_by_pairs", lambda positions, *_: 1 < positions <= kggn.MAX_PAIR_POSITIONS)
    rng = _rng(7)
    inp = keras.Input((3, 3, 2), dtype=F64)
    h = L.Conv2D(4, 2, activation="relu", dtype=F64, name="conv")(inp)  # 2×2
    h = L.Dense(5, activation="relu", dtype=F64, name="dense")(h)  # on the 4 positions
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng, scale=0.6)
    x, y = rng.normal(size=(5, 3, 3, 2)), rng.integers(0, 3, 5)
    twin = _clone(model)
    conv, dense, head = twin.get_layer("conv"), twin.get_layer("dense"), twin.get_layer("head")
    f, g = _factors(rng, 4), _factors(rng, 5)
    conv.kernel.assign(conv.kernel.numpy() * f)
    conv.bias.assign(conv.bias.numpy() * f)
    dense.kernel.assign(dense.kernel.numpy() / f[:, None] * g)
    dense.bias.assign(dense.bias.numpy() * g)
    head.kernel.assign(head.kernel.numpy() / np.tile(g, 4)[:, None])  # Flatten: position-major
    assert_rescaling_invariant(model, twin, x, y, moved=("conv", "dense", "head"))


def test_chunk_counts_the_squares_working_set_once():
    # fixed + linear · n <= budget: the loop's working set is not per sample.
    assert kggn.ggn_chunk_size(10, None, 9, default_budget=1000, fixed=400) == 60
    assert kggn.ggn_chunk_size(10, 1000, 9, fixed=400) == 60
    assert kggn.ggn_chunk_size(10, None, 9, default_budget=1000, fixed=995) == 1  # at least one sample
    with pytest.raises(ValueError, match="too small"):  # a given budget: one sample must fit
        kggn.ggn_chunk_size(10, 1000, 9, fixed=995)
    # 3C3D's third convolution (3×3, 96 -> 128 channels on 6×6 maps): one sample's gradients.
    size, pre = 3 * 3 * 96 * 128, 6 * 6 * 128
    assert kggn.squares_working_set(9, size, pre) == 9 * (2 * pre + 2 * size) + 2 * 9 * size
    assert kggn.squares_working_set(40, size, pre) == (2 * pre + 2 * size) + 2 * 40 * size  # one signal at a time


def test_squares_chunk_grows_where_tensorflow_sees_a_gpu(monkeypatch):
    assert kggn.squares_chunk_entries() == kggn.SQUARES_CHUNK_ENTRIES  # the tests run on the CPU
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: ["GPU:0"] if kind == "GPU" else [])
    assert kggn.squares_chunk_entries() == kggn.GPU_SQUARES_CHUNK_ENTRIES
    assert kggn.squares_working_set(9, 1000, 100) == (1 << 22) // 9000 * 9 * 2200 + 18000


def test_squares_by_pairs_is_chosen_by_cost():
    # ConvNeXt-Tiny's third stage (2×2 maps, Dense 384 -> 1536) against a 6×6 map and a tiny layer.
    assert kggn.squares_by_pairs(4, 9, 1, 1536, 384)
    assert kggn.squares_by_pairs(9, 9, 1, 512, 512)
    assert not kggn.squares_by_pairs(36, 9, 1, 256, 256)  # more than MAX_PAIR_POSITIONS
    assert not kggn.squares_by_pairs(16, 12, 6, 768, 192)  # many groups: a matmul per group
    assert not kggn.squares_by_pairs(16, 2, 1, 8, 36)
    assert not kggn.squares_by_pairs(1, 9, 1, 1536, 384)  # one position: rank one


def test_fast_and_generic_paths_agree_for_ggn_mc():
    model = conv2d_net(seed=3)
    x, y = _data(model, 4, seed=1)
    kw = dict(estimator="ggn-mc", samples=3, seed=7)
    _assert_close(_diag(model, (x, y), **kw), _diag(model, (x, y), fast=False, **kw))


def test_exact_through_the_depthwise_form_equals_the_full_hessian(monkeypatch):
    # Second derivatives of the grouped convolutions run as depthwise convolutions.
    monkeypatch.setattr(calls, "DEPTHWISE_GROUPS_PER_CHANNEL", 0)
    keras.utils.set_random_seed(4)
    inp = keras.Input((6, 4), dtype=F64)
    h = L.Conv1D(4, 2, groups=2, activation="tanh", dtype=F64, name="g2")(inp)
    h = L.Conv1D(8, 2, strides=2, padding="same", groups=4, activation="tanh", dtype=F64, name="gcin")(h)
    out = L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h))
    model = keras.Model(inp, out)
    assert calls.uses_depthwise_form(model.get_layer("g2")) and calls.uses_depthwise_form(model.get_layer("gcin"))
    x, y = _data(model, 4, seed=2)
    _assert_close(_diag(model, (x, y), estimator="exact"), full_hessian_diag(model, x, y), rtol=1e-9)


def test_per_group_form_is_kept_for_few_large_groups():
    keras.utils.set_random_seed(0)
    few = L.Conv2D(8, 3, groups=2)
    few.build((None, 5, 5, 8))
    many = L.Conv2D(32, 3, groups=16)
    many.build((None, 5, 5, 32))
    conv3d = L.Conv3D(4, 2, groups=4)
    conv3d.build((None, 3, 3, 3, 4))
    assert not calls.uses_depthwise_form(few)  # 2 groups of 4 channels: two convolutions
    assert calls.uses_depthwise_form(many)  # 16 groups of 2 channels: one depthwise convolution
    assert not calls.uses_depthwise_form(conv3d)  # no 3-D depthwise convolution in TensorFlow


def _rescaled(model, factors, first, second):
    """A copy of ``model`` with output channel o of ``first`` times factors[o] and the matching
    input channel of ``second`` divided by it (relu between them, positively homogeneous:
    the function is unchanged)."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    a, b = copy.get_layer(first), copy.get_layer(second)
    ka = a.kernel.numpy() * factors  # (*k, in/groups, out): output channels on the last axis
    kb = b.kernel.numpy()  # (*k, in/groups, out)
    groups, (cin_g, cout) = b.groups, kb.shape[-2:]
    cout_g = cout // groups
    for c, f in enumerate(factors):  # input channel c: column c mod cin_g of group c div cin_g's filters
        g = c // cin_g
        kb[..., c % cin_g, g * cout_g:(g + 1) * cout_g] /= f
    a.kernel.assign(ka)
    a.bias.assign(a.bias.numpy() * factors)  # relu(f·(Wx + b)) = f·relu(Wx + b) for f > 0
    b.kernel.assign(kb)
    return copy


@pytest.mark.parametrize("groups", [4, 8], ids=["in/groups=2", "groups=in"])
def test_depthwise_form_rescaling_invariance(groups, monkeypatch):
    # Output channels of a grouped convolution (run as one depthwise convolution) rescaled
    # against the input channels of the grouped convolution after it (method §8).
    monkeypatch.setattr(calls, "DEPTHWISE_GROUPS_PER_CHANNEL", 0)
    keras.utils.set_random_seed(5)
    inp = keras.Input((5, 5, 8), dtype=F64)
    h = L.Conv2D(8, 3, padding="same", groups=groups, activation="relu", dtype=F64, name="first")(inp)
    h = L.Conv2D(8, 2, strides=2, groups=groups, activation="tanh", dtype=F64, name="second")(h)
    out = L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h))
    model = keras.Model(inp, out)
    factors = np.exp(np.random.default_rng(6).uniform(-1.5, 1.5, size=8))
    other = _rescaled(model, factors, "first", "second")
    x, y = _data(model, 6, seed=3)
    np.testing.assert_allclose(other(x).numpy(), model(x).numpy(), rtol=1e-12, atol=1e-13)
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, (x, y), loss="ce", estimator="ggn", progress=False)
    assert [l.details["path"] for l in before.layers] == ["fast"] * 3
    assert after.normalized_sharpness == pytest.approx(before.normalized_sharpness, rel=1e-8)
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8, abs=1e-12)
    assert abs(after.hessian_trace - before.hessian_trace) > 1e-3 * abs(before.hessian_trace)
    for name in ("first", "second"):  # both rescaled layers' own curvature moves
        tb = before.layers[[l.name for l in before.layers].index(name)].hessian_trace
        ta = after.layers[[l.name for l in after.layers].index(name)].hessian_trace
        assert abs(ta - tb) > 1e-3 * abs(tb)


def test_analysis_leaves_the_grouped_layers_untouched():
    # The replaced calls and the taps live on the layer instances only while analyzing.
    model = conv2d_net(seed=7)
    x, y = _data(model, 3, seed=4)
    before = model(x).numpy()
    def state():
        return {l.name: (l.call, getattr(l, "activation", None), "call" in vars(l)) for l in model.layers}

    saved = state()
    normflat.analyze(model, (x, y), loss="ce", progress=False)
    assert state() == saved
    np.testing.assert_array_equal(model(x).numpy(), before)


# ----------------------------------------------------------------------------- separable convolutions


def separable_net(seed=2):
    """``SeparableConv2D`` (strided, "same", depth multiplier 2) and ``SeparableConv1D`` (dilated)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((7, 7, 3), dtype=F64)
    h = L.SeparableConv2D(4, 3, strides=2, padding="same", depth_multiplier=2, activation="relu", dtype=F64,
                          name="sep2d")(inp)  # 4×4
    h = L.Reshape((16, 4), dtype=F64)(h)
    h = L.SeparableConv1D(5, 2, dilation_rate=2, activation="tanh", dtype=F64, name="sep1d")(h)
    return keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)), name="separable_net")


def _separable_reference(model, x):
    """Brute-force GGN diagonal (full per-sample Jacobians) of every kernel, canonical layout: a depthwise
    kernel ``(*k, in, m)`` as ``(in·m, 1, *k)``, a pointwise or dense one ``(*k, in, out)`` as ``(out, in, *k)``."""
    kernels = {}
    for layer in model.layers:
        if isinstance(layer, (L.SeparableConv1D, L.SeparableConv2D)):
            kernels[f"{layer.name}/depthwise"] = layer.depthwise_kernel
            kernels[f"{layer.name}/pointwise"] = layer.pointwise_kernel
        elif isinstance(layer, L.Dense):
            kernels[layer.name] = layer.kernel
    with tf.GradientTape() as tape:
        z = model(x, training=False)
    jacobians = tape.jacobian(z, [v.value for v in kernels.values()])
    p = tf.nn.softmax(z).numpy()
    hess = np.einsum("na,ab->nab", p, np.eye(p.shape[1])) - np.einsum("na,nb->nab", p, p)
    out = {}
    for (name, v), j in zip(kernels.items(), jacobians):
        j = j.numpy().reshape(p.shape[0], p.shape[1], -1)
        d = np.einsum("nai,nab,nbi->i", j, hess, j).reshape(v.shape) / p.shape[0]
        r = d.ndim - 2
        if name.endswith("/depthwise"):
            t = d.transpose((r, r + 1) + tuple(range(r)))
            out[name] = t.reshape(t.shape[0] * t.shape[1], 1, *t.shape[2:])
        else:
            out[name] = d.transpose((r + 1, r) + tuple(range(r)))
    return out


def test_separable_convolutions_fast_rule_equals_brute_force():
    """``SeparableConv1D/2D`` run as their depthwise then pointwise convolution, each kernel on its
    fast rule (the depthwise one's, a 1×1 convolution's): against brute force on batches of 3 and 2,
    and against the generic path."""
    model = separable_net()
    x, y = _data(model, 5)
    report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert {l.name: l.details["path"] for l in report.layers} == {
        "sep2d/depthwise": "fast", "sep2d/pointwise": "fast", "sep1d/depthwise": "fast", "sep1d/pointwise": "fast",
        "head": "fast"}
    ref = _separable_reference(model, x)
    _assert_close(_diag(model, [(x[:3], y[:3]), (x[3:], y[3:])]), ref)
    _assert_close(_diag(model, (x, y), fast=False), ref)


def test_separable_convolution_rescaling_invariance():
    """The depthwise output channels of a ``SeparableConv2D`` times positive factors and the pointwise
    kernel's matching input channels divided by them (nothing between the two: the function is
    unchanged), then its output channels against the next one's inputs through the relu: the
    normalized sharpness of every layer stays, the traces of the rescaled kernels move (method §8)."""
    model = separable_net(seed=4)
    rng = np.random.default_rng(7)
    inner = np.exp(rng.uniform(-1.5, 1.5, size=6))  # 3 input channels × depth multiplier 2
    outer = np.exp(rng.uniform(-1.5, 1.5, size=4))
    other = keras.models.clone_model(model)
    other.set_weights(model.get_weights())
    sep, nxt = other.get_layer("sep2d"), other.get_layer("sep1d")
    sep.depthwise_kernel.assign(sep.depthwise_kernel.numpy() * inner.reshape(3, 2))  # (k, k, in, m): channel c·m + j
    point = sep.pointwise_kernel.numpy() / inner[:, None] * outer  # (1, 1, in·m, out)
    sep.pointwise_kernel.assign(point)
    sep.bias.assign(sep.bias.numpy() * outer)  # relu(f·u) = f·relu(u), f > 0
    # sep1d's depthwise kernel reads each input channel on its own: its input channel c divided by outer[c].
    nxt.depthwise_kernel.assign(nxt.depthwise_kernel.numpy() / outer[:, None])
    x, y = _data(model, 6, seed=5)
    np.testing.assert_allclose(other(x).numpy(), model(x).numpy(), rtol=1e-11, atol=1e-13)
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, (x, y), loss="ce", estimator="ggn", progress=False)
    assert {l.details["path"] for l in before.layers} == {"fast"}
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8, abs=1e-12), lb.name
    for name in ("sep2d/depthwise", "sep2d/pointwise", "sep1d/depthwise"):
        assert abs(after.layer(name).hessian_trace - before.layer(name).hessian_trace) > \
            1e-3 * abs(before.layer(name).hessian_trace), name


# ----------------------------------------------------------------------------- Dense signals' product


def mlp_net(seed=3):
    """Dense layers on rank-2 inputs (one position per sample)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6,), dtype=F64)
    h = L.Dense(7, activation="tanh", dtype=F64, name="d1")(inp)
    h = L.Dense(5, activation="tanh", dtype=F64, name="d2")(h)
    return keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h), name="mlp_net")


@pytest.mark.parametrize("form", ["columns", "rows", "onednn", "gpu"])
@pytest.mark.parametrize("make", [small_maps_net, mlp_net])
def test_dense_signals_go_back_through_either_product(make, form, monkeypatch):
    """In the step a fast ``Dense`` runs through ``ggn.dense_product``, whose input gradient (each
    signal's back-propagation) is ``(W gᵀ)ᵀ`` for few rows without oneDNN ("columns"), TensorFlow's
    ``g Wᵀ`` for more rows ("rows", the threshold at 0), with oneDNN and where TensorFlow sees a GPU
    (both faked for the rule): the same GGN diagonal as the brute force in every form, float64."""
    used = []
    product = kggn.dense_product
    monkeypatch.setattr(kggn, "dense_product", lambda *args: used.append(args) or product(*args))
    monkeypatch.setattr(kggn.compat, "onednn_enabled", lambda: False)  # whatever the CPU's default
    if form == "rows":
        monkeypatch.setattr(kggn, "DENSE_COLUMNS_ROWS", 0)
    elif form == "onednn":
        monkeypatch.setattr(kggn.compat, "onednn_enabled", lambda: True)
    elif form == "gpu":
        devices = tf.config.list_logical_devices
        monkeypatch.setattr(tf.config, "list_logical_devices",
                            lambda kind=None: ["GPU:0"] if kind == "GPU" else devices(kind))
    model = make()
    x, y = _data(model, 5)
    ref = brute_force_ggn(model, x)
    _assert_close(_diag(model, [(x[:3], y[:3]), (x[3:], y[3:])]), ref)
    dense = {l.name for l in model.layers if isinstance(l, L.Dense)}
    assert len(used) >= len(dense)  # every Dense of the step's forward went through the product


def _input_gradient(w):
    """A ``tf.function`` ``(x, g)`` → the input gradient of ``dense_product(x, w)`` for the signal ``g``."""
    @tf.function
    def back(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = kggn.dense_product(x, w)
        return tape.gradient(y, x, output_gradients=g)

    return back


def _graph_ops(back, *args):
    """The operation types of ``back``'s graph traced for ``args`` (tensors or specs)."""
    return {op.type for op in back.get_concrete_function(*args).graph.get_operations()}


def _gradient_graph_ops(x, w):
    return _graph_ops(_input_gradient(w), x, tf.zeros(list(x.shape[:-1]) + [int(w.shape[-1])], x.dtype))


@pytest.mark.parametrize("shape", [(3, 6), (40, 6), (2, 4, 5, 6)])
def test_dense_product_is_keras_product_and_its_input_gradient(shape, monkeypatch):
    """``dense_product``: the forward is ``keras.ops.matmul`` (any rank, the kernel without a
    gradient) and the input gradient is ``g Wᵀ``, with few rows (the transposed product) and with
    many (TensorFlow's), float64; without oneDNN and a GPU the choice is made while tracing, from the
    rows of the traced inputs."""
    monkeypatch.setattr(kggn.compat, "onednn_enabled", lambda: False)  # whatever the CPU's default
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal(shape))
    kernel = tf.Variable(rng.standard_normal((6, 4)))
    g = tf.constant(rng.standard_normal(shape[:-1] + (4,)))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = kggn.dense_product(x, kernel)
    np.testing.assert_array_equal(y.numpy(), keras.ops.matmul(x, kernel).numpy())
    assert y.shape == shape[:-1] + (4,)
    got = tape.gradient(y, x, output_gradients=g)
    np.testing.assert_allclose(got.numpy(), g.numpy() @ kernel.numpy().T, rtol=1e-13, atol=1e-13)
    assert tape.gradient(y, kernel) is None  # a fast kernel's squares come from its taps
    # The rows are known while tracing: the product is chosen then, no tf.cond in the graph.
    ops = _gradient_graph_ops(x, kernel)
    assert not {"If", "StatelessIf"} & ops
    rows = int(np.prod(shape[:-1]))
    assert ("Transpose" in ops) == (rows <= kggn.DENSE_COLUMNS_ROWS)


@pytest.mark.parametrize("batch", [3, 40, None])
def test_dense_product_chooses_its_backward_for_the_traced_batch(batch, monkeypatch):
    """A step traced with its batch axis open (``session.trace_open_batch``) gets the batch size of the
    call it is traced for (``ggn.open_batch``): the input gradient's product is chosen then, ``(W gᵀ)ᵀ``
    for few rows and ``g Wᵀ`` for many, without a ``tf.cond``, whose branch functions TensorFlow keeps
    after the step is freed; with neither the rows nor a batch size known it stays in the graph. The
    gradient is ``g Wᵀ`` either way, also for a call of another size than the traced one."""
    monkeypatch.setattr(kggn.compat, "onednn_enabled", lambda: False)  # whatever the CPU's default
    rng = np.random.default_rng(3)
    w = tf.constant(rng.standard_normal((6, 4)))
    back = _input_gradient(w)
    spec = tf.TensorSpec([None, 5, 6], tf.float64), tf.TensorSpec([None, 5, 4], tf.float64)
    with kggn.open_batch(batch):
        ops = _graph_ops(back, *spec)
    assert bool({"If", "StatelessIf"} & ops) == (batch is None)
    if batch is not None:
        assert ("Transpose" in ops) == (batch * 5 <= kggn.DENSE_COLUMNS_ROWS)
    for n in (2, 9):
        x, g = tf.constant(rng.standard_normal((n, 5, 6))), tf.constant(rng.standard_normal((n, 5, 4)))
        np.testing.assert_allclose(back(x, g).numpy(), g.numpy() @ w.numpy().T, rtol=1e-13, atol=1e-13)


def test_analyses_of_new_models_leave_nothing_in_tensorflow(monkeypatch):
    """Analyzing one new model after another (checkpoint after checkpoint) leaves nothing behind in
    TensorFlow's process-wide registries: no gradient function (``tf.custom_gradient`` registers one
    per call in a graph, holding that graph: 3 MiB per analysis of a small MLP and 7.6 MiB of a small
    CNN, measured), no function (a ``tf.cond``'s branches stay in the eager context). The ``Dense``
    products and argmax poolings of the step (without oneDNN, where they replace TensorFlow's own
    gradients) go through ``compat.with_backward``, and the product is chosen while tracing. A
    convolutional model's ``hutchinson`` probes run one after the other (``hvp.probes_in_sequence``):
    vectorized, TensorFlow's loops for the convolutions' second derivatives stayed (7.2 MiB per
    analysis of a small CNN); an MLP's stay vectorized."""
    from normflat.backends.keras.hvp import probes_in_sequence
    from tensorflow.python.eager import context
    from tensorflow.python.framework import ops

    monkeypatch.setattr(kggn.compat, "onednn_enabled", lambda: False)  # the replaced gradients in use

    def model():
        inp = keras.Input((8, 8, 2), dtype=F64)
        h = L.Conv2D(3, 3, activation="tanh", dtype=F64)(inp)
        h = L.MaxPooling2D(dtype=F64)(h)
        h = L.Dense(5, activation="tanh", dtype=F64)(L.Flatten(dtype=F64)(h))
        return keras.Model(inp, L.Dense(3, dtype=F64)(h))

    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((6, 8, 8, 2)), rng.integers(0, 3, 6)
    assert probes_in_sequence(model()) and not probes_in_sequence(mlp_net())

    def analyses():
        for estimator, kw in (("ggn", {}), ("ggn-mc", {"samples": 2}), ("hutchinson", {"samples": 2})):
            normflat.hessian_diagonal(model(), (x, y), estimator=estimator, progress=False, **kw)
        gc.collect()  # the models and their compiled steps
        # Less TensorFlow's own wrappers of single eager ops ("__wrapped__<op>_device_..."), a cache.
        functions = {f for f in context.context().list_function_names() if not f.startswith("__wrapped__")}
        return set(ops._gradient_registry.list()), functions

    # The first round also sets TensorFlow's own state on first use. A freed step's loop functions
    # may leave the context a round later (not every round's are gone by its end), so the functions
    # are counted: they must not grow from round to round, as the gradient registry must not change.
    rounds = [analyses() for _ in range(3)]
    assert rounds[1][0] == rounds[0][0] and rounds[2][0] == rounds[0][0]
    assert len(rounds[2][1]) <= len(rounds[0][1]) and len(rounds[1][1]) <= len(rounds[0][1])


def test_dense_product_keeps_tensorflows_gradient_with_onednn(monkeypatch):
    x, w = tf.zeros((3, 6)), tf.zeros((6, 4))
    monkeypatch.setattr(kggn.compat, "onednn_enabled", lambda: True)
    ops = _gradient_graph_ops(x, w)
    assert not {"If", "StatelessIf", "IdentityN", "Transpose"} & ops


def test_dense_product_reads_the_kernel_as_a_mixed_precision_layer_does():
    """Under a ``mixed_bfloat16`` policy the layer's call reads its float32 kernel cast to bfloat16:
    the product's output is the layer's own, value and dtype."""
    layer = L.Dense(4, dtype="mixed_bfloat16")
    x = tf.constant(np.random.default_rng(1).standard_normal((3, 2, 6)), tf.float32)
    want = layer(x)

    def call(inputs, training=None):
        return keras.ops.add(kggn.dense_product(inputs, layer.kernel), layer.bias)

    try:
        object.__setattr__(layer, "call", call)
        got = layer(x)
    finally:
        layer.__dict__.pop("call")
    assert got.dtype == want.dtype == tf.bfloat16
    np.testing.assert_array_equal(got.numpy().astype(np.float32), want.numpy().astype(np.float32))


# ----------------------------------------------------------------------------- max pooling by argmax


def pooled_net(seed=4):
    """Convolutions feeding 2-D max poolings: 2×2 of stride 2 (``valid``) after a ReLU (windows of
    tied zeros), 3×3 of stride 2 (``same``, the windows overlapping), then a ``Dense`` head."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 2), dtype=F64)
    h = L.Conv2D(4, 3, padding="same", activation="relu", dtype=F64, name="c1")(inp)
    h = L.MaxPooling2D(2, dtype=F64)(h)  # 4×4
    h = L.Conv2D(5, 3, padding="same", activation="tanh", dtype=F64, name="c2")(h)
    h = L.MaxPooling2D(3, strides=2, padding="same", dtype=F64)(h)  # 2×2
    h = L.Flatten(dtype=F64)(h)
    return keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h), name="pooled_net")


def pooled_sequence_net(seed=4):
    """1-D convolutions feeding 1-D max poolings (the same two forms as :func:`pooled_net`: 2 of
    stride 2 ``valid`` after a ReLU, 3 of stride 2 ``same``), then a ``Dense`` head."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((9, 2), dtype=F64)
    h = L.Conv1D(4, 3, padding="same", activation="relu", dtype=F64, name="c1")(inp)
    h = L.MaxPooling1D(2, dtype=F64)(h)  # 4
    h = L.Conv1D(5, 3, padding="same", activation="tanh", dtype=F64, name="c2")(h)
    h = L.MaxPooling1D(3, strides=2, padding="same", dtype=F64)(h)  # 2
    h = L.Flatten(dtype=F64)(h)
    return keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h), name="pooled_sequence_net")


@pytest.mark.parametrize("net", [pooled_net, pooled_sequence_net], ids=["2d", "1d"])
@pytest.mark.parametrize("form", ["argmax", "tensorflow", "generic"])
def test_max_pooling_signals_by_argmax_or_tensorflow(form, net, monkeypatch):
    """In the step a ``MaxPooling2D`` runs through ``ggn.max_pool_by_argmax`` where it wins (without
    oneDNN on a CPU, forced here) and its signals go back one by one, also beside generic weights
    (whose per-sample forwards use Keras' pooling); TensorFlow's own pooling otherwise (forced off):
    the same GGN diagonal as the brute force in every form, float64."""
    used = []
    pool = kggn.max_pool_by_argmax
    monkeypatch.setattr(kggn, "max_pool_by_argmax", lambda *args: used.append(args) or pool(*args))
    monkeypatch.setattr(kggn, "argmax_pooling_wins", lambda: form != "tensorflow")
    model = net()
    x, y = _data(model, 5)
    got = _diag(model, [(x[:3], y[:3]), (x[3:], y[3:])], fast=form != "generic")
    _assert_close(got, brute_force_ggn(model, x))
    assert (len(used) >= 2) == (form != "tensorflow") and (form != "tensorflow" or not used)
    assert all(len(args[1]) == len(model.input.shape) - 2 for args in used)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("pool, shape, pool_size, strides, padding", [
    (L.MaxPooling2D, (3, 7, 6, 4), 2, 2, "valid"), (L.MaxPooling2D, (3, 7, 6, 4), 3, 2, "same"),
    (L.MaxPooling2D, (3, 7, 6, 4), (2, 3), (1, 2), "valid"), (L.MaxPooling2D, (3, 7, 6, 4), (3, 2), (2, 1), "same"),
    (L.MaxPooling1D, (3, 11, 4), 2, 2, "valid"), (L.MaxPooling1D, (3, 11, 4), 3, 2, "same"),
    (L.MaxPooling1D, (3, 11, 4), 2, 1, "same"), (L.MaxPooling1D, (3, 11, 4), 4, 3, "valid"),
], ids=["2d-2", "2d-3-same", "2d-2x3", "2d-3x2-same", "1d-2", "1d-3-same", "1d-2-1-same", "1d-4-3"])
def test_max_pool_by_argmax_is_the_pooling_and_its_gradient(pool, shape, pool_size, strides, padding, dtype):
    """``max_pool_by_argmax``: Keras' ``MaxPooling2D``'s and ``MaxPooling1D``'s values (``(n, L, C)``
    inputs through their 2-D view) and TensorFlow's gradient, exactly, also with windows of tied
    maxima (the zeros after a ReLU: the first one gets the gradient in both)."""
    layer = pool(pool_size, strides=strides, padding=padding, dtype=dtype)
    rng = np.random.default_rng(5)
    x = tf.constant(np.maximum(rng.standard_normal(shape), 0.0).astype(dtype))
    want = layer(x)
    g = tf.constant(rng.standard_normal(want.shape).astype(dtype))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours = kggn.max_pool_by_argmax(x, layer.pool_size, layer.strides, layer.padding)
        theirs = layer(x)
    assert ours.shape == want.shape
    np.testing.assert_array_equal(ours.numpy(), want.numpy())
    np.testing.assert_array_equal(tape.gradient(ours, x, output_gradients=g).numpy(),
                                  tape.gradient(theirs, x, output_gradients=g).numpy())


def test_max_pooling_by_argmax_only_for_plain_channels_last_layers():
    """A ``MaxPooling1D/2D`` subclass with its own call, or one on channels-first inputs, keeps Keras'
    call; so does a ``MaxPooling3D`` (TensorFlow's argmax pooling is 2-D)."""
    class Custom(L.MaxPooling2D):
        def call(self, inputs):
            return super().call(inputs) * 2.0

    class Custom1D(L.MaxPooling1D):
        def call(self, inputs):
            return super().call(inputs) * 2.0

    assert kggn._plain_max_pooling(L.MaxPooling2D(2))
    assert kggn._plain_max_pooling(L.MaxPooling1D(2))
    assert not kggn._plain_max_pooling(Custom(2))
    assert not kggn._plain_max_pooling(Custom1D(2))
    assert not kggn._plain_max_pooling(L.MaxPooling1D(2, data_format="channels_first"))
    assert not kggn._plain_max_pooling(L.MaxPooling3D(2))
    assert not kggn._plain_max_pooling(L.MaxPooling2D(2, data_format="channels_first"))
    assert not kggn._plain_max_pooling(L.AveragePooling2D(2))
