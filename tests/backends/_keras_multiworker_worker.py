"""Subprocess of test_keras_distributed: one worker of a 2-worker MultiWorkerMirroredStrategy on CPU.

Run as ``python _keras_multiworker_worker.py INDEX PORT0,PORT1 OUT.json``; each
worker analyzes its own shard of the data (every other batch) and writes the
distributed result next to a ``distributed=False`` reference on all the data.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _failing_layer():
    import keras
    import tensorflow as tf

    class FailOnLargeInput(keras.layers.Layer):
        """Identity that fails at run time on inputs above 100."""

        def call(self, x):
            tf.debugging.assert_less(tf.reduce_max(x), tf.constant(100.0, x.dtype), message="replica failure")
            return x

    return FailOnLargeInput


def main(index: int, ports: list[str], out_path: str) -> None:
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })
    import numpy as np
    import tensorflow as tf

    import keras
    import normflat

    FailOnLargeInput = _failing_layer()
    keras.backend.set_floatx("float64")
    # A timeout on collectives: a worker that dies makes the other one fail instead of hang.
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=60)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"),
                                  keras.layers.Dense(4)])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(23, 5)), rng.integers(0, 4, size=23)
    from normflat.backends.keras import layer_problems
    from normflat.engine.options import validate_options

    def batches(x, y, size):
        return [(x[a:a + size], y[a:a + size]) for a in range(0, len(y), size)]

    def shard(data):
        # Every worker passes its own shard of the data (here: every other batch).
        return [b for k, b in enumerate(data) if k % 2 == index]

    result = {"replicas": strategy.num_replicas_in_sync}
    for est in ("ggn", "exact"):
        options = validate_options(estimator=est, progress=False)
        dist, meta = layer_problems(model, shard(batches(x, y, 5)), options)
        ref, _ = layer_problems(model, batches(x, y, 5), options, distributed=False)
        result[est] = max(float(np.max(np.abs(a.hessian_diag - b.hessian_diag)) / np.max(np.abs(b.hessian_diag)))
                          for a, b in zip(dist, ref))
        result[f"{est}_metadata"] = {"examples": meta["examples"], "batches": meta["batches"],
                                     "replicas": meta["backend"].get("replicas"),
                                     "workers": meta["world_size"]}
    # A failure on worker 1 only (its batch 1 holds a value > 100): both workers raise, none hangs.
    with strategy.scope():
        keras.utils.set_random_seed(1)
        failing = keras.Sequential([keras.Input((5,)), FailOnLargeInput(), keras.layers.Dense(4)])
    xf = x.copy()
    xf[6] = 1e3  # batch 1 of size 5 -> the shard of worker 1
    try:
        normflat.analyze(failing, shard(batches(xf, y, 5)), progress=False)
        result["failure"] = "no error"
    except Exception as err:  # noqa: BLE001 - the test checks type and message
        result["failure"] = f"{type(err).__name__}: {err}"[:300]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
