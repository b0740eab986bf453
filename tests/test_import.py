"""`import normflat` and core calls import no deep-learning framework."""

import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec

from tests.builders import require_frameworks


def test_import_normflat_imports_no_framework():
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import normflat
        import normflat.engine, normflat.engine.driver, normflat.engine.losses, normflat.engine.random
        import normflat.integrations
        w = np.ones((3, 2)); h = np.ones((3, 2))
        normflat.analyze([normflat.LayerProblem("a", w, h)]).to_json()
        normflat.normalized_sharpness(w, h)
        loaded = sorted(m for m in sys.modules
                        if m.split(".")[0] in {"torch", "tensorflow", "jax", "jaxlib", "keras", "flax", "equinox"})
        print(loaded)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_keras_on_jax_imports_no_tensorflow():
    """A Keras model on Keras' JAX backend is analyzed (softmax stripped, measures) without importing
    TensorFlow: the Keras helpers both paths share live in ``normflat.backends.keras_shared``."""
    missing = [name for name in ("keras", "jax") if find_spec(name) is None]
    if missing:  # checked without importing them here (keras would pick its TensorFlow backend)
        require_frameworks(*missing)
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import keras
        import normflat
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(5, activation="tanh")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax", name="probs")(hidden))
        data = (np.ones((2, 4), "float32"), np.array([0, 1]))
        report = normflat.analyze(model, data, loss="ce", progress=False)
        normflat.measures(model, data, ["fisher_rao_norm"], loss="ce", progress=False)
        print(report.metadata["framework"], report.metadata["backend"]["stripped_softmax"],
              sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "jax probs []", out.stdout
