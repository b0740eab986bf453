"""Keras ``LSTM``, ``GRU`` and ``SimpleRNN`` weights on their fast rule (method §6.1, "Recurrent weights").

The GGN step runs the layer's loop as a recurrence that forms ``x_t W`` for every step at
once and adds a zero tap to every step's ``h_{t-1} U``; each weight's squares are the dense
rule over the steps. Every variant is checked against the brute-force GGN (per-sample
Jacobians, float64) and against the generic path for the stochastic estimators and chunks;
layers the rule cannot see take the generic path with their reason, and stay exact.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras  # noqa: E402

import normflat  # noqa: E402
from tests.arch._keras_invariance import invariance_tolerance, jax_generic  # noqa: E402
from tests.arch.test_keras_layers import (F64, RTOL, _assert_invariant, _clone, _randomize, _rng,  # noqa: E402
                                          _transposed, check_against)

L = keras.layers
T, D, H, C = 4, 2, 3, 3


def _layers(model):
    """The recurrent layers of ``model`` (a ``Bidirectional``'s two directions each)."""
    out = []
    for layer in model.layers:
        if isinstance(layer, L.Bidirectional):
            out += [layer.forward_layer, layer.backward_layer]
        elif isinstance(layer, L.RNN):
            out.append(layer)
    return out


def _names(model):
    """``{report name: (variable path, canonical)}`` of every recurrent weight of ``model``."""
    expected = {}
    for layer in _layers(model):
        cells = layer.cell.cells if isinstance(layer.cell, L.StackedRNNCells) else [layer.cell]
        for cell in cells:
            for w in (cell.kernel, cell.recurrent_kernel):
                name = w.path.removeprefix(model.name + "/")  # a Sequential's variables carry its name
                expected[name] = (w.path, _transposed)
    return expected


def _model(recurrent, masked=False, seed=0):
    """Sequences (n, T, D), optionally masked (trailing zero steps), through ``recurrent`` and a head."""
    rng = _rng(seed)
    inp = keras.Input((T, D), dtype=F64)
    h = L.Masking(0.0, dtype=F64)(inp) if masked else inp
    h = recurrent()(h)
    if len(h.shape) == 3:  # every step's output (pooled with the mask, which Flatten drops)
        h = L.GlobalAveragePooling1D(dtype=F64)(h) if masked else L.Flatten(dtype=F64)(h)
    model = keras.Model(inp, L.Dense(C, dtype=F64, name="head")(h))
    _randomize(model, rng)
    x = rng.normal(size=(5, T, D))
    if masked:
        x[0, 2:] = 0.0  # two steps shorter
        x[2, 1:] = 0.0
    return model, x, rng.integers(0, C, 5)


CASES = {
    "lstm": lambda: L.LSTM(H, return_sequences=True, dtype=F64),
    "lstm-implementation-1-backwards": lambda: L.LSTM(H, implementation=1, go_backwards=True, dtype=F64),
    "lstm-unrolled-no-bias": lambda: L.LSTM(H, unroll=True, use_bias=False, return_sequences=True, dtype=F64),
    "lstm-dropout": lambda: L.LSTM(H, dropout=0.3, recurrent_dropout=0.2, dtype=F64),  # inference: no masks
    "gru": lambda: L.GRU(H, dtype=F64),
    "gru-reset-before-backwards": lambda: L.GRU(H, reset_after=False, go_backwards=True, return_sequences=True,
                                                dtype=F64),
    "gru-reset-before-unrolled": lambda: L.GRU(H, reset_after=False, unroll=True, dtype=F64),
    "simple-rnn": lambda: L.SimpleRNN(H, activation="relu", return_sequences=True, dtype=F64),
    "bidirectional-lstm": lambda: L.Bidirectional(L.LSTM(H, return_sequences=True, dtype=F64), dtype=F64),
}


#: The cases also checked against the generic path with the stochastic estimators (the generic path
#: runs the recurrent loop once per sample and signal: slow).
STOCHASTIC = ("lstm", "gru-reset-before-backwards", "simple-rnn")


def _check_fast(model, x, y, loss="nsce", stochastic=False):
    """Every recurrent weight on the fast path; ``ggn`` against brute force in chunks of 2 (the second
    chunk of one sample); with ``stochastic``, ``ggn-mc`` and ``ggn-topk`` against the generic path
    with the same draws."""
    report = normflat.analyze(model, (x, y), loss=loss, progress=False)
    expected = _names(model)
    for layer in report.layers:
        if layer.name.split(".")[0] in expected:
            assert layer.details["path"] == "fast", (layer.name, layer.details)
    check_against(model, x[:3], y[:3], expected, loss=loss, chunk_size=2)
    if not stochastic:
        return
    for kw in (dict(estimator="ggn-mc", samples=3, seed=2), dict(estimator="ggn-topk", top_classes=2, samples=2,
                                                                   seed=3)):
        fast = normflat.hessian_diagonal(model, (x, y), loss=loss, progress=False, **kw)
        generic = normflat.hessian_diagonal(model, (x, y), loss=loss, progress=False, fast=False, **kw)
        for name in fast:
            np.testing.assert_allclose(np.asarray(fast[name]), np.asarray(generic[name]), rtol=RTOL,
                                       atol=1e-14 * np.abs(np.asarray(generic[name])).max(), err_msg=(name, kw))


@pytest.mark.parametrize("case", sorted(CASES))
def test_recurrent_fast_rule(case):
    model, x, y = _model(CASES[case], seed=1)
    _check_fast(model, x, y, stochastic=case in STOCHASTIC)
    for layer in _layers(model):  # the model is left as it was
        assert "inner_loop" not in vars(layer)


@pytest.mark.parametrize("case", ["gru-reset-before-backwards", "lstm-unrolled-no-bias"])
def test_recurrent_fast_rule_with_masks(case):
    """Masked steps keep the previous state: their taps get no signal (Keras' own masked loop)."""
    model, x, y = _model(CASES[case], masked=True, seed=2)
    _check_fast(model, x, y)


def test_initial_state_and_returned_states():
    rng = _rng(3)
    inp = keras.Input((T, D), dtype=F64)
    start = L.Dense(H, activation="tanh", dtype=F64, name="start")(L.Flatten(dtype=F64)(inp))
    out, h, c = L.LSTM(H, return_state=True, dtype=F64, name="lstm")(inp, initial_state=[start, start])
    g = L.GRU(H, return_sequences=True, dtype=F64, name="gru")(inp, initial_state=out)
    head = L.Dense(C, dtype=F64, name="head")(L.Concatenate(dtype=F64)([out, h, c, L.Flatten(dtype=F64)(g)]))
    model = keras.Model(inp, head)
    _randomize(model, rng)
    _check_fast(model, rng.normal(size=(5, T, D)), rng.integers(0, C, 5), loss="ce")


class _ShiftedForget(L.LSTMCell):
    """An LSTM cell with Keras' own ``call`` whose gates differ (a forget bias of 1 added inside)."""

    def _compute_carry_and_output_fused(self, z, c_tm1):
        z0, z1, z2, z3 = z
        return super()._compute_carry_and_output_fused((z0, z1 + 1.0, z2, z3), c_tm1)


def _generic_cases():
    """Models whose recurrent weights the rule cannot see, with the reason each must give."""
    rng = _rng(4)
    inp = keras.Input((T, D), dtype=F64)
    shared = L.LSTM(H, dtype=F64, name="shared")
    twice = keras.Model(inp, L.Dense(C, dtype=F64)(L.Concatenate(dtype=F64)([shared(inp), shared(inp[:, ::-1])])))
    stacked = keras.Sequential([keras.Input((T, D), dtype=F64),
                                L.RNN(L.StackedRNNCells([L.GRUCell(H, dtype=F64), L.SimpleRNNCell(H, dtype=F64)],
                                                        dtype=F64), dtype=F64),
                                L.Dense(C, dtype=F64)])
    shifted = keras.Sequential([keras.Input((T, D), dtype=F64), L.RNN(_ShiftedForget(H, dtype=F64), dtype=F64),
                                L.Dense(C, dtype=F64)])
    out = []
    for model, reason in ((twice, "its recurrent layer ran 2 times per forward"),
                          (stacked, "its cell is not run by the loop of an LSTM, GRU or SimpleRNN layer of its own"),
                          (shifted, "its recorded recurrence computes other outputs than RNN's own loop")):
        _randomize(model, rng)
        out.append((model, reason))
    return out, rng.normal(size=(3, T, D)), rng.integers(0, C, 3)


def test_generic_recurrent_layers_give_their_reason_and_stay_exact():
    models, x, y = _generic_cases()
    for model, reason in models:
        report = normflat.analyze(model, (x, y), loss="nsce", progress=False)
        expected = _names(model)
        recurrent = [layer for layer in report.layers if layer.name.split(".")[0] in expected]
        assert recurrent
        for layer in recurrent:
            assert layer.details["path"] == "generic" and reason in layer.details["generic_reason"], layer.details
        check_against(model, x, y, expected, loss="nsce")


def test_stateful_recurrent_layer_is_refused_with_the_fix():
    model = keras.Sequential([keras.Input((T, D), batch_size=4, dtype=F64), L.LSTM(H, stateful=True, dtype=F64),
                              L.Dense(C, dtype=F64)])
    rng = _rng(5)
    x, y = rng.normal(size=(4, T, D)), rng.integers(0, C, 4)
    before = [v.numpy() for v in model.get_layer(index=0).states]
    with pytest.raises(ValueError, match="stateful=True"):
        normflat.analyze(model, (x, y), progress=False)
    for v, b in zip(model.get_layer(index=0).states, before):
        np.testing.assert_array_equal(v.numpy(), b)


@pytest.mark.parametrize("recurrent", ["lstm", "gru"])
def test_input_feature_rescaling_is_invariant(recurrent):
    """The features entering the recurrence times c (the projection's columns and bias), the
    recurrent kernel's input rows divided by c: the same function, the same normalized sharpness,
    another Hessian trace (the kernel's and the projection's move)."""
    rng = _rng(6)
    inp = keras.Input((T, D), dtype=F64)
    h = L.Dense(3, dtype=F64, name="proj")(inp)
    cell = {"lstm": L.LSTM(H, dtype=F64, name="rnn"), "gru": L.GRU(H, reset_after=False, dtype=F64, name="rnn")}
    model = keras.Model(inp, L.Dense(C, dtype=F64, name="head")(cell[recurrent](h)))
    _randomize(model, rng, scale=0.5)
    x, y = rng.normal(size=(5, T, D)), rng.integers(0, C, 5)
    twin = _clone(model)
    c = np.array([4.0, 0.3, 1.5])
    proj, rnn = twin.get_layer("proj"), twin.get_layer("rnn").cell
    proj.kernel.assign(proj.kernel.numpy() * c[None, :])
    proj.bias.assign(proj.bias.numpy() * c)
    rnn.kernel.assign(rnn.kernel.numpy() / c[:, None])
    rtol = invariance_tolerance(twin(x), model(x))
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    # On Keras' JAX backend the cell's kernels, used inside the traced scan, take the generic path.
    assert all(layer.details["path"] == ("generic" if jax_generic("_cell/")(layer.name) else "fast")
               for layer in before.layers), [(layer.name, layer.details["path"]) for layer in before.layers]
    _assert_invariant(before, normflat.analyze(twin, (x, y), loss="ce", estimator="ggn", progress=False), rtol)
