"""JAX backend, layers beyond dense and convolution: multi-axis kernels, attention, embeddings, cells,
transposed convolutions.

Every diagonal is checked against a brute-force float64 reference computed from
the model's own forward pass as a function of its parameter leaves: ``ggn``
against ``(1/N) Σ J_{n,t}ᵀ H_{n,t} J_{n,t}`` with full per-sample Jacobians
(``jax.jacrev``) and the per-token loss Hessian in the logits (``jax.hessian``),
over the counted tokens; ``exact`` against the diagonal of ``jax.hessian`` of the
mean loss. The references live in the native layouts of the frameworks and are
brought to the canonical layout of method §3 by the explicit transposes written
here (``canon``), independently of the backend's layout code. The invariance
tests are method §8 items 5-7, and the rescaling of a weight-normalized direction
(method §3, "Weight normalization").
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
from normflat.engine.options import NSCE_EPS  # noqa: E402

jax.config.update("jax_enable_x64", True)

F64 = jnp.float64
RTOL = 1e-10


# ----------------------------------------------------------------------------- references


def _key_name(k) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _named(tree) -> tuple[list[str], list, object]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    # nnx states end their paths with the Variable's "value" attribute
    names = ["/".join(_key_name(k) for k in (p[:-1] if _key_name(p[-1]) == "value" and hasattr(p[-1], "name")
                                            else p)) for p, _ in flat]
    return names, [a for _, a in flat], treedef


def pure(model, variables=None):
    """``(names, leaves, apply(leaves, x) -> logits)`` of an nnx / equinox / linen model."""
    if isinstance(model, nnx.Module):
        gdef, params, rest = nnx.split(model, nnx.Param, ...)
        names, leaves, treedef = _named(params)
        return names, leaves, lambda ls, x: nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, ls), rest)(x)
    if isinstance(model, eqx.Module):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        names, leaves, treedef = _named(params)
        return names, leaves, lambda ls, x: jax.vmap(eqx.combine(jax.tree_util.tree_unflatten(treedef, ls), static))(x)
    names, leaves, treedef = _named(variables["params"])
    return names, leaves, lambda ls, x: model.apply({"params": jax.tree_util.tree_unflatten(treedef, ls)}, x)


def normalized(z, loss):
    """The logits the cross-entropy sees: ``ẑ`` per token for nsce (method §7), ``z`` for ce."""
    if loss != "nsce":
        return z
    zc = z - z.mean(axis=-1, keepdims=True)
    return zc / jnp.sqrt((zc**2).mean(axis=-1, keepdims=True) + NSCE_EPS)


def token_loss(u, y, loss):
    """One token's (or one sample's) loss in its logits ``u``."""
    u = normalized(u, loss)
    return jax.nn.logsumexp(u) - u[y]


def ref_ggn(model, x, y, loss, variables=None) -> dict[str, np.ndarray]:
    """``{leaf name: native GGN diagonal}`` with per-sample Jacobians and per-token loss Hessians.

    For nsce the Jacobian is that of the normalized logits and the Hessian that of the
    cross-entropy in them (the Gauss-Newton split of method §6).
    """
    names, leaves, apply = pure(model, variables)
    y = jnp.asarray(y)

    def jac(ls, xi):
        # nsce: the Gauss-Newton split after the normalization (method §6), J of the normalized logits
        f = lambda l_: normalized(apply(l_, jax.tree_util.tree_map(lambda a: a[None], xi))[0], loss)  # noqa: E731
        return f(ls), jax.jacrev(f)(ls)

    @jax.jit
    def run(ls, x, y):
        z, J = jax.vmap(jac, in_axes=(None, 0))(ls, x)
        c = z.shape[-1]
        zt, yt = z.reshape(-1, c), y.reshape(-1)
        counted = (yt >= 0).astype(z.dtype)
        H = jax.vmap(jax.hessian(lambda u, t: token_loss(u, t, "ce")))(zt, jnp.maximum(yt, 0))
        H = H * counted[:, None, None]
        out = []
        for j in J:
            jt = j.reshape(zt.shape[0], c, -1)
            out.append(jnp.einsum("ncp,ncd,ndp->p", jt, H, jt).reshape(j.shape[z.ndim:]) / counted.sum())
        return out

    return dict(zip(names, (np.asarray(v) for v in run(leaves, x, y))))


def ref_exact(model, x, y, loss, select, variables=None) -> dict[str, np.ndarray]:
    """``{leaf name: native diagonal of jax.hessian of the mean loss}`` for the leaves in ``select``."""
    names, leaves, apply = pure(model, variables)
    idx = [names.index(s) for s in select]
    sizes = [leaves[i].size for i in idx]
    flat0 = jnp.concatenate([leaves[i].ravel() for i in idx])
    y = jnp.asarray(y)

    def mean_loss(flat):
        ls, o = list(leaves), 0
        for i, s in zip(idx, sizes):
            ls[i] = flat[o:o + s].reshape(leaves[i].shape)
            o += s
        z = apply(ls, x)
        c = z.shape[-1]
        zt, yt = z.reshape(-1, c), y.reshape(-1)
        counted = (yt >= 0).astype(z.dtype)
        per = jax.vmap(lambda u, t: token_loss(u, t, loss))(zt, jnp.maximum(yt, 0))
        return jnp.sum(per * counted) / counted.sum()

    d = np.asarray(jnp.diag(jax.jit(jax.hessian(mean_loss))(flat0)))
    out, o = {}, 0
    for i, s in zip(idx, sizes):
        out[names[i]] = d[o:o + s].reshape(leaves[i].shape)
        o += s
    return out


def canon(a, kind):
    """Native -> canonical layout (method §3), written out per kind."""
    a = np.asarray(a)
    if kind == "flax":  # (in, out) kernels, (vocabulary, features) tables
        return a.T
    if kind == "eqx":  # (out, in)
        return a
    if kind == "qkv":  # (d, H, hd) -> (H·hd, d)
        return a.transpose(1, 2, 0).reshape(a.shape[1] * a.shape[2], a.shape[0])
    if kind == "attn_out":  # (H, hd, d) -> (d, H·hd)
        return a.transpose(2, 0, 1).reshape(a.shape[2], a.shape[0] * a.shape[1])
    raise ValueError(kind)


def assert_close(got, want, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def check(diag: dict, ref: dict, expected: dict):
    """``expected``: {report name: (leaf name, canonical kind, optional row slice)}."""
    assert set(diag) == set(expected), (sorted(diag), sorted(expected))
    for name, (leaf, kind, *rows) in expected.items():
        want = canon(ref[leaf], kind)
        if rows:
            want = want[rows[0]]
        assert_close(diag[name], want)


def _hd(model, data, **kw):
    kw.setdefault("progress", False)
    return {k: np.asarray(v) for k, v in normflat.hessian_diagonal(model, data, **kw).items()}


RNG = np.random.default_rng(0)


# ----------------------------------------------------------------------------- models


class NnxGeneral(nnx.Module):
    """LinearGeneral with two input and two output axes, an Einsum with two input axes."""

    def __init__(self, rngs):
        self.gen = nnx.LinearGeneral((2, 3), (2, 2), axis=(-2, -1), param_dtype=F64, rngs=rngs)
        self.ein = nnx.Einsum("nab,abc->nc", (2, 3, 4), param_dtype=F64, rngs=rngs)
        self.head = nnx.Linear(4, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        h = self.gen(x).reshape(x.shape[0], 4) + self.ein(x)
        return self.head(jnp.tanh(h))


class LinenGeneral(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.DenseGeneral((2, 2), axis=(-2, -1), param_dtype=F64, name="gen")(x).reshape(x.shape[0], 4)
        h = h + nn.Einsum((2, 3, 4), "nab,abc->nc", param_dtype=F64, name="ein")(x)
        return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h))


def attention64(query, key, value, *args, **kwargs):
    """Dot-product attention in the inputs' dtype.

    nnx's default attention without dropout calls ``jax.nn.dot_product_attention``,
    whose softmax runs in float32 whatever the inputs; a float64 reference needs a
    float64 softmax (the projections, which normflat analyzes, are the same).
    """
    w = jax.nn.softmax(jnp.einsum("...qhd,...khd->...hqk", query / jnp.sqrt(query.shape[-1]), key), axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", w, value)


class NnxAttention(nnx.Module):
    """MHA over a sequence, mean-pooled classifier."""

    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(2, 4, qkv_features=4, decode=False, param_dtype=F64, rngs=rngs,
                                           attention_fn=attention64)
        self.head = nnx.Linear(4, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.attn(x)).mean(axis=1))


class LinenAttention(nn.Module):
    """Self-attention over a sequence and a per-token head: token logits (n, T, 3)."""

    @nn.compact
    def __call__(self, x):
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4, param_dtype=F64, name="attn")(x)
        return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h))


class EqxAttention(eqx.Module):
    """Per-example: token ids (T,) -> embedding -> MHA -> mean -> Linear (classifier)."""

    emb: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.emb = eqx.nn.Embedding(7, 4, key=k1, dtype=F64)
        self.attn = eqx.nn.MultiheadAttention(2, 4, use_query_bias=True, use_key_bias=True,
                                             use_value_bias=True, use_output_bias=True, key=k2, dtype=F64)
        self.head = eqx.nn.Linear(4, 3, key=k3, dtype=F64)

    def __call__(self, ids):
        e = jax.vmap(self.emb)(ids)
        return self.head(jnp.tanh(self.attn(e, e, e)).mean(axis=0))


class NnxLM(nnx.Module):
    """Token LM: Embed, one attention block, the tied ``attend`` head (logits (n, T, V))."""

    def __init__(self, rngs, vocab=9, d=4):
        self.emb = nnx.Embed(vocab, d, param_dtype=F64, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, d, qkv_features=d, decode=False, param_dtype=F64, rngs=rngs,
                                           attention_fn=attention64)

    def __call__(self, ids):
        h = self.emb(ids)
        return self.emb.attend(jnp.tanh(h + self.attn(h)))


ATTN_X = jnp.asarray(RNG.normal(size=(3, 3, 4)))
ATTN_Y = jnp.asarray([0, 2, 1])


# ----------------------------------------------------------------------------- brute force


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_multi_axis_kernels_ggn(api):
    x = jnp.asarray(RNG.normal(size=(4, 2, 3)))
    y = jnp.asarray([0, 1, 2, 1])
    if api == "nnx":
        model = NnxGeneral(nnx.Rngs(1))
        d = _hd(model, (x, y), estimator="ggn")
        ref = ref_ggn(model, x, y, "nsce")
    else:
        module = LinenGeneral()
        variables = module.init(jax.random.key(1), x)
        d = _hd((module, variables), (x, y), estimator="ggn")
        ref = ref_ggn(module, x, y, "nsce", variables)
    gk, ek = "gen/kernel", "ein/kernel"
    # (2, 3, 2, 2): output axes (2, 3), input axes (0, 1); einsum (2, 3, 4): output 2, inputs (0, 1)
    assert_close(d["gen"], np.asarray(ref[gk]).transpose(2, 3, 0, 1).reshape(4, 6))
    assert_close(d["ein"], np.asarray(ref[ek]).transpose(2, 0, 1).reshape(4, 6))
    assert_close(d["head"], canon(ref["head/kernel"], "flax"))


@pytest.mark.slow
def test_nnx_attention_ggn_and_exact():
    model = NnxAttention(nnx.Rngs(2))
    expected = {f"attn/{p}": (f"attn/{p}/kernel", "qkv") for p in ("query", "key", "value")}
    expected["attn/out"] = ("attn/out/kernel", "attn_out")
    expected["head"] = ("head/kernel", "flax")
    check(_hd(model, (ATTN_X, ATTN_Y), estimator="ggn"), ref_ggn(model, ATTN_X, ATTN_Y, "nsce"), expected)
    exact = _hd(model, (ATTN_X, ATTN_Y), estimator="exact", loss="ce")
    ref = ref_exact(model, ATTN_X, ATTN_Y, "ce", [leaf for leaf, _ in expected.values()])
    check(exact, ref, expected)


@pytest.mark.slow
def test_linen_attention_token_logits_ce_with_ignore_index():
    module = LinenAttention()
    variables = module.init(jax.random.key(3), ATTN_X)
    y = jnp.asarray([[0, 1, -100], [2, -100, 1], [1, 1, 0]])
    d = _hd((module, variables), (ATTN_X, y), estimator="ggn", loss="ce")
    ref = ref_ggn(module, ATTN_X, y, "ce", variables)
    expected = {f"attn/{p}": (f"attn/{p}/kernel", "qkv") for p in ("query", "key", "value")}
    expected["attn/out"] = ("attn/out/kernel", "attn_out")
    expected["head"] = ("head/kernel", "flax")
    check(d, ref, expected)
    r = normflat.analyze((module, variables), (ATTN_X, y), estimator="ggn", loss="ce", progress=False)
    assert r.metadata["loss_terms"] == 7  # the counted tokens (method §6.3)
    # exact: the Hessian of the mean over the counted tokens, batches split unevenly (padded pieces)
    exact = _hd((module, variables), [(ATTN_X[:2], y[:2]), (ATTN_X[2:], y[2:])], estimator="exact", loss="ce",
                chunk_size=None)
    check(exact, ref_exact(module, ATTN_X, y, "ce", [leaf for leaf, *_ in expected.values()], variables), expected)


def test_equinox_attention_and_embedding_ggn():
    model = EqxAttention(jax.random.key(4))
    ids = jnp.asarray(RNG.integers(0, 7, size=(4, 3)))
    y = jnp.asarray([0, 1, 2, 0])
    d = _hd(model, (ids, y), estimator="ggn")
    expected = {"emb": ("emb/weight", "flax"), "head": ("head/weight", "eqx")}
    for p in ("query_proj", "key_proj", "value_proj", "output_proj"):
        expected[f"attn/{p}"] = (f"attn/{p}/weight", "eqx")
    check(d, ref_ggn(model, ids, y, "nsce"), expected)


def test_nnx_token_lm_tied_embedding_nsce_ignore_index():
    model = NnxLM(nnx.Rngs(5))
    ids = jnp.asarray(RNG.integers(0, 9, size=(3, 4)))
    y = np.asarray(ids).copy()
    y[0, 1] = y[2, 3] = -100
    r = normflat.analyze(model, (ids, jnp.asarray(y)), estimator="ggn", progress=False)
    d = {l.name: None for l in r.layers}
    assert list(d)[0] == "emb" and r.metadata["loss_terms"] == 10
    assert r.layer("emb").details["path"] == "fast"  # the lookup's and the head's taps (method §6.1)
    diag = _hd(model, (ids, jnp.asarray(y)), estimator="ggn")
    expected = {"emb": ("emb/embedding", "flax")}  # used by the lookup and the tied head: one diagonal
    for p in ("query", "key", "value"):
        expected[f"attn/{p}"] = (f"attn/{p}/kernel", "qkv")
    expected["attn/out"] = ("attn/out/kernel", "attn_out")
    check(diag, ref_ggn(model, ids, y, "nsce"), expected)


class NnxSharedKernel(nnx.Module):
    """Two ``nnx.Linear`` holding one kernel variable (``second.kernel = first.kernel``)."""

    def __init__(self, rngs):
        self.first = nnx.Linear(4, 4, param_dtype=F64, rngs=rngs)
        self.second = nnx.Linear(4, 4, param_dtype=F64, rngs=rngs)
        self.second.kernel = self.first.kernel
        self.head = nnx.Linear(4, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.second(jnp.tanh(self.first(x)))))


def test_nnx_kernel_shared_between_two_modules():
    """A variable shared by two modules is one parameter leaf, under its first path: one problem, no
    ``shared_with`` (there is no second name), on the fast path with one tied tap per use (method
    §6.1 "Tied weights"), the diagonal covering both uses."""
    model = NnxSharedKernel(nnx.Rngs(7))
    x, y = jnp.asarray(RNG.normal(size=(6, 4))), np.array([0, 1, 2, 2, 1, 0])
    report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert [layer.name for layer in report.layers] == ["first", "head"]
    first = report.layer("first").details
    assert first["path"] == "fast" and "shared_with" not in first
    check(_hd(model, (x, y), loss="ce", estimator="ggn"), ref_ggn(model, x, y, "ce"),
          {"first": ("first/kernel", "flax"), "head": ("head/kernel", "flax")})


# ----------------------------------------------------------------------------- recurrent cells


def zero_carry(cell, x):
    """A float64 zero carry (nnx's initialize_carry draws it from the cell's Rngs, in float32)."""
    z = jnp.zeros((x.shape[0], 3) if not isinstance(cell, nnx.SimpleCell) else (x.shape[0], cell.hidden_features),
                  x.dtype)
    return (z, z) if isinstance(cell, (nnx.LSTMCell, nnx.OptimizedLSTMCell)) else z


class NnxCells(nnx.Module):
    def __init__(self, rngs, first, second):
        self.rnn1 = nnx.RNN(first(3, 3, dtype=F64, param_dtype=F64, rngs=rngs))
        self.rnn2 = nnx.RNN(second(3, 3, dtype=F64, param_dtype=F64, rngs=rngs))
        self.head = nnx.Linear(3, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        h = self.rnn1(x, initial_carry=zero_carry(self.rnn1.cell, x))
        return self.head(self.rnn2(h, initial_carry=zero_carry(self.rnn2.cell, h))[:, -1])


class LinenCells(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i, cell in enumerate((nn.LSTMCell, nn.OptimizedLSTMCell, nn.GRUCell)):
            x = nn.RNN(cell(3, param_dtype=F64), name=f"rnn{i}")(x)
        return nn.Dense(3, param_dtype=F64, name="head")(x[:, -1])


class EqxCells(eqx.Module):
    lstm: eqx.nn.LSTMCell
    gru: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.lstm = eqx.nn.LSTMCell(3, 3, key=k1, dtype=F64)
        self.gru = eqx.nn.GRUCell(3, 3, key=k2, dtype=F64)
        self.head = eqx.nn.Linear(3, 3, key=k3, dtype=F64)

    def __call__(self, xs):  # one example (T, 3), scanned by the user's own code
        def step(carry, x):
            (h, c), g = carry
            h, c = self.lstm(x, (h, c))
            g = self.gru(h, g)
            return ((h, c), g), None

        z = jnp.zeros(3, xs.dtype)
        ((_, _), g), _ = jax.lax.scan(step, ((z, z), z), xs)
        return self.head(g)


CELL_X = jnp.asarray(RNG.normal(size=(3, 3, 3)))
CELL_Y = jnp.asarray([0, 1, 2])  # 3 classes: with 2, nsce's normalized logits are ±1 (no curvature)
LSTM, GRU = ("i", "f", "g", "o"), ("r", "z", "n")


def _gate_rows(gates, hidden=3):
    return {g: slice(j * hidden, (j + 1) * hidden) for j, g in enumerate(gates)}


@pytest.mark.slow
@pytest.mark.parametrize("cells", ["optimized_gru", "lstm_simple"])
def test_nnx_cells_ggn_through_time(cells):
    first, second = ((nnx.OptimizedLSTMCell, nnx.GRUCell) if cells == "optimized_gru"
                     else (nnx.LSTMCell, nnx.SimpleCell))
    model = NnxCells(nnx.Rngs(6), first, second)
    d = _hd(model, (CELL_X, CELL_Y), estimator="ggn")
    expected = {"head": ("head/kernel", "flax")}
    if cells == "optimized_gru":
        # packed gates (in, 4·hidden) / (in, 3·hidden): one matrix per gate (method §3)
        for rnn, gates in (("rnn1", LSTM), ("rnn2", GRU)):
            for dense in ("dense_i", "dense_h"):
                for g, rows in _gate_rows(gates).items():
                    expected[f"{rnn}/cell/{dense}.{g}"] = (f"{rnn}/cell/{dense}/kernel", "flax", rows)
    else:
        for g in ("ii", "if_", "ig", "io", "hi", "hf", "hg", "ho"):
            expected[f"rnn1/cell/{g}"] = (f"rnn1/cell/{g}/kernel", "flax")
        for dense in ("dense_i", "dense_h"):
            expected[f"rnn2/cell/{dense}"] = (f"rnn2/cell/{dense}/kernel", "flax")
    check(d, ref_ggn(model, CELL_X, CELL_Y, "nsce"), expected)


@pytest.mark.slow
def test_linen_cells_ggn_through_time():
    module = LinenCells()
    variables = module.init(jax.random.key(7), CELL_X)
    d = _hd((module, variables), (CELL_X, CELL_Y), estimator="ggn")
    expected = {"head": ("head/kernel", "flax")}
    # linen cells store one Dense (OptimizedLSTMCell: one DenseParams) per gate, bound in the model's scope
    for cell, names in (("LSTMCell_0", ("ii", "if", "ig", "io", "hi", "hf", "hg", "ho")),
                        ("OptimizedLSTMCell_0", ("ii", "if", "ig", "io", "hi", "hf", "hg", "ho")),
                        ("GRUCell_0", ("ir", "iz", "in", "hr", "hz", "hn"))):
        for g in names:
            expected[f"{cell}/{g}"] = (f"{cell}/{g}/kernel", "flax")
    check(d, ref_ggn(module, CELL_X, CELL_Y, "nsce", variables), expected)


@pytest.mark.slow
def test_equinox_cells_under_scan_ggn():
    model = EqxCells(jax.random.key(8))
    d = _hd(model, (CELL_X, CELL_Y), estimator="ggn")
    expected = {"head": ("head/weight", "eqx")}
    for cell, gates in (("lstm", LSTM), ("gru", GRU)):
        for leaf in ("weight_ih", "weight_hh"):
            for g, rows in _gate_rows(gates).items():
                expected[f"{cell}/{leaf}.{g}"] = (f"{cell}/{leaf}", "eqx", rows)
    check(d, ref_ggn(model, CELL_X, CELL_Y, "nsce"), expected)


# ----------------------------------------------------------------------------- layouts=


class LinenProj(nn.Module):
    @nn.compact
    def __call__(self, x):  # x (n, T, 4): a (4, 2, 2) projection, pooled
        h = nn.DenseGeneral((2, 2), param_dtype=F64, name="proj")(x).reshape(x.shape[0], x.shape[1], 4)
        return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h).mean(axis=1))


def test_layouts_describe_or_refuse_multi_axis_kernels():
    module = LinenProj()
    variables = module.init(jax.random.key(9), ATTN_X)
    want = _hd((module, variables), (ATTN_X, ATTN_Y), estimator="ggn")
    ref = ref_ggn(module, ATTN_X, ATTN_Y, "nsce", variables)
    assert_close(want["proj"], canon(ref["proj/kernel"], "qkv"))
    pair = (module.apply, variables)
    # (apply_fn, params): the 3-axis "kernel" is contracted on axis 0 by the traced program, so it is
    # read as the multi-axis kernel it is, not as a convolution kernel (k, in, out)
    got = _hd(pair, (ATTN_X, ATTN_Y), estimator="ggn")
    assert_close(got["proj"], want["proj"])
    # declared by the role of every axis, or by a mapping: the same matrix
    for lay in ("in,out,out", {"out": (1, 2), "in": 0}):
        got = _hd(pair, (ATTN_X, ATTN_Y), estimator="ggn", layouts={"proj/kernel": lay})
        assert_close(got["proj"], want["proj"])
    # a layout that misreads the kernel is refused with the fix
    with pytest.raises(ValueError, match="reads it as a convolution kernel.*'in,out,out'"):
        normflat.analyze(pair, (ATTN_X, ATTN_Y), progress=False, layouts={"proj/kernel": "*k,in,out"})
    with pytest.raises(ValueError, match=r"declares input axes \[2\].*contracts its axes \[0\]"):
        normflat.analyze(pair, (ATTN_X, ATTN_Y), progress=False, layouts={"proj/kernel": "out,out,in"})
    with pytest.raises(ValueError, match="does not describe a leaf of shape"):
        normflat.analyze(pair, (ATTN_X, ATTN_Y), progress=False, layouts={"proj/kernel": "in,in,in"})


def test_kernels_with_batch_axes_are_refused_clearly():
    class Batched(nnx.Module):
        def __init__(self, rngs):
            self.gen = nnx.LinearGeneral(3, 2, batch_axis={0: 2}, param_dtype=F64, rngs=rngs)
            self.ein = nnx.Einsum("nhd,hde->nhe", (2, 3, 2), param_dtype=F64, rngs=rngs)
            self.head = nnx.Linear(8, 3, param_dtype=F64, rngs=rngs)

        def __call__(self, x):  # x (n, 2, 3)
            h = jnp.concatenate([self.gen(x), self.ein(x)], axis=-1)
            return self.head(h.reshape(x.shape[0], -1))

    x = jnp.asarray(RNG.normal(size=(2, 2, 3)))
    with pytest.raises(ValueError) as err:
        normflat.analyze(Batched(nnx.Rngs(0)), (x, jnp.asarray([0, 1])), progress=False, on_unsupported="error")
    assert "gen/kernel (2, 3, 2) (LinearGeneral: its kernel has batch axes" in str(err.value)
    assert "ein/kernel (2, 3, 2) (Einsum: kernel axis 'h' of 'nhd,hde->nhe' is a batch axis" in str(err.value)


# ----------------------------------------------------------------------------- invariance (method §8)


def _ns(model, data, **kw):
    r = normflat.analyze(model, data, estimator="ggn", progress=False, **kw)
    return r, {l.name: l.normalized_sharpness for l in r.layers}


def _assert_invariant(model_a, model_b, data, apply_a, apply_b, **kw):
    np.testing.assert_allclose(np.asarray(apply_b(data[0])), np.asarray(apply_a(data[0])), rtol=1e-12, atol=1e-12)
    ra, la = _ns(model_a, data, **kw)
    rb, lb = _ns(model_b, data, **kw)
    assert la.keys() == lb.keys()
    for k in la:
        np.testing.assert_allclose(lb[k], la[k], rtol=1e-8)
    np.testing.assert_allclose(rb.normalized_sharpness, ra.normalized_sharpness, rtol=1e-8)
    assert abs(rb.hessian_trace - ra.hessian_trace) > 1e-3 * abs(ra.hessian_trace)
    return ra, rb


def _scale_heads(k, c, axis):
    shape = [1] * k.ndim
    shape[axis] = c.shape[0]
    return k * c.reshape(shape)


def test_invariance_nnx_attention_heads():
    model = NnxAttention(nnx.Rngs(2))
    c_qk, c_vo = jnp.asarray([3.0, 0.4]), jnp.asarray([0.25, 5.0])
    other = nnx.clone(model)
    a = other.attn
    # query rows of head h times c_h, key rows times 1/c_h (kernel (d, H, hd), bias (H, hd))
    a.query.kernel[...] = _scale_heads(a.query.kernel[...], c_qk, 1)
    a.query.bias[...] = _scale_heads(a.query.bias[...], c_qk, 0)
    a.key.kernel[...] = _scale_heads(a.key.kernel[...], 1 / c_qk, 1)
    a.key.bias[...] = _scale_heads(a.key.bias[...], 1 / c_qk, 0)
    # value rows of head h times c_h, the output projection's columns of head h (kernel (H, hd, d)) times 1/c_h
    a.value.kernel[...] = _scale_heads(a.value.kernel[...], c_vo, 1)
    a.value.bias[...] = _scale_heads(a.value.bias[...], c_vo, 0)
    a.out.kernel[...] = _scale_heads(a.out.kernel[...], 1 / c_vo, 0)
    _assert_invariant(model, other, (ATTN_X, ATTN_Y), model, other)


def test_invariance_equinox_attention_heads_and_embedding_features():
    model = EqxAttention(jax.random.key(4))
    ids = jnp.asarray(RNG.integers(0, 7, size=(4, 3)))
    data = (ids, jnp.asarray([0, 1, 2, 0]))
    heads = lambda c: jnp.repeat(c, 2)[:, None]  # noqa: E731 - rows (H·hd, d), head-major
    c_qk, c_vo = jnp.asarray([2.0, 0.3]), jnp.asarray([0.5, 4.0])
    feat = jnp.asarray([2.0, 0.5, 3.0, 0.2])  # embedding feature j times c_j, input column j of q/k/v times 1/c_j
    at = model.attn
    new = eqx.tree_at(
        lambda m: (m.emb.weight, m.attn.query_proj.weight, m.attn.query_proj.bias, m.attn.key_proj.weight,
                   m.attn.key_proj.bias, m.attn.value_proj.weight, m.attn.value_proj.bias,
                   m.attn.output_proj.weight),
        model,
        (model.emb.weight * feat, at.query_proj.weight * heads(c_qk) / feat, at.query_proj.bias * heads(c_qk)[:, 0],
         at.key_proj.weight / heads(c_qk) / feat, at.key_proj.bias / heads(c_qk)[:, 0],
         at.value_proj.weight * heads(c_vo) / feat, at.value_proj.bias * heads(c_vo)[:, 0],
         at.output_proj.weight / heads(c_vo).T))
    _assert_invariant(model, new, data, jax.vmap(model), jax.vmap(new))


def test_invariance_nnx_tied_embedding_features_against_both_uses():
    """Feature j of the table that is both the lookup and the ``attend`` head times c_j: the next
    layer's input row j (kernel (in, out)) and the previous layer's output column j take 1/c_j."""

    class TiedMixer(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(9, 4, param_dtype=F64, rngs=rngs)
            self.mix_in = nnx.Linear(4, 6, param_dtype=F64, rngs=rngs)
            self.mix_out = nnx.Linear(6, 4, param_dtype=F64, rngs=rngs)

        def __call__(self, ids):
            return self.emb.attend(self.mix_out(jnp.tanh(self.mix_in(self.emb(ids)))))

    model = TiedMixer(nnx.Rngs(12))
    model.mix_out.bias[...] = jnp.asarray(RNG.normal(size=4)) * 0.3  # a non-zero bias to rescale
    other = nnx.clone(model)
    c = jnp.asarray([2.0, 0.5, 3.0, 0.25])
    other.emb.embedding[...] = other.emb.embedding[...] * c
    other.mix_in.kernel[...] = other.mix_in.kernel[...] / c[:, None]
    other.mix_out.kernel[...] = other.mix_out.kernel[...] / c
    other.mix_out.bias[...] = other.mix_out.bias[...] / c
    ids = jnp.asarray(RNG.integers(0, 9, size=(3, 4)))
    before, after = _assert_invariant(model, other, (ids, jnp.asarray(RNG.integers(0, 9, size=(3, 4)))), model, other)
    assert before.layer("emb").details["path"] == after.layer("emb").details["path"] == "fast"  # the tied taps


def test_invariance_nnx_simple_cell_relu_hidden_units():
    class Relu(nnx.Module):
        def __init__(self, rngs):
            self.rnn = nnx.RNN(nnx.SimpleCell(3, 4, activation_fn=nnx.relu, dtype=F64, param_dtype=F64, rngs=rngs))
            self.head = nnx.Linear(4, 3, param_dtype=F64, rngs=rngs)

        def __call__(self, x):
            return self.head(self.rnn(x, initial_carry=zero_carry(self.rnn.cell, x))[:, -1])

    model = Relu(nnx.Rngs(11))
    other = nnx.clone(model)
    c = jnp.asarray([2.0, 0.5, 3.0, 0.25])
    cell = other.rnn.cell
    # hidden unit k: rows of W_i, W_h and biases times c_k, columns of W_h and of the head times 1/c_k
    cell.dense_i.kernel[...] = cell.dense_i.kernel[...] * c  # (in, H): columns are output units
    cell.dense_h.kernel[...] = cell.dense_h.kernel[...] * c / c[:, None]  # D W_h D^-1 in (in, out)
    for dense in (cell.dense_i, cell.dense_h):
        if dense.bias is not None:
            dense.bias[...] = dense.bias[...] * c
    other.head.kernel[...] = other.head.kernel[...] / c[:, None]
    _assert_invariant(model, other, (CELL_X, jnp.asarray([0, 1, 2])), model, other)


class NnxWindowed(nnx.Module):
    """Dense -> the batch folded into windows (``layout`` as in the torch and Keras tests: in blocks
    per sample, window-major, or in blocks plus a dense layer on a batch-independent coordinate
    table) -> a dense layer per window -> merged -> mean -> head."""

    def __init__(self, layout, rngs):
        self.layout = layout
        self.embed = nnx.Linear(3, 6, param_dtype=F64, rngs=rngs)
        self.windowed = nnx.Linear(6, 6, param_dtype=F64, rngs=rngs)
        self.coords_mlp = nnx.Linear(2, 6, param_dtype=F64, rngs=rngs) if layout == "shared" else None
        self.head = nnx.Linear(6, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.embed(x))
        n = h.shape[0]
        if self.layout == "window-major":
            w = h.reshape(n, 2, 2, 6).transpose(1, 0, 2, 3).reshape(2 * n, 2, 6)
        else:
            w = h.reshape(2 * n, 2, 6)
        w = jnp.tanh(self.windowed(w))
        if self.layout == "window-major":
            h = w.reshape(2, n, 2, 6).transpose(1, 0, 2, 3).reshape(n, 4, 6)
        else:
            h = w.reshape(n, 4, 6)
        if self.coords_mlp is not None:
            h = h + jnp.tanh(self.coords_mlp(jnp.linspace(-1.0, 1.0, 8, dtype=F64).reshape(4, 2)))
        return self.head(h.mean(1))


@pytest.mark.parametrize("layout", ["blocks", "window-major", "shared"])
def test_dense_layer_on_a_batch_folded_into_windows(layout):
    """The JAX backend forms each example's squares from its own forward (a batch of one), so a
    batch folded into the windows' leading axis, in any order, keeps the fast rule; a layer on a
    batch-independent table (a kernel use without the example axis) takes the generic path; all
    equal brute force, with batches of 5 and 1 and chunks of 2 (as in the torch and Keras tests)."""
    model = NnxWindowed(layout, nnx.Rngs(5))
    x, y = RNG.normal(size=(5, 4, 3)), RNG.integers(0, 3, 5)
    rep = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    paths = {layer.name: layer.details["path"] for layer in rep.layers}
    assert paths == {"embed": "fast", "windowed": "fast", "head": "fast",
                     **({"coords_mlp": "generic"} if layout == "shared" else {})}
    expected = {name: (f"{name}/kernel", "flax") for name in ("embed", "windowed", "head")}
    if layout == "shared":
        expected["coords_mlp"] = ("coords_mlp/kernel", "flax")
    for n, kw in ((5, {}), (1, {}), (5, {"chunk_size": 2})):
        check(_hd(model, (x[:n], y[:n]), estimator="ggn", loss="ce", **kw), ref_ggn(model, x[:n], y[:n], "ce"),
              expected)


# ----------------------------------------------------------------------------- layers called several times


class NnxShared(nnx.Module):
    """A grouped convolution called twice and a dense layer called three times (a module shared
    across depth, as ALBERT's layers), ReLU between: every weight used once per call."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(4, 4, (3,), padding="SAME", feature_group_count=2, param_dtype=F64, rngs=rngs)
        self.inp = nnx.Linear(2, 4, param_dtype=F64, rngs=rngs)
        self.shared = nnx.Linear(4, 4, param_dtype=F64, rngs=rngs)
        self.head = nnx.Linear(4, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):  # x: (n, T, 2)
        h = jax.nn.relu(self.inp(x))
        for _ in range(3):
            h = jax.nn.relu(self.shared(h))
        h = self.conv(jax.nn.relu(self.conv(h)))
        return self.head(h.mean(-2))


def _shared_data():
    g = np.random.default_rng(11)
    return jnp.asarray(g.normal(size=(5, 6, 2))), jnp.asarray(g.integers(0, 3, size=5))


def test_layers_called_several_times_fast_equals_generic_and_brute_force():
    """A weight used by several products with the activations (a module called several times per
    forward) has one tap per use, and its per-example gradient is the sum of the uses' before the
    square (method §6.1, "Tied weights"): the dense layer's and the grouped convolution's
    diagonals equal brute force and the generic path (the same program traced without such taps),
    for ``ggn`` and ``ggn-mc``, in chunks of 2."""
    from normflat.backends.jax import program, session

    model = NnxShared(nnx.Rngs(3))
    x, y = _shared_data()
    report = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    assert {layer.name: layer.details["path"] for layer in report.layers} == {
        "conv": "fast", "inp": "fast", "shared": "fast", "head": "fast"}
    runs = [dict(estimator="ggn"), dict(estimator="ggn-mc", samples=3, seed=2)]
    fast = [normflat.hessian_diagonal(model, (x, y), progress=False, chunk_size=2, **r) for r in runs]
    session._TRACES.clear()
    session._CACHE.clear()
    saved = program._TIED_USES
    program._TIED_USES = frozenset()
    try:
        generic_report = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
        generic = [normflat.hessian_diagonal(model, (x, y), progress=False, chunk_size=2, **r) for r in runs]
    finally:
        program._TIED_USES = saved
        session._TRACES.clear()
        session._CACHE.clear()
    assert generic_report.layer("shared").details["path"] == generic_report.layer("conv").details["path"] == "generic"
    want = ref_ggn(model, x, y, "nsce")
    brute = {"shared": canon(want["shared/kernel"], "flax"), "inp": canon(want["inp/kernel"], "flax"),
             "head": canon(want["head/kernel"], "flax"),
             "conv": np.asarray(want["conv/kernel"]).transpose(2, 1, 0)}  # (k, in/g, out) -> (out, in/g, k)
    for name, value in brute.items():
        assert_close(fast[0][name], value)
        assert_close(generic[0][name], value)
    for f, g in zip(fast, generic):
        for name in f:
            assert_close(f[name], g[name])


def test_invariance_nnx_shared_layers_conjugated():
    """Hidden unit k times c_k throughout the shared layers: the layer before's column k (kernel
    (in, out)) times c_k, the shared dense kernel ``K -> D⁻¹ K D`` in flax's ``(in, out)`` layout,
    the grouped convolution's ``K[t, j, o] -> K[t, j, o] · c_o / c_i`` (input channel ``i`` of
    output ``o``'s group), the head's row k times 1/c_k: the function and every normalized
    sharpness unchanged, the traces moved."""
    model = NnxShared(nnx.Rngs(3))
    model.shared.bias[...] = jnp.asarray(RNG.normal(size=4)) * 0.3
    model.conv.bias[...] = jnp.asarray(RNG.normal(size=4)) * 0.3
    other = nnx.clone(model)
    c = jnp.asarray([2.0, 0.5, 3.0, 0.25])
    other.inp.kernel[...] = other.inp.kernel[...] * c
    other.inp.bias[...] = other.inp.bias[...] * c
    other.shared.kernel[...] = other.shared.kernel[...] / c[:, None] * c
    other.shared.bias[...] = other.shared.bias[...] * c
    per_group = other.conv.kernel.shape[1]
    inputs = jnp.stack([c[(o // per_group) * per_group + jnp.arange(per_group)] for o in range(4)], axis=1)
    other.conv.kernel[...] = other.conv.kernel[...] * c / inputs[None]
    other.conv.bias[...] = other.conv.bias[...] * c
    other.head.kernel[...] = other.head.kernel[...] / c[:, None]
    x, y = _shared_data()
    before, after = _assert_invariant(model, other, (x, y), model, other)
    for name in ("shared", "conv"):
        assert before.layer(name).details["path"] == after.layer(name).details["path"] == "fast"
        assert abs(before.layer(name).hessian_trace - after.layer(name).hessian_trace) > 1e-3 * abs(
            before.layer(name).hessian_trace)


class NnxRelative(nnx.Module):
    """A projection applied to the activations and to a table the data does not reach, as DeBERTa's
    query and key projections are to its relative-position embeddings: ``q = proj(inp(x))`` per token,
    ``r = proj(rel(arange(T)))`` (every row of the table), the scores ``tanh(q_t · r_t)`` to the head."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(2, 4, param_dtype=F64, rngs=rngs)
        self.rel = nnx.Embed(6, 4, param_dtype=F64, rngs=rngs)
        self.proj = nnx.Linear(4, 4, param_dtype=F64, rngs=rngs)
        self.head = nnx.Linear(6, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):  # x: (n, 6, 2)
        q = self.proj(self.inp(x))
        r = self.proj(self.rel(jnp.arange(6)))  # (6, 4): the same for every sample
        return self.head(jnp.tanh(jnp.einsum("...td,td->...t", q, r)))


class NnxConstantOnly(nnx.Module):
    """A layer applied to a constant only, its output added to the logits: a learned offset, not a map
    of the activations."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(2, 3, param_dtype=F64, rngs=rngs)
        self.offset = nnx.Linear(4, 3, use_bias=False, param_dtype=F64, rngs=rngs)

    def __call__(self, x):  # x: (n, 6, 2)
        return self.inp(x.mean(-2)) + self.offset(jnp.linspace(-1.0, 1.0, 4, dtype=F64))


def _relative_data():
    g = np.random.default_rng(12)
    return jnp.asarray(g.normal(size=(5, 6, 2))), jnp.asarray(g.integers(0, 3, size=5))


def test_projection_also_applied_to_a_table_the_data_does_not_reach():
    """The projection's product with the table's rows is one more use of a weight used several times
    (method §6.1, "Tied weights"): it takes the fast rule (it took the generic path, as DeBERTa-v3's
    query and key projections on Keras' JAX backend), and every diagonal equals brute force and the
    generic path (``ggn``, ``ggn-mc``, chunks of 2). A weight multiplied by such values only (a
    penalty, not a layer) is not tapped."""
    model = NnxRelative(nnx.Rngs(4))
    x, y = _relative_data()
    report = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    assert {layer.name: layer.details["path"] for layer in report.layers} == {
        "inp": "fast", "rel": "fast", "proj": "fast", "head": "fast"}
    want = ref_ggn(model, x, y, "nsce")
    brute = {"inp": canon(want["inp/kernel"], "flax"), "proj": canon(want["proj/kernel"], "flax"),
             "rel": canon(want["rel/embedding"], "flax"), "head": canon(want["head/kernel"], "flax")}
    for kw in (dict(estimator="ggn"), dict(estimator="ggn", chunk_size=2), dict(estimator="ggn-mc", samples=3, seed=2)):
        fast = _hd(model, (x, y), **kw)
        generic = _hd(model, (x, y), fast=False, **kw)
        for name in fast:
            assert_close(fast[name], generic[name])
            if kw["estimator"] == "ggn":
                assert_close(fast[name], brute[name])
    offset = NnxConstantOnly(nnx.Rngs(5))
    report = normflat.analyze(offset, (x, y), estimator="ggn", progress=False)
    assert report.layer("offset").details["path"] == "generic" and report.layer("inp").details["path"] == "fast"
    want = ref_ggn(offset, x, y, "nsce")
    assert_close(_hd(offset, (x, y), estimator="ggn")["offset"], canon(want["offset/kernel"], "flax"))


def test_invariance_projection_also_applied_to_a_table():
    """Feature j entering the projection times c_j from both sides, the input layer's output column
    (and bias) and the table's feature j, the projection's input row j times 1/c_j: the same function,
    every normalized sharpness unchanged (the projection on its fast rule), the traces moved."""
    model = NnxRelative(nnx.Rngs(4))
    other = nnx.clone(model)
    c = jnp.asarray([2.0, 0.5, 3.0, 0.25])
    other.inp.kernel[...] = other.inp.kernel[...] * c
    other.inp.bias[...] = other.inp.bias[...] * c
    other.rel.embedding[...] = other.rel.embedding[...] * c
    other.proj.kernel[...] = other.proj.kernel[...] / c[:, None]
    x, y = _relative_data()
    before, after = _assert_invariant(model, other, (x, y), model, other)
    for name in ("inp", "rel", "proj"):
        assert before.layer(name).details["path"] == after.layer(name).details["path"] == "fast"
        assert abs(before.layer(name).hessian_trace - after.layer(name).hessian_trace) > 1e-3 * abs(
            before.layer(name).hessian_trace), name


# ----------------------------------------------------------------------------- weight normalization (method §3)


class LinenWeightNorm(nn.Module):
    """flax's ``nn.WeightNorm`` (``W = scale · v / ‖v‖``, the norms over every axis but
    ``feature_axes``) around a 1-D convolution and a dense layer, then a plain head."""

    conv_axes: object = -1
    fc_axes: object = -1
    epsilon: float = 1e-12

    @nn.compact
    def __call__(self, x):  # x (n, 6, 2)
        norm = dict(epsilon=self.epsilon, param_dtype=F64)
        h = nn.WeightNorm(nn.Conv(3, (3,), param_dtype=F64, name="conv"), feature_axes=self.conv_axes,
                          name="wn_conv", **norm)(x)
        h = jnp.tanh(h).reshape(x.shape[0], -1)
        h = nn.WeightNorm(nn.Dense(4, param_dtype=F64, name="fc"), feature_axes=self.fc_axes, name="wn_fc",
                          **norm)(h)
        return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h))


class NnxWeightNorm(nnx.Module):
    """``nnx.WeightNorm`` around a 1-D convolution and a dense layer, then a plain head. Its scales
    are plain arrays (not ``nnx.Param``s), and its forward writes ``scale · v / ‖v‖`` into the
    wrapped layer's kernel in place."""

    def __init__(self, rngs, axes=-1, epsilon=1e-12):
        norm = dict(feature_axes=axes, epsilon=epsilon, param_dtype=F64, rngs=rngs)
        self.conv = nnx.WeightNorm(nnx.Conv(2, 3, (3,), param_dtype=F64, rngs=rngs), **norm)
        self.fc = nnx.WeightNorm(nnx.Linear(18, 4, param_dtype=F64, rngs=rngs), **norm)
        self.head = nnx.Linear(4, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.conv(x)).reshape(x.shape[0], -1)
        return self.head(jnp.tanh(self.fc(h)))


WN_X = jnp.asarray(RNG.normal(size=(5, 6, 2)))
WN_Y = jnp.asarray([0, 1, 2, 0, 1])


def _weight_norm_model(api, axes=(-1, -1), epsilon=1e-12):
    """``(model, apply)``: the scales and biases drawn away from their initial ones and zeros;
    ``apply(x)`` computes the logits without changing the model (nnx's forward writes its kernels)."""
    g = np.random.default_rng(4)
    if api == "linen":
        module = LinenWeightNorm(*axes, epsilon=epsilon)
        variables = module.init(jax.random.key(4), WN_X)
        params = jax.tree_util.tree_map_with_path(
            lambda p, a: (jnp.exp(0.5 * g.normal(size=a.shape)) if "scale" in _key_name(p[-1])
                          else 0.3 * g.normal(size=a.shape) if _key_name(p[-1]) == "bias" else a),
            variables["params"])
        variables = {"params": params}
        return (module, variables), lambda x: module.apply(variables, x)
    model = NnxWeightNorm(nnx.Rngs(4), axes[0], epsilon)
    for wrapper in (model.conv, model.fc):
        wrapper.scales[("kernel",)] = jnp.exp(0.5 * g.normal(size=wrapper.scales[("kernel",)].shape))
        wrapper.layer_instance.bias[...] = 0.3 * g.normal(size=wrapper.layer_instance.bias.shape)
    return model, lambda x: nnx.clone(model)(x)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_flax_weight_norm_direction_against_brute_force(api):
    """flax's weight normalization ``W = scale · v / ‖v‖`` (linen's ``nn.WeightNorm`` and
    ``nnx.WeightNorm``, norms per output feature): the stored kernel is the direction ``v``, analyzed
    under the wrapped layer's name on the generic path, which differentiates the normalization in the
    traced forward (method §3, "Weight normalization"; §6.1); linen's ``scale`` vectors are excluded
    as scales, nnx's are not parameters (plain arrays) and appear nowhere; the coverage is whole,
    the ``ggn`` diagonal of ``v`` the brute-force one, and analyzing leaves an nnx model's kernels as
    they were (its forward overwrites them)."""
    model, _ = _weight_norm_model(api)
    prefix = "" if api == "linen" else "/layer_instance"
    conv, fc = f"conv{prefix}", f"fc{prefix}"
    if api == "nnx":
        stored = np.asarray(model.fc.layer_instance.kernel[...]).copy()
    report = normflat.analyze(model, (WN_X, WN_Y), estimator="ggn", progress=False)
    assert report.metadata["coverage"] == 1.0 and report.metadata["unsupported"] == []
    assert {layer.name for layer in report.layers} == {conv, fc, "head"}
    for name in (conv, fc):
        details = report.layer(name).details
        assert details["param"] == f"{name}/kernel" and details["path"] == "generic", details
    scales = {k for k in report.metadata["excluded"] if "scale" in k}
    assert scales == ({"wn_conv/conv/kernel/scale", "wn_fc/fc/kernel/scale"} if api == "linen" else set())
    if api == "nnx":
        np.testing.assert_array_equal(np.asarray(model.fc.layer_instance.kernel[...]), stored)
        ref = ref_ggn(model, WN_X, WN_Y, "nsce")
    else:
        ref = ref_ggn(model[0], WN_X, WN_Y, "nsce", model[1])
    diag = _hd(model, (WN_X, WN_Y), estimator="ggn")
    assert set(diag) == {conv, fc, "head"}
    assert_close(diag[conv], np.asarray(ref[f"{conv}/kernel"]).transpose(2, 1, 0))  # (k, in, out) -> (out, in, k)
    assert_close(diag[fc], canon(ref[f"{fc}/kernel"], "flax"))
    assert_close(diag["head"], canon(ref["head/kernel"], "flax"))


@pytest.mark.parametrize("api, axes", [("linen", (-1, -1)), ("linen", (1, 0)), ("linen", (None, None)),
                                       ("nnx", (-1, -1))])
def test_flax_weight_norm_direction_rescaling_invariance(api, axes):
    """``W = scale · v / ‖v‖`` does not change when a slice of ``v`` normalized together is
    multiplied by a positive factor: per output feature (flax's default ``feature_axes=-1``: a row
    scaling), per input channel (``feature_axes`` the input axis: a column scaling) or the whole
    tensor (``None``). The function stays (the normalization epsilon is 0 here), every layer's
    normalized sharpness stays, and the Hessian trace of each rescaled direction moves (method §3,
    "Weight normalization"; §8)."""
    model, apply = _weight_norm_model(api, axes, epsilon=0.0)
    g = np.random.default_rng(5)

    def rescale(v, feature_axes):
        keep = () if feature_axes is None else (feature_axes % v.ndim,)
        shape = tuple(d if i in keep else 1 for i, d in enumerate(v.shape))
        return v * jnp.exp(g.normal(size=shape))

    if api == "linen":
        module, variables = model
        params = dict(variables["params"])
        for name, feature_axes in zip(("conv", "fc"), axes):
            params[name] = {**params[name], "kernel": rescale(params[name]["kernel"], feature_axes)}
        other = (module, {"params": params})
        other_apply = lambda x: module.apply(other[1], x)  # noqa: E731
    else:
        other = nnx.clone(model)
        for wrapper in (other.conv, other.fc):
            kernel = wrapper.layer_instance.kernel
            kernel[...] = rescale(kernel[...], axes[0])
        other_apply = lambda x: nnx.clone(other)(x)  # noqa: E731
    before, after = _assert_invariant(model, other, (WN_X, WN_Y), apply, other_apply)
    for name in ("conv", "fc") if api == "linen" else ("conv/layer_instance", "fc/layer_instance"):
        tb, ta = before.layer(name).hessian_trace, after.layer(name).hessian_trace
        assert abs(ta - tb) > 1e-3 * abs(tb), name


class NnxIdle(nnx.Module):
    """A classifier with a dense layer no forward uses (a head left over from pre-training)."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 6, param_dtype=F64, rngs=rngs)
        self.head = nnx.Linear(6, 3, param_dtype=F64, rngs=rngs)
        self.spare = nnx.Linear(6, 5, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.hidden(x)))


def test_weights_no_forward_uses_are_reported_unused():
    """A weight no operation of the traced forward uses has zero curvature and takes no path (its
    per-example gradients are symbolic zeros): its details say so, as in the other backends
    (method §6.1, "Weights no forward uses"); the other weights keep their fast rules."""
    model = NnxIdle(nnx.Rngs(3))
    x, y = jnp.asarray(RNG.normal(size=(5, 4))), jnp.asarray([0, 1, 2, 1, 0])
    report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    spare = report.layer("spare").details
    assert spare["path"] == "fast" and "its curvature is zero" in spare["unused"] and "generic_reason" not in spare
    assert report.layer("spare").hessian_trace == 0.0
    assert all("unused" not in layer.details and layer.details["path"] == "fast"
               for layer in report.layers if layer.name != "spare")
    got = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert not np.any(np.asarray(got["spare"]))


# ----------------------------------------------------------------------------- transposed convolutions


class NnxTransposed(nnx.Module):
    """A convolution, then transposed convolutions with ``"SAME"``, ``"VALID"`` and explicit padding,
    strides per axis and a kernel dilation, into a dense head."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 3, (2, 2), padding="SAME", rngs=rngs, param_dtype=F64)
        self.up0 = nnx.ConvTranspose(3, 4, (3, 3), strides=(2, 2), padding="SAME", rngs=rngs, param_dtype=F64)
        self.up1 = nnx.ConvTranspose(4, 2, (2, 3), strides=(1, 2), padding="VALID", kernel_dilation=(2, 1),
                                     rngs=rngs, param_dtype=F64)
        self.up2 = nnx.ConvTranspose(2, 2, (2, 2), padding=((1, 0), (0, 1)), rngs=rngs, param_dtype=F64)
        self.head = nnx.Linear(2 * 8 * 13, 3, rngs=rngs, param_dtype=F64)

    def __call__(self, x):
        h = jax.nn.relu(self.conv(x))
        h = jnp.tanh(self.up0(h))
        h = jax.nn.relu(self.up1(h))
        return self.head(self.up2(h).reshape(x.shape[0], -1))


class LinenTransposed(nn.Module):
    """The same layers in linen."""

    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(nn.Conv(3, (2, 2), padding="SAME", param_dtype=F64, name="conv")(x))
        h = jnp.tanh(nn.ConvTranspose(4, (3, 3), strides=(2, 2), padding="SAME", param_dtype=F64, name="up0")(h))
        h = jax.nn.relu(nn.ConvTranspose(2, (2, 3), strides=(1, 2), padding="VALID", kernel_dilation=(2, 1),
                                         param_dtype=F64, name="up1")(h))
        h = nn.ConvTranspose(2, (2, 2), padding=((1, 0), (0, 1)), param_dtype=F64, name="up2")(h)
        return nn.Dense(3, param_dtype=F64, name="head")(h.reshape(x.shape[0], -1))


class EqxTransposed(eqx.Module):
    """Per example ``(C, H, W)``: a convolution, a grouped strided transposed convolution with padding,
    output padding and dilation, and a 1-D one over the rows."""

    conv: eqx.nn.Conv2d
    up0: eqx.nn.ConvTranspose2d
    up1: eqx.nn.ConvTranspose1d
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.conv = eqx.nn.Conv2d(2, 4, 2, padding=1, dtype=F64, key=k[0])
        self.up0 = eqx.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, dilation=(1, 2), groups=2,
                                          dtype=F64, key=k[1])
        self.up1 = eqx.nn.ConvTranspose1d(6, 2, 2, stride=2, dtype=F64, key=k[2])
        self.head = eqx.nn.Linear(2 * 8 * 20, 3, dtype=F64, key=k[3])

    def __call__(self, x):
        h = jax.nn.relu(self.conv(x))
        h = jnp.tanh(self.up0(h))  # (6, 8, 10)
        h = jax.vmap(self.up1, in_axes=1, out_axes=1)(h)  # each row: (6, 10) -> (2, 20)
        return self.head(h.reshape(-1))


def _transposed_model(api):
    """``(model, variables, data, expected)``: ``expected`` as :func:`check` takes it."""
    if api == "eqx":
        x = jnp.asarray(RNG.normal(size=(4, 2, 3, 3)))
        model, variables = EqxTransposed(jax.random.key(5)), None
        expected = {name: (f"{name}/weight", "eqx") for name in ("conv", "head")}
        expected.update({name: (f"{name}/weight", "up_eqx") for name in ("up0", "up1")})
    else:
        x = jnp.asarray(RNG.normal(size=(4, 3, 3, 2)))
        if api == "nnx":
            model, variables = NnxTransposed(nnx.Rngs(5)), None
        else:
            model = LinenTransposed()
            variables = model.init(jax.random.key(5), x)
        expected = {"conv": ("conv/kernel", "conv_flax")}
        expected.update({name: (f"{name}/kernel", "up_flax") for name in ("up0", "up1", "up2")})
        expected["head"] = ("head/kernel", "flax")
    return model, variables, (x, jnp.asarray([0, 1, 2, 1])), expected


def _canonical_conv(a, kind):
    """A convolution kernel in the canonical ``(out, in/groups, *k)`` layout: flax ``(*k, in, out)``
    moved, equinox's as is; a transposed convolution's (``up_*``) also flipped on its kernel axes,
    torch's orientation (flax and equinox correlate the dilated input with the kernel, method §3); a
    dense kernel by :func:`canon`."""
    a = np.asarray(a)
    if kind in ("conv_flax", "up_flax"):
        a = a.transpose((a.ndim - 1, a.ndim - 2) + tuple(range(a.ndim - 2)))
    if kind.startswith("up_"):
        return a[(slice(None), slice(None)) + (slice(None, None, -1),) * (a.ndim - 2)]
    return a if kind == "conv_flax" else canon(a, kind)


@pytest.mark.parametrize("api", ["nnx", "linen", "eqx"])
def test_transposed_convolutions_ggn_and_exact(api):
    """flax's ``ConvTranspose`` (nnx and linen, kernel ``(*k, in, out)``) and equinox's
    ``ConvTranspose1d/2d`` (``(out, in/groups, *k)``, grouped) against brute force: ``ggn`` (nsce)
    on their taps (method §6.1), ``exact`` (ce) for the transposed kernels; the kind, the groups and
    the fast path in the report."""
    model, variables, (x, y), expected = _transposed_model(api)
    target = model if variables is None else (model, variables)
    ref = ref_ggn(model, x, y, "nsce", variables)
    got = _hd(target, (x, y), estimator="ggn")
    assert set(got) == set(expected)
    for name, (leaf, kind) in expected.items():
        assert_close(got[name], _canonical_conv(ref[leaf], kind))
    ups = [name for name in expected if name.startswith("up")]
    exact = _hd(target, (x, y), estimator="exact", loss="ce")
    ref = ref_exact(model, x, y, "ce", [expected[name][0] for name in ups], variables)
    for name in ups:
        assert_close(exact[name], _canonical_conv(ref[expected[name][0]], expected[name][1]))
    report = normflat.analyze(target, (x, y), progress=False)
    assert {layer.name: layer.details["path"] for layer in report.layers} == dict.fromkeys(expected, "fast")
    assert report.layer("up0").kind == "conv_transpose2d"
    assert report.layer("up0").details["groups"] == (2 if api == "eqx" else 1)


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_flax_transposed_kernel_layout_is_refused(api):
    """``transpose_kernel=True`` stores the kernel ``(*k, out, in)``, flipped where it is applied: reported
    as unsupported with the fix, never read in the wrong layout."""
    x = jnp.asarray(RNG.normal(size=(3, 3, 3, 2)))
    y = jnp.asarray([0, 1, 2])
    if api == "nnx":
        class Model(nnx.Module):
            def __init__(self, rngs):
                self.up = nnx.ConvTranspose(2, 3, (2, 2), transpose_kernel=True, rngs=rngs, param_dtype=F64)
                self.head = nnx.Linear(3 * 9, 3, rngs=rngs, param_dtype=F64)

            def __call__(self, x):
                return self.head(jnp.tanh(self.up(x)).reshape(x.shape[0], -1))

        target = Model(nnx.Rngs(1))
    else:
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                h = nn.ConvTranspose(3, (2, 2), transpose_kernel=True, param_dtype=F64, name="up")(x)
                return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h).reshape(x.shape[0], -1))

        module = Model()
        target = (module, module.init(jax.random.key(1), x))
    with pytest.warns(UserWarning, match="transpose_kernel=True"):
        report = normflat.analyze(target, (x, y), progress=False)
    assert [layer.name for layer in report.layers] == ["head"]
    assert any("transpose_kernel=True" in str(u) for u in report.metadata["unsupported"])
