"""The Keras SharpnessCallback with the shared options in a real ``fit``: the run is unchanged."""

from __future__ import annotations

import csv
import math
import os
import random
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from normflat.integrations.keras import SharpnessCallback  # noqa: E402


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 0.5).astype("int64")
    return x, y


def _fit(callbacks, tmp_path, epochs=2):
    keras.utils.set_random_seed(0)
    x, y = _data()
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.2),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, epochs=epochs, batch_size=16, shuffle=True, verbose=0,
                        callbacks=[*callbacks, keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))])
    draws = (float(np.random.random()), random.random(), float(tf.random.uniform(())),
             float(keras.random.uniform(())))
    return model, history, draws


def _assert_same(a, b):
    (m1, _, d1), (m2, _, d2) = a, b
    for w1, w2 in zip(m1.get_weights(), m2.get_weights()):
        np.testing.assert_array_equal(w1, w2)
    v1 = [np.asarray(v) for v in m1.optimizer.variables]
    v2 = [np.asarray(v) for v in m2.optimizer.variables]
    assert len(v1) == len(v2) > 2
    for a1, a2 in zip(v1, v2):
        np.testing.assert_array_equal(a1, a2)
    assert d1 == d2


def test_keras_callback_by_steps_leaves_fit_bit_identical(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    probe = _data(48, seed=1)
    logged = []
    cb = SharpnessCallback(probe, every_n_steps=3, log=("normalized_sharpness", "hessian_trace"), per_layer=True,
                           logger=lambda m, s: logged.append(s))
    base = _fit([], tmp_path / "a")
    tracked = _fit([cb], tmp_path / "b")
    _assert_same(base, tracked)
    # 4 steps per epoch, 8 in all: analyses after steps 3 and 6.
    assert cb.history.steps == [3, 6] and logged == [3, 6]
    assert cb.history.epochs == [0, 1]
    hist = tracked[1].history
    assert hist["normalized_sharpness"] == [cb.history[0].normalized_sharpness, cb.history[1].normalized_sharpness]
    assert "matrix_normalized_sharpness" not in hist
    layer_keys = [k for k in hist if k.startswith("normalized_sharpness/")]
    assert len(layer_keys) == 2
    rows = list(csv.DictReader(Path(tmp_path / "b" / "log.csv").read_text().splitlines()))
    assert len(rows) == 2 and float(rows[1]["hessian_trace"]) == pytest.approx(cb.history[1].hessian_trace)


def test_keras_callback_by_epochs_on_a_fixed_subset(tmp_path):
    x, y = _data(64, seed=2)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64).batch(16).repeat()
    cb = SharpnessCallback(ds, every_n_epochs=2, max_batches=2, keep_reports=False)
    base = _fit([], tmp_path, epochs=4)
    tracked = _fit([cb], tmp_path, epochs=4)
    _assert_same(base, tracked)
    ns = tracked[1].history["normalized_sharpness"]
    assert math.isnan(ns[0]) and math.isnan(ns[2]) and ns[1] > 0 and ns[3] > 0
    assert cb.history.epochs == [1, 3] and cb.reports == []
    assert len(cb.tracker._subset) == 2  # drawn once from the infinite dataset
    with pytest.raises(ValueError, match="old name"):
        SharpnessCallback(ds, every=2, every_n_epochs=3)
