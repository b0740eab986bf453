"""Track normalized sharpness during Keras ``fit`` (digits, MLP, CPU).

The values land in the epoch ``logs``: ``History.history``, ``CSVLogger`` and
``TensorBoard`` see them like any metric.

Run: ``python examples/track_keras.py [figure.png]`` (default ``tracking_keras.png``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from normflat.integrations.keras import SharpnessCallback  # noqa: E402


def digits(train: int = 1200):
    """scikit-learn's bundled digits (no download): x_train, y_train, x_test, y_test."""
    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x, y = (d.data[order] / 16.0).astype("float32"), d.target[order].astype("int64")
    return x[:train], y[:train], x[train:], y[train:]


def main(figure: str = "tracking_keras.png") -> None:
    keras.utils.set_random_seed(0)
    x_train, y_train, x_test, y_test = digits()
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    cb = SharpnessCallback((x_train[:512], y_train[:512]), every_n_steps=19, per_layer=True)  # about once per epoch
    history = model.fit(x_train, y_train, epochs=12, batch_size=64, verbose=0, callbacks=[cb],
                        validation_data=(x_test, y_test))
    print("val accuracy", round(history.history["val_accuracy"][-1], 3))
    print("normalized sharpness per epoch:", [round(v, 3) for v in history.history["normalized_sharpness"]])
    cb.history.plot(figure, title="Keras fit: digits MLP")
    print(f"figure written to {figure}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
