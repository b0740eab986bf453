"""JAX backend: the fast GGN rule of embedding lookups (method §3 "Embeddings", §6, §6.3).

A table whose only use is one row lookup (flax nnx / linen ``Embed``, equinox
``Embedding``, ``jnp.take`` or ``table[:, ids]`` of a raw table) is a tap of the
traced program: per example the output signals of equal ids are summed, squared
and scattered into the table. Every diagonal here is checked three ways in
float64: the fast rule, the generic path (the same analysis traced without
lookup taps) and the brute-force ``(1/N) Σ J_{n,t}ᵀ H_{n,t} J_{n,t}`` of
:func:`tests.arch.test_jax_layers.ref_ggn` (full per-sample Jacobians, per-token
loss Hessians over the counted tokens), with repeated ids inside a sample and
token labels with ``ignore_index``. A table that is also the tied LM head is used
twice and must stay on the generic path.
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
from normflat.backends.jax import program, session  # noqa: E402
from tests.arch.test_jax_layers import NnxLM, assert_close, canon, ref_ggn  # noqa: E402

jax.config.update("jax_enable_x64", True)

F64 = jnp.float64
V, D, T = 11, 4, 4
#: Token ids (n, T) with ids repeated inside every sample.
IDS = jnp.asarray([[1, 3, 1, 1], [2, 2, 5, 0], [7, 1, 7, 3]])
#: Token labels with uncounted tokens (ignore_index -100).
LABELS = np.asarray([[3, -100, 0, 10], [1, 4, -100, -100], [9, 9, 2, 6]])


def _hd(model, data, **kw):
    kw.setdefault("progress", False)
    return {k: np.asarray(v) for k, v in normflat.hessian_diagonal(model, data, **kw).items()}


def _paths(model, data, **kw):
    r = normflat.analyze(model, data, progress=False, **kw)
    return {layer.name: layer.details["path"] for layer in r.layers}


def _generic(monkeypatch, fn):
    """``fn()`` traced without lookup taps (every table on the generic path), in fresh caches.

    The traced programs and compiled kernels are cached by the program's text, which
    does not show the taps: both caches are emptied before and after.
    """
    session._TRACES.clear()
    session._CACHE.clear()
    monkeypatch.setattr(program, "_LOOKUP_PRIMS", frozenset())
    try:
        return fn()
    finally:
        monkeypatch.undo()
        session._TRACES.clear()
        session._CACHE.clear()


def _three_way(monkeypatch, model, data, ref, expected, tables, **kw):
    """fast == generic == brute force for every layer of ``expected``; ``tables``: the looked-up ones."""
    fast = _hd(model, data, estimator="ggn", **kw)
    paths, generic = _generic(monkeypatch, lambda: (_paths(model, data, estimator="ggn", **kw),
                                                    _hd(model, data, estimator="ggn", **kw)))
    assert all(paths[name] == "generic" for name in tables)  # the comparison really is with the generic path
    assert set(fast) == set(generic) == set(expected)
    for name, (leaf, kind) in expected.items():
        want = canon(ref[leaf], kind)
        assert_close(fast[name], want)
        assert_close(generic[name], want)
    return fast


# ----------------------------------------------------------------------------- models


class NnxTagger(nnx.Module):
    """Token and position ``Embed`` (the positions looked up at constant ids), a mix over tokens, a head."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, param_dtype=F64, rngs=rngs)
        self.pos = nnx.Embed(T, D, param_dtype=F64, rngs=rngs)
        self.head = nnx.Linear(D, V, param_dtype=F64, rngs=rngs)

    def __call__(self, ids):
        h = self.emb(ids) + self.pos(jnp.arange(ids.shape[-1]))
        # the mix makes every token's signal reach the rows of the other tokens
        return self.head(jnp.tanh(h + h.mean(axis=-2, keepdims=True)))


class NnxClassifier(nnx.Module):
    """One id per sample (ids (n,)) -> Embed -> head: logits (n, C)."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, param_dtype=F64, rngs=rngs)
        self.head = nnx.Linear(D, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, ids):
        return self.head(jnp.tanh(self.emb(ids)))


class LinenTables(nn.Module):
    """linen ``Embed`` beside two raw ``(features, vocabulary)`` tables read by columns and by a clipped take."""

    @nn.compact
    def __call__(self, ids):
        init = nn.initializers.normal(1.0)
        cols = self.param("cols", init, (D, V), F64)
        clipped = self.param("clipped", init, (D, V), F64)
        h = nn.Embed(V, D, param_dtype=F64, name="emb")(ids % V)
        h = h + jnp.moveaxis(cols[:, ids % V], 0, -1)  # a gather of columns: rows along the table's axis 1
        h = h + jnp.take(clipped.T, ids, axis=0, mode="clip")  # ids past the vocabulary read its last row
        return nn.Dense(V, param_dtype=F64, name="head")(jnp.tanh(h + h.mean(axis=-2, keepdims=True)))


class EqxTagger(eqx.Module):
    """Per example: ids (T,) -> vmapped Embedding (a gather) + the first id's row of another (a dynamic_slice)."""

    emb: eqx.nn.Embedding
    first: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.emb = eqx.nn.Embedding(V, D, key=k1, dtype=F64)
        self.first = eqx.nn.Embedding(V, D, key=k2, dtype=F64)
        self.head = eqx.nn.Linear(D, V, key=k3, dtype=F64)

    def __call__(self, ids):
        h = jax.vmap(self.emb)(ids) + self.first(ids[0])
        return jax.vmap(self.head)(jnp.tanh(h + h.mean(axis=0)))


# ----------------------------------------------------------------------------- tests


def test_nnx_embed_fast_token_logits_ignore_index(monkeypatch):
    model = NnxTagger(nnx.Rngs(0))
    data = (IDS, jnp.asarray(LABELS))
    # pieces of 2 sequences: the last one padded (masked rows must not reach the table)
    kw = dict(loss="ce", chunk_size=2)
    assert _paths(model, data, estimator="ggn", **kw) == {"emb": "fast", "pos": "fast", "head": "fast"}
    expected = {"emb": ("emb/embedding", "flax"), "pos": ("pos/embedding", "flax"), "head": ("head/kernel", "flax")}
    _three_way(monkeypatch, model, data, ref_ggn(model, IDS, LABELS, "ce"), expected, ("emb", "pos"), **kw)


def test_nnx_embed_fast_one_id_per_sample_nsce(monkeypatch):
    model = NnxClassifier(nnx.Rngs(1))
    ids = jnp.asarray([4, 1, 4, 9, 4])
    y = jnp.asarray([0, 2, 1, 1, 0])
    expected = {"emb": ("emb/embedding", "flax"), "head": ("head/kernel", "flax")}
    _three_way(monkeypatch, model, (ids, y), ref_ggn(model, ids, y, "nsce"), expected, ("emb",))
    # ggn-mc: the same signals (same seed) reach the table on both paths
    mc = _hd(model, (ids, y), estimator="ggn-mc", samples=4, seed=3)
    mc_generic = _generic(monkeypatch, lambda: _hd(model, (ids, y), estimator="ggn-mc", samples=4, seed=3))
    assert_close(mc["emb"], mc_generic["emb"])


def test_linen_embed_and_raw_tables_fast(monkeypatch):
    module = LinenTables()
    ids = IDS.at[1, 3].set(V + 2)  # past the vocabulary: clipped by the take, wrapped (ids % V) elsewhere
    variables = module.init(jax.random.key(2), ids)
    model, data = (module, variables), (ids, jnp.asarray(LABELS))
    layouts = {"cols": "out,in", "clipped": "out,in"}  # (features, vocabulary): canonical already
    paths = _paths(model, data, estimator="ggn", layouts=layouts)
    assert paths == {"emb": "fast", "cols": "fast", "clipped": "fast", "head": "fast"}
    expected = {"emb": ("emb/embedding", "flax"), "cols": ("cols", "eqx"), "clipped": ("clipped", "eqx"),
                "head": ("head/kernel", "flax")}
    fast = _three_way(monkeypatch, model, data, ref_ggn(module, ids, LABELS, "nsce", variables), expected,
                      ("emb", "cols", "clipped"), layouts=layouts)
    assert fast["clipped"][:, V - 1].sum() > 0  # the clipped id's curvature lands on the last row


def test_equinox_embedding_gather_and_dynamic_slice_fast(monkeypatch):
    model = EqxTagger(jax.random.key(3))
    data = (IDS, jnp.asarray(LABELS))
    assert _paths(model, data, estimator="ggn") == {"emb": "fast", "first": "fast", "head": "fast"}
    expected = {"emb": ("emb/weight", "flax"), "first": ("first/weight", "flax"), "head": ("head/weight", "eqx")}
    _three_way(monkeypatch, model, data, ref_ggn(model, IDS, LABELS, "nsce"), expected, ("emb", "first"))


def test_tied_attend_head_stays_generic_and_exact():
    model = NnxLM(nnx.Rngs(4), vocab=V, d=D)
    data = (IDS, jnp.asarray(LABELS))
    paths = _paths(model, data, estimator="ggn", loss="ce")
    assert paths["emb"] == "generic"  # the lookup and the attend head: one table used twice
    diag = _hd(model, data, estimator="ggn", loss="ce")
    assert_close(diag["emb"], canon(ref_ggn(model, IDS, LABELS, "ce")["emb/embedding"], "flax"))
