"""Benchmark: the GGN diagonal of ConvNeXt-Tiny in Keras next to PyTorch, in one run.

Workload (normflat issue 12, item 4): ConvNeXt-Tiny with random weights at 32×32×3
input, 10 classes, one batch of 16 random images, float32, ``loss="ce"``:

* Keras: ``keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3),
  classes=10)``; its depthwise 7×7 convolutions are ``Conv2D(groups=channels)``;
* PyTorch: ``torchvision.models.convnext_tiny(num_classes=10)`` (``--torch-model timm``:
  ``timm.create_model("convnext_tiny", num_classes=10)``), eval mode.

Methods per framework: one gradient of the mean cross-entropy (the training
step without the optimizer), and normflat ``estimator="ggn"`` through the public
``normflat.hessian_diagonal``. All four runs alternate within each round after one
warm-up call each (tracing, compilation); the table gives the minimum and the
median over the rounds and the Keras/PyTorch ratio of the minima. Peak memory is
the resident-set growth of one call after a warm-up call, each in a fresh process
(as in ``benchmarks/torch_diag.py``).

Run::

    python -m benchmarks.convnext [--rounds 5] [--threads 1] [--no-memory] [--torch-model timm]

``--threads N`` limits both frameworks to N CPU threads (TensorFlow's intra- and
inter-op pools, ``torch.set_num_threads``): on a shared machine this gives the most
comparable figures. The ratios are what the script is for.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Callable

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks._common import proc_status_kib, reset_peak_kib, time_rounds, value_from_fresh_process  # noqa: E402

__all__ = ["RUNS", "make_runner", "main"]

BATCH, IMAGE, CLASSES = 16, 32, 10
#: The timed runs, in the order they alternate within a round.
RUNS = ("keras_gradient", "keras_ggn", "torch_gradient", "torch_ggn")


def _set_threads(threads: int | None) -> None:
    if not threads:
        return
    import tensorflow as tf
    import torch

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    torch.set_num_threads(threads)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, IMAGE, IMAGE, 3)).astype("float32")  # NHWC
    y = rng.integers(0, CLASSES, size=BATCH)
    return x, y


def _keras_runner(method: str) -> Callable[[], Any]:
    import keras
    import tensorflow as tf

    import normflat

    keras.utils.set_random_seed(0)
    model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(IMAGE, IMAGE, 3), classes=CLASSES)
    x_np, y_np = _data()
    x, y = tf.constant(x_np), tf.constant(y_np)
    if method == "gradient":
        variables = model.trainable_variables

        @tf.function
        def gradient(x, y):
            with tf.GradientTape() as tape:
                # The model ends in a softmax: the cross-entropy of its probabilities.
                probs = model(x, training=False)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, probs))
            return tape.gradient(loss, variables)

        return lambda: [g.numpy() for g in gradient(x, y)][-1]  # .numpy(): wait for the result

    def run():
        # The final softmax is stripped by normflat (the built-in losses take logits).
        out = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn", progress=False)
        return [v.numpy() for v in out.values()]

    return run


def _torch_runner(method: str, source: str) -> Callable[[], Any]:
    import torch

    import normflat

    torch.manual_seed(0)
    if source == "timm":
        import timm

        model = timm.create_model("convnext_tiny", pretrained=False, num_classes=CLASSES)
    else:
        import torchvision

        model = torchvision.models.convnext_tiny(num_classes=CLASSES)
    model.eval()
    x_np, y_np = _data()
    x = torch.from_numpy(x_np.transpose(0, 3, 1, 2).copy())  # NCHW
    y = torch.from_numpy(y_np)
    if method == "gradient":
        loss_fn = torch.nn.CrossEntropyLoss()

        def gradient():
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            return [p.grad for p in model.parameters()]

        return gradient
    return lambda: normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn", progress=False)


def make_runner(run: str, torch_model: str = "torchvision") -> Callable[[], Any]:
    """The zero-argument callable of one of :data:`RUNS` (model and data built here)."""
    framework, method = run.split("_", 1)
    return _keras_runner(method) if framework == "keras" else _torch_runner(method, torch_model)


def _peak_worker(run: str, torch_model: str, threads: int | None, queue: Any) -> None:
    _set_threads(threads)
    runner = make_runner(run, torch_model)
    runner()  # warm-up: one-time tracing and initialization are not part of the peak
    # Linux: reset the peak-RSS mark (VmHWM) so that the peak of this one call is measured.
    before = reset_peak_kib()
    runner()
    queue.put((proc_status_kib("VmHWM") - before) / 1024)


def _peak_mib(run: str, torch_model: str, threads: int | None) -> float:
    return value_from_fresh_process(_peak_worker, (run, torch_model, threads))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per framework")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--torch-model", choices=("torchvision", "timm"), default="torchvision")
    args = parser.parse_args(argv)
    _set_threads(args.threads)
    runners = {run: make_runner(run, args.torch_model) for run in RUNS}
    times = time_rounds(runners, args.rounds)
    peaks = {} if args.no_memory else {run: _peak_mib(run, args.torch_model, args.threads) for run in RUNS}

    import keras
    import tensorflow as tf
    import torch

    best = {run: min(t) for run, t in times.items()}
    print(f"ConvNeXt-Tiny, {IMAGE}x{IMAGE}, {CLASSES} classes, batch {BATCH}, float32; keras {keras.__version__}, "
          f"tensorflow {tf.__version__}, torch {torch.__version__} ({args.torch_model}); "
          f"threads {args.threads or 'default'}; {args.rounds} interleaved rounds")
    print("| run | min s | median s | x own gradient | peak MiB |\n|---|---|---|---|---|")
    for run in RUNS:
        own = best[run.split("_")[0] + "_gradient"]
        peak = f"{peaks[run]:.0f}" if run in peaks else "-"
        print(f"| {run} | {best[run]:.2f} | {statistics.median(times[run]):.2f} | {best[run] / own:.1f} | {peak} |")
    ratio = best["keras_ggn"] / best["torch_ggn"]
    print(f"keras/torch ggn time (minima): {ratio:.2f}x; gradients: "
          f"{best['keras_gradient'] / best['torch_gradient']:.2f}x")
    return {"times": times, "peak_mib": peaks, "ggn_ratio": ratio}


if __name__ == "__main__":
    main()
