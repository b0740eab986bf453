"""normflat.keras.SharpnessCallback with a real ``model.fit``."""

from __future__ import annotations

import math
import os
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402

import normflat  # noqa: E402
from normflat.integrations.keras import SharpnessCallback  # noqa: E402


def test_callback_records_totals_into_history():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    probe = (x[:32], y[:32])
    cb = SharpnessCallback(probe, every=2, estimator="ggn", chunk_size=16)
    history = model.fit(x, y, epochs=4, batch_size=16, verbose=0, callbacks=[cb])
    ns = history.history["normalized_sharpness"]
    assert len(ns) == 4 and math.isnan(ns[0]) and math.isnan(ns[2])
    assert ns[1] > 0 and ns[3] > 0 and ns[1] != ns[3]
    assert [epoch for epoch, _ in cb.reports] == [1, 3]
    # The last entry is the analysis of the trained model (final softmax stripped).
    final = normflat.analyze(model, probe, progress=False, chunk_size=16)
    for name in normflat.MEASURES:
        assert history.history[name][3] == pytest.approx(getattr(final, name), rel=1e-6)
    assert final.metadata["backend"]["stripped_softmax"] == model.layers[-1].name
    with pytest.raises(ValueError, match="every"):
        SharpnessCallback(probe, every=0)


def test_import_normflat_does_not_import_keras():
    code = "import sys, normflat; print('keras' in sys.modules, 'tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.split() == ["False", "False"], out.stderr
