"""PReLU's slopes in every framework: excluded with the normalization and activation layers' one reason
(method §4), never skipped as unsupported.

A Keras ``PReLU`` after a convolution has one slope per input entry, a ``(height, width, channels)``
weight that looked like a matrix: it was skipped with a warning and counted against the coverage
(0.82 on this model), where PyTorch's ``nn.PReLU`` was held fixed. Each framework's model here is a
convolution, a PReLU, a dense layer, a PReLU, a head; the report must cover every weight matrix,
list nothing unsupported, and exclude every slope with ``IGNORED_REASON``. (Keras' JAX backend
reads the same registry table, ``KERAS_IGNORED_LAYERS``; ``tests/backends/test_keras_on_jax.py``
compares its excluded reasons with the TensorFlow backend's on a model with a PReLU.)
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import normflat
from normflat.engine.registry import IGNORED_REASON
from tests.builders import require_frameworks

RNG = np.random.default_rng(0)
X = RNG.normal(size=(4, 6, 6, 2)).astype("float32")  # channels last; torch transposes
Y = np.array([0, 1, 2, 0])


def _torch():
    require_frameworks("torch")
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.PReLU(3), nn.Flatten(), nn.Linear(108, 4), nn.PReLU(),
                          nn.Linear(4, 3))
    return model, (torch.from_numpy(X.transpose(0, 3, 1, 2).copy()), torch.from_numpy(Y)), ("1.weight", "4.weight")


def _keras():
    require_frameworks("tensorflow", "keras")
    import keras

    L = keras.layers
    inp = keras.Input((6, 6, 2))
    h = L.PReLU(name="prelu")(L.Conv2D(3, 3, padding="same", name="conv")(inp))
    h = L.PReLU(name="prelu_dense")(L.Dense(4, name="dense")(L.Flatten()(h)))
    model = keras.Model(inp, L.Dense(3, name="head")(h))
    model.set_weights([RNG.normal(size=w.shape).astype("float32") * 0.5 for w in model.get_weights()])
    return model, (X, Y), ("prelu/alpha", "prelu_dense/alpha")


def _flax_nnx():
    require_frameworks("flax")
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(2, 3, (3, 3), padding="SAME", rngs=rngs)
            self.act1, self.act2 = nnx.PReLU(), nnx.PReLU()
            self.dense, self.head = nnx.Linear(108, 4, rngs=rngs), nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            h = self.act1(self.conv(x)).reshape(x.shape[0], -1)
            return self.head(self.act2(self.dense(h)))

    return Net(nnx.Rngs(0)), (X, Y), ("act1/negative_slope", "act2/negative_slope")


def _flax_linen():
    require_frameworks("flax")
    import flax.linen as nn
    import jax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.PReLU(name="act1")(nn.Conv(3, (3, 3), padding="SAME", name="conv")(x)).reshape(x.shape[0], -1)
            return nn.Dense(3, name="head")(nn.PReLU(name="act2")(nn.Dense(4, name="dense")(h)))

    module = Net()
    return (module, module.init(jax.random.PRNGKey(0), X)), (X, Y), ("act1/negative_slope", "act2/negative_slope")


def _equinox():
    require_frameworks("equinox")
    import equinox as eqx
    import jax

    class Net(eqx.Module):
        conv: eqx.nn.Conv2d
        act1: eqx.nn.PReLU
        dense: eqx.nn.Linear
        act2: eqx.nn.PReLU
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.conv = eqx.nn.Conv2d(2, 3, 3, padding=1, key=k1)
            self.act1, self.act2 = eqx.nn.PReLU(), eqx.nn.PReLU()
            self.dense, self.head = eqx.nn.Linear(108, 4, key=k2), eqx.nn.Linear(4, 3, key=k3)

        def __call__(self, x):  # one example, channels first
            return self.head(self.act2(self.dense(self.act1(self.conv(x)).reshape(-1))))

    model = Net(jax.random.PRNGKey(0))
    # With x64 enabled (other tests enable it in this process), equinox creates float64 weights: the
    # inputs in the weights' dtype, as the model itself takes them.
    x = X.transpose(0, 3, 1, 2).astype(model.conv.weight.dtype)
    return model, (x, Y), ("act1/negative_slope", "act2/negative_slope")


@pytest.mark.parametrize("build", [_torch, _keras, _flax_nnx, _flax_linen, _equinox],
                         ids=["torch", "keras", "flax_nnx", "flax_linen", "equinox"])
def test_prelu_slopes_are_excluded_with_the_one_reason(build):
    model, data, slopes = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, so no warning
        report = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    assert report.metadata["coverage"] == 1.0 and report.metadata["unsupported"] == []
    assert len(report.layers) == 3
    for name in slopes:
        assert report.metadata["excluded"][name] == IGNORED_REASON, (name, report.metadata["excluded"])
