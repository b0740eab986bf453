"""Normalized sharpness of a small Keras MLP trained on scikit-learn's digits.

Trains a 64-32-10 ReLU network for a few seconds while a SharpnessCallback logs
normalized sharpness every 5 epochs, analyzes the trained model with the exact
GGN diagonal, compares estimators, and checks that a function-preserving
rescaling of two layers leaves normalized sharpness unchanged while the Hessian
trace moves.

Run: ``python examples/keras_mlp.py``
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import normflat  # noqa: E402
from normflat.integrations.keras import SharpnessCallback  # noqa: E402


def main() -> None:
    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu", name="hidden"),
                              keras.layers.Dense(10, name="logits")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    watch = SharpnessCallback((x_train[:500], y_train[:500]), every=5)
    history = model.fit(x_train, y_train, epochs=15, batch_size=100, verbose=0, callbacks=[watch])
    print("normalized sharpness during training (every 5 epochs):",
          [round(v, 3) for v in history.history["normalized_sharpness"] if not np.isnan(v)])
    _, acc = model.evaluate(x_test, y_test, verbose=0)
    print(f"test accuracy {acc:.3f}")

    # The GGN diagonal of the mean training loss over all training samples.
    report = normflat.analyze(model, (x_train, y_train), progress=False)
    print(report)

    # A cheaper stochastic estimate, with standard errors.
    mc = normflat.analyze(model, (x_train, y_train), estimator="ggn-mc", samples=20, seed=0, progress=False)
    se = mc.standard_error["normalized_sharpness"]
    print(f"ggn-mc (20 draws): normalized sharpness {mc.normalized_sharpness:.4f} ± {se:.4f} "
          f"(ggn: {report.normalized_sharpness:.4f})")

    # Dinh et al.'s rescaling: hidden layer × 10, logits layer ÷ 10 computes the same function.
    rescaled = keras.models.clone_model(model)
    (w1, b1), (w2, b2) = model.get_layer("hidden").get_weights(), model.get_layer("logits").get_weights()
    rescaled.get_layer("hidden").set_weights([w1 * 10.0, b1 * 10.0])
    rescaled.get_layer("logits").set_weights([w2 / 10.0, b2])
    same = np.allclose(rescaled(x_test).numpy(), model(x_test).numpy(), atol=1e-4)
    after = normflat.analyze(rescaled, (x_train, y_train), progress=False)
    print(f"rescaled model computes the same function: {same}")
    print(f"  hessian trace        {report.hessian_trace:10.4f} -> {after.hessian_trace:10.4f}")
    print(f"  normalized sharpness {report.normalized_sharpness:10.4f} -> {after.normalized_sharpness:10.4f}")


if __name__ == "__main__":
    main()
