"""Benchmark: Keras/TensorFlow scale-out (replicas) and memory budget of the GGN.

Two sections, each measured in fresh subprocesses (logical devices must be
configured before TensorFlow starts, and peak memory is a per-process figure):

* ``throughput``: samples/s of ``normflat.hessian_diagonal(estimator="ggn")``
  on a 784-256-128-10 tanh MLP (float32, 10 classes, ``--samples`` random
  inputs, batch 128) with 1 replica (``distributed=False``) and with a
  ``tf.distribute.MirroredStrategy`` over 2 logical CPU devices. Median of
  ``--repeats`` timed runs after a warm-up (which traces the compiled steps).
* ``memory``: peak resident memory added by one GGN pass (``ru_maxrss`` after
  minus the resident size before the call, warm-up included) of a small CNN
  (conv 3x3x32 -> conv 3x3x64 -> dense 10, 32x32x3 inputs, one batch of 256) vs the chunk
  size, set directly (``chunk_size``) or chosen from ``memory_budget``.

Run::

    python -m benchmarks.scaling_tf [--section throughput|memory|all] [--samples 4096] [--repeats 3]

On a CPU the 2 logical devices share the same cores; the throughput ratio
shows the overhead (or gain from parallel per-replica graphs) of the
distributed path, not the speed-up of 2 real devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks._common import memory_vs_chunk, print_throughput, scaling_main

_CHILD = r'''
import json, os, resource, statistics, sys, time
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
import tensorflow as tf
args = json.loads(sys.argv[1])
if args["mode"] == "throughput" and args["replicas"] > 1:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args["replicas"])
import keras
import normflat

def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

rng = np.random.default_rng(0)
if args["mode"] == "throughput":
    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="tanh"),
                                 keras.layers.Dense(128, activation="tanh"), keras.layers.Dense(10)])
    n = args["samples"]
    xs, ys = rng.normal(size=(n, 784)).astype("float32"), rng.integers(0, 10, n)
    data = [(xs[a:a + 128], ys[a:a + 128]) for a in range(0, n, 128)]  # batches of 128
    if args["replicas"] > 1:
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args["replicas"])])
        with strategy.scope():
            model = build()
        kw = {}
    else:
        model, kw = build(), {"distributed": False}
    run = lambda: normflat.hessian_diagonal(model, data, progress=False, **kw)
    run()
    times = []
    for _ in range(args["repeats"]):
        t = time.perf_counter(); run(); times.append(time.perf_counter() - t)
    print(json.dumps({"samples_per_s": n / statistics.median(times), "seconds": statistics.median(times)}))
else:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    data = (rng.normal(size=(256, 32, 32, 3)).astype("float32"), rng.integers(0, 10, 256))
    before = rss_now()
    t = time.perf_counter()
    report = normflat.analyze(model, data, progress=False, **args["options"])  # one batch of 256
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_added_mb": (peak - before) / 2**20, "chunk_size": report.metadata["chunk_size"],
                      "seconds": seconds}))
'''


def _child(args: dict) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True,
                         env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def throughput(samples: int = 4096, repeats: int = 3) -> list[dict]:
    """Samples/s of the GGN pass with 1 and 2 replicas (MirroredStrategy over logical CPUs)."""
    rows = []
    for replicas in (1, 2):
        r = _child({"mode": "throughput", "replicas": replicas, "samples": samples, "repeats": repeats})
        rows.append({"replicas": replicas, **r})
    print_throughput(rows, "replica", f"GGN throughput, 784-256-128-10 MLP, float32, {samples} samples, batch 128")
    return rows


def memory() -> list[dict]:
    """Peak memory of one GGN pass vs chunk size (direct or from memory_budget)."""
    return memory_vs_chunk(lambda options: _child({"mode": "memory", "options": options}),
                           "GGN peak memory, CNN 32x32x3 -> conv32 -> conv64/2 -> dense10, float32, one batch of 256")


def main() -> None:
    scaling_main(__doc__, throughput, memory)


if __name__ == "__main__":
    main()
