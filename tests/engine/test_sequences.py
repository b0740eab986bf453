"""Token logits, Hugging Face outputs, packed weights and the parameter inventory (method §3, §6.3, §9).

Framework-free: numpy stands in for every backend's array namespace.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from normflat.engine import losses, validate_options
from normflat.engine.data import Batch, labels_for
from normflat.engine.outputs import select_output
from normflat.engine.problems import LayerSpec, ParameterStatus, build_metadata, build_problems, coverage, \
    split_diagonals
from normflat.engine.registry import STATE_DECAY_REASON, excluded_reason, position_table
from tests.engine._fakes import NumpyAdapter, logit_hessians

RNG = np.random.default_rng(7)
ADAPTER = NumpyAdapter()


def _opts(**kw):
    kw.setdefault("estimator", "ggn")  # these tests call the signal functions of a resolved estimator
    return validate_options(progress=False, **kw)


def _batch(y, n=None):
    n = len(y) if n is None else n
    return Batch(index=3, x=np.zeros((n, 1)), y=y, n=n, offset=0)


# ----------------------------------------------------------------------------- token labels


def test_token_labels_keep_ignore_index_and_check_range():
    y = np.array([[1, 2, -100], [0, -100, 3]])
    got = labels_for(_batch(y), 4, ADAPTER, _opts(), tokens=3)
    np.testing.assert_array_equal(got, y)
    with pytest.raises(ValueError, match=r"in \[0, 3\] or ignore_index=-100"):
        labels_for(_batch(np.array([[1, 4, 0]])), 4, ADAPTER, _opts(), tokens=3)
    with pytest.raises(ValueError, match=r"in \[0, 3\] or ignore_index=-1"):
        labels_for(_batch(np.array([[1, -100, 0]])), 4, ADAPTER, _opts(ignore_index=-1), tokens=3)
    np.testing.assert_array_equal(
        labels_for(_batch(np.array([[1, -1, 0]])), 4, ADAPTER, _opts(ignore_index=-1), tokens=3), [[1, -1, 0]])


def test_token_labels_shift_for_causal_models():
    y = np.array([[5, 1, 2, 3]])
    got = labels_for(_batch(y), 6, ADAPTER, _opts(), tokens=4, shift=True)
    np.testing.assert_array_equal(got, [[1, 2, 3, -100]])


@pytest.mark.parametrize("y, match", [
    (np.array([1, 2]), "one class per sample"),
    (np.array([[1, 2], [0, 1]]), "2 token labels per sample but the model returns logits for 3"),
    (np.zeros((2, 3, 4)), "integer token labels of shape"),
])
def test_token_labels_that_do_not_fit_the_logits(y, match):
    with pytest.raises(ValueError, match=match):
        labels_for(_batch(y), 4, ADAPTER, _opts(), tokens=3)


def test_output_shape_accepts_token_logits_only():
    assert losses.check_output_shape((2, 5, 7), _opts(), 0, 2) == 7
    with pytest.raises(ValueError, match=r"token logits \(batch, tokens, classes\)"):
        losses.check_output_shape((2, 5, 7, 3), _opts(), 0, 2)


# ----------------------------------------------------------------------------- the token loss


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_token_loss_sum_counts_only_labelled_tokens(loss):
    z = RNG.normal(size=(3, 4, 5))
    y = np.array([[0, 1, -100, 4], [-100, -100, 2, 2], [3, 3, 3, -100]])
    got = losses.loss_sum(np, z, y, _opts(loss=loss))
    mask = y >= 0
    ref = losses.loss_sum(np, z[mask], y[mask], _opts(loss=loss))  # the counted tokens as rows
    np.testing.assert_allclose(got, ref, rtol=1e-14)


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_token_signals_factor_the_block_diagonal_hessian(loss):
    """Σ_j s_j s_jᵀ over the M·T signals of one sequence is the Hessian of its summed token
    loss in the (T·C) logits: block-diagonal, the per-token blocks, zero at ignored tokens."""
    n, t, c = 2, 3, 4
    z = RNG.normal(size=(n, t, c)) * 2
    counted = np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    sig = losses.token_signals(np, z, _opts(loss=loss), counted)  # (1, (C-1)·T, n, T, C)
    assert sig.shape == (1, (c - 1) * t, n, t, c)
    blocks = logit_hessians(z.reshape(n * t, c), loss).reshape(n, t, c, c)
    for i in range(n):
        s = sig[0, :, i].reshape(-1, t * c)
        ref = np.zeros((t * c, t * c))
        for k in range(t):
            ref[k * c:(k + 1) * c, k * c:(k + 1) * c] = counted[i, k] * blocks[i, k]
        np.testing.assert_allclose(s.T @ s, ref, atol=1e-13)


@pytest.mark.parametrize("estimator", ["ggn", "ggn-mc"])
def test_token_signal_blocks_make_up_the_whole_factor(estimator):
    """Blocks of tokens (how a backend bounds memory) concatenate to the signals of every token."""
    n, t, c, draws = 2, 5, 4, 3
    z = RNG.normal(size=(n, t, c))
    counted = np.array([[1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0, 1.0]])
    opts = _opts(loss="nsce", estimator=estimator, samples=draws if estimator == "ggn-mc" else None,
                 sequence_signals=False if estimator == "ggn-mc" else None)
    u = RNG.uniform(size=(n, t * draws)) if estimator == "ggn-mc" else None
    whole = losses.token_signals(np, z, opts, counted, u)
    k, mt = whole.shape[:2]
    m = mt // t
    blocks = [losses.token_signals(np, z, opts, counted, u, tokens=r) for r in [(0, 2), (2, 3), (3, 5)]]
    # Whole: signal m·T + t; block (lo, hi): signal m·W + j for token lo + j.
    parts = [b.reshape(k, m, -1, n, t, c) for b in blocks]
    np.testing.assert_array_equal(np.concatenate(parts, axis=2).reshape(k, m * t, n, t, c), whole)


def test_token_mc_signals_are_the_row_signals_placed_per_token():
    n, t, c, draws = 2, 3, 5, 4
    z = RNG.normal(size=(n, t, c))
    u = RNG.uniform(size=(n, t * draws))
    opts = _opts(loss="ce", estimator="ggn-mc", samples=draws, sequence_signals=False)
    sig = losses.token_signals(np, z, opts, np.ones((n, t)), u)
    rows = losses.output_signals(np, z.reshape(n * t, c), opts, u.reshape(n * t, draws))
    k, m = rows.shape[:2]
    assert sig.shape == (k, m * t, n, t, c)
    rows = rows.reshape(k, m, n, t, c)
    for tok in range(t):
        np.testing.assert_allclose(sig[:, tok::t][:, :, :, tok], rows[:, :, :, tok], rtol=1e-15)
        others = [o for o in range(t) if o != tok]
        assert np.all(sig[:, tok::t][:, :, :, others] == 0)


# ----------------------------------------------------------------------------- per-sequence signals


def _sequence_case(estimator, loss, samples, top=2, n=2, t=4, c=6):
    z = RNG.normal(size=(n, t, c)) * 1.5
    counted = np.ones((n, t))
    counted[1, 2] = 0.0  # an ignored token carries no signal
    opts = _opts(loss=loss, estimator=estimator, samples=samples,
                 top_classes=top if estimator == "ggn-topk" else None)
    return z, counted, opts


def _exact_sequence_blocks(z, counted, loss):
    """Per sequence, Σ_t counted_t · H_t placed on the (T·C) diagonal blocks (the exact GGN's factor)."""
    n, t, c = z.shape
    blocks = logit_hessians(z.reshape(n * t, c), loss).reshape(n, t, c, c)
    ref = np.zeros((n, t * c, t * c))
    for i in range(n):
        for k in range(t):
            ref[i, k * c:(k + 1) * c, k * c:(k + 1) * c] = counted[i, k] * blocks[i, k]
    return ref


def test_sequence_signals_options_layout_and_validation():
    topk = _opts(estimator="ggn-topk", samples=10, top_classes=2)
    assert topk.per_sequence and topk.sign_draws == 5 * (2 + 2)
    assert topk.uniform_columns(None) == 10 and topk.uniform_columns(7) == 7 * (10 + 20)
    assert topk.token_signals_per_group(1000, 7) == 2 + 2
    assert topk.token_signals_per_group(1, 7) == 1 + 2  # k clipped to C, the sign layout is not
    off = _opts(estimator="ggn-topk", sequence_signals=False)
    assert not off.per_sequence and off.sign_draws == 0 and off.token_signals_per_group(1000, 7) == 2 * 7
    mc = _opts(estimator="ggn-mc", samples=3)
    assert mc.per_sequence and mc.sign_draws == 0 and mc.token_signals_per_group(50, 9) == 1
    assert not _opts(estimator="ggn").per_sequence
    # The one predicate of the backends: per sequence only for token logits.
    assert topk.sequence_layout(7) and not topk.sequence_layout(None)
    assert not off.sequence_layout(7) and not _opts(estimator="ggn").sequence_layout(7)
    with pytest.raises(ValueError, match="sequence_signals=True needs a stochastic GGN estimator"):
        _opts(estimator="ggn", sequence_signals=True)
    with pytest.raises(ValueError, match="sequence_signals=False has no meaning"):
        _opts(estimator="hutchinson", sequence_signals=False)
    with pytest.raises(TypeError, match="sequence_signals must be True, False or None"):
        _opts(estimator="ggn-mc", sequence_signals=1)


def test_auto_counts_signals_per_sequence_for_token_logits():
    from normflat.engine.options import resolve_estimator
    auto = validate_options(progress=False)
    assert resolve_estimator(auto, 10).estimator == "ggn"  # (n, C): up to 25 classes exact
    # Token logits: ggn-topk per sequence whatever T and C (ranks with sequences of other lengths agree)
    for c, t in [(10, 32), (3, 4), (2, 1), (50000, 1024)]:
        resolved = resolve_estimator(auto, c, tokens=t)
        assert resolved.estimator == "ggn-topk" and resolved.per_sequence
    per_token = validate_options(progress=False, sequence_signals=False)
    assert resolve_estimator(per_token, 10, tokens=32).estimator == "ggn"  # the (n, C) rule per token
    assert resolve_estimator(per_token, 100, tokens=32).estimator == "ggn-topk"


@pytest.mark.parametrize("loss", ["ce", "nsce"])
@pytest.mark.parametrize("estimator, samples", [("ggn-mc", 3), ("ggn-topk", 6)])
def test_sequence_signals_are_signed_sums_of_the_per_token_signals(estimator, samples, loss):
    """A per-sequence signal is Σ_t ε_t s_t over the per-token signals of the same draws (ε = ±1;
    ggn-mc: ε = 1, its s_t have mean zero); E[ε_t ε_t'] = δ_tt' and the independent draws make each
    group's squares an unbiased estimate of the sequence's block-diagonal logit Hessian."""
    z, counted, opts = _sequence_case(estimator, loss, samples)
    n, t, c = z.shape
    u = RNG.uniform(size=(n, opts.uniform_columns(t)))
    sig = losses.token_signals(np, z, opts, counted, u)
    m = opts.token_signals_per_group(c, t)
    assert sig.shape == (opts.state_groups, m, n, t, c)
    per_token = _opts(loss=loss, estimator=estimator, samples=samples, sequence_signals=False,
                      top_classes=2 if estimator == "ggn-topk" else None)
    d = opts.uniform_columns(t) // t
    placed = losses.token_signals(np, z, per_token, counted, u.reshape(n, t, d)[:, :, :samples].reshape(n, -1))
    mt = placed.shape[1] // t
    placed = placed.reshape(placed.shape[0], mt, t, n, t, c).sum(axis=2)  # (K', M, n, T, C): token t at t
    if estimator == "ggn-mc":
        np.testing.assert_allclose(sig, placed, rtol=1e-14, atol=1e-16)
        return
    assert np.all(sig[0] == 0)
    signs = np.where(u.reshape(n, t, d)[:, :, samples:] < 0.5, 1.0, -1.0).reshape(n, t, 5, 2 + 2)
    for g in range(5):
        for j in range(2):  # the top classes (k = 2), then the draws (ceil(6 / 5) = 2 per group)
            want_top = placed[0, j] * signs[:, :, g, j][..., None]
            np.testing.assert_allclose(sig[1 + g, j], want_top, rtol=1e-14, atol=1e-16)
            want_draw = placed[1 + g, j] * signs[:, :, g, 2 + j][..., None]
            np.testing.assert_allclose(sig[1 + g, 2 + j], want_draw, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("estimator, samples", [("ggn-mc", 3), ("ggn-topk", 6)])
def test_sequence_signals_average_to_the_block_diagonal_hessian(estimator, samples):
    """Over many independent uniforms the groups' squares approach the exact block-diagonal Hessian
    (the cross-token blocks vanish), while one draw has cross-token terms."""
    z, counted, opts = _sequence_case(estimator, "nsce", samples)
    n, t, c = z.shape
    ref = _exact_sequence_blocks(z, counted, "nsce")
    draws = 2000
    u = np.random.default_rng(11).uniform(size=(draws, n, opts.uniform_columns(t)))
    first = 1 if opts.shared_group else 0
    total = np.zeros_like(ref)
    for d in range(draws):
        s = losses.token_signals(np, z, opts, counted, u[d])[first:]
        s = s.reshape(s.shape[0], s.shape[1], n, t * c)
        one = np.einsum("gmia,gmib->giab", s, s)
        total += one.mean(axis=0)
        if d == 0:
            assert np.abs(one[0, 0, :c, c:2 * c]).max() > 1e-3 * np.abs(ref).max()
    mean = total / draws
    assert np.linalg.norm(mean - ref) <= 0.05 * np.linalg.norm(ref)
    assert np.all(mean[1, 2 * c:3 * c] == 0)  # sequence 1, token 2 is not counted


def test_sequence_topk_slots_zero_group_and_pooling():
    z, counted, opts = _sequence_case("ggn-topk", "ce", 10, top=2)
    n, t, c = z.shape
    u = RNG.uniform(size=(n, opts.uniform_columns(t)))
    sig = losses.token_signals(np, z, opts, counted, u)  # (1 + K, 2 + 2, n, T, C)
    assert sig.shape == (6, 4, n, t, c)
    # The real slots are those the backends back-propagate; the others are zero.
    real = set(losses.signal_slots(opts, c, sequence=True))
    for g in range(opts.state_groups):
        for j in range(sig.shape[1]):
            if (g, j) not in real:
                assert np.all(sig[g, j] == 0)
    assert losses.zero_signals(opts, sig.shape[1], sequence=True) == list(range(sig.shape[1]))
    assert losses.padding_signals(opts, c, sequence=True) == list(range(sig.shape[1]))  # group 0 only
    assert losses.padding_signals(opts, c, members=(1, 3), sequence=True) == [0, 1]
    # Pooled (only the mean wanted): one group, the empty shared group left out, no padding.
    pooled, padding = losses.pool_signals(np, sig, opts, sequence=True,
                                          padding=losses.padding_signals(opts, c, sequence=True))
    assert pooled.shape == (1, 5 * sig.shape[1], n, t, c) and padding == []
    np.testing.assert_allclose(np.einsum("gm...,gm...->g...", pooled, pooled)[0],
                               np.einsum("gm...,gm...->...", sig[1:], sig[1:]) / 5, rtol=1e-13)


def test_pooled_signals_square_to_the_mean_of_the_group_sums():
    """pool_signals: the squares of the one pooled group sum to the mean over the K groups of
    (shared + sampled) squares, for ggn-topk (shared group unscaled) and ggn-mc."""
    from normflat.engine.options import validate_options

    for estimator, extra in (("ggn-topk", {"top_classes": 3}), ("ggn-mc", {})):
        opts = validate_options(loss="ce", estimator=estimator, samples=14, progress=False, **extra)
        offset = 1 if opts.shared_group else 0
        m = opts.signals_per_group(6)  # 3 (topk: 3 exact, 3 draws in 4 of 5 groups) or 2 (mc: 14 in 10)
        padding = losses.padding_signals(opts, 6)
        assert padding == ([5 * m + 2] if offset else [g * m + 1 for g in range(4, 10)])
        sig = RNG.normal(size=(offset + opts.groups, m, 4, 6))
        sig.reshape(-1, 4, 6)[padding] = 0.0  # the padding the engine's signals have
        pooled, pooled_padding = losses.pool_signals(np, sig, opts, padding=padding)
        assert pooled.shape[0] == 1 and pooled_padding == padding  # the same flat order
        np.testing.assert_array_equal(pooled[0][pooled_padding], 0.0)
        squares = np.einsum("gmnc,gmnc->gnc", sig, sig)
        groups = squares[offset:] + (squares[0] if offset else 0)
        np.testing.assert_allclose(np.einsum("mnc,mnc->nc", pooled[0], pooled[0]), groups.mean(0), rtol=1e-13)


@pytest.mark.parametrize("estimator", ["ggn-topk", "ggn-mc"])
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_sequence_signals_in_blocks_of_members_are_the_whole(estimator, loss):
    """members=(lo, hi): the same draws and signs, members lo .. hi - 1 of every group; the blocks
    side by side are the whole set (a backend forms one block at a time)."""
    z, counted, opts = _sequence_case(estimator, loss, 7, top=2)
    u = RNG.uniform(size=(z.shape[0], opts.uniform_columns(z.shape[1])))
    whole = losses.token_signals(np, z, opts, counted, u)
    m = whole.shape[1]
    assert m == opts.token_signals_per_group(z.shape[2], z.shape[1])
    for step in (1, 2, m):
        parts = [losses.token_signals(np, z, opts, counted, u, members=(a, min(m, a + step)))
                 for a in range(0, m, step)]
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)
    with pytest.raises(ValueError, match="per-sequence"):
        losses.token_signals(np, z, replace(opts, sequence_signals=False), counted, u[:, :opts.draws * z.shape[1]],
                             members=(0, 1))


@pytest.mark.parametrize("estimator", ["ggn-topk", "ggn-mc"])
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_sequence_classes_form_any_signals_alone(estimator, loss):
    """sequence_classes + sequence_dense: any selection of the (group, member) signals, formed
    alone from their classes and scales, equals those signals of the whole tensor (a backend
    forms a step of them at a time, method §9)."""
    z, counted, opts = _sequence_case(estimator, loss, 7, top=2)
    n, t, c = z.shape
    u = np.random.default_rng(34).uniform(size=(n, opts.uniform_columns(t)))
    whole = losses.token_signals(np, z, opts, counted, u)  # (K', M', n, T, C)
    k2, m = whole.shape[:2]
    classes = losses.sequence_classes(np, z, opts, counted, u)
    assert classes.index.shape == classes.scale.shape == (k2, m, n * t)
    np.testing.assert_array_equal(losses.sequence_dense(np, classes, opts).reshape(whole.shape), whole)
    flat_index = classes.index.reshape(k2 * m, n * t)
    flat_scale = classes.scale.reshape(k2 * m, n * t)
    picked = np.random.default_rng(33).permutation(k2 * m)[:3]
    got = losses.sequence_dense(np, classes, opts, flat_index[picked][None], flat_scale[picked][None])
    np.testing.assert_array_equal(got.reshape(3, n, t, c), whole.reshape(k2 * m, n, t, c)[picked])
    # A padding slot (class -1, scale 0) is a zero signal.
    pad = losses.sequence_dense(np, classes, opts, -np.ones((1, 1, n * t)), np.zeros((1, 1, n * t)))
    assert not np.any(pad)


@pytest.mark.parametrize("estimator", ["ggn-topk", "ggn-mc"])
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_sequence_factor_is_the_sequence_signals(estimator, loss):
    """sequence_factor: the per-sequence signals in structured form over the token rows; pulled
    through a dense head, the signals at its input (method §6.2, §6.3)."""
    z, counted, opts = _sequence_case(estimator, loss, 7, top=2)
    n, t, c = z.shape
    u = np.random.default_rng(35).uniform(size=(n, opts.uniform_columns(t)))
    whole = losses.token_signals(np, z, opts, counted, u)  # (K', M', n, T, C)
    factor = losses.sequence_factor(np, z, opts, counted, u)
    np.testing.assert_allclose(factor.dense(np).reshape(whole.shape), whole, rtol=1e-12, atol=1e-15)
    weight = np.random.default_rng(36).normal(size=(c, 3))  # a head's (C, d) rows
    np.testing.assert_allclose(factor.through(np, weight).reshape(*whole.shape[:-1], 3), whole @ weight,
                               rtol=1e-12, atol=1e-14)
    part = factor.members(1, 3)
    np.testing.assert_allclose(part.dense(np).reshape(whole[:, 1:3].shape), whole[:, 1:3], rtol=1e-12, atol=1e-15)


def test_sequence_signals_need_every_token_at_once():
    z, counted, opts = _sequence_case("ggn-mc", "ce", 2)
    u = RNG.uniform(size=(z.shape[0], opts.uniform_columns(z.shape[1])))
    with pytest.raises(ValueError, match="all tokens at once"):
        losses.token_signals(np, z, opts, counted, u, tokens=(0, 2))
    whole = losses.token_signals(np, z, opts, counted, u)
    np.testing.assert_array_equal(losses.token_signals(np, z, opts, counted, u, tokens=(0, z.shape[1])), whole)
    # The head's diagonal signals stay per token: exact.
    diag = losses.token_signals(np, z, opts, counted, None, diagonal=True)
    assert diag.shape[1] == z.shape[1]


# ----------------------------------------------------------------------------- outputs


class _ModelOutput(dict):
    """A Hugging Face ``ModelOutput`` is a dict with attributes."""

    def __getattr__(self, name):
        return self[name]


class _Attrs:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _is_array(a):
    return isinstance(a, np.ndarray)


def test_select_output_rules():
    z = np.ones((2, 3))
    assert select_output(z, None, _is_array) is z
    assert select_output(_ModelOutput(loss=np.ones(()), logits=z), None, _is_array) is z
    assert select_output(_Attrs(logits=z), None, _is_array) is z
    assert select_output((z, np.zeros(1)), None, _is_array) is z
    assert select_output({"scores": z}, "scores", _is_array) is z
    assert select_output(_Attrs(scores=z), "scores", _is_array) is z
    assert select_output((np.zeros(1), z), 1, _is_array) is z
    assert select_output({"a": {"b": z}}, lambda o: o["a"]["b"], _is_array) is z


@pytest.mark.parametrize("out, option, match", [
    ({"scores": np.ones(2)}, None, r"dict with keys \['scores'\].*output="),
    ({"scores": np.ones(2)}, "logits", "without that key"),
    ((np.ones(2),), 3, "which that index does not fit"),
    ({"logits": [1, 2]}, None, "not an array of logits"),
    (np.ones(2), lambda o: "x", "callable returned a str"),
])
def test_select_output_errors_name_the_fix(out, option, match):
    with pytest.raises(TypeError, match=match):
        select_output(out, option, _is_array)


@pytest.mark.parametrize("kw, error", [
    ({"ignore_index": 3}, ValueError), ({"ignore_index": 1.5}, TypeError), ({"output": 2.0}, TypeError),
    ({"shift_labels": "yes"}, TypeError),
])
def test_new_options_are_validated(kw, error):
    with pytest.raises(error):
        _opts(**kw)


# ----------------------------------------------------------------------------- packed weights


def test_blocks_split_a_packed_weight_into_problems():
    w = RNG.normal(size=(6, 4))
    s = RNG.uniform(size=(3, 6, 4))
    d = s.mean(0)
    spec = LayerSpec("attn", "attention", "attn.in_proj_weight",
                     blocks=[("query", 0, 2), ("key", 2, 4), ("value", 4, 6)])
    problems = build_problems([spec], [w], [d], [s])
    assert [p.name for p in problems] == ["attn.query", "attn.key", "attn.value"]
    for p, (lo, hi) in zip(problems, [(0, 2), (2, 4), (4, 6)]):
        np.testing.assert_array_equal(np.asarray(p.weight), w[lo:hi])
        np.testing.assert_array_equal(np.asarray(p.hessian_diag), d[lo:hi])
        np.testing.assert_array_equal(np.asarray(p.hessian_diag_samples), s[:, lo:hi])
        assert p.details["param"] == "attn.in_proj_weight" and p.details["rows"] == [lo, hi]
    diags = split_diagonals([spec], [d])
    assert list(diags) == ["attn.query", "attn.key", "attn.value"]


# ----------------------------------------------------------------------------- inventory


def test_excluded_reason_rules():
    assert excluded_reason("fc.bias", (3,)) == "bias"
    assert "vector" in excluded_reason("blocks.0.ls1.gamma", (192,))
    assert "vector" in excluded_reason("cls_token", (1, 1, 192))
    assert "added to activations" in excluded_reason("blocks.0.attn.relative_position_bias_table", (169, 4))
    assert excluded_reason("pos_embed", (1, 65, 192)) is None
    assert excluded_reason("custom.kernel", (3, 4)) is None
    assert excluded_reason("backbone.layers.0.mixer.A_log", (32, 16)) == STATE_DECAY_REASON  # Mamba's
    assert excluded_reason("mixer/A_log", (32, 16)) == STATE_DECAY_REASON


def test_position_tables_are_embeddings_of_the_positions():
    assert position_table("pos_embed", (1, 65, 192)) == (192, 65)
    assert position_table("vit.embeddings.position_embeddings", (1, 5, 8)) == (8, 5)
    assert position_table("learned", (1, 4, 6, 16)) == (16, 24)  # a 2-D grid of positions
    assert position_table("pos_embedding", (10, 8)) == (8, 10)
    assert position_table("cls_token", (1, 1, 8)) is None
    assert position_table("custom.kernel", (3, 4)) is None


def test_coverage_counts_matrix_entries_not_excluded():
    params = [
        ParameterStatus("a.weight", (10, 10), "analyzed"),
        ParameterStatus("a.bias", (10,), "excluded", "bias"),
        ParameterStatus("pos", (1, 50, 10), "excluded", "table"),
        ParameterStatus("b.kernel", (10, 1), "skipped", "no rule"),  # a vector: not a matrix
        ParameterStatus("c.kernel", (5, 20), "skipped", "no rule"),
    ]
    assert coverage(params) == pytest.approx(100 / 200)
    meta = build_metadata("numpy", "0", _opts(), examples=4, batches=1, dtype="float64", device="cpu",
                          unsupported=[], loss_terms=12, parameters=params)
    assert meta["loss_terms"] == 12
    assert meta["excluded"] == {"a.bias": "bias", "pos": "table"}
    assert meta["coverage"] == pytest.approx(0.5)
    assert coverage([ParameterStatus("a.bias", (3,), "excluded")]) is None


def test_nsce_refuses_two_classes():
    """Two normalized logits are always ±τ: the loss would be constant in the weights."""
    # Fixed logits (the module's draws depend on the test order), none nearly tied: there the ε of
    # the normalization, not the logits, would decide the normalized values.
    z = np.array([[0.3, 3.1], [1.2, -2.0], [5.4, 2.2], [-1.0, -4.5], [2.5, 0.1]])
    u = losses.normalize_logits(np, z)[0]
    np.testing.assert_allclose(np.abs(u), 1.0, rtol=1e-10)
    with pytest.raises(ValueError, match="Pass loss='ce' for a binary classifier"):
        losses.check_output_shape((5, 2), _opts(), 0, 5)
    assert losses.check_output_shape((5, 2), _opts(loss="ce"), 0, 5) == 2
    assert losses.check_output_shape((5, 3), _opts(), 0, 5) == 3
