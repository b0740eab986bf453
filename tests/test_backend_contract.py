"""The backend contract: every model builder, through the public API only.

Whatever the framework, ``normflat.analyze`` / ``normflat.hessian_diagonal``
must treat data, labels and errors the same way (one engine, method §9), give
deterministic, split-independent and framework-independent stochastic
estimates (normflat's own counter-based draws, probes in the canonical layout,
method §6), and leave the user's model exactly as it was, also after an error
or a ``KeyboardInterrupt``.

Only the builders (``tests/builders``) and a few framework helpers below
(appending a softmax, a custom loss, a state fingerprint) know the framework.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import normflat
from normflat.engine import DETAIL_KEYS, METADATA_KEYS
from normflat.engine.registry import IGNORED_REASON
from tests import netspec
from tests.builders import BUILDERS, load_builder

FRAMEWORK = {"torch": "torch", "keras": "keras", "equinox": "jax", "flax_nnx": "jax", "flax_linen": "jax"}


@pytest.fixture(params=BUILDERS)
def builder(request):
    module = load_builder(request.param)
    module.NAME = request.param
    return module


def _mlp(seed=0, sizes=(4, 5, 3)):
    return netspec.mlp(sizes, seed=seed)


def _cnn(seed=0):
    return netspec.cnn(channels=(2, 3, 4), image=4, seed=seed, batchnorm=True, maxpool=False)


def _kw(builder, **kw):
    kw.setdefault("progress", False)
    return {**kw, **builder.ANALYZE_KWARGS}


def _numpy(a):
    if hasattr(a, "detach"):
        a = a.detach().cpu()
    return np.asarray(a, dtype=np.float64)


def _diag(builder, model, data, **kw):
    return [_numpy(v) for v in normflat.hessian_diagonal(model, data, **_kw(builder, **kw)).values()]


def _batches(builder, x, y, size):
    """Framework-native batches as a list of (x, y) tuples."""
    return [tuple(b) for b in builder.make_data(x, y, size)]


def _pair(builder, x, y):
    """One framework-native (x, y) pair."""
    (batch,) = _batches(builder, x, y, len(x))
    return batch


def _native(builder, a):
    """A label array in the framework's own array type."""
    if builder.NAME == "torch":
        import torch

        return torch.as_tensor(a)
    if builder.NAME == "keras":
        import tensorflow as tf

        return tf.convert_to_tensor(a)
    import jax.numpy as jnp

    return jnp.asarray(a)


def _xp(builder):
    """The framework's array functions, for custom losses."""
    if builder.NAME == "torch":
        import torch

        return torch
    if builder.NAME == "keras":
        import keras

        return keras.ops
    import jax.numpy as jnp

    return jnp


def _assert_same(a, b, rtol=1e-12, what=""):
    assert len(a) == len(b), what
    scale = max(float(np.max(np.abs(v))) for v in b)
    for i, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=rtol * 1e-3 * scale, err_msg=f"{what} layer {i}")


# ----------------------------------------------------------------------------- framework helpers


def _with_softmax(builder, model):
    """The model followed by a softmax: its outputs are probabilities, not logits."""
    return _followed_by(builder, model, "softmax")


def _followed_by(builder, model, what):
    """The model followed by ``what``: ``"softmax"`` (its outputs are probabilities, not logits),
    ``"exp"`` (finite logits that overflow for large inputs), ``"scores"`` (its outputs, as
    embeddings, scored against every sample's of the batch: ``(n, n)`` logits that mix the samples,
    a contrastive model's ``logits_per_image``), ``"batch mean"`` (its outputs plus their mean over
    the batch: logits that mix the samples and keep the number of classes) or ``"pairs"`` (its outputs
    reshaped to two halves of the batch and back: the same logits, and a forward written for an even
    batch, which fails on one sample alone)."""
    name = builder.NAME
    if name == "torch":
        import torch
        from torch import nn

        class Then(nn.Module):
            def forward(self, z):
                if what == "scores":
                    return z @ z.T
                if what == "batch mean":
                    return z + z.mean(0, keepdim=True)
                if what == "pairs":
                    return z.reshape(2, -1, z.shape[-1]).reshape(-1, z.shape[-1])
                return torch.softmax(z, dim=1) if what == "softmax" else torch.exp(z)

        return nn.Sequential(model, Then())
    if name == "keras":
        import keras

        # A softmax written out: a final Softmax layer or activation is removed by the
        # Keras backend (docs/semantics.md), see test_keras_final_softmax_is_stripped.
        def then(t):
            if what == "exp":
                return keras.ops.exp(t)
            if what == "scores":
                return keras.ops.matmul(t, keras.ops.transpose(t))
            if what == "batch mean":
                return t + keras.ops.mean(t, axis=0, keepdims=True)
            if what == "pairs":
                return keras.ops.reshape(keras.ops.reshape(t, (2, -1, t.shape[-1])), (-1, t.shape[-1]))
            e = keras.ops.exp(t - keras.ops.max(t, axis=-1, keepdims=True))
            return e / keras.ops.sum(e, axis=-1, keepdims=True)

        return keras.Model(model.input, keras.layers.Lambda(then, dtype="float64")(model.outputs[0]))
    import jax
    import jax.numpy as jnp

    def then(z):
        if what == "scores":
            return z @ z.T
        if what == "batch mean":
            return z + z.mean(0, keepdims=True)
        if what == "pairs":
            return z.reshape(2, -1, z.shape[-1]).reshape(-1, z.shape[-1])
        return jax.nn.softmax(z, axis=-1) if what == "softmax" else jnp.exp(z)

    if name == "equinox":
        import equinox as eqx

        class Then(eqx.Module):
            net: eqx.Module

            def __call__(self, x):
                if what in ("scores", "batch mean", "pairs"):  # the builder's network takes one example: these need the batch
                    return then(jax.vmap(self.net)(x))
                return then(self.net(x))

        return Then(model)
    if name == "flax_nnx":
        from flax import nnx

        class ThenNnx(nnx.Module):
            def __init__(self, net):
                self.net = net

            def __call__(self, h):
                return then(self.net(h))

        return ThenNnx(model)
    if name == "flax_linen":
        import flax.linen as linen

        module, variables = model

        class ThenLinen(linen.Module):
            inner: linen.Module

            @linen.compact
            def __call__(self, h):
                return then(self.inner(h))

        wrapped = {k: {"inner": v} for k, v in variables.items()}
        return ThenLinen(module.clone()), wrapped
    raise AssertionError(name)


def _fingerprint(builder, model):
    """Everything of the model (and the framework's global state) an analysis must not change."""
    state = {"numpy_rng": repr(np.random.get_state()[1][:8].tolist())}
    name = builder.NAME
    if name == "torch":
        import torch

        state["params"] = [(n, p.detach().clone().numpy(), p.requires_grad, p.grad is None, p.dtype)
                           for n, p in model.named_parameters()]
        state["buffers"] = [(n, b.detach().clone().numpy()) for n, b in model.named_buffers()]
        state["training"] = [(n, m.training) for n, m in model.named_modules()]
        state["hooks"] = [(n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                          for n, m in model.named_modules()]
        state["global"] = (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_rng_state().numpy().tobytes())
    elif name == "keras":
        import keras

        state["weights"] = [(w.path, w.trainable, np.array(w.numpy())) for w in model.weights]
        # a replaced call (class or instance attribute) must be put back
        state["layers"] = [(layer.name, layer.trainable, type(layer).call, vars(layer).get("call"))
                           for layer in model.layers]
        state["model"] = (model.trainable, len(model.trainable_weights), len(model.non_trainable_weights))
    else:
        import jax

        if name == "flax_nnx":
            from flax import nnx

            tree = nnx.state(model)
        elif name == "flax_linen":
            tree = model[1]
        else:
            tree = model
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        state["leaves"] = [np.array(v) if hasattr(v, "shape") else v for v in leaves]
        state["treedef"] = str(treedef)
    return state


def _assert_fingerprint_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert _equal(a[key], b[key]), key


def _equal(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b))
    return a == b


# ----------------------------------------------------------------------------- data contract


def test_single_pair_is_one_batch_and_equals_batches(builder):
    spec = _mlp(1)
    x, y = netspec.data(spec, n=12, seed=2)
    model = builder.build(spec)
    one = normflat.analyze(model, _pair(builder, x, y), **_kw(builder))
    assert one.metadata["batches"] == 1 and one.metadata["examples"] == 12
    many = normflat.analyze(model, _batches(builder, x, y, 5), **_kw(builder))
    assert many.metadata["batches"] == 3 and many.metadata["examples"] == 12
    assert many.normalized_sharpness == pytest.approx(one.normalized_sharpness, rel=1e-12)
    _assert_same(_diag(builder, model, _batches(builder, x, y, 5)), _diag(builder, model, _pair(builder, x, y)))


def test_one_hot_labels_equal_class_indices(builder):
    spec = _mlp(2)
    x, y = netspec.data(spec, n=8, seed=3)
    model = builder.build(spec)
    onehot = np.eye(spec.num_classes)[y]
    for estimator in ("ggn", "exact"):
        ref = _diag(builder, model, builder.make_data(x, y, 4), estimator=estimator)
        got = _diag(builder, model, builder.make_data(x, onehot, 4), estimator=estimator)
        _assert_same(got, ref, rtol=1e-14, what=estimator)


def test_empty_batch_is_skipped(builder):
    spec = _mlp(3)
    x, y = netspec.data(spec, n=8, seed=4)
    model = builder.build(spec)
    batches = _batches(builder, x, y, 4)
    empty = tuple(a[:0] for a in batches[0])
    ref = normflat.analyze(model, batches, **_kw(builder))
    got = normflat.analyze(model, [empty, batches[0], empty, batches[1], empty], **_kw(builder))
    assert got.metadata["examples"] == 8 and got.metadata["batches"] == 2
    assert got.normalized_sharpness == pytest.approx(ref.normalized_sharpness, rel=1e-13)
    _assert_same(_diag(builder, model, [empty, batches[0], empty, batches[1]], estimator="ggn-mc", samples=2),
                 _diag(builder, model, batches, estimator="ggn-mc", samples=2), rtol=1e-13)


def test_max_batches(builder):
    spec = _mlp(4)
    x, y = netspec.data(spec, n=12, seed=5)
    model = builder.build(spec)
    got = normflat.analyze(model, builder.make_data(x, y, 4), **_kw(builder, max_batches=2))
    assert got.metadata["examples"] == 8 and got.metadata["batches"] == 2
    ref = normflat.analyze(model, builder.make_data(x[:8], y[:8], 4), **_kw(builder))
    assert got.normalized_sharpness == pytest.approx(ref.normalized_sharpness, rel=1e-13)


def test_max_batches_does_not_draw_one_more(builder):
    spec = _mlp(4)
    x, y = netspec.data(spec, n=12, seed=5)
    model = builder.build(spec)
    drawn = []

    def gen():
        for i, batch in enumerate(_batches(builder, x, y, 3)):
            drawn.append(i)
            yield batch

    report = normflat.analyze(model, gen(), **_kw(builder, max_batches=2))
    assert report.metadata["batches"] == 2 and drawn == [0, 1]


def test_mismatched_lengths(builder):
    spec = _mlp(5)
    x, y = netspec.data(spec, n=6, seed=6)
    xb, yb = _pair(builder, x, y)
    with pytest.raises(ValueError, match="6 inputs but 5 labels"):
        normflat.analyze(builder.build(spec), (xb, yb[:5]), **_kw(builder))


def _foreign(builder, a):
    """An array of the builder's batches as another framework's tensor: TensorFlow's for PyTorch,
    PyTorch's for the others."""
    host = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)  # the array's own dtype
    if builder.NAME == "torch":
        import tensorflow as tf

        return tf.constant(host)
    import torch

    return torch.from_numpy(host)


def test_batches_of_another_frameworks_tensors(builder):
    """Batches of another framework's tensors (a torch DataLoader feeding a Keras or JAX model, a
    tf.data pipeline feeding a PyTorch model) are read into numpy by the data contract: the same
    numbers as the framework's own arrays, for the analysis and the measures, also as one (x, y) pair.
    Before, PyTorch and Keras refused them ("the inputs x must be an array … of the keras backend or
    numpy, got Tensor")."""
    spec = _cnn(23)
    x, y = netspec.data(spec, n=6, seed=23)
    model = builder.build(spec)
    native = _batches(builder, x, y, 3)
    foreign = [(_foreign(builder, xb), _foreign(builder, yb)) for xb, yb in native]
    for estimator in ("ggn", "hutchinson"):
        want = normflat.analyze(model, native, **_kw(builder, estimator=estimator, seed=3))
        got = normflat.analyze(model, foreign, **_kw(builder, estimator=estimator, seed=3))
        assert (got.normalized_sharpness, got.hessian_trace) == (want.normalized_sharpness, want.hessian_trace)
    (whole,) = _batches(builder, x, y, 6)
    pair = normflat.analyze(model, (_foreign(builder, whole[0]), _foreign(builder, whole[1])), **_kw(builder))
    assert pair.hessian_trace == pytest.approx(normflat.analyze(model, whole, **_kw(builder)).hessian_trace,
                                               rel=1e-12)
    measures = ["fisher_rao_norm"]
    options = dict(loss="ce", progress=False, backend_options=builder.ANALYZE_KWARGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        normflat.hessian_diagonal(model, foreign, **_kw(builder))
    assert not [w for w in caught if "writable" in str(w.message)]  # no read-only view reached PyTorch
    got = normflat.measures(model, foreign, measures, **options)
    want = normflat.measures(model, native, measures, **options)
    assert got["fisher_rao_norm"] == pytest.approx(want["fisher_rao_norm"], rel=1e-12)


def test_labels_out_of_range(builder):
    spec = _mlp(6)
    x, _ = netspec.data(spec, n=6, seed=7)
    for bad in (np.full(6, spec.num_classes), np.full(6, -1)):
        with pytest.raises(ValueError, match=r"class indices in \[0, 2\]"):
            normflat.analyze(builder.build(spec), builder.make_data(x, bad, 3), **_kw(builder))


def test_soft_labels_refused(builder):
    spec = _mlp(7)
    x, _ = netspec.data(spec, n=6, seed=8)
    soft = np.full((6, 3), 1 / 3)
    xb = _pair(builder, x, np.zeros(6, dtype=np.int64))[0]
    with pytest.raises(ValueError, match="soft or smoothed labels are not supported"):
        normflat.analyze(builder.build(spec), (xb, _native(builder, soft)), **_kw(builder))


def test_all_empty_data(builder):
    spec = _mlp(8)
    x, y = netspec.data(spec, n=4, seed=9)
    model = builder.build(spec)
    empty = tuple(a[:0] for a in _pair(builder, x, y))
    for data in ([empty, empty], [], empty):
        with pytest.raises(ValueError, match="The data is empty"):
            normflat.analyze(model, data, **_kw(builder))


# ----------------------------------------------------------------------------- errors


def test_probabilities_refused(builder):
    spec = _mlp(9)
    x, y = netspec.data(spec, n=6, seed=10)
    model = _with_softmax(builder, builder.build(spec))
    for loss in ("nsce", "ce"):
        with pytest.raises(ValueError, match="probabilities"):
            normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, loss=loss))


@pytest.mark.parametrize("estimator,held", [("ggn", None), ("ggn-topk", None), ("hutchinson", None), ("ggn", 2)])
def test_later_batch_with_overflowing_logits(builder, estimator, held, monkeypatch):
    """Finite inputs whose logits overflow in a later batch: every framework names that batch
    with the logits' message (JAX, Keras and PyTorch read the value checks of the batches after
    the first in one go after the loop, not the "diagonal is not finite" that follows); also when
    the checks held are read during the loop (``held``: at most that many)."""
    if held is not None:
        session = f"normflat.backends.{FRAMEWORK[builder.NAME]}.session"
        monkeypatch.setattr(f"{session}.PENDING_CHECKS", held)
    spec = _mlp(9)
    x, y = netspec.data(spec, n=15, seed=10)
    x[6:9] *= 1e6  # the 3rd batch: exp of logits of order 1e5 is infinite
    model = _followed_by(builder, builder.build(spec), "exp")
    batches = _batches(builder, x, y, 3)
    data = batches
    if held is not None:
        def data_source():  # the checks must be read before the loop reaches the 5th batch
            yield from batches[:4]
            raise AssertionError("the deferred checks were not read within the loop")

        data = data_source()
    with pytest.raises(ValueError, match="Batch 2: the model's logits contain NaN or infinite"):
        normflat.analyze(model, data, **_kw(builder, estimator=estimator))


def test_keras_final_softmax_is_stripped(builder):
    # Documented Keras behaviour (docs/semantics.md): a final Softmax of a functional
    # model is made the identity while analyzing, so the numbers are those of the logits.
    if builder.NAME != "keras":
        pytest.skip("Keras only")
    import keras

    spec = _mlp(9)
    x, y = netspec.data(spec, n=6, seed=10)
    model = builder.build(spec)
    wrapped = keras.Model(model.input, keras.layers.Softmax(dtype="float64")(model.outputs[0]))
    pred = builder.predict(wrapped, x)
    got = normflat.analyze(wrapped, builder.make_data(x, y, 3), **_kw(builder))
    ref = normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder))
    assert got.metadata["backend"].get("stripped_softmax")
    assert got.normalized_sharpness == pytest.approx(ref.normalized_sharpness, rel=1e-12)
    np.testing.assert_array_equal(builder.predict(wrapped, x), pred)  # the softmax is back


def test_zero_initialized_head(builder):
    spec = _mlp(10)
    head = spec.weight_layers()[-1]
    head.weight[:] = 0.0
    head.bias[:] = 0.0
    x, y = netspec.data(spec, n=6, seed=11)
    model = builder.build(spec)
    with pytest.raises(ValueError, match=r"nearly\) equal across classes"):
        normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, loss="nsce"))
    report = normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, loss="ce"))
    assert np.isfinite(report.normalized_sharpness) and np.isfinite(report.hessian_trace)


@pytest.mark.parametrize("estimator", ["ggn", "ggn-mc", "hutchinson", "exact"])
def test_saturated_softmax_warns_the_same(builder, estimator):
    """Logits so far apart that every sample's top probability rounds to 1 (inputs ×1e4 through a
    bias-free ReLU net): every framework and estimator warns once with the engine's message
    (method §7) and returns finite numbers; with one batch of ordinary inputs it does not warn."""
    import warnings

    spec = netspec.mlp((4, 5, 3), seed=12, bias=False)
    x, y = netspec.data(spec, n=6, seed=13)
    big = x * 1e4
    opts = normflat.engine.validate_options(loss="ce")
    eps = float(np.finfo(np.float64).eps)
    stats = normflat.engine.losses.logit_stats(np, netspec.forward(spec, big))
    assert normflat.engine.losses.softmax_saturation(stats, opts, 3, eps) > 10  # saturated in float64
    model = builder.build(spec)
    kw = _kw(builder, loss="ce", estimator=estimator)
    with pytest.warns(UserWarning, match="softmax is saturated on every sample") as caught:
        report = normflat.analyze(model, builder.make_data(big, y, 3), **kw)
    assert sum("saturated" in str(w.message) for w in caught) == 1
    assert np.isfinite(report.normalized_sharpness) and np.isfinite(report.hessian_trace)
    mixed = _batches(builder, big, y, 3)[:1] + _batches(builder, x, y, 3)[1:]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saturated")
        normflat.analyze(model, mixed, **kw)


def test_single_output_unit(builder):
    spec = _mlp(11, sizes=(4, 5, 1))
    x, _ = netspec.data(spec, n=6, seed=12)
    with pytest.raises(ValueError, match="single output unit"):
        normflat.analyze(builder.build(spec), builder.make_data(x, np.zeros(6, dtype=np.int64), 3), **_kw(builder))


#: The distinctive part of the engine's error for logits whose classes follow the rows
#: (normflat.engine.losses.check_same_classes).
MIXED = (r"their number of classes \(the last axis\) follows the number of samples the model is called on, so "
         r"each sample's logits depend on the other samples")


def test_logits_that_mix_the_samples(builder):
    """In-batch scores ``(n, n)``, each sample's logits depending on the others (a contrastive model's
    ``logits_per_image``): the engine's one error in every framework, whatever the path that meets them
    (PyTorch: the probe of 2 rows against the chunk, the one-row forward before refusing 2 classes with
    ``nsce``, the batches of the Hessian-vector products and of the measures; Keras: the same, and the
    compiled steps' traces; JAX: the per-example trace against the batch model), never a number that
    depends on the batching, an error worded for a classifier, or one from inside the framework."""
    spec = _mlp(15)
    x, y = netspec.data(spec, n=7, seed=16)
    binary = y % 2  # labels that 2 "classes" take, so that no label check refuses them first
    model = _followed_by(builder, builder.build(spec), "scores")
    xp = _xp(builder)

    def custom(z, labels):
        return xp.mean(z * z)

    for labels, size, kw in [
        (binary, 7, dict(loss="ce")),  # one batch, no chunks
        (binary, 7, dict()),  # nsce: 2 classes in the probe of 2 rows
        (y, 7, dict(loss="ce")),  # a label 2, out of the probe's range
        (binary, 4, dict(loss="ce")),  # batches of 4 and 3
        (binary, 4, dict(loss=custom, estimator="hutchinson", samples=2)),
    ]:
        with pytest.raises(ValueError, match=MIXED):
            normflat.hessian_diagonal(model, builder.make_data(x, labels, size), **_kw(builder, **kw))
    for labels in (binary, y):  # the perturbation models of normflat.measures
        with pytest.raises(ValueError, match=MIXED):
            normflat.measures(model, builder.make_data(x, labels, 4), ["fisher_rao_norm"], loss="ce", progress=False,
                              backend_options=builder.ANALYZE_KWARGS)


#: The distinctive part of the engine's error for logits of a sample that depend on the other samples
#: with the number of classes kept (normflat.engine.losses.check_samples_apart).
MIXED_VALUES = r"The model's logits of a sample depend on the other samples of its batch: row 0 of the first batch"


@pytest.mark.parametrize("estimator", ["ggn", "ggn-mc", "exact", "hutchinson"])
def test_logits_that_mix_the_samples_with_the_classes_kept(builder, estimator):
    """A model whose logits of one sample depend on the others with as many classes on every call (its
    logits plus their mean over the batch, as a statistic over the batch axis would): every framework
    compares the first two rows computed together with each alone and gives the engine's one error, for
    every estimator and in the perturbation models of ``normflat.measures``. Before, each gave its own silent number: PyTorch's and Keras' generic paths and JAX
    the curvature of each sample alone, their Hessian-vector products that of the batch."""
    spec = _mlp(15)
    x, y = netspec.data(spec, n=7, seed=16)
    model = _followed_by(builder, builder.build(spec), "batch mean")
    kw = dict(estimator=estimator, loss="ce")
    if estimator == "hutchinson":
        kw["samples"] = 2
    for size in (7, 3):  # one batch; batches of 3, 3 and 1
        with pytest.raises(ValueError, match=MIXED_VALUES):
            normflat.hessian_diagonal(model, builder.make_data(x, y, size), **_kw(builder, **kw))
    if estimator == "ggn":  # the perturbation models of normflat.measures, the same error
        with pytest.raises(ValueError, match=MIXED_VALUES):
            normflat.measures(model, builder.make_data(x, y, 4), ["fisher_rao_norm"], loss="ce", progress=False,
                              backend_options=builder.ANALYZE_KWARGS)
    # The same network without the mean: no error, and a first batch of one row cannot reveal the mixing.
    normflat.hessian_diagonal(builder.build(spec), builder.make_data(x, y, 7), **_kw(builder, **kw))
    normflat.hessian_diagonal(model, builder.make_data(x[:1], y[:1], 1), **_kw(builder, **kw))


#: The distinctive part of the engine's error for a model that runs on its batches but fails on one
#: sample alone (normflat.engine.losses.one_sample_error).
ONE_SAMPLE = r"model runs on its batches but fails when called on one sample alone \("


def test_model_that_fails_on_one_sample_alone(builder):
    """A forward written for an even batch (its logits reshaped to two halves of the batch and back)
    runs on batches of 4 and fails on one sample alone. Wherever the analysis runs each sample alone
    (PyTorch's and Keras' generic paths, every weight in JAX), every framework gives the engine's one
    error naming the cause and the fix, the framework's own error quoted and chained; before, each
    raised its own error from deep inside the analysis (a reshape in a compiled loop, a ``vmap``-free
    per-sample loop, a ``make_jaxpr`` trace). The fast rules of PyTorch and Keras read the batch's
    activations: there the same model gives the plain network's numbers."""
    spec = _mlp(17)
    x, y = netspec.data(spec, n=8, seed=18)
    plain = builder.build(spec)
    model = _followed_by(builder, plain, "pairs")
    data = builder.make_data(x, y, 4)
    with pytest.raises(ValueError, match=ONE_SAMPLE + r".*\)\. normflat computes every weight's curvature") as info:
        normflat.hessian_diagonal(model, data, **_kw(builder, fast=False))
    assert info.value.__cause__ is not None  # the framework's own error, chained
    assert "Make the model's forward accept a batch of one sample" in str(info.value)
    if FRAMEWORK[builder.NAME] == "jax":  # per example: every estimator, fast or not
        for estimator in ("ggn", "exact"):
            with pytest.raises(ValueError, match=ONE_SAMPLE + ".*the JAX backend traces the model per example"):
                normflat.hessian_diagonal(model, builder.make_data(x, y, 4), **_kw(builder, estimator=estimator))
        return
    _assert_same(_diag(builder, model, builder.make_data(x, y, 4)), _diag(builder, plain, builder.make_data(x, y, 4)))
    _assert_same(_diag(builder, model, builder.make_data(x, y, 4), estimator="exact"),
                 _diag(builder, plain, builder.make_data(x, y, 4), estimator="exact"))


#: The distinctive part of the engine's error for inputs the model fails on
#: (normflat.engine.data.model_fails_on_inputs).
FAILS_ON_INPUTS = r"model fails on the inputs of batch 0 \(\w+ \(6, 5\)\): "


def test_inputs_the_model_fails_on(builder):
    """Inputs that do not fit the model (one feature too many): every framework gives the engine's one
    error, naming the batch and its inputs' dtype and shape, the model's own error quoted and chained,
    for the analysis (a GGN and a Hessian-vector product estimator) and the perturbation models of
    ``normflat.measures``, on the first batch and on a later one. Before, each raised its own error
    from inside the framework (PyTorch's matmul, Keras' input check, flax's parameter shape check, an
    equinox message about ``vmap``; on a later batch also a broadcasting error from inside JAX)."""
    spec = _mlp(19)
    x, y = netspec.data(spec, n=6, seed=20)
    wide = np.concatenate([x, x[:, :1]], axis=1)
    model = builder.build(spec)
    for estimator in ("ggn", "exact"):
        with pytest.raises(ValueError, match=FAILS_ON_INPUTS) as info:
            normflat.analyze(model, builder.make_data(wide, y, 6), **_kw(builder, estimator=estimator))
        assert info.value.__cause__ is not None  # the model's own error, chained
        assert str(info.value).endswith("Check that the model runs on one batch of the data outside normflat.")
    with pytest.raises(ValueError, match=FAILS_ON_INPUTS):
        normflat.measures(model, builder.make_data(wide, y, 6), ["fisher_rao_norm"], loss="ce", progress=False,
                          backend_options=builder.ANALYZE_KWARGS)
    # A later batch that the model does not take, after one it does: the same error, for that batch,
    # wherever its work fails (a compiled step, a per-sample transform, a perturbed loss).
    later = list(builder.make_data(x, y, 6)) + list(builder.make_data(wide, y, 6))
    for estimator in ("ggn", "hutchinson"):
        with pytest.raises(ValueError, match=FAILS_ON_INPUTS.replace("batch 0", "batch 1")) as info:
            normflat.analyze(model, later, **_kw(builder, estimator=estimator))
        assert info.value.__cause__ is not None
    for measure in ("fisher_rao_norm", "adaptive_sharpness"):
        with pytest.raises(ValueError, match=FAILS_ON_INPUTS.replace("batch 0", "batch 1")):
            normflat.measures(model, later, [measure], loss="ce", progress=False,
                              backend_options=builder.ANALYZE_KWARGS)
    # normflat's own errors raised around the first forward keep their messages.
    with pytest.raises(ValueError, match="probabilities"):
        normflat.analyze(_with_softmax(builder, model), builder.make_data(x, y, 6), **_kw(builder))


def test_samples_apart_tolerance_and_comparison():
    """The engine's comparison: rounding of the logits' dtype passes, a difference of their own order
    fails; non-finite entries and rows of another shape are not compared."""
    from normflat.engine.losses import check_samples_apart, samples_apart_tolerance

    assert samples_apart_tolerance("float64") == pytest.approx(16 * np.finfo(np.float64).eps ** 0.5)
    assert samples_apart_tolerance("float32") == pytest.approx(16 * np.finfo(np.float32).eps ** 0.5)
    assert samples_apart_tolerance("bfloat16") == samples_apart_tolerance("torch.float16") == 0.1
    z = np.random.default_rng(0).normal(size=(2, 5))
    scale = np.abs(z - z.mean(1, keepdims=True)).max(axis=1)  # each row's largest centred logit
    first = np.eye(5)[0]  # one class moved: centred, its difference is 0.8 of the move
    for dtype, tol in (("float64", 2.38e-7), ("float32", 5.5e-3)):
        check_samples_apart(z, [z[:1] + 0.3 * tol * scale[0] * first, z[1]], dtype=dtype)
        with pytest.raises(ValueError, match="row 1 of the first batch"):
            check_samples_apart(z, [z[:1], z[1] + 3 * tol * scale[1] * first], dtype=dtype)
    check_samples_apart(z, [z[:1, :3], np.where(np.arange(5) == 2, np.nan, z[1])])  # trimmed; NaN not compared
    check_samples_apart(np.zeros((2, 3)), [np.zeros(3), np.zeros(3)])  # constant logits (a zero head)
    check_samples_apart(z, [z[:1] + 3.0, z[1] - 1.0])  # a shift of all logits changes no probability
    with pytest.raises(ValueError, match="row 0 of the first batch"):  # a large common offset hides nothing
        check_samples_apart(z + 1e4, [z[:1] + 1e4 + 0.1 * np.eye(5)[:1], z[1] + 1e4])
    tokens = np.random.default_rng(1).normal(size=(2, 4, 5))  # token logits: each token's centred
    check_samples_apart(tokens, [tokens[:1] + np.arange(4)[None, :, None], tokens[1]])
    with pytest.raises(ValueError, match="row 1 of the first batch"):
        check_samples_apart(tokens, [tokens[:1], tokens[1] + 0.1 * np.arange(5)])


def test_two_classes_with_nsce_also_after_an_analysis_with_ce(builder):
    """The shape checks apply each analysis' own options, also where the first forward's findings are
    cached per model (Keras): a binary classifier analyzed with ``ce`` is still refused with ``nsce``."""
    spec = _mlp(16, sizes=(4, 5, 2))
    x, y = netspec.data(spec, n=6, seed=17)
    model = builder.build(spec)
    assert np.isfinite(normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, loss="ce")).hessian_trace)
    with pytest.raises(ValueError, match="The model has 2 classes"):
        normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, loss="nsce"))


def test_custom_loss_errors(builder):
    spec = _mlp(12)
    x, y = netspec.data(spec, n=6, seed=13)
    model = builder.build(spec)
    xp = _xp(builder)

    def per_sample(z, labels):
        return xp.mean(z * z, axis=1)

    def nan_loss(z, labels):
        return xp.mean(z * z) * float("nan")

    for estimator in ("exact", "hutchinson"):
        with pytest.raises(TypeError, match="must return the mean loss"):
            normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, loss=per_sample, estimator=estimator))
        # the engine's loss check, not only the later non-finite-diagonal error (which also says NaN)
        with pytest.raises(ValueError, match="Batch 0: the loss is NaN or infinite"):
            normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, loss=nan_loss, estimator=estimator))


def test_option_errors(builder):
    spec = _mlp(13)
    x, y = netspec.data(spec, n=6, seed=14)
    model = builder.build(spec)
    with pytest.raises(ValueError, match="samples=3 has no meaning"):
        normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, estimator="ggn", samples=3))
    with pytest.raises(ValueError, match="tol must be a positive finite number"):
        normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, tol=-1))
    for flag in ("fast", "force"):  # "no" would read as true
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'no'"):
            normflat.analyze(model, builder.make_data(x, y, 3), **_kw(builder, **{flag: "no"}))


def test_memory_budget_too_small_for_one_signal(builder):
    """Every backend steps through one sample's signals when the sample does not fit (method §9,
    "Memory"), and refuses with the same message a budget that one signal does not fit."""
    spec = _mlp(14, sizes=(4, 6, 40))
    x, y = netspec.data(spec, n=4, seed=15)
    with pytest.raises(ValueError, match=r"^memory_budget=500 bytes \(500 B\) is too small: one back-propagated "
                                         r"GGN signal needs \d+ bytes \(.*\) for a single sample\. Raise "
                                         r"memory_budget"):
        normflat.analyze(builder.build(spec), builder.make_data(x, y, 4),
                         **_kw(builder, estimator="ggn", memory_budget=500))


@pytest.mark.parametrize("estimator", ["ggn", "ggn-mc", "ggn-topk"])
def test_fast_false_takes_the_generic_path_with_the_same_numbers(builder, estimator):
    """``fast=False`` (every framework): every weight on the generic path, reason ``"fast=False"``, the
    same diagonal as the fast rules (the same draws for the stochastic estimators). Under ``ggn-topk``
    the dense head's fast rule is exact (method §6.1) where the generic path samples it: there the
    fast head equals the exact ``ggn``'s."""
    spec = _cnn(17)
    x, y = netspec.data(spec, n=6, seed=18)
    model = builder.build(spec)
    kw = dict(estimator=estimator, seed=2, **({} if estimator == "ggn" else {"samples": 2}),
              **({"top_classes": 1} if estimator == "ggn-topk" else {}))
    report = normflat.analyze(model, builder.make_data(x, y, 4), **_kw(builder, fast=False, **kw))
    for layer in report.layers:
        assert (layer.details["path"], layer.details["generic_reason"]) == ("generic", "fast=False"), layer.name
    fast = normflat.analyze(model, builder.make_data(x, y, 4), **_kw(builder, **kw))
    assert all(layer.details["path"] == "fast" for layer in fast.layers)
    generic = _diag(builder, model, builder.make_data(x, y, 4), fast=False, **kw)
    got = _diag(builder, model, builder.make_data(x, y, 4), **kw)
    if estimator == "ggn-topk":
        exact_head = _diag(builder, model, builder.make_data(x, y, 4), estimator="ggn")[-1]
        _assert_same(got[-1:], [exact_head], rtol=1e-10)
        generic, got = generic[:-1], got[:-1]
    _assert_same(generic, got, rtol=1e-10)


@pytest.mark.parametrize("estimator", ["ggn-topk", "ggn-mc"])
def test_hessian_diagonal_keeps_one_pooled_sum_per_weight(builder, estimator, monkeypatch):
    """``hessian_diagonal`` wants only the mean of the ``K`` group estimates (``options.pooled``):
    every backend keeps one sum per weight (``ggn-topk``: 1 instead of ``1 + K``), and the diagonal
    is the mean of ``analyze``'s group estimates (the same draws), on a CNN over two batches."""
    import importlib

    from normflat.engine import estimators, validate_options

    backend = importlib.import_module(f"normflat.backends.{FRAMEWORK[builder.NAME]}")
    spec = _cnn(19)
    x, y = netspec.data(spec, n=6, seed=20)
    model = builder.build(spec)
    kw = dict(loss="ce", estimator=estimator, samples=5, seed=3, progress=False,
              **({"top_classes": 1} if estimator == "ggn-topk" else {}))
    options = validate_options(**kw)
    kept = []
    finalize = estimators.finalize

    def spy(state, *args, **kwargs):
        kept.append(sorted({int(s.shape[0]) for s in state.sums if s is not None}))
        return finalize(state, *args, **kwargs)

    monkeypatch.setattr(estimators, "finalize", spy)
    pooled = backend.hessian_diagonal(model, builder.make_data(x, y, 4), options, **builder.ANALYZE_KWARGS)
    problems, _ = backend.layer_problems(model, builder.make_data(x, y, 4), options, **builder.ANALYZE_KWARGS)
    # analyze: K' group sums, and the exact head of ggn-topk its one shared sum in every backend (not
    # K' head-sized sums of which K' - 1 are zero).
    assert kept[0] == [1] and kept[1] == ([1] if estimator == "ggn-topk" else []) + [options.state_groups], kept
    assert len(pooled) == len(problems)
    for value, problem in zip(pooled.values(), problems):
        assert len(problem.hessian_diag_samples) == options.groups > 1
        mean = _numpy(problem.hessian_diag)
        np.testing.assert_allclose(_numpy(value), mean, rtol=1e-10, atol=1e-14 * float(np.abs(mean).max()))


# ----------------------------------------------------------------------------- metadata


def test_metadata_and_details(builder):
    spec = _cnn(1)
    x, y = netspec.data(spec, n=6, seed=15)
    report = normflat.analyze(builder.build(spec), builder.make_data(x, y, 4), **_kw(builder, estimator="ggn-mc",
                                                                                    samples=2, seed=3))
    meta = report.metadata
    assert set(meta) >= set(METADATA_KEYS)
    assert meta["framework"] == FRAMEWORK[builder.NAME]
    assert (meta["estimator"], meta["samples"], meta["seed"], meta["loss"]) == ("ggn-mc", 2, 3, "nsce")
    assert (meta["examples"], meta["batches"], meta["world_size"]) == (6, 2, 1)
    assert len(report.layers) == len(spec.weight_layers())
    for layer in report.layers:
        assert set(layer.details) >= set(DETAIL_KEYS), layer.name
    # The batch normalizations' scales, shifts and running statistics (where the framework holds them
    # as parameters or variables) are excluded with one reason in every framework, the head's bias as a bias.
    reasons = meta["excluded"]
    assert sum(1 for name, reason in reasons.items() if reason == IGNORED_REASON) >= 4
    assert set(reasons.values()) == {IGNORED_REASON, "bias"}, reasons


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("estimator,samples", [("ggn", None), ("exact", None), ("ggn-mc", 3), ("hutchinson", 4)])
def test_deterministic(builder, estimator, samples):
    spec = _mlp(14)
    x, y = netspec.data(spec, n=8, seed=16)
    model = builder.build(spec)
    a = _diag(builder, model, builder.make_data(x, y, 4), estimator=estimator, samples=samples, seed=1)
    b = _diag(builder, model, builder.make_data(x, y, 4), estimator=estimator, samples=samples, seed=1)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    if samples is not None:
        c = _diag(builder, model, builder.make_data(x, y, 4), estimator=estimator, samples=samples, seed=2)
        assert not all(np.allclose(u, v, rtol=1e-6) for u, v in zip(a, c))


@pytest.mark.parametrize("estimator,samples", [("ggn-mc", 3), ("hutchinson", 4)])
def test_stochastic_independent_of_the_split(builder, estimator, samples):
    spec = _mlp(15)
    x, y = netspec.data(spec, n=9, seed=17)
    model = builder.build(spec)
    one = _diag(builder, model, _pair(builder, x, y), estimator=estimator, samples=samples, seed=4)
    three = _diag(builder, model, builder.make_data(x, y, 4), estimator=estimator, samples=samples, seed=4)
    _assert_same(three, one, rtol=1e-10, what=estimator)


_TORCH_REFERENCE: dict = {}


@pytest.mark.parametrize("estimator,samples", [("ggn-mc", 2), ("hutchinson", 3)])
def test_stochastic_same_as_torch(builder, estimator, samples):
    if builder.NAME == "torch":
        pytest.skip("torch is the reference")
    spec = _cnn(2)  # conv + dense: probes must be drawn in the canonical layout
    x, y = netspec.data(spec, n=6, seed=18)
    if estimator not in _TORCH_REFERENCE:  # computed once for all builders
        torch_builder = load_builder("torch")
        torch_builder.NAME = "torch"
        _TORCH_REFERENCE[estimator] = _diag(torch_builder, torch_builder.build(spec), torch_builder.make_data(x, y, 4),
                                            estimator=estimator, samples=samples, seed=5)
    ref = _TORCH_REFERENCE[estimator]
    got = _diag(builder, builder.build(spec), builder.make_data(x, y, 4), estimator=estimator, samples=samples,
                seed=5)
    _assert_same(got, ref, rtol=1e-8, what=f"{builder.NAME} vs torch")


# ----------------------------------------------------------------------------- the model is untouched


def _prepared(builder, spec):
    """A model with a frozen parameter where the framework has the notion (it must stay frozen)."""
    model = builder.build(spec)
    if builder.NAME == "torch":
        next(p for n, p in model.named_parameters() if n.endswith("bias")).requires_grad_(False)
    elif builder.NAME == "keras":
        next(layer for layer in model.layers if layer.weights).trainable = False
    return model


def test_fingerprint_detects_changes(builder):
    # The check below must be able to fail: a changed weight or flag changes the fingerprint.
    spec = _cnn(3)
    model = _prepared(builder, spec)
    before = _fingerprint(builder, model)
    if builder.NAME == "torch":
        next(model.parameters()).requires_grad_(False)
        changed = [_fingerprint(builder, model)]
        model.train()
        changed.append(_fingerprint(builder, model))
        with __import__("torch").no_grad():
            next(model.parameters()).add_(1e-12)
        changed.append(_fingerprint(builder, model))
    elif builder.NAME == "keras":
        model.layers[-1].trainable = False
        changed = [_fingerprint(builder, model)]
        model.layers[-1].trainable = True
        w = model.layers[-1].weights[0]
        w.assign(w.numpy() + 1e-12)
        changed.append(_fingerprint(builder, model))
    else:
        other = spec.copy()
        other.weight_layers()[0].weight[0, 0, 0, 0] += 1e-12
        changed = [_fingerprint(builder, _prepared(builder, other))]
    for fp in changed:
        with pytest.raises(AssertionError):
            _assert_fingerprint_equal(fp, before)


@pytest.mark.parametrize("estimator", ["ggn-mc", "exact"])
def test_model_untouched_after_success(builder, estimator):
    spec = _cnn(3)
    x, y = netspec.data(spec, n=6, seed=19)
    model = _prepared(builder, spec)
    # Lists of batches: iterating a torch DataLoader draws from torch's global RNG itself.
    data = _batches(builder, x, y, 4)
    before, pred = _fingerprint(builder, model), builder.predict(model, x)
    samples = {"ggn-mc": 2, "hutchinson": 2}.get(estimator)
    normflat.analyze(model, data, **_kw(builder, estimator=estimator, samples=samples))
    _assert_fingerprint_equal(_fingerprint(builder, model), before)
    np.testing.assert_array_equal(builder.predict(model, x), pred)


def test_the_warning_filters_are_never_touched(builder, monkeypatch):
    """normflat never changes the process's warning filters, not even for a moment: a
    ``warnings.catch_warnings`` block is not thread-safe (two analyses in threads could leave the
    user's process with an "ignore" of the other thread). The frameworks' own blocks are theirs."""
    import os
    import sys
    import warnings

    package = os.path.dirname(normflat.__file__) + os.sep
    calls = []

    def watched(original):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(package):
                calls.append((original.__name__, caller))
            return original(*args, **kwargs)
        return call

    class WatchedBlock(warnings.catch_warnings):
        def __init__(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(package):
                calls.append(("catch_warnings", caller))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(warnings, "catch_warnings", WatchedBlock)
    for name in ("simplefilter", "filterwarnings", "resetwarnings"):
        monkeypatch.setattr(warnings, name, watched(getattr(warnings, name)))
    spec = _cnn(6)
    x, y = netspec.data(spec, n=6, seed=22)
    x = x.astype(np.float32)
    model = builder.build(spec, dtype="float32")  # the core promotes each layer to float64 for the solve
    for estimator, samples in (("ggn", None), ("ggn-mc", 2), ("hutchinson", 2), ("exact", None)):
        report = normflat.analyze(model, _batches(builder, x, y, 3), **_kw(builder, estimator=estimator,
                                                                          samples=samples))
        assert np.isfinite(report.normalized_sharpness)
    assert not calls, calls


def test_model_untouched_after_an_error_mid_pass(builder):
    spec = _cnn(4)
    x, y = netspec.data(spec, n=8, seed=20)
    x_bad = x.copy()
    x_bad[5] = np.nan  # in the 2nd batch
    model = _prepared(builder, spec)
    data = _batches(builder, x_bad, y, 4)
    before, pred = _fingerprint(builder, model), builder.predict(model, x)
    for estimator in ("ggn", "exact"):
        with pytest.raises(ValueError, match="Batch 1: the inputs contain NaN"):
            normflat.analyze(model, data, **_kw(builder, estimator=estimator))
        _assert_fingerprint_equal(_fingerprint(builder, model), before)
        np.testing.assert_array_equal(builder.predict(model, x), pred)


def test_model_untouched_after_keyboard_interrupt(builder):
    spec = _cnn(5)
    x, y = netspec.data(spec, n=8, seed=21)
    model = _prepared(builder, spec)
    batches = _batches(builder, x, y, 4)
    before, pred = _fingerprint(builder, model), builder.predict(model, x)

    def interrupted():
        yield batches[0]
        raise KeyboardInterrupt  # the user presses Ctrl-C while the 2nd batch loads

    for estimator, samples in (("ggn", None), ("hutchinson", 2)):
        with pytest.raises(KeyboardInterrupt):
            normflat.analyze(model, interrupted(), **_kw(builder, estimator=estimator, samples=samples))
        _assert_fingerprint_equal(_fingerprint(builder, model), before)
        np.testing.assert_array_equal(builder.predict(model, x), pred)
    # and the model still analyzes normally afterwards
    report = normflat.analyze(model, batches, **_kw(builder))
    assert report.metadata["examples"] == 8
