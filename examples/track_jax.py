"""Track normalized sharpness in optax loops: equinox and flax nnx (digits, MLP, CPU).

Run: ``python examples/track_jax.py [figure.png]`` (default ``tracking_jax.png``;
the flax nnx run writes ``<figure>_nnx.png`` beside it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sklearn.datasets import load_digits

from normflat.integrations.jax import SharpnessTracker


def digits(train: int = 1200):
    """scikit-learn's bundled digits (no download): x_train, y_train, x_test, y_test."""
    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x, y = (d.data[order] / 16.0).astype("float32"), d.target[order].astype("int64")
    return x[:train], y[:train], x[train:], y[train:]


def batches(x, y, size, rng):
    order = rng.permutation(len(y))
    for i in range(0, len(y) - size + 1, size):
        idx = order[i:i + size]
        yield jnp.asarray(x[idx]), jnp.asarray(y[idx])


def run_equinox(x, y, figure: str) -> None:
    model = eqx.nn.MLP(64, 10, 64, depth=2, key=jax.random.PRNGKey(0))
    tx = optax.adam(3e-3)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, xb, yb):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(m)(xb), yb).mean()
        grads = eqx.filter_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    tracker = SharpnessTracker((x[:512], y[:512]), every_n_steps=25, logger=lambda m, s: None)
    rng, step = np.random.default_rng(0), 0
    for epoch in range(12):
        for xb, yb in batches(x, y, 64, rng):
            model, opt_state = train_step(model, opt_state, xb, yb)
            step += 1
            tracker.step(model, step, epoch=epoch)
    print(f"equinox: {len(tracker.history)} analyses, final NS {tracker.history[-1].normalized_sharpness:.4g}")
    tracker.history.plot(figure, title="optax + equinox: digits MLP")


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(64, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 32, rngs=rngs)
        self.l3 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


def run_nnx(x, y, figure: str) -> None:
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, xb, yb):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(xb), yb).mean()
        opt.update(model, nnx.grad(loss_fn)(model))

    tracker = SharpnessTracker((x[:512], y[:512]), every_n_epochs=1, per_layer=True)
    rng = np.random.default_rng(0)
    for epoch in range(12):
        for xb, yb in batches(x, y, 64, rng):
            train_step(model, opt, xb, yb)
        tracker.epoch_end(model, epoch)
    print(f"flax nnx: {len(tracker.history)} analyses, final NS {tracker.history[-1].normalized_sharpness:.4g}")
    tracker.history.plot(figure, x="epoch", title="optax + flax nnx: digits MLP")


def main(figure: str = "tracking_jax.png") -> None:
    x, y, _, _ = digits()
    run_equinox(x, y, figure)
    nnx_figure = str(Path(figure).with_name(Path(figure).stem + "_nnx.png"))
    run_nnx(x, y, nnx_figure)
    print(f"figures written to {figure} and {nnx_figure}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
