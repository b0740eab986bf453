"""JAX backend: ``ggn-topk`` and ``estimator="auto"`` (method §6.2).

* with every class on top (``top_classes = C``) nothing is sampled: ``ggn-topk`` is the
  exact ``ggn``, for ``(n, C)`` and for token ``(n, T, C)`` logits with per-token signals
  (``sequence_signals=False``; per sequence, the default, the signs make it stochastic,
  method §6.3);
* a dense head (the layer whose output is the logits) is exact whatever the draws,
  with standard error 0, in every JAX model type (the traced program identifies it);
* the same weights and data give the torch backend's numbers to 1e-10 (float64), token
  logits per sequence and per token: normflat's draws and signs do not depend on the framework;
* ``"auto"`` resolves to ``ggn`` for few classes and to ``ggn-topk`` for many;
* above 32 classes ``ggn`` takes the structured head too (the other layers' signals start
  at the head's input, method §6.1) with the numbers of the dense signals, and of the
  exact Hessian on a ReLU net;
* without ``chunk_size``/``memory_budget`` the chunk keeps the working memory within about
  twice a training step, and the chunking changes no number.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.builders import load_builder, require_frameworks

require_frameworks("jax", "flax", "equinox")

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normflat  # noqa: E402
from tests import netspec  # noqa: E402

jax.config.update("jax_enable_x64", True)

JAX_BUILDERS = ("equinox", "flax_nnx", "flax_linen")


def _diag(model, data, **kw):
    d = normflat.hessian_diagonal(model, data, progress=False, **kw)
    return [np.asarray(v, dtype=np.float64) for v in d.values()]


def _close(got, ref, tol=1e-10):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol * max(1.0, float(np.abs(r).max())))


@pytest.fixture(params=JAX_BUILDERS)
def builder(request):
    return load_builder(request.param)


# ----------------------------------------------------------------------------- (n, C) logits


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_all_classes_on_top_is_exact_ggn(builder, loss):
    spec = netspec.mlp((5, 6, 6), activation="tanh", seed=41)
    x, y = netspec.data(spec, n=7, seed=1)
    model, data = builder.build(spec), builder.make_data(x, y, 4)
    ggn = _diag(model, data, loss=loss, estimator="ggn")
    topk = _diag(model, data, loss=loss, estimator="ggn-topk", top_classes=6, samples=3)
    _close(topk, ggn)


def test_head_is_exact_and_others_within_standard_errors(builder):
    spec = netspec.mlp((5, 8, 6, 7), activation="tanh", seed=42)
    x, y = netspec.data(spec, n=8, seed=2)
    model, data = builder.build(spec), builder.make_data(x, y, 3)
    ggn = _diag(model, data, loss="nsce", estimator="ggn")
    kw = dict(loss="nsce", estimator="ggn-topk", top_classes=1, samples=2, seed=3)
    topk = _diag(model, data, **kw)
    _close(topk[-1:], ggn[-1:])  # the head: exact
    assert all(np.abs(t - g).max() > 1e-8 for t, g in zip(topk[:-1], ggn[:-1]))  # the others: sampled
    report = normflat.analyze(model, data, progress=False, **kw)
    assert report.metadata["estimator"] == "ggn-topk" and report.metadata["top_classes"] == 1
    head = report.layers[-1]
    assert head.details["path"] == "fast"
    assert all(v == 0 for v in head.standard_error.values())
    assert all(l.standard_error["hessian_trace"] > 0 for l in report.layers[:-1])
    # Two draws make two groups, whose spread is too rough a standard error to test against:
    # ten draws (five groups) for that.
    report = normflat.analyze(model, data, progress=False, **{**kw, "samples": 10})
    exact = normflat.analyze(model, data, progress=False, loss="nsce", estimator="ggn")
    assert report.layers[-1].hessian_trace == pytest.approx(exact.layers[-1].hessian_trace, rel=1e-10)
    for got, ref in zip(report.layers[:-1], exact.layers[:-1]):
        assert abs(got.hessian_trace - ref.hessian_trace) < 4 * got.standard_error["hessian_trace"]


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_same_numbers_as_torch(builder, loss):
    torch_builder = load_builder("torch")
    spec = netspec.mlp((5, 7, 6, 9), seed=43)
    x, y = netspec.data(spec, n=9, seed=3)
    kw = dict(loss=loss, estimator="ggn-topk", top_classes=2, samples=6, seed=4)
    ref = _diag(torch_builder.build(spec), torch_builder.make_data(x, y, 4), **kw)
    got = _diag(builder.build(spec), builder.make_data(x, y, 4), **kw)
    _close(got, ref)
    r_ref = normflat.analyze(torch_builder.build(spec), torch_builder.make_data(x, y, 4), progress=False, **kw)
    r_got = normflat.analyze(builder.build(spec), builder.make_data(x, y, 4), progress=False, **kw)
    for lg, lr in zip(r_got.layers, r_ref.layers):
        for name, se in lr.standard_error.items():
            assert lg.standard_error[name] == pytest.approx(se, rel=1e-9, abs=1e-13), name


def _apply(params, x):
    h = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    return h @ params["head"]["kernel"] + params["head"]["bias"]


def test_apply_fn_params_head_is_exact():
    spec = netspec.mlp((4, 5, 7), activation="tanh", seed=44)
    ls = spec.weight_layers()
    params = {n: {"kernel": jnp.asarray(l.weight.T), "bias": jnp.asarray(l.bias)}
              for n, l in zip(("hidden", "head"), ls)}
    x, y = netspec.data(spec, n=6, seed=4)
    data = (jnp.asarray(x), jnp.asarray(y))
    ggn = _diag((_apply, params), data, loss="ce", estimator="ggn")
    topk = _diag((_apply, params), data, loss="ce", estimator="ggn-topk", top_classes=1, samples=2)
    _close(topk[1:], ggn[1:])
    assert np.abs(topk[0] - ggn[0]).max() > 1e-8


def test_layer_after_the_head_keeps_it_sampled():
    """A dense layer whose output goes through another data-dependent op is no head."""
    rng = np.random.default_rng(5)
    params = {"hidden": {"kernel": jnp.asarray(rng.normal(size=(4, 5)))},
              "head": {"kernel": jnp.asarray(rng.normal(size=(5, 7)))}}

    def apply(p, x):
        h = jnp.tanh(x @ p["hidden"]["kernel"])
        z = h @ p["head"]["kernel"]
        return z + 0.1 * jnp.sin(z)  # not a bias: the signals at the layer output are not the logits'

    x = jnp.asarray(rng.normal(size=(6, 4)))
    y = jnp.asarray(rng.integers(0, 7, size=6))
    report = normflat.analyze((apply, params), (x, y), loss="ce", estimator="ggn-topk", top_classes=1,
                              samples=2, progress=False)
    assert all(l.standard_error["hessian_trace"] > 0 for l in report.layers)


# ----------------------------------------------------------------------------- the structured head


@pytest.fixture
def dense_signals(monkeypatch):
    """Switch the structured head off (kernels built while it is set use dense signals at the
    logits) with fresh kernel caches; returns the calls of ``output_factor`` made while tracing."""
    from normflat.backends.jax import ggn as jax_ggn
    from normflat.backends.jax import session as jax_session
    from normflat.backends.jax.cache import LRU

    calls = []
    factor = jax_ggn.output_factor
    monkeypatch.setattr(jax_ggn, "output_factor", lambda *a, **k: (calls.append(1), factor(*a, **k))[1])
    monkeypatch.setattr(jax_session, "_CACHE", LRU(8))

    def use(dense: bool):
        monkeypatch.setattr(jax_ggn, "STRUCTURED_HEAD_CLASSES", 10**9 if dense else 32)
        monkeypatch.setattr(jax_session, "_CACHE", LRU(8))
        calls.clear()
        return calls

    return use


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_structured_head_ggn_equals_dense_signals(builder, loss, dense_signals):
    """At 40 classes ``ggn`` squares the head from the logit-Hessian diagonal and pulls the
    structured signals back through it: the numbers of C − 1 dense signals, every layer."""
    spec = netspec.mlp((5, 6, 7, 40), activation="tanh", seed=47)
    x, y = netspec.data(spec, n=7, seed=7)
    model, data = builder.build(spec), builder.make_data(x, y, 4)
    calls = dense_signals(False)
    got = _diag(model, data, loss=loss, estimator="ggn")
    assert calls  # the structured path was taken
    calls = dense_signals(True)
    ref = _diag(model, data, loss=loss, estimator="ggn")
    assert not calls
    _close(got, ref)


def test_structured_head_ggn_is_the_relu_hessian(dense_signals):
    """On a ReLU net with ``ce`` the GGN diagonal is the Hessian diagonal: brute force."""
    spec = netspec.mlp((4, 5, 40), seed=48)
    x, y = netspec.data(spec, n=6, seed=8)
    b = load_builder("equinox")
    model, data = b.build(spec), b.make_data(x, y, 6)
    calls = dense_signals(False)
    got = _diag(model, data, loss="ce", estimator="ggn")
    assert calls
    _close(got, _diag(model, data, loss="ce", estimator="exact"))


def test_few_classes_keep_dense_signals(dense_signals):
    """``ggn`` at 32 classes or fewer pushes the dense signals (cheaper there); ``ggn-mc`` always."""
    spec = netspec.mlp((4, 5, 32), seed=49)
    x, y = netspec.data(spec, n=5, seed=9)
    b = load_builder("flax_nnx")
    model, data = b.build(spec), b.make_data(x, y, 5)
    calls = dense_signals(False)
    _diag(model, data, loss="ce", estimator="ggn")
    _diag(model, data, loss="ce", estimator="ggn-mc", samples=2)
    assert not calls


# ----------------------------------------------------------------------------- default chunking


def test_default_chunk_is_bounded_and_changes_no_number():
    """No chunk_size / memory_budget: about twice a training step (at least 32 MiB) decides the
    chunk, here below the batch, with the numbers of one chunk for the whole batch."""
    b = load_builder("flax_nnx")
    spec = netspec.cnn(channels=(3, 8, 8), image=16, classes=100, seed=50)
    n = 48
    x, y = netspec.data(spec, n=n, seed=10)
    model, data = b.build(spec), b.make_data(x, y, n)
    report = normflat.analyze(model, data, progress=False)
    whole = normflat.analyze(model, data, progress=False, chunk_size=n)
    assert report.metadata["estimator"] == "ggn-topk"  # auto at 100 classes
    assert report.metadata["chunk_size"] < n and whole.metadata["chunk_size"] == n
    for got, ref in zip(report.layers, whole.layers):
        assert got.hessian_trace == pytest.approx(ref.hessian_trace, rel=1e-10)
        assert got.normalized_sharpness == pytest.approx(ref.normalized_sharpness, rel=1e-10)
        for name, se in ref.standard_error.items():
            assert got.standard_error[name] == pytest.approx(se, rel=1e-9, abs=1e-13), name
    _close(_diag(model, data), _diag(model, data, chunk_size=n))


# ----------------------------------------------------------------------------- auto


def test_auto_resolves_by_number_of_classes(builder):
    for classes, expected in ((10, "ggn"), (30, "ggn-topk")):
        spec = netspec.mlp((4, 5, classes), seed=45 + classes)
        x, y = netspec.data(spec, n=5, seed=5)
        model, data = builder.build(spec), builder.make_data(x, y, 5)
        report = normflat.analyze(model, data, loss="ce", progress=False)
        assert report.metadata["estimator"] == expected
        if expected == "ggn":
            assert report.metadata["samples"] is None and report.metadata["top_classes"] is None
            assert report.standard_error is None
            ref = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
        else:
            assert report.metadata["samples"] == 10 and report.metadata["top_classes"] == 2
            assert report.standard_error is not None
            ref = normflat.analyze(model, data, loss="ce", estimator="ggn-topk", progress=False)
        assert report.hessian_trace == pytest.approx(ref.hessian_trace, rel=1e-12)
        assert [l.hessian_trace for l in report.layers] == pytest.approx([l.hessian_trace for l in ref.layers],
                                                                        rel=1e-12)


# ----------------------------------------------------------------------------- token logits (n, T, C)

T, D, H, C = 4, 3, 5, 6


def _token_weights(seed=46):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(H, D)) / np.sqrt(D), 0.1 * rng.normal(size=H),
            rng.normal(size=(C, H)) / np.sqrt(H), 0.1 * rng.normal(size=C))


def _token_data(n=5, seed=6):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, T, D))
    y = rng.integers(0, C, size=(n, T))
    y[0, 1] = y[3, 0] = -100  # ignored tokens
    return x, y


class _EqxSeq(eqx.Module):
    hidden: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x):  # one sequence (T, D) -> (T, C)
        return jax.vmap(lambda t: self.head(jnp.tanh(self.hidden(t))))(x)


class _LinenSeq(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(H, param_dtype=jnp.float64)(x))  # Dense_0
        return nn.Dense(C, param_dtype=jnp.float64)(h)  # Dense_1


class _NnxSeq(nnx.Module):
    def __init__(self):
        self.hidden = nnx.Linear(D, H, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(H, C, param_dtype=jnp.float64, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.head(jnp.tanh(self.hidden(x)))


def _token_model(kind):
    """A tiny sequence model of ``kind`` with the weights of :func:`_token_weights`; extra analyze kwargs."""
    w1, b1, w2, b2 = (jnp.asarray(a) for a in _token_weights())
    if kind == "equinox":
        m = _EqxSeq(eqx.nn.Linear(D, H, key=jax.random.key(0), dtype=jnp.float64),
                    eqx.nn.Linear(H, C, key=jax.random.key(1), dtype=jnp.float64))
        m = eqx.tree_at(lambda m: (m.hidden.weight, m.hidden.bias, m.head.weight, m.head.bias), m,
                        (w1, b1, w2, b2))
        return m, {"vmap": True}
    if kind == "flax_linen":
        variables = {"params": {"Dense_0": {"kernel": w1.T, "bias": b1}, "Dense_1": {"kernel": w2.T, "bias": b2}}}
        return (_LinenSeq(), variables), {}
    if kind == "flax_nnx":
        m = _NnxSeq()
        m.hidden.kernel, m.hidden.bias = nnx.Param(w1.T), nnx.Param(b1)
        m.head.kernel, m.head.bias = nnx.Param(w2.T), nnx.Param(b2)
        return m, {}
    raise ValueError(kind)


def _torch_token_model():
    import torch

    w1, b1, w2, b2 = (torch.as_tensor(a) for a in _token_weights())
    m = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, C)).double()
    with torch.no_grad():
        m[0].weight.copy_(w1), m[0].bias.copy_(b1), m[2].weight.copy_(w2), m[2].bias.copy_(b2)
    return m.eval()


@pytest.mark.parametrize("kind", JAX_BUILDERS)
def test_token_logits(kind):
    model, extra = _token_model(kind)
    x, y = _token_data()
    data = [(jnp.asarray(x[:3]), jnp.asarray(y[:3])), (jnp.asarray(x[3:]), jnp.asarray(y[3:]))]
    ggn = _diag(model, data, loss="nsce", estimator="ggn", **extra)
    # per token (sequence_signals=False) with every class on top nothing is sampled: the exact ggn
    _close(_diag(model, data, loss="nsce", estimator="ggn-topk", top_classes=C, samples=2, sequence_signals=False,
                 **extra), ggn)
    kw = dict(loss="nsce", estimator="ggn-topk", top_classes=1, samples=3, seed=7)
    topk = _diag(model, data, **kw, **extra)  # per sequence (method §6.3): signed sums over the tokens
    _close(topk[1:], ggn[1:])  # the head: exact
    assert np.abs(topk[0] - ggn[0]).max() > 1e-8
    report = normflat.analyze(model, data, progress=False, **kw, **extra)
    assert report.metadata["loss_terms"] == 5 * T - 2 and report.metadata["sequence_signals"] is True
    assert all(v == 0 for v in report.layers[1].standard_error.values())
    assert report.layers[0].standard_error["hessian_trace"] > 0
    if kind == "flax_linen":
        # and the torch backend's numbers, draws and signs included, per sequence and per token
        require_frameworks("torch")
        import torch

        tdata = [(torch.as_tensor(x[:3]), torch.as_tensor(y[:3])), (torch.as_tensor(x[3:]), torch.as_tensor(y[3:]))]
        _close(topk, _diag(_torch_token_model(), tdata, **kw))
        per_token = _diag(model, data, sequence_signals=False, **kw, **extra)
        assert np.abs(per_token[0] - topk[0]).max() > 1e-8
        _close(per_token, _diag(_torch_token_model(), tdata, sequence_signals=False, **kw))


def test_embedding_language_model():
    """Lookups (fast embedding rule) beside a token head: all K' sums, the head exact."""
    from tests.arch.test_jax_embedding_fast import IDS, LABELS, V, EqxTagger, NnxTagger

    data = (IDS, jnp.asarray(LABELS))
    for model in (NnxTagger(nnx.Rngs(0)), EqxTagger(jax.random.key(0))):
        ggn = _diag(model, data, loss="ce", estimator="ggn")
        _close(_diag(model, data, loss="ce", estimator="ggn-topk", top_classes=V, samples=2, sequence_signals=False),
               ggn)  # per token, every class on top: the exact ggn
        report = normflat.analyze(model, data, loss="ce", estimator="ggn-topk", top_classes=1, samples=4,
                                  progress=False)
        names = [l.name for l in report.layers]
        i = names.index("head")
        assert all(v == 0 for v in report.layers[i].standard_error.values())
        assert all(l.standard_error["hessian_trace"] > 0 for l in report.layers if l.name != "head")
        assert [l.details["path"] for l in report.layers] == ["fast"] * len(report.layers)
        topk = _diag(model, data, loss="ce", estimator="ggn-topk", top_classes=1, samples=4)
        _close(topk[i:i + 1], ggn[i:i + 1])
