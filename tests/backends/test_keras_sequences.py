"""Keras backend: per-sequence signals of token logits (method §6.3).

``ggn-topk`` and ``ggn-mc`` back-propagate one signal per (signal, sequence): the
tokens' signals summed with independent signs. The backend's diagonals and group
estimates are checked against a brute-force reference built here: the full
per-sequence Jacobians of the logits with respect to every analyzed weight
(``tf.GradientTape.jacobian``, float64) contracted with the engine's
:func:`normflat.engine.losses.token_signals`, formed in numpy from the same
framework-free uniforms, and divided by the counted tokens; also for a language model
whose head is its token embedding (a tied ``ReversibleEmbedding``, method §6.1 "Tied
weights").
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks, stored_groups  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import normflat  # noqa: E402
from normflat.backends.keras import layer_problems  # noqa: E402
from normflat.backends.keras.ggn import signal_layout  # noqa: E402
from normflat.backends.keras.ops import TF  # noqa: E402
from normflat.engine import losses, validate_options  # noqa: E402
from normflat.engine.random import sample_uniforms  # noqa: E402
from tests.arch.test_keras_layers import _assert_invariant as assert_invariant  # noqa: E402

L = keras.layers
F64 = "float64"
VOCAB, C, T = 6, 5, 4


class _OwnCallDense(L.Dense):
    """A Dense with its own call: the generic path (per-sample Jacobians from the logits)."""

    def call(self, inputs):
        return super().call(inputs)


def _transposed(k):
    return k.T


def _conv1d(k):  # Conv1D kernel (k, in, out) -> (out, in, k)
    return k.transpose(2, 1, 0)


#: Report name -> (variable path, native -> canonical layout).
LAYOUT = {
    "emb": ("emb/embeddings", _transposed),
    "mix": ("mix/kernel", _conv1d),
    "own": ("own/kernel", _transposed),
    "head": ("head/kernel", _transposed),
}


@pytest.fixture(scope="module")
def token_lm():
    """Embedding, a causal convolution (the tokens mix), a generic Dense and a Dense head.

    Logits ``(n, T, C)``; labels as a causal language model's, shifted by the backend
    (``shift_labels=True``), with a prompt and padding not counted. Returns the model, the
    data and the brute-force logits and Jacobians (:func:`_jacobians`, for every estimator).
    """
    keras.utils.set_random_seed(11)
    rng = np.random.default_rng(11)
    inp = keras.Input((T,), dtype="int32")
    e = L.Embedding(VOCAB, 3, dtype=F64, name="emb")(inp)
    m = L.Conv1D(3, 2, padding="causal", activation="tanh", dtype=F64, name="mix")(e)
    h = _OwnCallDense(4, activation="tanh", dtype=F64, name="own")(m)
    model = keras.Model(inp, L.Dense(C, dtype=F64, name="head")(h))
    for v in model.weights:
        v.assign(rng.normal(size=v.shape) * 0.8)
    x = rng.integers(0, VOCAB, (4, T)).astype("int32")
    y = rng.integers(0, C, (4, T))
    y[0, 1] = y[2, 3] = y[3, 1] = -100  # after the shift, with the last tokens: 9 of 16 counted
    return model, x, y, _jacobians(model, x, [path for path, _ in LAYOUT.values()])


def _shifted(y):
    return np.concatenate([y[:, 1:], np.full((len(y), 1), -100)], axis=1)


def _jacobians(model, x, paths):
    """The logits ``(n, T, C)`` and, per path, the ``(n, T, C, size)`` Jacobian of the logits."""
    variables = {v.path: v for v in model.weights}
    with tf.GradientTape(persistent=True) as tape:
        z = model(x, training=False)
    jac = tape.jacobian(z, [variables[p].value for p in paths], experimental_use_pfor=False)
    z = z.numpy()
    return z, [tf.convert_to_tensor(j).numpy().reshape(*z.shape, -1) for j in jac]


def reference(model, jacobians, y, options, exact_head, layout=None):
    """Brute force: ``{name: (K', *canonical)}`` sums of squared per-sequence gradients, and the counted tokens.

    Each signal ``s`` of :func:`~normflat.engine.losses.token_signals` (per sequence) gives
    the per-sequence gradient ``Σ_{t,c} s_tc J_tc``. ``exact_head``: the head's squares are
    the exact GGN's in the shared group 0 (per-token signals, each at its token), zero in
    the sampled groups, as the backend's dense head rule (method §6.2–6.3). ``layout``: the
    report names of ``jacobians``, as :data:`LAYOUT` (the default).
    """
    layout = LAYOUT if layout is None else layout
    counted = (y >= 0).astype(np.float64)
    z, jac = jacobians
    u = sample_uniforms(options.seed, 0, 0, len(y), options.uniform_columns(T))
    sig = losses.token_signals(np, z, options, counted, u)  # (K', M', n, T, C)
    exact = losses.token_signals(np, z, validate_options(loss=options.loss, estimator="ggn", progress=False),
                                 counted)  # (1, (C − 1)·T, n, T, C): each at its own token
    shapes = {v.path: tuple(v.shape) for v in model.weights}
    out = {}
    for (name, (path, canonical)), j in zip(layout.items(), jac):
        if exact_head and name == "head":
            sq = np.zeros((sig.shape[0], j.shape[-1]))
            sq[0] = (np.einsum("mntc,ntcp->mnp", exact[0], j) ** 2).sum(axis=(0, 1))
        else:
            sq = (np.einsum("gmntc,ntcp->gmnp", sig, j) ** 2).sum(axis=(1, 2))
        out[name] = np.stack([canonical(s.reshape(shapes[path])) for s in sq])
    return out, counted.sum()


def _groups(sums, shared, count):
    """Group estimates from the ``(K', ...)`` sums: ``(shared + sampled_k) / N`` or ``sampled_k / N``."""
    if shared:
        return (sums[:1] + sums[1:]) / count
    return sums / count


def assert_close(got, ref, name):
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-13 * np.abs(ref).max(), err_msg=name)


@pytest.mark.parametrize("estimator, loss, samples, top", [("ggn-topk", "nsce", 3, 1), ("ggn-mc", "ce", 3, None)])
def test_sequence_signals_equal_brute_force(token_lm, estimator, loss, samples, top):
    """Fast (embedding, convolution), generic and head layers; two batches, the first in two chunks."""
    model, x, y, jacobians = token_lm
    kw = dict(loss=loss, estimator=estimator, samples=samples, top_classes=top, seed=5, shift_labels=True)
    options = validate_options(progress=False, **kw)
    assert options.per_sequence
    sums, count = reference(model, jacobians, _shifted(y), options, exact_head=estimator == "ggn-topk")
    groups = {k: _groups(v, options.shared_group, count) for k, v in sums.items()}
    data = [(x[:3], y[:3]), (x[3:], y[3:])]
    got = normflat.hessian_diagonal(model, data, progress=False, chunk_size=2, **kw)
    assert list(got) == list(LAYOUT)
    for name, g in groups.items():
        assert_close(np.asarray(got[name]), g.mean(axis=0), name)
    problems, meta = layer_problems(model, data, options, chunk_size=2)
    assert meta["sequence_signals"] is True and meta["loss_terms"] == count == 9
    assert [p.name for p in problems] == list(LAYOUT)
    for p in problems:
        # A convolution's groups are kept as kernel sums (normflat.engine.estimators).
        want = stored_groups(groups[p.name], p.hessian_diag_samples.shape)
        assert p.hessian_diag_samples.shape == want.shape and want.shape[:3] == (options.groups, *p.shape[:2])
        assert_close(np.asarray(p.hessian_diag_samples), want, p.name)
    # The cross-token terms are really there: per-token signals give other numbers.
    per_token, _ = reference(model, jacobians, _shifted(y), validate_options(
        progress=False, sequence_signals=False, **kw), exact_head=estimator == "ggn-topk")
    assert not np.allclose(per_token["mix"][1:], sums["mix"][1:], rtol=1e-3)


#: The layers of :func:`_tied_lm`: the table in its embedding layout (method §3).
TIED_LAYOUT = {"emb": ("emb/embeddings", _transposed), "mix": ("mix/kernel", _conv1d)}


def _tied_lm():
    """Ids -> a tied ``ReversibleEmbedding`` -> a causal convolution -> its reverse projection: logits ``(n, T,
    VOCAB)``, 4 sequences with padding (id 0, its labels ignored)."""
    keras.utils.set_random_seed(12)
    rng = np.random.default_rng(12)
    emb = L.ReversibleEmbedding(VOCAB, 3, tie_weights=True, dtype=F64, name="emb")
    inp = keras.Input((T,), dtype="int32")
    h = L.Conv1D(3, 2, padding="causal", activation="tanh", dtype=F64, name="mix")(emb(inp))
    model = keras.Model(inp, emb(h, reverse=True))
    for v in model.weights:
        v.assign(rng.normal(size=v.shape) * 0.8)
    x = rng.integers(1, VOCAB, (4, T)).astype("int32")
    x[1, 3] = x[3, 2:] = 0
    y = np.where(x == 0, -100, x)
    return model, x, y


@pytest.mark.parametrize("estimator, loss, samples, top", [("ggn-topk", "ce", 3, 2), ("ggn-mc", "nsce", 3, None)])
def test_tied_table_sequence_signals_equal_brute_force(estimator, loss, samples, top):
    """The tied table on its fast rule (the lookup's and the head's per-sample gradients summed before
    the square): every group estimate against the per-sequence brute force, two batches, chunks of 2."""
    model, x, y = _tied_lm()
    kw = dict(loss=loss, estimator=estimator, samples=samples, top_classes=top, seed=6, shift_labels=True)
    options = validate_options(progress=False, **kw)
    jacobians = _jacobians(model, x, [path for path, _ in TIED_LAYOUT.values()])
    sums, count = reference(model, jacobians, _shifted(y), options, exact_head=False, layout=TIED_LAYOUT)
    groups = {k: _groups(v, options.shared_group, count) for k, v in sums.items()}
    data = [(x[:3], y[:3]), (x[3:], y[3:])]
    problems, meta = layer_problems(model, data, options, chunk_size=2)
    assert meta["sequence_signals"] is True and meta["loss_terms"] == count
    assert [(p.name, p.details["path"]) for p in problems] == [("emb", "fast"), ("mix", "fast")]
    for p in problems:
        want = stored_groups(groups[p.name], p.hessian_diag_samples.shape)
        assert_close(np.asarray(p.hessian_diag_samples), want, p.name)


def test_sequence_layout_counts_signals_per_sequence():
    """20 back-propagations per sequence with the defaults whatever T and C; group 0 never taken."""
    topk = validate_options(estimator="ggn-topk", progress=False)
    for tokens, classes in [(3, 7), (32, 5000)]:
        index, seg = signal_layout(topk, classes, tokens)
        assert len(index) == 20 and 0 not in set(seg.tolist())
        m = topk.token_signals_per_group(classes, tokens)
        np.testing.assert_array_equal(index, [g * m + j for g, j in losses.signal_slots(topk, classes, sequence=True)])
    per_token = validate_options(estimator="ggn-topk", sequence_signals=False, progress=False)
    index, seg = signal_layout(per_token, 7, 3)
    assert len(index) == 3 * len(losses.signal_slots(per_token, 7)) and 0 in set(seg.tolist())
    mc = validate_options(estimator="ggn-mc", samples=7, progress=False)
    index, seg = signal_layout(mc, 9, 32)
    assert len(index) == 7 and sorted(seg.tolist()) == sorted(d % mc.groups for d in range(7))
    # (n, C) logits: the ordinary layout, whatever sequence_signals says.
    np.testing.assert_array_equal(signal_layout(mc, 9)[0], signal_layout(mc, 9, None)[0])
    assert len(signal_layout(mc, 9)[0]) == 7


def _token_dense(tokens=T, classes=C, seed=3):
    """One Dense over the tokens of ``(n, T, 2)`` inputs: token logits at a small compile cost."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((tokens, 2), dtype=F64), L.Dense(classes, dtype=F64, name="head")])
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, (2, tokens))
    y[0, 0] = -100
    return model, (rng.normal(size=(2, tokens, 2)), y)


def test_sequence_signals_metadata_and_auto():
    """``sequence_signals`` in the report; ``auto`` on token logits: ggn-topk per sequence, even for
    4 tokens of 5 classes, or per token (sequence_signals=False) the (n, C) rule, here ggn."""
    model, data = _token_dense()
    run = lambda **kw: normflat.analyze(model, data, progress=False, loss="ce", **kw).metadata  # noqa: E731
    assert run(estimator="ggn-mc", samples=2)["sequence_signals"] is True
    assert run(estimator="ggn-mc", samples=2, sequence_signals=False)["sequence_signals"] is False
    assert run(estimator="ggn")["sequence_signals"] is False
    auto = run()
    assert auto["estimator"] == "ggn-topk" and auto["sequence_signals"] is True
    per_token = run(sequence_signals=False)
    assert per_token["estimator"] == "ggn" and per_token["sequence_signals"] is False
    assert run(estimator="hutchinson", samples=2)["sequence_signals"] is None
    classifier = keras.Sequential([keras.Input((3,), dtype=F64), L.Dense(C, dtype=F64)])
    rng = np.random.default_rng(0)
    meta = normflat.analyze(classifier, (rng.normal(size=(4, 3)), rng.integers(0, C, 4)), loss="ce",
                            estimator="ggn-mc", samples=2, progress=False).metadata
    assert meta["sequence_signals"] is None  # (n, C) logits


@pytest.mark.parametrize("kw", [dict(loss="ce", estimator="ggn"), dict(loss="nsce", estimator="ggn-mc", samples=3),
                                dict(loss="ce", estimator="ggn-topk", top_classes=2, samples=4)],
                         ids=["ggn", "ggn-mc", "ggn-topk"])
def test_per_token_block_is_the_block_of_the_whole_signals(kw):
    """Per token (``sequence_signals=False``) a step forms only its block of signals from the
    per-token factor (method §9, "Memory"): every block equals the same block of the engine's whole
    ``token_signals`` tensor (real slots, zero padding past the end), counted tokens and draws
    included."""
    from normflat.backends.keras.ggn import _token_block

    options = validate_options(progress=False, sequence_signals=False, seed=3, **kw)
    n, t, c = 3, 4, 6
    rng = np.random.default_rng(31)
    z = rng.normal(size=(n, t, c)) * 2
    counted = (rng.random((n, t)) > 0.3).astype(np.float64)
    u = sample_uniforms(3, 0, 0, n, options.uniform_columns(t)) if options.draws else np.zeros((n, 0))
    index, _ = signal_layout(options, c, t)
    whole = losses.token_signals(np, z, options, counted, u if options.draws else None)  # (K', M·T, n, T, C)
    real = whole.reshape(-1, n, t, c)[index]
    block = 5
    for start in range(0, len(index), block):
        got = _token_block(tf.constant(z), tf.constant(u), tf.constant(counted), options, index, tf.constant(start),
                           block, t)
        want = np.concatenate([real, np.zeros((block, n, t, c))])[start:start + block]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kw", [dict(loss="nsce", estimator="ggn-mc", samples=3),
                                dict(loss="ce", estimator="ggn-topk", top_classes=2, samples=4)],
                         ids=["ggn-mc", "ggn-topk"])
def test_per_sequence_block_is_the_block_of_the_whole_signals(kw):
    """Per sequence a step forms only its block of signals from the tokens' classes and scales
    (method §9, "Memory"): every block equals the same block of the engine's whole
    ``token_signals`` tensor (real slots, the empty group 0 of ``ggn-topk`` left out, zero padding
    past the end), signs, counted tokens and draws included."""
    from normflat.backends.keras.ggn import _sequence_block

    options = validate_options(progress=False, seed=3, **kw)
    n, t, c = 3, 4, 6
    assert options.sequence_layout(t)
    rng = np.random.default_rng(32)
    z = rng.normal(size=(n, t, c)) * 2
    counted = (rng.random((n, t)) > 0.3).astype(np.float64)
    u = sample_uniforms(3, 0, 0, n, options.uniform_columns(t))
    index, _ = signal_layout(options, c, t)
    whole = losses.token_signals(np, z, options, counted, u)  # (K', M', n, T, C)
    real = whole.reshape(-1, n, t, c)[index]
    assert np.any(real)
    block = next(b for b in range(2, len(index)) if len(index) % b)  # several blocks, the last one padded
    for start in range(0, len(index), block):
        got = _sequence_block(tf.constant(z), tf.constant(u), tf.constant(counted), options, index,
                              tf.constant(start), block)
        want = np.concatenate([real, np.zeros((block, n, t, c))])[start:start + block]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kw", [dict(loss="nsce", estimator="ggn-mc", samples=3),
                                dict(loss="ce", estimator="ggn-topk", top_classes=2, samples=4),
                                dict(loss="nsce", estimator="ggn-topk", top_classes=1, samples=3)],
                         ids=["ggn-mc-nsce", "ggn-topk-ce", "ggn-topk-nsce"])
def test_per_sequence_block_at_the_heads_input_is_the_block_of_the_whole_signals_through_it(kw):
    """Per sequence a step's signals at a ``Dense`` head's input come from the tokens' classes and
    scales in structured form (:func:`~normflat.engine.losses.sequence_factor`, ``O(d)`` per
    signal and token, method §6.3): every block equals the same block of the engine's whole
    ``token_signals`` tensor pulled back through the kernel (real slots, zero padding past the end)."""
    from normflat.backends.keras.ggn import _head_input_signals

    options = validate_options(progress=False, seed=4, **kw)
    n, t, c, d = 3, 4, 6, 5
    rng = np.random.default_rng(33)
    z = rng.normal(size=(n, t, c)) * 2
    kernel = rng.normal(size=(d, c))
    counted = (rng.random((n, t)) > 0.3).astype(np.float64)
    u = sample_uniforms(4, 0, 0, n, options.uniform_columns(t))
    index, _ = signal_layout(options, c, t)
    whole = losses.token_signals(np, z, options, counted, u)  # (K', M', n, T, C)
    real = np.einsum("bntc,dc->bntd", whole.reshape(-1, n, t, c)[index], kernel)
    assert np.any(real)
    factor = losses.sequence_factor(TF, tf.constant(z), options, tf.constant(counted), tf.constant(u))
    block = next(b for b in range(2, len(index)) if len(index) % b)  # several blocks, the last one padded
    for start in range(0, len(index), block):
        got = _head_input_signals(factor, tf.constant(kernel), index, tf.constant(start), block)
        want = np.concatenate([real, np.zeros((block, n, t, d))])[start:start + block]
        np.testing.assert_allclose(got.numpy().reshape(block, n, t, d), want, rtol=1e-12, atol=1e-13)


#: The layers of :func:`_head_lm`: every one fast.
HEAD_LAYOUT = {name: LAYOUT[name] for name in ("emb", "mix", "head")}


def _head_lm():
    """Ids -> an Embedding -> a causal convolution -> a Dense head on the token logits ``(n, T, C)``."""
    keras.utils.set_random_seed(13)
    rng = np.random.default_rng(13)
    inp = keras.Input((T,), dtype="int32")
    e = L.Embedding(VOCAB, 3, dtype=F64, name="emb")(inp)
    m = L.Conv1D(3, 2, padding="causal", activation="tanh", dtype=F64, name="mix")(e)
    model = keras.Model(inp, L.Dense(C, dtype=F64, name="head")(m))
    for v in model.weights:
        v.assign(rng.normal(size=v.shape) * 0.8)
    x = rng.integers(0, VOCAB, (4, T)).astype("int32")
    y = rng.integers(0, C, (4, T))
    y[1, 2] = y[3, 0] = -100
    return model, x, y


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "token-blocks"])
@pytest.mark.parametrize("loss, samples, top", [("ce", 3, 1), ("nsce", 2, 2)])
def test_sequence_signals_start_at_the_heads_input(loss, samples, top, blocks, monkeypatch):
    """``ggn-topk`` per sequence with a ``Dense`` head on the token logits and no generic layer: the
    other layers' signals start at the head's input (structured, method §6.3) and no signal is
    formed at the logits; every group estimate against the per-sequence brute force, two batches
    in chunks of 2. ``token-blocks``: the work at the logits (the checks, the head's squares, the
    tokens' classes) one token at a time (``ggn.token_blocks``), the same numbers."""
    from normflat.backends.keras import ggn

    taken = []
    if blocks:
        monkeypatch.setattr(ggn, "LOGIT_BLOCK_ENTRIES", C)  # one token of a sequence per block
        real = ggn.token_blocks
        monkeypatch.setattr(ggn, "token_blocks", lambda *a: (taken.append(real(*a)), taken[-1])[1])
    calls = {"structured": [], "dense": []}
    for name, kind in (("_head_input_signals", "structured"), ("_sequence_block", "dense")):
        def spy(*args, _f=getattr(ggn, name), _kind=kind, **kwargs):
            calls[_kind].append(1)
            return _f(*args, **kwargs)
        monkeypatch.setattr(ggn, name, spy)
    model, x, y = _head_lm()
    kw = dict(loss=loss, estimator="ggn-topk", samples=samples, top_classes=top, seed=7)
    options = validate_options(progress=False, **kw)
    jacobians = _jacobians(model, x, [path for path, _ in HEAD_LAYOUT.values()])
    sums, count = reference(model, jacobians, y, options, exact_head=True, layout=HEAD_LAYOUT)
    groups = {k: _groups(v, options.shared_group, count) for k, v in sums.items()}
    data = [(x[:3], y[:3]), (x[3:], y[3:])]
    problems, meta = layer_problems(model, data, options, chunk_size=2)
    assert meta["sequence_signals"] is True and meta["loss_terms"] == count
    assert [(p.name, p.details["path"]) for p in problems] == [(name, "fast") for name in HEAD_LAYOUT]
    for p in problems:
        want = stored_groups(groups[p.name], p.hessian_diag_samples.shape)
        assert_close(np.asarray(p.hessian_diag_samples), want, p.name)
    assert calls["structured"] and not calls["dense"]
    assert not blocks or (taken and all(b == [(t, t + 1) for t in range(T)] for b in taken))


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_token_blocks_give_the_whole_logits_numbers(loss, monkeypatch):
    """The step's work at token logits a block of tokens at a time (``ggn.token_blocks``, method §9):
    the logit checks, a head's exact squares and the per-sequence factor (and its signals through
    the head) equal those of the whole logits, in graph mode, blocks of one and of three tokens."""
    from normflat.backends.keras import ggn

    rng = np.random.default_rng(5)
    n, t, c, d = 3, 7, 5, 4
    z = tf.constant(rng.normal(size=(n, t, c)) * 2)
    z = tf.tensor_scatter_nd_update(z, [[1, 4]], tf.fill([1, c], tf.constant(0.5, tf.float64)))  # a constant row
    counted = np.ones((n, t))
    counted[2, 5] = 0.0
    counted = tf.constant(counted)
    x = tf.constant(rng.normal(size=(n, t, d)))
    kernel = tf.constant(rng.normal(size=(d, c)))
    options = validate_options(progress=False, loss=loss, estimator="ggn-topk", samples=3, top_classes=2, seed=3)
    u = tf.constant(rng.uniform(size=(n, options.uniform_columns(t))))
    layout = signal_layout(options, c, t)[0]

    @tf.function
    def run(z, counted, u, x):
        blocks = ggn.token_blocks(t, c)
        factor = ggn._blocked_sequence_factor(z, options, counted, u, blocks)
        through = ggn._head_input_signals(factor, kernel, tf.constant(layout, tf.int32), tf.constant(0), len(layout))
        return (ggn._blocked_logit_stats(z, blocks), ggn._head_squares(x, z, counted, options, t),
                factor.dense(TF), through)

    whole = [v.numpy() for v in run(z, counted, u, x)]
    for per_block in (1, 3):
        monkeypatch.setattr(ggn, "LOGIT_BLOCK_ENTRIES", per_block * c)
        assert ggn.token_blocks(t, c)[:2] == [(0, per_block), (per_block, 2 * per_block)]
        run = tf.function(run.python_function)  # a fresh trace with these blocks
        for got, want in zip(run(z, counted, u, x), whole):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-13, atol=1e-15)
    assert whole[0][3] == 0  # the constant row's RMS, found in its block
    assert ggn.token_blocks(None, c) is None  # (n, C) logits: rows whole


def test_steps_return_one_sum_when_pooled_and_for_an_exact_head(monkeypatch):
    """The compiled step returns, per layer, what the state keeps: one sum when only the groups'
    mean is wanted (``hessian_diagonal``: each signal weighted in the step, not ``K'`` sums of every
    layer then their weighted sum), one shared sum for an exact ``Dense`` head beside the others'
    ``K'`` (``analyze``), and an embedding's squares on the rows the piece read only
    (``ggn.TableRows``), never a table of the vocabulary; the same numbers."""
    from normflat.backends.keras import ggn
    from normflat.backends.keras import session as keras_session

    model, x, y = _head_lm()
    options = validate_options(progress=False, loss="ce", estimator="ggn-topk", samples=4, top_classes=1, seed=5)
    seen = []
    add = keras_session.KerasSession._add

    def spy(self, state, layer, value):
        name = self.entries[layer].name
        if isinstance(value, ggn.TableRows):
            seen.append((name, int(value.values.shape[0]), sorted(np.asarray(value.rows).tolist())))
        else:
            seen.append((name, int(value.shape[0]), None))
        return add(self, state, layer, value)

    monkeypatch.setattr(keras_session.KerasSession, "_add", spy)
    pooled = normflat.hessian_diagonal(model, (x, y), **{k: getattr(options, k) for k in
                                                          ("loss", "estimator", "samples", "top_classes", "seed")},
                                       progress=False)
    assert seen and {count for _, count, _ in seen} == {1}, seen
    read = sorted(set(x.reshape(-1).tolist()))
    assert [rows for name, _, rows in seen if name == "emb"] == [read]  # one piece: the ids it reads
    seen.clear()
    problems, _ = layer_problems(model, (x, y), options)
    assert {name: count for name, count, _ in seen} == {"emb": options.state_groups, "mix": options.state_groups,
                                                         "head": 1}
    for p in problems:
        np.testing.assert_allclose(np.asarray(pooled[p.name]), np.asarray(p.hessian_diag), rtol=1e-11,
                                   atol=1e-14 * float(np.abs(p.hessian_diag).max()))


def test_table_rows_dense():
    """``TableRows.dense`` (the device path's addition): the rows read at their place in the
    ``(K, features, vocabulary)`` table, zero elsewhere, as the host adds them in place."""
    from normflat.backends.keras import ggn

    values = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4) + 1
    rows = np.array([5, 0, 7, 2])
    dense = ggn.TableRows(tf.constant(values), tf.constant(rows, tf.int64)).dense(9).numpy()
    want = np.zeros((2, 3, 9))
    want[:, :, rows] += values
    np.testing.assert_array_equal(dense, want)


def test_embedding_feature_rescaling_with_the_head_on_token_logits():
    """Per-sequence ggn-topk with a ``Dense`` head on the token logits (its squares from the token
    rows, the other layers' signals from its input, method §6.3): an embedding feature scaled by c
    and the next layer's input row by 1/c keep the function, every layer's normalized sharpness and
    the total; the trace moves."""
    def build(scales=None):
        keras.utils.set_random_seed(14)
        rng = np.random.default_rng(14)
        inp = keras.Input((T,), dtype="int32")
        e = L.Embedding(VOCAB, 3, dtype=F64, name="emb")(inp)
        m = L.Dense(4, activation="tanh", dtype=F64, name="mix")(e)
        model = keras.Model(inp, L.Dense(C, dtype=F64, name="head")(m))
        for v in model.weights:
            v.assign(rng.normal(size=v.shape) * 0.8)
        if scales is not None:
            emb, mix = model.get_layer("emb"), model.get_layer("mix")
            emb.embeddings.assign(emb.embeddings.numpy() * scales[None, :])
            mix.kernel.assign(mix.kernel.numpy() / scales[:, None])
        return model

    model, moved = build(), build(np.random.default_rng(15).uniform(0.3, 3.3, size=3))
    x = np.random.default_rng(16).integers(0, VOCAB, (4, T)).astype("int32")
    y = np.random.default_rng(17).integers(0, C, (4, T))
    y[0, 1] = -100
    np.testing.assert_allclose(moved(x).numpy(), model(x).numpy(), rtol=1e-12, atol=1e-12)
    kw = dict(loss="ce", estimator="ggn-topk", top_classes=1, samples=3, seed=18, progress=False)
    r0, r1 = (normflat.analyze(m, [(x[:3], y[:3]), (x[3:], y[3:])], chunk_size=2, **kw) for m in (model, moved))
    assert r0.metadata["sequence_signals"] is True
    assert [layer.name for layer in r0.layers] == [layer.name for layer in r1.layers] == ["emb", "mix", "head"]
    assert_invariant(r0, r1)  # every layer's normalized sharpness and the total kept, the trace moved


_RETAINED_SCRIPT = r"""
import gc, os
import numpy as np
import tensorflow as tf
import keras
import normflat

L = keras.layers
keras.utils.set_random_seed(0)
V, T = 8000, 16
ids = keras.Input((T,), dtype="int32")
tied = L.ReversibleEmbedding(V, 32, tie_weights=True, name="tied")
h = tied(ids)
h = L.Add()([h, L.Dense(32, name="mix")(h)])
tied_lm = keras.Model(ids, tied(h, reverse=True))
h = L.Embedding(V, 32, name="emb")(ids)
head_lm = keras.Model(ids, L.Dense(V, name="head")(L.Dense(32, activation="tanh", name="mix2")(h)))
x = np.random.default_rng(0).integers(0, V, size=(4, T)).astype("int32")
y = np.concatenate([x[:, 1:], np.full((4, 1), -100)], axis=1)

def in_use():
    gc.collect()
    return tf.config.experimental.get_memory_info("CPU:0")["current"]

before = in_use()
for model in (tied_lm, head_lm):
    normflat.analyze(model, (x, y), loss="ce", progress=False)
print((in_use() - before) / 2**20)
"""


def test_compiled_steps_keep_no_sums_between_analyses():
    """A compiled step must not keep weight-sized arrays while the model lives: TensorFlow's graph
    optimizer folds ``tf.zeros`` of a static shape into constants the step holds, which kept the
    zero groups of a head's exact sums and a tied table's running sums (``K'`` vocabulary-sized
    tables: about 0.9 GiB for a GPT-2-sized tied table) between analyses. In a fresh process with
    TensorFlow's allocator statistics on (``TF_CPU_ALLOCATOR_USE_BFC``), a tied and an untied
    language model (8000 ids; each weight-sized sum 1 MiB) are analyzed; afterwards the memory in use is back within 2 MiB of what it was, the models still alive."""
    import subprocess
    import sys

    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _RETAINED_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    retained = float(done.stdout.strip().splitlines()[-1])
    assert retained < 2.0, f"{retained:.1f} MiB kept by the compiled steps"
