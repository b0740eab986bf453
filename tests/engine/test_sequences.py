"""Token logits, Hugging Face outputs, packed weights and the parameter inventory (method §3, §6.3, §9).

Framework-free: numpy stands in for every backend's array namespace.
"""

from __future__ import annotations

import numpy as np
import pytest

from normflat.engine import losses, validate_options
from normflat.engine.data import Batch, labels_for
from normflat.engine.outputs import select_output
from normflat.engine.problems import LayerSpec, ParameterStatus, build_metadata, build_problems, coverage, \
    split_diagonals
from normflat.engine.registry import excluded_reason, position_table
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
    opts = _opts(loss="nsce", estimator=estimator, samples=draws if estimator == "ggn-mc" else None)
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
    opts = _opts(loss="ce", estimator="ggn-mc", samples=draws)
    sig = losses.token_signals(np, z, opts, np.ones((n, t)), u)
    rows = losses.output_signals(np, z.reshape(n * t, c), opts, u.reshape(n * t, draws))
    k, m = rows.shape[:2]
    assert sig.shape == (k, m * t, n, t, c)
    rows = rows.reshape(k, m, n, t, c)
    for tok in range(t):
        np.testing.assert_allclose(sig[:, tok::t][:, :, :, tok], rows[:, :, :, tok], rtol=1e-15)
        others = [o for o in range(t) if o != tok]
        assert np.all(sig[:, tok::t][:, :, :, others] == 0)


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
    z = RNG.normal(size=(5, 2)) * 3
    u = losses.normalize_logits(np, z)[0]
    np.testing.assert_allclose(np.abs(u), 1.0, rtol=1e-10)
    with pytest.raises(ValueError, match="Pass loss='ce' for a binary classifier"):
        losses.check_output_shape((5, 2), _opts(), 0, 5)
    assert losses.check_output_shape((5, 2), _opts(loss="ce"), 0, 5) == 2
    assert losses.check_output_shape((5, 3), _opts(), 0, 5) == 3
