"""JAX backend: estimators against brute-force float64 references.

References are computed from the framework-free :mod:`tests.netspec` description
with an independent plain-JAX forward pass whose inputs are the canonical
``(out, in, *k)`` weights: ``jax.hessian`` of the mean loss for ``exact``, and
``sum_n J_n^T H_n J_n`` with full per-example Jacobians for ``ggn``. The models
under test are built by the equinox, flax nnx and flax linen builders.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.builders import load_builder, require_frameworks

require_frameworks("jax", "flax", "equinox")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import normflat  # noqa: E402
from normflat.engine.options import NSCE_EPS  # noqa: E402
from tests import netspec  # noqa: E402

jax.config.update("jax_enable_x64", True)

JAX_BUILDERS = ("equinox", "flax_nnx", "flax_linen")


# ----------------------------------------------------------------------------- reference


def spec_forward(spec, ws, x):
    """netspec.forward in plain JAX, with the weight layers' canonical weights ``ws``."""
    it = iter(ws)

    def run(layers, h):
        for layer in layers:
            h = apply(layer, h)
        return h

    def apply(layer, h):
        if isinstance(layer, netspec.Dense):
            out = h @ next(it).T
            return out + layer.bias if layer.bias is not None else out
        if isinstance(layer, netspec.Conv2d):
            p = layer.padding
            out = jax.lax.conv_general_dilated(h, next(it), (layer.stride,) * 2, [(p, p), (p, p)],
                                               dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                               feature_group_count=layer.groups,
                                               precision=jax.lax.Precision.HIGHEST)
            return out + layer.bias.reshape(1, -1, 1, 1) if layer.bias is not None else out
        if isinstance(layer, netspec.Relu):
            return jnp.maximum(h, 0.0)
        if isinstance(layer, netspec.Tanh):
            return jnp.tanh(h)
        if isinstance(layer, netspec.MaxPool2d):
            s = layer.size
            return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 1, s, s), (1, 1, s, s), "VALID")
        if isinstance(layer, netspec.GlobalAvgPool2d):
            return h.mean(axis=(2, 3))
        if isinstance(layer, netspec.Flatten):
            return h.reshape(h.shape[0], -1)
        if isinstance(layer, netspec.BatchNorm):
            shape = (1, -1) + (1,) * (h.ndim - 2)
            scale = layer.gamma / np.sqrt(layer.var + layer.eps)
            return (h - layer.mean.reshape(shape)) * scale.reshape(shape) + layer.beta.reshape(shape)
        if isinstance(layer, netspec.LayerNorm):
            mu = h.mean(axis=-1, keepdims=True)
            var = ((h - mu) ** 2).mean(axis=-1, keepdims=True)
            return (h - mu) / jnp.sqrt(var + layer.eps) * layer.gamma + layer.beta
        if isinstance(layer, netspec.Residual):
            return h + run(layer.body, h)
        raise TypeError(layer)

    return run(spec.layers, jnp.asarray(x))


def head(z, loss, tau=1.0):
    if loss == "nsce":
        zc = z - z.mean(axis=-1, keepdims=True)
        return tau * zc / jnp.sqrt((zc**2).mean(axis=-1, keepdims=True) + NSCE_EPS)
    return z


def mean_loss(spec, ws, x, y, loss):
    zp = head(spec_forward(spec, ws, x), loss)
    return jnp.mean(jax.nn.logsumexp(zp, axis=-1) - zp[jnp.arange(len(y)), y])


def _unflatten(ws0, flat):
    out, i = [], 0
    for w in ws0:
        out.append(flat[i:i + w.size].reshape(w.shape))
        i += w.size
    return out


def _split_like(ws0, vec):
    return [np.asarray(a) for a in _unflatten(ws0, vec)]


def reference_hessian(spec, x, y, loss):
    """Full jax.hessian of the mean loss with respect to all weights, flattened."""
    ws0 = [jnp.asarray(l.weight) for l in spec.weight_layers()]
    flat0 = jnp.concatenate([w.ravel() for w in ws0])
    return jax.jit(jax.hessian(lambda f: mean_loss(spec, _unflatten(ws0, f), x, y, loss)))(flat0)


def reference_exact(spec, x, y, loss):
    """Diagonal of jax.hessian of the mean loss, per weight layer (canonical layout)."""
    ws0 = [jnp.asarray(l.weight) for l in spec.weight_layers()]
    return _split_like(ws0, jnp.diag(reference_hessian(spec, x, y, loss)))


def reference_ggn(spec, x, loss):
    """Diagonal of (1/N) sum_n J_n^T (diag p_n - p_n p_n^T) J_n with full Jacobians."""
    ws0 = [jnp.asarray(l.weight) for l in spec.weight_layers()]
    flat0 = jnp.concatenate([w.ravel() for w in ws0])

    def one(xi):
        f = lambda fl: head(spec_forward(spec, _unflatten(ws0, fl), xi[None]), loss)[0]  # noqa: E731
        jac = jax.jacobian(f)(flat0)  # (C, P)
        p = jax.nn.softmax(f(flat0))
        return jnp.einsum("cp,cd,dp->p", jac, jnp.diag(p) - jnp.outer(p, p), jac)

    return _split_like(ws0, jax.jit(jax.vmap(one))(jnp.asarray(x)).mean(axis=0))


@functools.lru_cache(maxsize=None)
def cached_reference(kind, name, loss, n, seed):
    """Reference diagonals of a named spec (shared by the three builders' tests)."""
    spec = SPECS[name]()
    x, y = netspec.data(spec, n=n, seed=seed)
    return reference_exact(spec, x, y, loss) if kind == "exact" else reference_ggn(spec, x, loss)


def diag_of(builder, spec, x, y, *, loss, estimator, batch_size=5, **kw):
    model = builder.build(spec)
    data = builder.make_data(x, y, batch_size)
    d = normflat.hessian_diagonal(model, data, loss=loss, estimator=estimator, progress=False,
                                  **builder.ANALYZE_KWARGS, **kw)
    return [np.asarray(v) for v in d.values()], list(d)


def assert_layers_close(got, ref, rtol, atol=1e-12):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=rtol, atol=atol * max(1.0, np.abs(r).max()))


SMOOTH = {
    "mlp-tanh": lambda: netspec.mlp((5, 6, 4), activation="tanh", seed=21),
    "mlp-layernorm": lambda: netspec.mlp((5, 6, 3), activation="tanh", layernorm=True, seed=22),
    "cnn-tanh-bn": lambda: netspec.cnn(batchnorm=True, activation="tanh", maxpool=False, image=4, seed=23),
}
RELU = {
    "mlp-relu": lambda: netspec.mlp((5, 7, 6, 3), seed=24),
    "cnn-maxpool": lambda: netspec.cnn(seed=25),
    "cnn-grouped": lambda: netspec.cnn(seed=26, channels=(2, 4, 6), groups=2, maxpool=False, image=4),
    "resnet-block": lambda: netspec.resnet_block(seed=27, image=4),
}
SPECS = {**SMOOTH, **RELU}


@pytest.fixture(params=JAX_BUILDERS)
def builder(request):
    return load_builder(request.param)


# ----------------------------------------------------------------------------- exact


@pytest.mark.parametrize("name, loss", [("mlp-tanh", "nsce"), ("cnn-tanh-bn", "ce"), ("resnet-block", "nsce")])
def test_exact_equals_jax_hessian(builder, name, loss):
    spec = SPECS[name]()
    x, y = netspec.data(spec, n=7, seed=1)
    got, _ = diag_of(builder, spec, x, y, loss=loss, estimator="exact")
    assert_layers_close(got, cached_reference("exact", name, loss, 7, 1), rtol=1e-8)


def test_exact_with_callable_loss(builder):
    spec = SMOOTH["mlp-tanh"]()
    x, y = netspec.data(spec, n=6, seed=2)

    def squared_error(logits, labels):
        return jnp.mean(jnp.sum((logits - jax.nn.one_hot(labels, logits.shape[-1])) ** 2, axis=-1))

    got, _ = diag_of(builder, spec, x, y, loss=squared_error, estimator="exact", batch_size=4)
    ws0 = [jnp.asarray(l.weight) for l in spec.weight_layers()]
    flat0 = jnp.concatenate([w.ravel() for w in ws0])
    h = jax.hessian(lambda f: squared_error(spec_forward(spec, _unflatten(ws0, f), x), jnp.asarray(y)))(flat0)
    assert_layers_close(got, _split_like(ws0, jnp.diag(h)), rtol=1e-8)


# ----------------------------------------------------------------------------- ggn


@pytest.mark.parametrize("name", ["mlp-relu", "cnn-maxpool", "cnn-grouped"])
def test_ggn_equals_exact_on_relu_nets_with_ce(builder, name):
    spec = RELU[name]()
    x, y = netspec.data(spec, n=7, seed=3)
    got, _ = diag_of(builder, spec, x, y, loss="ce", estimator="ggn")
    assert_layers_close(got, cached_reference("exact", name, "ce", 7, 3), rtol=1e-8)


@pytest.mark.parametrize("name, loss", [("mlp-tanh", "nsce"), ("mlp-layernorm", "ce"), ("cnn-tanh-bn", "nsce")])
def test_ggn_equals_brute_force_jthj(builder, name, loss):
    spec = SMOOTH[name]()
    x, y = netspec.data(spec, n=6, seed=4)
    got, _ = diag_of(builder, spec, x, y, loss=loss, estimator="ggn", batch_size=4)
    ref = cached_reference("ggn", name, loss, 6, 4)
    assert_layers_close(got, ref, rtol=1e-8)
    if name == "mlp-tanh":
        # On smooth nets the GGN is not the Hessian: the test can tell them apart.
        exact = cached_reference("exact", name, loss, 6, 4)
        assert max(np.abs(g - e).max() for g, e in zip(ref, exact)) > 1e-6


def test_ggn_nsce_relu_resnet_equals_brute_force(builder):
    spec = RELU["resnet-block"]()
    x, _ = netspec.data(spec, n=5, seed=5)
    got, _ = diag_of(builder, spec, x, np.zeros(5, dtype=int), loss="nsce", estimator="ggn", batch_size=2)
    assert_layers_close(got, reference_ggn(spec, x, "nsce"), rtol=1e-8)


def test_ggn_uses_fast_path_for_every_layer(builder):
    spec = RELU["resnet-block"]()
    x, y = netspec.data(spec, n=4)
    report = normflat.analyze(builder.build(spec), builder.make_data(x, y, 4), loss="ce", progress=False)
    assert [l.details["path"] for l in report.layers] == ["fast"] * len(spec.weight_layers())
    assert report.metadata["examples"] == 4 and report.metadata["batches"] == 1
    assert report.metadata["dtype"] == "float64"


def test_chunk_size_does_not_change_ggn(builder):
    spec = RELU["cnn-maxpool"]()
    x, y = netspec.data(spec, n=7, seed=6)
    a, _ = diag_of(builder, spec, x, y, loss="nsce", estimator="ggn", batch_size=7)
    b, _ = diag_of(builder, spec, x, y, loss="nsce", estimator="ggn", batch_size=7, chunk_size=3)
    assert_layers_close(b, a, rtol=1e-12)


# ----------------------------------------------------------------------------- stochastic estimators


def test_ggn_mc_converges_to_ggn_and_is_seeded():
    builder = load_builder("equinox")
    spec = SMOOTH["mlp-tanh"]()
    x, y = netspec.data(spec, n=8, seed=7)
    ggn, _ = diag_of(builder, spec, x, y, loss="nsce", estimator="ggn")
    # 8 examples × 1000 draws: a relative standard deviation of about 2 % per entry, far inside the 10 %.
    mc, _ = diag_of(builder, spec, x, y, loss="nsce", estimator="ggn-mc", samples=1000, batch_size=8)
    for g, m in zip(ggn, mc):
        assert np.abs(m - g).max() < 0.1 * np.abs(g).max()
    one, _ = diag_of(builder, spec, x, y, loss="nsce", estimator="ggn-mc", samples=3, seed=1)
    again, _ = diag_of(builder, spec, x, y, loss="nsce", estimator="ggn-mc", samples=3, seed=1)
    other, _ = diag_of(builder, spec, x, y, loss="nsce", estimator="ggn-mc", samples=3, seed=2)
    assert_layers_close(again, one, rtol=0)
    assert any(np.abs(o - a).max() > 1e-8 for o, a in zip(other, one))
    # Batching and chunking do not change the draws (keys are per example).
    rebatched, _ = diag_of(builder, spec, x, y, loss="nsce", estimator="ggn-mc", samples=3, seed=1,
                           batch_size=3, chunk_size=2)
    assert_layers_close(rebatched, one, rtol=1e-12)


def test_hutchinson_converges_to_exact_with_standard_errors():
    builder = load_builder("flax_nnx")
    spec = SMOOTH["mlp-tanh"]()
    x, y = netspec.data(spec, n=6, seed=8)
    exact, _ = diag_of(builder, spec, x, y, loss="ce", estimator="exact")
    samples = 2000
    est, _ = diag_of(builder, spec, x, y, loss="ce", estimator="hutchinson", samples=samples, batch_size=6)
    # One batch: the error of entry i has variance sum_{j != i} H_ij^2 / samples.
    h = np.asarray(reference_hessian(spec, x, y, "ce"))
    sd = np.sqrt(((h**2).sum(axis=1) - np.diag(h) ** 2) / samples)
    err = np.concatenate([(g - e).ravel() for g, e in zip(est, exact)])
    assert np.all(np.abs(err) < 5 * sd + 1e-12)
    assert np.abs(err).max() > 0  # it is an estimate
    report = normflat.analyze(builder.build(spec), builder.make_data(x, y, 3), loss="ce",
                              estimator="hutchinson", samples=40, progress=False)
    assert report.standard_error is not None and report.standard_error["hessian_trace"] > 0
    ref_trace = sum(float(e.sum()) for e in exact)
    assert abs(report.hessian_trace - ref_trace) < 6 * report.standard_error["hessian_trace"] + 1e-12


def test_ggn_mc_standard_errors():
    builder = load_builder("flax_linen")
    spec = RELU["cnn-maxpool"]()
    x, y = netspec.data(spec, n=6, seed=9)
    report = normflat.analyze(builder.build(spec), builder.make_data(x, y, 3), loss="ce",
                              estimator="ggn-mc", samples=12, progress=False)
    assert report.standard_error is not None
    assert all(l.standard_error is not None for l in report.layers)


# ----------------------------------------------------------------------------- names and order


def test_names_are_pytree_paths_in_model_order():
    spec = netspec.resnet_block(seed=1, image=4)
    x, y = netspec.data(spec, n=3)
    names = {}
    for b in JAX_BUILDERS:
        builder = load_builder(b)
        names[b] = list(normflat.hessian_diagonal(builder.build(spec), builder.make_data(x, y, 3), progress=False))
    assert names["equinox"] == ["layers/0", "layers/3/body/0", "layers/3/body/3", "layers/6"]
    assert names["flax_nnx"] == ["layers/0", "layers/3/body/0", "layers/3/body/3", "layers/6"]
    # Sorted pytree order would put Dense_0 before Net_0: normflat follows the call order.
    assert names["flax_linen"] == ["Conv_0", "Net_0/Conv_0", "Net_0/Conv_1", "Dense_0"]


def test_results_are_jax_arrays_and_the_reports_problems_host_numpy(builder):
    """hessian_diagonal returns the framework's arrays; the report's problems on a CPU are numpy
    views of the same numbers (the core runs op by op, which JAX would compile op by op)."""
    from normflat.backends import jax as jax_backend
    from normflat.engine.options import validate_options

    spec = netspec.mlp((5, 7, 3), seed=5)
    x, y = netspec.data(spec, n=4)
    data = builder.make_data(x, y, 4)
    model = builder.build(spec)
    diag = normflat.hessian_diagonal(model, data, progress=False)
    assert all(isinstance(d, jax.Array) for d in diag.values())
    problems, _ = jax_backend.layer_problems(model, data, validate_options(progress=False))
    for p in problems:
        assert isinstance(p.weight, np.ndarray) and isinstance(p.hessian_diag, np.ndarray), p.name
        np.testing.assert_array_equal(p.hessian_diag, np.asarray(diag[p.name]))


def test_report_shapes_are_canonical(builder):
    spec = netspec.cnn(seed=3, channels=(2, 4, 6), groups=2)
    x, y = netspec.data(spec, n=3)
    report = normflat.analyze(builder.build(spec), builder.make_data(x, y, 3), progress=False)
    assert [l.shape for l in report.layers] == [l.weight.shape for l in spec.weight_layers()]
    assert [l.kind for l in report.layers] == ["conv2d", "conv2d", "dense"]


# ----------------------------------------------------------------------------- rematerialization


def _remat_models(remat: bool):
    """The same two-block tanh network in flax linen, flax nnx and equinox, its first block under
    ``jax.checkpoint`` (``nn.remat``, ``nnx.remat``, ``eqx.filter_checkpoint``) where ``remat``."""
    import equinox as eqx
    import flax.linen as nn
    from flax import nnx

    class LinenBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(5, param_dtype=jnp.float64, name="b")(jnp.tanh(nn.Dense(6, param_dtype=jnp.float64,
                                                                                     name="a")(x)))

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = (nn.remat(LinenBlock) if remat else LinenBlock)(name="block")
            return nn.Dense(3, param_dtype=jnp.float64, name="head")(jnp.tanh(block(x)))

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 6, param_dtype=jnp.float64, rngs=rngs)
            self.b = nnx.Linear(6, 5, param_dtype=jnp.float64, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    class Nnx(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.block = NnxBlock(rngs)
            self.head = nnx.Linear(5, 3, param_dtype=jnp.float64, rngs=rngs)

        def __call__(self, x):
            h = nnx.remat(lambda block, v: block(v))(self.block, x) if remat else self.block(x)
            return self.head(jnp.tanh(h))

    class Eqx(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self):
            k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
            self.a, self.b = eqx.nn.Linear(4, 6, key=k1), eqx.nn.Linear(6, 5, key=k2)
            self.head = eqx.nn.Linear(5, 3, key=k3)

        def __call__(self, x):  # one example, as equinox's layers are written
            def block(v):
                return self.b(jnp.tanh(self.a(v)))
            h = eqx.filter_checkpoint(block)(x) if remat else block(x)
            return self.head(jnp.tanh(h))

    x0 = jnp.zeros((2, 4), jnp.float64)
    linen = Linen()
    return {"flax_linen": (linen, linen.init(jax.random.PRNGKey(0), x0)), "flax_nnx": Nnx(),
            "equinox": jax.tree_util.tree_map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a,
                                              Eqx())}


def test_rematerialized_blocks_keep_their_fast_rules_and_numbers():
    """A block under ``jax.checkpoint`` (its primitive ``remat2``, inlined in the traced program like a
    ``jit``): the same layers in the same model order, on their fast rules, and the same numbers as
    without it, for ``ggn``, ``hutchinson`` and the measures. Before, the block was one opaque
    operation: its layers took the generic path and came in parameter order (which changed
    ``hutchinson``'s draws)."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(6, 4)), rng.integers(0, 3, size=6)
    plain, remat = _remat_models(False), _remat_models(True)
    for name in plain:
        for options in (dict(estimator="ggn"), dict(estimator="hutchinson", samples=3, seed=2)):
            want = normflat.analyze(plain[name], (x, y), progress=False, **options)
            got = normflat.analyze(remat[name], (x, y), progress=False, **options)
            assert [layer.name for layer in got.layers] == [layer.name for layer in want.layers], name
            assert len(got.layers) == 3
            paths = {"ggn": "fast", "hutchinson": "hvp"}[options["estimator"]]
            assert all(layer.details["path"] == paths for layer in got.layers), (name, options)
            for a, b in zip(got.layers, want.layers):
                assert (a.normalized_sharpness, a.hessian_trace) == pytest.approx(
                    (b.normalized_sharpness, b.hessian_trace), rel=1e-12), (name, a.name, options)
            got = normflat.hessian_diagonal(remat[name], (x, y), progress=False, **options)
            want = normflat.hessian_diagonal(plain[name], (x, y), progress=False, **options)
            for layer in want:
                np.testing.assert_allclose(np.asarray(got[layer]), np.asarray(want[layer]), rtol=1e-12,
                                           err_msg=(name, layer, options))
        measures = ["fisher_rao_norm", "adaptive_sharpness"]
        got = normflat.measures(remat[name], (x, y), measures, loss="ce", progress=False)
        want = normflat.measures(plain[name], (x, y), measures, loss="ce", progress=False)
        assert [got[m] for m in measures] == pytest.approx([want[m] for m in measures], rel=1e-10), name
