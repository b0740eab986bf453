"""Normalized sharpness of a small equinox MLP trained on scikit-learn's digits.

Trains a 64-32-10 ReLU network for a few seconds with plain JAX gradient steps,
analyzes it with the exact GGN diagonal, compares estimators, and checks that a
function-preserving rescaling of two layers leaves normalized sharpness
unchanged while the Hessian trace moves.

Run: ``python examples/jax_equinox_mlp.py``
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits

import normflat


def main() -> None:
    digits = load_digits()
    x = jnp.asarray(digits.data / 16.0, dtype=jnp.float32)
    y = jnp.asarray(digits.target)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

    # equinox layers act on one example; normflat detects this and vmaps the model.
    model = eqx.nn.MLP(64, 10, width_size=32, depth=1, activation=jax.nn.relu, key=jax.random.key(0))

    @eqx.filter_jit
    def step(model, xb, yb):
        def loss(m):
            logits = jax.vmap(m)(xb)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, yb[:, None], -1)[:, 0])

        grads = eqx.filter_grad(loss)(model)
        return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.3 * g, grads))

    rng = np.random.default_rng(0)
    for _ in range(40):
        perm = rng.permutation(len(x_train))
        for i in range(0, len(perm), 100):
            idx = perm[i:i + 100]
            model = step(model, x_train[idx], y_train[idx])
    acc = float(jnp.mean(jax.vmap(model)(x_test).argmax(-1) == y_test))
    print(f"test accuracy {acc:.3f}")

    # Hessian (here: GGN) diagonal of the mean training loss over all training samples,
    # from an iterable of (x, y) batches. Layers are named by pytree path: layers/0, layers/1.
    train = [(x_train[i:i + 256], y_train[i:i + 256]) for i in range(0, len(x_train), 256)]
    report = normflat.analyze(model, train, estimator="ggn", progress=False)
    print(report)

    # A cheaper stochastic estimate, with standard errors (explicit PRNG keys from the seed).
    mc = normflat.analyze(model, train, estimator="ggn-mc", samples=20, seed=0, progress=False)
    se = mc.standard_error["normalized_sharpness"]
    print(f"ggn-mc (20 draws): normalized sharpness {mc.normalized_sharpness:.4f} ± {se:.4f} "
          f"(ggn: {report.normalized_sharpness:.4f})")

    # Dinh et al.'s rescaling: layer 0 × 10, layer 1 ÷ 10 computes the same function.
    rescaled = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight), model,
        (model.layers[0].weight * 10.0, model.layers[0].bias * 10.0, model.layers[1].weight / 10.0))
    same = bool(jnp.allclose(jax.vmap(rescaled)(x_test), jax.vmap(model)(x_test), atol=1e-4))
    after = normflat.analyze(rescaled, train, estimator="ggn", progress=False)
    print(f"rescaled model computes the same function: {same}")
    print(f"  normalized sharpness {report.normalized_sharpness:.4f} -> {after.normalized_sharpness:.4f}")
    print(f"  Hessian trace        {report.hessian_trace:.4f} -> {after.hessian_trace:.4f}")


if __name__ == "__main__":
    main()
