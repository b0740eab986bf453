"""Keras 3 models on Keras' JAX backend (``KERAS_BACKEND=jax``), analyzed by normflat's JAX backend.

The backend of Keras is fixed per process when keras is imported, so the JAX side runs in a fresh
interpreter. The same architecture with the same weights is analyzed here on the TensorFlow backend
(normflat's Keras backend, a different code path end to end) and there on the JAX one
(``model.stateless_call`` traced into normflat's JAX program analysis): the same layer names in the
same order, everything covered, the same numbers for ``ggn`` and ``exact``; and a keras-hub BERT
classifier (a nested backbone named as the TensorFlow backend names it, a position table, a mapping
of named inputs); an LSTM and a GRU (each cell kernel split per gate), with the Keras training
callback run during a ``fit`` on the JAX backend; and every convolution kind (plain, grouped,
depthwise, separable, transposed); and models called as the TensorFlow backend calls them (a
final softmax stripped, a mixed precision layer computed in its variables' dtype, a subclassed
model whose ``call`` takes no ``training``, an untied ``ReversibleEmbedding``); and keras-hub's experts layers (one matrix per expert
and map), DeBERTa-v3's relative position table, and the matrices keras-hub layers multiply by in
their own call (Qwen3.5's causal convolution, RWKV-7's low-rank maps). The rescaling tests of the convolution kinds
(``tests/arch/test_keras_rescalings.py``) also run on the JAX backend, in float64. Keras' JAX backend
computes some of its operations (``tanh``, normalization, pooling) at float32's accuracy also for
float64 inputs, so the models are float32 and the tolerance is float32's. The JAX side also checks
that the model's variables are left as they were, that ``normflat.measures`` runs, and that a
LoRA-enabled layer is reported unsupported with the reason. One layer is frozen (``trainable=False``):
its kernel is analyzed in both, BatchNormalization's moving statistics are excluded in both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

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
h = keras.layers.BatchNormalization(name="bn")(h)
h = keras.layers.Dense(7, activation="tanh", name="dense")(h)
model = keras.Model(ids, keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(h)))
rng = np.random.default_rng(5)
model.set_weights([(np.abs(rng.normal(size=w.shape)) + 0.5 if "variance" in v.path else rng.normal(size=w.shape) * 0.5)
                   .astype("float32") for w, v in zip(model.get_weights(), model.weights)])
x = rng.integers(0, 11, (8, 5)).astype("int32")
y = rng.integers(0, 3, 8)
model.get_layer("conv").trainable = False  # a frozen layer is analyzed too (non-trainable variables)
"""

#: A keras-hub BERT classifier (a nested backbone, named inputs, a position table), ``hub_*`` names.
BUILD_HUB = """
import keras_hub
keras.utils.set_random_seed(3)
hub_backbone = keras_hub.models.BertBackbone(vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=8,
                                             name="bert_backbone")  # not bert_backbone_1 after another one
hub_model = keras_hub.models.BertTextClassifier(hub_backbone, num_classes=2, preprocessor=None)
hub_rng = np.random.default_rng(3)
hub_model.set_weights([hub_rng.normal(size=w.shape).astype("float32") * 0.5 for w in hub_model.get_weights()])
hub_batch = {"token_ids": hub_rng.integers(0, 30, (4, 6)).astype("int32"), "segment_ids": np.zeros((4, 6), "int32"),
             "padding_mask": np.array([[1] * 6, [1] * 4 + [0] * 2] * 2, "int32"), "labels": np.array([0, 1, 1, 0])}
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

#: keras-hub mixture-of-experts layers (separate, packed and alternating gate/up kernels, one matrix per
#: expert and map) in a routed classifier, and a DeBERTa-v3 classifier (its relative position table);
#: ``moe_*`` names.
BUILD_MOE = """
import keras_hub
from keras import ops
from keras_hub.src.models.gpt_oss.gpt_oss_decoder import GptOssExperts
from keras_hub.src.models.mixtral.mixtral_decoder import MixtralMoeExperts
from keras_hub.src.models.qwen_moe.qwen_moe_decoder import QwenMoeExperts


class Routed(keras.Model):
    def __init__(self, experts):
        super().__init__(name="routed")
        self.embed = keras.layers.Dense(6, name="embed")
        self.router = keras.layers.Dense(3, use_bias=False, name="router")
        self.experts = experts
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        h = ops.reshape(self.embed(x), (-1, 6))
        weights = ops.transpose(ops.softmax(self.router(h), axis=-1))
        mixed = ops.sum(self.experts(h) * weights[:, :, None], axis=0)
        return self.head(ops.mean(ops.reshape(mixed, (-1, 3, 6)), axis=1))


moe_rng = np.random.default_rng(6)
moe_x, moe_y = moe_rng.normal(size=(4, 3, 5)).astype("float32"), moe_rng.integers(0, 3, 4)
moe_models = {}
for moe_kind, moe_cls in (("mixtral", MixtralMoeExperts), ("qwen_moe", QwenMoeExperts), ("gpt_oss", GptOssExperts)):
    moe_models[moe_kind] = Routed(moe_cls(num_experts=3, hidden_dim=6, intermediate_dim=4, name="experts"))
    moe_models[moe_kind](moe_x)
    moe_models[moe_kind].set_weights([moe_rng.normal(size=w.shape).astype("float32") * 0.5
                                      for w in moe_models[moe_kind].get_weights()])
keras.utils.set_random_seed(7)
moe_deberta = keras_hub.models.DebertaV3TextClassifier(
    keras_hub.models.DebertaV3Backbone(vocabulary_size=20, num_layers=1, num_heads=2, hidden_dim=8,
                                       intermediate_dim=16, max_sequence_length=8, bucket_size=4,
                                       name="deberta_v3_backbone"), num_classes=3, preprocessor=None)
moe_deberta.set_weights([moe_rng.normal(size=w.shape).astype("float32") * 0.5 for w in moe_deberta.get_weights()])
moe_ids = moe_rng.integers(1, 20, (3, 6)).astype("int32")
moe_batch = ({"token_ids": moe_ids, "padding_mask": np.ones_like(moe_ids, bool)}, moe_rng.integers(0, 3, 3))
# keras-hub layers multiplying by matrices of their own: Qwen3.5's causal convolution, RWKV-7's maps.
from keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net import Qwen3_5GatedDeltaNet
moe_in = keras.Input((4, 6))
moe_h = Qwen3_5GatedDeltaNet(hidden_size=6, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=2,
                             linear_value_head_dim=2, linear_conv_kernel_dim=3, name="delta")(moe_in)
moe_delta = keras.Model(moe_in, keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(moe_h)))
moe_rwkv = keras_hub.models.RWKV7CausalLM(keras_hub.models.RWKV7Backbone(
    hidden_size=8, head_size=4, num_layers=2, vocabulary_size=11, intermediate_dim=16, gate_lora=3, mv_lora=2,
    aaa_lora=2, decay_lora=3), preprocessor=None)
for moe_model in (moe_delta, moe_rwkv):
    moe_model.set_weights([moe_rng.normal(size=w.shape).astype("float32") * 0.5 for w in moe_model.get_weights()])
moe_tokens = moe_rng.integers(1, 11, (3, 5)).astype("int32")
moe_own = {"delta": (moe_delta, (moe_rng.normal(size=(3, 4, 6)).astype("float32"), moe_rng.integers(0, 3, 3))),
           "rwkv": (moe_rwkv, ({"token_ids": moe_tokens, "padding_mask": np.ones((3, 5), "int32")},
                               np.concatenate([moe_tokens[:, 1:], np.full((3, 1), -100)], axis=1)))}
"""

#: The convolution kinds' rescaling tests (method §8), run on the JAX backend as they are on the TensorFlow one.
RESCALINGS = ("test_conv_channel_rescaling_plain_and_grouped or test_transposed_conv_channel_rescaling or "
              "test_depthwise_conv_with_depth_multiplier_rescaling or test_separable_conv1d_depthwise_and_pointwise"
              " or test_einsum_dense_multi_axis_feature_rescaling")

MODELS = BUILD + BUILD_HUB + BUILD_RNN + BUILD_CONV + BUILD_CALLS + BUILD_MOE

JAX_SIDE = MODELS + """
import json, normflat
before = [np.array(v.value) for v in model.weights]
out = {"backend": keras.backend.backend()}
for estimator in ("ggn", "exact"):
    report = normflat.analyze(model, (x, y), loss="ce", estimator=estimator, progress=False)
    out[estimator] = [[l.name, l.normalized_sharpness, l.hessian_trace] for l in report.layers]
    out[estimator + "_meta"] = [report.metadata["framework"], report.metadata["coverage"],
                                report.metadata["unsupported"], sorted(report.metadata["excluded"])]
measures = normflat.measures(model, (x, y), ["fisher_rao_norm", "adaptive_sharpness"], loss="ce", progress=False)
out["measures"] = [measures["fisher_rao_norm"], measures["adaptive_sharpness"]]
out["unchanged"] = all(np.array_equal(a, np.array(v.value)) for a, v in zip(before, model.weights))
model.get_layer("dense").enable_lora(2)
import warnings
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    lora = normflat.analyze(model, (x, y), loss="ce", progress=False)
out["lora_unsupported"] = lora.metadata["unsupported"]
hub = normflat.analyze(hub_model, hub_batch, loss="ce", progress=False)
out["hub"] = [hub.metadata["coverage"], hub.metadata["unsupported"],
              {l.name: l.normalized_sharpness for l in hub.layers}]
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
for key, (moe_model, moe_data) in {**{k: (m, (moe_x, moe_y)) for k, m in moe_models.items()},
                                   "deberta": (moe_deberta, moe_batch), **moe_own}.items():
    moe = normflat.analyze(moe_model, moe_data, loss="ce", progress=False)
    out["moe_" + key] = [moe.metadata["coverage"], moe.metadata["unsupported"],
                         [[l.name, l.kind, l.normalized_sharpness, l.hessian_trace] for l in moe.layers],
                         moe.metadata["excluded"]]
# The Keras training callback, during a fit on this backend.
from normflat.integrations.keras import SharpnessCallback
rnn_model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
callback = SharpnessCallback((rnn_x, rnn_y), every_n_epochs=1, progress=False)
rnn_model.fit(rnn_x, rnn_y, epochs=1, verbose=0, callbacks=[callback])
out["callback"] = [entry.totals["normalized_sharpness"] for entry in callback.history]
print("RESULT", json.dumps(out))
"""


def _jax_side() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import keras, numpy as np\n" + JAX_SIDE
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root,
                          env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_keras_model_on_the_jax_backend_equals_the_tensorflow_backend():
    assert keras.backend.backend() == "tensorflow"
    scope: dict = {"keras": keras, "np": np}
    exec(MODELS, scope)  # noqa: S102 - the shared model definitions above
    model, x, y = scope["model"], scope["x"], scope["y"]
    got = _jax_side()
    assert got["backend"] == "jax"
    for estimator in ("ggn", "exact"):
        want = normflat.analyze(model, (x, y), loss="ce", estimator=estimator, progress=False)
        framework, coverage, unsupported, excluded = got[estimator + "_meta"]
        assert framework == "jax" and coverage == 1.0 and unsupported == []
        assert excluded == sorted(want.metadata["excluded"])
        assert [name for name, _, _ in got[estimator]] == [layer.name for layer in want.layers]
        assert [layer.name for layer in want.layers] == [
            "emb", "mha/query", "mha/key", "mha/value", "mha/attention_output", "conv", "dense", "head"]
        for (name, sharpness, trace), layer in zip(got[estimator], want.layers):
            assert sharpness == pytest.approx(layer.normalized_sharpness, rel=2e-4), (estimator, name)
            assert trace == pytest.approx(layer.hessian_trace, rel=2e-4, abs=1e-6), (estimator, name)
    measures = normflat.measures(model, (x, y), ["fisher_rao_norm", "adaptive_sharpness"], loss="ce", progress=False)
    assert got["measures"] == pytest.approx([measures["fisher_rao_norm"], measures["adaptive_sharpness"]], rel=1e-3)
    assert got["unchanged"]
    assert any(m.startswith("dense/") and "LoRA-enabled" in m and "KERAS_BACKEND=tensorflow" in m
               for m in got["lora_unsupported"]), got["lora_unsupported"]
    # keras-hub: the TensorFlow backend's names (the backbone's prefix), the position table, named inputs.
    hub = normflat.analyze(scope["hub_model"], scope["hub_batch"], loss="ce", progress=False)
    coverage, unsupported, sharpness = got["hub"]
    assert coverage == 1.0 and unsupported == []
    assert sorted(sharpness) == sorted(layer.name for layer in hub.layers)
    assert "bert_backbone/position_embedding" in sharpness
    for layer in hub.layers:
        assert sharpness[layer.name] == pytest.approx(layer.normalized_sharpness, rel=2e-4), layer.name
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
    # keras-hub: one matrix per expert and map (gate and up de-interleaved for GPT-OSS), DeBERTa's
    # relative position table, as the TensorFlow backend names and reads them.
    moe_data = {**{k: (m, (scope["moe_x"], scope["moe_y"])) for k, m in scope["moe_models"].items()},
                "deberta": (scope["moe_deberta"], scope["moe_batch"]), **scope["moe_own"]}
    for key, (moe_model, data) in moe_data.items():
        want = normflat.analyze(moe_model, data, loss="ce", progress=False)
        coverage, unsupported, layers, excluded = got["moe_" + key]
        assert sorted(excluded) == sorted(want.metadata["excluded"]), key
        for name, reason in want.metadata["excluded"].items():
            if name.endswith("/r_k"):  # RWKV-7's bonus scale: the same reason
                assert excluded[name] == reason
        assert coverage == 1.0 and unsupported == [], (key, unsupported)
        # (the JAX backend lists layers by first use: DeBERTa's table after the first query projection)
        assert sorted(row[0] for row in layers) == sorted(layer.name for layer in want.layers), key
        for name, kind, sharpness, trace in layers:
            layer = want.layer(name)
            assert kind == layer.kind, (key, name)
            assert sharpness == pytest.approx(layer.normalized_sharpness, rel=2e-4, abs=1e-7), (key, name)
            assert trace == pytest.approx(layer.hessian_trace, rel=2e-4, abs=1e-7), (key, name)
    names = [row[0] for row in got["moe_gpt_oss"][2]]
    assert "experts/gate_up.2.up" in names and "experts/down.0" in names
    assert "deberta_v3_backbone/rel_embedding" in [row[0] for row in got["moe_deberta"][2]]
    assert ["delta/conv1d_kernel", "depthwise_conv1d"] in [row[:2] for row in got["moe_delta"][2]]
    assert any(row[0].endswith("/RWKV_TIME_MIX/a2") for row in got["moe_rwkv"][2])
    # The perturbation measures draw their noise in the canonical layouts and apply it in the native ones.
    measures = normflat.measures(scope["conv_model"], (scope["conv_x"], scope["conv_y"]),
                                 ["fisher_rao_norm", "adaptive_sharpness"], loss="ce", progress=False)
    assert got["conv_measures"] == pytest.approx([measures["fisher_rao_norm"], measures["adaptive_sharpness"]],
                                                 rel=1e-3)


def test_keras_convolution_rescalings_hold_on_the_jax_backend():
    """The rescaling tests of the convolution kinds (plain and grouped 1-D to 3-D, transposed 1-D to 3-D,
    depthwise with a depth multiplier, separable) and of multi-axis ``EinsumDense`` kernels, run on Keras'
    JAX backend in float64: the function unchanged, every normalized sharpness unchanged, the traces
    moved, each layer on its fast rule (method §8)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # Every analysis of the run must be the JAX backend's (not a TensorFlow fallback).
    code = f"""
import sys, keras, normflat, pytest
assert keras.backend.backend() == "jax"
analyze = normflat.analyze
def on_jax(*args, **kwargs):
    report = analyze(*args, **kwargs)
    assert report.metadata["framework"] == "jax", report.metadata["framework"]
    return report
normflat.analyze = on_jax
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
                      "tests/arch/test_keras_rescalings.py", "-k", {RESCALINGS!r}]))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root,
        env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", JAX_ENABLE_X64="1"))
    assert done.returncode == 0 and "9 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
