"""Benchmark: the Keras generic GGN path against one gradient, at growing batch sizes.

The generic path (``fast=False``, and every weight no fast rule reads) forms per-sample gradients
of its weights through the whole model. Its cost per sample should not grow with the batch: the
figure printed is ``hessian_diagonal(..., fast=False)`` as a multiple of one gradient of the same
model on the same batch, for each batch size. Problems (``loss="ce"``, random data):

* ``mlp``: ``benchmarks.keras_diag``'s 784-512-256-10 ReLU MLP (float32, 10 classes: 9 signals);
* ``gated-delta``: keras-hub Qwen3.5's gated delta net (``Qwen3_5GatedDeltaNet``: hidden size 6,
  one key and one value head of 2, a causal convolution of 3 taps; float64, run by keras-hub in
  float32) over 4 tokens, averaged over the tokens into a 3-class ``Dense`` head; its convolution
  kernel is on the generic path with ``fast=True`` too, as in the keras-hub zoo's Qwen3.5.

Times are medians of ``--repeats`` interleaved rounds after a warm-up call (the tracing), one
thread by default; the gradient is a ``tf.function``-compiled ``GradientTape``.

``python -m benchmarks.keras_generic [--problems mlp gated-delta] [--batches 8 32 64]``
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks._common import time_interleaved  # noqa: E402

__all__ = ["PROBLEMS", "generic_figures", "main"]

PROBLEMS = ("mlp", "gated-delta")


def _problem(name: str, n: int) -> tuple[Any, Any, Any]:
    """Model and one batch ``(x, y)`` of ``n`` samples (Keras' seed 0)."""
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if name == "mlp":
        from benchmarks.keras_diag import PROBLEMS as DIAG_PROBLEMS
        from benchmarks.keras_diag import make_problem

        model, _, _ = make_problem("mlp")
        sample = DIAG_PROBLEMS["mlp"][1][1:]
        return model, rng.normal(size=(n, *sample)).astype("float32"), rng.integers(0, 10, n)
    from keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net import Qwen3_5GatedDeltaNet

    layers = keras.layers
    inputs = keras.Input((4, 6), dtype="float64")
    mixed = Qwen3_5GatedDeltaNet(hidden_size=6, linear_num_key_heads=1, linear_num_value_heads=1,
                                 linear_key_head_dim=2, linear_value_head_dim=2, linear_conv_kernel_dim=3,
                                 dtype="float64", name="delta")(inputs)
    pooled = layers.GlobalAveragePooling1D(dtype="float64")(mixed)
    model = keras.Model(inputs, layers.Dense(3, dtype="float64", name="head")(pooled))
    for v in model.weights:
        v.assign(rng.normal(size=v.shape) * 0.5)
    return model, rng.normal(size=(n, 4, 6)), rng.integers(0, 3, n)


def _gradient(model: Any, x: Any, y: Any) -> Callable[[], Any]:
    """One gradient of the mean cross-entropy: ``benchmarks.keras_diag``'s compiled runner."""
    import tensorflow as tf

    from benchmarks.keras_diag import _runner

    return _runner("gradient", model, tf.constant(x), tf.constant(y))


def generic_figures(problems: list[str], batches: list[int], repeats: int = 3) -> list[dict[str, Any]]:
    """``[{"problem", "n", "gradient", "generic", "ratio", "chunk"}]``: seconds, their ratio and the
    samples per compiled step (the batch, or the chunk the memory rule chose)."""
    import normflat

    rows = []
    for name in problems:
        for n in batches:
            model, x, y = _problem(name, n)
            options = dict(loss="ce", fast=False, progress=False)
            runs = {"gradient": _gradient(model, x, y),
                    "generic": lambda: normflat.hessian_diagonal(model, (x, y), **options)}
            times = time_interleaved(runs, repeats)
            chunk = min(n, normflat.analyze(model, (x, y), **options).metadata["chunk_size"])
            rows.append(dict(problem=name, n=n, gradient=times["gradient"], generic=times["generic"],
                             ratio=times["generic"] / times["gradient"], chunk=chunk))
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="*", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--batches", nargs="*", type=int, default=[8, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    rows = generic_figures(args.problems, args.batches, args.repeats)
    print("| problem | samples | samples per step | gradient (s) | generic `ggn` (s) | generic / gradient |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['problem']} | {r['n']} | {r['chunk']} | {r['gradient']:.4f} | {r['generic']:.3f} | "
              f"{r['ratio']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
