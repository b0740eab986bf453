"""Keras EinsumDense, MultiHeadAttention, Embedding, position tables, a ``ReversibleEmbedding`` tied to the
LM head, recurrent layers, transposed convolutions, and token logits (method §3, §6.1, §6.3, §8).

Every diagonal is checked against a reference built here, independently of the
backend: full per-sample Jacobians of the (normalized) logits with respect to
each analyzed variable (``tf.GradientTape.jacobian``), the per-token loss
Hessian ``diag(p) − p pᵀ`` in those logits, and the canonical layouts of
method §3 written out per layer. The ``exact`` estimator is checked against the
diagonal of the full Hessian of the mean loss. Everything in float64.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import normflat  # noqa: E402
from normflat.engine.options import NSCE_EPS  # noqa: E402
from tests.arch._keras_invariance import invariance_tolerance  # noqa: E402

L = keras.layers
F64 = "float64"
RTOL = 1e-10


# ----------------------------------------------------------------------------- canonical layouts (method §3)


def _transposed(k):
    return k.T


def _einsum_abc_cd(k):  # "abc,cd->abd": kernel (c, d) -> (d, c)
    return k.T


def _einsum_abc_bcd(k):  # "abc,bcd->ad": kernel (b, c, d) -> (d, b·c)
    return k.transpose(2, 0, 1).reshape(k.shape[2], -1)


def _mha_in(k):  # query/key/value kernel (d, H, hd) -> (H·hd, d), rows head-major
    return k.transpose(1, 2, 0).reshape(-1, k.shape[0])


def _mha_out(k):  # output kernel (H, hd, d) -> (d, H·hd)
    return k.transpose(2, 0, 1).reshape(k.shape[2], -1)


def _mha(prefix):
    return {f"{prefix}/query": ("query", _mha_in), f"{prefix}/key": ("key", _mha_in),
            f"{prefix}/value": ("value", _mha_in), f"{prefix}/attention_output": ("attention_output", _mha_out)}


# ----------------------------------------------------------------------------- references


def _normalized(z, loss):
    if loss == "nsce":
        zc = z - tf.reduce_mean(z, axis=-1, keepdims=True)
        return zc / tf.sqrt(tf.reduce_mean(zc**2, axis=-1, keepdims=True) + NSCE_EPS)
    return z


def ggn_reference(model, variables, x, y, loss):
    """``(1/N) Σ_n Σ_t counted J_ntᵀ (diag p − p pᵀ) J_nt`` per variable, native layout.

    ``y`` is ``(n,)`` for ``(n, C)`` logits or ``(n, T)`` token labels with negative
    entries not counted; ``N`` the number of counted terms.
    """
    @tf.function(autograph=False)
    def logits_and_jacobians(x):
        # A graph: the Jacobian's loop over the logits runs there, not one eager backward per logit
        # (15 s against 2 s through a keras-hub model's loop over time).
        with tf.GradientTape() as tape:
            # float64 logits (a float32 reverse projection's too: the tape's Jacobian wants one dtype)
            u = _normalized(tf.cast(model(x, training=False), tf.float64), loss)
            u3 = u[:, None, :] if len(u.shape) == 2 else u  # (n, T, C), T = 1 for a classifier
        return u3, tape.jacobian(u3, [v.value for v in variables], experimental_use_pfor=False)

    u3, jacobians = logits_and_jacobians(x)
    y2 = np.asarray(y).reshape(u3.shape[:2])
    p = tf.nn.softmax(u3).numpy()
    c = p.shape[-1]
    hess = np.einsum("nta,ab->ntab", p, np.eye(c)) - np.einsum("nta,ntb->ntab", p, p)
    counted = (y2 >= 0).astype(np.float64)
    hess = hess * counted[:, :, None, None]
    out = []
    for v, jac in zip(variables, jacobians):  # (n, T, C, *shape) each
        j = tf.convert_to_tensor(jac).numpy().reshape(*u3.shape, -1)
        out.append(np.einsum("ntai,ntab,ntbi->i", j, hess, j).reshape(v.shape) / counted.sum())
    return out


def hessian_reference(model, variables, x, y, loss):
    """Diagonal of the full Hessian of the mean loss over the counted terms, per variable."""
    y2 = np.asarray(y)
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            u = _normalized(model(x, training=False), loss)
            counted = y2 >= 0
            ce = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.constant(np.where(counted, y2, 0)), u)
            value = tf.reduce_sum(ce * counted) / counted.sum()
        grads = inner.gradient(value, [v.value for v in variables])
        grads = [tf.convert_to_tensor(g) for g in grads]
    out = []
    for v, g in zip(variables, grads):
        h = outer.jacobian(g, v.value, experimental_use_pfor=False).numpy()
        size = int(np.prod(v.shape))
        out.append(np.diag(h.reshape(size, size)).reshape(v.shape))
    return out


def _joined(got, name):
    """The diagonal of one variable: as is, or its gate / q-k-v blocks stacked back."""
    if name in got:
        return np.asarray(got[name])
    parts = [np.asarray(v) for k, v in got.items() if k.rsplit(".", 1)[0] == name]
    assert parts, (name, list(got))
    return np.concatenate(parts, axis=0)


def _layer_variable(model, path):
    for v in model.weights:
        if v.path == path:
            return v
    raise KeyError(path)


def _fast_equals_brute_force_and_generic(model, x, y, expected, seed=4):
    """``ggn`` (nsce) against brute force, whole and in chunks of 2, and ``ggn-mc`` and chunked ``ggn``
    against the generic path (``fast=False``), every analyzed weight."""
    check_against(model, x, y, expected, loss="nsce")
    check_against(model, x, y, expected, loss="nsce", chunk_size=2)
    for kw in (dict(estimator="ggn-mc", samples=3, seed=seed), dict(estimator="ggn", chunk_size=2)):
        fast = normflat.hessian_diagonal(model, (x, y), loss="nsce", progress=False, **kw)
        generic = normflat.hessian_diagonal(model, (x, y), loss="nsce", progress=False, fast=False, **kw)
        for name in fast:
            np.testing.assert_allclose(np.asarray(fast[name]), np.asarray(generic[name]), rtol=RTOL,
                                       atol=1e-14 * np.abs(np.asarray(generic[name])).max(), err_msg=name)


def check_against(model, x, y, expected, loss="ce", estimator="ggn", reference=ggn_reference, **kw):
    """``expected``: ``{report name: (variable path, canonical fn)}``; every name is compared."""
    got = normflat.hessian_diagonal(model, (x, y), loss=loss, estimator=estimator, progress=False, **kw)
    variables = [_layer_variable(model, path) for path, _ in expected.values()]
    refs = reference(model, variables, x, y, loss)
    for (name, (_, canonical)), ref in zip(expected.items(), refs):
        np.testing.assert_allclose(_joined(got, name), canonical(ref), rtol=RTOL, atol=1e-14 * np.abs(ref).max(),
                                   err_msg=name)
    return got


def _rng(seed):
    keras.utils.set_random_seed(seed)
    return np.random.default_rng(seed)


def _randomize(model, rng, scale=0.7):
    """Random weights, biases included (so that no curvature vanishes by symmetry)."""
    for v in model.weights:
        v.assign(rng.normal(size=v.shape) * scale)


# ----------------------------------------------------------------------------- brute force


@pytest.mark.parametrize("fast", [True, False])
def test_einsum_dense_two_equations(fast):
    rng = _rng(1)
    inp = keras.Input((3, 4), dtype=F64)
    h = L.EinsumDense("abc,cd->abd", output_shape=(3, 5), bias_axes="d", activation="tanh", dtype=F64,
                      name="e1")(inp)
    out = L.EinsumDense("abc,bcd->ad", output_shape=3, dtype=F64, name="e2")(h)
    model = keras.Model(inp, out)
    _randomize(model, rng)
    x, y = rng.normal(size=(4, 3, 4)), rng.integers(0, 3, 4)
    got = check_against(model, x, y, {"e1": ("e1/kernel", _einsum_abc_cd), "e2": ("e2/kernel", _einsum_abc_bcd)},
                        loss="nsce", fast=fast)
    assert got["e2"].shape == (3, 15)
    rep = normflat.analyze(model, (x, y), progress=False, fast=fast)
    assert [l.details["path"] for l in rep.layers] == ["fast" if fast else "generic"] * 2


def test_einsum_with_a_batch_like_kernel_axis_is_refused():
    inp = keras.Input((3, 4), dtype=F64)
    # "b" is in the input, the kernel and the output: one matrix per b, not one linear map.
    h = L.EinsumDense("abc,bcd->abd", output_shape=(3, 2), dtype=F64, name="per_position")(inp)
    model = keras.Model(inp, L.Dense(2, dtype=F64, name="head")(L.Flatten()(h)))
    x, y = np.ones((2, 3, 4)), np.array([0, 1])
    with pytest.raises(ValueError, match=r"per_position.*kernel axes \['b'\] appear in the input and the output"):
        normflat.analyze(model, (x, y), loss="ce", on_unsupported="error", progress=False)
    with pytest.warns(UserWarning, match="per_position"):
        rep = normflat.analyze(model, (x, y), loss="ce", progress=False)
    assert [l.name for l in rep.layers] == ["head"]
    assert rep.metadata["coverage"] < 0.5


def attention_model_problem():
    rng = _rng(2)
    inp = keras.Input((3, 4), dtype=F64)
    a = L.MultiHeadAttention(num_heads=2, key_dim=2, dtype=F64, name="mha")(inp, inp)
    out = L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(a))
    model = keras.Model(inp, out)
    _randomize(model, rng)
    return model, rng.normal(size=(3, 3, 4)), rng.integers(0, 3, 3)


@pytest.fixture(scope="module")
def attention_model():
    return attention_model_problem()


def shared_attention_model(scales=None):
    """One ``MultiHeadAttention`` layer applied twice in sequence (ALBERT's layer shared across depth),
    a residual ``tanh`` between: each ``EinsumDense`` called twice. ``scales``: ``(c, d)`` per head,
    the query times c and the key divided by it, the value times d and the output's rows divided
    by it (the same function at each call)."""
    rng = _rng(34)
    inp = keras.Input((3, 4), dtype=F64)
    mha = L.MultiHeadAttention(num_heads=2, key_dim=2, dtype=F64, name="mha")
    h = L.Add(dtype=F64)([inp, L.Activation("tanh", dtype=F64)(mha(inp, inp))])
    h = mha(h, h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng)
    if scales is not None:
        c, d = scales
        q, k, v, o = mha._query_dense, mha._key_dense, mha._value_dense, mha._output_dense
        for layer, factor in ((q, c), (k, 1 / c), (v, d)):
            layer.kernel.assign(layer.kernel.numpy() * factor[None, :, None])
            layer.bias.assign(layer.bias.numpy() * factor[:, None])
        o.kernel.assign(o.kernel.numpy() / d[:, None, None])
    return model, rng.normal(size=(5, 3, 4)), rng.integers(0, 3, 5)


def test_multi_head_attention_called_twice_fast_rule():
    """Each ``EinsumDense`` of an attention layer called twice per forward: the dense rule over both
    calls' positions (method §6.1, "Tied weights"), against brute force and the generic path (``ggn``,
    ``ggn-mc``, chunks of 2)."""
    model, x, y = shared_attention_model()
    report = normflat.analyze(model, (x, y), loss="nsce", progress=False)
    assert {layer.details["path"] for layer in report.layers} == {"fast"}, [
        (layer.name, layer.details) for layer in report.layers]
    expected = {k: (f"mha/{v[0]}/kernel", v[1]) for k, v in _mha("mha").items()}
    expected["head"] = ("head/kernel", _transposed)
    _fast_equals_brute_force_and_generic(model, x, y, expected)


def test_multi_head_attention_called_twice_per_head_rescalings_are_invariant():
    model, x, y = shared_attention_model()
    twin, _, _ = shared_attention_model((np.array([3.0, 0.25]), np.array([0.5, 4.0])))
    rtol = invariance_tolerance(twin(x), model(x))
    _assert_invariant(_analyze(model, x, y), _analyze(twin, x, y), rtol)


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_multi_head_attention_ggn(attention_model, loss):
    model, x, y = attention_model
    expected = {k: (f"mha/{v[0]}/kernel", v[1]) for k, v in _mha("mha").items()}
    expected["head"] = ("head/kernel", _transposed)
    got = check_against(model, x, y, expected, loss=loss)
    assert got["mha/query"].shape == (4, 4) and got["mha/attention_output"].shape == (4, 4)


def test_multi_head_attention_exact(attention_model):
    model, x, y = attention_model
    expected = {k: (f"mha/{v[0]}/kernel", v[1]) for k, v in _mha("mha").items()}
    check_against(model, x, y, expected, loss="nsce", estimator="exact", reference=hessian_reference)


@pytest.mark.parametrize("fast", [True, False])
def test_embedding_with_repeated_ids(fast):
    rng = _rng(3)
    inp = keras.Input((4,), dtype="int32")
    h = L.Embedding(6, 3, dtype=F64, name="emb")(inp)
    out = L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(L.Activation("tanh", dtype=F64)(h)))
    model = keras.Model(inp, out)
    _randomize(model, rng)
    # repeats within and across samples; Keras' take reads row 6 − 1 for id −1, also looked up as 5 by the
    # sample before (the rows of two samples must not meet)
    x = np.array([[1, 1, 2, 5], [-1, 3, 3, 3], [5, 1, -1, 1]], dtype="int32")
    got = check_against(model, x, rng.integers(0, 3, 3), {"emb": ("emb/embeddings", _transposed),
                                                          "head": ("head/kernel", _transposed)}, fast=fast)
    assert got["emb"].shape == (3, 6)
    assert np.all(np.asarray(got["emb"])[:, 4] == 0)  # id 4 never looked up: no curvature


class PatchPositions(L.Layer):
    """A custom ViT layer holding a learned ``(1, N, d)`` position table as a loose weight.

    ``use``: ``add`` as ViTs do (sliced to the tokens); ``first`` indexes the table's leading
    axis (``P[0]``, which with the table expanded over the batch reads sample 0's row: the
    samples' gradients would mix); ``alias`` also reads it through a second reference;
    ``reshaped`` reshapes it without its batch axis (the forward fails with the expanded table);
    ``summed`` sums its leading axis (the logits change with the expanded table).
    """

    def __init__(self, positions, use="add", **kwargs):
        super().__init__(**kwargs)
        self.positions, self.use = positions, use

    def build(self, input_shape):
        self.pos_embed = self.add_weight(shape=(1, self.positions, int(input_shape[-1])), name="pos_embed")
        object.__setattr__(self, "alias", [self.pos_embed])  # untracked: a second way to the variable

    def call(self, x):
        t = tf.shape(x)[1]
        if self.use == "first":
            return x + self.pos_embed[0, :t]
        if self.use == "reshaped":
            return x + tf.reshape(self.pos_embed, [self.positions, -1])[:t]
        if self.use == "summed":
            return x + tf.reduce_sum(self.pos_embed, axis=0)[:t]
        if self.use == "alias":
            return x + self.pos_embed[:, :t] + 0.5 * self.alias[0][:, :t]
        return x + self.pos_embed[:, :t]


def _patch_model(positions: L.Layer, seed: int, samples: int):
    """Patches ``(3, 2)`` -> Dense -> ``positions`` (named ``vit``) -> a tanh mixer -> average over
    the tokens -> head: one logit row per sample; random weights, ``samples`` inputs and labels."""
    rng = _rng(seed)
    inp = keras.Input((3, 2), dtype=F64)
    h = positions(L.Dense(4, dtype=F64, name="patch")(inp))
    h = L.Dense(6, activation="tanh", dtype=F64, name="mix")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.GlobalAveragePooling1D(dtype=F64)(h)))
    _randomize(model, rng)
    return model, rng.normal(size=(samples, 3, 2)), rng.integers(0, 3, samples)


def position_model(use="add", seed=12):
    """:func:`_patch_model` with the position table (5 positions, sliced to 3)."""
    return _patch_model(PatchPositions(5, use=use, dtype=F64, name="vit"), seed, 3)


def _positions(k):  # a (1, N, d) table -> (features, positions)
    return k.reshape(-1, k.shape[-1]).T


#: The analyzed weights of ``position_model`` and their canonical layouts.
POSITION_LAYERS = {"patch": ("patch/kernel", _transposed), "vit/pos_embed": ("vit/pos_embed", _positions),
                   "mix": ("mix/kernel", _transposed), "head": ("head/kernel", _transposed)}


def test_loose_position_table_fast_rule():
    """A loose ``(1, N, d)`` table's fast rule (method §6.1 "Position tables"): the model runs with
    the table expanded over the batch. ``ggn`` against brute force on the fast and the generic path;
    ``ggn-mc`` and ``ggn-topk`` fast against generic (the same draws); batches of 3 and 2."""
    model, x, y = position_model()
    rep = normflat.analyze(model, (x, y), progress=False)
    assert rep.layer("vit/pos_embed").details["path"] == "fast", rep.layer("vit/pos_embed").details
    assert rep.layer("vit/pos_embed").shape == (4, 5) and rep.metadata["coverage"] == 1.0
    for n in (3, 2):
        got = check_against(model, x[:n], y[:n], POSITION_LAYERS, loss="nsce")
        check_against(model, x[:n], y[:n], POSITION_LAYERS, loss="nsce", fast=False)
        assert np.all(np.asarray(got["vit/pos_embed"])[:, 3:] == 0)  # rows past the tokens: never read
        for kw in (dict(estimator="ggn-mc", samples=3, seed=4), dict(estimator="ggn-topk", top_classes=1,
                                                                       samples=3, seed=5)):
            fast = normflat.hessian_diagonal(model, (x[:n], y[:n]), progress=False, **kw)
            generic = normflat.hessian_diagonal(model, (x[:n], y[:n]), progress=False, fast=False, **kw)
            assert set(fast) == set(POSITION_LAYERS)
            for k in fast:
                # ggn-topk squares the fast head exactly (method §6.2), the generic path samples it
                want = got[k] if (k, kw["estimator"]) == ("head", "ggn-topk") else generic[k]
                np.testing.assert_allclose(np.asarray(fast[k]), np.asarray(want), rtol=RTOL, err_msg=k)
    assert model.get_layer("vit").pos_embed is model.get_layer("vit").__dict__["pos_embed"]  # put back


@pytest.mark.parametrize("use, reason", [
    ("first", "not added to each sample's own activations"),
    ("alias", "also used outside its layer attribute"),
    ("reshaped", "fails with the position table expanded over the batch"),
    ("summed", "computes other logits with the position table expanded over the batch"),
])
def test_loose_position_table_read_otherwise_takes_the_exact_generic_path(use, reason):
    """A table read in a way the expanded view would get wrong (the leading axis indexed, a second
    reference, a reshape without the batch axis, a sum over the batch axis) is refused on the first forward: the generic
    path, with its reason, and the brute-force numbers; a first batch of one row is checked too."""
    model, x, y = position_model(use)
    for n in (3, 1):
        rep = normflat.analyze(model, (x[:n], y[:n]), progress=False)
        details = rep.layer("vit/pos_embed").details
        assert details["path"] == "generic" and reason in details["generic_reason"], details
        assert rep.layer("mix").details["path"] == "fast"
    check_against(model, x, y, POSITION_LAYERS, loss="nsce")


def recurrent_model_problem():
    rng = _rng(4)
    inp = keras.Input((3, 2), dtype=F64)
    h = L.LSTM(2, return_sequences=True, dtype=F64, name="lstm")(inp)
    h = L.Bidirectional(L.GRU(2, return_sequences=True, dtype=F64, name="gru"), dtype=F64, name="bi")(h)
    h = L.GRU(2, return_sequences=True, reset_after=False, dtype=F64, name="gru_v1")(h)
    h = L.SimpleRNN(2, dtype=F64, name="rnn")(h)
    out = L.Dense(3, dtype=F64, name="head")(h)
    model = keras.Model(inp, out)
    _randomize(model, rng)
    return model, rng.normal(size=(3, 3, 2)), rng.integers(0, 3, 3)


@pytest.fixture(scope="module")
def recurrent_model():
    return recurrent_model_problem()


def test_recurrent_layers_ggn_through_time(recurrent_model):
    model, x, y = recurrent_model
    expected = {}
    for layer, cell in [("lstm", "lstm_cell"), ("bi/forward_gru", "gru_cell"), ("bi/backward_gru", "gru_cell"),
                        ("gru_v1", "gru_cell"), ("rnn", "simple_rnn_cell")]:
        for w in ("kernel", "recurrent_kernel"):
            expected[f"{layer}/{cell}/{w}"] = (f"{layer}/{cell}/{w}", _transposed)
    got = check_against(model, x, y, expected, loss="nsce")
    assert [k for k in got if k.startswith("lstm/lstm_cell/kernel")] == [
        f"lstm/lstm_cell/kernel.{g}" for g in "ifco"]
    assert [k for k in got if k.startswith("gru_v1/gru_cell/recurrent_kernel")] == [
        f"gru_v1/gru_cell/recurrent_kernel.{g}" for g in "zrh"]
    assert got["lstm/lstm_cell/recurrent_kernel.f"].shape == (2, 2)
    assert "rnn/simple_rnn_cell/kernel" in got  # no gates: one matrix


def test_lstm_exact():
    rng = _rng(5)
    inp = keras.Input((3, 2), dtype=F64)
    out = L.Dense(2, dtype=F64, name="head")(L.LSTM(2, dtype=F64, name="lstm")(inp))
    model = keras.Model(inp, out)
    _randomize(model, rng)
    x, y = rng.normal(size=(2, 3, 2)), np.array([0, 1])
    check_against(model, x, y, {"lstm/lstm_cell/kernel": ("lstm/lstm_cell/kernel", _transposed),
                                "lstm/lstm_cell/recurrent_kernel": ("lstm/lstm_cell/recurrent_kernel", _transposed)},
                  loss="ce", estimator="exact", reference=hessian_reference)


def token_model_problem():
    """A token language model: Embedding, one attention block, a vocabulary head, logits (B, T, V)."""
    rng = _rng(6)
    inp = keras.Input((4,), dtype="int32")
    e = L.Embedding(7, 4, dtype=F64, name="emb")(inp)
    a = L.MultiHeadAttention(num_heads=2, key_dim=2, dtype=F64, name="mha")(e, e, use_causal_mask=True)
    h = L.Add(dtype=F64)([e, a])
    out = L.Dense(5, dtype=F64, name="lm_head")(h)
    model = keras.Model(inp, out)
    _randomize(model, rng)
    x = rng.integers(0, 7, (3, 4)).astype("int32")
    y = rng.integers(0, 5, (3, 4))
    y[0, 3] = y[2, 0] = y[2, 1] = -100  # padding and a prompt, not counted
    return model, x, y


@pytest.fixture(scope="module")
def token_model():
    return token_model_problem()


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_token_logits_with_ignore_index(token_model, loss):
    model, x, y = token_model
    expected = {k: (f"mha/{v[0]}/kernel", v[1]) for k, v in _mha("mha").items()}
    expected["emb"] = ("emb/embeddings", _transposed)
    expected["lm_head"] = ("lm_head/kernel", _transposed)
    check_against(model, x, y, expected, loss=loss)
    rep = normflat.analyze(model, (x, y), loss=loss, progress=False)
    assert rep.metadata["loss_terms"] == int((y >= 0).sum()) == 9
    assert rep.metadata["examples"] == 3


def test_token_logits_shifted_labels_and_exact(token_model):
    model, x, y = token_model
    full = np.where(y < 0, 1, y)
    shifted = np.concatenate([full[:, 1:], np.full((3, 1), -100)], axis=1)
    a = normflat.hessian_diagonal(model, (x, full), loss="ce", shift_labels=True, progress=False)
    b = normflat.hessian_diagonal(model, (x, shifted), loss="ce", progress=False)
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-13, err_msg=k)
    # The exact estimator on token logits: against the full Hessian of the mean over counted tokens.
    check_against(model, x, y, {"lm_head": ("lm_head/kernel", _transposed), "emb": ("emb/embeddings", _transposed)},
                  loss="nsce", estimator="exact", reference=hessian_reference, layers=["emb", "lm_head"])


def test_token_logits_ggn_mc_is_unbiased(token_model):
    """With per-sequence signals (the default: each spans the tokens, the cross terms of mean zero,
    method §6.3), about 7 % from the exact GGN here with 400 draws."""
    model, x, y = token_model
    ref = normflat.hessian_diagonal(model, (x, y), loss="ce", progress=False, layers=["lm_head"])["lm_head"]
    mc = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn-mc", samples=400, seed=3,
                                   progress=False, layers=["lm_head"])["lm_head"]
    ref, mc = np.asarray(ref), np.asarray(mc)
    assert np.abs(mc - ref).max() < 0.25 * np.abs(ref).max()
    assert not np.allclose(mc, ref, rtol=1e-6)  # a real Monte-Carlo estimate, not the exact GGN


# ----------------------------------------------------------------------------- a tied table (method §6.1)

#: Vocabulary, features and tokens of :func:`tied_model`.
TV, TD, TT = 9, 4, 4


def _conv1d(k):  # Conv1D kernel (k, in, out) -> (out, in, k)
    return k.transpose(2, 1, 0)


#: The layers of :func:`tied_model` (the table in its embedding layout, method §3).
TIED_LAYERS = {"emb": ("emb/embeddings", _transposed), "mix": ("mix/kernel", _conv1d),
               "out": ("out/kernel", _transposed)}


class _OwnCallReversible(L.ReversibleEmbedding):
    """A subclass with its own ``call`` (the same numbers): no tied fast rule for it."""

    def call(self, inputs, reverse=False):
        return super().call(inputs, reverse=reverse)


class _TableScale(L.Layer):
    """Scales its input by ``tanh`` of the table's mean row: a third use of the table, outside its layer."""

    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self._read = lambda: table.embeddings  # a function: the layer is not tracked twice

    def call(self, h):
        return h * keras.ops.tanh(keras.ops.mean(self._read(), axis=0))


def tied_model(use="tied", seed=13):
    """A causal LM whose head is its token embedding (``ReversibleEmbedding``, ``tie_weights=True``):
    lookup, a causal convolution over the tokens, a Dense, the reverse projection. ``use``: ``"third"``
    the table also scales the features, ``"twice"`` two reverse projections, ``"soft_cap"``
    ``logit_soft_cap``, ``"own_call"`` a subclass with its own call, ``"untied"`` ``tie_weights=False``,
    ``"reverse_float32"`` the reverse projection computed in float32 (``reverse_dtype``), ``"two_lookups"``
    a second lookup of the ids in reverse order added to the first (an encoder's and a decoder's ids).

    Returns the model, ids ``(3, T)`` with padding (0, its labels ignored) and an id −1 (row V − 1),
    and next-token labels to be shifted (``shift_labels=True``).
    """
    rng = _rng(seed)
    cls = _OwnCallReversible if use == "own_call" else L.ReversibleEmbedding
    extra = {"reverse_dtype": "float32"} if use == "reverse_float32" else {}
    emb = cls(TV, TD, tie_weights=use != "untied", logit_soft_cap=3.0 if use == "soft_cap" else None, dtype=F64,
              name="emb", **extra)
    ids = keras.Input((TT,), dtype="int32")
    e = emb(ids)
    if use == "two_lookups":
        e = L.Add(dtype=F64)([e, emb(keras.ops.flip(ids, axis=1))])
    m = L.Conv1D(TD, 2, padding="causal", activation="tanh", dtype=F64, name="mix")(e)
    h = L.Dense(TD, activation="tanh", dtype=F64, name="out")(m)
    if use == "third":
        h = _TableScale(emb, dtype=F64, name="scale")(h)
    logits = emb(h, reverse=True)
    if use == "twice":
        logits = L.Add(dtype=F64)([logits, emb(L.Dense(TD, dtype=F64, name="second")(m), reverse=True)])
    model = keras.Model(ids, logits)
    _randomize(model, rng)
    x = np.array([[1, 3, 1, 8], [2, -1, 5, 0], [7, 1, 0, 0]], dtype="int32")
    y = np.where(x == 0, -100, x % TV)
    y[0, 2] = -100  # a prompt token
    return model, x, y


class _SharedKernelDense(L.Dense):
    """A ``Dense`` whose kernel is another ``Dense``'s variable (a hand-tied weight, built in ``build``)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self._source = lambda: source  # a function: the source layer is not tracked twice

    def build(self, input_shape):
        self._kernel = self._source()._kernel
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")
        self.built = True


@pytest.mark.parametrize("estimator", ["ggn", "exact"])
def test_kernel_shared_between_two_layers(estimator):
    """One variable listed by two ``Dense`` layers: one problem under the first user, ``shared_with``
    naming the second (as in torch), the generic path (each fast rule sees one use only), and the
    diagonal covering both uses (method §6.1 "Embeddings")."""
    rng = _rng(21)
    first = L.Dense(4, activation="tanh", dtype=F64, name="first")
    inputs = keras.Input((4,))
    h = _SharedKernelDense(first, units=4, activation="tanh", dtype=F64, name="second")(first(inputs))
    model = keras.Model(inputs, L.Dense(3, dtype=F64, name="head")(h))
    _randomize(model, rng)
    x, y = rng.normal(size=(6, 4)), np.array([0, 1, 2, 2, 1, 0])
    report = normflat.analyze(model, (x, y), loss="ce", estimator=estimator, progress=False)
    assert [layer.name for layer in report.layers] == ["first", "head"]
    assert report.layer("first").details["shared_with"] == ["second"]
    assert "shared_with" not in report.layer("head").details
    if estimator == "ggn":
        assert report.layer("first").details["path"] == "generic"
        assert report.layer("first").details["generic_reason"] == "weight shared between layers"
        assert report.layer("head").details["path"] == "fast"
    reference = ggn_reference if estimator == "ggn" else hessian_reference
    check_against(model, x, y, {"first": ("first/kernel", _transposed), "head": ("head/kernel", _transposed)},
                  estimator=estimator, reference=reference)


def _shift(y):
    return np.concatenate([y[:, 1:], np.full((len(y), 1), -100)], axis=1)


def _tied_check(model, x, y, layers, **kw):
    """``ggn`` with ``shift_labels=True`` against the brute force on the shifted labels, per layer."""
    got = normflat.hessian_diagonal(model, (x, y), loss="nsce", estimator="ggn", shift_labels=True, progress=False,
                                    **kw)
    refs = ggn_reference(model, [_layer_variable(model, path) for path, _ in layers.values()], x, _shift(y), "nsce")
    for (name, (_, canonical)), ref in zip(layers.items(), refs):
        np.testing.assert_allclose(np.asarray(got[name]), canonical(ref), rtol=RTOL, atol=1e-14 * np.abs(ref).max(),
                                   err_msg=name)
    return got


@pytest.mark.parametrize("use", ["tied", "two_lookups", "untied"])
def test_tied_reversible_embedding_fast_rule(use):
    """The table read by the lookup (or two: their positions together) and by the reverse projection
    (the LM head): its per-sample gradient is the sum of the uses', squared one signal at a time
    (method §6.1 "Tied weights"); untied (its own ``reverse_embeddings``, keras-hub's Llama), the
    table on the embedding rule and the projection on the dense one, the exact head rule under
    ``ggn-topk``. ``ggn`` against brute force and ``fast=False``; ``ggn-mc`` and ``ggn-topk`` (per
    sequence) against ``fast=False`` with the same draws; batches of 3 (in chunks of 2) and 2."""
    model, x, y = tied_model(use)
    layers = dict(TIED_LAYERS)
    if use == "untied":
        layers["emb/reverse"] = ("emb/reverse_embeddings", _transposed)
    rep = normflat.analyze(model, (x, y), shift_labels=True, progress=False)
    for name in ("emb", "emb/reverse") if use == "untied" else ("emb",):
        details = rep.layer(name).details
        assert details["path"] == "fast" and "generic_reason" not in details, details
    assert rep.layer("emb").shape == (TD, TV) and rep.metadata["coverage"] == 1.0
    assert rep.metadata["loss_terms"] == int((_shift(y) >= 0).sum()) == 5
    for n in (3, 2):
        got = _tied_check(model, x[:n], y[:n], layers, chunk_size=2)
        generic = normflat.hessian_diagonal(model, (x[:n], y[:n]), loss="nsce", estimator="ggn", shift_labels=True,
                                            progress=False, fast=False)
        for kw in (dict(estimator="ggn-mc", samples=3, seed=4), dict(estimator="ggn-topk", top_classes=2, samples=3,
                                                                       seed=5)):
            fast = normflat.hessian_diagonal(model, (x[:n], y[:n]), shift_labels=True, progress=False, chunk_size=2,
                                             **kw)
            slow = normflat.hessian_diagonal(model, (x[:n], y[:n]), shift_labels=True, progress=False, fast=False, **kw)
            for k in layers:
                # The untied projection is the head: under ggn-topk it takes the exact head rule, which
                # the generic path estimates by its draws; it equals the exact ggn diagonal instead.
                exact = k == "emb/reverse" and kw["estimator"] == "ggn-topk"
                np.testing.assert_allclose(np.asarray(fast[k]), np.asarray((got if exact else slow)[k]), rtol=RTOL,
                                           err_msg=(k, kw))
        for k in layers:
            np.testing.assert_allclose(np.asarray(generic[k]), np.asarray(got[k]), rtol=RTOL, err_msg=k)


def test_tied_reversible_embedding_with_another_reverse_dtype():
    """A float64 model whose reverse projection runs in float32 (``reverse_dtype``): the fast rule takes
    the head's float32 signals with the float64 table and activations, and agrees with ``fast=False``
    and the brute force to float32's precision."""
    model, x, y = tied_model("reverse_float32")
    rep = normflat.analyze(model, (x, y), loss="nsce", estimator="ggn", shift_labels=True, progress=False)
    assert rep.layer("emb").details["path"] == "fast" and rep.metadata["dtype"] == "float64"
    fast = normflat.hessian_diagonal(model, (x, y), loss="nsce", estimator="ggn", shift_labels=True, progress=False)
    slow = normflat.hessian_diagonal(model, (x, y), loss="nsce", estimator="ggn", shift_labels=True, progress=False,
                                     fast=False)
    refs = ggn_reference(model, [_layer_variable(model, path) for path, _ in TIED_LAYERS.values()], x, _shift(y),
                         "nsce")
    for (name, (_, canonical)), ref in zip(TIED_LAYERS.items(), refs):
        assert np.asarray(fast[name]).dtype == np.float64
        scale = np.abs(ref).max()
        np.testing.assert_allclose(np.asarray(fast[name]), np.asarray(slow[name]), rtol=1e-5, atol=1e-6 * scale,
                                   err_msg=name)
        np.testing.assert_allclose(np.asarray(fast[name]), canonical(ref), rtol=1e-5, atol=1e-6 * scale,
                                   err_msg=name)


def _twice_looked_up(rng, scale=None):
    """Two id inputs looked up by one ``Embedding`` (a siamese pair), their features concatenated into a
    ReLU ``Dense`` and a head. ``scale``: the table's features times ``scale`` and the ``Dense`` rows
    of each lookup's features divided by it (the same function)."""
    a, b = keras.Input((3,), dtype="int32"), keras.Input((3,), dtype="int32")
    emb = L.Embedding(7, 3, dtype=F64, name="emb")
    h = L.Concatenate(dtype=F64)([L.Flatten(dtype=F64)(emb(a)), L.Flatten(dtype=F64)(emb(b))])
    h = L.Dense(4, activation="relu", dtype=F64, name="mix")(h)
    model = keras.Model([a, b], L.Dense(3, dtype=F64, name="head")(h))
    _randomize(model, rng)
    if scale is not None:
        emb.embeddings.assign(emb.embeddings.numpy() * scale[None, :])
        mix = model.get_layer("mix")
        mix.kernel.assign(mix.kernel.numpy() / np.tile(scale, 6)[:, None])  # input (lookup, t, feature)
    return model


def test_embedding_looked_up_twice_fast_rule():
    """An ``Embedding`` called on two id inputs: one lookup over both calls' positions (method §6.1
    "Tied weights"), against brute force and the generic path (``ggn``, ``ggn-mc``, chunks of 2)."""
    rng = _rng(31)
    model = _twice_looked_up(rng)
    x = [rng.integers(0, 7, (5, 3)).astype("int32"), rng.integers(0, 7, (5, 3)).astype("int32")]
    y = rng.integers(0, 3, 5)
    report = normflat.analyze(model, (x, y), loss="nsce", progress=False)
    assert report.layer("emb").details["path"] == "fast", report.layer("emb").details
    expected = {"emb": ("emb/embeddings", _transposed), "mix": ("mix/kernel", _transposed),
                "head": ("head/kernel", _transposed)}
    _fast_equals_brute_force_and_generic(model, x, y, expected)


def test_embedding_looked_up_twice_feature_rescaling_is_invariant():
    rng = _rng(32)
    x = [rng.integers(0, 7, (5, 3)).astype("int32"), rng.integers(0, 7, (5, 3)).astype("int32")]
    y = rng.integers(0, 3, 5)
    model = _twice_looked_up(_rng(33))
    twin = _twice_looked_up(_rng(33), scale=np.array([4.0, 0.2, 1.5]))
    rtol = invariance_tolerance(twin(x), model(x))
    before, after = _analyze(model, x, y), _analyze(twin, x, y)
    assert before.layer("emb").details["path"] == "fast"
    _assert_invariant(before, after, rtol)


@pytest.mark.parametrize("use, reason", [
    ("third", "also used outside its layer's call"),
    ("twice", "1 lookup call(s) and 2 reverse call(s) per forward"),
    ("soft_cap", "soft-capped (logit_soft_cap)"),
    ("own_call", "overrides ReversibleEmbedding's call"),
])
def test_tied_reversible_embedding_otherwise_takes_the_generic_path(use, reason):
    """A table also read outside the layer, a layer called twice in reverse, a soft-capped head, a
    subclass with its own call: the generic path, with the reason, and the brute-force numbers."""
    model, x, y = tied_model(use)
    rep = normflat.analyze(model, (x, y), loss="nsce", estimator="ggn", shift_labels=True, progress=False)
    details = rep.layer("emb").details
    assert details["path"] == "generic" and reason in details["generic_reason"], details
    assert rep.layer("mix").details["path"] == "fast"
    _tied_check(model, x, y, TIED_LAYERS)


def test_keyword_batches_and_dict_outputs():
    """A mapping batch with named inputs (keras-hub style) and a model returning a dict of outputs."""
    rng = _rng(7)
    ids = keras.Input((3,), dtype="int32", name="token_ids")
    mask = keras.Input((3,), dtype=F64, name="padding_mask")
    e = L.Embedding(5, 2, dtype=F64, name="emb")(ids)
    pooled = L.Dot(axes=1, dtype=F64)([e, mask])
    logits = L.Dense(3, dtype=F64, name="head")(pooled)
    model = keras.Model({"token_ids": ids, "padding_mask": mask}, {"logits": logits, "features": pooled})
    _randomize(model, rng)
    x = {"token_ids": rng.integers(0, 5, (3, 3)).astype("int32"), "padding_mask": np.array(
        [[1.0, 1, 0], [1, 1, 1], [1, 0, 0]])}
    y = rng.integers(0, 3, 3)
    got = normflat.hessian_diagonal(model, {**x, "labels": y}, loss="ce", progress=False)
    plain = keras.Model({"token_ids": ids, "padding_mask": mask}, logits)
    ref = ggn_reference(plain, [model.get_layer("emb").embeddings, model.get_layer("head").kernel], x, y, "ce")
    np.testing.assert_allclose(np.asarray(got["emb"]), ref[0].T, rtol=RTOL)
    np.testing.assert_allclose(np.asarray(got["head"]), ref[1].T, rtol=RTOL)
    with pytest.raises(TypeError, match=r"output='scores': the model returned a dict .*without that key"):
        normflat.analyze(model, {**x, "labels": y}, output="scores", progress=False)


# ----------------------------------------------------------------------------- invariance (method §8, items 5-7)


def _analyze(model, x, y):
    return normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)


def _assert_invariant(before, after, rtol=1e-8):
    """Every layer's normalized sharpness and the total the same (``rtol``: 1e-8, or float32's accuracy
    where Keras' JAX backend computed part of the float64 model in float32,
    ``tests/arch/_keras_invariance.py``), the total trace moved."""
    assert after.normalized_sharpness == pytest.approx(before.normalized_sharpness, rel=rtol)
    for a, b in zip(before.layers, after.layers):
        assert a.name == b.name
        assert b.normalized_sharpness == pytest.approx(a.normalized_sharpness, rel=rtol, abs=1e-300), a.name
    assert abs(after.hessian_trace / before.hessian_trace - 1) > 1e-3


def _clone(model):
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def test_attention_per_head_rescalings_are_invariant(attention_model):
    model, x, y = attention_model
    twin = _clone(model)
    mha = twin.get_layer("mha")
    c = np.array([3.0, 0.25])  # per head
    d = np.array([0.5, 4.0])
    q, k, v, o = mha._query_dense, mha._key_dense, mha._value_dense, mha._output_dense
    q.kernel.assign(q.kernel.numpy() * c[None, :, None])
    q.bias.assign(q.bias.numpy() * c[:, None])
    k.kernel.assign(k.kernel.numpy() / c[None, :, None])
    k.bias.assign(k.bias.numpy() / c[:, None])
    v.kernel.assign(v.kernel.numpy() * d[None, :, None])
    v.bias.assign(v.bias.numpy() * d[:, None])
    o.kernel.assign(o.kernel.numpy() / d[:, None, None])
    rtol = invariance_tolerance(twin(x), model(x))
    _assert_invariant(_analyze(model, x, y), _analyze(twin, x, y), rtol)


def test_embedding_feature_rescaling_is_invariant():
    rng = _rng(8)
    inp = keras.Input((3,), dtype="int32")
    h = L.Flatten(dtype=F64)(L.Embedding(5, 2, dtype=F64, name="emb")(inp))
    out = L.Dense(3, dtype=F64, name="out")(L.Dense(4, activation="tanh", dtype=F64, name="mix")(h))
    model = keras.Model(inp, out)
    _randomize(model, rng)
    x, y = rng.integers(0, 5, (4, 3)).astype("int32"), rng.integers(0, 3, 4)
    twin = _clone(model)
    c = np.array([5.0, 0.3])
    emb, mix = twin.get_layer("emb"), twin.get_layer("mix")
    emb.embeddings.assign(emb.embeddings.numpy() * c[None, :])
    mix.kernel.assign(mix.kernel.numpy() / np.tile(c, 3)[:, None])  # input t·d + j of the flattened sequence
    rtol = invariance_tolerance(twin(x), model(x))
    _assert_invariant(_analyze(model, x, y), _analyze(twin, x, y), rtol)


def test_relu_rnn_hidden_unit_rescaling_is_invariant():
    rng = _rng(9)
    inp = keras.Input((3, 2), dtype=F64)
    h = L.SimpleRNN(3, activation="relu", dtype=F64, name="rnn")(inp)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h))
    _randomize(model, rng, scale=0.5)
    x, y = rng.normal(size=(4, 3, 2)), rng.integers(0, 3, 4)
    twin = _clone(model)
    c = np.array([2.0, 0.5, 7.0])
    cell, head = twin.get_layer("rnn").cell, twin.get_layer("head")
    cell.kernel.assign(cell.kernel.numpy() * c[None, :])
    cell.bias.assign(cell.bias.numpy() * c)
    cell.recurrent_kernel.assign(cell.recurrent_kernel.numpy() * c[None, :] / c[:, None])  # D⁻¹ U D
    head.kernel.assign(head.kernel.numpy() / c[:, None])
    rtol = invariance_tolerance(twin(x), model(x))
    _assert_invariant(_analyze(model, x, y), _analyze(twin, x, y), rtol)


# ----------------------------------------------------------------------------- inventory and errors


def test_inventory_lists_every_weight(recurrent_model):
    model, x, y = recurrent_model
    rep = normflat.analyze(model, (x, y), progress=False)
    assert rep.metadata["coverage"] == 1.0
    assert set(rep.metadata["excluded"]) == {v.path for v in model.weights if v.path.endswith("bias")}
    assert rep.metadata["unsupported"] == []


def test_bad_token_labels_give_the_engine_messages(token_model):
    model, x, y = token_model
    with pytest.raises(ValueError, match="hold one class per sample"):
        normflat.analyze(model, (x, y[:, 0]), progress=False)
    with pytest.raises(ValueError, match="3 token labels per sample but the model returns logits for 4"):
        normflat.analyze(model, (x, y[:, :3]), progress=False)
    with pytest.raises(ValueError, match=r"in \[0, 4\] or ignore_index=-100"):
        normflat.analyze(model, (x, np.where(y < 0, 9, y)), progress=False)
    with pytest.raises(ValueError, match="No token of the data is counted"):
        normflat.analyze(model, (x, np.full_like(y, -100)), progress=False)


class _Windows(L.Layer):
    """``(n, 4, d)`` -> ``(2n, 2, d)`` windows (``inverse``: back), in blocks per sample or window-major."""

    def __init__(self, layout, inverse=False, **kwargs):
        super().__init__(**kwargs)
        self.layout, self.inverse = layout, inverse

    def call(self, h):
        d = h.shape[-1]
        if self.layout != "window-major":
            return keras.ops.reshape(h, (-1, 4, d) if self.inverse else (-1, 2, d))
        if self.inverse:  # (2n, 2, d) -> (2, n, 2, d) -> (n, 2, 2, d)
            return keras.ops.reshape(keras.ops.transpose(keras.ops.reshape(h, (2, -1, 2, d)), (1, 0, 2, 3)), (-1, 4, d))
        return keras.ops.reshape(keras.ops.transpose(keras.ops.reshape(h, (-1, 2, 2, d)), (1, 0, 2, 3)), (-1, 2, d))


class _CoordinateBias(L.Layer):
    """Adds ``tanh(Dense(coordinates))`` of a batch-independent ``(4, 2)`` table to every sample
    (``rows=2``: of a ``(2, 2)`` table, averaged, as many rows as the first forward's check has samples)."""

    def __init__(self, rows=4, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows
        self.mlp = L.Dense(6, dtype=F64, name="coords_mlp")

    def call(self, h):
        coords = keras.ops.reshape(keras.ops.linspace(-1.0, 1.0, 2 * self.rows, dtype=F64), (self.rows, 2))
        bias = keras.ops.tanh(self.mlp(coords))
        return h + (bias if self.rows == 4 else keras.ops.mean(bias, axis=0))


def windowed_model(layout, kind, activation="tanh"):
    """Dense -> the batch folded into windows -> ``Dense`` or ``EinsumDense`` per window (then
    ``activation``) -> merged -> mean -> head; ``"shared"``: windows in blocks plus :class:`_CoordinateBias`."""
    rng = _rng(21)
    inp = keras.Input((4, 3), dtype=F64)
    h = L.Dense(6, activation="tanh", dtype=F64, name="embed")(inp)
    h = _Windows(layout, dtype=F64)(h)
    if kind == "dense":
        h = L.Dense(6, activation=activation, dtype=F64, name="windowed")(h)
    else:
        h = L.EinsumDense("abc,cd->abd", output_shape=(2, 6), bias_axes="d", activation=activation, dtype=F64,
                          name="windowed")(h)
    h = _Windows(layout, inverse=True, dtype=F64)(h)
    if layout.startswith("shared"):
        h = _CoordinateBias(2 if layout == "shared-two-rows" else 4, dtype=F64, name="bias")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.GlobalAveragePooling1D(dtype=F64)(h)))
    _randomize(model, rng)
    return model, rng.normal(size=(5, 4, 3)), rng.integers(0, 3, 5)


@pytest.mark.parametrize("layout, generic", [
    ("blocks", {}),
    ("window-major", {"windowed": "not one block of rows per sample"}),
    ("shared", {"bias/coords_mlp": "not one block of rows per sample"}),
    ("shared-two-rows", {"bias/coords_mlp": "its output's leading axis is not the batch"}),
])
@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_dense_layer_on_a_batch_folded_into_windows(layout, generic, kind):
    """A ``Dense``/``EinsumDense`` whose input holds a block of rows per sample (attention windows)
    keeps its fast rule, each sample's gradient summed over its block (method §6.1), checked by a
    signal at one sample of the first forward; rows of several samples in another order, and a
    layer on a batch-independent table (also one of two rows, as many as the check's samples), take
    the generic path. Against brute force with batches of
    5 and 1 and chunks of 2 (before, every window was read as a sample: 320 % off)."""
    model, x, y = windowed_model(layout, kind)
    rep = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    for layer in rep.layers:
        details = layer.details
        if layer.name in generic:
            assert details["path"] == "generic" and generic[layer.name] in details["generic_reason"], details
        else:
            assert details["path"] == "fast", (layer.name, details)
    expected = {layer.name: (layer.details["param"], _transposed) for layer in rep.layers}  # (in, out) kernels
    # The fold itself with a batch of one and chunks of two; a refused layer on its generic path once.
    for n, kw in ((5, {}), (1, {}), (5, {"chunk_size": 2})) if not generic else ((5, {}),):
        check_against(model, x[:n], y[:n], expected, loss="ce", **kw)


def spectral_model(activation="tanh"):
    """``SpectralNormalization(Conv1D)`` -> ``SpectralNormalization(Dense)`` (``activation``) -> head, float64."""
    rng = _rng(31)
    inp = keras.Input((5, 3), dtype=F64)
    h = L.SpectralNormalization(L.Conv1D(4, 2, activation="tanh", dtype=F64, name="conv"), dtype=F64, name="sn_conv")(inp)
    h = L.SpectralNormalization(L.Dense(4, activation=activation, dtype=F64, name="inner"), dtype=F64, name="sn")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng)
    return model, rng.normal(size=(6, 5, 3)), rng.integers(0, 3, 6)


def _conv1d(k):  # (k, in, out) -> (out, in, k)
    return k.transpose(2, 1, 0)


def test_spectrally_normalized_layers_are_their_layers():
    """Keras' ``SpectralNormalization`` renormalizes its layer's kernel in place in training calls only;
    at inference, where normflat calls the model, it applies the layer as it is. So the wrapped kernel
    is a weight matrix like any, analyzed on its layer's fast rule (method §3, "Spectral
    normalization"; before, it was held fixed with the normalization layers): against brute force,
    the wrapper's ``vector_u`` excluded, every variable left as it was."""
    model, x, y = spectral_model()
    before = [v.numpy().copy() for v in model.weights]
    rep = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert rep.metadata["coverage"] == 1.0 and rep.metadata["unsupported"] == []
    assert {layer.name: layer.details["path"] for layer in rep.layers} == {"sn_conv/conv": "fast", "sn/inner": "fast",
                                                                             "head": "fast"}
    assert "not a weight matrix" in rep.metadata["excluded"]["sn/vector_u"]
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(model.weights, before))
    expected = {"sn_conv/conv": ("sn_conv/conv/kernel", _conv1d), "sn/inner": ("sn/inner/kernel", _transposed),
                "head": ("head/kernel", _transposed)}
    for kw in ({}, {"chunk_size": 2}):
        check_against(model, x, y, expected, **kw)


def test_spectrally_normalized_dense_feature_rescaling():
    """The wrapped ``Dense`` (no activation): its output feature j times ``c_j`` (kernel column and bias)
    and the head's matching input rows divided by it, the same function at inference; every normalized
    sharpness stays, the two kernels' traces move (method §8)."""
    model, x, y = spectral_model(activation=None)
    other = _copy(model)
    c = np.exp(np.random.default_rng(32).uniform(-1.0, 1.0, 4))
    inner, head = other.get_layer("sn").layer, other.get_layer("head")
    inner.kernel.assign(inner.kernel.numpy() * c)
    inner.bias.assign(inner.bias.numpy() * c)
    head.kernel.assign(head.kernel.numpy() / np.tile(c, 4)[:, None])  # (5 - 1 positions, 4 features) flattened
    _assert_rescaling_invariant(model, other, x, y, moved=("sn/inner", "head"))


class PositionIds(L.Layer):
    """Adds an ``Embedding`` of the position ids ``(1, N)`` to its input, broadcast over the batch
    (keras-hub's ``ViTPatchingAndEmbedding`` does so).

    ``use``: ``add``; ``first`` takes the lookup's row 0 (with the ids looked up per sample it reads
    sample 0's row: the samples' gradients would mix); ``reshaped`` reshapes it without its batch
    axis (the forward fails with one lookup per sample); ``summed`` sums its leading axis (the logits
    change).
    """

    def __init__(self, positions, use="add", **kwargs):
        super().__init__(**kwargs)
        self.use = use
        self.table = L.Embedding(positions, 4, dtype=F64, name="positions")

    def call(self, x):
        pos = self.table(keras.ops.arange(x.shape[1])[None, :])  # (1, N, d)
        if self.use == "first":
            return x + pos[0]
        if self.use == "reshaped":
            return x + keras.ops.reshape(pos, (x.shape[1], -1))
        if self.use == "summed":
            return x + keras.ops.sum(pos, axis=0)
        return x + pos


def position_ids_model(use):
    """:func:`_patch_model` with the embedding of position ids ``(1, 3)``."""
    return _patch_model(PositionIds(3, use=use, dtype=F64, name="vit"), 23, 4)


@pytest.mark.parametrize("use, reason", [
    ("add", None),
    ("first", "not added to each sample's own activations"),
    ("reshaped", "the forward fails with its one row of ids looked up per sample"),
    ("summed", "computes other logits with its one row of ids looked up per sample"),
])
def test_embedding_of_position_ids_broadcast_over_the_batch(use, reason):
    """An ``Embedding`` of one row of position ids ``(1, N)``, broadcast over the batch when added: the
    lookup runs once per sample in the GGN step (a view of the ids), so the signal at each row of its
    output is that sample's (method §6.1, "Position tables"), checked by the first forward; read
    otherwise (row 0 taken, a reshape without the batch axis, a sum over it), the generic path with
    the reason. Against brute force with batches of 4 and 1 and chunks of 3 (before, the one row was
    read as one sample: 83 % off on keras-hub's ViT)."""
    model, x, y = position_ids_model(use)
    rep = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    details = rep.layer("vit/positions").details
    if reason is None:
        assert details["path"] == "fast", details
    else:
        assert details["path"] == "generic" and reason in details["generic_reason"], details
    assert {rep.layer(name).details["path"] for name in ("patch", "mix", "head")} == {"fast"}
    expected = {layer.name: (layer.details["param"], _transposed) for layer in rep.layers}
    for n, kw in ((4, {}), (1, {}), (4, {"chunk_size": 3})):
        check_against(model, x[:n], y[:n], expected, loss="ce", **kw)


def _assert_rescaling_invariant(model, other, x, y, moved):
    """``other`` computes ``model``'s function; every layer's normalized sharpness is the same, the
    traces of the layers ``moved`` are not (method §8); every layer on its fast rule."""
    rtol = invariance_tolerance(other(x), model(x), rtol=1e-11)
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, (x, y), loss="ce", estimator="ggn", progress=False)
    assert {layer.details["path"] for layer in before.layers} == {"fast"}
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=rtol), lb.name
    for name in moved:
        assert abs(after.layer(name).hessian_trace - before.layer(name).hessian_trace) > \
            1e-3 * abs(before.layer(name).hessian_trace), name


def _copy(model):
    other = keras.models.clone_model(model)
    other.set_weights(model.get_weights())
    return other


@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_folded_dense_layer_rescaling_invariance(kind):
    """The windowed layer's output units times positive factors (a relu after it), the head's
    matching input rows divided by them, the windowed layer on its folded fast rule."""
    model, x, y = windowed_model("blocks", kind, activation="relu")
    other = _copy(model)
    factors = np.exp(np.linspace(-1.0, 1.0, 6))
    windowed, head = other.get_layer("windowed"), other.get_layer("head")
    windowed.kernel.assign(windowed.kernel.numpy() * factors)  # (in, out): output units on the last axis
    windowed.bias.assign(windowed.bias.numpy() * factors)
    head.kernel.assign(head.kernel.numpy() / factors[:, None])
    _assert_rescaling_invariant(model, other, x, y, ("windowed", "head"))


def test_position_ids_embedding_rescaling_invariance():
    """Feature j of the patches and of the position-id embedding (the two added) times a positive
    factor, the mixer's input j divided by it, the embedding on its per-sample lookup."""
    model, x, y = position_ids_model("add")
    other = _copy(model)
    factors = np.exp(np.linspace(-1.0, 1.0, 4))
    patch, mix = other.get_layer("patch"), other.get_layer("mix")
    table = other.get_layer("vit").table
    patch.kernel.assign(patch.kernel.numpy() * factors)
    patch.bias.assign(patch.bias.numpy() * factors)
    table.embeddings.assign(table.embeddings.numpy() * factors)
    mix.kernel.assign(mix.kernel.numpy() / factors[:, None])
    _assert_rescaling_invariant(model, other, x, y, ("patch", "vit/positions", "mix"))


# ----------------------------------------------------------------------------- a layer called several times


def _shared_model(rng):
    """A ReLU ``Dense`` applied three times (one layer shared across depth, as ALBERT's), a grouped
    ReLU ``Conv1D`` and a ReLU ``DepthwiseConv1D`` applied twice each, between an input ``Dense``
    and a head, on sequences of 3 steps."""
    inp = keras.Input((3, 2), dtype=F64)
    h = L.Dense(4, activation="relu", dtype=F64, name="inp")(inp)
    shared = L.Dense(4, activation="relu", dtype=F64, name="shared")
    for _ in range(3):
        h = shared(h)
    conv = L.Conv1D(4, 3, padding="same", groups=2, activation="relu", dtype=F64, name="conv")
    h = conv(conv(h))
    depthwise = L.DepthwiseConv1D(3, padding="same", activation="relu", dtype=F64, name="depthwise")
    h = depthwise(depthwise(h))
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.GlobalAveragePooling1D(dtype=F64)(h)))
    _randomize(model, rng, scale=0.6)
    return model


def test_dense_called_several_times_sums_its_calls():
    """Every call of a ``Dense`` or a (grouped) convolution called several times per forward is
    recorded, and the calls' per-sample gradients are summed before they are squared (their
    positions concatenated, method §6.1 "Tied weights"): the fast path, brute force for ``ggn``,
    the generic path for ``ggn-mc``, in chunks of 2 too."""
    rng = _rng(21)
    model = _shared_model(rng)
    x, y = rng.normal(size=(5, 3, 2)), rng.integers(0, 3, 5)
    report = normflat.analyze(model, (x, y), loss="nsce", estimator="ggn", progress=False)
    assert {layer.name: layer.details["path"] for layer in report.layers} == {
        "inp": "fast", "shared": "fast", "conv": "fast", "depthwise": "fast", "head": "fast"}
    expected = {name: (f"{name}/kernel", _transposed) for name in ("inp", "shared", "head")}
    expected["conv"] = ("conv/kernel", _conv1d)
    expected["depthwise"] = ("depthwise/kernel", lambda k: k.transpose(1, 2, 0))  # (k, C, 1) -> (C, 1, k)
    _fast_equals_brute_force_and_generic(model, x, y, expected, seed=2)


def test_dense_called_several_times_conjugation_is_invariant():
    """Hidden unit k times c_k throughout the shared ReLU layers: the input layer's column k (kernel
    (in, out)) and bias times c_k, the shared kernel ``K -> D⁻¹ K D`` and its bias times c_k, the
    grouped convolution's ``K[t, j, o] -> K[t, j, o] · c_o / c_i`` (input channel ``i`` of output
    ``o``'s group) and its bias times c_k, the depthwise convolution's bias times c_k (its kernel
    maps channel k to channel k and stays), the head's row k times 1/c_k: the function and every
    normalized sharpness unchanged, the dense and grouped convolution's traces moved."""
    rng = _rng(22)
    model = _shared_model(rng)
    x, y = rng.normal(size=(5, 3, 2)), rng.integers(0, 3, 5)
    twin = _clone(model)
    c = np.array([2.0, 0.5, 3.0, 0.25])
    inp, shared, head = twin.get_layer("inp"), twin.get_layer("shared"), twin.get_layer("head")
    inp.kernel.assign(inp.kernel.numpy() * c[None, :])
    inp.bias.assign(inp.bias.numpy() * c)
    shared.kernel.assign(shared.kernel.numpy() / c[:, None] * c[None, :])
    shared.bias.assign(shared.bias.numpy() * c)
    conv = twin.get_layer("conv")
    per_group = conv.kernel.shape[1]
    inputs = np.stack([c[(o // per_group) * per_group + np.arange(per_group)] for o in range(4)], axis=1)
    conv.kernel.assign(conv.kernel.numpy() * c[None, None, :] / inputs[None])
    conv.bias.assign(conv.bias.numpy() * c)
    depthwise = twin.get_layer("depthwise")  # channel k in, channel k out: its kernel stays, its bias scales
    depthwise.bias.assign(depthwise.bias.numpy() * c)
    head.kernel.assign(head.kernel.numpy() / c[:, None])
    rtol = invariance_tolerance(twin(x), model(x))
    before, after = _analyze(model, x, y), _analyze(twin, x, y)
    for name in ("shared", "conv", "depthwise"):
        assert before.layer(name).details["path"] == after.layer(name).details["path"] == "fast"
    # The depthwise kernel maps channel k to channel k, so the channel scaling passes through it
    # and leaves its curvature as it is; the other shared layers' traces move.
    for name in ("shared", "conv"):
        assert abs(after.layer(name).hessian_trace / before.layer(name).hessian_trace - 1) > 1e-3
    _assert_invariant(before, after, rtol)


def test_fast_layer_whose_output_the_logits_do_not_reach():
    """A backbone computing a pooled output beside the sequence a head reads (keras-hub's Electra): the
    pooler's ``Dense`` runs but no signal reaches it. Its diagonal is zero, as brute force says, and
    every other layer's is unchanged (no error from a missing signal)."""
    rng = _rng(35)
    inp = keras.Input((3, 2), dtype=F64)
    h = L.Dense(4, activation="tanh", dtype=F64, name="mix")(inp)
    pooled = L.Dense(4, dtype=F64, name="pooler")(h[:, 0])
    backbone = keras.Model(inp, [h, pooled], name="backbone")
    out = L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(backbone(inp)[0]))
    model = keras.Model(inp, out)
    _randomize(model, rng)
    x, y = rng.normal(size=(4, 3, 2)), rng.integers(0, 3, 4)
    report = normflat.analyze(model, (x, y), loss="nsce", progress=False)
    assert report.layer("backbone/pooler").details["path"] == "fast"
    got = check_against(model, x, y, {"backbone/mix": ("mix/kernel", _transposed),
                                      "head": ("head/kernel", _transposed)}, loss="nsce")
    assert np.asarray(got["backbone/pooler"]).shape == (4, 4) and not np.asarray(got["backbone/pooler"]).any()
    generic = normflat.hessian_diagonal(model, (x, y), loss="nsce", progress=False, fast=False)
    for name in got:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(generic[name]), rtol=RTOL, err_msg=name)


def _untied_lm(scale=None):
    """Ids -> an untied ``ReversibleEmbedding`` -> a ``tanh`` Dense -> a linear Dense ``proj`` -> the reverse
    projection. ``scale``: ``proj``'s output features times c and the projection's rows divided by c
    (the same function)."""
    rng = _rng(36)
    emb = L.ReversibleEmbedding(TV, TD, tie_weights=False, dtype=F64, name="emb")
    ids = keras.Input((TT,), dtype="int32")
    h = L.Dense(TD, activation="tanh", dtype=F64, name="mix")(emb(ids))
    model = keras.Model(ids, emb(L.Dense(TD, dtype=F64, name="proj")(h), reverse=True))
    _randomize(model, rng)
    if scale is not None:
        proj = model.get_layer("proj")
        proj.kernel.assign(proj.kernel.numpy() * scale[None, :])
        proj.bias.assign(proj.bias.numpy() * scale)
        emb.reverse_embeddings.assign(emb.reverse_embeddings.numpy() / scale[:, None])  # (features, vocabulary)
    return model


def test_untied_reverse_projection_rescaling_is_invariant():
    """The features entering the untied reverse projection times c, its rows divided by c: the same
    function; every layer's normalized sharpness stays (the projection on its fast rule), the Hessian
    trace moves."""
    x = np.array([[1, 3, 1, 8], [2, 4, 5, 0], [7, 1, 0, 6]], dtype="int32")
    y = np.where(x == 0, -100, (x + 1) % TV)
    model, twin = _untied_lm(), _untied_lm(np.array([3.0, 0.4, 1.7, 0.6]))
    rtol = invariance_tolerance(twin(x), model(x))
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(twin, (x, y), loss="ce", estimator="ggn", progress=False)
    assert {layer.details["path"] for layer in before.layers} == {"fast"}
    _assert_invariant(before, after, rtol)


# ----------------------------------------------------------------------------- transposed convolutions


def _transposed_conv(rank):
    """A ``ConvNDTranspose`` kernel ``(*k, out, in)`` -> canonical ``(out, in, *k)`` (method §3)."""
    return lambda k: k.transpose((rank, rank + 1) + tuple(range(rank)))


def transposed_conv_model(case):
    """Transposed convolutions of every rank, with ``"valid"`` and ``"same"`` padding, strides per axis,
    ``output_padding``, and (``"1d"``) a first layer on one input position, whose per-sample gradients
    are rank one."""
    rng = _rng({"1d": 41, "2d": 42, "3d": 43}[case])
    if case == "1d":
        inp = keras.Input((1, 3), dtype=F64)
        h = L.Conv1DTranspose(3, 4, activation="tanh", dtype=F64, name="up0")(inp)  # (4, 3)
        h = L.Conv1DTranspose(2, 3, strides=2, padding="same", activation="relu", dtype=F64, name="up1")(h)
        layers = {"up0": 1, "up1": 1}
    elif case == "2d":
        inp = keras.Input((3, 3, 2), dtype=F64)
        h = L.Conv2D(3, 2, padding="same", activation="relu", dtype=F64, name="conv")(inp)
        h = L.Conv2DTranspose(3, (2, 3), strides=(3, 2), output_padding=(2, 1), activation="tanh", dtype=F64,
                              name="up0")(h)
        h = L.Conv2DTranspose(2, 4, strides=2, padding="same", dtype=F64, name="up1")(h)
        layers = {"up0": 2, "up1": 2}
    else:
        inp = keras.Input((2, 2, 2, 2), dtype=F64)
        h = L.Conv3DTranspose(2, 2, strides=2, activation="relu", dtype=F64, name="up0")(inp)
        layers = {"up0": 3}
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(L.Flatten(dtype=F64)(h)))
    _randomize(model, rng, scale=0.5)
    x, y = rng.normal(size=(4,) + tuple(inp.shape[1:])), rng.integers(0, 3, 4)
    expected = {name: (f"{name}/kernel", _transposed_conv(rank)) for name, rank in layers.items()}
    if case == "2d":
        expected["conv"] = ("conv/kernel", lambda k: k.transpose(3, 2, 0, 1))  # (*k, in, out) -> (out, in, *k)
    expected["head"] = ("head/kernel", _transposed)
    return model, x, y, expected


@pytest.mark.parametrize("case", ["1d", "2d", "3d"])
def test_transposed_convolutions_fast_rule(case):
    """``Conv1DTranspose/2D/3D`` take their fast rule (the convolution's per-sample gradient with the
    input and the signal in swapped roles, method §6.1): ``ggn`` against brute force whole and in
    chunks, ``ggn-mc`` and chunked ``ggn`` against the generic path; the canonical layout
    ``(out, in, *k)`` and the kind in the report."""
    model, x, y, expected = transposed_conv_model(case)
    _fast_equals_brute_force_and_generic(model, x, y, expected)
    report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert {layer.name: layer.details["path"] for layer in report.layers} == dict.fromkeys(expected, "fast")
    rank = {"1d": 1, "2d": 2, "3d": 3}[case]
    up0 = report.layer("up0")
    native = tuple(model.get_layer("up0").kernel.shape)
    assert up0.kind == f"conv_transpose{rank}d"
    assert tuple(up0.shape) == (native[rank], native[rank + 1]) + native[:rank]


def test_transposed_convolution_exact_hessian():
    """The ``exact`` estimator reads a transposed convolution's kernel in the same layout: the diagonal
    of the full Hessian of the mean loss."""
    model, x, y, expected = transposed_conv_model("2d")
    check_against(model, x, y, {k: expected[k] for k in ("up0", "up1")}, loss="nsce", estimator="exact",
                  reference=hessian_reference)


class _SpareLayer(L.Layer):
    """A block that creates a convolution it never calls (keras-hub EfficientNet's squeeze-excite
    convolutions of blocks without one): never built, it has no weights."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.conv = L.Conv2D(3, 3, padding="same", activation="tanh", dtype=F64, name="conv")
        self.spare = L.Conv2D(3, 1, dtype=F64, name="spare")

    def call(self, x):
        return self.conv(x)


def test_a_layer_never_built_has_nothing_to_analyze():
    """A layer created but never called is never built (reading its kernel raised inside the walk); it
    has no weights and is not reported; the others are analyzed as usual, against brute force."""
    rng = _rng(44)
    inp = keras.Input((4, 4, 2), dtype=F64)
    block = _SpareLayer(dtype=F64, name="block")
    h = L.GlobalAveragePooling2D(dtype=F64)(block(inp))
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h))
    _randomize(model, rng)
    assert not block.spare.built
    x, y = rng.normal(size=(4, 4, 4, 2)), rng.integers(0, 3, 4)
    got = check_against(model, x, y, {"block/conv": ("block/conv/kernel", lambda k: k.transpose(3, 2, 0, 1)),
                                      "head": ("head/kernel", _transposed)}, loss="nsce")
    assert set(got) == {"block/conv", "head"}


class _OpenFeatures(keras.layers.Layer):
    """A ``Dense`` read through the model's own reshape, as keras-hub's RoFormerV2 attention reads its
    output projection: ``ops.reshape(h, (b, t, -1))`` with ``b`` the batch size from ``ops.shape``
    leaves the feature axis open in a compiled graph (the inner ``Dense`` built with it beforehand).
    ``flat``: ``(b, -1)``, every position's features one vector (one position per sample)."""

    def __init__(self, units, flat=False, **kwargs):
        super().__init__(**kwargs)
        self.units, self.flat = units, flat
        self.inner = L.Dense(units, activation="tanh", dtype=F64, name="inner")

    def build(self, input_shape):
        self.inner.build((input_shape[0], input_shape[1] * input_shape[2]) if self.flat else input_shape)

    def call(self, x):
        b, t = keras.ops.shape(x)[0], keras.ops.shape(x)[1]
        heads = keras.ops.reshape(x, (b, t, 2, -1))
        return self.inner(keras.ops.reshape(heads, (b, -1) if self.flat else (b, t, -1)))

    def compute_output_shape(self, shape):
        return (shape[0], self.units) if self.flat else (*shape[:-1], self.units)


def test_dense_whose_input_features_the_graph_leaves_open():
    """A ``Dense`` whose input's feature axis is unknown in the compiled step (keras-hub's RoFormerV2
    crashed inside the step, ``int(None)``, before the kernel's rows fixed it): on several positions
    and on one, the fast rule against brute force and the generic path."""
    rng = _rng(23)
    inp = keras.Input((4, 6), dtype=F64)
    h = L.Dense(6, activation="tanh", dtype=F64, name="a")(inp)
    h = _OpenFeatures(6, dtype=F64, name="positions")(h)
    h = _OpenFeatures(3, flat=True, dtype=F64, name="flat")(h)
    model = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h))
    _randomize(model, rng, scale=0.6)
    x, y = rng.normal(size=(5, 4, 6)), rng.integers(0, 3, 5)
    report = normflat.analyze(model, (x, y), loss="nsce", estimator="ggn", progress=False)
    assert {layer.name: layer.details["path"] for layer in report.layers} == {
        "a": "fast", "positions/inner": "fast", "flat/inner": "fast", "head": "fast"}
    expected = {name: (f"{name}/kernel", _transposed) for name in ("a", "positions/inner", "flat/inner", "head")}
    _fast_equals_brute_force_and_generic(model, x, y, expected, seed=3)
