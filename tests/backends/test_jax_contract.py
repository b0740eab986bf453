"""JAX backend on the engine: data contract, bad inputs, randomness, registry, threads.

Every case here has the same error text (from :mod:`normflat.engine`) in every
framework; the stochastic estimators use the engine's own draws, so they are
checked against a framework-free reference computed from those draws.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from typing import Any

import numpy as np
import pytest

from tests.builders import load_builder, require_frameworks

require_frameworks("jax", "flax", "equinox")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normflat  # noqa: E402
from normflat.backends import jax as nf_jax  # noqa: E402
from normflat.engine import IGNORE, METADATA_KEYS, DETAIL_KEYS  # noqa: E402
from normflat.engine.random import rademacher, sample_uniforms  # noqa: E402
from normflat.engine.losses import output_signals  # noqa: E402
from normflat.engine.options import validate_options  # noqa: E402
from tests import netspec  # noqa: E402
from tests.backends.test_jax import (JAX_BUILDERS, _unflatten, assert_layers_close,  # noqa: E402
                                     reference_hessian, spec_forward)

jax.config.update("jax_enable_x64", True)

SPEC = netspec.mlp((5, 6, 3), activation="tanh", seed=51)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 5))
Y = np.arange(8) % 3


def _params(scale_last=1.0, classes=3):
    rng = np.random.default_rng(3)
    return {"d0": {"kernel": jnp.asarray(rng.normal(size=(5, 6)))},
            "d1": {"kernel": jnp.asarray(rng.normal(size=(6, classes)) * scale_last)}}


def _pair(post=lambda z: z, scale_last=1.0, classes=3):
    def apply(p, x):
        return post(jnp.tanh(x @ p["d0"]["kernel"]) @ p["d1"]["kernel"])
    return apply, _params(scale_last, classes)


@pytest.fixture(params=JAX_BUILDERS)
def builder(request):
    return load_builder(request.param)


def _diag(model, data, **kw):
    kw.setdefault("progress", False)
    return {k: np.asarray(v) for k, v in normflat.hessian_diagonal(model, data, **kw).items()}


# ----------------------------------------------------------------------------- data contract


def test_one_hot_labels_equal_indices_and_single_pair_is_one_batch(builder):
    x, y = netspec.data(SPEC, n=6, seed=1)
    model = builder.build(SPEC)
    idx = builder.make_data(x, y, 6)[0]
    hot = (idx[0], np.eye(3, dtype=np.float32)[y])
    a = normflat.analyze(model, idx, loss="ce", progress=False)
    b = normflat.analyze(model, hot, loss="ce", progress=False)
    assert a.metadata["batches"] == b.metadata["batches"] == 1
    assert a.metadata["examples"] == 6
    assert b.normalized_sharpness == a.normalized_sharpness


def test_empty_batches_are_skipped_and_max_batches(builder):
    x, y = netspec.data(SPEC, n=6, seed=2)
    model = builder.build(SPEC)
    data = builder.make_data(x, y, 3)
    empty = (data[0][0][:0], data[0][1][:0])
    ref = _diag(model, data, loss="ce")
    got = _diag(model, [empty, data[0], empty, data[1]], loss="ce")
    assert_layers_close(list(got.values()), list(ref.values()), rtol=1e-12)
    r = normflat.analyze(model, [empty, data[0], empty, data[1]], loss="ce", progress=False)
    assert r.metadata["batches"] == 2 and r.metadata["examples"] == 6
    first = _diag(model, data[:1], loss="ce")
    limited = _diag(model, itertools.cycle(data), loss="ce", max_batches=1)
    assert_layers_close(list(limited.values()), list(first.values()), rtol=1e-12)


def test_metadata_and_details_keys(builder):
    spec = netspec.cnn(seed=3, channels=(2, 4, 6), groups=2, maxpool=False, image=4)
    x, y = netspec.data(spec, n=4)
    r = normflat.analyze(builder.build(spec), builder.make_data(x, y, 4), progress=False)
    assert set(METADATA_KEYS) <= set(r.metadata)
    assert r.metadata["framework"] == "jax" and r.metadata["world_size"] == 1
    for layer in r.layers:
        assert set(DETAIL_KEYS) <= set(layer.details)
    assert [l.details["groups"] for l in r.layers] == [1, 2, 1]


def test_samples_with_ggn_and_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="samples=3 has no meaning"):
        normflat.analyze(_pair(), (X, Y), estimator="ggn", samples=3, progress=False)
    with pytest.raises(ValueError, match="8 inputs but 7 labels"):
        normflat.analyze(_pair(), (X, Y[:7]), progress=False)


def test_infinite_tf_dataset_needs_max_batches():
    tf = pytest.importorskip("tensorflow")
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat()
    with pytest.raises(ValueError, match="infinite"):
        normflat.analyze(_pair(), ds, progress=False)
    r = normflat.analyze(_pair(), ds, progress=False, max_batches=2)
    assert r.metadata["batches"] == 2 and r.metadata["examples"] == 8


# ----------------------------------------------------------------------------- bad outputs and losses


def test_probabilities_as_logits_are_refused():
    with pytest.raises(ValueError, match="probabilities"):
        normflat.analyze(_pair(jax.nn.softmax), (X, Y), progress=False)
    with pytest.raises(ValueError, match="probabilities"):
        normflat.analyze(_pair(jax.nn.softmax), (X, Y), loss="ce", estimator="exact", progress=False)


def test_constant_logits_nsce_error_and_ce_valid():
    model = _pair(scale_last=0.0)
    with pytest.raises(ValueError, match="nearly\\) equal across classes"):
        normflat.analyze(model, (X, Y), progress=False)
    r = normflat.analyze(model, (X, Y), loss="ce", progress=False)
    assert np.isfinite(r.hessian_trace) and r.hessian_trace > 0


def test_one_output_unit_is_refused():
    with pytest.raises(ValueError, match="single output unit"):
        normflat.analyze(_pair(classes=1), (X, np.zeros(8, int)), progress=False)


def test_custom_loss_per_sample_vector_and_nan_loss():
    def per_sample(z, y):
        return jnp.sum((z - jax.nn.one_hot(y, 3)) ** 2, axis=-1)

    def nan_loss(z, y):
        return jnp.mean(z) * jnp.nan

    with pytest.raises(TypeError, match="must return the mean loss of the batch, a scalar"):
        normflat.analyze(_pair(), (X, Y), loss=per_sample, estimator="exact", progress=False)
    for est in ("exact", "hutchinson"):
        with pytest.raises(ValueError, match="the loss is NaN or infinite"):
            normflat.analyze(_pair(), (X, Y), loss=nan_loss, estimator=est, progress=False)


def test_labels_out_of_range_with_custom_loss():
    def mse(z, y):
        return jnp.mean((z - jax.nn.one_hot(y, 3)) ** 2)

    with pytest.raises(ValueError, match=r"class indices in \[0, 2\]"):
        normflat.analyze(_pair(), (X, Y + 1), loss=mse, estimator="exact", progress=False)


def test_nan_logits_and_nan_inputs_on_device():
    bad = _params()
    bad["d1"]["kernel"] = bad["d1"]["kernel"].at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="logits contain NaN"):
        normflat.analyze((_pair()[0], bad), (X, Y), progress=False)
    with pytest.raises(ValueError, match="inputs contain NaN"):
        normflat.analyze(_pair(), (jnp.asarray(X).at[2, 1].set(jnp.nan), Y), progress=False)


def test_deferred_labels_are_checked_after_the_loop(monkeypatch):
    """Labels on an accelerator are copied to the host without waiting and checked after the loop
    (the GGN of (n, C) logits does not use them; the Hessian-vector products' loss compares class
    indices with the classes, so a bad one selects nothing until then): the same numbers, and a later batch's bad labels
    get the eager message naming it. Run on the CPU by deferring every JAX array's labels."""
    from normflat.backends.jax.session import JaxSession

    data = [(jnp.asarray(X[:4]), jnp.asarray(Y[:4])), (jnp.asarray(X[4:]), jnp.asarray(Y[4:]))] * 2
    eager = normflat.hessian_diagonal(_pair(), data, estimator="ggn", progress=False)
    monkeypatch.setattr(JaxSession, "_deferred_labels", staticmethod(lambda y: isinstance(y, jax.Array)))
    deferred = normflat.hessian_diagonal(_pair(), data, estimator="ggn", progress=False)
    for name in eager:
        np.testing.assert_array_equal(np.asarray(deferred[name]), np.asarray(eager[name]))
    bad = list(data)
    bad[1] = (data[1][0], data[1][1].at[1].set(3))
    with pytest.raises(ValueError, match=r"Batch 1: .*class indices in \[0, 2\]"):
        normflat.analyze(_pair(), bad, estimator="ggn", progress=False)
    # The Hessian-vector products use the class indices on the device before the checks: the same
    # numbers, the later batches checked after the loop, the eager message.
    from normflat.backends.jax import session as jax_session
    from normflat.engine.data import labels_for

    for estimator in ("exact", "hutchinson"):
        monkeypatch.undo()
        eager = normflat.hessian_diagonal(_pair(), data, estimator=estimator, seed=1, progress=False)
        monkeypatch.setattr(JaxSession, "_deferred_labels", staticmethod(lambda y: isinstance(y, jax.Array)))
        checked = []
        monkeypatch.setattr(jax_session, "labels_for", lambda batch, *a, **k: checked.append(
            (batch.index, batch.x is None)) or labels_for(batch, *a, **k))
        deferred = normflat.hessian_diagonal(_pair(), data, estimator=estimator, seed=1, progress=False)
        assert checked == [(0, False), (1, True), (2, True), (3, True)], checked
        for name in eager:
            np.testing.assert_array_equal(np.asarray(deferred[name]), np.asarray(eager[name]))
        for wrong in (3, -1):
            bad = list(data)
            bad[1] = (data[1][0], data[1][1].at[1].set(wrong))
            with pytest.raises(ValueError, match=r"Batch 1: .*class indices in \[0, 2\]"):
                normflat.analyze(_pair(), bad, estimator=estimator, progress=False)


def test_float32_logits_near_1e20_keep_their_value():
    """nsce is invariant to the logit scale: logits near 1e20 in float32 give the float64 value at scale 1.

    The model is linear, ``z = (x W0) W1``: scaling ``x`` by 1e12 and ``W0`` by 1e7 scales the
    logits by 1e19 and leaves the nsce loss, as a function of the weights up to the layer-wise
    rescaling of ``W0``, unchanged; normalized sharpness is invariant to both.
    """
    rng = np.random.default_rng(8)
    w0, w1 = rng.normal(size=(5, 6)), rng.normal(size=(6, 3))

    def apply(p, x):
        return (x @ p["d0"]["kernel"]) @ p["d1"]["kernel"]

    ref = normflat.analyze((apply, {"d0": {"kernel": jnp.asarray(w0)}, "d1": {"kernel": jnp.asarray(w1)}}),
                           (X, Y), progress=False)
    big = {"d0": {"kernel": jnp.asarray(w0 * 1e7, jnp.float32)}, "d1": {"kernel": jnp.asarray(w1, jnp.float32)}}
    xb = (X * 1e12).astype(np.float32)
    assert 1e18 < np.abs(np.asarray(apply(big, jnp.asarray(xb)))).max() < 1e22
    r = normflat.analyze((apply, big), (xb, Y), progress=False)
    assert r.metadata["dtype"] == "float32"
    assert r.normalized_sharpness == pytest.approx(ref.normalized_sharpness, rel=1e-3)


def test_float16_nnx_model_computes_in_float32():
    class M(nnx.Module):
        def __init__(self, rngs, dtype):
            self.l1 = nnx.Linear(5, 6, param_dtype=jnp.float16, dtype=dtype, rngs=rngs)
            self.l2 = nnx.Linear(6, 3, param_dtype=jnp.float16, dtype=dtype, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    x16 = X.astype(np.float16)
    plain = normflat.analyze(M(nnx.Rngs(0), None), (x16, Y), progress=False)
    half = M(nnx.Rngs(0), jnp.float16)
    r = normflat.analyze(half, (x16, Y), progress=False)
    assert r.metadata["dtype"] == "float32"
    assert r.normalized_sharpness == pytest.approx(plain.normalized_sharpness, rel=1e-6)
    assert half.l1.dtype == jnp.float16  # the user's module keeps its dtype


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_linen_model_built_for_mixed_precision_is_analyzed_in_float32(compute):
    """A linen model whose ``dtype`` field (flax's compute dtype, passed down to its layers) is bfloat16 or
    float16 over float32 parameters is analyzed in float32 through a clone of the module, as PyTorch
    under autocast and Keras under a mixed policy: every estimator and the measures equal the float32
    model's, passed as ``(module, variables)`` or ``(module.apply, variables)``. It was refused ("computes
    in half precision inside its forward pass"); a layer with its own half dtype still is."""
    import flax.linen as nn

    class Mixed(nn.Module):
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(dtype=self.dtype)(jnp.tanh(nn.Dense(6, dtype=self.dtype)(x)))
            return nn.Dense(3, dtype=self.dtype)(h)

    x = X.astype(np.float32)
    variables = Mixed().init(jax.random.PRNGKey(0), x[:1])
    half = Mixed(dtype=jnp.dtype(compute))
    assert half.apply(variables, x[:2]).dtype == jnp.dtype(compute)
    for estimator in ("ggn", "hutchinson", "exact"):
        want = normflat.analyze((Mixed(), variables), (x, Y), estimator=estimator, progress=False)
        for model in ((half, variables), (half.apply, variables)):
            got = normflat.analyze(model, (x, Y), estimator=estimator, progress=False)
            assert got.metadata["dtype"] == "float32"
            assert got.normalized_sharpness == want.normalized_sharpness
            assert got.hessian_trace == want.hessian_trace
    measures = ["fisher_rao_norm", "adaptive_sharpness"]
    want_m = normflat.measures((Mixed(), variables), (x, Y), measures, progress=False)
    got_m = normflat.measures((half, variables), (x, Y), measures, progress=False)
    assert [got_m[m] for m in measures] == [want_m[m] for m in measures]
    assert half.dtype == jnp.dtype(compute)  # the user's module keeps its dtype

    class OwnHalf(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, dtype=jnp.dtype(compute))(x)

    with pytest.raises(ValueError, match="half precision"):
        normflat.analyze((OwnHalf(), OwnHalf().init(jax.random.PRNGKey(0), x[:1])), (x, Y), progress=False)


# ----------------------------------------------------------------------------- randomness


def _flat_spec_weights(spec):
    return [jnp.asarray(l.weight) for l in spec.weight_layers()]


def test_hutchinson_equals_reference_from_engine_probes_and_ignores_the_split(builder):
    spec = SPEC
    x, y = netspec.data(spec, n=6, seed=4)
    model = builder.build(spec)
    samples, seed = 5, 7
    got = _diag(model, builder.make_data(x, y, 6), loss="ce", estimator="hutchinson", samples=samples, seed=seed)
    split = _diag(model, builder.make_data(x, y, 2), loss="ce", estimator="hutchinson", samples=samples, seed=seed,
                  probe_chunk=2)
    assert_layers_close(list(split.values()), list(got.values()), rtol=1e-10)
    h = np.asarray(reference_hessian(spec, x, y, "ce"))
    shapes = [l.weight.shape for l in spec.weight_layers()]
    probes = np.concatenate([rademacher(seed, i, range(samples), s).reshape(samples, -1)
                             for i, s in enumerate(shapes)], axis=1).astype(np.float64)
    est = (probes * (probes @ h.T)).mean(axis=0)  # groups of one probe each: the plain mean
    ref = [a.reshape(s) for a, s in zip(np.split(est, np.cumsum([np.prod(s) for s in shapes])[:-1]), shapes)]
    assert_layers_close(list(got.values()), ref, rtol=1e-9)


def test_ggn_mc_equals_reference_from_engine_uniforms_and_ignores_the_split(builder):
    spec = SPEC
    x, y = netspec.data(spec, n=6, seed=5)
    model = builder.build(spec)
    samples, seed = 4, 3
    got = _diag(model, builder.make_data(x, y, 6), estimator="ggn-mc", samples=samples, seed=seed)
    split = _diag(model, builder.make_data(x, y, 4), estimator="ggn-mc", samples=samples, seed=seed, chunk_size=3)
    assert_layers_close(list(split.values()), list(got.values()), rtol=1e-10)
    ws0 = _flat_spec_weights(spec)
    flat0 = jnp.concatenate([w.ravel() for w in ws0])
    options = validate_options(estimator="ggn-mc", samples=samples, seed=seed)
    u = sample_uniforms(seed, 0, 0, len(x), samples)
    total = 0
    for i in range(len(x)):
        f = lambda fl: spec_forward(spec, _unflatten(ws0, fl), x[i:i + 1])[0]  # noqa: E731
        jac = np.asarray(jax.jacobian(f)(flat0))  # (C, P)
        sig = np.asarray(output_signals(jnp, f(flat0)[None], options, jnp.asarray(u[i:i + 1])))  # (K, M, 1, C)
        per_group = ((sig[:, :, 0, :] @ jac) ** 2).sum(axis=1)  # (K, P)
        total = total + per_group.mean(axis=0)
    est = total / len(x)
    shapes = [w.shape for w in ws0]
    ref = [a.reshape(s) for a, s in zip(np.split(est, np.cumsum([np.prod(s) for s in shapes])[:-1]), shapes)]
    assert_layers_close(list(got.values()), ref, rtol=1e-9)


# ----------------------------------------------------------------------------- registry


class Scale(eqx.Module):
    """A user layer: y = x @ w.T * s (weight (out, in) in a leaf named w)."""

    w: jax.Array
    s: jax.Array

    def __call__(self, x, *, key=None):
        return (self.w @ x) * self.s


def test_registry_register_ignore_unsupported_and_mro():
    entries = nf_jax.registered_layers()
    assert isinstance(entries[eqx.nn.Linear], nf_jax.LayerRule)
    assert entries[nnx.BatchNorm] is IGNORE and entries[nnx.ConvTranspose].kind == "conv_transpose"
    assert entries[nnx.Embed].kind == "embedding"  # embeddings are layers (method §3)
    rng = np.random.default_rng(1)
    layer = Scale(jnp.asarray(rng.normal(size=(3, 5))), jnp.asarray(1.5))
    model = eqx.nn.Sequential([layer])
    with pytest.raises(ValueError, match="layers/0/w"):
        normflat.analyze(model, (X, Y), progress=False, on_unsupported="error")

    class SubScale(Scale):
        pass

    try:
        nf_jax.register_layer(Scale, leaf="w", layout="canonical")
        d = _diag(eqx.nn.Sequential([SubScale(layer.w, layer.s)]), (X, Y), loss="ce")  # MRO: subclass matches
        assert list(d) == ["layers/0"]
        nf_jax.register_layer(Scale, unsupported="not today")
        with pytest.raises(ValueError, match="not today"):
            normflat.analyze(model, (X, Y), progress=False, on_unsupported="error")
    finally:
        nf_jax.layers.REGISTRY.unregister(Scale)
    with pytest.raises(TypeError, match="module class"):
        nf_jax.register_layer(int, leaf="w")


# ----------------------------------------------------------------------------- process-wide state


def test_two_analyses_in_threads_leave_warnings_and_rng_alone():
    spec_a = netspec.mlp((5, 6, 3), activation="tanh", seed=61)
    spec_b = netspec.cnn(seed=62, channels=(2, 4, 6), groups=2, maxpool=False, image=4)
    cases = []
    for name, spec in (("flax_nnx", spec_a), ("equinox", spec_b), ("flax_linen", spec_a)):
        b = load_builder(name)
        x, y = netspec.data(spec, n=6, seed=1)
        cases.append((b.build(spec), b.make_data(x, y, 3)))
    kws = [dict(loss="ce", estimator="ggn"), dict(estimator="hutchinson", samples=4),
           dict(estimator="ggn-mc", samples=3)]
    sequential = [_diag(m, d, **kw) for (m, d), kw in zip(cases, kws)]
    np_state = np.random.get_state()[1].copy()
    results: dict = {}
    errors: list = []

    def work(i):
        try:
            for _ in range(2):
                results[i] = _diag(*cases[i], **kws[i])
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for i, ref in enumerate(sequential):
        assert_layers_close(list(results[i].values()), list(ref.values()), rtol=1e-12)
    np.testing.assert_array_equal(np.random.get_state()[1], np_state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("still recorded", UserWarning)
    assert [str(w.message) for w in caught] == ["still recorded"]


def test_keyboard_interrupt_mid_pass_leaves_nnx_model_untouched():
    spec = netspec.cnn(batchnorm=True, activation="tanh", maxpool=False, image=4, seed=63)
    builder = load_builder("flax_nnx")
    model = builder.build(spec)
    model.train()
    before = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    x, y = netspec.data(spec, n=6, seed=1)
    data = builder.make_data(x, y, 3)

    def interrupted():
        yield data[0]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        normflat.analyze(model, interrupted(), progress=False)
    assert model.layers[1].use_running_average is False
    after = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        np.testing.assert_array_equal(a, b)
    assert normflat.analyze(model, data, progress=False).metadata["batches"] == 2


# ----------------------------------------------------------------------------- against torch


def _torch_on_engine() -> bool:
    import importlib

    try:
        mod = importlib.import_module("normflat.backends.torch")
    except ImportError:
        return False
    return hasattr(mod, "__path__")  # the package over normflat.engine (the draws of engine.random)


@pytest.mark.parametrize("estimator, samples", [("hutchinson", 5), ("ggn-mc", 4)])
def test_stochastic_estimators_equal_torch(builder, estimator, samples):
    """Same weights, same data, different batch splits: the same numbers as the torch backend."""
    if not _torch_on_engine():
        pytest.skip("the torch backend does not run on normflat.engine yet")
    torch_builder = load_builder("torch")
    spec = netspec.cnn(seed=71, channels=(2, 4, 6), groups=2, maxpool=False, image=4)
    x, y = netspec.data(spec, n=6, seed=2)
    kw = dict(loss="nsce", estimator=estimator, samples=samples, seed=5, progress=False)
    ref = normflat.hessian_diagonal(torch_builder.build(spec), torch_builder.make_data(x, y, 4), **kw,
                                    **torch_builder.ANALYZE_KWARGS)
    got = normflat.hessian_diagonal(builder.build(spec), builder.make_data(x, y, 3), **kw, **builder.ANALYZE_KWARGS)
    assert len(got) == len(ref)
    for g, r in zip(got.values(), ref.values()):
        r = r.detach().numpy() if hasattr(r, "detach") else np.asarray(r)
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-9, atol=1e-14)


def test_same_architecture_does_not_recompile():
    from normflat.backends.jax import session

    builder = load_builder("flax_nnx")
    x, y = netspec.data(SPEC, n=6, seed=1)
    sizes = []
    for seed in (81, 82, 83):  # same architecture, new weights and new batch sizes
        spec = netspec.mlp((5, 6, 3), activation="tanh", seed=seed)
        normflat.hessian_diagonal(builder.build(spec), builder.make_data(x, y, 4 if seed == 83 else 6),
                                  loss="ce", progress=False, chunk_size=4)
        kernels = [k for _, k in session._CACHE._data.values()]
        sizes.append((len(session._CACHE), sum(k._jit._cache_size() for k in kernels)))
    assert sizes[0] == sizes[1] == sizes[2]
