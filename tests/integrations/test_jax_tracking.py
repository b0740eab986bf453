"""The JAX tracker in real optax loops (flax nnx, flax linen, equinox): the run is unchanged."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("jax", "optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from normflat.integrations.jax import SharpnessTracker  # noqa: E402

STEPS = 8


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = ((x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 0.5).astype("int32"))
    return x, y


def _batches():
    x, y = _data()
    return [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]


def _draws():
    return float(np.random.random()), random.random()


def _seed():
    np.random.seed(0)
    random.seed(0)


def _same_tree(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) > 0
    for u, v in zip(la, lb):
        if hasattr(u, "dtype") and jax.dtypes.issubdtype(u.dtype, jax.dtypes.prng_key):
            u, v = jax.random.key_data(u), jax.random.key_data(v)
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _nnx_run(tracker):
    from flax import nnx

    _seed()

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(6, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.l2 = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(jax.nn.relu(self.l1(x))))

    model = Net(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, x, y):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        grads = nnx.grad(loss_fn)(model)
        opt.update(model, grads)

    step = 0
    for epoch in range(2):
        for x, y in _batches():
            train_step(model, opt, jnp.asarray(x), jnp.asarray(y))
            step += 1
            if tracker is not None:
                tracker.step(model, step, epoch=epoch)
        if tracker is not None:
            tracker.epoch_end(model, epoch)
    return nnx.state(model), nnx.state(opt), _draws(), model


def test_nnx_optax_loop_is_bit_identical_with_the_tracker():
    require_frameworks("flax")
    logged = []
    tracker = SharpnessTracker(_data(32, seed=1), every_n_steps=3, per_layer=True,
                               logger=lambda m, s: logged.append((s, m)))
    s1, o1, d1, _ = _nnx_run(None)
    s2, o2, d2, model = _nnx_run(tracker)
    _same_tree(s1, s2)  # weights and the nnx.Rngs counters of the dropout stream
    _same_tree(o1, o2)
    assert d1 == d2
    assert tracker.history.steps == [3, 6] and [s for s, _ in logged] == [3, 6]
    assert set(tracker.history.layer_names) == {"l1", "l2"}
    assert "normalized_sharpness/l1" in logged[0][1]
    assert model.drop.deterministic is False  # analyzed in eval mode, left in train mode
    assert all(v > 0 and math.isfinite(v) for v in tracker.history.values("normalized_sharpness"))


def _eqx_run(tracker):
    import equinox as eqx

    _seed()
    model = eqx.nn.MLP(6, 3, 8, depth=1, key=jax.random.PRNGKey(0))
    tx = optax.sgd(0.1, momentum=0.9)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(m)(x), y).mean()
        grads = eqx.filter_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    step = 0
    for epoch in range(2):
        for x, y in _batches():
            model, opt_state = train_step(model, opt_state, jnp.asarray(x), jnp.asarray(y))
            step += 1
            if tracker is not None:
                tracker.step(model, step, epoch=epoch)
        if tracker is not None:
            tracker.epoch_end(model, epoch)
    return model, opt_state, _draws()


def test_equinox_optax_loop_is_bit_identical_with_the_tracker():
    require_frameworks("equinox")
    import equinox as eqx

    tracker = SharpnessTracker(_batches()[:2], every_n_epochs=1, max_batches=1, log="normalized_sharpness")
    m1, o1, d1 = _eqx_run(None)
    m2, o2, d2 = _eqx_run(tracker)
    _same_tree(eqx.filter(m1, eqx.is_array), eqx.filter(m2, eqx.is_array))
    _same_tree(o1, o2)
    assert d1 == d2
    assert tracker.history.epochs == [0, 1] and tracker.history.steps == [4, 8]
    assert len(tracker.history[0].layers) == 2


def _linen_run(tracker):
    import flax.linen as nn

    _seed()

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))

    module = Net()
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 6)))["params"]
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(module.apply({"params": p}, x), y).mean()
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = 0
    for x, y in _batches() * 2:
        params, opt_state = train_step(params, opt_state, jnp.asarray(x), jnp.asarray(y))
        step += 1
        if tracker is not None:
            tracker.step(module, step, params=params)
    return params, opt_state, _draws()


def test_linen_optax_loop_with_explicit_params():
    require_frameworks("flax")
    tracker = SharpnessTracker(_data(32, seed=2), every_n_steps=4, keep_reports=False)
    p1, o1, d1 = _linen_run(None)
    p2, o2, d2 = _linen_run(tracker)
    _same_tree(p1, p2)
    _same_tree(o1, o2)
    assert d1 == d2
    assert tracker.history.steps == [4, 8] and tracker.history.epochs == [None, None]
    with pytest.raises(TypeError, match="not both"):
        tracker.analyze_now(object(), params={}, variables={})
