"""JAX backend: the fast GGN rule of embedding lookups (method §3 "Embeddings", §6, §6.3).

A table whose only use is one row lookup (flax nnx / linen ``Embed``, equinox
``Embedding``, ``jnp.take`` or ``table[:, ids]`` of a raw table) is a tap of the
traced program: per example the output signals of equal ids are summed, squared
and scattered into the table. Every diagonal here is checked three ways in
float64: the fast rule, the generic path (the same analysis traced without
lookup taps) and the brute-force ``(1/N) Σ J_{n,t}ᵀ H_{n,t} J_{n,t}`` of
:func:`tests.arch.test_jax_layers.ref_ggn` (full per-sample Jacobians, per-token
loss Hessians over the counted tokens), with repeated ids inside a sample and
token labels with ``ignore_index``.

A table that is also the tied LM head (flax ``Embed.attend``, ``h @ table.T``) has one
tap per use (method §6.1 "Tied weights"): its per-example gradient, the lookup's
scatter of its output signals plus the head's product of the signal with its input, is
summed before the square. The same three ways for flax nnx, linen and equinox, with a
padding id whose labels are ignored, ``shift_labels``, ``ggn``, ``ggn-mc`` and ``ggn-topk``
on two batch sizes, and the signals in several steps; a table also used otherwise, or
changed before its use, stays generic with its reason.

Learned position tables added to the activations (method §6.1 "Position tables")
are taps of their own: the signal at the table's operand of the ``add`` is, in the
per-example program, that example's gradient of the rows it reads. The same three
ways for flax nnx, linen and equinox tables (sliced, indexed at the leading axis,
broadcast inside the example), with ``ggn``, ``ggn-mc`` and ``ggn-topk`` on two batch
sizes; a table also used elsewhere, or used other than by an addition, stays generic
with its reason.
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
from normflat.backends.jax import ggn as jax_ggn  # noqa: E402
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
    """``fn()`` traced without lookup taps and added tables (every table on the generic path),
    in fresh caches.

    The traced programs and compiled kernels are cached by the program's text, which
    does not show the taps: both caches are emptied before and after.
    """
    session._TRACES.clear()
    session._CACHE.clear()
    monkeypatch.setattr(program, "_LOOKUP_PRIMS", frozenset())
    monkeypatch.setattr(program, "_TABLE_ADD", frozenset())
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


# ----------------------------------------------------------------------------- tied tables (method §6.1)

#: The padding id of :data:`TIED_IDS`; its positions' labels are ignored.
PAD = 0
#: Sequences with repeated ids and trailing padding (the second and third).
TIED_IDS = jnp.asarray([[1, 3, 1, 1], [2, 2, 5, PAD], [7, 1, PAD, PAD]])
#: Next-token labels (``shift_labels=True`` shifts them): padding and one prompt token not counted.
TIED_LABELS = np.asarray([[1, 3, -100, 1], [2, 2, 5, -100], [7, 1, -100, -100]])


def _shifted(y):
    """The labels ``shift_labels=True`` makes of ``y``: position ``t`` predicts label ``t + 1``."""
    y = np.asarray(y)
    return np.concatenate([y[:, 1:], np.full((len(y), 1), -100)], axis=1)


class NnxTiedLM(nnx.Module):
    """Embed, a mix over the tokens, the ``attend`` head; ``use``: ``"attend"`` only, ``"lookups"`` the
    ids reversed looked up too (two lookups and the head: three taps), ``"third"`` the table also
    scales the features (a third use), ``"scaled"`` the head reads a scaled copy of it, ``"row"`` its
    row 0 is added to every token (a fixed row, e.g. a start token's)."""

    def __init__(self, rngs, use="attend"):  # "float32": the head computes in float32 (float32 logits)
        self.use = use
        self.emb = nnx.Embed(V, D, param_dtype=F64, rngs=rngs)
        self.mix = nnx.Linear(D, D, param_dtype=F64, rngs=rngs)

    def __call__(self, ids):
        h = self.emb(ids)
        if self.use == "row":
            h = h + self.emb.embedding[0]
        if self.use == "lookups":
            h = h + 0.5 * self.emb(jnp.flip(ids, axis=-1))
        h = jnp.tanh(self.mix(h + h.mean(axis=-2, keepdims=True)))
        if self.use == "third":
            h = h * jnp.tanh(self.emb.embedding[...].mean(axis=0))
        if self.use == "scaled":
            return h @ (0.5 * self.emb.embedding[...]).T
        if self.use == "float32":
            return h.astype(jnp.float32) @ self.emb.embedding[...].astype(jnp.float32).T
        return self.emb.attend(h)


class LinenTiedLM(nn.Module):
    """linen ``Embed`` and its ``attend`` as the head."""

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(V, D, param_dtype=F64, name="emb")
        h = emb(ids)
        return emb.attend(jnp.tanh(nn.Dense(D, param_dtype=F64, name="mix")(h + h.mean(axis=-2, keepdims=True))))


class EqxTiedLM(eqx.Module):
    """Per example: ids (T,) -> vmapped ``Embedding`` -> a mix -> ``h @ table.T`` by hand."""

    emb: eqx.nn.Embedding
    mix: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.emb = eqx.nn.Embedding(V, D, key=k1, dtype=F64)
        self.mix = eqx.nn.Linear(D, D, key=k2, dtype=F64)

    def __call__(self, ids):
        h = jax.vmap(self.emb)(ids)
        return jnp.tanh(jax.vmap(self.mix)(h + h.mean(axis=0))) @ self.emb.weight.T


def _tied(kind, **kw):
    """``(model, brute-force reference (ids, labels, loss) -> {leaf: native}, {name: (leaf, kind)})``."""
    if kind == "nnx":
        model = NnxTiedLM(nnx.Rngs(8), **kw)
        return model, lambda x, y, loss: ref_ggn(model, x, y, loss), {
            "emb": ("emb/embedding", "flax"), "mix": ("mix/kernel", "flax")}
    if kind == "linen":
        module = LinenTiedLM()
        variables = module.init(jax.random.key(9), TIED_IDS)
        return (module, variables), lambda x, y, loss: ref_ggn(module, x, y, loss, variables), {
            "emb": ("emb/embedding", "flax"), "mix": ("mix/kernel", "flax")}
    model = EqxTiedLM(jax.random.key(10))
    return model, lambda x, y, loss: ref_ggn(model, x, y, loss), {
        "emb": ("emb/weight", "flax"), "mix": ("mix/weight", "eqx")}


def _untied(fn):
    """``fn()`` with every tied table on the generic path (no tied taps), in fresh caches."""
    session._TRACES.clear()
    session._CACHE.clear()
    saved = program._TIED_USES
    program._TIED_USES = frozenset()
    try:
        return fn()
    finally:
        program._TIED_USES = saved
        session._TRACES.clear()
        session._CACHE.clear()


@pytest.mark.parametrize("kind, kw, every_estimator", [
    ("nnx", {}, True), ("nnx", {"use": "lookups"}, False), ("linen", {}, False), ("equinox", {}, False)],
    ids=["nnx", "nnx-lookups", "linen", "equinox"])
def test_tied_table_fast_equals_generic_and_brute_force(kind, kw, every_estimator):
    """The table read by the lookup and the tied head: one weight, two taps, their per-example
    gradients summed before the square. ``ggn`` (per token, labels shifted as a causal LM's, the
    padding ignored) against brute force and the generic path, on a batch of 3 in pieces of 2 (the
    last one padded) and of 2; with ``every_estimator`` also ``ggn-mc`` and ``ggn-topk`` (per
    sequence) against the generic path (the same draws)."""
    model, ref, layers = _tied(kind, **kw)
    data = (TIED_IDS, jnp.asarray(TIED_LABELS))
    report = normflat.analyze(model, data, estimator="ggn", shift_labels=True, progress=False)
    emb = report.layer("emb")
    assert emb.shape == (D, V) and emb.details["path"] == "fast" and "generic_reason" not in emb.details
    assert report.metadata["loss_terms"] == int((_shifted(TIED_LABELS) >= 0).sum()) == 5
    batches = [(TIED_IDS[:n], jnp.asarray(TIED_LABELS[:n])) for n in (3, 2)]
    runs = [dict(estimator="ggn")]
    if every_estimator:
        runs += [dict(estimator="ggn-mc", samples=3, seed=4),
                 dict(estimator="ggn-topk", top_classes=2, samples=3, seed=5)]

    def every():
        return [[_hd(model, b, chunk_size=2, shift_labels=True, **r) for r in runs] for b in batches]

    fast = every()
    generic_paths, generic = _untied(lambda: (_paths(model, data, estimator="ggn"), every()))
    assert generic_paths["emb"] == "generic"  # the comparison really is with the generic path
    for (ids, y), f_runs, g_runs in zip(batches, fast, generic):
        want = ref(ids, _shifted(y), "nsce")
        for name, (leaf, native) in layers.items():
            assert_close(f_runs[0][name], canon(want[leaf], native))
            assert_close(g_runs[0][name], canon(want[leaf], native))
        for f, g in zip(f_runs, g_runs):
            assert set(f) == set(g) == set(layers)
            for k in f:
                assert_close(f[k], g[k])


def test_tied_head_in_float32_of_a_float64_model():
    """A float64 model whose tied head computes in float32 (float32 logits; Keras' ``reverse_dtype``):
    the signals go back through that use, and through the whole model on the generic path, in the
    logits' dtype, as the model's own VJP takes them; the fast and generic paths agree with the brute
    force to float32's precision, the diagonal in float64."""
    model, ref, layers = _tied("nnx", use="float32")
    data = (TIED_IDS, jnp.asarray(TIED_LABELS))
    assert model(TIED_IDS).dtype == jnp.float32
    fast = _hd(model, data, estimator="ggn", shift_labels=True)
    assert _paths(model, data, estimator="ggn")["emb"] == "fast"
    generic = _hd(model, data, estimator="ggn", shift_labels=True, fast=False)
    want = ref(TIED_IDS, _shifted(TIED_LABELS), "nsce")
    for name, (leaf, native) in layers.items():
        assert np.asarray(fast[name]).dtype == np.float64
        assert_close(fast[name], canon(want[leaf], native), rtol=1e-5)
        assert_close(generic[name], canon(want[leaf], native), rtol=1e-5)


def test_tied_table_signals_in_steps(monkeypatch):
    """A table whose per-example gradients are formed a few signals at a time (a vocabulary-sized
    table takes one at a time): 2 signals per step, the last step padded, the same numbers."""
    model, _, layers = _tied("nnx")
    data = (TIED_IDS, jnp.asarray(TIED_LABELS))
    kw = dict(estimator="ggn-topk", top_classes=2, samples=3, seed=5, chunk_size=2)
    whole = _hd(model, data, **kw)
    session._TRACES.clear()
    session._CACHE.clear()
    monkeypatch.setattr(jax_ggn, "_TIED_ELEMENTS", 2 * V * D)
    try:
        stepped = _hd(model, data, **kw)
        kernels = [k for _, k in session._CACHE._data.values() if isinstance(k, jax_ggn.GGN) and k.tied]
        assert kernels and all(list(k.tied_step.values()) == [2] and (k.bp * k.cols) % 2 for k in kernels)
    finally:
        monkeypatch.undo()
        session._TRACES.clear()
        session._CACHE.clear()
    for name in layers:
        assert_close(stepped[name], whole[name])


@pytest.mark.parametrize("use, reason", [
    ("third", "used 3 times in the forward pass (gather, reduce_sum, dot_general): a tied table is fast only"),
    ("scaled", "used 2 times in the forward pass (gather, mul): a tied table is fast only"),
    ("row", "used 3 times in the forward pass (gather, add, dot_general): a tied table is fast only"),
])
def test_tied_table_used_otherwise_stays_generic_and_exact(use, reason):
    """A table the forward also reads another way (a third use, a fixed row added), or changes before
    the head reads it, has per-example gradients that are not the sum of a lookup's and a product's: the generic path,
    with its reason, and the brute-force numbers."""
    model, ref, layers = _tied("nnx", use=use)
    data = (TIED_IDS, jnp.asarray(TIED_LABELS))
    report = normflat.analyze(model, data, estimator="ggn", progress=False)
    details = report.layer("emb").details
    assert details["path"] == "generic" and reason in details["generic_reason"], details
    assert report.layer("mix").details["path"] == "fast"
    got = _hd(model, data, estimator="ggn")
    want = ref(TIED_IDS, TIED_LABELS, "nsce")
    for name, (leaf, native) in layers.items():
        assert_close(got[name], canon(want[leaf], native))


# ----------------------------------------------------------------------------- position tables (method §6.1)

#: Positions of the tables (longer than the sequences: the forward slices them), patch features.
P_N, P_IN = 5, 3
#: Patches (n, T, P_IN) of T = 3 positions and their labels, 3 classes.
PATCHES = jnp.asarray(np.random.default_rng(7).normal(size=(3, 3, P_IN)))
PATCH_Y = jnp.asarray([2, 0, 1])


class NnxViT(nnx.Module):
    """A ViT in small: a class token, patch embeddings plus a ``(1, N, d)`` ``nnx.Param`` table, a
    mixer and a head. ``use``: ``add`` as ViTs do (the table sliced to the tokens), ``first`` its
    leading axis indexed (``P[0]``: per example that is no mix of samples), ``twice`` also read
    once more, ``scaled`` multiplied into the activations instead of added."""

    def __init__(self, rngs, use="add"):
        self.use = use
        self.patch = nnx.Linear(P_IN, D, param_dtype=F64, rngs=rngs)
        self.cls_token = nnx.Param(0.5 * jax.random.normal(rngs.params(), (1, 1, D), F64))
        self.pos_embed = nnx.Param(0.5 * jax.random.normal(rngs.params(), (1, P_N, D), F64))
        self.mix = nnx.Linear(D, 6, param_dtype=F64, rngs=rngs)
        self.head = nnx.Linear(6, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        n, t = x.shape[0], x.shape[1] + 1
        h = jnp.concatenate([jnp.broadcast_to(self.cls_token[...], (n, 1, D)), self.patch(x)], axis=1)
        p = self.pos_embed[...]
        if self.use == "first":
            h = h + p[0, :t]
        elif self.use == "scaled":
            h = h * p[:, :t]
        else:
            h = h + p[:, :t]
        if self.use == "twice":
            h = h * jnp.tanh(p.sum())
        return self.head(jnp.tanh(self.mix(h)).mean(axis=1))


class LinenViT(nn.Module):
    """The same with a linen ``self.param('pos_embedding', ...)`` table."""

    @nn.compact
    def __call__(self, x):
        pe = self.param("pos_embedding", nn.initializers.normal(0.5), (1, P_N, D), F64)
        h = nn.Dense(D, param_dtype=F64, name="patch")(x) + pe[:, :x.shape[1]]
        return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(nn.Dense(6, param_dtype=F64, name="mix")(h)).mean(1))


class EqxViT(eqx.Module):
    """Per example: patches (T, P_IN) -> two views (T, d) of the patch embeddings, each plus the
    table's rows: the table broadcast inside the example, its gradient the sum of the two views'
    signals before the square. ``broadcast``: ``explicit`` (``jnp.broadcast_to``) or ``implicit``
    (the addition broadcasts the table's axis of 1)."""

    patch: eqx.nn.Linear
    pos_embed: jax.Array
    head: eqx.nn.Linear
    broadcast: str = eqx.field(static=True)

    def __init__(self, key, broadcast="explicit"):
        k1, k2, k3 = jax.random.split(key, 3)
        self.patch = eqx.nn.Linear(P_IN, D, key=k1, dtype=F64)
        self.pos_embed = 0.5 * jax.random.normal(k2, (1, P_N, D), F64)
        self.head = eqx.nn.Linear(D, 3, key=k3, dtype=F64)
        self.broadcast = broadcast

    def __call__(self, x):
        h = jax.vmap(self.patch)(x)
        views = jnp.stack([h, jnp.tanh(h)])  # (2, T, d)
        t = x.shape[0]
        if self.broadcast == "explicit":
            views = views + jnp.broadcast_to(self.pos_embed[0, :t], views.shape)
        else:
            views = views + self.pos_embed[:, :t]
        return self.head(jnp.tanh(views).mean(axis=(0, 1)))


def _vit(kind, **kw):
    """``(model, brute-force reference function, table name, its native leaf)``."""
    if kind == "nnx":
        model = NnxViT(nnx.Rngs(5), **kw)
        return model, lambda x, y, loss: ref_ggn(model, x, y, loss), "pos_embed"
    if kind == "linen":
        module = LinenViT()
        variables = module.init(jax.random.key(6), PATCHES)
        return (module, variables), lambda x, y, loss: ref_ggn(module, x, y, loss, variables), "pos_embedding"
    model = EqxViT(jax.random.key(7), **kw)
    return model, lambda x, y, loss: ref_ggn(model, x, y, loss), "pos_embed"


def _table(a):
    """A ``(1, N, d)`` table as its canonical ``(features, positions)`` matrix (method §3)."""
    a = np.asarray(a)
    return a.reshape(-1, a.shape[-1]).T


@pytest.mark.parametrize("kind, kw, every_estimator", [
    ("nnx", {}, True), ("equinox", {"broadcast": "explicit"}, True), ("nnx", {"use": "first"}, False),
    ("linen", {}, False), ("equinox", {"broadcast": "implicit"}, False)],
    ids=["nnx", "equinox-broadcast", "nnx-first", "linen", "equinox-implicit"])
def test_position_table_fast_equals_generic_and_brute_force(monkeypatch, kind, kw, every_estimator):
    """The added table's fast rule (method §6.1 "Position tables"): ``ggn`` against brute force and
    the generic path; with ``every_estimator`` also ``ggn-mc`` and ``ggn-topk`` against the generic
    path (the same draws), and on two batches: 3 in pieces of 2 (the last one padded) and 2 (one
    piece, the same compiled step). The other model forms: ``ggn`` on the first batch."""
    model, ref, name = _vit(kind, **kw)
    report = normflat.analyze(model, (PATCHES, PATCH_Y), estimator="ggn", progress=False)
    table = report.layer(name)
    assert table.shape == (D, P_N) and table.details["path"] == "fast", table.details
    batches = [(PATCHES[:n], PATCH_Y[:n]) for n in ((3, 2) if every_estimator else (3,))]
    runs = [dict(estimator="ggn")]
    if every_estimator:
        runs += [dict(estimator="ggn-mc", samples=3, seed=4), dict(estimator="ggn-topk", top_classes=1, samples=3,
                                                                    seed=5)]

    def every():
        return [[_hd(model, data, chunk_size=2, **r) for r in runs] for data in batches]

    fast = every()
    generic = _generic(monkeypatch, every)
    for data, f_runs, g_runs in zip(batches, fast, generic):
        want = _table(ref(*data, "nsce")[name])
        assert_close(f_runs[0][name], want)
        assert_close(g_runs[0][name], want)
        assert np.all(want[:, PATCHES.shape[1] + (kind == "nnx"):] == 0)  # rows past the tokens: never read
        for f, g in zip(f_runs, g_runs):
            assert set(f) == set(g)
            for k in f:
                assert_close(f[k], g[k])


@pytest.mark.parametrize("use, reason", [
    ("twice", "also used outside its addition to the activations"),
    ("scaled", "its use in the forward pass (mul) has no fast rule"),
])
def test_position_table_used_otherwise_stays_generic_and_exact(use, reason):
    """A table the forward also reads elsewhere, or multiplies into the activations, has per-example
    gradients that are not the signal at one addition: the generic path, with its reason, and the
    brute-force numbers."""
    model, ref, name = _vit("nnx", use=use)
    report = normflat.analyze(model, (PATCHES, PATCH_Y), estimator="ggn", progress=False)
    details = report.layer(name).details
    assert details["path"] == "generic" and reason in details["generic_reason"], details
    assert report.layer("mix").details["path"] == "fast" and "generic_reason" not in report.layer("mix").details
    got = _hd(model, (PATCHES, PATCH_Y), estimator="ggn")
    full = ref(PATCHES, PATCH_Y, "nsce")
    assert_close(got[name], _table(full[name]))
    assert_close(got["mix"], canon(full["mix/kernel"], "flax"))


class EqxPrior(eqx.Module):
    """Logits that are a row of a learned table, whatever the input (class priors): the table
    reaches the program's output through a slice only, so its one use is the output."""

    patch: eqx.nn.Linear
    pos_embed: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.patch = eqx.nn.Linear(P_IN, 3, key=k1, dtype=F64)
        self.pos_embed = 0.5 * jax.random.normal(k2, (1, P_N, 3), F64)

    def __call__(self, x):
        return self.pos_embed[0, 1]


def test_table_returned_as_the_logits_is_generic_with_its_reason_and_exact():
    """The reason names the output (not "not used"), found through the slice, and the generic
    path's diagonal is the brute force: every sample's softmax Hessian diagonal on the row read."""
    model = EqxPrior(jax.random.key(8))
    report = normflat.analyze(model, (PATCHES, PATCH_Y), estimator="ggn", progress=False)
    details = report.layer("pos_embed").details
    assert details["path"] == "generic", details
    assert details["generic_reason"] == "its use in the forward pass (the output) has no fast rule", details
    patch = report.layer("patch").details  # used by no operation: zero, no path (method §6.1)
    assert "generic_reason" not in patch and "its curvature is zero" in patch["unused"], patch
    got = _hd(model, (PATCHES, PATCH_Y), loss="ce", estimator="ggn")
    assert_close(got["pos_embed"], _table(ref_ggn(model, PATCHES, PATCH_Y, "ce")["pos_embed"]))
    p = jax.nn.softmax(model.pos_embed[0, 1])
    assert_close(got["pos_embed"][:, 1], np.asarray(p * (1 - p)))  # the row read; the others 0
