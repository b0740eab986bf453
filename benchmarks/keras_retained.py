"""Benchmark: memory a Keras analysis leaves behind, one new model after another.

Comparing checkpoints loads one model after another (``keras.models.load_model``) and analyzes each.
Whatever an analysis leaves in the process after its model is gone adds up over the checkpoints.
The figure printed is the growth of the process's resident memory per new model, in MiB, for:

* ``keras``: Keras' own use of each new model (``compile``, one ``train_on_batch``, one
  ``predict``), the baseline: what Keras itself leaves per model;
* ``normflat``: ``normflat.hessian_diagonal`` of each new model (``--estimator``: ``ggn``, or
  ``hutchinson`` with 2 probes).

Problems (float32, 32 random samples, 10 classes): ``mlp`` (64-256-10, ReLU) and ``cnn`` (16×16×3
images, ``Conv2D(16, 3)``, ``MaxPooling2D``, ``Conv2D(32, 3)``, global average pooling, ``Dense``).
Each contender runs in a fresh process: ``--warmup`` models first (TensorFlow's own first-use state),
then ``--models`` more, garbage collected after each; the growth is the least-squares slope of the
resident memory over those models. It also prints how many functions each model left in
TensorFlow's eager context (``tf.cond`` branches stay there after their step is freed).

``python -m benchmarks.keras_retained [--problems mlp cnn] [--models 20] [--warmup 5] [--estimator ggn]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

__all__ = ["PROBLEMS", "CONTENDERS", "retained", "main"]

PROBLEMS = ("mlp", "cnn")
CONTENDERS = ("keras", "normflat")


def _model_and_data(problem: str) -> tuple[Any, Any, Any]:
    import keras

    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, 32)
    L = keras.layers
    if problem == "mlp":
        x = rng.standard_normal((32, 64)).astype("float32")

        def build() -> Any:
            return keras.Sequential([keras.Input((64,)), L.Dense(256, activation="relu"), L.Dense(10)])
    else:
        x = rng.standard_normal((32, 16, 16, 3)).astype("float32")

        def build() -> Any:
            return keras.Sequential([keras.Input((16, 16, 3)), L.Conv2D(16, 3, activation="relu"), L.MaxPooling2D(),
                                     L.Conv2D(32, 3, activation="relu"), L.GlobalAveragePooling2D(), L.Dense(10)])
    return build, x, y


def _child(problem: str, contender: str, models: int, warmup: int, estimator: str = "ggn") -> dict[str, float]:
    """One contender in this process: ``{"mib_per_model", "functions_per_model"}``."""
    import gc

    import keras
    from tensorflow.python.eager import context

    import normflat

    build, x, y = _model_and_data(problem)

    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def one() -> None:
        model = build()
        if contender == "keras":
            model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="sgd")
            model.train_on_batch(x, y)
            model.predict(x, verbose=0)
        else:
            normflat.hessian_diagonal(model, (x, y), loss="ce", estimator=estimator, progress=False,
                                      **({"samples": 2} if estimator == "hutchinson" else {}))
        del model
        gc.collect()

    for _ in range(warmup):
        one()
    memory, functions = [], []
    for _ in range(models):
        one()
        memory.append(resident_mib())
        functions.append(len(context.context().list_function_names()))
    steps = np.arange(models, dtype=float)
    return {"mib_per_model": float(np.polyfit(steps, memory, 1)[0]),
            "functions_per_model": float(np.polyfit(steps, functions, 1)[0])}


def retained(problem: str, contender: str, models: int = 20, warmup: int = 5,
             estimator: str = "ggn") -> dict[str, float]:
    """:func:`_child` in a fresh Python process (its own TensorFlow), one thread."""
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1",
           "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
    code = ("import json, sys; from benchmarks.keras_retained import _child; "
            f"print(json.dumps(_child({problem!r}, {contender!r}, {models}, {warmup}, {estimator!r})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", choices=PROBLEMS, default=list(PROBLEMS))
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--estimator", choices=("ggn", "hutchinson"), default="ggn")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"memory left per new model (MiB, slope over {args.models} models after {args.warmup}), one thread")
    for problem in args.problems:
        results[problem] = {c: retained(problem, c, args.models, args.warmup, args.estimator)
                            for c in CONTENDERS}
        base, ours = results[problem]["keras"], results[problem]["normflat"]
        print(f"  {problem:4s} keras (compile, train_on_batch, predict) {base['mib_per_model']:.2f} MiB, "
              f"{base['functions_per_model']:.1f} functions; normflat {args.estimator} {ours['mib_per_model']:.2f} MiB, "
              f"{ours['functions_per_model']:.1f} functions; normflat / keras "
              f"{ours['mib_per_model'] / max(base['mib_per_model'], 1e-3):.2f}")
    return results


if __name__ == "__main__":
    main()
