"""Keras backend: ``estimator="ggn-topk"`` and the default ``"auto"`` (method §6.2).

``ggn-topk`` takes the most probable classes exactly and samples the rest; with
every class on top it is the exact ``ggn`` (for token logits: per token,
``sequence_signals=False``; per sequence, the default, the top classes carry random
signs, method §6.3). A ``Dense`` head whose pre-activation
is the logits gets its exact GGN diagonal from the logit-Hessian diagonal (its
standard error is 0), and the numbers equal the torch backend's on the same
weights and data (normflat's draws are framework-free).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests import netspec  # noqa: E402
from tests.builders import load_builder, require_frameworks  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402

import normflat  # noqa: E402

L = keras.layers
F64 = "float64"
C = 7


def diag(model, data, **kw):
    kw.setdefault("progress", False)
    return {k: np.asarray(v) for k, v in normflat.hessian_diagonal(model, data, **kw).items()}


def assert_close(a, b, rtol=1e-10):
    assert len(a) == len(b)
    for (ka, va), (kb, vb) in zip(a.items(), b.items()):
        np.testing.assert_allclose(va, vb, rtol=rtol, atol=1e-14 * max(np.abs(vb).max(), 1e-300),
                                   err_msg=f"{ka} vs {kb}")


def mlp_spec(classes=C):
    return netspec.mlp((5, 8, classes), activation="tanh", seed=21)


def mlp_data(classes=C, n=12):
    return netspec.data(mlp_spec(classes), n=n, seed=5)


def batches(x, y, size):
    return [(x[a:a + size], y[a:a + size]) for a in range(0, len(y), size)]


def sequence_model(classes=C, tokens=3, features=4, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((tokens, features), dtype=F64),
        L.Dense(6, activation="tanh", dtype=F64, name="hidden"),
        L.Dense(classes, dtype=F64, name="head"),
    ])


def sequence_data(classes=C, tokens=3, features=4, n=5, seed=1, ignored=True):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, tokens, features))
    y = rng.integers(0, classes, size=(n, tokens))
    if ignored:
        y[0, 1] = y[3, 2] = -100  # tokens the loss skips
    return x, y


# ----------------------------------------------------------------------------- every class on top: exact


@pytest.mark.parametrize("loss", ["nsce", "ce"])
@pytest.mark.parametrize("fast", [True, False])
def test_all_classes_on_top_is_ggn(loss, fast):
    builder = load_builder("keras")
    model = builder.build(mlp_spec())
    x, y = mlp_data()
    data = batches(x, y, 5)  # uneven batches: 5, 5, 2
    exact = diag(model, data, loss=loss, estimator="ggn", fast=fast)
    topk = diag(model, data, loss=loss, estimator="ggn-topk", top_classes=C, fast=fast)
    assert_close(topk, exact)


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_token_logits_all_classes_on_top_is_ggn(loss):
    """Per token (sequence_signals=False): every class on top is the exact ggn. (Per sequence the
    top classes carry random signs, so only the head stays exact: test_token_head_is_exact.)"""
    model = sequence_model()
    x, y = sequence_data()
    # 3 tokens x 7 classes = 21 signals: two blocks of signals, the head counted once.
    exact = diag(model, (x, y), loss=loss, estimator="ggn")
    topk = diag(model, (x, y), loss=loss, estimator="ggn-topk", top_classes=C, chunk_size=2, sequence_signals=False)
    assert_close(topk, exact)


def test_language_model_all_classes_on_top_is_ggn():
    """Embedding, a sequence Dense and a vocabulary head on token ids: every fast kernel of token logits."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential([
        keras.Input((4,), dtype="int32"),
        L.Embedding(C, 3, dtype=F64, name="embed"),
        L.Dense(5, activation="tanh", dtype=F64, name="mix"),
        L.Dense(C, dtype=F64, name="vocab"),
    ])
    rng = np.random.default_rng(2)
    x = rng.integers(0, C, size=(4, 4)).astype("int32")
    y = np.concatenate([x[:, 1:], np.full((4, 1), -100)], axis=1)  # next token; the last one ignored
    exact = diag(model, (x, y), estimator="ggn")
    assert_close(diag(model, (x, y), estimator="ggn-topk", top_classes=C, sequence_signals=False), exact)
    # Per sequence (the default) the head's squares are still the exact ones (method §6.3).
    sampled = diag(model, (x, y), estimator="ggn-topk", top_classes=2, samples=3)
    np.testing.assert_allclose(sampled["vocab"], exact["vocab"], rtol=1e-10, atol=0)
    assert not np.allclose(sampled["mix"], exact["mix"], rtol=1e-6)


# ----------------------------------------------------------------------------- the exact head


def test_head_is_exact_with_zero_standard_error():
    builder = load_builder("keras")
    model = builder.build(mlp_spec())
    x, y = mlp_data(n=40)
    data = batches(x, y, 16)
    exact = normflat.analyze(model, data, estimator="ggn", progress=False)
    topk = normflat.analyze(model, data, estimator="ggn-topk", top_classes=1, samples=2, progress=False)
    de = diag(model, data, estimator="ggn")
    dt = diag(model, data, estimator="ggn-topk", top_classes=1, samples=2)
    head_e, head_t = list(de)[-1], list(dt)[-1]
    np.testing.assert_allclose(dt[head_t], de[head_e], rtol=1e-10, atol=0)
    hidden = list(dt)[0]
    assert not np.allclose(dt[hidden], de[hidden], rtol=1e-6)  # sampled: not exact

    head_le, head_lt = exact.layers[-1], topk.layers[-1]
    assert head_lt.hessian_trace == pytest.approx(head_le.hessian_trace, rel=1e-10)
    assert head_lt.standard_error is not None
    assert head_lt.standard_error["hessian_trace"] == 0
    assert topk.layers[0].standard_error["hessian_trace"] > 0
    # Two groups make a poor standard error (one degree of freedom): five, for the bound.
    five = normflat.analyze(model, data, estimator="ggn-topk", top_classes=1, samples=10, progress=False)
    for le, lt in zip(exact.layers, five.layers):
        se = lt.standard_error["hessian_trace"]
        assert abs(lt.hessian_trace - le.hessian_trace) <= 5 * se + 1e-10 * le.hessian_trace, le.name


def test_token_head_is_exact():
    """With per-sequence signals (the default) the head's squares are still exact, the rest sampled."""
    model = sequence_model()
    x, y = sequence_data()
    exact = diag(model, (x, y), estimator="ggn")
    topk = diag(model, (x, y), estimator="ggn-topk", top_classes=1, samples=2)
    np.testing.assert_allclose(topk["head"], exact["head"], rtol=1e-10, atol=0)
    assert not np.allclose(topk["hidden"], exact["hidden"], rtol=1e-6)


def test_head_with_an_activation_is_sampled():
    """A Dense whose output passes through an activation is not a head: its squares are sampled."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5,), dtype=F64), L.Dense(6, activation="tanh", dtype=F64),
                              L.Dense(C, activation="tanh", dtype=F64, name="out")])
    x, y = mlp_data()
    exact = diag(model, (x, y), estimator="ggn")
    topk = diag(model, (x, y), estimator="ggn-topk", top_classes=1, samples=2)
    assert not np.allclose(topk["out"], exact["out"], rtol=1e-6)
    everything = diag(model, (x, y), estimator="ggn-topk", top_classes=C)
    assert_close(everything, exact)


# ----------------------------------------------------------------------------- the same numbers as torch


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_same_as_torch(loss):
    torch_builder = load_builder("torch")
    keras_builder = load_builder("keras")
    spec = mlp_spec()
    x, y = mlp_data(n=10)
    kw = dict(loss=loss, estimator="ggn-topk", top_classes=2, samples=4, seed=7, progress=False)
    ref = normflat.hessian_diagonal(torch_builder.build(spec), torch_builder.make_data(x, y, 4), **kw)
    got = diag(keras_builder.build(spec), keras_builder.make_data(x, y, 4), **kw)
    assert_close(got, {k: v.detach().numpy() for k, v in ref.items()})
    report = normflat.analyze(keras_builder.build(spec), keras_builder.make_data(x, y, 4), **kw)
    ref_report = normflat.analyze(torch_builder.build(spec), torch_builder.make_data(x, y, 4), **kw)
    for lk, lt in zip(report.layers, ref_report.layers):
        assert lk.hessian_trace == pytest.approx(lt.hessian_trace, rel=1e-10)
        for m, v in lt.standard_error.items():
            assert lk.standard_error[m] == pytest.approx(v, rel=1e-8, abs=1e-12), m


@pytest.mark.parametrize("sequence_signals", [False, None])
def test_token_logits_same_as_torch(sequence_signals):
    """Per token and per sequence (the default): the same draws and signs, the same numbers."""
    require_frameworks("torch")
    import torch

    model = sequence_model()
    x, y = sequence_data()
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, C)).double()
    with torch.no_grad():
        for lin, name in ((net[0], "hidden"), (net[2], "head")):
            kernel, bias = model.get_layer(name).get_weights()
            lin.weight.copy_(torch.from_numpy(kernel.T.copy()))
            lin.bias.copy_(torch.from_numpy(bias))
    kw = dict(estimator="ggn-topk", top_classes=2, samples=3, seed=2, progress=False,
              sequence_signals=sequence_signals)
    ref = normflat.hessian_diagonal(net, (torch.from_numpy(x), torch.from_numpy(y)), **kw)
    got = diag(model, (x, y), **kw)
    assert_close(got, {k: v.detach().numpy() for k, v in ref.items()})
    report = normflat.analyze(model, (x, y), **kw)
    ref_report = normflat.analyze(net, (torch.from_numpy(x), torch.from_numpy(y)), **kw)
    assert report.metadata["sequence_signals"] is ref_report.metadata["sequence_signals"] is (sequence_signals is None)
    for lk, lt in zip(report.layers, ref_report.layers):
        assert lk.hessian_trace == pytest.approx(lt.hessian_trace, rel=1e-10)
        for m, v in lt.standard_error.items():
            assert lk.standard_error[m] == pytest.approx(v, rel=1e-8, abs=1e-12), m


# ----------------------------------------------------------------------------- auto


@pytest.mark.parametrize("classes, expected", [(10, "ggn"), (30, "ggn-topk")])
def test_auto_resolves_by_classes(classes, expected):
    builder = load_builder("keras")
    model = builder.build(mlp_spec(classes))
    x, y = mlp_data(classes, n=8)
    report = normflat.analyze(model, (x, y), progress=False)  # estimator="auto", the default
    assert report.metadata["estimator"] == expected
    if expected == "ggn":
        assert report.metadata["samples"] is None and report.metadata["top_classes"] is None
        ref = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    else:
        assert report.metadata["samples"] == 10 and report.metadata["top_classes"] == 2
        assert report.layers[0].standard_error is not None
        ref = normflat.analyze(model, (x, y), estimator="ggn-topk", progress=False)
    for a, b in zip(report.layers, ref.layers):
        assert a.hessian_trace == pytest.approx(b.hessian_trace, rel=1e-12)


# ----------------------------------------------------------------------------- the structured head (no C² term)

MANY = 40  # above STRUCTURED_HEAD_CLASSES: ggn takes the exact head and starts the signals at its input


class _OwnCallDense(L.Dense):
    """A Dense with its own call: the generic path (per-sample Jacobians from the logits)."""

    def call(self, inputs):
        return super().call(inputs)


def mixed_model(classes=MANY, seed=6):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype=F64),
        _OwnCallDense(6, activation="tanh", dtype=F64, name="own"),  # generic
        L.Dense(8, activation="tanh", dtype=F64, name="hidden"),  # fast, signals from the head's input
        L.Dense(classes, dtype=F64, name="head"),  # exact from the logit-Hessian diagonal
    ])


def _count_structured(monkeypatch):
    from normflat.backends.keras import ggn

    calls = []
    original = ggn._head_input_signals

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ggn, "_head_input_signals", counted)
    return calls


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_ggn_structured_head_equals_generic(loss, monkeypatch):
    calls = _count_structured(monkeypatch)
    model = mixed_model()
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(12, 5)), rng.integers(0, MANY, size=12)
    data = batches(x, y, 5)  # 5, 5, 2: the step retraces with a relaxed sample axis
    got = diag(model, data, loss=loss, estimator="ggn")
    assert calls, "the structured path was not taken"
    ref = diag(model, data, loss=loss, estimator="ggn", fast=False)
    assert list(got) == ["own", "hidden", "head"]
    assert_close(got, ref)


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_ggn_many_classes_without_a_head_equals_generic(loss, monkeypatch):
    """An output Dense with an activation is no head: the block's dense signals, formed from the
    structured factor (O(C) per signal), go back from the logits."""
    calls = _count_structured(monkeypatch)
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((5,), dtype=F64), L.Dense(6, activation="tanh", dtype=F64, name="hidden"),
                              L.Dense(MANY, activation="tanh", dtype=F64, name="out")])
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(7, 5)), rng.integers(0, MANY, size=7)
    data = batches(x, y, 4)
    got = diag(model, data, loss=loss, estimator="ggn")
    assert not calls
    assert_close(got, diag(model, data, loss=loss, estimator="ggn", fast=False))


def test_ggn_few_classes_keeps_dense_signals(monkeypatch):
    calls = _count_structured(monkeypatch)
    model = mixed_model(classes=C)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 5)), rng.integers(0, C, size=6)
    got = diag(model, (x, y), estimator="ggn")
    assert not calls
    assert_close(got, diag(model, (x, y), estimator="ggn", fast=False))


# ----------------------------------------------------------------------------- bounded memory by default


def test_default_chunk_is_bounded_by_a_training_step():
    """Default options (auto: ggn-topk at 100 classes): the chunk keeps the step within about twice
    a training step (at least 32 MiB), smaller than this batch; the numbers do not depend on it."""
    keras.utils.set_random_seed(8)
    model = keras.Sequential([
        keras.Input((16, 16, 3), dtype=F64),
        L.Conv2D(8, 3, padding="same", activation="relu", dtype=F64, name="conv"),
        L.Flatten(dtype=F64),
        L.Dense(100, dtype=F64, name="head"),
    ])
    rng = np.random.default_rng(4)
    n = 48
    x, y = rng.normal(size=(n, 16, 16, 3)), rng.integers(0, 100, size=n)
    report = normflat.analyze(model, (x, y), progress=False)
    assert report.metadata["estimator"] == "ggn-topk"
    assert 1 <= report.metadata["chunk_size"] < n
    whole = normflat.analyze(model, (x, y), chunk_size=n, progress=False)
    assert whole.metadata["chunk_size"] == n
    for a, b in zip(report.layers, whole.layers):
        assert a.hessian_trace == pytest.approx(b.hessian_trace, rel=1e-10)
    assert_close(diag(model, (x, y)), diag(model, (x, y), chunk_size=n))
