"""Benchmark: the first Keras analysis of a model (tracing included) against Keras' first training step.

A first analysis traces normflat's compiled steps; later analyses of the same model with the
same settings reuse them. A user meets the first call's time once per model, and a test suite
once per test. The baseline is what Keras itself takes for the same model the first time:
``model.train_on_batch`` after ``compile`` (tracing its training function, one step), on the
same batch. Each figure is measured in a fresh process (nothing traced before it; TensorFlow's
process start-up is paid by a small eager computation before the clock starts):

* ``train``: the first ``train_on_batch`` (SGD, sparse cross-entropy from logits, ignoring the
  language models' label -100 as normflat does);
* ``first``: the first ``normflat.hessian_diagonal(model, batch, estimator=..., loss="ce")``
  (``samples=...`` with ``--samples``, the estimator's default without);
* ``again``: the same call right after ``first`` in its process (nothing left to trace).

Models: the ``mlp`` and ``3c3d`` problems of ``benchmarks.keras_diag`` (batches of 128 and
32), and keras-hub's tiny configurations of ``benchmarks.keras_zoo`` named by ``--hub``
(batches of 3). Printed: the three times and ``first / train``.

``python -m benchmarks.keras_first_call --hub "GPT-2" "RWKV-7"``
``python -m benchmarks.keras_first_call --hub --estimator ggn-mc --samples 1500``
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from typing import Any

from benchmarks._common import result_from_fresh_process

__all__ = ["first_call_figures", "main"]

#: Default keras-hub rows (names as in ``benchmarks.keras_zoo``' table).
HUB_DEFAULT = ("BERT classifier", "GPT-2", "Llama 3", "RWKV-7")


def _problem(name: str) -> tuple[Any, Any, Any]:
    """Model and one batch ``(x, y)`` (numpy) of the named problem, Keras' seed 0."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    if name in ("mlp", "3c3d"):
        from benchmarks.keras_diag import make_problem

        model, x, y = make_problem(name)
        return model, np.asarray(x), np.asarray(y)
    from benchmarks.keras_zoo import hub_models

    model, batch = hub_models()[name]()
    x, y = batch(3)
    return model, x, y


def _worker(name: str, what: str, estimator: str, threads: int, samples: int | None, queue: Any) -> None:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    warnings.filterwarnings("ignore")
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    float(tf.reduce_sum(tf.matmul(tf.ones((8, 8)), tf.ones((8, 8)))))  # TensorFlow's start-up, untimed
    model, x, y = _problem(name)
    out = {}
    if what == "train":
        model.compile(optimizer=keras.optimizers.SGD(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100))
        t0 = time.perf_counter()
        model.train_on_batch(x, y)
        out["train"] = time.perf_counter() - t0
    else:
        import normflat

        options = dict(estimator=estimator, loss="ce", progress=False)
        if samples is not None:
            options["samples"] = samples
        for key in ("first", "again"):
            t0 = time.perf_counter()
            normflat.hessian_diagonal(model, (x, y), **options)
            out[key] = time.perf_counter() - t0
    queue.put(out)


def first_call_figures(names: list[str], estimator: str = "ggn", threads: int = 1,
                       repeats: int = 1, samples: int | None = None) -> dict[str, dict[str, float]]:
    """``{name: {"train", "first", "again"}}`` in seconds, each the least of ``repeats`` fresh
    processes (the two kinds alternate)."""
    figures: dict[str, dict[str, float]] = {}
    for name in names:
        best: dict[str, float] = {}
        for _ in range(repeats):
            for what in ("train", "analyze"):
                for key, value in result_from_fresh_process(_worker, (name, what, estimator, threads, samples)).items():
                    best[key] = min(best.get(key, float("inf")), value)
        figures[name] = best
    return figures


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="*", default=["mlp", "3c3d"], choices=["mlp", "3c3d"])
    parser.add_argument("--hub", nargs="*", default=list(HUB_DEFAULT), metavar="NAME",
                        help="keras-hub rows of benchmarks.keras_zoo")
    parser.add_argument("--estimator", default="ggn")
    parser.add_argument("--samples", type=int, default=None, help="the estimator's samples (its default without)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per figure (the least is kept)")
    args = parser.parse_args(argv)
    figures = first_call_figures([*args.problems, *args.hub], args.estimator, args.threads, args.repeats,
                                 args.samples)
    what = args.estimator if args.samples is None else f"{args.estimator}, {args.samples} samples"
    print(f"| model | first train step (s) | first {what} (s) | again (s) | first / train |")
    print("|---|---|---|---|---|")
    for name, f in figures.items():
        print(f"| {name} | {f['train']:.2f} | {f['first']:.2f} | {f['again']:.2f} | {f['first'] / f['train']:.2f} |")
    return figures


if __name__ == "__main__":
    main()
