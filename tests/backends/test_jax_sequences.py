"""JAX backend: per-sequence signals of token logits (method §6.3, "Signals per sequence").

``ggn-mc`` and ``ggn-topk`` back-propagate one signal per sequence, the tokens' signals
summed with independent random signs. Every group estimate is checked in float64
against a brute force that shares nothing with the backend but the engine's signals:
the full per-sequence Jacobians of the logits with respect to every parameter leaf
(``jax.jacrev``) contracted with :func:`normflat.engine.losses.token_signals` computed
in numpy from the same uniforms (:func:`normflat.engine.random.sample_uniforms`),
squared, summed over each group's signals and sequences and divided by the counted
tokens. A dense head whose output is the logits stays exact under ``ggn-topk`` (the
brute force of the exact ``ggn`` in every group). The models have ignored tokens, an
embedding lookup, a convolution over the tokens and self-attention (every fast tap of
the traced program), or a head tied to the embedding (one table, two taps whose
per-example gradients are summed before the square, method §6.1 "Tied weights"), and
are fed in two batches with a padded piece.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.builders import require_frameworks, stored_groups

require_frameworks("jax", "flax", "equinox")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normflat  # noqa: E402
from normflat.backends import jax as jax_backend  # noqa: E402
from normflat.backends.jax import ggn as jax_ggn  # noqa: E402
from normflat.backends.jax import session  # noqa: E402
from normflat.backends.jax.ggn import GGN  # noqa: E402
from normflat.engine import losses, validate_options  # noqa: E402
from normflat.engine.random import sample_uniforms  # noqa: E402
from tests.arch.test_jax_layers import NnxLM, attention64, canon, pure  # noqa: E402

jax.config.update("jax_enable_x64", True)

F64 = jnp.float64
V, D, T, C = 7, 4, 4, 5
RNG = np.random.default_rng(21)
IDS = jnp.asarray(RNG.integers(0, V, size=(3, T)))
#: Token labels with ignored tokens (ignore_index -100), one sequence with two.
LABELS = np.asarray([[0, -100, 4, 2], [3, 1, -100, -100], [2, 2, 0, 1]])
TOL = 1e-10


class NnxTokens(nnx.Module):
    """Embed -> a convolution over the tokens -> self-attention -> a dense head: logits (n, T, C)."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, param_dtype=F64, rngs=rngs)
        self.conv = nnx.Conv(D, D, kernel_size=(2,), padding="SAME", param_dtype=F64, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, D, qkv_features=D, decode=False, param_dtype=F64, rngs=rngs,
                                           attention_fn=attention64)
        self.head = nnx.Linear(D, C, param_dtype=F64, rngs=rngs)

    def __call__(self, ids):
        h = self.emb(ids)
        h = jnp.tanh(h + self.conv(h))
        return self.head(jnp.tanh(h + self.attn(h)))


class EqxTokens(eqx.Module):
    """Per sequence: ids (T,) -> a vmapped ``Embedding`` -> a causal mix of the tokens -> a vmapped dense
    head (``weight @ x`` batched over the tokens: the weight is the left operand of the product and
    the logits are its transpose)."""

    emb: eqx.nn.Embedding
    mix: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.emb = eqx.nn.Embedding(V, D, key=k1, dtype=F64)
        self.mix = eqx.nn.Linear(D, D, key=k2, dtype=F64)
        self.head = eqx.nn.Linear(D, C, key=k3, dtype=F64)

    def __call__(self, ids):
        h = jax.vmap(self.emb)(ids)
        h = jnp.tanh(h + jax.vmap(self.mix)(jnp.cumsum(h, axis=0)))
        return jax.vmap(self.head)(h)


def _attention_layers():
    out = {f"attn/{p}": (f"attn/{p}/kernel", "qkv") for p in ("query", "key", "value")}
    out["attn/out"] = ("attn/out/kernel", "attn_out")
    return out


#: {report name: (leaf name, canonical kind)} of the models, and the dense head (None: tied).
MODELS = {
    "tokens": (lambda: NnxTokens(nnx.Rngs(3)), {"emb": ("emb/embedding", "flax"), "conv": ("conv/kernel", "conv"),
                                                **_attention_layers(), "head": ("head/kernel", "flax")}, "head"),
    "tied": (lambda: NnxLM(nnx.Rngs(4), vocab=V, d=D), {"emb": ("emb/embedding", "flax"), **_attention_layers()},
             None),
    "eqx": (lambda: EqxTokens(jax.random.key(5)), {"emb": ("emb/weight", "flax"), "mix": ("mix/weight", "eqx"),
                                                   "head": ("head/weight", "eqx")}, "head"),
}


def _canon(a, kind):
    if kind == "conv":  # nnx (k, in, out) -> (out, in, k)
        return np.asarray(a).transpose(2, 1, 0)
    return canon(a, kind)


def _data():
    """The sequences in two batches (2 + 1), so that the second piece of chunk_size=2 is padded."""
    y = jnp.asarray(LABELS)
    return [(IDS[:2], y[:2]), (IDS[2:], y[2:])]


def _options(**kw):
    return validate_options(progress=False, **kw)


@functools.lru_cache(maxsize=None)
def _jacobians(name):
    """``(leaf names, logits (n, T, C), {leaf: (n, T·C, entries)})``: full per-sequence Jacobians of a model
    of :data:`MODELS` (built from fixed seeds, so one computation serves every test)."""
    names, leaves, apply = pure(MODELS[name][0]())
    z = np.asarray(apply(leaves, IDS))
    # the Jacobian of the batch's logits: sequence n's (T, C) logits depend on its own ids only, so its
    # rows of sequence n are J_n
    jac = jax.jit(jax.jacrev(lambda ls: apply(ls, IDS)))(leaves)
    n, t, c = z.shape
    return z, {leaf: (np.asarray(j).reshape(n, t * c, -1), np.shape(j)[3:]) for leaf, j in zip(names, jac)}


def reference_groups(name, options) -> dict[str, np.ndarray]:
    """``{leaf: (K', *native shape)}``: the brute-force group sums over all sequences / counted tokens.

    ``Σ_{m, n} (J_nᵀ σ_{g, m, n})²`` with ``J_n`` the full Jacobian of sequence ``n``'s
    logits ``(T, C)`` and ``σ`` the engine's :func:`~normflat.engine.losses.token_signals`
    (per sequence or per token, as ``options`` say) from the analysis' uniforms.
    """
    z, jac = _jacobians(name)
    counted = (LABELS >= 0).astype(np.float64)
    n, t, c = z.shape
    u = sample_uniforms(options.seed, 0, 0, n, options.uniform_columns(t)) if options.draws else None
    sig = losses.token_signals(np, z, options, counted, u)  # (K', M', n, T, C)
    sig = sig.reshape(sig.shape[:3] + (t * c,))
    out = {}
    for leaf, (j, shape) in jac.items():
        grads = np.einsum("gmna,nap->gmnp", sig, j)
        out[leaf] = (grads**2).sum(axis=(1, 2)).reshape((sig.shape[0],) + shape) / counted.sum()
    return out


def reference_estimates(name, options) -> dict[str, np.ndarray]:
    """``{report name: (K, *canonical)}`` group estimates: ``sums_0 + sums_g`` (ggn-topk) or ``sums_g``.

    ``ggn-topk``'s dense head is exact: the brute force of the exact ``ggn`` in every group.
    """
    _, layers, head = MODELS[name]
    sums = reference_groups(name, options)
    exact = reference_groups(name, _options(loss=options.loss, estimator="ggn")) if head else {}
    out = {}
    for layer, (leaf, kind) in layers.items():
        if layer == head and options.estimator == "ggn-topk":
            groups = np.repeat(exact[leaf], options.groups, axis=0)
        elif options.shared_group:
            groups = sums[leaf][1:] + sums[leaf][:1]
        else:
            groups = sums[leaf]
        out[layer] = np.stack([_canon(g, kind) for g in groups])
    return out


def _assert_close(got, want):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * np.abs(want).max())


CASES = [
    ("tokens", dict(loss="nsce", estimator="ggn-topk", top_classes=2, samples=3, seed=5)),
    ("tokens", dict(loss="ce", estimator="ggn-mc", samples=4, seed=6)),
    ("tied", dict(loss="ce", estimator="ggn-topk", top_classes=1, samples=2, seed=7)),
    ("tied", dict(loss="nsce", estimator="ggn-mc", samples=3, seed=8)),
    ("eqx", dict(loss="ce", estimator="ggn-topk", top_classes=1, samples=3, seed=9)),
    ("eqx", dict(loss="nsce", estimator="ggn-topk", top_classes=2, samples=2, seed=10)),
]


@pytest.fixture
def signal_forms(monkeypatch):
    """Fresh kernel caches (so that the kernels are traced here) and the calls, while tracing, of the
    engine functions that form per-sequence signals: ``{"dense": ..., "structured": ...}``
    (:func:`~normflat.engine.losses.token_signals` / ``sequence_dense`` at the logits, or
    :func:`~normflat.engine.losses.sequence_factor` pulled through the head)."""
    from normflat.backends.jax.cache import LRU

    calls = {"dense": [], "structured": []}
    for name, form in (("token_signals", "dense"), ("sequence_dense", "dense"), ("sequence_factor", "structured")):
        def spy(*args, _f=getattr(jax_ggn, name), _form=form, **kwargs):
            calls[_form].append(1)
            return _f(*args, **kwargs)
        monkeypatch.setattr(jax_ggn, name, spy)
    monkeypatch.setattr(session, "_CACHE", LRU(8))
    session._TRACES.clear()
    return calls


@pytest.mark.parametrize("name, kw", CASES, ids=[f"{m}-{k['estimator']}-{k['loss']}" for m, k in CASES])
def test_sequence_signals_equal_the_brute_force(name, kw, signal_forms):
    make, layers, head = MODELS[name]
    model = make()
    options = _options(**kw)
    assert options.per_sequence
    want = reference_estimates(name, options)
    problems, meta = jax_backend.layer_problems(model, _data(), options, chunk_size=2)
    assert meta["sequence_signals"] is True and meta["loss_terms"] == int((LABELS >= 0).sum())
    got = {p.name: p.hessian_diag_samples for p in problems}
    assert set(got) == set(layers)
    for layer, w in want.items():
        _assert_close(got[layer], stored_groups(w, got[layer].shape))  # a convolution's: kernel sums
    # every layer took a fast tap of the traced program (lookup, conv patches, dense squares, the head,
    # the tied table's two taps)
    assert {p.name: p.details["path"] for p in problems} == {layer: "fast" for layer in layers}
    diag = normflat.hessian_diagonal(model, _data(), progress=False, chunk_size=2, **kw)
    for layer, w in want.items():
        _assert_close(diag[layer], w.mean(axis=0))
    # Under ggn-topk with a dense head on the logits the other layers' signals start at the head's
    # input (O(d) per signal and token, method §6.3): no signal is formed at the logits.
    structured = head is not None and options.estimator == "ggn-topk"
    assert bool(signal_forms["structured"]) == structured and bool(signal_forms["dense"]) != structured


def test_per_token_and_per_sequence_signals_on_one_model():
    """``sequence_signals=False`` keeps one square per (token, signal) pair (the per-token brute force);
    the same model and program, per sequence, gets other numbers (another compiled kernel)."""
    name, kw = CASES[0]
    model = MODELS[name][0]()
    per_token = _options(sequence_signals=False, **kw)
    problems, meta = jax_backend.layer_problems(model, _data(), per_token, chunk_size=2)
    assert meta["sequence_signals"] is False
    want = reference_estimates(name, per_token)
    for p in problems:
        _assert_close(p.hessian_diag_samples, stored_groups(want[p.name], p.hessian_diag_samples.shape))
    per_sequence = _options(**kw)
    problems, meta = jax_backend.layer_problems(model, _data(), per_sequence, chunk_size=2)
    assert meta["sequence_signals"] is True
    want_seq = reference_estimates(name, per_sequence)
    for p in problems:
        _assert_close(p.hessian_diag_samples, stored_groups(want_seq[p.name], p.hessian_diag_samples.shape))
    assert np.abs(want_seq["emb"] - want["emb"]).max() > 1e-6  # the two really differ


def test_sequence_signals_metadata():
    model = nnx.Linear(3, C, param_dtype=F64, rngs=nnx.Rngs(0))  # a dense layer over tokens: token logits
    data = (jnp.asarray(RNG.normal(size=(2, T, 3))), jnp.asarray(LABELS[:2]))

    def meta(**kw):
        return normflat.analyze(model, data, progress=False, loss="ce", **kw).metadata

    assert meta(estimator="ggn-mc", samples=2)["sequence_signals"] is True
    assert meta(estimator="ggn-mc", samples=2, sequence_signals=False)["sequence_signals"] is False
    assert meta(estimator="ggn")["sequence_signals"] is False  # exact, per token
    # (n, C) logits: no tokens
    x, y = jnp.asarray(RNG.normal(size=(4, 3))), jnp.asarray([0, 1, 2, 3])
    assert normflat.analyze(model, (x, y), progress=False, estimator="ggn-topk",
                            samples=2).metadata["sequence_signals"] is None


def test_auto_counts_signals_per_sequence():
    """``auto`` takes ggn-topk for 10 classes over 32 tokens (288 exact signals per sequence against
    K(k + ⌈S/K⌉) = 20 signed ones; without the tokens, 10 classes take the exact ggn)."""
    model = nnx.Linear(3, 10, param_dtype=F64, rngs=nnx.Rngs(1))
    x = jnp.asarray(RNG.normal(size=(2, 32, 3)))
    y = jnp.asarray(RNG.integers(0, 10, size=(2, 32)))
    meta = normflat.analyze(model, (x, y), progress=False, loss="ce").metadata
    assert meta["estimator"] == "ggn-topk" and meta["sequence_signals"] is True
    # the cost: 20 back-propagated signals per sequence (the zero group 0 is not back-propagated)
    kernels = [k for _, k in session._CACHE._data.values() if isinstance(k, GGN) and k.tokens == 32]
    assert kernels and all(k.bp * k.cols == 20 for k in kernels)


class EqxMixed(EqxTokens):
    """:class:`EqxTokens`' layers in another order: ids (T,) -> a vmapped ``Embedding`` -> a linear
    causal mix of the tokens -> a vmapped dense layer and ``tanh`` -> a vmapped dense head."""

    def __call__(self, ids):
        h = jnp.cumsum(jax.vmap(self.emb)(ids), axis=0)
        return jax.vmap(self.head)(jnp.tanh(jax.vmap(self.mix)(h)))


def test_embedding_feature_rescaling_with_the_head_on_token_logits():
    """Per-sequence ggn-topk with a dense head on the token logits (its squares from the token rows,
    the other layers' signals from its input, method §6.3): an embedding feature scaled by c and
    the next layer's input column by 1/c keep the function, every layer's normalized sharpness and
    the total; the trace moves."""
    model = EqxMixed(jax.random.key(12))
    c = jnp.asarray(np.random.default_rng(13).uniform(0.3, 3.3, size=D))
    moved = eqx.tree_at(lambda m: (m.emb.weight, m.mix.weight), model,
                        (model.emb.weight * c[None, :], model.mix.weight / c[None, :]))
    np.testing.assert_allclose(jax.vmap(moved)(IDS), jax.vmap(model)(IDS), rtol=1e-12, atol=1e-12)
    kw = dict(loss="ce", estimator="ggn-topk", top_classes=1, samples=3, seed=14, progress=False)
    r0, r1 = (normflat.analyze(m, _data(), chunk_size=2, **kw) for m in (model, moved))
    assert r0.metadata["sequence_signals"] is True
    assert [layer.name for layer in r0.layers] == [layer.name for layer in r1.layers] == ["emb", "mix", "head"]
    for l0, l1 in zip(r0.layers, r1.layers):
        np.testing.assert_allclose(l1.normalized_sharpness, l0.normalized_sharpness, rtol=1e-8, err_msg=l0.name)
    np.testing.assert_allclose(r1.normalized_sharpness, r0.normalized_sharpness, rtol=1e-8)
    assert abs(r1.hessian_trace / r0.hessian_trace - 1) > 1e-3
