"""Method §8: the invariance suite every backend must pass.

Each test builds the same small network in every framework (``tests/builders``),
applies a transformation that provably leaves the function unchanged, checks
that the function really is unchanged, and compares the reports. The position
table cases use the tiny ViTs of the framework's own layer tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import normflat
from tests import netspec
from tests.builders import BUILDERS, load_builder, require_frameworks

RTOL_INVARIANT = 1e-8


@pytest.fixture(params=BUILDERS)
def builder(request):
    return load_builder(request.param)


def _analyze(builder, spec, *, loss, estimator, n=16, batch_size=8):
    x, y = netspec.data(spec, n=n)
    model = builder.build(spec)
    np.testing.assert_allclose(builder.predict(model, x), netspec.forward(spec, x), rtol=1e-9, atol=1e-10,
                               err_msg="builder does not reproduce the spec's function")
    data = builder.make_data(x, y, batch_size)
    return normflat.analyze(model, data, loss=loss, estimator=estimator, progress=False,
                            **builder.ANALYZE_KWARGS)


def _check(builder, spec, transformed, *, loss, estimator, trace_changes=True, mns_invariant):
    x, _ = netspec.data(spec, n=16)
    before_fn, after_fn = netspec.forward(spec, x), netspec.forward(transformed, x)
    if loss == "nsce":
        # The logit transformation changes the logits but not the normalized logits.
        def norm(z):
            z = z - z.mean(axis=1, keepdims=True)
            return z / np.sqrt((z**2).mean(axis=1, keepdims=True))
        np.testing.assert_allclose(norm(after_fn), norm(before_fn), rtol=1e-9, atol=1e-10)
    else:
        np.testing.assert_allclose(after_fn, before_fn, rtol=1e-9, atol=1e-10)
    before = _analyze(builder, spec, loss=loss, estimator=estimator)
    after = _analyze(builder, transformed, loss=loss, estimator=estimator)
    assert after.normalized_sharpness == pytest.approx(before.normalized_sharpness, rel=RTOL_INVARIANT)
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=RTOL_INVARIANT, abs=1e-12)
    if trace_changes:
        assert abs(after.hessian_trace - before.hessian_trace) > 1e-3 * abs(before.hessian_trace)
    mns_same = after.matrix_normalized_sharpness == pytest.approx(before.matrix_normalized_sharpness, rel=1e-8)
    assert mns_same == mns_invariant
    return before, after


@pytest.mark.parametrize("estimator", ["exact", "ggn"])
def test_layerwise_rescaling(builder, estimator):
    spec = netspec.mlp((5, 7, 6, 3), bias=False, seed=2)
    c = 7.5
    before, after = _check(builder, spec, netspec.rescale_layers(spec, 0, 1, c), loss="ce",
                           estimator=estimator, mns_invariant=True)
    # Hessian diagonal of layer 0 scales by 1/c², of layer 1 by c².
    assert after.layers[0].hessian_trace == pytest.approx(before.layers[0].hessian_trace / c**2, rel=1e-8)
    assert after.layers[1].hessian_trace == pytest.approx(before.layers[1].hessian_trace * c**2, rel=1e-8)


@pytest.mark.parametrize("estimator", ["exact", "ggn"])
def test_unitwise_rescaling(builder, estimator):
    spec = netspec.mlp((5, 7, 6, 3), seed=3)
    factors = np.exp(np.random.default_rng(0).uniform(-3, 3, size=7))
    _check(builder, spec, netspec.rescale_units(spec, 0, factors), loss="ce", estimator=estimator,
           mns_invariant=False)


def test_conv_before_batchnorm(builder):
    spec = netspec.cnn(batchnorm=True, seed=4, maxpool=False, image=4)
    factors = np.exp(np.random.default_rng(1).uniform(-2, 2, size=4))
    _check(builder, spec, netspec.rescale_before_norm(spec, 0, factors), loss="ce", estimator="exact",
           mns_invariant=False)


def test_dense_before_batchnorm_scalar(builder):
    spec = netspec.mlp((5, 6, 3), seed=5, batchnorm=True, bias=False)
    _check(builder, spec, netspec.rescale_before_norm(spec, 0, 13.0), loss="ce", estimator="exact",
           mns_invariant=True)


def test_dense_before_layernorm(builder):
    spec = netspec.mlp((5, 6, 3), seed=6, layernorm=True, bias=False)
    _check(builder, spec, netspec.rescale_before_norm(spec, 0, 0.05), loss="ce", estimator="exact",
           mns_invariant=True)


@pytest.mark.parametrize("estimator", ["exact", "ggn"])
def test_logit_scale_and_shift_with_nsce(builder, estimator):
    spec = netspec.mlp((5, 7, 4), activation="tanh", seed=7)
    transformed = netspec.scale_shift_logits(spec, 6.0, -2.5)
    # Only the last layer changes, by a layer-wise scale, which the matrix-normalized
    # measure also survives (method §4 table).
    _check(builder, spec, transformed, loss="nsce", estimator=estimator, trace_changes=True,
           mns_invariant=True)


@pytest.mark.parametrize("estimator", ["exact", "ggn"])
def test_conv_channel_rescaling_through_max_pooling(builder, estimator):
    # The output channels of the first convolution scaled by positive factors against the input
    # channels of the second, a ReLU and a 2×2 max pooling between them: both commute with a
    # positive per-channel scaling, so the function is the same. The signals go back through the
    # pooling (Keras: the forward's maxima, method §6.1; JAX: the program's argmax rule).
    spec = netspec.cnn(seed=10, image=4, maxpool=True)
    assert any(isinstance(layer, netspec.MaxPool2d) for layer in spec.layers)
    factors = np.exp(np.random.default_rng(4).uniform(-2, 2, size=4))
    _check(builder, spec, netspec.rescale_units(spec, 0, factors), loss="ce", estimator=estimator,
           mns_invariant=False)


@pytest.mark.parametrize("estimator", ["exact", "ggn"])
@pytest.mark.parametrize("channels,groups", [((2, 4, 6), 2), ((2, 4, 4), 4)], ids=["grouped", "depthwise"])
def test_grouped_conv_input_channel_rescaling(builder, estimator, channels, groups):
    # Input channels of a grouped (depthwise) convolution rescaled against the output
    # channels of the convolution before it: each input channel has its own column
    # variance within its group, so normalized sharpness must not move (method §8).
    spec = netspec.cnn(channels=channels, groups=groups, seed=8, image=4, maxpool=False)
    factors = np.exp(np.random.default_rng(2).uniform(-2, 2, size=channels[1]))
    before, after = _check(builder, spec, netspec.rescale_units(spec, 0, factors), loss="ce",
                           estimator=estimator, mns_invariant=False)
    assert before.layers[1].details["groups"] == groups
    assert before.layers[1].col_sigma.shape == (channels[1],)
    # The grouped layer itself is rescaled column-wise: its own NS is invariant, its trace is not.
    assert abs(after.layers[1].hessian_trace - before.layers[1].hessian_trace) > 1e-3 * before.layers[1].hessian_trace


@pytest.mark.parametrize("estimator", ["exact", "ggn"])
@pytest.mark.parametrize("channels,groups", [((2, 4, 6), 2), ((2, 4, 4), 4)], ids=["grouped", "depthwise"])
def test_grouped_conv_output_channel_rescaling(builder, estimator, channels, groups):
    spec = netspec.cnn(channels=channels, groups=groups, seed=9, image=4, maxpool=False)
    factors = np.exp(np.random.default_rng(3).uniform(-2, 2, size=channels[2]))
    _check(builder, spec, netspec.rescale_units(spec, 1, factors), loss="ce", estimator=estimator,
           mns_invariant=False)


@pytest.mark.parametrize("estimator", ["exact", "ggn"])
@pytest.mark.parametrize("layer", [0, 1], ids=["input-channels", "output-channels"])
def test_transposed_conv_channel_rescaling(builder, estimator, layer):
    # netspec.decoder's first transposed convolution (4×4, stride 2, pad 1) is weight layer 1: its
    # input channels against the convolution before it (layer 0's units), or its output channels
    # against the next transposed convolution's inputs (layer 1's units). A column or row scaling of
    # its canonical (out, in, kh, kw) matrix, whatever axis each framework stores them on (method §3).
    spec = netspec.decoder(seed=10)
    factors = np.exp(np.random.default_rng(4).uniform(-2, 2, size=spec.weight_layers()[layer].weight.shape[0]))
    before, after = _check(builder, spec, netspec.rescale_units(spec, layer, factors), loss="ce",
                           estimator=estimator, mns_invariant=False)
    assert before.layers[1].kind == "conv_transpose2d"
    for i in (layer, layer + 1):  # the rescaled rows and columns: their traces move
        moved = after.layers[i].hessian_trace - before.layers[i].hessian_trace
        assert abs(moved) > 1e-3 * before.layers[i].hessian_trace


def _scaled_vit_keras(c):
    """The Keras ViT of ``tests/arch/test_keras_layers.py`` (a loose ``(1, N, d)`` table in a custom
    layer) and its copy with feature j of the patch embedding and of the table times ``c[j]``."""
    require_frameworks("keras", "tensorflow")
    import keras

    from tests.arch.test_keras_layers import position_model

    model, x, y = position_model()
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    patch, table, mix = twin.get_layer("patch"), twin.get_layer("vit").pos_embed, twin.get_layer("mix")
    patch.kernel.assign(patch.kernel.numpy() * c)
    patch.bias.assign(patch.bias.numpy() * c)
    table.assign(table.numpy() * c)
    mix.kernel.assign(mix.kernel.numpy() / c[:, None])  # kernel (in, out): input row j
    return model, twin, (x, y), lambda m: m(x).numpy(), "vit/pos_embed"


def _scaled_vit_flax_nnx(c):
    """The flax nnx ViT of ``tests/arch/test_jax_embedding_fast.py`` (class token, ``(1, N, d)``
    ``nnx.Param`` table) and its copy with feature j of the patch embedding, the class token and
    the table times ``c[j]``."""
    require_frameworks("jax", "flax", "equinox")
    import jax.numpy as jnp
    from flax import nnx

    from tests.arch.test_jax_embedding_fast import PATCH_Y, PATCHES, NnxViT

    model = NnxViT(nnx.Rngs(5))
    twin = nnx.clone(model)
    cj = jnp.asarray(c)
    twin.patch.kernel[...] = twin.patch.kernel[...] * cj
    twin.patch.bias[...] = twin.patch.bias[...] * cj
    twin.cls_token[...] = twin.cls_token[...] * cj
    twin.pos_embed[...] = twin.pos_embed[...] * cj
    twin.mix.kernel[...] = twin.mix.kernel[...] / cj[:, None]  # kernel (in, out): input row j
    return model, twin, (PATCHES, PATCH_Y), lambda m: np.asarray(m(PATCHES)), "pos_embed"


@pytest.mark.parametrize("framework", ["keras", "flax_nnx"])
def test_position_table_feature_scaling(framework):
    """Feature j of the patch embedding and of the learned position table added to it (rows j of
    both canonical ``(features, ·)`` matrices) times c_j, the next linear layer's input column j
    times 1/c_j: the same function, the same normalized sharpness per layer (the rescaled rows
    and columns are absorbed, method §8), a moved trace, and the table on its fast path
    (method §6.1 "Position tables")."""
    c = np.array([3.0, 0.25, 1.5, 0.1])
    model, twin, data, predict, table = globals()[f"_scaled_vit_{framework}"](c)
    np.testing.assert_allclose(predict(twin), predict(model), rtol=1e-10, atol=1e-12)
    before, after = (normflat.analyze(m, data, loss="ce", estimator="ggn", progress=False) for m in (model, twin))
    assert [l.name for l in before.layers] == [l.name for l in after.layers]
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=RTOL_INVARIANT), lb.name
    assert after.normalized_sharpness == pytest.approx(before.normalized_sharpness, rel=RTOL_INVARIANT)
    assert abs(after.hessian_trace - before.hessian_trace) > 1e-3 * abs(before.hessian_trace)
    assert before.layer(table).details["path"] == after.layer(table).details["path"] == "fast"
    assert after.layer(table).hessian_trace != pytest.approx(before.layer(table).hessian_trace, rel=1e-3)
