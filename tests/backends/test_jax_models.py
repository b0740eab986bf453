"""JAX backend: model types, options, untouched models, float32/float64, bad inputs."""

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
from tests.backends.test_jax import assert_layers_close, reference_exact, reference_ggn  # noqa: E402

jax.config.update("jax_enable_x64", True)

SPEC = netspec.mlp((5, 6, 3), activation="tanh", seed=31)


def _data(n=6, seed=1, spec=SPEC):
    x, y = netspec.data(spec, n=n, seed=seed)
    return jnp.asarray(x), jnp.asarray(y)


def _ref(loss="ce", estimator="exact", spec=SPEC, n=6):
    x, y = netspec.data(spec, n=n, seed=1)
    if estimator == "exact":
        return reference_exact(spec, x, y, loss)
    return reference_ggn(spec, x, loss)


def _pair_params(spec=SPEC):
    """Flax-style params of a dense spec: kernels (in, out)."""
    params = {}
    for i, l in enumerate(spec.weight_layers()):
        params[f"dense{i}"] = {"kernel": jnp.asarray(l.weight.T), "bias": jnp.asarray(l.bias)}
    return params


def _pair_apply(params, x):
    h = x
    n = len(params)
    for i in range(n):
        h = h @ params[f"dense{i}"]["kernel"] + params[f"dense{i}"]["bias"]
        if i < n - 1:
            h = jnp.tanh(h)
    return h


# ----------------------------------------------------------------------------- (apply_fn, params)


@pytest.mark.parametrize("estimator", ["exact", "ggn"])
def test_apply_fn_params_pair(estimator):
    x, y = _data()
    d = normflat.hessian_diagonal((_pair_apply, _pair_params()), [(x[:4], y[:4]), (x[4:], y[4:])],
                                  loss="nsce", estimator=estimator, progress=False)
    assert list(d) == ["dense0", "dense1"]
    assert_layers_close([np.asarray(v) for v in d.values()], _ref("nsce", estimator), rtol=1e-8)


def test_apply_fn_with_frozendict_params():
    from flax.core import FrozenDict

    x, y = _data()
    r = normflat.analyze((_pair_apply, FrozenDict(_pair_params())), (x, y), loss="ce", progress=False)
    ref = normflat.analyze((_pair_apply, _pair_params()), (x, y), loss="ce", progress=False)
    assert r.normalized_sharpness == ref.normalized_sharpness and r.metadata["framework"] == "jax"


def test_apply_fn_with_declared_layout_and_variables_collections():
    """A weight named ``w`` in (out, in) order, declared with layouts=; {'params': ...} variables."""
    ws = [l.weight for l in SPEC.weight_layers()]
    params = {"params": {"first": {"w": jnp.asarray(ws[0]), "b": jnp.asarray(SPEC.weight_layers()[0].bias)},
                         "second": {"kernel": jnp.asarray(ws[1].T), "b": jnp.asarray(SPEC.weight_layers()[1].bias)}},
              "consts": {"shift": jnp.zeros(3)}}

    def apply(v, x):
        p = v["params"]
        h = jnp.tanh(x @ p["first"]["w"].T + p["first"]["b"])
        return h @ p["second"]["kernel"] + p["second"]["b"] + v["consts"]["shift"]

    x, y = _data()
    with pytest.warns(UserWarning, match="first/w"):
        d = normflat.hessian_diagonal((apply, params), (x, y), loss="ce", estimator="exact", progress=False)
    assert list(d) == ["second"]
    d = normflat.hessian_diagonal((apply, params), (x, y), loss="ce", estimator="ggn", progress=False,
                                  layouts={"first/w": "out,in"})
    assert list(d) == ["first", "second"]
    ref = _ref("ce", "ggn")
    assert_layers_close([np.asarray(v) for v in d.values()], ref, rtol=1e-8)
    with pytest.raises(ValueError, match="not parameter leaves"):
        normflat.hessian_diagonal((apply, params), (x, y), progress=False, layouts={"first/W": "out,in"})


def test_weight_used_twice_sums_its_uses_and_stays_exact():
    """A weight used by two products with the activations: one tied tap per use, the uses'
    per-example gradients summed before the square (method §6.1, "Tied weights"); brute force."""
    w1 = jnp.asarray(np.random.default_rng(0).normal(size=(5, 5)) / 2)
    w2 = jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)))
    params = {"a": {"kernel": w1}, "out": {"kernel": w2}}

    def apply(p, x):
        h = jnp.tanh(x @ p["a"]["kernel"])
        h = jnp.tanh(h @ p["a"]["kernel"])
        return h @ p["out"]["kernel"]

    x, y = _data()
    report = normflat.analyze((apply, params), (x, y), loss="nsce", progress=False)
    assert [l.details["path"] for l in report.layers] == ["fast", "fast"]

    flat0 = jnp.concatenate([w1.ravel(), w2.ravel()])

    def z_of(f, xi):
        p = {"a": {"kernel": f[:25].reshape(5, 5)}, "out": {"kernel": f[25:].reshape(5, 3)}}
        z = apply(p, xi[None])[0]
        zc = z - z.mean()
        return zc / jnp.sqrt((zc**2).mean() + 1e-12)

    @jax.jit
    def per_example(xi):  # one compiled brute-force J^T H J diagonal per example (eager would take minutes)
        jac = jax.jacobian(z_of)(flat0, xi)
        p = jax.nn.softmax(z_of(flat0, xi))
        return jnp.einsum("cp,cd,dp->p", jac, jnp.diag(p) - jnp.outer(p, p), jac)

    ref = jax.vmap(per_example)(jnp.asarray(x)).mean(axis=0)
    d = normflat.hessian_diagonal((apply, params), (x, y), loss="nsce", progress=False)
    np.testing.assert_allclose(np.asarray(d["a"]), np.asarray(ref[:25]).reshape(5, 5).T, rtol=1e-8)
    np.testing.assert_allclose(np.asarray(d["out"]), np.asarray(ref[25:]).reshape(5, 3).T, rtol=1e-8)


# ----------------------------------------------------------------------------- equinox


def _eqx_mlp(dtype=jnp.float64):
    keys = jax.random.split(jax.random.key(0), 2)
    ws = SPEC.weight_layers()
    layers = []
    for w, k in zip(ws, keys):
        lin = eqx.nn.Linear(w.weight.shape[1], w.weight.shape[0], dtype=dtype, key=k)
        lin = eqx.tree_at(lambda l: (l.weight, l.bias), lin,
                          (jnp.asarray(w.weight, dtype), jnp.asarray(w.bias, dtype)))
        layers.append(lin)
    return layers


class BatchMLP(eqx.Module):
    """A user module that takes a whole batch (not per example)."""

    w0: jax.Array
    b0: jax.Array
    lin: eqx.nn.Linear

    def __call__(self, x):
        h = jnp.tanh(x @ self.w0.T + self.b0)
        return jax.vmap(self.lin)(h)


def test_equinox_batch_model_and_vmap_option():
    l0, l1 = _eqx_mlp()
    model = BatchMLP(l0.weight, l0.bias, l1)
    x, y = _data()
    with pytest.warns(UserWarning, match="w0"):
        r = normflat.analyze(model, (x, y), loss="ce", estimator="exact", progress=False)
    assert r.metadata["backend"]["vmap"] is False and [l.name for l in r.layers] == ["lin"]
    d = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="exact", progress=False,
                                  layouts={"w0": "out,in"})
    assert list(d) == ["w0", "lin"]
    assert_layers_close([np.asarray(v) for v in d.values()], _ref("ce", "exact"), rtol=1e-8)
    # The per-example equinox MLP: vmap detected; forcing vmap=False on it fails clearly.
    seq = eqx.nn.Sequential([_eqx_mlp()[0], eqx.nn.Lambda(jnp.tanh), _eqx_mlp()[1]])
    r = normflat.analyze(seq, (x, y), loss="ce", estimator="ggn", progress=False)
    assert r.metadata["backend"]["vmap"] is True and [l.name for l in r.layers] == ["layers/0", "layers/2"]
    r2 = normflat.analyze(seq, (x, y), loss="ce", estimator="ggn", progress=False, vmap=True)
    assert r2.normalized_sharpness == r.normalized_sharpness


class StatefulNet(eqx.Module):
    lin0: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    lin1: eqx.nn.Linear

    def __call__(self, x, state):
        h, state = self.bn(self.lin0(x), state)
        return self.lin1(jnp.tanh(h)), state


def test_equinox_state_option_uses_running_statistics():
    spec = netspec.mlp((5, 6, 3), activation="tanh", batchnorm=True, seed=32)
    (d0, bn_spec, _, d1) = spec.layers
    l0, l1 = _eqx_mlp()
    l0 = eqx.tree_at(lambda l: (l.weight, l.bias), l0, (jnp.asarray(d0.weight), jnp.asarray(d0.bias)))
    l1 = eqx.tree_at(lambda l: (l.weight, l.bias), l1, (jnp.asarray(d1.weight), jnp.asarray(d1.bias)))
    bn = eqx.nn.BatchNorm(6, axis_name="batch", eps=bn_spec.eps, mode="ema", dtype=jnp.float64)  # training mode
    bn = eqx.tree_at(lambda b: (b.weight, b.bias), bn, (jnp.asarray(bn_spec.gamma), jnp.asarray(bn_spec.beta)))
    model = StatefulNet(l0, bn, l1)
    state = eqx.nn.State(model).set(bn.ema_state_index, (jnp.asarray(bn_spec.mean), jnp.asarray(bn_spec.var)))
    x, y = _data(spec=spec)
    with pytest.raises(ValueError, match="state="):
        normflat.hessian_diagonal(model, (x, y), progress=False)
    d = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="exact", progress=False, state=state)
    assert list(d) == ["lin0", "lin1"]
    assert_layers_close([np.asarray(v) for v in d.values()], _ref("ce", "exact", spec=spec), rtol=1e-8)
    assert model.bn.inference is False  # the user's module is not switched


def test_equinox_embedding_is_analyzed():
    class Tokens(eqx.Module):
        emb: eqx.nn.Embedding
        lin: eqx.nn.Linear

        def __call__(self, t):
            return self.lin(jax.vmap(self.emb)(t).mean(0))

    k1, k2 = jax.random.split(jax.random.key(1))
    model = Tokens(eqx.nn.Embedding(10, 4, key=k1), eqx.nn.Linear(4, 3, key=k2))
    t = jnp.asarray(np.random.default_rng(0).integers(0, 10, size=(5, 7)))
    y = jnp.asarray([0, 1, 2, 0, 1])
    # the table (vocabulary, features) is the matrix (features, vocabulary) of method §3
    r = normflat.analyze(model, (t, y), progress=False, on_unsupported="error")
    assert [(l.name, l.kind, l.shape) for l in r.layers] == [("emb", "embedding", (4, 10)), ("lin", "dense", (3, 4))]


# ----------------------------------------------------------------------------- flax nnx and linen


def test_nnx_train_mode_model_is_analyzed_in_eval_mode_and_left_untouched():
    spec = netspec.cnn(batchnorm=True, activation="tanh", maxpool=False, image=4, seed=33)
    builder = load_builder("flax_nnx")
    model = builder.build(spec)
    model.train()  # BatchNorm would use (and update) batch statistics
    before = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    x, y = netspec.data(spec, n=6, seed=1)
    d = normflat.hessian_diagonal(model, builder.make_data(x, y, 3), loss="ce", estimator="exact",
                                  progress=False)
    assert_layers_close([np.asarray(v) for v in d.values()], reference_exact(spec, x, y, "ce"), rtol=1e-8)
    assert model.layers[1].use_running_average is False
    after = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    assert jax.tree_util.tree_structure(before) == jax.tree_util.tree_structure(after)
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        np.testing.assert_array_equal(a, b)


class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(6, param_dtype=jnp.float64)(x)
        x = nn.BatchNorm(use_running_average=not train, epsilon=0.0, param_dtype=jnp.float64)(x)
        return nn.Dense(3, param_dtype=jnp.float64)(jnp.tanh(x))


def test_linen_train_kwarg():
    module = LinenBN()
    x, y = _data()
    variables = module.init(jax.random.key(0), x[:1], train=False)
    with pytest.raises(ValueError, match="apply_kwargs"):
        normflat.analyze((module, variables), (x, y), progress=False)
    r = normflat.analyze((module, variables), (x, y), progress=False, apply_kwargs={"train": False})
    assert [l.name for l in r.layers] == ["Dense_0", "Dense_1"]


def test_models_are_untouched():
    spec = netspec.mlp((5, 6, 3), batchnorm=True, seed=34)
    x, y = netspec.data(spec, n=4)
    for name in ("equinox", "flax_linen"):
        builder = load_builder(name)
        model = builder.build(spec)
        leaves = jax.tree_util.tree_leaves(model)
        copies = [np.array(a) if hasattr(a, "shape") else a for a in leaves]
        for est in ("ggn", "exact"):
            normflat.analyze(model, builder.make_data(x, y, 2), estimator=est, progress=False)
        for a, c, new in zip(leaves, copies, jax.tree_util.tree_leaves(model)):
            assert a is new
            if hasattr(a, "shape"):
                np.testing.assert_array_equal(np.asarray(a), c)


# ----------------------------------------------------------------------------- dtypes


def test_float32_model_with_x64_enabled():
    """flax/equinox create float32 parameters even with x64 on; float64 inputs must not break jvp."""
    seq = eqx.nn.Sequential([_eqx_mlp(jnp.float32)[0], eqx.nn.Lambda(jnp.tanh), _eqx_mlp(jnp.float32)[1]])
    x, y = _data()  # float64 inputs
    ref = _ref("ce", "exact")
    for est in ("exact", "ggn", "hutchinson", "ggn-mc"):
        r = normflat.analyze(seq, (x, y), loss="ce", estimator=est, progress=False)
        assert r.metadata["dtype"] == "float32"
    d = normflat.hessian_diagonal(seq, (x, y), loss="ce", estimator="exact", progress=False)
    assert all(v.dtype == jnp.float32 for v in d.values())
    assert_layers_close([np.asarray(v, np.float64) for v in d.values()], ref, rtol=2e-4, atol=1e-6)
    d64 = normflat.hessian_diagonal(seq, (x, y), loss="ce", estimator="exact", progress=False, dtype="float64")
    assert all(v.dtype == jnp.float64 for v in d64.values())
    ref32 = [l.weight.astype(np.float32).astype(np.float64) for l in SPEC.weight_layers()]
    spec32 = SPEC.copy()
    for l, w in zip(spec32.weight_layers(), ref32):
        l.weight = w
    for l in spec32.weight_layers():
        l.bias = l.bias.astype(np.float32).astype(np.float64)
    assert_layers_close([np.asarray(v) for v in d64.values()], _ref("ce", "exact", spec=spec32), rtol=1e-8)


def test_float64_enabled_locally_without_x64():
    x, y = netspec.data(SPEC, n=6, seed=1)
    with jax.enable_x64(False):
        seq = eqx.nn.Sequential([_eqx_mlp(jnp.float32)[0], eqx.nn.Lambda(jnp.tanh), _eqx_mlp(jnp.float32)[1]])
        r32 = normflat.analyze(seq, (x, y), loss="ce", progress=False)
        assert r32.metadata["dtype"] == "float32"
        d = normflat.hessian_diagonal(seq, (x, y), loss="ce", progress=False, dtype="float64")
        assert not jax.config.jax_enable_x64
        assert all(isinstance(v, np.ndarray) and v.dtype == np.float64 for v in d.values())
        r64 = normflat.analyze(seq, (x, y), loss="ce", progress=False, dtype="float64")
        assert r64.metadata["dtype"] == "float64"
    assert r64.normalized_sharpness == pytest.approx(r32.normalized_sharpness, rel=1e-4)


# ----------------------------------------------------------------------------- compilation cache


def test_cached_compilation_sees_new_weights():
    builder = load_builder("flax_nnx")
    x, y = netspec.data(SPEC, n=6, seed=1)
    for seed in (40, 41):  # same architecture, different weights: one compiled estimator
        spec = netspec.mlp((5, 6, 3), activation="tanh", seed=seed)
        d = normflat.hessian_diagonal(builder.build(spec), builder.make_data(x, y, 6), loss="ce",
                                      estimator="ggn", progress=False)
        assert_layers_close([np.asarray(v) for v in d.values()], reference_ggn(spec, x, "ce"), rtol=1e-8)


# ----------------------------------------------------------------------------- bad inputs


def _seq():
    return eqx.nn.Sequential([_eqx_mlp()[0], eqx.nn.Lambda(jnp.tanh), _eqx_mlp()[1]])


@pytest.mark.parametrize("data, match", [
    ([], "empty"),
    ((np.ones((4, 5)), np.array([0, 1, 3, 0])), r"\[0, 2\]"),
    ((np.ones((4, 5)), np.array([0, 1, -1, 0])), r"\[0, 2\]"),
    ((np.ones((4, 5)), np.array([0.0, 1.5, 1.0, 0.0])), "integer"),
    ((np.ones((4, 5)), np.full((4, 3), 1 / 3)), "one-hot"),
    ((np.ones((4, 5)), np.array([0, 1, 1])), "4 inputs but 3 labels"),
    ((np.full((4, 5), np.nan), np.array([0, 1, 1, 0])), "NaN"),
])
def test_bad_data(data, match):
    with pytest.raises(ValueError, match=match):
        normflat.analyze(_seq(), data, progress=False)


def test_bad_data_type():
    with pytest.raises(TypeError, match="iterable of"):
        normflat.analyze(_seq(), 3, progress=False)
    with pytest.raises(TypeError, match="pair"):
        normflat.analyze(_seq(), [np.ones((4, 5))], progress=False)


def test_bad_model_and_options():
    x, y = _data()
    with pytest.raises(TypeError, match="Unknown option"):
        normflat.analyze(_seq(), (x, y), progress=False, chunks=3)
    with pytest.raises(TypeError, match="equinox models only"):
        normflat.analyze((_pair_apply, _pair_params()), (x, y), progress=False, vmap=True)
    with pytest.raises(ValueError, match="chunk_size"):
        normflat.analyze(_seq(), (x, y), progress=False, chunk_size=0)
    with pytest.raises(ValueError, match="floating"):
        normflat.analyze(_seq(), (x, y), progress=False, dtype="int32")
    with pytest.raises(ValueError, match="max_exact_params"):
        normflat.analyze(_seq(), (x, y), estimator="exact", progress=False, max_exact_params=10)
    r = normflat.analyze(_seq(), (x, y), estimator="exact", progress=False, max_exact_params=10, force=True)
    assert r.metadata["estimator"] == "exact"
    nan_params = _pair_params()
    nan_params["dense0"]["kernel"] = nan_params["dense0"]["kernel"].at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="NaN"):
        normflat.analyze((_pair_apply, nan_params), (x, y), progress=False)
    with pytest.raises(ValueError, match="no weight tensor"):
        normflat.analyze((lambda p, x: x[:, :3] * p["s"], {"s": jnp.ones(3)}), (x, y), progress=False)
    with pytest.raises(ValueError, match=r"\(batch, classes\)"):
        # (batch, tokens, classes) are token logits (method §6.3); four axes are no logits at all
        normflat.analyze((lambda p, x: (x @ p["d"]["kernel"])[:, :, None, None], _pair_params()["dense0"] and
                          {"d": {"kernel": jnp.ones((5, 3))}}), (x, y), progress=False)


def test_progress_bar(capsys):
    x, y = _data()
    normflat.analyze(_seq(), [(x[:3], y[:3]), (x[3:], y[3:])], progress=True)
    assert "normflat ggn" in capsys.readouterr().err
    normflat.analyze(_seq(), [(x[:3], y[:3]), (x[3:], y[3:])], progress=False)
    assert "normflat" not in capsys.readouterr().err
