"""JAX backend: the PerturbationModel of the rival measures (method §10) against brute force.

Every model is a tiny float64 network built from a :mod:`tests.netspec` description by
the equinox, flax nnx and flax linen builders: an MLP with biases and two hidden ReLU
layers, and a CNN with inference-mode BatchNorm and max-pooling; and a token-logit
model. The references never go through normflat: the framework's own forward pass and
cross-entropy (optax), the framework's own autodiff of a copy of the model built with
the moved weights (the builders convert canonical weights to each framework's layout),
central differences, explicit sums over the network's paths, and a numpy forward pass
of the hand-folded network.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.builders import load_builder, require_frameworks

require_frameworks("jax", "flax", "equinox", "optax")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import normflat  # noqa: E402
from normflat.backends.jax import perturbation_model  # noqa: E402
from normflat.engine.options import NSCE_EPS, validate_options  # noqa: E402
from normflat.engine.perturbation import UnsupportedMeasureError  # noqa: E402
from tests import netspec  # noqa: E402

jax.config.update("jax_enable_x64", True)

BUILDERS = ("equinox", "flax_nnx", "flax_linen")
SPECS = {
    "mlp": netspec.mlp((4, 5, 4, 3), seed=11),  # two hidden ReLU layers, biases
    # conv-BN-relu-maxpool-conv-BN-relu-GAP-dense, BatchNorm in inference mode
    "cnn": netspec.cnn(channels=(2, 3, 4), batchnorm=True, image=4, seed=12),
}
N, BATCH = 6, 3  # two batches
SCOPE = "path_norm is defined for feed-forward ReLU networks of dense and convolution layers"


def _options(loss="ce", **kw):
    return validate_options(loss=loss, estimator="exact", progress=False, **kw)


def _data(spec):
    return netspec.data(spec, n=N, seed=3)


def _setup(builder_name, spec_name, loss="ce", **kw):
    spec = SPECS[spec_name]
    builder = load_builder(builder_name)
    model = builder.build(spec)
    x, y = _data(spec)
    data = builder.make_data(x, y, BATCH)
    return spec, builder, model, data, perturbation_model(model, data, _options(loss, **kw))


def _user_state(builder_name, model):
    """What of the user's model must never change: every leaf, and for nnx its state and modes."""
    if builder_name == "flax_nnx":
        return nnx.state(model), [getattr(m, "use_running_average", None) for m in model.layers]
    return model


#: ``{(builder, spec): snapshot of the user's model}``, taken when its case is made.
SNAPSHOTS: dict = {}


@pytest.fixture(scope="module")
def cases():
    """One perturbation model per (builder, spec), shared by the tests (one compilation each).

    The user's model is snapshotted when its perturbation model is made; the last
    tests of this file check it after every method was called.
    """
    made = {}

    def get(builder_name, spec_name):
        if (builder_name, spec_name) not in made:
            case = _setup(builder_name, spec_name)
            made[builder_name, spec_name] = case
            SNAPSHOTS[builder_name, spec_name] = _snapshot(_user_state(builder_name, case[2]))
        return made[builder_name, spec_name]

    yield get
    for *_, pm in made.values():
        pm.close()


def _random_deltas(spec, scale=0.05, seed=5):
    rng = np.random.default_rng(seed)
    return [scale * rng.normal(size=l.weight.shape) for l in spec.weight_layers()]


def _to_flax(delta):
    """A canonical (out, in) or (out, in, kh, kw) array in flax's (in, out) / (kh, kw, in, out) layout."""
    return delta.T if delta.ndim == 2 else delta.transpose(2, 3, 1, 0)


def _moved_copy(builder_name, model, deltas):
    """A copy of the model with its weights moved by ``deltas``, converted by hand to its layout."""
    deltas = [jnp.asarray(d) for d in deltas]
    if builder_name == "equinox":  # equinox stores (out, in, *k): the canonical layout
        slots = [i for i, l in enumerate(model.layers) if isinstance(l, (eqx.nn.Linear, eqx.nn.Conv))]
        return eqx.tree_at(lambda m: [m.layers[i].weight for i in slots], model,
                           [model.layers[i].weight + d for i, d in zip(slots, deltas)])
    if builder_name == "flax_nnx":
        graph, state = nnx.split(model)
        state = jax.tree_util.tree_map(lambda a: a, state)  # new Variables: the user's are not written
        slots = [i for i, l in enumerate(model.layers) if isinstance(l, (nnx.Linear, nnx.Conv))]
        for i, d in zip(slots, deltas):
            kernel = state["layers"][i]["kernel"]
            kernel.set_value(kernel.get_value() + _to_flax(d))
        return nnx.merge(graph, state)
    module, variables = model
    names = sorted((k for k in variables["params"] if k.startswith(("Conv", "Dense"))),
                   key=lambda k: (k[0] == "D", k))  # model order: the convolutions come first in SPECS
    params = {**variables["params"]}
    for name, d in zip(names, deltas):
        params[name] = {**params[name], "kernel": params[name]["kernel"] + _to_flax(d)}
    return module, {**variables, "params": params}


def _hand_losses(logits, y, loss="ce", temperature=1.0):
    """Per-sample losses with optax's cross-entropy on the (normalized) logits (method §7)."""
    z = jnp.asarray(logits)
    if loss == "nsce":
        zc = z - z.mean(axis=-1, keepdims=True)
        z = temperature * zc / jnp.sqrt((zc**2).mean(axis=-1, keepdims=True) + NSCE_EPS)
    return np.asarray(optax.softmax_cross_entropy_with_integer_labels(z, jnp.asarray(y)))


def _to_canonical(g, batch_dims=0):
    """A flax kernel (in, out) or (kh, kw, in, out) in the canonical (out, in, *k) layout."""
    g = np.asarray(g)
    lead = tuple(range(batch_dims))
    core = (1, 0) if g.ndim - batch_dims == 2 else (3, 2, 0, 1)
    return g.transpose(lead + tuple(batch_dims + i for i in core))


def _pure(builder_name, model):
    """``(params, logits(params, x), canonical weights of a params-shaped tree)`` of a built model.

    The framework's own split of the model into its parameters and a pure function,
    for JAX's autodiff of the model as the framework runs it (NCHW inputs for equinox).
    """
    if builder_name == "equinox":
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def logits(p, x):
            return jax.vmap(eqx.combine(p, static))(x)

        def weights_of(tree, batch_dims=0):
            return [np.asarray(l.weight) for l in tree.layers if isinstance(l, (eqx.nn.Linear, eqx.nn.Conv))]

        return params, logits, weights_of
    if builder_name == "flax_nnx":
        graph, params, rest = nnx.split(model, nnx.Param, ...)

        def logits(p, x):
            return nnx.merge(graph, p, rest)(x)

        def weights_of(tree, batch_dims=0):
            layers = [i for i, l in enumerate(model.layers) if isinstance(l, (nnx.Linear, nnx.Conv))]
            return [_to_canonical(tree["layers"][i]["kernel"].get_value(), batch_dims) for i in layers]

        return params, logits, weights_of
    module, variables = model

    def logits(p, x):
        return module.apply({**variables, "params": p}, x)

    def weights_of(tree, batch_dims=0):
        names = sorted((k for k in tree if k.startswith(("Conv", "Dense"))), key=lambda k: (k[0] == "D", k))
        return [_to_canonical(tree[k]["kernel"], batch_dims) for k in names]  # convs come first in SPECS

    return variables["params"], logits, weights_of


def _native_inputs(builder_name, x):
    return jnp.asarray(x if builder_name == "equinox" or x.ndim != 4 else x.transpose(0, 2, 3, 1))


def _native_gradients(builder_name, model, x, y):
    """JAX's gradient of the mean optax cross-entropy of the framework's model, canonical layout."""
    params, logits, weights_of = _pure(builder_name, model)

    def mean_ce(p):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, xn), jnp.asarray(y)).mean()

    xn = _native_inputs(builder_name, x)
    return weights_of(jax.jit(jax.grad(mean_ce))(params))


def _native_sample_gradients(builder_name, model, x, y):
    """Per-sample gradients of the cross-entropy, ``(N, *canonical)`` per layer (one vmapped call)."""
    params, logits, weights_of = _pure(builder_name, model)

    def ce(p, xi, yi):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, xi[None]), yi[None]).sum()

    grads = jax.jit(jax.vmap(jax.grad(ce), in_axes=(None, 0, 0)))(params, _native_inputs(builder_name, x),
                                                                    jnp.asarray(y))
    return weights_of(grads, batch_dims=1)


# ----------------------------------------------------------------------------- layers and weights


@pytest.mark.parametrize("builder_name", BUILDERS)
def test_layers_and_weights_are_those_of_analyze(cases, builder_name):
    spec, _, model, data, pm = cases(builder_name, "cnn")  # convolutions, BatchNorm and a dense head
    report = normflat.analyze(model, data, estimator="exact", progress=False)
    assert pm.names == [l.name for l in report.layers]
    assert pm.kinds == [l.kind for l in report.layers]
    weights = pm.weights()
    for w, layer in zip(weights, spec.weight_layers()):
        assert w.dtype == np.float64
        np.testing.assert_array_equal(w, layer.weight)
    weights[0][...] = 0.0  # a copy: the model's weight is not written
    np.testing.assert_array_equal(pm.weights()[0], spec.weight_layers()[0].weight)


# ----------------------------------------------------------------------------- evaluate


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("builder_name", BUILDERS)
def test_evaluate_matches_the_frameworks_own_loss_and_a_moved_copy(cases, builder_name, spec_name):
    spec, builder, model, _, pm = cases(builder_name, spec_name)
    x, y = _data(spec)
    logits = builder.predict(model, x)
    losses, correct = pm.evaluate(None)
    assert losses.dtype == np.float64 and correct.dtype == bool and losses.shape == (N,)
    np.testing.assert_allclose(losses, _hand_losses(logits, y), rtol=1e-12)
    np.testing.assert_array_equal(correct, logits.argmax(1) == y)

    deltas = _random_deltas(spec)
    moved = _moved_copy(builder_name, model, deltas)
    moved_logits = builder.predict(moved, x)
    losses_d, correct_d = pm.evaluate(deltas)
    np.testing.assert_allclose(losses_d, _hand_losses(moved_logits, y), rtol=1e-12)
    np.testing.assert_array_equal(correct_d, moved_logits.argmax(1) == y)
    # ... which is the unperturbed evaluation of the moved copy itself.
    pm_moved = perturbation_model(moved, builder.make_data(x, y, BATCH), _options())
    try:
        np.testing.assert_allclose(losses_d, pm_moved.evaluate(None)[0], rtol=1e-12)
    finally:
        pm_moved.close()
    assert not np.allclose(losses_d, losses)  # the deltas matter


@pytest.mark.parametrize("builder_name", BUILDERS)
def test_evaluate_nsce_with_temperature(builder_name):
    spec, builder, model, _, pm = _setup(builder_name, "mlp", loss="nsce", temperature=2.0)
    try:
        x, y = _data(spec)
        losses, _ = pm.evaluate(None)
        np.testing.assert_allclose(losses, _hand_losses(builder.predict(model, x), y, "nsce", 2.0), rtol=1e-12)
    finally:
        pm.close()


def test_perturbations_of_the_wrong_shape_are_refused(cases):
    spec, _, _, _, pm = cases("flax_linen", "cnn")
    deltas = _random_deltas(spec)
    with pytest.raises(ValueError, match="3 layers"):
        pm.evaluate(deltas[:2])
    deltas[1] = deltas[1].transpose(2, 3, 1, 0)  # flax's layout, not the canonical one
    with pytest.raises(ValueError, match="'Conv_1'.*canonical"):
        pm.gradient(deltas)


# ----------------------------------------------------------------------------- gradient


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("builder_name", BUILDERS)
def test_gradient_matches_framework_autodiff_and_central_differences(cases, builder_name, spec_name):
    spec, _, model, _, pm = cases(builder_name, spec_name)
    x, y = _data(spec)
    deltas = _random_deltas(spec, seed=6)
    moved = _moved_copy(builder_name, model, deltas)
    value, grads = pm.gradient(deltas)
    assert isinstance(value, float)
    assert value == pytest.approx(float(pm.evaluate(deltas)[0].mean()), rel=1e-12)
    reference = _native_gradients(builder_name, moved, x, y)
    assert [g.shape for g in grads] == [l.weight.shape for l in spec.weight_layers()]
    for g, r in zip(grads, reference):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-14)
    # Central differences of the mean loss on three entries (first, middle and last layer).
    h = 1e-5
    rng = np.random.default_rng(7)
    for layer in range(len(grads)):
        entry = tuple(int(rng.integers(0, s)) for s in grads[layer].shape)
        plus = [d.copy() for d in deltas]
        minus = [d.copy() for d in deltas]
        plus[layer][entry] += h
        minus[layer][entry] -= h
        fd = (pm.evaluate(plus)[0].mean() - pm.evaluate(minus)[0].mean()) / (2 * h)
        np.testing.assert_allclose(grads[layer][entry], fd, rtol=1e-6, atol=1e-10)


# ----------------------------------------------------------------------------- weight derivatives


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("builder_name", BUILDERS)
def test_weight_derivatives_match_per_sample_gradients(cases, builder_name, spec_name):
    spec, _, model, _, pm = cases(builder_name, spec_name)
    x, y = _data(spec)
    derivatives = pm.weight_derivatives()
    assert derivatives.dtype == np.float64 and derivatives.shape == (N,)
    weights = [l.weight for l in spec.weight_layers()]
    if spec_name == "mlp":
        # Per sample, the framework's own loss gradient dotted with the weights.
        per_sample = _native_sample_gradients(builder_name, model, x, y)
        reference = sum((g * w).reshape(N, -1).sum(axis=1) for g, w in zip(per_sample, weights))
    else:
        # d/dt loss_i(W (1 + t)) at 0 by the five-point central difference (error O(t^4)); the
        # evaluation it uses is checked against the framework itself above.
        t = 1e-3

        def at(s):
            return pm.evaluate([s * t * w for w in weights])[0]

        reference = (at(-2) - 8 * at(-1) + 8 * at(1) - at(2)) / (12 * t)
    np.testing.assert_allclose(derivatives, reference, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("builder_name", BUILDERS)
def test_a_short_last_batch_is_padded_and_changes_no_number(builder_name):
    """Batches of 4, 4, 1: the last is padded to 4 (label -1, not counted), so every compiled
    step is compiled once and the losses, gradient and derivatives equal one whole batch's."""
    spec = netspec.mlp((4, 5, 3), seed=13)
    builder = load_builder(builder_name)
    model = builder.build(spec)
    x, y = netspec.data(spec, n=9, seed=4)
    uneven = perturbation_model(model, builder.make_data(x, y, 4), _options())
    whole = perturbation_model(model, builder.make_data(x, y, 9), _options())
    deltas = _random_deltas(spec, seed=2)
    for a, b in zip(uneven.evaluate(deltas), whole.evaluate(deltas)):
        assert a.shape == (9,)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    (va, ga), (vb, gb) = uneven.gradient(deltas), whole.gradient(deltas)
    assert va == pytest.approx(vb, rel=1e-12)
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-14)
    np.testing.assert_allclose(uneven.weight_derivatives(), whole.weight_derivatives(), rtol=1e-11, atol=1e-14)
    from normflat.backends.jax import perturbation as jax_perturbation

    jax_perturbation._STEPS.clear()  # new steps: count their compilations from none
    fresh = perturbation_model(model, builder.make_data(x, y, 4), _options())
    fresh.evaluate(deltas), fresh.gradient(deltas), fresh.weight_derivatives()
    steps = (fresh._steps.losses, fresh._steps.gradient, fresh._steps.derivatives)
    assert [f._cache_size() for f in steps] == [1, 1, 1]  # batches of 4 only, the short one padded


# ----------------------------------------------------------------------------- squared output


def _path_sum_mlp(spec):
    """Sum over every input->output path of the product of squared weights, plus the bias paths."""
    (w1, b1), (w2, b2), (w3, b3) = [(l.weight, l.bias) for l in spec.weight_layers()]
    total = 0.0
    for o in range(w3.shape[0]):
        total += b3[o] ** 2
        for k in range(w3.shape[1]):
            total += w3[o, k] ** 2 * b2[k] ** 2
            for j in range(w2.shape[1]):
                total += w3[o, k] ** 2 * w2[k, j] ** 2 * b1[j] ** 2
                for i in range(w1.shape[1]):  # the input entry is 1
                    total += w3[o, k] ** 2 * w2[k, j] ** 2 * w1[j, i] ** 2
    return total


def _hand_folded_squared(spec):
    """netspec's numpy forward on ones, every parameter squared, BatchNorm folded into a x + b first."""
    sq = spec.copy()
    for i, layer in enumerate(sq.layers):
        if isinstance(layer, (netspec.Dense, netspec.Conv2d)):
            layer.weight = layer.weight**2
            layer.bias = None if layer.bias is None else layer.bias**2
        elif isinstance(layer, netspec.BatchNorm):
            a = layer.gamma / np.sqrt(layer.var + layer.eps)
            b = layer.beta - a * layer.mean
            n = len(a)
            sq.layers[i] = netspec.BatchNorm(a**2, b**2, np.zeros(n), np.ones(n), 0.0)
    return float(netspec.forward(sq, np.ones((1,) + spec.input_shape)).sum())


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("builder_name", BUILDERS)
def test_squared_output(cases, builder_name, spec_name):
    spec, _, _, _, pm = cases(builder_name, spec_name)
    reference = _path_sum_mlp(spec) if spec_name == "mlp" else _hand_folded_squared(spec)
    assert pm.squared_output() == pytest.approx(reference, rel=1e-12)


@pytest.mark.parametrize("builder_name", BUILDERS)
@pytest.mark.parametrize("what", ["layernorm", "tanh"])
def test_squared_output_refuses_other_layers(builder_name, what):
    spec = netspec.mlp((4, 5, 3), seed=13, layernorm=what == "layernorm",
                       activation="tanh" if what == "tanh" else "relu")
    builder = load_builder(builder_name)
    x, y = _data(spec)
    pm = perturbation_model(builder.build(spec), builder.make_data(x, y, N), _options())
    try:
        match = r"layer '(layers/1|LayerNorm_0)' \(LayerNorm\)" if what == "layernorm" else "'tanh'"
        with pytest.raises(UnsupportedMeasureError, match=match) as err:
            pm.squared_output()
        assert SCOPE in str(err.value) and "leave 'path_norm' out of measures=..." in str(err.value)
    finally:
        pm.close()


def test_squared_output_of_an_apply_fn_pair_is_refused():
    spec = SPECS["mlp"]
    params = {f"dense{i}": {"kernel": jnp.asarray(l.weight.T), "bias": jnp.asarray(l.bias)}
              for i, l in enumerate(spec.weight_layers())}

    def apply(p, h):
        for i in range(3):
            h = h @ p[f"dense{i}"]["kernel"] + p[f"dense{i}"]["bias"]
            h = jax.nn.relu(h) if i < 2 else h
        return h

    x, y = _data(spec)
    pm = perturbation_model((apply, params), (jnp.asarray(x), jnp.asarray(y)), _options())
    try:
        np.testing.assert_allclose(pm.evaluate(None)[0], _hand_losses(apply(params, jnp.asarray(x)), y),
                                   rtol=1e-12)
        with pytest.raises(UnsupportedMeasureError, match=r"\(apply_fn, params\) pair"):
            pm.squared_output()
    finally:
        pm.close()


# ----------------------------------------------------------------------------- the user's model


def _snapshot(tree):
    leaves = jax.tree_util.tree_leaves(tree)
    return leaves, [np.array(a) if hasattr(a, "shape") else a for a in leaves]


def _assert_same(tree, snapshot):
    leaves, copies = snapshot
    now = jax.tree_util.tree_leaves(tree)
    assert len(now) == len(leaves)
    for a, b, c in zip(leaves, now, copies):
        assert a is b
        if hasattr(a, "shape"):
            np.testing.assert_array_equal(np.asarray(b), c)


def _exercise(pm, spec):
    deltas = _random_deltas(spec)
    pm.evaluate(deltas)
    pm.gradient(deltas)
    pm.weight_derivatives()
    pm.squared_output()
    pm.weights()
    pm.close()


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("builder_name", BUILDERS)
def test_the_users_model_is_unchanged(cases, builder_name, spec_name):
    spec, _, model, _, pm = cases(builder_name, spec_name)  # every method was called by the tests above
    _exercise(pm, spec)
    _assert_same(_user_state(builder_name, model), SNAPSHOTS[builder_name, spec_name])
    with pytest.raises(RuntimeError, match="closed"):
        pm.evaluate(None)


def test_an_nnx_model_in_training_mode_is_measured_in_inference_mode_and_unchanged():
    spec = SPECS["cnn"]
    builder = load_builder("flax_nnx")
    model = builder.build(spec)
    reference = builder.predict(model, _data(spec)[0])  # inference mode, as built
    model.train()  # BatchNorm would use (and update) batch statistics
    before = _snapshot(nnx.state(model))
    x, y = _data(spec)
    pm = perturbation_model(model, builder.make_data(x, y, BATCH), _options())
    np.testing.assert_allclose(pm.evaluate(None)[0], _hand_losses(reference, y), rtol=1e-12)
    assert pm.squared_output() == pytest.approx(_hand_folded_squared(spec), rel=1e-12)
    pm.evaluate(_random_deltas(spec))
    pm.close()
    assert model.layers[1].use_running_average is False
    _assert_same(nnx.state(model), before)


# ----------------------------------------------------------------------------- token logits


class TokenNet(nnx.Module):
    """Token logits (batch, tokens, classes): embedding, tanh, dense."""

    def __init__(self):
        rngs = nnx.Rngs(4)
        self.embed = nnx.Embed(7, 4, param_dtype=jnp.float64, rngs=rngs)
        self.out = nnx.Linear(4, 5, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, tokens):
        return self.out(jnp.tanh(self.embed(tokens)))


def test_token_logits_with_ignored_and_shifted_labels():
    model = TokenNet()
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 7, size=(4, 6))
    labels = rng.integers(0, 5, size=(4, 6))
    labels[0, 2] = labels[2, 4] = labels[3, 1] = -100
    data = [(jnp.asarray(tokens[:2]), jnp.asarray(labels[:2])), (jnp.asarray(tokens[2:]), jnp.asarray(labels[2:]))]
    options = _options(shift_labels=True)
    pm = perturbation_model(model, data, options)
    try:
        report = normflat.analyze(model, data, estimator="exact", shift_labels=True, progress=False)
        assert pm.names == [l.name for l in report.layers] == ["embed", "out"]
        assert pm.kinds == [l.kind for l in report.layers] == ["embedding", "dense"]
        # Position t predicts the label at t + 1; the last position and ignore_index are no predictions.
        shifted = np.concatenate([labels[:, 1:], np.full((4, 1), -100)], axis=1).reshape(-1)
        counted = shifted >= 0
        logits = np.asarray(model(jnp.asarray(tokens))).reshape(-1, 5)
        losses, correct = pm.evaluate(None)
        assert losses.shape == (int(counted.sum()),)
        np.testing.assert_allclose(losses, _hand_losses(logits[counted], shifted[counted]), rtol=1e-12)
        np.testing.assert_array_equal(correct, logits[counted].argmax(1) == shifted[counted])
        # Gradient and weight derivatives against central differences of evaluate.
        weights = pm.weights()
        value, grads = pm.gradient(None)
        assert value == pytest.approx(float(losses.mean()), rel=1e-12)
        h = 1e-5
        for layer, entry in ((0, (1, 3)), (1, (4, 2))):
            plus = [np.zeros_like(w) for w in weights]
            minus = [np.zeros_like(w) for w in weights]
            plus[layer][entry], minus[layer][entry] = h, -h
            fd = (pm.evaluate(plus)[0].mean() - pm.evaluate(minus)[0].mean()) / (2 * h)
            np.testing.assert_allclose(grads[layer][entry], fd, rtol=1e-6, atol=1e-10)
        t = 1e-5
        fd = (pm.evaluate([t * w for w in weights])[0] - pm.evaluate([-t * w for w in weights])[0]) / (2 * t)
        np.testing.assert_allclose(pm.weight_derivatives(), fd, rtol=1e-6, atol=1e-9)
        with pytest.raises(UnsupportedMeasureError, match="ones"):
            pm.squared_output()  # token ids: no input of ones, and an embedding is no path
    finally:
        pm.close()


# ----------------------------------------------------------------------------- dtypes


def test_float64_without_global_x64_and_float32_models():
    spec = SPECS["mlp"]
    builder = load_builder("equinox")
    x, y = _data(spec)
    with jax.enable_x64(False):
        model32 = builder.build(spec, dtype="float32")
        data = builder.make_data(x.astype(np.float32), y, BATCH)
        pm32 = perturbation_model(model32, data, _options())
        pm64 = perturbation_model(model32, data, _options(), dtype="float64")
        try:
            assert pm32.dtype == jnp.float32 and pm64.dtype == jnp.float64
            losses32, losses64 = pm32.evaluate(None)[0], pm64.evaluate(None)[0]
            assert losses32.dtype == losses64.dtype == np.float64
            assert not jax.config.jax_enable_x64
        finally:
            pm32.close()
            pm64.close()
    np.testing.assert_allclose(losses32, _hand_losses(netspec.forward(spec, x), y), rtol=1e-5)
    spec32 = spec.copy()  # the float32 weights and inputs, computed in float64
    for layer in spec32.weight_layers():
        layer.weight = layer.weight.astype(np.float32).astype(np.float64)
        layer.bias = layer.bias.astype(np.float32).astype(np.float64)
    x32 = x.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(losses64, _hand_losses(netspec.forward(spec32, x32), y), rtol=1e-12)
