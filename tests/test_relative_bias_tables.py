"""Relative-position bias tables held by an embedding layer are excluded in every framework (method §3).

T5's ``relative_attention_bias`` (and keras-hub's T5 attribute of that name) is looked up by its own
embedding layer, one row per bucket of relative positions, and added to the attention scores per
head: a bias table, excluded by definition like the tables recognised by name, with one reason in
every framework, while the layers around it are analyzed.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import normflat  # noqa: E402
from normflat.engine.registry import RELATIVE_BIAS_REASON  # noqa: E402

T, D, C = 5, 4, 3
BUCKETS = np.arange(T) % 3  # a fixed bucket per position, looked up without a batch axis


def _data(n=4, seed=0):
    g = np.random.default_rng(seed)
    return g.normal(size=(n, T, D)), g.integers(0, C, n)


def _check(report, table_path):
    excluded = report.metadata["excluded"]
    assert excluded.get(table_path) == RELATIVE_BIAS_REASON, excluded
    assert report.metadata["coverage"] == 1.0 and report.metadata["unsupported"] == []
    assert {layer.details["path"] for layer in report.layers} == {"fast"}
    assert not any("relative" in layer.name for layer in report.layers)


def test_the_rule_reads_the_last_name():
    from normflat.engine.registry import relative_bias_table

    assert relative_bias_table("encoder.block.0.layer.0.SelfAttention.relative_attention_bias") == RELATIVE_BIAS_REASON
    assert relative_bias_table("t5/self_attention/relative_attention_bias") == RELATIVE_BIAS_REASON
    assert relative_bias_table("wavlm.encoder.layers.0.attention.rel_attn_embed") == RELATIVE_BIAS_REASON
    assert relative_bias_table("relative_attention_bias_proj") is None
    assert relative_bias_table("decoder.embed_tokens") is None


def test_torch_embedding_named_relative_attention_bias():
    import torch

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(D, D)
            self.relative_attention_bias = torch.nn.Embedding(3, D)
            self.head = torch.nn.Linear(D, C)

        def forward(self, x):
            bias = self.relative_attention_bias(torch.as_tensor(BUCKETS))  # (T, D), shared by the batch
            return self.head(torch.tanh(self.proj(x) + bias).mean(1))

    torch.manual_seed(0)
    x, y = _data()
    report = normflat.analyze(Biased().double(), (torch.as_tensor(x), torch.as_tensor(y)), progress=False)
    _check(report, "relative_attention_bias.weight")


def test_torch_t5_relative_attention_bias():
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=50, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(2, 50, (2, 6), generator=g), "labels": torch.randint(2, 50, (2, 4), generator=g)}
    report = normflat.analyze(model, batch, progress=False)
    tables = [name for name in report.metadata["excluded"] if "relative_attention_bias" in name]
    assert tables == ["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                      "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    assert all(report.metadata["excluded"][name] == RELATIVE_BIAS_REASON for name in tables)
    assert report.metadata["coverage"] == 1.0
    assert {layer.details["path"] for layer in report.layers} == {"fast"}


@pytest.mark.parametrize("named", [True, False])
def test_keras_embedding_held_as_relative_attention_bias(named):
    """A Keras ``Embedding`` named ``relative_attention_bias``, or held by its layer under that attribute."""
    import keras

    L = keras.layers

    class Biased(L.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.proj = L.Dense(D, dtype="float64", name="proj")
            self.relative_attention_bias = L.Embedding(3, D, dtype="float64",
                                                       name="relative_attention_bias" if named else "table")

        def call(self, x):
            bias = self.relative_attention_bias(keras.ops.convert_to_tensor(BUCKETS))  # (T, D), shared
            return keras.ops.tanh(self.proj(x) + bias)

    inp = keras.Input((T, D), dtype="float64")
    biased = Biased(dtype="float64", name="biased")
    model = keras.Model(inp, L.Dense(C, dtype="float64", name="head")(keras.ops.mean(biased(inp), axis=1)))
    report = normflat.analyze(model, _data(), progress=False)
    _check(report, biased.relative_attention_bias.embeddings.path)


def test_keras_hub_t5_relative_attention_bias():
    pytest.importorskip("keras_hub")
    import keras
    from keras_hub.src.models.t5.t5_backbone import T5Backbone

    keras.utils.set_random_seed(0)
    backbone = T5Backbone(vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
                          key_value_dim=4)
    names = ("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask")
    inputs = {k: keras.Input((6,), dtype="int32", name=k) for k in names}
    model = keras.Model(inputs, keras.layers.Dense(C, name="head")(backbone(inputs)["decoder_sequence_output"][:, 0]))
    g = np.random.default_rng(2)
    x = {k: (g.integers(1, 30, (3, 6)) if "ids" in k else np.ones((3, 6))).astype("int32") for k in names}
    report = normflat.analyze(model, (x, g.integers(0, C, 3)), progress=False)
    tables = [v.path for v in backbone.weights if tuple(v.shape) == (32, 2)]
    assert len(tables) == 2 and report.metadata["unsupported"] == []
    for path in tables:
        assert report.metadata["excluded"][path] == RELATIVE_BIAS_REASON


@pytest.mark.parametrize("flavour", ["nnx", "linen"])
def test_flax_embed_named_relative_attention_bias(flavour):
    import jax
    import jax.numpy as jnp

    x, y = _data()
    x = x.astype(np.float32)  # flax's default parameters are float32
    buckets = jnp.asarray(BUCKETS)
    if flavour == "nnx":
        from flax import nnx

        class Biased(nnx.Module):
            def __init__(self, rngs):
                self.proj = nnx.Linear(D, D, rngs=rngs)
                self.relative_attention_bias = nnx.Embed(3, D, rngs=rngs)
                self.head = nnx.Linear(D, C, rngs=rngs)

            def __call__(self, x):
                return self.head(jnp.tanh(self.proj(x) + self.relative_attention_bias(buckets)).mean(1))

        model, table = Biased(nnx.Rngs(0)), "relative_attention_bias/embedding"
    else:
        import flax.linen as nn

        class Biased(nn.Module):
            @nn.compact
            def __call__(self, x):
                bias = nn.Embed(3, D, name="relative_attention_bias")(buckets)
                h = jnp.tanh(nn.Dense(D, name="proj")(x) + bias)
                return nn.Dense(C, name="head")(h.mean(1))

        module = Biased()
        model = (module, module.init(jax.random.PRNGKey(0), jnp.asarray(x)))
        table = "relative_attention_bias/embedding"
    report = normflat.analyze(model, (jnp.asarray(x), jnp.asarray(y)), progress=False)
    excluded = report.metadata["excluded"]
    assert [k for k in excluded if "relative_attention_bias" in k] and all(
        excluded[k] == RELATIVE_BIAS_REASON for k in excluded if "relative_attention_bias" in k), excluded
    assert any(k.endswith(table) for k in excluded)
    assert report.metadata["coverage"] == 1.0 and report.metadata["unsupported"] == []
    assert {layer.details["path"] for layer in report.layers} == {"fast"}
