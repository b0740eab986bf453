"""Function-preserving rescalings of the Keras layer kinds that have none elsewhere (method §8).

Every layer kind normflat reads gets its own function-preserving rescaling: a tiny float64
model holding the kind, a copy whose weights are rescaled so that the function provably does
not change (checked to ~1e-12), and then every layer's normalized sharpness and the total must
stay (1e-8 relative) while the rescaled layers' Hessian traces move (method §8, "Invariance
guarantees"; the canonical layouts that make each rescaling a row or column scaling are those
of method §3). The kinds already covered elsewhere are not repeated here: ``Dense``, ``Conv2D``
plain, grouped and depthwise in ``tests/test_invariance.py``; ``MultiHeadAttention``,
``Embedding``, the untied ``ReversibleEmbedding``, ReLU ``SimpleRNN``, a grouped ``Conv1D`` and the
folded ``EinsumDense`` in ``tests/arch/test_keras_layers.py``; ``LSTM`` and
``GRU(reset_after=False)`` in ``tests/arch/test_keras_recurrent.py``; keras-hub's tied
``ReversibleEmbedding`` in ``tests/arch/test_keras_models.py``; Mixtral's separate experts kernels
in ``tests/arch/test_keras_moe.py``; grouped convolutions in their depthwise form and
``SeparableConv2D`` in ``tests/backends/test_keras_grouped.py``. This file covers: multi-axis
``EinsumDense`` kernels with a factor per feature, ``GroupQueryAttention``, ``Conv1D`` and
``Conv3D`` (plain and grouped, a factor per channel), ``DepthwiseConv1D/2D`` with a depth
multiplier, ``SeparableConv1D`` (depthwise and pointwise kernels), keras-hub's
``PositionEmbedding`` and DeBERTa-v3 ``RelativeEmbedding``, keras-hub's packed experts kernels
(Qwen-MoE halves, GPT-OSS alternating), the input kernels of ``GRU(reset_after=True)`` and a
tanh ``SimpleRNN`` against the features of an ``Embedding``, ``Conv1D`` channels through
``MaxPooling1D``, keras-hub Qwen3.5's gated delta net's own causal convolution against its
``in_proj_qkv`` channels, and ``Conv1DTranspose`` /
``Conv2DTranspose`` / ``Conv3DTranspose`` (input and output channels). Every layer takes its fast
rule unless a test names it generic. The tests run on Keras' TensorFlow backend here and on its JAX
backend in ``tests/backends/test_keras_rescalings_on_jax.py`` (at float32's accuracy where Keras
computes part of a float64 model in float32 there, ``tests/arch/_keras_invariance.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402

import normflat  # noqa: E402
from tests._invariance import assert_reports_invariant  # noqa: E402
from tests.arch._keras_invariance import invariance_tolerance, jax_generic, tensorflow_generic  # noqa: E402
from tests.arch.test_keras_layers import _randomize, _rng  # noqa: E402

L = keras.layers
F64 = "float64"


def _clone(model):
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def _factors(rng, *shape):
    """Distinct positive factors between e^-1.5 and e^1.5."""
    return np.exp(rng.uniform(-1.5, 1.5, size=shape))


def assert_rescaling_invariant(model, twin, x, y, moved, generic=(), **kw):
    """``twin`` is ``model`` rescaled: the same function (to ~1e-12), every layer's normalized sharpness
    and the total the same (1e-8 relative), the Hessian trace of every layer in ``moved`` changed by
    more than 1e-3 relative (method §8). On Keras' JAX backend, where Keras computes parts of a float64
    model in float32, both at float32's accuracy (``tests/arch/_keras_invariance.py``).

    Args:
        generic: The layers expected on the generic path (names, or a predicate on the name);
            every other layer must take its fast rule (``layer.details["path"]``), in both analyses.

    Returns:
        The two reports.
    """
    rtol = invariance_tolerance(twin(x), model(x))
    kw = {"loss": "ce", "estimator": "ggn", **kw}
    before = normflat.analyze(model, (x, y), progress=False, **kw)
    after = normflat.analyze(twin, (x, y), progress=False, **kw)
    assert_reports_invariant(before, after, moved, generic, rtol=rtol)
    return before, after


# ----------------------------------------------------------------------------- EinsumDense, attention


def test_einsum_dense_multi_axis_feature_rescaling():
    """Two multi-axis ``EinsumDense`` kernels: ``"ab,bcd->acd"`` (one input axis, two output axes,
    relu) and ``"acd,cde->ae"`` (two contracted axes). Output feature ``(c, d)`` of the first (its
    kernel column ``[:, c, d]`` and bias) times its own factor, the second's kernel row ``[c, d, :]``
    divided by it: a row scaling of the first's ``(c·d, b)`` matrix and a column scaling of the
    second's ``(e, c·d)`` matrix (method §3 "Multi-axis kernels"), absorbed (§8); both on the fast
    einsum rule."""
    rng = _rng(1)
    inp = keras.Input((4,), dtype=F64)
    h = L.EinsumDense("ab,bcd->acd", output_shape=(2, 3), bias_axes="cd", activation="relu", dtype=F64,
                      name="expand")(inp)
    model = keras.Model(inp, L.EinsumDense("acd,cde->ae", output_shape=(3,), bias_axes="e", dtype=F64,
                                           name="contract")(h))
    _randomize(model, rng)
    x, y = rng.normal(size=(6, 4)), rng.integers(0, 3, 6)
    twin = _clone(model)
    f = _factors(rng, 2, 3)
    expand, contract = twin.get_layer("expand"), twin.get_layer("contract")
    expand.kernel.assign(expand.kernel.numpy() * f[None])
    expand.bias.assign(expand.bias.numpy() * f)
    contract.kernel.assign(contract.kernel.numpy() / f[:, :, None])
    assert_rescaling_invariant(model, twin, x, y, moved=("expand", "contract"))


def test_group_query_attention_per_key_value_head_rescalings():
    """``GroupQueryAttention`` (4 query heads sharing 2 key/value heads): the query rows of every
    query head reading key/value head ``g`` times ``c_g`` and key head ``g``'s rows over ``c_g``
    (every score ``q_h·k_g`` kept); value head ``g``'s rows times ``d_g`` and the output
    projection's columns of every query head reading it over ``d_g`` (method §3 "Multi-axis kernels",
    §8 item 5, per shared head). Every projection is an ``EinsumDense`` on its fast rule."""
    rng = _rng(2)
    inp = keras.Input((3, 4), dtype=F64)
    gqa = L.GroupQueryAttention(head_dim=2, num_query_heads=4, num_key_value_heads=2, dtype=F64, name="gqa")
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(gqa(inp, inp))))
    _randomize(model, rng)
    x, y = rng.normal(size=(4, 3, 4)), rng.integers(0, 3, 4)
    twin = _clone(model)
    a = twin.get_layer("gqa")
    c, d = np.array([3.0, 0.25]), np.array([0.5, 4.0])  # per key/value head
    per_query = lambda v: np.repeat(v, 2)  # noqa: E731 - query head u reads key/value head u // 2
    q, k, v, o = a._query_dense, a._key_dense, a._value_dense, a._output_dense
    q.kernel.assign(q.kernel.numpy() * per_query(c)[None, :, None])  # (d, heads, head_dim)
    q.bias.assign(q.bias.numpy() * per_query(c)[:, None])
    k.kernel.assign(k.kernel.numpy() / c[None, :, None])
    k.bias.assign(k.bias.numpy() / c[:, None])
    v.kernel.assign(v.kernel.numpy() * d[None, :, None])
    v.bias.assign(v.bias.numpy() * d[:, None])
    o.kernel.assign(o.kernel.numpy() / per_query(d)[:, None, None])  # (heads, head_dim, d)
    names = ("gqa/query", "gqa/key", "gqa/value", "gqa/attention_output")
    assert_rescaling_invariant(model, twin, x, y, moved=names)


# ----------------------------------------------------------------------------- convolutions


@pytest.mark.parametrize("rank", [1, 3])
def test_conv_channel_rescaling_plain_and_grouped(rank):
    """``Conv1D``/``Conv3D``: a plain convolution (relu) then one with ``groups=2``. Output channel
    ``o`` of the first (kernel ``(*k, in, out)`` column ``o``, bias) times its own factor; the
    grouped one's input channel ``o`` (column ``o mod in/groups`` of group ``o div in/groups``'s
    filters) divided by it, a different factor for every channel of every group; the grouped
    layer's output channels against the head's inputs through a second relu. Each matrix is
    multiplied by diagonal matrices on its rows and columns (every input channel of a group its
    own column, method §3 "Grouped convolutions"), which normalized sharpness absorbs (§8 item 2)."""
    rng = _rng(3)
    spatial = (5,) if rank == 1 else (3, 3, 3)
    conv = L.Conv1D if rank == 1 else L.Conv3D
    inp = keras.Input(spatial + (2,), dtype=F64)
    h = conv(4, 2, padding="same", activation="relu", dtype=F64, name="plain")(inp)
    h = conv(4, 2, groups=2, activation="relu", dtype=F64, name="grouped")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng, scale=0.6)
    x, y = rng.normal(size=(4,) + spatial + (2,)), rng.integers(0, 3, 4)
    twin = _clone(model)
    plain, grouped, head = twin.get_layer("plain"), twin.get_layer("grouped"), twin.get_layer("head")
    f, g = _factors(rng, 4), _factors(rng, 4)
    plain.kernel.assign(plain.kernel.numpy() * f)
    plain.bias.assign(plain.bias.numpy() * f)
    kg = grouped.kernel.numpy()  # (*k, in/groups = 2, out = 4); output channels 0-1: group 0
    for o in range(4):
        group = o // 2
        kg[..., :, o] = kg[..., :, o] / f[2 * group:2 * group + 2] * g[o]
    grouped.kernel.assign(kg)
    grouped.bias.assign(grouped.bias.numpy() * g)
    positions = int(np.prod(h.shape[1:-1]))  # Flatten: position-major, channel last
    head.kernel.assign(head.kernel.numpy() / np.tile(g, positions)[:, None])
    before, _ = assert_rescaling_invariant(model, twin, x, y, moved=("plain", "grouped", "head"))
    assert before.layer("grouped").details["groups"] == 2


def test_conv1d_channel_rescaling_through_max_pooling(monkeypatch):
    """``Conv1D`` (relu), ``MaxPooling1D`` (2 ``valid``, then 3 of stride 2 ``same``), ``Conv1D``: the
    first convolution's output channel ``o`` times its own factor, the second's input channel ``o``
    divided by it (a positive factor per channel commutes with a relu and a max over positions). The
    step's poolings run the signals' scatter to the forward's maxima (``ggn.max_pool_by_argmax``,
    forced on and spied), as a 1-D pooling through its 2-D view."""
    from normflat.backends.keras import ggn as keras_ggn

    used = []
    pool = keras_ggn.max_pool_by_argmax
    monkeypatch.setattr(keras_ggn, "max_pool_by_argmax", lambda *args: used.append(args) or pool(*args))
    monkeypatch.setattr(keras_ggn, "argmax_pooling_wins", lambda: True)
    rng = _rng(5)
    inp = keras.Input((11, 2), dtype=F64)
    h = L.Conv1D(4, 3, padding="same", activation="relu", dtype=F64, name="first")(inp)
    h = L.MaxPooling1D(2, dtype=F64)(h)
    h = L.MaxPooling1D(3, strides=2, padding="same", dtype=F64)(h)
    h = L.Conv1D(3, 2, activation="tanh", dtype=F64, name="second")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng, scale=0.6)
    x, y = rng.normal(size=(5, 11, 2)), rng.integers(0, 3, 5)
    twin = _clone(model)
    first, second = twin.get_layer("first"), twin.get_layer("second")
    f = _factors(rng, 4)
    first.kernel.assign(first.kernel.numpy() * f)  # (k, in, out): output channels last
    first.bias.assign(first.bias.numpy() * f)
    second.kernel.assign(second.kernel.numpy() / f[:, None])  # (k, in, out): input channels
    assert_rescaling_invariant(model, twin, x, y, moved=("first", "second"))
    assert used and all(len(args[1]) == 1 for args in used)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_transposed_conv_channel_rescaling(rank):
    """A plain convolution (relu), a strided ``ConvNDTranspose`` (relu, kernel ``(*k, out, in)``,
    canonical ``(out, in, *k)``), the head. The convolution's output channel ``i`` times ``f_i`` and
    the transposed convolution's input channel ``i`` (kernel ``[..., :, i]``) divided by it; its output
    channel ``o`` (kernel ``[..., o, :]``, bias) times ``g_o`` and the head's inputs from channel ``o``
    divided by it: a column and a row scaling of the transposed kernel's canonical matrix, which the
    normalized sharpness absorbs (method §8 item 2) and the Hessian traces do not."""
    rng = _rng(30 + rank)
    spatial = {1: (3,), 2: (3, 3), 3: (2, 2, 2)}[rank]
    conv = (L.Conv1D, L.Conv2D, L.Conv3D)[rank - 1]
    up = (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)[rank - 1]
    inp = keras.Input(spatial + (2,), dtype=F64)
    h = conv(3, 2, padding="same", activation="relu", dtype=F64, name="plain")(inp)
    h = up(4, 3, strides=2, padding="same" if rank == 2 else "valid", activation="relu", dtype=F64,
           name="up")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng, scale=0.6)
    x, y = rng.normal(size=(4,) + spatial + (2,)), rng.integers(0, 3, 4)
    twin = _clone(model)
    plain, transposed, head = twin.get_layer("plain"), twin.get_layer("up"), twin.get_layer("head")
    f, g = _factors(rng, 3), _factors(rng, 4)
    plain.kernel.assign(plain.kernel.numpy() * f)
    plain.bias.assign(plain.bias.numpy() * f)
    transposed.kernel.assign(transposed.kernel.numpy() * g[:, None] / f[None, :])  # (*k, out, in)
    transposed.bias.assign(transposed.bias.numpy() * g)
    positions = int(np.prod(h.shape[1:-1]))  # Flatten: position-major, channel last
    head.kernel.assign(head.kernel.numpy() / np.tile(g, positions)[:, None])
    before, _ = assert_rescaling_invariant(model, twin, x, y, moved=("plain", "up", "head"))
    assert before.layer("up").kind == f"conv_transpose{rank}d"


@pytest.mark.parametrize("rank", [1, 2])
def test_depthwise_conv_with_depth_multiplier_rescaling(rank):
    """``DepthwiseConv1D/2D`` with depth multiplier 2 (canonical ``(in·2, 1, *k)``, one block per
    input channel): input channel ``i`` (the relu ``Dense`` before it) times ``a_i`` and the depthwise
    kernel's channel ``i`` over ``a_i`` (a column scaling per block); output channel ``i·2 + j`` times
    its own ``b_ij`` (kernel ``(*k, in, m)`` entry ``[..., i, j]`` and bias), the head's matching
    inputs over it through a relu (a row scaling). Method §3 "Grouped convolutions", §8 item 2."""
    rng = _rng(4)
    spatial = (5,) if rank == 1 else (3, 3)
    depthwise = L.DepthwiseConv1D if rank == 1 else L.DepthwiseConv2D
    inp = keras.Input(spatial + (2,), dtype=F64)
    h = L.Dense(3, activation="relu", dtype=F64, name="inp")(inp)
    h = depthwise(2, depth_multiplier=2, activation="relu", dtype=F64, name="depthwise")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng, scale=0.6)
    x, y = rng.normal(size=(4,) + spatial + (2,)), rng.integers(0, 3, 4)
    twin = _clone(model)
    a, b = _factors(rng, 3), _factors(rng, 3, 2)
    first, dw, head = twin.get_layer("inp"), twin.get_layer("depthwise"), twin.get_layer("head")
    first.kernel.assign(first.kernel.numpy() * a)
    first.bias.assign(first.bias.numpy() * a)
    dw.kernel.assign(dw.kernel.numpy() / a[:, None] * b)  # (*k, in, m)
    dw.bias.assign(dw.bias.numpy() * b.reshape(-1))  # output channel i·m + j
    positions = int(np.prod(h.shape[1:-1]))
    head.kernel.assign(head.kernel.numpy() / np.tile(b.reshape(-1), positions)[:, None])
    before, _ = assert_rescaling_invariant(model, twin, x, y, moved=("inp", "depthwise", "head"))
    assert before.layer("depthwise").details["groups"] == 3


def test_separable_conv1d_depthwise_and_pointwise_rescaling():
    """``SeparableConv1D`` (depth multiplier 2): its input channel ``i`` (the relu ``Conv1D`` before it)
    times ``a_i`` against the depthwise kernel's channel ``i``; the depthwise output ``i·2 + j`` times
    ``b_ij`` against the pointwise kernel's input row ``i·2 + j`` (nothing between the two maps); the
    pointwise output channel ``o`` times ``c_o`` (kernel column and bias) against the head's inputs
    through a relu. Both kernels are scaled by rows and by columns (method §3 "Grouped
    convolutions", §8 item 2)."""
    rng = _rng(5)
    inp = keras.Input((6, 2), dtype=F64)
    h = L.Conv1D(3, 2, padding="same", activation="relu", dtype=F64, name="conv")(inp)
    h = L.SeparableConv1D(4, 2, depth_multiplier=2, activation="relu", dtype=F64, name="sep")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng, scale=0.6)
    x, y = rng.normal(size=(4, 6, 2)), rng.integers(0, 3, 4)
    twin = _clone(model)
    a, b, c = _factors(rng, 3), _factors(rng, 3, 2), _factors(rng, 4)
    conv, sep, head = twin.get_layer("conv"), twin.get_layer("sep"), twin.get_layer("head")
    conv.kernel.assign(conv.kernel.numpy() * a)
    conv.bias.assign(conv.bias.numpy() * a)
    sep.depthwise_kernel.assign(sep.depthwise_kernel.numpy() / a[:, None] * b)  # (k, in, m)
    sep.pointwise_kernel.assign(sep.pointwise_kernel.numpy() / b.reshape(-1)[:, None] * c)  # (1, in·m, out)
    sep.bias.assign(sep.bias.numpy() * c)
    head.kernel.assign(head.kernel.numpy() / np.tile(c, 5)[:, None])  # 5 positions, channel last
    assert_rescaling_invariant(model, twin, x, y, moved=("conv", "sep/depthwise", "sep/pointwise", "head"))


# ----------------------------------------------------------------------------- keras-hub tables


def test_keras_hub_position_embedding_feature_rescaling():
    """keras-hub's ``PositionEmbedding`` added to an ``Embedding`` (``TokenAndPositionEmbedding``):
    feature ``j`` of both tables times ``c_j`` (row ``j`` of both canonical ``(features, ·)``
    matrices) and the next ``Dense``'s input row ``j`` over ``c_j`` (method §3 "Position tables",
    §8 item 6); the position table on its fast rule."""
    require_frameworks("keras_hub")
    import keras_hub

    rng = _rng(6)
    ids = keras.Input((3,), dtype="int32")
    tpe = keras_hub.layers.TokenAndPositionEmbedding(7, 3, 4, dtype=F64, name="tpe")
    h = L.Dense(5, activation="tanh", dtype=F64, name="mix")(tpe(ids))
    model = keras.Model(ids, L.Dense(3, dtype=F64, name="head")(L.GlobalAveragePooling1D(dtype=F64)(h)))
    _randomize(model, rng)
    x, y = rng.integers(0, 7, (4, 3)).astype("int32"), rng.integers(0, 3, 4)
    twin = _clone(model)
    c = _factors(rng, 4)
    layer, mix = twin.get_layer("tpe"), twin.get_layer("mix")
    for table in (layer.token_embedding.embeddings, layer.position_embedding.position_embeddings):
        table.assign(table.numpy() * c)
    mix.kernel.assign(mix.kernel.numpy() / c[:, None])
    tables = ("tpe/token_embedding", "tpe/position_embedding")
    assert_rescaling_invariant(model, twin, x, y, moved=tables + ("mix",))


def test_keras_hub_relative_embedding_position_rescaling():
    """keras-hub's DeBERTa-v3 ``RelativeEmbedding``: a ``(2·buckets, features)`` table, layer-normalized
    per row and added to the activations. With the normalization's epsilon 0, row ``t`` (column ``t``
    of the canonical ``(features, positions)`` matrix) times its own ``c_t`` leaves the normalized
    rows and the function as they are (method §8 item 3, per position): its normalized sharpness
    stays and its trace moves. Read whole, on the generic path (method §3)."""
    require_frameworks("keras_hub")
    from keras_hub.src.models.deberta_v3.relative_embedding import RelativeEmbedding

    rng = _rng(7)
    inp = keras.Input((4, 3), dtype=F64)
    rel = RelativeEmbedding(4, 2, layer_norm_epsilon=0.0, dtype=F64, name="rel")
    h = L.Dense(4, dtype=F64, name="proj")(inp) + rel(inp)
    h = L.Dense(5, activation="tanh", dtype=F64, name="mix")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng)
    x, y = rng.normal(size=(4, 4, 3)), rng.integers(0, 3, 4)
    twin = _clone(model)
    table = twin.get_layer("rel").rel_embeddings
    table.assign(table.numpy() * _factors(rng, 4)[:, None])
    before, _ = assert_rescaling_invariant(model, twin, x, y, moved=("rel",), generic=("rel",))
    assert before.layer("rel").shape == (4, 4)


@pytest.mark.parametrize("kind", ["qwen_moe", "gpt_oss"])
def test_keras_hub_packed_experts_rescaling(kind):
    """keras-hub experts whose gate and up maps share one ``(experts, in, 2·inter)`` kernel: packed in
    halves (Qwen-MoE) or alternating (GPT-OSS), reported as ``<experts>/gate_up.<e>.gate`` and ``.up``
    (method §3 "Mixture-of-experts layers"; the separate Mixtral kernels are rescaled in
    ``tests/arch/test_keras_moe.py``). The features entering the block times ``c_j`` (the linear
    ``embed``'s output and bias) against input row ``j`` of the router's and of every expert's packed
    kernel; the block's output feature ``h`` times ``s_h`` (every expert's down-kernel column and
    bias) against the head's input ``h``; for Qwen-MoE also expert ``e``'s up unit ``k`` (the up half's
    column) times ``u_ek`` against its down kernel's row ``k`` (``up · silu(gate)`` is linear in
    ``up``; GPT-OSS's ``(up + 1)`` is not). Row and column scalings of every expert's matrices (§8
    item 8); the experts on the generic path (on Keras' JAX backend on the fast dense rule)."""
    require_frameworks("keras_hub")
    from tests.arch.test_keras_moe import EXPERTS, HIDDEN, INTER, _model

    model, x, y = _model(kind)
    twin, _, _ = _model(kind)
    rng = np.random.default_rng(9)
    c, s, u = _factors(rng, HIDDEN), _factors(rng, HIDDEN), _factors(rng, EXPERTS, INTER)
    experts = twin.experts
    twin.embed.kernel.assign(twin.embed.kernel.numpy() * c)
    twin.embed.bias.assign(twin.embed.bias.numpy() * c)
    twin.router.kernel.assign(twin.router.kernel.numpy() / c[:, None])
    if kind == "qwen_moe":
        gate_up, down = experts._expert_feedforward_gate_dense, experts._expert_feedforward_output_dense
        kernel = np.asarray(gate_up) / c[None, :, None]
        kernel[:, :, INTER:] *= u[:, None, :]  # each expert's up half
        gate_up.assign(kernel)
        down.assign(np.asarray(down) / u[:, :, None] * s)
    else:
        gate_up, down = experts.gate_up_proj, experts.down_proj
        gate_up.assign(np.asarray(gate_up) / c[None, :, None])
        down.assign(np.asarray(down) * s)
        experts.down_proj_bias.assign(np.asarray(experts.down_proj_bias) * s)
    twin.head.kernel.assign(twin.head.kernel.numpy() / s[:, None])
    names = [f"experts/gate_up.{e}.{m}" for e in range(EXPERTS) for m in ("gate", "up")]
    names += [f"experts/down.{e}" for e in range(EXPERTS)]
    assert_rescaling_invariant(model, twin, x, y, moved=["embed", "router", "head"] + names,
                               generic=tensorflow_generic(lambda name: name.startswith("experts/")))


# ----------------------------------------------------------------------------- recurrent input kernels


RECURRENT = {
    "gru-reset-after": (lambda: L.GRU(3, dtype=F64, name="rnn"), ("z", "r", "h")),
    "simple-rnn-tanh": (lambda: L.SimpleRNN(3, dtype=F64, name="rnn"), ()),
}


@pytest.mark.parametrize("kind", sorted(RECURRENT))
def test_recurrent_input_kernels_against_embedding_features(kind):
    """Feature ``j`` of an ``Embedding`` times ``c_j`` and row ``j`` of the recurrent layer's input
    kernel ``(in, gates·hidden)`` (column ``j`` of every gate's canonical matrix) over ``c_j``: the
    same function, a column scaling of every gate's input matrix (method §3 "Packed maps are split",
    §8 item 7). ``GRU`` with ``reset_after=True`` (Keras' default; ``reset_after=False`` and ``LSTM``
    are rescaled in ``tests/arch/test_keras_recurrent.py``) and a tanh ``SimpleRNN`` (its ReLU
    hidden units in ``tests/arch/test_keras_layers.py``); every weight on its fast rule, the
    table's and every input gate's trace moved."""
    make, gates = RECURRENT[kind]
    rng = _rng(8)
    ids = keras.Input((3,), dtype="int32")
    h = make()(L.Embedding(6, 3, dtype=F64, name="emb")(ids))
    model = keras.Model(ids, L.Dense(3, dtype=F64, name="head")(h))
    _randomize(model, rng, scale=0.6)
    x, y = rng.integers(0, 6, (4, 3)).astype("int32"), rng.integers(0, 3, 4)
    twin = _clone(model)
    c = _factors(rng, 3)
    emb, cell = twin.get_layer("emb"), twin.get_layer("rnn").cell
    emb.embeddings.assign(emb.embeddings.numpy() * c)
    cell.kernel.assign(cell.kernel.numpy() / c[:, None])
    prefix = f"rnn/{cell.name}/kernel"
    kernels = [f"{prefix}.{g}" for g in gates] or [prefix]
    # On Keras' JAX backend the recurrent kernels, used inside the traced scan, take the generic path.
    assert_rescaling_invariant(model, twin, x, y, moved=("emb",) + tuple(kernels),
                               generic=jax_generic("recurrent_kernel"))


@pytest.mark.slow
def test_keras_hub_gated_delta_net_conv_kernel_brute_force_and_rescaling():
    """keras-hub Qwen3.5's gated delta net applies its own short causal convolution over the tokens,
    ``conv1d_kernel`` ``(channels, kernel)`` through ``ops.depthwise_conv``: a depthwise kernel,
    canonical ``(channels, 1, kernel)`` with one group per channel, on the generic path (it was
    skipped). Its GGN diagonal against brute force; then channel ``c`` of the ``in_proj_qkv`` output
    (the convolution's input) divided by its own factor and the kernel's row ``c`` multiplied by it:
    the function unchanged, every normalized sharpness unchanged, both traces moved (the model
    rescaled in place, its compiled step reused)."""
    require_frameworks("keras_hub")
    from keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net import Qwen3_5GatedDeltaNet

    from tests.arch.test_keras_layers import ggn_reference

    rng = _rng(9)
    inp = keras.Input((4, 6), dtype=F64)
    h = Qwen3_5GatedDeltaNet(hidden_size=6, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=2,
                             linear_value_head_dim=2, linear_conv_kernel_dim=3, dtype=F64, name="delta")(inp)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.GlobalAveragePooling1D(dtype=F64)(h)))
    _randomize(model, rng, scale=0.5)
    x, y = rng.normal(size=(3, 4, 6)), rng.integers(0, 3, 3)
    conv = next(v for v in model.weights if v.path == "delta/conv1d_kernel")
    got = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn", progress=False)
    (want,) = ggn_reference(model, [conv], x, y, "ce")
    assert got["delta/conv1d_kernel"].shape == (6, 1, 3) and np.abs(want).max() > 0
    # keras-hub runs the delta rule in float32 (its decay cast so): agreement to that precision
    np.testing.assert_allclose(np.asarray(got["delta/conv1d_kernel"]), want[:, None, :], rtol=1e-5,
                               atol=1e-6 * np.abs(want).max())
    z = np.asarray(model(x))
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert before.layer("delta/conv1d_kernel").details["groups"] == 6
    qkv = model.get_layer("delta").in_proj_qkv.kernel  # (features, channels), no bias
    factors = _factors(rng, 6)
    qkv.assign(qkv.numpy() / factors)
    conv.assign(conv.numpy() * factors[:, None])
    np.testing.assert_allclose(np.asarray(model(x)), z, rtol=1e-12, atol=1e-13)
    after = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert_reports_invariant(before, after, moved=("delta/in_proj_qkv", "delta/conv1d_kernel"),
                             generic=("delta/conv1d_kernel",))
