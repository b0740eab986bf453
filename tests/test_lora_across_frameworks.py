"""One LoRA-adapted network in PyTorch (PEFT), Keras (``enable_lora``) and flax nnx (``nnx.LoRALinear``):
the same matrices and the same numbers (method §3, "LoRA adapters").

The network is ``x (6) → W x + B A x → tanh → head (3)`` with a rank-2 adapter of scale 1 (PEFT and
Keras with ``lora_alpha = r``; nnx's ``LoRA`` has no scale). Each framework reports the frozen map,
``A`` and ``B`` as three matrices, under its own names. ``A`` and ``B`` are drawn on float32's grid
because Keras creates its LoRA factors in float32; its product ``A·B`` is also formed in float32, so
Keras agrees with the float64 PyTorch and JAX numbers to about 1e-6, and those two to 1e-9.
"""

from __future__ import annotations

import numpy as np
import pytest

import normflat
from tests.builders import require_frameworks

RNG = np.random.default_rng(41)
W1, B1 = RNG.normal(size=(5, 6)), RNG.normal(size=5) * 0.1
A = RNG.normal(size=(2, 6)).astype(np.float32).astype(np.float64)  # (r, in)
B = RNG.normal(size=(5, 2)).astype(np.float32).astype(np.float64) * 0.5  # (out, r), exact in float32 too
W2, B2 = RNG.normal(size=(3, 5)), RNG.normal(size=3) * 0.1
X, Y = RNG.normal(size=(12, 6)), RNG.integers(0, 3, 12)
NAMES = {
    "torch": ("base_model.model.l1.base_layer", "base_model.model.l1.lora_A.default",
              "base_model.model.l1.lora_B.default", "base_model.model.l2"),
    "keras": ("l1", "l1/lora_a", "l1/lora_b", "l2"),
    "jax": ("l1", "l1/lora/lora_a", "l1/lora/lora_b", "l2"),
}


def _model(framework, factors=(1.0, 1.0)):
    """The network in ``framework``; ``factors``: rank k's row of A times factors[k], B's column k divided
    by it (the same function)."""
    a, b = A * np.asarray(factors)[:, None], B / np.asarray(factors)
    if framework == "torch":
        require_frameworks("torch", "peft")
        import peft
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.l1, self.l2 = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)

            def forward(self, x):
                return self.l2(torch.tanh(self.l1(x)))

        model = peft.get_peft_model(Net().double(), peft.LoraConfig(r=2, lora_alpha=2, target_modules=["l1"])).double()
        inner = model.base_model.model
        with torch.no_grad():
            for p, v in ((inner.l1.base_layer.weight, W1), (inner.l1.base_layer.bias, B1), (inner.l2.weight, W2),
                         (inner.l2.bias, B2), (inner.l1.lora_A["default"].weight, a),
                         (inner.l1.lora_B["default"].weight, b)):
                p.copy_(torch.from_numpy(v))
        return model.eval()
    if framework == "keras":
        require_frameworks("keras", "tensorflow")
        import keras

        model = keras.Sequential([keras.Input((6,), dtype="float64"),
                                  keras.layers.Dense(5, activation="tanh", dtype="float64", name="l1"),
                                  keras.layers.Dense(3, dtype="float64", name="l2")])
        model.get_layer("l1").set_weights([W1.T, B1])
        model.get_layer("l2").set_weights([W2.T, B2])
        layer = model.get_layer("l1")
        layer.enable_lora(2, lora_alpha=2)
        layer.lora_kernel_a.assign(a.T.astype(np.float32))
        layer.lora_kernel_b.assign(b.T.astype(np.float32))
        return model
    require_frameworks("jax", "flax")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    jax.config.update("jax_enable_x64", True)

    class Net(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.l1 = nnx.LoRALinear(6, 5, lora_rank=2, param_dtype=jnp.float64, lora_param_dtype=jnp.float64,
                                     rngs=rngs)
            self.l2 = nnx.Linear(5, 3, param_dtype=jnp.float64, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    model = Net()
    model.l1.kernel[...], model.l1.bias[...] = jnp.asarray(W1.T), jnp.asarray(B1)
    model.l1.lora.lora_a[...], model.l1.lora.lora_b[...] = jnp.asarray(a.T), jnp.asarray(b.T)
    model.l2.kernel[...], model.l2.bias[...] = jnp.asarray(W2.T), jnp.asarray(B2)
    return model


def _data(framework):
    if framework == "torch":
        import torch

        return torch.from_numpy(X), torch.from_numpy(Y)
    return X, Y


def _logits(framework, model):
    if framework == "torch":
        import torch

        with torch.no_grad():
            return model(torch.from_numpy(X)).numpy()
    return np.asarray(model(X))


@pytest.mark.parametrize("estimator", ["ggn", "exact"])
def test_every_framework_reports_the_same_lora_matrices(estimator):
    """The frozen map, ``A`` and ``B`` of the adapter and the head: the same normalized sharpness and trace
    per matrix in PyTorch, Keras and JAX, everything analyzed (coverage 1, nothing unsupported)."""
    reports = {}
    for framework in ("torch", "keras", "jax"):
        report = normflat.analyze(_model(framework), _data(framework), loss="ce", estimator=estimator,
                                  progress=False)
        assert [layer.name for layer in report.layers] == list(NAMES[framework]), framework
        assert report.metadata["unsupported"] == [] and report.metadata["coverage"] == 1.0, framework
        reports[framework] = [(layer.normalized_sharpness, layer.hessian_trace) for layer in report.layers]
    for i, name in enumerate(NAMES["torch"]):
        torch_ns, torch_tr = reports["torch"][i]
        assert reports["jax"][i][0] == pytest.approx(torch_ns, rel=1e-9), name
        assert reports["jax"][i][1] == pytest.approx(torch_tr, rel=1e-9), name
        assert reports["keras"][i][0] == pytest.approx(torch_ns, rel=1e-5), name
        assert reports["keras"][i][1] == pytest.approx(torch_tr, rel=1e-5), name


@pytest.mark.parametrize("framework", ["torch", "keras", "jax"])
def test_rank_rescaling_leaves_every_normalized_sharpness_unchanged(framework):
    """Rank 0's row of ``A`` times 4 and rank 1's times 1/2, ``B``'s columns divided by the same (factors
    exact in float32): the same logits, every matrix's normalized sharpness unchanged, the factors'
    traces moved (method §8 item 9), in each framework."""
    factors = (4.0, 0.5)
    rel = 1e-5 if framework == "keras" else 1e-8
    np.testing.assert_allclose(_logits(framework, _model(framework, factors)), _logits(framework, _model(framework)),
                               rtol=1e-6 if framework == "keras" else 1e-12, atol=1e-12)
    before = normflat.analyze(_model(framework), _data(framework), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(_model(framework, factors), _data(framework), loss="ce", estimator="ggn",
                             progress=False)
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=rel), lb.name
    for name in NAMES[framework][1:3]:
        assert abs(after.layer(name).hessian_trace - before.layer(name).hessian_trace) > \
            0.05 * before.layer(name).hessian_trace, name
