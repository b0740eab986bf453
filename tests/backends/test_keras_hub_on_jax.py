"""keras-hub models on Keras' JAX backend (``KERAS_BACKEND=jax``) against the TensorFlow backend.

The same models with the same weights are analyzed here on the TensorFlow backend and, in a fresh
interpreter, on the JAX one (see ``tests/backends/test_keras_on_jax.py`` for the plain Keras
layers): a BERT classifier (a nested backbone named as the TensorFlow backend names it, a position
table, a mapping of named inputs); the experts layers of Mixtral, Qwen-MoE and GPT-OSS (separate,
packed and alternating gate/up kernels, one matrix per expert and map) in a routed classifier;
a DeBERTa-v3 classifier (its relative position table); and the matrices keras-hub layers multiply
by in their own call (RWKV-7's low-rank maps, its ``r_k`` held fixed with the same reason; Qwen3.5's
gated delta net's causal convolution, compared as read, not analyzed: its analysis compiles for a
minute on JAX); T5's attention (its relative-position bias table excluded with the same reason, it
was skipped as unsupported on JAX). Both backends give the same names, kinds, coverage 1
and numbers, at float32's agreement.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.backends._keras_jax_side import run_on_jax
from tests.builders import require_frameworks

require_frameworks("keras", "tensorflow", "jax", "keras_hub")

import keras  # noqa: E402

import normflat  # noqa: E402
from normflat.engine.registry import RELATIVE_BIAS_REASON  # noqa: E402

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
moe_in = keras.Input((3, 6))
moe_h = Qwen3_5GatedDeltaNet(hidden_size=6, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=2,
                             linear_value_head_dim=2, linear_conv_kernel_dim=3, name="delta")(moe_in)
moe_delta = keras.Model(moe_in, keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(moe_h)))
moe_rwkv = keras_hub.models.RWKV7CausalLM(keras_hub.models.RWKV7Backbone(
    hidden_size=8, head_size=4, num_layers=1, vocabulary_size=11, intermediate_dim=16, gate_lora=3, mv_lora=2,
    aaa_lora=2, decay_lora=3, name="rwkv7_backbone"), preprocessor=None)  # not rwkv7_backbone_2 after others
for moe_model in (moe_delta, moe_rwkv):
    moe_model.set_weights([moe_rng.normal(size=w.shape).astype("float32") * 0.5 for w in moe_model.get_weights()])
moe_tokens = moe_rng.integers(1, 11, (2, 4)).astype("int32")
moe_own = {"rwkv": (moe_rwkv, ({"token_ids": moe_tokens, "padding_mask": np.ones((2, 4), "int32")},
                               np.concatenate([moe_tokens[:, 1:], np.full((2, 1), -100)], axis=1)))}
# keras-hub T5's attention, holding its relative-position bias table as `relative_attention_bias`.
from keras_hub.src.models.t5.t5_multi_head_attention import T5MultiHeadAttention


class T5Attending(keras.Model):
    def __init__(self):
        super().__init__(name="t5_attending")
        self.attention = T5MultiHeadAttention(is_decoder=False, hidden_dim=6, key_value_dim=2, num_heads=2,
                                              dropout=0.0, use_relative_attention_bias=True, name="t5_attention")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(ops.mean(self.attention(x)[0], axis=1))  # (output, position bias, cache)


moe_t5 = T5Attending()
moe_t5(np.zeros((1, 4, 6), "float32"))
moe_t5.set_weights([moe_rng.normal(size=w.shape).astype("float32") * 0.5 for w in moe_t5.get_weights()])
moe_own["t5"] = (moe_t5, (moe_rng.normal(size=(3, 4, 6)).astype("float32"), moe_rng.integers(0, 3, 3)))
"""

MODELS = BUILD_HUB + BUILD_MOE

JAX_SIDE = MODELS + """
import normflat
out = {"backend": keras.backend.backend()}
hub = normflat.analyze(hub_model, hub_batch, loss="ce", progress=False)
out["hub"] = [hub.metadata["coverage"], hub.metadata["unsupported"],
              {l.name: l.normalized_sharpness for l in hub.layers}]
for key, (moe_model, moe_data) in {**{k: (m, (moe_x, moe_y)) for k, m in moe_models.items()},
                                   "deberta": (moe_deberta, moe_batch), **moe_own}.items():
    moe = normflat.analyze(moe_model, moe_data, loss="ce", progress=False)
    out["moe_" + key] = [moe.metadata["coverage"], moe.metadata["unsupported"],
                         [[l.name, l.kind, l.normalized_sharpness, l.hessian_trace] for l in moe.layers],
                         moe.metadata["excluded"]]
from normflat.backends.jax.layers import make_view
delta_view = make_view(moe_delta, np.zeros((2, 3, 6), "float32"), dtype=None, vmap=None, state=None, apply_kwargs={},
                       layouts={})
delta_conv = next(w for w in delta_view.weights if w.name == "delta/conv1d_kernel")
delta_kernel = np.asarray(delta_conv.to_canonical(delta_view.leaves[delta_conv.leaf]))
out["delta_view"] = [[w.name for w in delta_view.weights], {w.name: w.kind for w in delta_view.weights},
                     delta_conv.groups, delta_kernel.tolist()]
"""


def _unnumbered(name: str) -> str:
    """``name`` without Keras' per-process numbering of unnamed layers (``group_normalization_3``)."""
    return re.sub(r"_\d+(?=/|$)", "", name)


def test_keras_hub_models_on_the_jax_backend_equal_the_tensorflow_backend():
    assert keras.backend.backend() == "tensorflow"
    scope: dict = {"keras": keras, "np": np}
    exec(MODELS, scope)  # noqa: S102 - the shared model definitions above
    got = run_on_jax(JAX_SIDE)
    assert got["backend"] == "jax"
    # keras-hub: the TensorFlow backend's names (the backbone's prefix), the position table, named inputs.
    hub = normflat.analyze(scope["hub_model"], scope["hub_batch"], loss="ce", progress=False)
    coverage, unsupported, sharpness = got["hub"]
    assert coverage == 1.0 and unsupported == []
    assert sorted(sharpness) == sorted(layer.name for layer in hub.layers)
    assert "bert_backbone/position_embedding" in sharpness
    for layer in hub.layers:
        assert sharpness[layer.name] == pytest.approx(layer.normalized_sharpness, rel=2e-4), layer.name
    # keras-hub: one matrix per expert and map (gate and up de-interleaved for GPT-OSS), DeBERTa's
    # relative position table, as the TensorFlow backend names and reads them.
    moe_data = {**{k: (m, (scope["moe_x"], scope["moe_y"])) for k, m in scope["moe_models"].items()},
                "deberta": (scope["moe_deberta"], scope["moe_batch"]), **scope["moe_own"]}
    for key, (moe_model, data) in moe_data.items():
        want = normflat.analyze(moe_model, data, loss="ce", progress=False)
        coverage, unsupported, layers, excluded = got["moe_" + key]
        # Layers keras-hub leaves unnamed are numbered per process (group_normalization_3 here after
        # other tests, group_normalization in the fresh JAX interpreter): names compared unnumbered.
        assert sorted(map(_unnumbered, excluded)) == sorted(map(_unnumbered, want.metadata["excluded"])), key
        # the same reasons (RWKV-7's bonus scale, the normalization layers', the biases')
        assert {_unnumbered(name): reason for name, reason in excluded.items()} == {
            _unnumbered(name): reason for name, reason in want.metadata["excluded"].items()}, key
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
    # Qwen3.5's gated delta net: its analysis on JAX compiles for a minute (its chunked scan), so its
    # weights are compared as read (names, kinds, groups, the canonical convolution kernel), not analyzed.
    from normflat.backends.keras.layers import walk

    entries, unsupported, _ = walk(scope["moe_delta"], "warn", None)
    assert unsupported == []
    names, kinds, groups, canonical = got["delta_view"]
    assert sorted(names) == sorted(e.name for e in entries)
    conv = next(e for e in entries if e.name == "delta/conv1d_kernel")
    channels = conv.variable.shape[0]
    assert (kinds["delta/conv1d_kernel"], groups) == (conv.weight.kind, conv.weight.groups) == ("depthwise_conv1d",
                                                                                               channels)
    np.testing.assert_array_equal(np.asarray(canonical), np.expand_dims(conv.variable.numpy(), 1))
    assert any(row[0].endswith("/RWKV_TIME_MIX/a2") for row in got["moe_rwkv"][2])
    # T5's relative-position bias table: excluded (added to the scores), not skipped as unsupported.
    assert got["moe_t5"][3]["t5_attention/embeddings"] == RELATIVE_BIAS_REASON
