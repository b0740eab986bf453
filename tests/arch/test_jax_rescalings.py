"""Function-preserving rescalings of the JAX layer kinds that have none elsewhere (method §8).

Every layer kind normflat reads gets its own function-preserving rescaling: a tiny float64
model holding the kind, a copy whose weights are rescaled so that the function provably does
not change (checked to ~1e-12), and then every layer's normalized sharpness and the total must
stay (1e-8 relative) while the rescaled layers' Hessian traces move (method §8, "Invariance
guarantees"; the canonical layouts that make each rescaling a row or column scaling are those
of method §3). The kinds already covered elsewhere are not repeated here: equinox ``Linear`` and
``Conv``, flax nnx ``Linear`` and ``Conv``, linen ``Dense`` and ``Conv`` (plain, grouped through
``feature_group_count`` and depthwise) in ``tests/test_invariance.py``, with nnx's loose position
table; nnx ``MultiHeadAttention`` (through ``LinearGeneral``), equinox ``MultiheadAttention`` and
``Embedding``, nnx's tied ``Embed``, nnx's ReLU ``SimpleCell``, nnx layers called several times
and flax's ``WeightNorm`` in ``tests/arch/test_jax_layers.py``. This file covers: multi-axis
kernels with a factor per feature (nnx ``LinearGeneral`` and ``Einsum``, linen ``DenseGeneral`` and
``Einsum``), linen ``MultiHeadDotProductAttention``, linen ``Embed`` and equinox ``Embedding`` tied to
the head, the input weights of every recurrent cell (nnx ``LSTMCell``, ``OptimizedLSTMCell``,
``GRUCell``; linen ``LSTMCell``, ``OptimizedLSTMCell``, ``GRUCell``, ``SimpleCell``; equinox
``LSTMCell``, ``GRUCell``) against an embedding's features, linen's ReLU ``SimpleCell`` hidden units,
linen and equinox loose position tables, the ``kernel`` leaves of an ``(apply_fn, params)`` model
(a multi-axis one among them), equinox's ``WeightNorm``, the spectrally normalized kernels of flax nnx,
linen and equinox (whole-kernel scalings, and their ``ggn`` diagonals against brute force), and the
transposed convolutions of flax nnx, linen and equinox (input and output channels, equinox's grouped).
Every layer takes its fast rule unless a test names it generic.
"""

from __future__ import annotations

import functools

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
from tests._invariance import assert_reports_invariant  # noqa: E402

jax.config.update("jax_enable_x64", True)

F64 = jnp.float64
V, D, H, T = 7, 3, 4, 3  # vocabulary, features, hidden units, tokens


def _factors(seed, *shape):
    """Distinct positive factors between e^-1.5 and e^1.5 (float64)."""
    return jnp.asarray(np.exp(np.random.default_rng(seed).uniform(-1.5, 1.5, size=shape)))


def _normal(seed, *shape, scale=0.5):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale)


def assert_rescaling_invariant(model, twin, data, apply, twin_apply, moved, generic=(), **kw):
    """``twin`` is ``model`` rescaled: the same function (to ~1e-12), every layer's normalized sharpness
    and the total the same (1e-8 relative), the Hessian trace of every layer in ``moved`` changed by
    more than 1e-3 relative (method §8).

    Args:
        apply, twin_apply: The two models' logits for ``data[0]``.
        moved: Names of the layers whose trace must move.
        generic: The layers expected on the generic path (names, or a predicate on the name);
            every other layer must take its fast rule (``layer.details["path"]``), in both analyses.

    Returns:
        The two reports.
    """
    np.testing.assert_allclose(np.asarray(twin_apply(data[0])), np.asarray(apply(data[0])), rtol=1e-12,
                               atol=1e-13)
    kw = {"loss": "ce", "estimator": "ggn", **kw}
    before = normflat.analyze(model, data, progress=False, **kw)
    after = normflat.analyze(twin, data, progress=False, **kw)
    assert_reports_invariant(before, after, moved, generic)
    return before, after


def _linen(module, x, seed):
    """``(module, variables)`` with every parameter drawn at random (biases away from zero)."""
    variables = module.init(jax.random.key(seed), x)
    leaves, treedef = jax.tree_util.tree_flatten(variables["params"])
    leaves = [_normal(seed + 100 + i, *np.shape(a)) for i, a in enumerate(leaves)]
    return module, {"params": jax.tree_util.tree_unflatten(treedef, leaves)}


def _edit(params, path, fn):
    """A copy of the nested mapping ``params`` with the leaf at ``path`` (``"a/b/kernel"``) replaced by
    ``fn(leaf)``."""
    head, _, rest = path.partition("/")
    out = dict(params)
    out[head] = fn(params[head]) if not rest else _edit(params[head], rest, fn)
    return out


# ----------------------------------------------------------------------------- multi-axis kernels


class NnxMultiAxis(nnx.Module):
    """``x (n, 4)`` -> ``LinearGeneral`` to ``(2, 3)`` (relu) -> ``LinearGeneral`` contracting both axes
    to ``(2, 2)`` (relu) -> ``Einsum`` contracting both -> logits ``(n, 3)``."""

    def __init__(self, rngs):
        self.pre = nnx.LinearGeneral(4, (2, 3), param_dtype=F64, rngs=rngs)
        self.gen = nnx.LinearGeneral((2, 3), (2, 2), axis=(-2, -1), param_dtype=F64, rngs=rngs)
        self.ein = nnx.Einsum("nab,abc->nc", (2, 2, 3), param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.ein(jax.nn.relu(self.gen(jax.nn.relu(self.pre(x)))))


class LinenMultiAxis(nn.Module):
    """The same with linen's ``DenseGeneral`` and ``Einsum``."""

    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(nn.DenseGeneral((2, 3), param_dtype=F64, name="pre")(x))
        h = jax.nn.relu(nn.DenseGeneral((2, 2), axis=(-2, -1), param_dtype=F64, name="gen")(h))
        return nn.Einsum((2, 2, 3), "nab,abc->nc", param_dtype=F64, name="ein")(h)


MULTI_X = _normal(1, 5, 4, scale=1.0)
MULTI_Y = jnp.asarray([0, 1, 2, 1, 0])


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_multi_axis_kernels_per_feature_rescaling(api):
    """Multi-axis kernels (nnx ``LinearGeneral`` / ``Einsum``, linen ``DenseGeneral`` / ``Einsum``), a
    factor per feature: output feature ``(a, b)`` of ``pre`` (kernel ``(4, 2, 3)`` entry ``[:, a, b]``,
    bias) times ``g_ab`` and ``gen``'s input feature ``(a, b)`` (kernel ``(2, 3, 2, 2)`` entry
    ``[a, b]``) over it; ``gen``'s output feature ``(c, d)`` times ``f_cd`` and ``ein``'s input feature
    ``(c, d)`` (kernel ``(2, 2, 3)`` entry ``[c, d]``) over it, through relus. Rows and columns of the
    flattened ``(∏ out, ∏ in)`` matrices (method §3 "Multi-axis kernels"), absorbed (§8 item 2)."""
    g, f = _factors(2, 2, 3), _factors(3, 2, 2)
    if api == "nnx":
        model = NnxMultiAxis(nnx.Rngs(1))
        for i, (_, p) in enumerate(nnx.iter_graph(model)):
            if isinstance(p, nnx.Param):
                p[...] = _normal(10 + i, *p[...].shape)
        twin = nnx.clone(model)
        twin.pre.kernel[...] = twin.pre.kernel[...] * g
        twin.pre.bias[...] = twin.pre.bias[...] * g
        twin.gen.kernel[...] = twin.gen.kernel[...] / g[:, :, None, None] * f
        twin.gen.bias[...] = twin.gen.bias[...] * f
        twin.ein.kernel[...] = twin.ein.kernel[...] / f[:, :, None]
        apply, twin_apply = model, twin
    else:
        module, variables = _linen(LinenMultiAxis(), MULTI_X, 4)
        p = variables["params"]
        p = _edit(p, "pre/kernel", lambda k: k * g)
        p = _edit(p, "pre/bias", lambda b: b * g)
        p = _edit(p, "gen/kernel", lambda k: k / g[:, :, None, None] * f)
        p = _edit(p, "gen/bias", lambda b: b * f)
        p = _edit(p, "ein/kernel", lambda k: k / f[:, :, None])
        model, twin = (module, variables), (module, {"params": p})
        apply = lambda x: module.apply(variables, x)  # noqa: E731
        twin_apply = lambda x: module.apply(twin[1], x)  # noqa: E731
    before, _ = assert_rescaling_invariant(model, twin, (MULTI_X, MULTI_Y), apply, twin_apply,
                                           moved=("pre", "gen", "ein"))
    assert [before.layer(n).shape for n in ("pre", "gen", "ein")] == [(6, 4), (4, 6), (3, 4)]


class LinenAttention(nn.Module):
    """``MultiHeadDotProductAttention`` (2 heads of 2) over a sequence, mean-pooled classifier."""

    @nn.compact
    def __call__(self, x):
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4, param_dtype=F64, name="attn")(x)
        return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h).mean(axis=1))


def test_linen_attention_per_head_rescalings():
    """linen ``MultiHeadDotProductAttention`` (``DenseGeneral`` projections): head ``h``'s query rows
    (kernel ``(d, H, hd)`` entry ``[:, h]``, bias) times ``c_h`` and its key rows over ``c_h``; its value
    rows times ``d_h`` and the output projection's columns (kernel ``(H, hd, d)`` entry ``[h]``) over
    ``d_h`` (method §3 "Multi-axis kernels", §8 item 5)."""
    x, y = _normal(5, 3, 3, 4, scale=1.0), jnp.asarray([0, 2, 1])
    module, variables = _linen(LinenAttention(), x, 5)
    c, d = jnp.asarray([3.0, 0.25]), jnp.asarray([0.5, 4.0])
    p = variables["params"]
    for proj, s in (("query", c), ("key", 1 / c), ("value", d)):
        p = _edit(p, f"attn/{proj}/kernel", lambda k, s=s: k * s[None, :, None])
        p = _edit(p, f"attn/{proj}/bias", lambda b, s=s: b * s[:, None])
    p = _edit(p, "attn/out/kernel", lambda k: k / d[:, None, None])
    twin = {"params": p}
    names = ("attn/query", "attn/key", "attn/value", "attn/out")
    assert_rescaling_invariant((module, variables), (module, twin), (x, y), lambda a: module.apply(variables, a),
                               lambda a: module.apply(twin, a), moved=names)


# ----------------------------------------------------------------------------- embeddings tied to the head


class LinenTied(nn.Module):
    """linen ``Embed`` (the lookup and, through ``attend``, the head), a tanh ``Dense`` and a linear one."""

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(V, D, param_dtype=F64, name="emb")
        h = jnp.tanh(nn.Dense(5, param_dtype=F64, name="mix_in")(emb(ids)))
        return emb.attend(nn.Dense(D, param_dtype=F64, name="mix_out")(h))


class EqxTied(eqx.Module):
    """Per example: equinox ``Embedding``, a tanh ``Linear``, a linear one and ``h @ table.T``."""

    emb: eqx.nn.Embedding
    mix_in: eqx.nn.Linear
    mix_out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.emb = eqx.nn.Embedding(V, D, key=k1, dtype=F64)
        self.mix_in = eqx.nn.Linear(D, 5, key=k2, dtype=F64)
        self.mix_out = eqx.nn.Linear(5, D, key=k3, dtype=F64)

    def __call__(self, ids):
        h = jnp.tanh(jax.vmap(self.mix_in)(jax.vmap(self.emb)(ids)))
        return jax.vmap(self.mix_out)(h) @ self.emb.weight.T


TIED_IDS = jnp.asarray([[1, 3, 1], [2, 6, 0], [5, 1, 4]])
TIED_Y = jnp.asarray([[3, 0, 6], [1, 4, 2], [0, 5, 5]])


@pytest.mark.parametrize("api", ["linen", "equinox"])
def test_tied_embedding_feature_rescaling_against_both_uses(api):
    """A table that is the lookup and the LM head (linen ``Embed.attend``, equinox ``h @ weight.T``):
    feature ``j`` times ``c_j`` (row ``j`` of the canonical ``(features, vocabulary)`` matrix), the next
    layer's input ``j`` and the previous layer's output ``j`` (and bias) over ``c_j`` (method §8 item 6);
    the table on its tied fast rule."""
    c = _factors(6, D)
    if api == "linen":
        module, variables = _linen(LinenTied(), TIED_IDS, 6)
        p = variables["params"]
        p = _edit(p, "emb/embedding", lambda e: e * c)
        p = _edit(p, "mix_in/kernel", lambda k: k / c[:, None])
        p = _edit(p, "mix_out/kernel", lambda k: k / c)
        p = _edit(p, "mix_out/bias", lambda b: b / c)
        model, twin = (module, variables), (module, {"params": p})
        apply = lambda a: module.apply(variables, a)  # noqa: E731
        twin_apply = lambda a: module.apply(twin[1], a)  # noqa: E731
    else:
        model = EqxTied(jax.random.key(6))
        model = eqx.tree_at(lambda m: m.mix_out.bias, model, _normal(7, D))
        twin = eqx.tree_at(lambda m: (m.emb.weight, m.mix_in.weight, m.mix_out.weight, m.mix_out.bias), model,
                           (model.emb.weight * c, model.mix_in.weight / c, model.mix_out.weight / c[:, None],
                            model.mix_out.bias / c))
        apply, twin_apply = jax.vmap(model), jax.vmap(twin)
    assert_rescaling_invariant(model, twin, (TIED_IDS, TIED_Y), apply, twin_apply, moved=("emb", "mix_in", "mix_out"))


# ----------------------------------------------------------------------------- recurrent cells


def _carry(cell, n):
    """A float64 zero carry of an nnx cell (nnx's initialize_carry draws a float32 one)."""
    z = jnp.zeros((n, H), F64)
    return (z, z) if isinstance(cell, (nnx.LSTMCell, nnx.OptimizedLSTMCell)) else z


class NnxRecurrent(nnx.Module):
    """Ids -> ``Embed`` -> one ``RNN`` per cell kind, side by side -> their last steps -> head."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, param_dtype=F64, rngs=rngs)
        self.lstm = nnx.RNN(nnx.LSTMCell(D, H, dtype=F64, param_dtype=F64, rngs=rngs))
        self.optimized = nnx.RNN(nnx.OptimizedLSTMCell(D, H, dtype=F64, param_dtype=F64, rngs=rngs))
        self.gru = nnx.RNN(nnx.GRUCell(D, H, dtype=F64, param_dtype=F64, rngs=rngs))
        self.head = nnx.Linear(3 * H, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, ids):
        h = self.emb(ids)
        last = [rnn(h, initial_carry=_carry(rnn.cell, h.shape[0]))[:, -1] for rnn in (self.lstm, self.optimized,
                                                                                     self.gru)]
        return self.head(jnp.concatenate(last, axis=-1))


class LinenRecurrent(nn.Module):
    """The same in linen, with a ``SimpleCell`` too (each cell, made inside ``__call__``, has its
    parameters in the model's scope, under its own name)."""

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(V, D, param_dtype=F64, name="emb")(ids)
        cells = (nn.LSTMCell(H, param_dtype=F64, name="lstm"),
                 nn.OptimizedLSTMCell(H, param_dtype=F64, name="optimized"),
                 nn.GRUCell(H, param_dtype=F64, name="gru"), nn.SimpleCell(H, param_dtype=F64, name="simple"))
        last = [nn.RNN(cell)(h)[:, -1] for cell in cells]
        return nn.Dense(3, param_dtype=F64, name="head")(jnp.concatenate(last, axis=-1))


class EqxRecurrent(eqx.Module):
    """Per example: ids ``(T,)`` -> ``Embedding`` -> an ``LSTMCell`` and a ``GRUCell`` scanned over the
    tokens side by side -> head."""

    emb: eqx.nn.Embedding
    lstm: eqx.nn.LSTMCell
    gru: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.emb = eqx.nn.Embedding(V, D, key=k1, dtype=F64)
        self.lstm = eqx.nn.LSTMCell(D, H, key=k2, dtype=F64)
        self.gru = eqx.nn.GRUCell(D, H, key=k3, dtype=F64)
        self.head = eqx.nn.Linear(2 * H, 3, key=k4, dtype=F64)

    def __call__(self, ids):
        def step(carry, x):
            lstm, gru = carry
            return (self.lstm(x, lstm), self.gru(x, gru)), None

        z = jnp.zeros(H, F64)
        ((h, _), g), _ = jax.lax.scan(step, ((z, z), z), jax.vmap(self.emb)(ids))
        return self.head(jnp.concatenate([h, g]))


RNN_IDS = jnp.asarray([[1, 3, 1], [2, 6, 0], [5, 1, 4], [0, 2, 3]])
RNN_Y = jnp.asarray([0, 2, 1, 1])


def _input_kernel(path: str) -> bool:
    """Whether a flax cell's parameter path is one of its input (not hidden-state) kernels: nnx's ``ii``,
    ``if_``, ``ig``, ``io``, ``dense_i``; linen's ``ii``, ``if``, ..., ``ir``, ``iz``, ``in``, ``i``."""
    parts = path.split("/")
    return parts[-1] == "kernel" and (parts[-2] == "dense_i" or parts[-2].startswith("i"))


#: Per API, the report names of the input weights' matrices: one per gate, stored per gate (nnx and linen
#: ``LSTMCell``, linen ``OptimizedLSTMCell`` and ``GRUCell``) or packed and split (method §3).
INPUT_GATES = {
    "nnx": [f"lstm/cell/{g}" for g in ("if_", "ig", "ii", "io")]
           + [f"optimized/cell/dense_i.{g}" for g in "ifgo"] + [f"gru/cell/dense_i.{g}" for g in "rzn"],
    "linen": [f"lstm/{g}" for g in ("if", "ig", "ii", "io")] + [f"optimized/{g}" for g in ("if", "ig", "ii", "io")]
             + [f"gru/{g}" for g in ("in", "ir", "iz")] + ["simple/i"],
    "equinox": [f"lstm/weight_ih.{g}" for g in "ifgo"] + [f"gru/weight_ih.{g}" for g in "rzn"],
}


@pytest.mark.parametrize("api", ["nnx", "linen", "equinox"])
def test_recurrent_input_weights_against_embedding_features(api):
    """Feature ``j`` of the embedding times ``c_j`` and input column ``j`` of every gate's input weights of
    every cell reading it over ``c_j`` (flax: row ``j`` of each input kernel ``(in, ·)``, one per gate or
    packed; equinox: column ``j`` of ``weight_ih``): the same function, a column scaling of every gate's
    input matrix (method §3 "Packed maps are split", §8 item 7). nnx ``LSTMCell``,
    ``OptimizedLSTMCell``, ``GRUCell``; linen ``LSTMCell``, ``OptimizedLSTMCell``, ``GRUCell``,
    ``SimpleCell``; equinox ``LSTMCell``, ``GRUCell``, side by side on one embedding. The table's and
    every input gate's trace move; the table and the head on their fast rules, the cells' weights
    (used inside the scan) on the generic path."""
    c = _factors(8, D)
    if api == "nnx":
        model = NnxRecurrent(nnx.Rngs(8))
        for i, (_, p) in enumerate(nnx.iter_graph(model)):
            if isinstance(p, nnx.Param):
                p[...] = _normal(20 + i, *p[...].shape)
        twin = nnx.clone(model)
        twin.emb.embedding[...] = twin.emb.embedding[...] * c
        for path, p in nnx.iter_graph(twin):
            if isinstance(p, nnx.Param) and "cell" in path and _input_kernel("/".join(str(k) for k in path)):
                p[...] = p[...] / c[:, None]
        apply, twin_apply = model, twin
    elif api == "linen":
        module, variables = _linen(LinenRecurrent(), RNN_IDS, 8)
        p = _edit(variables["params"], "emb/embedding", lambda e: e * c)
        for path, _ in jax.tree_util.tree_flatten_with_path(variables["params"])[0]:
            name = "/".join(str(k.key) for k in path)
            if name.split("/")[0] not in ("emb", "head") and _input_kernel(name):
                p = _edit(p, name, lambda k: k / c[:, None])
        model, twin = (module, variables), (module, {"params": p})
        apply = lambda a: module.apply(variables, a)  # noqa: E731
        twin_apply = lambda a: module.apply(twin[1], a)  # noqa: E731
    else:
        model = EqxRecurrent(jax.random.key(8))
        twin = eqx.tree_at(lambda m: (m.emb.weight, m.lstm.weight_ih, m.gru.weight_ih), model,
                           (model.emb.weight * c, model.lstm.weight_ih / c, model.gru.weight_ih / c))
        apply, twin_apply = jax.vmap(model), jax.vmap(twin)
    assert_rescaling_invariant(model, twin, (RNN_IDS, RNN_Y), apply, twin_apply, moved=["emb"] + INPUT_GATES[api],
                               generic=lambda name: name not in ("emb", "head"))


class LinenSimple(nn.Module):
    """Ids -> ``Embed`` -> a ReLU ``SimpleCell`` -> the last step -> head."""

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(V, D, param_dtype=F64, name="emb")(ids)
        h = nn.RNN(nn.SimpleCell(H, activation_fn=jax.nn.relu, param_dtype=F64, name="cell"))(h)
        return nn.Dense(3, param_dtype=F64, name="head")(h[:, -1])


def test_linen_relu_simple_cell_hidden_unit_rescaling():
    """linen's ReLU ``SimpleCell``: hidden unit ``k``'s input kernel column and bias times ``c_k``, the
    hidden kernel ``W_h -> D⁻¹ W_h D`` in flax's ``(in, out)`` layout, the head's row ``k`` over ``c_k``
    (method §8 item 7); the cell's kernels (inside the scan) on the generic path."""
    module, variables = _linen(LinenSimple(), RNN_IDS, 9)
    c = _factors(9, H)
    p = variables["params"]
    p = _edit(p, "cell/i/kernel", lambda k: k * c)
    p = _edit(p, "cell/i/bias", lambda b: b * c)
    p = _edit(p, "cell/h/kernel", lambda k: k / c[:, None] * c)
    p = _edit(p, "head/kernel", lambda k: k / c[:, None])
    twin = {"params": p}
    assert_rescaling_invariant((module, variables), (module, twin), (RNN_IDS, RNN_Y),
                               lambda a: module.apply(variables, a), lambda a: module.apply(twin, a),
                               moved=("cell/i", "cell/h", "head"),
                               generic=("cell/i", "cell/h"))


# ----------------------------------------------------------------------------- loose position tables


P_IN, P_N = 5, 4
PATCHES = _normal(10, 3, 3, P_IN, scale=1.0)
PATCH_Y = jnp.asarray([2, 0, 1])


class LinenPositions(nn.Module):
    """Patches -> ``Dense`` plus a ``(1, N, d)`` ``self.param`` table -> a tanh mixer -> mean -> head."""

    @nn.compact
    def __call__(self, x):
        table = self.param("pos_embedding", nn.initializers.normal(0.5), (1, P_N, D), F64)
        h = nn.Dense(D, param_dtype=F64, name="patch")(x) + table[:, :x.shape[1]]
        return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(nn.Dense(6, param_dtype=F64, name="mix")(h)).mean(1))


class EqxPositions(eqx.Module):
    """Per example: patches ``(T, P_IN)`` -> ``Linear`` plus rows of a raw ``(1, N, d)`` array -> a tanh
    mixer -> mean -> head."""

    patch: eqx.nn.Linear
    pos_embed: jax.Array
    mix: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.patch = eqx.nn.Linear(P_IN, D, key=k1, dtype=F64)
        self.pos_embed = 0.5 * jax.random.normal(k2, (1, P_N, D), F64)
        self.mix = eqx.nn.Linear(D, 6, key=k3, dtype=F64)
        self.head = eqx.nn.Linear(6, 3, key=k4, dtype=F64)

    def __call__(self, x):
        h = jax.vmap(self.patch)(x) + self.pos_embed[0, :x.shape[0]]
        return self.head(jnp.tanh(jax.vmap(self.mix)(h)).mean(axis=0))


@pytest.mark.parametrize("api", ["linen", "equinox"])
def test_position_table_feature_rescaling(api):
    """A learned ``(1, N, d)`` position table outside every layer (linen ``self.param``, an equinox
    array), added to the patch embeddings: feature ``j`` of the patch ``Dense`` (output ``j`` and bias)
    and of the table (row ``j`` of its canonical ``(features, positions)`` matrix) times ``c_j``, the
    mixer's input ``j`` over ``c_j`` (method §3 "Position tables", §8 item 6); the table on its fast
    rule."""
    c = _factors(12, D)
    if api == "linen":
        module, variables = _linen(LinenPositions(), PATCHES, 11)
        p = variables["params"]
        p = _edit(p, "pos_embedding", lambda t: t * c)
        p = _edit(p, "patch/kernel", lambda k: k * c)
        p = _edit(p, "patch/bias", lambda b: b * c)
        p = _edit(p, "mix/kernel", lambda k: k / c[:, None])
        model, twin = (module, variables), (module, {"params": p})
        apply = lambda a: module.apply(variables, a)  # noqa: E731
        twin_apply = lambda a: module.apply(twin[1], a)  # noqa: E731
        table = "pos_embedding"
    else:
        model = EqxPositions(jax.random.key(11))
        twin = eqx.tree_at(lambda m: (m.pos_embed, m.patch.weight, m.patch.bias, m.mix.weight), model,
                           (model.pos_embed * c, model.patch.weight * c[:, None], model.patch.bias * c,
                            model.mix.weight / c))
        apply, twin_apply = jax.vmap(model), jax.vmap(twin)
        table = "pos_embed"
    assert_rescaling_invariant(model, twin, (PATCHES, PATCH_Y), apply, twin_apply, moved=(table, "patch", "mix"))


# ----------------------------------------------------------------------------- (apply_fn, params)


def _pair_apply(params, x):
    """``x (n, 4)`` -> relu dense ``(4, 5)`` -> relu multi-axis ``(5, 2, 3)`` -> dense ``(2, 3, 3)`` logits."""
    h = jax.nn.relu(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    h = jax.nn.relu(jnp.einsum("nf,fab->nab", h, params["proj"]["kernel"]))
    return jnp.einsum("nab,abc->nc", h, params["out"]["kernel"])


def test_apply_fn_params_kernel_leaves_rescaling():
    """An ``(apply_fn, params)`` model: its ``kernel`` leaves are read by flax's convention, the 3-axis
    ones as multi-axis kernels from the traced program's contractions (method §3). Output ``k`` of
    ``dense`` times ``g_k`` against ``proj``'s input ``k``; ``proj``'s output feature ``(a, b)`` times
    ``f_ab`` against ``out``'s input feature ``(a, b)``, through relus (§8 item 2)."""
    params = {"dense": {"kernel": _normal(12, 4, 5), "bias": _normal(13, 5)},
              "proj": {"kernel": _normal(14, 5, 2, 3)}, "out": {"kernel": _normal(15, 2, 3, 3)}}
    g, f = _factors(12, 5), _factors(13, 2, 3)
    twin = {"dense": {"kernel": params["dense"]["kernel"] * g, "bias": params["dense"]["bias"] * g},
            "proj": {"kernel": params["proj"]["kernel"] / g[:, None, None] * f},
            "out": {"kernel": params["out"]["kernel"] / f[:, :, None]}}
    before, _ = assert_rescaling_invariant((_pair_apply, params), (_pair_apply, twin), (MULTI_X, MULTI_Y),
                                           lambda a: _pair_apply(params, a), lambda a: _pair_apply(twin, a),
                                           moved=("dense", "proj", "out"))
    assert [before.layer(n).shape for n in ("dense", "proj", "out")] == [(5, 4), (6, 5), (3, 6)]


# ----------------------------------------------------------------------------- equinox weight normalization


class EqxWeightNorm(eqx.Module):
    """Per example: ``WeightNorm(Conv1d)`` (tanh) -> ``WeightNorm(Linear)`` (tanh) -> a plain head; the
    norms per output channel / row (equinox's default ``axis=0``)."""

    conv: eqx.nn.WeightNorm
    fc: eqx.nn.WeightNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv = eqx.nn.WeightNorm(eqx.nn.Conv1d(2, 3, 3, key=k1, dtype=F64))
        self.fc = eqx.nn.WeightNorm(eqx.nn.Linear(12, 4, key=k2, dtype=F64))
        self.head = eqx.nn.Linear(4, 3, key=k3, dtype=F64)

    def __call__(self, x):  # x (2, 6): channels first
        h = jnp.tanh(self.conv(x)).reshape(-1)
        return self.head(jnp.tanh(self.fc(h)))


def test_equinox_weight_norm_direction_row_rescaling():
    """equinox's ``WeightNorm`` (``W = g · v / ‖v‖``, the norms over every axis but the output one):
    output row / channel ``i`` of the direction ``v`` times a positive factor leaves ``W`` and the
    function as they are (a row scaling of ``v``, method §3 "Weight normalization"): every layer's
    normalized sharpness stays and the directions' traces move (§8). The directions take the generic
    path, which differentiates the normalization (each also enters the norm besides the product)."""
    model = EqxWeightNorm(jax.random.key(14))
    model = eqx.tree_at(lambda m: (m.conv.g, m.fc.g), model,
                        (jnp.exp(_normal(15, *model.conv.g.shape)), jnp.exp(_normal(16, *model.fc.g.shape))))
    twin = eqx.tree_at(lambda m: (m.conv.layer.weight, m.fc.layer.weight), model,
                       (model.conv.layer.weight * _factors(17, 3)[:, None, None],
                        model.fc.layer.weight * _factors(18, 4)[:, None]))
    x, y = _normal(19, 5, 2, 6, scale=1.0), jnp.asarray([0, 1, 2, 0, 1])
    before, _ = assert_rescaling_invariant(model, twin, (x, y), jax.vmap(model), jax.vmap(twin),
                                           moved=("conv/layer", "fc/layer"),
                                           generic=("conv/layer", "fc/layer"))
    assert before.metadata["coverage"] == 1.0


# ----------------------------------------------------------------------------- spectral normalization


#: flax's power iteration normalizes by ``1/sqrt(‖w‖² + ε)``: with its default ε (1e-12), ``σ`` scales with
#: the kernel only to about ``ε/‖w‖²``, above the functions' 1e-12 check.
EPSILON = 1e-30


class NnxSpectral(nnx.Module):
    """``SpectralNorm(Conv)`` (tanh) -> ``SpectralNorm(Linear)`` (tanh) -> a plain head; ``update``: the
    power iteration's ``u`` updated (a training call) or used as stored (an evaluation call)."""

    def __init__(self, rngs):
        sn = functools.partial(nnx.SpectralNorm, param_dtype=F64, epsilon=EPSILON, rngs=rngs)
        self.conv = sn(nnx.Conv(2, 3, (3,), param_dtype=F64, rngs=rngs))
        self.fc = sn(nnx.Linear(12, 4, param_dtype=F64, rngs=rngs))
        self.head = nnx.Linear(4, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x, update=False):  # x (n, 4, 2): channels last
        h = jnp.tanh(self.conv(x, update_stats=update)).reshape(x.shape[0], -1)
        return self.head(jnp.tanh(self.fc(h, update_stats=update)))


class LinenSpectral(nn.Module):
    """The same with linen's ``SpectralNorm`` (its ``u`` in the ``batch_stats`` collection)."""

    update: bool = False

    @nn.compact
    def __call__(self, x):
        sn = functools.partial(nn.SpectralNorm, epsilon=EPSILON)
        h = sn(nn.Conv(3, (3,), param_dtype=F64, name="conv"), name="sn_conv")(x, update_stats=self.update)
        h = jnp.tanh(h).reshape(x.shape[0], -1)
        h = sn(nn.Dense(4, param_dtype=F64, name="fc"), name="sn_fc")(h, update_stats=self.update)
        return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h))


class EqxSpectral(eqx.Module):
    """Per example: equinox's ``SpectralNorm(Conv1d)`` -> ``SpectralNorm(Linear)`` -> a head, called as
    ``model(x, state)`` (its ``u``, ``v`` in the state) in inference mode."""

    conv: eqx.nn.SpectralNorm
    fc: eqx.nn.SpectralNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        self.conv = eqx.nn.SpectralNorm(eqx.nn.Conv1d(2, 3, 3, key=k1, dtype=F64), "weight", key=k4)
        self.fc = eqx.nn.SpectralNorm(eqx.nn.Linear(12, 4, key=k2, dtype=F64), "weight", key=k5)
        self.head = eqx.nn.Linear(4, 3, key=k3, dtype=F64)

    def __call__(self, x, state, inference=True):  # x (2, 6): channels first
        h, state = self.conv(x, state, inference=inference)
        h, state = self.fc(jnp.tanh(h).reshape(-1), state, inference=inference)
        return self.head(jnp.tanh(h)), state


def _spectral_model(api):
    """``(model, x, y, kernels, with_kernels, logits, names, kw)``: the spectral model of ``api`` after five
    training calls; ``kernels`` its ``(conv, fc, head)`` kernels as stored, ``with_kernels(ks)`` a copy
    with those replaced (the power-iteration vectors as stored), ``logits(m)`` a model's evaluation
    call on ``x`` (leaving ``m`` as it is), ``names`` the three layers as reported, ``kw`` the options
    ``analyze`` needs (equinox's state)."""
    y = jnp.asarray([0, 1, 2, 0, 1])
    if api == "nnx":
        x = _normal(21, 5, 4, 2, scale=1.0)
        model = NnxSpectral(nnx.Rngs(3))
        for _ in range(5):
            model(x, update=True)

        def layers(m):
            return m.conv.layer_instance, m.fc.layer_instance, m.head

        def with_kernels(ks):
            clone = nnx.clone(model)
            for layer, k in zip(layers(clone), ks):
                layer.kernel = nnx.Param(k)
            return clone

        return (model, x, y, tuple(layer.kernel[...] for layer in layers(model)), with_kernels,
                lambda m: nnx.clone(m)(x), ("conv/layer_instance", "fc/layer_instance", "head"), {})
    if api == "linen":
        x = _normal(21, 5, 4, 2, scale=1.0)
        variables = LinenSpectral().init(jax.random.key(4), x)
        for _ in range(5):
            _, updates = LinenSpectral(update=True).apply(variables, x, mutable=["batch_stats"])
            variables = {**variables, **updates}
        module, params, paths = LinenSpectral(), variables["params"], ("conv/kernel", "fc/kernel", "head/kernel")

        def with_kernels(ks):
            edited = params
            for path, k in zip(paths, ks):
                edited = _edit(edited, path, lambda _, k=k: k)
            return module, {**variables, "params": edited}

        return ((module, variables), x, y, tuple(params[p.split("/")[0]]["kernel"] for p in paths), with_kernels,
                lambda m: module.apply(m[1], x), ("conv", "fc", "head"), {})
    x = _normal(21, 5, 2, 6, scale=1.0)  # channels first
    model, state = eqx.nn.make_with_state(EqxSpectral)(jax.random.key(5))
    for i in range(5):
        _, state = model(x[i], state, inference=False)
    where = lambda m: (m.conv.layer.weight, m.fc.layer.weight, m.head.weight)  # noqa: E731
    return (model, x, y, where(model), lambda ks: eqx.tree_at(where, model, tuple(ks)),
            lambda m: jax.vmap(lambda xi: m(xi, state)[0])(x), ("conv/layer", "fc/layer", "head"),
            {"state": state, "vmap": True})


@pytest.mark.parametrize("api", ["nnx", "linen", "equinox"])
def test_spectral_norm_kernel_scale_invariance(api):
    """A spectrally normalized layer (``W = K / σ(K)``, ``σ`` from the stored power-iteration vectors,
    which stay; a few training calls first, as after training): its kernel ``K`` times a positive
    factor leaves ``W`` and the function as they are (``σ`` scales with it), so every layer's
    normalized sharpness stays and the normalized kernels' traces move (method §3 "Spectral
    normalization", §8). The kernels are analyzed (coverage 1) on the generic path, which
    differentiates the normalization."""
    model, x, y, kernels, with_kernels, logits, names, kw = _spectral_model(api)
    twin = with_kernels((kernels[0] * 2.5, kernels[1] * 0.3, kernels[2]))
    before, _ = assert_rescaling_invariant(model, twin, (x, y), lambda _: logits(model), lambda _: logits(twin),
                                           moved=names[:2], generic=names[:2], **kw)
    assert before.metadata["coverage"] == 1.0 and before.metadata["unsupported"] == []
    assert {layer.name for layer in before.layers} >= set(names)


@pytest.mark.parametrize("api", ["nnx", "linen", "equinox"])
def test_spectral_norm_kernel_ggn_against_brute_force(api):
    """The stored kernel ``K`` of a spectrally normalized layer (``W = K / σ(K)``, ``σ`` from the stored
    power-iteration vectors) after a few training calls: its ``ggn`` diagonal is the brute-force one,
    ``Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n / N`` with ``J_n`` the per-sample Jacobian of the logits in
    ``K`` through the normalization (method §3 "Spectral normalization", §6.1), and so is the plain
    head's beside it; an nnx module's vectors and kernels stay as stored (linen's and equinox's are
    immutable)."""
    model, x, y, kernels, with_kernels, logits, names, kw = _spectral_model(api)
    n, c = len(y), 3

    def per_sample(ks, i):
        return logits(with_kernels(ks))[i]

    p = jax.nn.softmax(logits(model), axis=-1)
    refs = [np.zeros(k.shape) for k in kernels]
    for i in range(n):
        jac = jax.jacrev(per_sample)(kernels, i)  # per kernel: (c, *kernel shape)
        h = jnp.diag(p[i]) - jnp.outer(p[i], p[i])
        for ref, j in zip(refs, jac):
            jm = j.reshape(c, -1)
            ref += np.asarray(jnp.einsum("cp,cd,dp->p", jm, h, jm)).reshape(ref.shape) / n
    if api == "equinox":  # (out, in, k) and (out, in): canonical as stored
        canonical = refs
    else:  # flax: (k, in, out) and (in, out)
        canonical = [refs[0].transpose(2, 1, 0), refs[1].T, refs[2].T]
    if api == "nnx":  # the module holds its vectors and kernels: every leaf as it was
        stored = [np.asarray(a).copy() for a in jax.tree_util.tree_leaves(nnx.state(model))]
    got = normflat.hessian_diagonal(model, (x, y), estimator="ggn", loss="ce", progress=False, **kw)
    assert set(got) == set(names), sorted(got)
    for name, want in zip(names, canonical):
        np.testing.assert_allclose(np.asarray(got[name]), want, rtol=1e-10, atol=1e-12 * np.abs(want).max())
    assert all(np.abs(w).max() > 0 for w in canonical[:2])
    if api == "nnx":
        for before, after in zip(stored, jax.tree_util.tree_leaves(nnx.state(model)), strict=True):
            np.testing.assert_array_equal(before, np.asarray(after))


# ----------------------------------------------------------------------------- transposed convolutions


def _flax_transposed_twin(params, f, g):
    """The flax transposed-convolution model's parameters rescaled (kernels ``(*k, in, out)``): ``conv``'s
    output channels times ``f`` and ``up0``'s input channels divided by it (a relu between), ``up1``'s
    output channels times ``g`` and ``up2``'s input channels divided by it (a relu between)."""
    params = _edit(params, "conv/kernel", lambda k: k * f)
    params = _edit(params, "conv/bias", lambda b: b * f)
    params = _edit(params, "up0/kernel", lambda k: k / f[:, None])
    params = _edit(params, "up1/kernel", lambda k: k * g)
    params = _edit(params, "up1/bias", lambda b: b * g)
    return _edit(params, "up2/kernel", lambda k: k / g[:, None])


@pytest.mark.parametrize("api", ["nnx", "linen", "eqx"])
def test_transposed_conv_channel_rescaling(api):
    """Transposed convolutions (``tests/arch/test_jax_layers.py``'s models): a transposed kernel's input
    channels against the convolution before it, and its output channels against the layer after it
    (the next transposed convolution's input channels, or equinox's head), through relus; equinox's
    grouped one per group (input channel ``i`` is column ``i mod in/groups`` of group
    ``i div in/groups``'s rows). Rows and columns of the canonical matrices (method §3), which the
    normalized sharpness absorbs and the traces do not (§8 item 2)."""
    from tests.arch.test_jax_layers import EqxTransposed, LinenTransposed, NnxTransposed

    f, g = _factors(40, 3 if api != "eqx" else 4), _factors(41, 2)
    if api == "eqx":
        x = _normal(42, 4, 2, 3, 3, scale=1.0)
        model = EqxTransposed(jax.random.key(43))
        up0 = np.array(model.up0.weight)  # (out 6, in/groups 2, 3, 3), 2 groups
        for i in range(4):
            up0[3 * (i // 2):3 * (i // 2 + 1), i % 2] /= float(f[i])
        twin = eqx.tree_at(
            lambda m: (m.conv.weight, m.conv.bias, m.up0.weight, m.up1.weight, m.up1.bias, m.head.weight), model,
            (model.conv.weight * f[:, None, None, None], model.conv.bias * f[:, None, None], jnp.asarray(up0),
             model.up1.weight * g[:, None, None], model.up1.bias * g[:, None],
             model.head.weight / jnp.repeat(g, 8 * 20)[None]))
        apply, twin_apply, moved = jax.vmap(model), jax.vmap(twin), ("conv", "up0", "up1", "head")
    else:
        x = _normal(42, 4, 3, 3, 2, scale=1.0)
        if api == "nnx":
            model = NnxTransposed(nnx.Rngs(43))
            gdef, params, rest = nnx.split(model, nnx.Param, ...)
            values = nnx.to_pure_dict(params)
            twin = nnx.merge(gdef, _flax_transposed_twin(values, f, g), rest)
            apply, twin_apply = model, twin
        else:
            model, variables = _linen(LinenTransposed(), x, 43)
            twin = (model, {"params": _flax_transposed_twin(variables["params"], f, g)})
            model = (model, variables)
            apply = lambda x: model[0].apply(model[1], x)  # noqa: E731
            twin_apply = lambda x: twin[0].apply(twin[1], x)  # noqa: E731
        moved = ("conv", "up0", "up1", "up2")
    before, _ = assert_rescaling_invariant(model, twin, (x, jnp.asarray([0, 1, 2, 1])), apply, twin_apply,
                                           moved=moved)
    assert before.layer("up0").kind == "conv_transpose2d"
