"""Subprocess of test_keras_distributed: one worker of a 2-worker MultiWorkerMirroredStrategy on CPU.

Run as ``python _keras_multiworker_worker.py INDEX PORT0,PORT1 OUT.json``; both
workers analyze the same full data (each keeps its replica's batches) and
write the distributed result next to a ``distributed=False`` reference.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(index: int, ports: list[str], out_path: str) -> None:
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })
    import numpy as np
    import tensorflow as tf

    import keras
    import normflat

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
    from normflat.core.options import validate_options

    result = {"replicas": strategy.num_replicas_in_sync}
    for est in ("ggn", "exact"):
        options = validate_options(estimator=est, progress=False)
        dist, meta = layer_problems(model, (x, y), options, batch_size=5)
        ref, _ = layer_problems(model, (x, y), options, batch_size=5, distributed=False)
        result[est] = max(float(np.max(np.abs(a.hessian_diag - b.hessian_diag)) / np.max(np.abs(b.hessian_diag)))
                          for a, b in zip(dist, ref))
        result[f"{est}_metadata"] = {k: meta.get(k) for k in ("examples", "batches", "replicas", "workers")}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
