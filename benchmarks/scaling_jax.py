"""Benchmark: JAX scale-out (batches sharded over devices) and memory budget of the GGN.

Two sections, each measured in fresh subprocesses (the host device count must be
set before JAX initializes, and peak memory is a per-process figure):

* ``throughput``: samples/s of ``normflat.hessian_diagonal(estimator="ggn")``
  on the benchmark MLP of :mod:`benchmarks.jax_diag` (784-512-256-10 ReLU, flax
  nnx, float32, 10 classes, ``--samples`` random inputs in batches of 128) with
  1 device (``distributed=False``) and with the batches sharded over 2 forced
  host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``, the
  default ``devices=None``). Median of ``--repeats`` timed runs after a warm-up
  (which compiles).
* ``memory``: peak resident memory added by one GGN pass (``ru_maxrss`` after
  minus the resident size before the call, compilation included) of a small CNN
  (conv 3x3x32 -> conv 3x3x64 stride 2 -> dense 10, 32x32x3 inputs, one batch
  of 256, the same network as :mod:`benchmarks.scaling_tf`) vs the chunk size,
  set directly (``chunk_size``) or chosen from ``memory_budget``.

Run::

    python -m benchmarks.scaling_jax [--section throughput|memory|all] [--samples 4096] [--repeats 3]

On a CPU the 2 forced host devices share the same cores (and XLA's CPU
backend already uses several threads for one device); the throughput ratio
shows the overhead of the sharded path, not the speed-up of 2 real devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks._common import memory_vs_chunk, print_throughput, scaling_main

_CHILD = r'''
import json, os, resource, statistics, sys, time
import numpy as np
import jax
from flax import nnx
import normflat
args = json.loads(sys.argv[1])

def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

rng = np.random.default_rng(0)
if args["mode"] == "throughput":
    from benchmarks.jax_diag import mlp
    model = mlp(0)
    n = args["samples"]
    x = rng.normal(size=(n, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, n)
    data = [(x[s:s + 128], y[s:s + 128]) for s in range(0, n, 128)]
    kw = {} if args["devices"] > 1 else {"distributed": False}
    run = lambda: normflat.hessian_diagonal(model, data, loss="ce", progress=False, **kw)
    run()
    times = []
    for _ in range(args["repeats"]):
        t = time.perf_counter(); run(); times.append(time.perf_counter() - t)
    print(json.dumps({"samples_per_s": n / statistics.median(times), "seconds": statistics.median(times),
                      "devices": len(jax.local_devices())}))
else:
    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.c1 = nnx.Conv(3, 32, (3, 3), padding="VALID", rngs=rngs)
            self.c2 = nnx.Conv(32, 64, (3, 3), strides=(2, 2), padding="VALID", rngs=rngs)
            self.d = nnx.Linear(14 * 14 * 64, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.c2(nnx.relu(self.c1(x))))
            return self.d(x.reshape(x.shape[0], -1))

    model = CNN(nnx.Rngs(0))
    data = (rng.normal(size=(256, 32, 32, 3)).astype("float32"), rng.integers(0, 10, 256))
    before = rss_now()
    t = time.perf_counter()
    report = normflat.analyze(model, data, progress=False, distributed=False, **args["options"])
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_added_mb": (peak - before) / 2**20, "chunk_size": report.metadata["chunk_size"],
                      "seconds": seconds}))
'''

_ROOT = Path(__file__).resolve().parents[1]


def _child(args: dict, devices: int = 1) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]))
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True,
                         env=env, timeout=1800, cwd=_ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def throughput(samples: int = 4096, repeats: int = 3) -> list[dict]:
    """Samples/s of the GGN pass on 1 device and sharded over 2 forced host devices."""
    rows = []
    for devices in (1, 2):
        r = _child({"mode": "throughput", "devices": devices, "samples": samples, "repeats": repeats}, devices)
        rows.append(r)
    print_throughput(rows, "device", f"GGN throughput, 784-512-256-10 MLP (flax nnx), float32, {samples} samples, batch 128")
    return rows


def memory() -> list[dict]:
    """Peak memory of one GGN pass vs chunk size (direct or from memory_budget)."""
    return memory_vs_chunk(lambda options: _child({"mode": "memory", "options": options}),
                           "GGN peak memory, CNN 32x32x3 -> conv32 -> conv64/2 -> dense10 (flax nnx), float32, one batch of 256")


def main() -> None:
    scaling_main(__doc__, throughput, memory)


if __name__ == "__main__":
    main()
