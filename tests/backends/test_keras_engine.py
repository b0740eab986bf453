"""Keras backend on the engine: the data contract, the errors, randomness, side effects, groups.

Every bad input gets the engine's one error (the same text in every framework);
the stochastic estimators do not depend on the batch split; two analyses in
two threads leave warnings, the global random streams and the model alone.
"""

from __future__ import annotations

import os
import random
import threading
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import normflat  # noqa: E402
from normflat.engine import DETAIL_KEYS, METADATA_KEYS  # noqa: E402
from normflat.engine.random import rademacher  # noqa: E402

L = keras.layers
F64 = "float64"


def mlp(seed=0, out=3, dtype=F64, activation=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype=dtype),
        L.Dense(6, activation="tanh", dtype=dtype, name="d1"),
        L.Dense(4, activation="tanh", dtype=dtype, name="d2"),
        L.Dense(out, activation=activation, dtype=dtype, name="d3"),
    ])


def data(n=10, seed=0, classes=3):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)), rng.integers(0, classes, size=n)


def batches(x, y, size):
    return [(x[a:a + size], y[a:a + size]) for a in range(0, len(y), size)]


def diag(model, data, **kw):
    kw.setdefault("progress", False)
    return {k: v.numpy() for k, v in normflat.hessian_diagonal(model, data, **kw).items()}


def assert_same(a, b, rtol=1e-12):
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=1e-15, err_msg=k)


class Wrapped(keras.Model):
    """A subclassed model applying ``fn`` to an inner model's logits (no automatic stripping)."""

    def __init__(self, inner, fn):
        super().__init__(dtype=F64)
        self.inner, self.fn = inner, fn

    def call(self, x):
        return self.fn(self.inner(x))


# ----------------------------------------------------------------------------- the data contract


def test_single_pair_is_one_batch_and_max_batches():
    model = mlp()
    x, y = data(n=300)
    rep = normflat.analyze(model, (x, y), progress=False)
    assert rep.metadata["batches"] == 1 and rep.metadata["examples"] == 300
    rep = normflat.analyze(model, batches(x, y, 50), max_batches=2, progress=False)
    assert rep.metadata["batches"] == 2 and rep.metadata["examples"] == 100


def test_metadata_and_detail_keys_are_the_engines():
    model = mlp()
    rep = normflat.analyze(model, data(), progress=False)
    assert set(METADATA_KEYS) <= set(rep.metadata)
    assert rep.metadata["framework"] == "keras" and rep.metadata["world_size"] == 1
    for layer in rep.layers:
        assert set(DETAIL_KEYS) <= set(layer.details)
        assert layer.details["path"] == "fast" and layer.details["groups"] == 1
    rep = normflat.analyze(model, data(), estimator="exact", progress=False)
    assert all(layer.details["path"] == "hvp" for layer in rep.layers)


def test_batch_size_is_a_deprecated_alias_of_chunk_size():
    model = mlp()
    x, y = data(n=11)
    with pytest.warns(DeprecationWarning, match="batch_size is deprecated"):
        rep = normflat.analyze(model, (x, y), batch_size=4, progress=False)
    assert rep.metadata["batches"] == 1 and rep.metadata["chunk_size"] == 4
    assert rep.normalized_sharpness == pytest.approx(normflat.analyze(model, (x, y), progress=False)
                                                     .normalized_sharpness, rel=1e-12)
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        normflat.analyze(model, (x, y), batch_size=4, chunk_size=3, progress=False)


def test_one_hot_labels_equal_indices_and_soft_labels_are_refused():
    model = mlp()
    x, y = data()
    ref = diag(model, (x, y))
    assert_same(diag(model, (x, np.eye(3)[y])), ref)
    assert_same(diag(model, tf.data.Dataset.from_tensor_slices((x, np.eye(3)[y])).batch(4)), ref)
    soft = np.full((10, 3), 1 / 3)
    with pytest.raises(ValueError, match="one-hot rows"):
        normflat.analyze(model, (x, soft), progress=False)


def test_empty_batches_are_skipped():
    model = mlp()
    x, y = data()
    ref = diag(model, (x, y))
    with_empty = [(x[:4], y[:4]), (x[:0], y[:0]), (x[4:], y[4:])]
    assert_same(diag(model, with_empty), ref)
    assert normflat.analyze(model, with_empty, progress=False).metadata["batches"] == 2
    with pytest.raises(ValueError, match="empty"):
        normflat.analyze(model, [(x[:0], y[:0])], progress=False)


def test_mismatched_x_and_y():
    model = mlp()
    x, y = data()
    with pytest.raises(ValueError, match="10 inputs but 9 labels"):
        normflat.analyze(model, (x, y[:9]), progress=False)
    with pytest.raises(ValueError, match="4 inputs but 3 labels"):
        normflat.analyze(model, [(x[:4], y[:3])], progress=False)


def test_infinite_dataset_needs_max_batches():
    model = mlp()
    x, y = data()
    repeated = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    with pytest.raises(ValueError, match="infinite.*max_batches"):
        normflat.analyze(model, repeated, progress=False)
    rep = normflat.analyze(model, repeated, max_batches=5, progress=False)
    assert rep.metadata["batches"] == 5 and rep.metadata["examples"] == 18


def test_samples_with_ggn_is_refused():
    model = mlp()
    with pytest.raises(ValueError, match="no meaning for the deterministic estimator"):
        normflat.analyze(model, data(), estimator="ggn", samples=5, progress=False)


# ----------------------------------------------------------------------------- model outputs and losses


@pytest.mark.parametrize("estimator", ["ggn", "exact"])
def test_probabilities_given_as_logits(estimator):
    probs = Wrapped(mlp(), tf.nn.softmax)
    probs(data()[0][:1])
    with pytest.raises(ValueError, match="probabilities"):
        normflat.analyze(probs, data(), estimator=estimator, progress=False)


def test_constant_logits():
    model = mlp()
    model.get_layer("d3").kernel.assign(np.zeros((4, 3)))
    model.get_layer("d3").bias.assign(np.zeros(3))
    for estimator in ("ggn", "exact"):
        with pytest.raises(ValueError, match=r"nearly\) equal across classes"):
            normflat.analyze(model, data(), estimator=estimator, progress=False)
    rep = normflat.analyze(model, data(), loss="ce", progress=False)  # well defined with ce
    assert np.isfinite(rep.normalized_sharpness) and rep.hessian_trace > 0


def test_one_output_unit():
    model = mlp(out=1)
    x, _ = data()
    with pytest.raises(ValueError, match="single output unit"):
        normflat.analyze(model, (x, np.zeros(10, int)), progress=False)


def test_custom_loss_must_return_the_mean():
    model = mlp()

    def per_sample(logits, labels):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

    for estimator in ("exact", "hutchinson"):
        with pytest.raises(TypeError, match="must return the mean loss of the batch, a scalar"):
            normflat.analyze(model, data(), loss=per_sample, estimator=estimator, progress=False)


def test_nan_or_inf_loss():
    model = mlp()

    def nan_loss(logits, labels):
        return tf.reduce_mean(logits) * float("nan")

    def inf_loss(logits, labels):
        return tf.reduce_mean(logits) + float("inf")

    for loss in (nan_loss, inf_loss):
        with pytest.raises(ValueError, match="the loss is NaN or infinite"):
            normflat.analyze(model, data(), loss=loss, estimator="exact", progress=False)


def test_labels_out_of_range_also_with_a_custom_loss():
    model = mlp()
    x, y = data()

    def ce(logits, labels):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    for loss in ("nsce", ce):
        with pytest.raises(ValueError, match=r"class indices in \[0, 2\]"):
            normflat.analyze(model, (x, y + 3), loss=loss, estimator="exact", progress=False)


def test_float32_logits_near_1e20():
    """Logits scaled to ~1e20 in float32: nsce does not see the scale, nothing overflows."""
    x, y = data(n=12)
    ref_model = mlp(seed=4)
    model = mlp(seed=4, dtype="float32")
    model.set_weights([w.astype(np.float32) for w in ref_model.get_weights()])
    head = model.get_layer("d3")
    scale = np.float32(1e20) / np.float32(np.abs(model(x.astype(np.float32)).numpy()).max())
    head.kernel.assign(head.kernel.numpy() * scale)
    head.bias.assign(head.bias.numpy() * scale)
    assert np.abs(model(x.astype(np.float32)).numpy()).max() > 1e19
    ref = normflat.analyze(ref_model, (x, y), progress=False)
    got = normflat.analyze(model, (x.astype(np.float32), y), progress=False)
    assert np.isfinite(got.normalized_sharpness)
    # The layers before the head see the same normalized logits: same curvature, same NS.
    for lg, lr in zip(got.layers[:2], ref.layers[:2]):
        assert lg.normalized_sharpness == pytest.approx(lr.normalized_sharpness, rel=1e-3)


def test_final_softmax_is_stripped_and_reported():
    model = mlp(activation="softmax")
    logits = mlp()
    rep = normflat.analyze(model, data(), progress=False)
    assert rep.metadata["backend"]["stripped_softmax"] == "d3"
    assert rep.normalized_sharpness == pytest.approx(
        normflat.analyze(logits, data(), progress=False).normalized_sharpness, rel=1e-12)
    assert model.get_layer("d3").activation is keras.activations.softmax


# ----------------------------------------------------------------------------- randomness


@pytest.mark.parametrize("estimator,samples", [("ggn-mc", 3), ("hutchinson", 7)])
def test_stochastic_estimators_do_not_depend_on_the_split(estimator, samples):
    model = mlp()
    x, y = data(n=11)
    kw = {"estimator": estimator, "samples": samples, "seed": 3}
    ref = diag(model, (x, y), **kw)
    for split in (batches(x, y, 3), tf.data.Dataset.from_tensor_slices((x, y)).batch(4)):
        assert_same(diag(model, split, **kw), ref, rtol=1e-10)
    assert_same(diag(model, (x, y), chunk_size=2, **kw), ref, rtol=1e-10)
    other = diag(model, (x, y), **{**kw, "seed": 4})
    assert not np.array_equal(other["d1"], ref["d1"])


def test_hutchinson_uses_the_engines_canonical_probes():
    """Reference: the engine's probes against the full Hessian, in the canonical layout."""
    model = mlp()
    x, y = data(n=8)
    samples = 5
    got = diag(model, (x, y), loss="ce", estimator="hutchinson", samples=samples, seed=2)
    kernels = [model.get_layer(n).kernel.value for n in ("d1", "d2", "d3")]
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
        flat = tf.concat([tf.reshape(tf.transpose(g), [-1]) for g in inner.gradient(loss, kernels)], 0)
    hess = np.concatenate([tf.reshape(tf.transpose(j, [0, 2, 1]), [flat.shape[0], -1]).numpy()
                           for j in outer.jacobian(flat, kernels)], 1)  # canonical (out, in) order
    shapes = [tuple(k.shape[::-1]) for k in kernels]
    probes = np.concatenate([rademacher(2, i, range(samples), s).reshape(samples, -1)
                             for i, s in enumerate(shapes)], 1).astype(np.float64)
    est = (probes * (probes @ hess.T)).mean(0)  # groups of equal size: the mean of the group means
    start = 0
    for (name, value), shape in zip(got.items(), shapes):
        size = int(np.prod(shape))
        np.testing.assert_allclose(value, est[start:start + size].reshape(shape), rtol=1e-9, atol=1e-14)
        start += size


@pytest.mark.parametrize("estimator", ["ggn-mc", "hutchinson"])
def test_stochastic_estimators_match_torch(estimator):
    import importlib.util

    from tests import netspec
    from tests.builders import load_builder

    torch_builder = load_builder("torch")
    if importlib.util.find_spec("normflat.backends.torch.session") is None:
        pytest.skip("the torch backend is not on the engine yet")
    keras_builder = load_builder("keras")
    spec = netspec.cnn(seed=21, groups=2, channels=(2, 4, 6))
    x, y = netspec.data(spec, n=7, seed=5)
    kw = {"estimator": estimator, "samples": 4, "seed": 9, "progress": False}
    ref = normflat.analyze(torch_builder.build(spec), torch_builder.make_data(x, y, 3), **kw)
    got = normflat.analyze(keras_builder.build(spec), keras_builder.make_data(x, y, 4), **kw)
    assert got.normalized_sharpness == pytest.approx(ref.normalized_sharpness, rel=1e-8)
    for lg, lr in zip(got.layers, ref.layers):
        assert lg.hessian_trace == pytest.approx(lr.hessian_trace, rel=1e-8)


# ----------------------------------------------------------------------------- grouped convolutions


def test_grouped_depthwise_and_separable_report_groups():
    keras.utils.set_random_seed(5)
    inp = keras.Input((5, 5, 4), dtype=F64)
    h = L.Conv2D(6, 3, groups=2, padding="same", activation="tanh", dtype=F64, name="grouped")(inp)
    h = L.DepthwiseConv2D(3, depth_multiplier=2, padding="same", activation="tanh", dtype=F64, name="dw")(h)
    h = L.SeparableConv2D(4, 3, activation="tanh", dtype=F64, name="sep")(h)
    out = L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h))
    model = keras.Model(inp, out)
    x = np.random.default_rng(0).normal(size=(6, 5, 5, 4))
    y = np.arange(6) % 3
    for estimator in ("ggn", "exact"):
        rep = normflat.analyze(model, (x, y), estimator=estimator, progress=False, force=True)
        layers = {layer.name: layer for layer in rep.layers}
        expected = {"grouped": (2, (6, 2, 3, 3)), "dw": (6, (12, 1, 3, 3)), "sep/depthwise": (12, (12, 1, 3, 3)),
                    "sep/pointwise": (1, (4, 12, 1, 1)), "head": (1, (3, 36))}
        for name, (groups, shape) in expected.items():
            assert layers[name].details["groups"] == groups, name
            assert layers[name].shape == shape, name
            assert layers[name].col_sigma.shape == (shape[1] * groups,), name


# ----------------------------------------------------------------------------- side effects


def _instance_state(model):
    return {id(layer): {k: layer.__dict__.get(k) for k in ("call", "activation")}
            for layer in model._flatten_layers()}


def test_model_restored_after_keyboard_interrupt_and_errors():
    model = mlp(activation="softmax")
    keras.utils.set_random_seed(1)
    ln = keras.Sequential([keras.Input((5,), dtype=F64), L.Dense(4, dtype=F64), L.LayerNormalization(dtype=F64),
                           L.Dense(3, dtype=F64)])
    x, y = data()
    for m in (model, ln):
        before = _instance_state(m)
        weights = [w.copy() for w in m.get_weights()]

        def interrupted():
            yield x[:5], y[:5]
            raise KeyboardInterrupt

        for estimator in ("ggn", "exact", "hutchinson"):
            with pytest.raises(KeyboardInterrupt):
                normflat.analyze(m, interrupted(), estimator=estimator, progress=False)
            assert _instance_state(m) == before
            with pytest.raises(ValueError, match="class indices"):
                normflat.analyze(m, [(x[:5], y[:5]), (x[5:], y[5:] + 7)], estimator=estimator, progress=False)
            assert _instance_state(m) == before
        for a, b in zip(weights, m.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_two_analyses_in_two_threads():
    from keras.src.backend.tensorflow import nn as tf_nn

    moments = tf_nn._compute_moments
    keras.utils.set_random_seed(2)
    ln = keras.Sequential([keras.Input((5,), dtype=F64), L.Dense(6, activation="tanh", dtype=F64),
                           L.LayerNormalization(dtype=F64), L.Dense(3, dtype=F64)])
    models = [mlp(activation="softmax"), ln, mlp(seed=3)]
    x, y = data(n=12)
    jobs = [(models[0], "ggn", {}), (models[1], "exact", {}), (models[2], "hutchinson", {"samples": 6}),
            (models[1], "ggn-mc", {"samples": 2}), (models[0], "exact", {})]

    def run(job):
        model, estimator, kw = job
        return normflat.analyze(model, batches(x, y, 5), estimator=estimator, progress=False, **kw)

    sequential = [run(job) for job in jobs]
    before = [_instance_state(m) for m in models]
    py_state = random.getstate()
    tf_state = tf.random.get_global_generator().state.numpy().copy()
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    draws: list[float] = []
    stop = threading.Event()

    def worker(i):
        try:
            results[i] = run(jobs[i])
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            errors.append(err)

    def drawer():  # a third thread drawing from the global numpy stream meanwhile
        rng_draws = []
        while not stop.is_set():
            rng_draws.append(np.random.random())
        draws.extend(rng_draws)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    third = threading.Thread(target=drawer)
    third.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    stop.set()
    third.join()
    assert not errors, errors
    for i, rep in enumerate(sequential):
        assert results[i].normalized_sharpness == pytest.approx(rep.normalized_sharpness, rel=1e-12)
        assert results[i].hessian_trace == pytest.approx(rep.hessian_trace, rel=1e-12)
    # The drawing thread's stream was never rewound: no value repeats.
    assert len(draws) > 0 and len(set(draws)) == len(draws)
    assert tf.random.get_global_generator().state.numpy().tolist() == tf_state.tolist()
    assert random.getstate() == py_state
    assert tf_nn._compute_moments is moments  # no module function swapped
    assert [_instance_state(m) for m in models] == before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("still recorded", UserWarning)
    assert [str(w.message) for w in caught] == ["still recorded"]


@pytest.mark.parametrize("estimator", ["exact", "ggn", "hutchinson"])
def test_compiled_steps_trace_once_for_every_layer_and_batch_size(estimator):
    """Uneven batches (4 + 4 + 2) and three layers: each compiled step is traced once (its batch
    axis open, exact's probes over every layer at once), and the numbers equal one whole batch."""
    from normflat.backends.keras import session as keras_session

    model = mlp()
    x, y = data(n=10)
    options = dict(loss="ce", estimator=estimator, progress=False, **({"samples": 4} if estimator == "hutchinson" else {}))
    whole = normflat.hessian_diagonal(model, (x, y), **options)
    keras_session._COMPILED.pop(model, None)
    split = normflat.hessian_diagonal(model, batches(x, y, 4), **options)

    def compiled(value):  # the tf.functions among the cached (nested tuples of) steps
        if isinstance(value, (tuple, list)):
            return [f for v in value for f in compiled(v)]
        return [value] if hasattr(value, "experimental_get_tracing_count") else []

    steps = compiled(list(keras_session._COMPILED[model].values()))
    used = [f for f in steps if f.experimental_get_tracing_count() > 0]
    assert used and all(f.experimental_get_tracing_count() == 1 for f in used), \
        [f.experimental_get_tracing_count() for f in used]
    for name in whole:
        np.testing.assert_allclose(np.asarray(split[name]), np.asarray(whole[name]), rtol=1e-10, atol=1e-14)


def test_compiled_steps_are_traced_without_autograph(monkeypatch):
    """normflat's steps (GGN, exact, Hutchinson, the rival measures' perturbations) are traced
    with ``autograph=False``, as Keras 3 traces its training step: AutoGraph converting
    normflat's own code took most of a first analysis (Keras guide, "Performance"). A spy on
    AutoGraph's entry point sees no call while a fresh model is analyzed, also with the GGN
    step's signals in a ``tf.map_fn``."""
    from tensorflow.python.autograph.impl import api as autograph_api

    calls = []
    original = autograph_api.converted_call

    def spy(f, *args, **kwargs):
        calls.append(getattr(f, "__qualname__", repr(f)))
        return original(f, *args, **kwargs)

    monkeypatch.setattr(autograph_api, "converted_call", spy)
    x, y = data(6, seed=3)
    model = mlp(seed=3)
    for estimator in ("ggn", "ggn-mc", "exact", "hutchinson"):
        normflat.analyze(model, (x, y), loss="ce", estimator=estimator, samples=2 if estimator == "hutchinson" else None,
                         progress=False)
    normflat.measures(model, (x, y), ["adaptive_sharpness"], loss="ce", progress=False)
    # The GGN step's loop over its signals (large graphs, ggn.UNROLL_OPS) is not converted either.
    from normflat.backends.keras import ggn

    monkeypatch.setattr(ggn, "UNROLL_OPS", 0)
    normflat.analyze(mlp(seed=4), (x, y), loss="ce", progress=False)
    assert calls == []
    # The spy does see AutoGraph when it runs (a test that can fail).
    tf.function(lambda t: t + 1)(tf.constant(1.0))
    assert calls
