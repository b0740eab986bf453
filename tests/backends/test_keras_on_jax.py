"""Keras 3 models on Keras' JAX backend (``KERAS_BACKEND=jax``), analyzed by normflat's JAX backend.

The backend of Keras is fixed per process when keras is imported, so the JAX side runs in a fresh
interpreter (``tests/backends/_keras_jax_side.py``). The same architecture with the same weights is
analyzed here on the TensorFlow backend (normflat's Keras backend, a different code path end to end)
and there on the JAX one (the model called inside ``keras.StatelessScope``, traced into normflat's
JAX program analysis): the same layer names, everything covered, the same numbers for ``ggn`` and
``exact``. The models: a functional one with Embedding, MultiHeadAttention, normalization, a frozen
Conv1D and Dense layers; an LSTM and a GRU (each cell kernel split per gate), with the Keras
training callback run during a ``fit`` on the JAX backend; every convolution kind (plain, grouped,
depthwise, separable, transposed); and models called as the TensorFlow backend calls them (a final
softmax stripped, a mixed precision layer computed in its variables' dtype, a subclassed model whose
``call`` takes no ``training``, an untied ``ReversibleEmbedding``; a half-precision model refused
with the Keras advice). keras-hub models are in ``tests/backends/test_keras_hub_on_jax.py``. The
rescaling tests of every Keras layer kind run on the JAX backend in
``tests/backends/test_keras_rescalings_on_jax.py``. Keras' JAX backend computes some of its operations
(``tanh``, normalization, pooling) in float32 also for float64 inputs (its type promotion maps float64
to float32), so the models here are float32 and the tolerance is float32's. The JAX side also checks that the model's variables are left as they
were, that ``normflat.measures`` runs, that LoRA-enabled layers (Dense, Embedding, an attention
projection) give the TensorFlow backend's factors and numbers, and that a LoRA-enabled grouped
convolution is reported unsupported with the reason. One layer is frozen (``trainable=False``): its
kernel is analyzed in both, BatchNormalization's moving statistics and a PReLU's slopes are excluded in
both, with the same reasons, and a ``SpectralNormalization``-wrapped layer is its layer in both (its
kernel analyzed, the wrapper's ``vector_u`` excluded).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends._keras_jax_side import run_on_jax
from tests.builders import require_frameworks

require_frameworks("keras", "tensorflow", "jax")

import keras  # noqa: E402

import normflat  # noqa: E402

#: The model, built the same way under either backend (``keras`` and ``np`` in scope).
BUILD = """
keras.utils.set_random_seed(0)
ids = keras.Input((5,), dtype="int32", name="ids")
h = keras.layers.Embedding(11, 8, name="emb")(ids)
h = h + keras.layers.MultiHeadAttention(2, 4, name="mha")(h, h)
h = keras.layers.LayerNormalization(name="norm")(h)
h = keras.layers.Conv1D(6, 3, padding="same", activation="tanh", name="conv")(h)
h = keras.layers.PReLU(name="prelu")(h)  # slopes (5, 6), one per input entry: held fixed with the norms' reason
h = keras.layers.BatchNormalization(name="bn")(h)
# a spectrally normalized layer: its layer at inference (the kernel analyzed, vector_u excluded), as on TensorFlow
h = keras.layers.SpectralNormalization(keras.layers.Dense(6, activation="tanh", name="inner"), name="sn")(h)
h = keras.layers.Dense(7, activation="tanh", name="dense")(h)
model = keras.Model(ids, keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(h)))
rng = np.random.default_rng(5)
model.set_weights([(np.abs(rng.normal(size=w.shape)) + 0.5 if "variance" in v.path else rng.normal(size=w.shape) * 0.5)
                   .astype("float32") for w, v in zip(model.get_weights(), model.weights)])
x = rng.integers(0, 11, (8, 5)).astype("int32")
y = rng.integers(0, 3, 8)
model.get_layer("conv").trainable = False  # a frozen layer is analyzed too (non-trainable variables)
"""

#: Recurrent layers (an LSTM and a GRU, each cell's kernels split per gate), ``rnn_*`` names.
BUILD_RNN = """
keras.utils.set_random_seed(1)
rnn_ids = keras.Input((6,), dtype="int32")
rnn_h = keras.layers.LSTM(4, return_sequences=True, name="lstm")(keras.layers.Embedding(9, 5, name="emb")(rnn_ids))
rnn_model = keras.Model(rnn_ids, keras.layers.Dense(3, name="head")(keras.layers.GRU(3, name="gru")(rnn_h)))
rnn_rng = np.random.default_rng(1)
rnn_model.set_weights([rnn_rng.normal(size=w.shape).astype("float32") * 0.5 for w in rnn_model.get_weights()])
rnn_x, rnn_y = rnn_rng.integers(0, 9, (6, 6)).astype("int32"), rnn_rng.integers(0, 3, 6)
"""

#: Every convolution kind (plain, grouped, depthwise, separable, transposed; 1-D and 2-D), ``conv_*`` names.
BUILD_CONV = """
keras.utils.set_random_seed(2)
conv_in = keras.Input((8, 8, 3))
conv_h = keras.layers.Conv2D(4, 3, padding="same", activation="tanh", name="c")(conv_in)
conv_h = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same", activation="tanh", name="dw")(conv_h)
conv_h = keras.layers.SeparableConv2D(6, 3, depth_multiplier=2, padding="same", activation="tanh", name="sep")(conv_h)
conv_h = keras.layers.Conv2D(4, 3, groups=2, activation="tanh", name="g")(conv_h)
conv_h = keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same", activation="tanh", name="tr")(conv_h)
conv_h = keras.layers.Reshape((12 * 12, 3))(conv_h)
conv_h = keras.layers.DepthwiseConv1D(3, depth_multiplier=2, strides=2, activation="tanh", name="dw1")(conv_h)
conv_h = keras.layers.SeparableConv1D(4, 3, activation="tanh", name="sep1")(conv_h)
conv_h = keras.layers.Conv1DTranspose(3, 3, strides=2, activation="tanh", name="tr1")(conv_h)
conv_model = keras.Model(conv_in, keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(conv_h)))
conv_rng = np.random.default_rng(2)
conv_model.set_weights([conv_rng.normal(size=w.shape).astype("float32") * 0.5 for w in conv_model.get_weights()])
conv_x, conv_y = conv_rng.normal(size=(4, 8, 8, 3)).astype("float32"), np.array([0, 1, 2, 0])
"""

#: How the model is called, as on the TensorFlow backend: a functional model's final softmax stripped
#: (the built-in losses take logits), a mixed precision layer computed in its variables' dtype, and a
#: subclassed model whose ``call`` takes no ``training`` argument; ``calls_*`` names.
BUILD_CALLS = """
keras.utils.set_random_seed(4)
calls_in = keras.Input((6,))
calls_h = keras.layers.Dense(5, activation="tanh", name="hidden")(calls_in)
calls_h = keras.layers.Dense(4, activation="tanh", name="half", dtype="mixed_bfloat16")(calls_h)
calls_soft = keras.Model(calls_in, keras.layers.Dense(3, activation="softmax", name="probs")(calls_h))


class NoTrainingArgument(keras.Model):
    def __init__(self):
        super().__init__(name="plain_call")
        self.hidden = keras.layers.Dense(5, activation="tanh", name="hidden")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.hidden(x))


calls_ids = keras.Input((4,), dtype="int32")
calls_table = keras.layers.ReversibleEmbedding(9, 4, tie_weights=False, name="emb")
calls_mixed = keras.layers.Dense(4, activation="tanh", name="mix")(calls_table(calls_ids))
calls_untied = keras.Model(calls_ids, calls_table(calls_mixed, reverse=True))  # token logits, an untied head
calls_plain = NoTrainingArgument()
calls_plain(np.zeros((1, 6), "float32"))
calls_rng = np.random.default_rng(4)
for calls_model in (calls_soft, calls_plain, calls_untied):
    calls_model.set_weights([calls_rng.normal(size=w.shape).astype("float32") for w in calls_model.get_weights()])
calls_x, calls_y = calls_rng.normal(size=(5, 6)).astype("float32"), np.array([0, 1, 2, 0, 1])
calls_tokens = (calls_rng.integers(0, 9, (3, 4)).astype("int32"), calls_rng.integers(0, 9, (3, 4)))
"""

#: LoRA enabled on a Dense, an Embedding and an attention projection (an EinsumDense) of ``model``,
#: with factors drawn away from their zero initialization.
LORA = """
for lora_layer in (model.get_layer("dense"), model.get_layer("emb"), model.get_layer("mha").query_dense):
    lora_layer.enable_lora(2)
lora_rng = np.random.default_rng(8)
for lora_v in sorted((v for v in model.weights if "lora" in v.path), key=lambda v: v.path):
    lora_v.assign(lora_rng.normal(size=lora_v.shape).astype("float32") * 0.5)
"""

MODELS = BUILD + BUILD_RNN + BUILD_CONV + BUILD_CALLS

JAX_SIDE = MODELS + "LORA = " + repr(LORA) + """
import normflat
before = [np.array(v.value) for v in model.weights]
out = {"backend": keras.backend.backend()}
for estimator in ("ggn", "exact"):
    report = normflat.analyze(model, (x, y), loss="ce", estimator=estimator, progress=False)
    out[estimator] = [[l.name, l.normalized_sharpness, l.hessian_trace] for l in report.layers]
    out[estimator + "_meta"] = [report.metadata["framework"], report.metadata["coverage"],
                                report.metadata["unsupported"], report.metadata["excluded"]]
measures = normflat.measures(model, (x, y), ["fisher_rao_norm", "adaptive_sharpness"], loss="ce", progress=False)
out["measures"] = [measures["fisher_rao_norm"], measures["adaptive_sharpness"]]
out["unchanged"] = all(np.array_equal(a, np.array(v.value)) for a, v in zip(before, model.weights))
rnn = normflat.analyze(rnn_model, (rnn_x, rnn_y), loss="ce", progress=False)
out["rnn"] = [rnn.metadata["coverage"], [[l.name, l.normalized_sharpness] for l in rnn.layers]]
for estimator in ("ggn", "exact"):
    conv = normflat.analyze(conv_model, (conv_x, conv_y), loss="ce", estimator=estimator, progress=False)
    out["conv_" + estimator] = [conv.metadata["coverage"], conv.metadata["unsupported"],
                                [[l.name, l.kind, list(l.shape), l.details["groups"], l.details["path"],
                                  l.normalized_sharpness, l.hessian_trace] for l in conv.layers]]
conv_measures = normflat.measures(conv_model, (conv_x, conv_y), ["fisher_rao_norm", "adaptive_sharpness"], loss="ce",
                                  progress=False)
out["conv_measures"] = [conv_measures["fisher_rao_norm"], conv_measures["adaptive_sharpness"]]
for key, calls_model, calls_data in (("calls_soft", calls_soft, (calls_x, calls_y)),
                                     ("calls_plain", calls_plain, (calls_x, calls_y)),
                                     ("calls_untied", calls_untied, calls_tokens)):
    calls = normflat.analyze(calls_model, calls_data, loss="ce", progress=False)
    out[key] = [calls.metadata["backend"].get("stripped_softmax"), calls.metadata["dtype"],
                [[l.name, l.normalized_sharpness, l.hessian_trace] for l in calls.layers]]
out["calls_policy"] = calls_soft.get_layer("half").dtype_policy.name  # restored after the analysis
half_in = keras.Input((6,))
half_model = keras.Model(half_in, keras.layers.Dense(3, dtype="float16", name="head")(half_in))
try:
    normflat.analyze(half_model, (calls_x, calls_y), loss="ce", progress=False)
except ValueError as err:
    out["half_error"] = str(err)
# LoRA (Dense, Embedding, an attention projection) with the same factors as on TensorFlow; a grouped
# convolution's LoRA refused with the reason.
exec(LORA)
lora = normflat.analyze(model, (x, y), loss="ce", progress=False)
out["lora"] = [lora.metadata["coverage"], [[l.name, l.kind, l.normalized_sharpness] for l in lora.layers]]
lora_in = keras.Input((6, 4))
lora_conv = keras.layers.Conv1D(4, 3, groups=2, name="gconv")
lora_model = keras.Model(lora_in, keras.layers.Dense(3)(keras.layers.Flatten()(lora_conv(lora_in))))
lora_conv.enable_lora(2)
import warnings
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    lora_refused = normflat.analyze(lora_model, (np.ones((2, 6, 4), "float32"), np.array([0, 1])), loss="ce",
                                    progress=False)
out["lora_unsupported"] = lora_refused.metadata["unsupported"]
# The Keras training callback, during a fit on this backend.
from normflat.integrations.keras import SharpnessCallback
rnn_model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
callback = SharpnessCallback((rnn_x, rnn_y), every_n_epochs=1, progress=False)
rnn_model.fit(rnn_x, rnn_y, epochs=1, verbose=0, callbacks=[callback])
out["callback"] = [entry.totals["normalized_sharpness"] for entry in callback.history]
"""


def test_keras_model_on_the_jax_backend_equals_the_tensorflow_backend():
    assert keras.backend.backend() == "tensorflow"
    scope: dict = {"keras": keras, "np": np}
    exec(MODELS, scope)  # noqa: S102 - the shared model definitions above
    model, x, y = scope["model"], scope["x"], scope["y"]
    got = run_on_jax(JAX_SIDE)
    assert got["backend"] == "jax"
    for estimator in ("ggn", "exact"):
        want = normflat.analyze(model, (x, y), loss="ce", estimator=estimator, progress=False)
        framework, coverage, unsupported, excluded = got[estimator + "_meta"]
        assert framework == "jax" and coverage == 1.0 and unsupported == []
        assert excluded == want.metadata["excluded"]  # the same names, with the same reasons
        assert [name for name, _, _ in got[estimator]] == [layer.name for layer in want.layers]
        assert [layer.name for layer in want.layers] == [
            "emb", "mha/query", "mha/key", "mha/value", "mha/attention_output", "conv", "sn/inner", "dense", "head"]
        for (name, sharpness, trace), layer in zip(got[estimator], want.layers):
            assert sharpness == pytest.approx(layer.normalized_sharpness, rel=2e-4), (estimator, name)
            assert trace == pytest.approx(layer.hessian_trace, rel=2e-4, abs=1e-6), (estimator, name)
    measures = normflat.measures(model, (x, y), ["fisher_rao_norm", "adaptive_sharpness"], loss="ce", progress=False)
    assert got["measures"] == pytest.approx([measures["fisher_rao_norm"], measures["adaptive_sharpness"]], rel=1e-3)
    assert got["unchanged"]
    # Recurrent layers: each gate of each cell kernel, in the same order; and the training callback ran.
    rnn = normflat.analyze(scope["rnn_model"], (scope["rnn_x"], scope["rnn_y"]), loss="ce", progress=False)
    coverage, layers = got["rnn"]
    assert coverage == 1.0 and [name for name, _ in layers] == [layer.name for layer in rnn.layers]
    assert "lstm/lstm_cell/recurrent_kernel.f" in dict(layers) and "gru/gru_cell/kernel.h" in dict(layers)
    for (name, sharpness), layer in zip(layers, rnn.layers):
        assert sharpness == pytest.approx(layer.normalized_sharpness, rel=2e-4), name
    assert len(got["callback"]) == 1 and np.isfinite(got["callback"][0])
    # Every convolution kind: the TensorFlow backend's names, kinds, canonical shapes and groups, each on
    # its fast rule for ggn (a depthwise kernel reshaped, a transposed one flipped inside lax.conv_transpose), the
    # same numbers.
    for estimator in ("ggn", "exact"):
        want = normflat.analyze(scope["conv_model"], (scope["conv_x"], scope["conv_y"]), loss="ce",
                                estimator=estimator, progress=False)
        coverage, unsupported, layers = got["conv_" + estimator]
        assert coverage == 1.0 and unsupported == []
        assert [row[0] for row in layers] == [layer.name for layer in want.layers] == [
            "c", "dw", "sep/depthwise", "sep/pointwise", "g", "tr", "dw1", "sep1/depthwise", "sep1/pointwise",
            "tr1", "head"]
        for (name, kind, shape, groups, path, sharpness, trace), layer in zip(layers, want.layers):
            assert (kind, tuple(shape), groups) == (layer.kind, tuple(layer.shape), layer.details["groups"]), name
            assert path == ("fast" if estimator == "ggn" else "hvp"), name
            assert sharpness == pytest.approx(layer.normalized_sharpness, rel=2e-4, abs=1e-6), (estimator, name)
            assert trace == pytest.approx(layer.hessian_trace, rel=2e-4, abs=1e-6), (estimator, name)
    # Called as the TensorFlow backend calls the model: the final softmax stripped and reported, the
    # bfloat16 layer computed in float32, a `call` without `training` called without it.
    data = {"calls_soft": (scope["calls_x"], scope["calls_y"]), "calls_plain": (scope["calls_x"], scope["calls_y"]),
            "calls_untied": scope["calls_tokens"]}
    for key in ("calls_soft", "calls_plain", "calls_untied"):
        want = normflat.analyze(scope[key], data[key], loss="ce", progress=False)
        stripped, dtype, layers = got[key]
        assert stripped == want.metadata["backend"].get("stripped_softmax") == (
            "probs" if key == "calls_soft" else None)
        assert dtype == want.metadata["dtype"] == "float32"
        # (in the order of first use in the forward on JAX: the untied head after the mixing layer)
        assert sorted(row[0] for row in layers) == sorted(layer.name for layer in want.layers)
        for name, sharpness, trace in layers:
            layer = want.layer(name)
            assert sharpness == pytest.approx(layer.normalized_sharpness, rel=2e-5), (key, name)
            assert trace == pytest.approx(layer.hessian_trace, rel=2e-5), (key, name)
    assert got["calls_policy"] == "mixed_bfloat16"
    # Half-precision variables: refused, with the Keras advice (float32 copy, a mixed policy, TensorFlow).
    assert "layers whose variables are float16" in got["half_error"] and "set_weights" in got["half_error"]
    assert [row[0] for row in got["calls_untied"][2]] == ["emb", "mix", "emb/reverse"]  # the untied head too
    # LoRA: the frozen kernels and both factors of each layer, as the TensorFlow backend reads them.
    exec(LORA, scope)  # noqa: S102
    want = normflat.analyze(model, (x, y), loss="ce", progress=False)
    coverage, layers = got["lora"]
    assert coverage == 1.0
    assert sorted(row[0] for row in layers) == sorted(layer.name for layer in want.layers)
    assert {"emb/lora_a", "mha/query/lora_b", "dense/lora_a"} <= {row[0] for row in layers}
    for name, kind, sharpness in layers:
        assert kind == want.layer(name).kind, name
        assert sharpness == pytest.approx(want.layer(name).normalized_sharpness, rel=2e-4), name
    assert any(m.startswith("gconv/") and "grouped convolution" in m for m in got["lora_unsupported"]), got[
        "lora_unsupported"]
    # The perturbation measures draw their noise in the canonical layouts and apply it in the native ones.
    measures = normflat.measures(scope["conv_model"], (scope["conv_x"], scope["conv_y"]),
                                 ["fisher_rao_norm", "adaptive_sharpness"], loss="ce", progress=False)
    assert got["conv_measures"] == pytest.approx([measures["fisher_rao_norm"], measures["adaptive_sharpness"]],
                                                 rel=1e-3)
