"""JAX backend, whole architectures: transformers, recurrent classifiers, token language models.

Each model is built from a tiny config with random weights (no downloads) and
analyzed with ``ggn`` on one batch. The checks are what a user of such a model
relies on: every weight matrix is analyzed (``coverage`` >= 0.99 in the report's
metadata, method §3), the parameters that are not weight matrices are listed in
``excluded`` with their reason, and the names are the models' own paths, in
model order. Hugging Face style keyword batches, dict outputs, tied embeddings
and learned position tables are exercised on the way. The numerical values of
these layers are checked against brute force in ``test_jax_layers.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("jax", "flax", "equinox")

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normflat  # noqa: E402

RNG = np.random.default_rng(3)
VOCAB, T, D = 13, 5, 8
IDS = jnp.asarray(RNG.integers(0, VOCAB, size=(4, T)))
MASK = jnp.asarray(np.arange(T)[None, :] < np.asarray([[5], [4], [3], [5]]))  # bool: stays bool
CLASSES = jnp.asarray([0, 1, 2, 1])


def _analyze(model, data, **kw):
    return normflat.analyze(model, data, estimator="ggn", progress=False, on_unsupported="error", **kw)


def _statuses(report):
    return {name: reason for name, reason in report.metadata["excluded"].items()}


class NnxTransformer(nnx.Module):
    """Embed + one pre-norm block (MHA, MLP) + mean-pooled head; keyword inputs, dict output."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(VOCAB, D, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        mask = nnx.make_attention_mask(attention_mask, attention_mask)
        h = h + self.attn(self.ln1(h), mask=mask)
        h = h + self.down(nnx.gelu(self.up(self.ln2(h))))
        w = attention_mask[..., None].astype(h.dtype)
        return {"logits": self.head((h * w).sum(1) / w.sum(1)), "hidden": h}


@pytest.mark.slow
def test_nnx_transformer_classifier_keyword_batch_and_dict_output():
    model = NnxTransformer(nnx.Rngs(0))
    before = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    batch = {"input_ids": IDS, "attention_mask": MASK, "labels": CLASSES}  # a Hugging Face style batch
    r = _analyze(model, batch)
    assert [l.name for l in r.layers] == ["emb", "attn/query", "attn/key", "attn/value", "attn/out", "up", "down",
                                          "head"]
    assert r.layers[0].kind == "embedding" and r.layers[0].shape == (D, VOCAB)
    assert r.layers[1].shape == (D, D)  # (heads·head_dim, d) from the kernel (d, heads, head_dim)
    assert r.metadata["coverage"] >= 0.99
    excluded = _statuses(r)
    assert excluded["up/bias"] == "bias" and "normalization" in excluded["ln1/scale"]
    assert set(excluded) == {"ln1/scale", "ln1/bias", "ln2/scale", "ln2/bias", "attn/query/bias", "attn/key/bias",
                             "attn/value/bias", "attn/out/bias", "up/bias", "down/bias", "head/bias"}
    after = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)  # the user's model is untouched


class NnxLSTMClassifier(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(VOCAB, D, rngs=rngs)
        self.rnn = nnx.RNN(nnx.LSTMCell(D, D, rngs=rngs))
        self.bi = nnx.Bidirectional(nnx.RNN(nnx.GRUCell(D, 4, rngs=rngs)), nnx.RNN(nnx.GRUCell(D, 4, rngs=rngs)))
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, ids):
        return self.head(self.bi(self.rnn(self.emb(ids)))[:, -1])


@pytest.mark.slow
def test_nnx_lstm_classifier():
    r = _analyze(NnxLSTMClassifier(nnx.Rngs(1)), (IDS, CLASSES))
    names = [l.name for l in r.layers]
    assert names[0] == "emb" and names[-1] == "head"
    assert {f"rnn/cell/{g}" for g in ("ii", "if_", "ig", "io", "hi", "hf", "hg", "ho")} <= set(names)
    # nnx.GRUCell packs its gates: one matrix per gate of each direction (method §3)
    assert {f"bi/{d}/cell/dense_{w}.{g}" for d in ("forward_rnn", "backward_rnn") for w in "ih"
            for g in "rzn"} <= set(names)
    assert r.metadata["coverage"] >= 0.99
    assert all(l.details["path"] == "generic" for l in r.layers if l.name.startswith("rnn/"))  # through the scan


class NnxLM(nnx.Module):
    """Token LM: Embed + learned positions (a loose nnx.Param) + block + tied ``attend`` head."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(VOCAB, D, rngs=rngs)
        self.pos_embed = nnx.Param(0.1 * jax.random.normal(rngs.params(), (1, T, D)))
        self.attn = nnx.MultiHeadAttention(2, D, decode=False, rngs=rngs)
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, ids):
        h = self.emb(ids) + self.pos_embed[...]
        causal = nnx.make_causal_mask(ids)
        h = h + self.attn(h, mask=causal)
        h = h + self.mlp(self.ln(h))
        return self.emb.attend(h), h  # a tuple: the logits are its first entry


def test_nnx_token_lm_tied_head_and_position_table():
    y = np.asarray(IDS).copy()
    y[:, 0] = -100  # prompt tokens not counted
    r = _analyze(NnxLM(nnx.Rngs(2)), (IDS, jnp.asarray(y)))
    layers = {l.name: l for l in r.layers}
    assert list(layers)[:2] == ["emb", "pos_embed"]
    assert layers["emb"].shape == (D, VOCAB)  # tied: the lookup and the head share one matrix, reported once
    assert layers["pos_embed"].kind == "embedding" and layers["pos_embed"].shape == (D, T)
    assert r.metadata["loss_terms"] == 4 * (T - 1)
    assert r.metadata["coverage"] >= 0.99


class EqxTokenModel(eqx.Module):
    """Per example: ids (T,) -> embedding + position table -> self-attention -> token logits (T, V)."""

    emb: eqx.nn.Embedding
    position_embeddings: jax.Array
    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.emb = eqx.nn.Embedding(VOCAB, D, key=k1)
        self.position_embeddings = 0.1 * jax.random.normal(k2, (T, D))
        self.attn = eqx.nn.MultiheadAttention(2, D, key=k3)
        self.norm = eqx.nn.LayerNorm(D)
        self.out = eqx.nn.Linear(D, VOCAB, key=k4)

    def __call__(self, ids):
        h = jax.vmap(self.emb)(ids) + self.position_embeddings
        h = h + self.attn(h, h, h)
        return jax.vmap(lambda v: self.out(self.norm(v)))(h)


@pytest.mark.slow
def test_equinox_attention_model_with_embeddings():
    r = _analyze(EqxTokenModel(jax.random.key(3)), (IDS, IDS), shift_labels=True)
    names = [l.name for l in r.layers]
    assert names == ["emb", "position_embeddings", "attn/query_proj", "attn/key_proj", "attn/value_proj",
                     "attn/output_proj", "out"]
    assert r.metadata["loss_terms"] == 4 * (T - 1)  # shift_labels: the last position predicts nothing
    assert r.metadata["coverage"] >= 0.99
    assert set(_statuses(r)) == {"norm/weight", "norm/bias", "out/bias"}


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(VOCAB, D, name="emb")(ids)
        h = h + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(nn.LayerNorm(name="ln1")(h))
        m = nn.Dense(2 * D, name="up")(nn.LayerNorm(name="ln2")(h))
        h = h + nn.Dense(D, name="down")(nn.relu(m))
        return nn.Dense(3, name="head")(h.mean(axis=1))


def test_linen_transformer_block():
    module = LinenBlock()
    variables = module.init(jax.random.key(4), IDS)
    r = _analyze((module, variables), (IDS, CLASSES))
    assert [l.name for l in r.layers] == ["emb", "attn/query", "attn/key", "attn/value", "attn/out", "up", "down",
                                          "head"]
    assert r.metadata["coverage"] >= 0.99
    # a keyword batch: module.apply(variables, ids=...), the same analysis
    rk = _analyze((module, variables), {"ids": IDS, "labels": CLASSES})
    assert rk.normalized_sharpness == pytest.approx(r.normalized_sharpness, rel=1e-6)


def test_skipped_parameters_lower_the_coverage():
    class Custom(nnx.Module):  # an unregistered module with a weight matrix
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)))

        def __call__(self, h):
            return h @ self.w[...]

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(VOCAB, D, rngs=rngs)
            self.custom = Custom(rngs)
            self.head = nnx.Linear(D, 3, rngs=rngs)

        def __call__(self, ids):
            return self.head(self.custom(self.emb(ids)).mean(1))

    with pytest.warns(UserWarning, match="custom/w"):
        r = normflat.analyze(Model(nnx.Rngs(5)), (IDS, CLASSES), estimator="ggn", progress=False)
    total = VOCAB * D + D * D + D * 3
    assert r.metadata["coverage"] == pytest.approx((total - D * D) / total)
    assert "custom/w" not in r.metadata["excluded"]
