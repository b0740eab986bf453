"""``normflat study --model`` with Keras and JAX (equinox) factories, and their precisions."""

from __future__ import annotations

import math
import sys
import textwrap
from functools import partial

import numpy as np
import pytest

from tests.builders import require_frameworks

from normflat.study.run import load_result
from tests.study._cli import assert_one_line_error, run_cli

FAST = ["--dataset", "feat.npz", "--ratios", "0,1", "--seeds", "1", "--epochs", "2", "--no-progress"]

KERAS_FACTORIES = textwrap.dedent('''
    import keras

    def sequential(input_shape, num_classes, width=None, seed=0):
        init = keras.initializers.GlorotUniform(seed=seed)
        return keras.Sequential([keras.Input(input_shape),
                                 keras.layers.Dense(width or 5, activation="relu", kernel_initializer=init),
                                 keras.layers.Dense(num_classes, kernel_initializer=init)])

    def functional(input_shape, num_classes, width=None, seed=0):
        x = keras.Input(input_shape)
        h = keras.layers.Dense(5, activation="relu")(x)
        return keras.Model(x, keras.layers.Dense(num_classes)(h + keras.layers.Dense(5)(x)))
''')

JAX_FACTORIES = textwrap.dedent('''
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    def sequential(input_shape, num_classes, width=None, seed=0):
        k1, k2 = jax.random.split(jax.random.key(seed))
        hidden = width or 5
        return eqx.nn.Sequential([eqx.nn.Linear(input_shape[0], hidden, key=k1), eqx.nn.Lambda(jax.nn.relu),
                                  eqx.nn.Linear(hidden, num_classes, key=k2)])

    def with_batchnorm(input_shape, num_classes, width=None, seed=0):
        k1, k2 = jax.random.split(jax.random.key(seed))
        return eqx.nn.make_with_state(eqx.nn.Sequential)([
            eqx.nn.Linear(input_shape[0], 5, key=k1), eqx.nn.BatchNorm(5, axis_name="examples", mode="ema"),
            eqx.nn.Lambda(jax.nn.relu), eqx.nn.Linear(5, num_classes, key=k2)])

    class Custom(eqx.Module):
        layer: eqx.nn.Linear

        def __call__(self, x):
            return self.layer(jnp.tanh(x))

    def custom(input_shape, num_classes, width=None, seed=0):
        return Custom(eqx.nn.Linear(input_shape[0], num_classes, key=jax.random.key(seed)))

    def batched(input_shape, num_classes, width=None, seed=0):
        return eqx.nn.Linear(input_shape[0] * 2, num_classes, key=jax.random.key(seed))
''')


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "kerasmodels.py").write_text(KERAS_FACTORIES)
    (tmp_path / "jaxmodels.py").write_text(JAX_FACTORIES)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "feat.npz", x_train=rng.normal(size=(32, 4)).astype(np.float32),
             y_train=rng.integers(0, 3, 32), x_test=rng.normal(size=(16, 4)).astype(np.float32),
             y_test=rng.integers(0, 3, 16))
    monkeypatch.chdir(tmp_path)
    for name in ("kerasmodels", "jaxmodels"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


#: TensorFlow and JAX write log lines of their own to stderr: count normflat's lines only.
one_line_error = partial(assert_one_line_error, framework_logs=True)


def check_rows(result, rtol):
    for r in result.rows:
        assert r["rescale_function_error"] < rtol
        assert r["rescaled_normalized_sharpness"] == pytest.approx(r["normalized_sharpness"], rel=1e-8)
        assert abs(math.log10(r["rescaled_hessian_trace"] / r["hessian_trace"])) > 0.1


def test_keras_user_models(work, capsys):
    require_frameworks("keras", "normflat.backends.keras")
    code, _, err = run_cli(["study", "--framework", "keras", "--model", "kerasmodels:sequential", "--width", "3", *FAST,
                         "--out", "k"], capsys)
    assert code == 0, err
    result = load_result(work / "k" / "results.json")
    assert result.config["model"] == "kerasmodels:sequential" and [r["width"] for r in result.rows] == [3, 3]
    check_rows(result, 1e-9)  # Dense(activation="relu") layers are rescaled unit-wise
    code, _, err = run_cli(["study", "--framework", "keras", "--model", "kerasmodels:functional", *FAST, "--out", "f"],
                        capsys)
    one_line_error(code, err, "keras.Sequential", "--no-reparam")
    code, _, err = run_cli(["study", "--framework", "keras", "--model", "kerasmodels:functional", "--no-reparam", *FAST,
                         "--out", "f"], capsys)
    assert code == 0, err  # the functional model is copied to float64 and analyzed
    code, _, err = run_cli(["study", "--framework", "keras", "--model", "kerasmodels:sequential", "--precision", "mixed",
                         *FAST, "--out", "m"], capsys)
    one_line_error(code, err, "mixed_bfloat16", "--precision float32")
    import keras

    if not keras.distribution.list_devices("gpu"):
        code, _, err = run_cli(["study", "--framework", "keras", "--device", "cuda", "--quick", "--no-progress", "--out",
                             "g"], capsys)
        one_line_error(code, err, "--device cuda", "Keras finds no CUDA device", "--device cpu")


def test_keras_mixed_precision_is_a_per_layer_policy(tmp_path):
    require_frameworks("keras", "normflat.backends.keras")
    import keras

    from normflat.study.frameworks import adapter

    fw = adapter("keras", precision="mixed")
    model = fw.build("cnn-bn", (1, 8, 8), 10, width=8, seed=0)
    policies = [layer.dtype_policy.name for layer in model.layers]
    assert policies[-1] == "float32" and set(policies[:-1]) == {"mixed_bfloat16"}
    assert keras.config.dtype_policy().name == "float32"  # never a global policy
    rng = np.random.default_rng(0)
    x, y = fw.inputs(rng.random((16, 1, 8, 8), dtype=np.float32)), fw.labels(rng.integers(0, 10, 16))
    fw.train(model, x, y, epochs=1, lr=1e-2, batch_size=8, weight_decay=0.0, optimizer="adam", target_accuracy=2.0,
             seed=0, progress=False, desc="")
    evaluated, analyzed = fw.evaluation_model(model), fw.analysis_copy(model, "float64")
    assert {layer.dtype_policy.name for layer in evaluated.layers} == {"float32"}
    # The float32 and float64 copies compute the same function as each other, not the bfloat16 one.
    np.testing.assert_allclose(fw._logits(evaluated, x), fw._logits(analyzed, x.astype(np.float64)), rtol=1e-4,
                               atol=1e-5)
    assert all(np.asarray(w).dtype == np.float32 for w in model.get_weights())  # float32 weights under mixed


def test_jax_user_models(work, capsys):
    require_frameworks("jax", "equinox", "optax", "normflat.backends.jax")
    code, _, err = run_cli(["study", "--framework", "jax", "--model", "jaxmodels:sequential", *FAST, "--out", "s"], capsys)
    assert code == 0, err
    check_rows(load_result(work / "s" / "results.json"), 1e-9)
    # A (module, state) pair whose BatchNorm averages over its own axis name.
    code, _, err = run_cli(["study", "--framework", "jax", "--model", "jaxmodels:with_batchnorm", *FAST, "--out", "b"],
                        capsys)
    assert code == 0, err
    check_rows(load_result(work / "b" / "results.json"), 1e-9)
    code, _, err = run_cli(["study", "--framework", "jax", "--model", "jaxmodels:custom", *FAST, "--out", "c"], capsys)
    one_line_error(code, err, "eqx.nn.Sequential", "--no-reparam")
    code, _, err = run_cli(["study", "--framework", "jax", "--model", "jaxmodels:batched", *FAST, "--out", "x"], capsys)
    one_line_error(code, err, "ONE example")
    code, _, err = run_cli(["study", "--framework", "jax", "--precision", "mixed", "--quick", "--no-progress", "--out",
                         "m"], capsys)
    one_line_error(code, err, "--precision mixed", "torch")
    import jax

    if not any(d.platform == "gpu" for d in jax.devices()):
        code, _, err = run_cli(["study", "--framework", "jax", "--device", "cuda", "--quick", "--no-progress", "--out",
                             "g"], capsys)
        one_line_error(code, err, "--device cuda", "JAX finds no CUDA device", "--device cpu")
