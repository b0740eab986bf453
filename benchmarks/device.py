"""Benchmark: normflat on an accelerator, in one run (issue 12, item 5).

On ``--device`` (``cuda`` where torch finds one, else ``cpu`` for a dry run) the script
checks, then times:

1. **float32 on the device against float64 on the CPU** (PyTorch): small models (a tanh
   MLP, a CNN with BatchNorm and max-pooling, a one-block GPT-2 with token logits), every
   estimator (``ggn``, ``ggn-topk``, ``ggn-mc``, ``exact``, ``hutchinson``; the draws and
   probes come from normflat's own generator, so both runs use the same ones): the largest
   difference of the Hessian diagonals relative to the largest entry, and that the
   diagonals stay on the device;
2. **host round trips per batch** (PyTorch): the calls that return a device value to the
   host (``.item()``, ``bool()``, ``.cpu()``, ``.numpy()``, ``.tolist()``, counted by a
   ``TorchFunctionMode``) in analyses of two batches and of four (both read the deferred
   checks once after the loop), so the count per batch is their difference over two: 0 on a
   CUDA device with the batch on it (the value checks of every batch after the first are read
   after the loop, the labels copied to pinned memory without waiting); a CPU dry run counts
   the data contract's checks of the inputs and labels, host tensors there;
3. **JAX** and **Keras** (TensorFlow backend), when installed: every estimator in float32 on
   the framework's default device (its GPU) against float64 (JAX: on its CPU, ``dtype="float64"``;
   Keras: a float64 copy of a CNN with BatchNormalization and max-pooling), and that the
   diagonals stay on the device;
4. the ratio tables of ``benchmarks/torch_diag.py`` (``--device``), ``benchmarks/classes.py``
   (``--device``, with ``--memory``) and ``benchmarks/jax_diag.py`` (JAX's default device).

Run (on a machine with a GPU; ``--quick`` for the checks and two rounds of the tables)::

    python -m benchmarks.device [--device cuda] [--quick]

Only ``array-api-compat`` (pure Python) must be added to an image that has torch and JAX.
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import normflat

ESTIMATORS = ("ggn", "ggn-topk", "ggn-mc", "exact", "hutchinson")
#: Tensor methods that wait for the device and copy to the host.
HOST_CALLS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"})


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 7), nn.Tanh(), nn.Linear(7, 5))


def _cnn() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(4, 3, 3, groups=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 2 * 2, 5))
    with torch.no_grad():
        bn = model[1]
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 1.5)
    return model


def _lm() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=13, n_positions=8, n_embd=8, n_layer=1, n_head=2))


def _cases() -> dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Any]]]:
    def images(g):
        return torch.randn(6, 2, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)

    def vectors(g):
        return torch.randn(6, 6, generator=g), torch.randint(0, 5, (6,), generator=g)

    def tokens(g):
        ids = torch.randint(0, 13, (3, 5), generator=g)
        return {"input_ids": ids, "labels": ids}

    cases = {"mlp": (_mlp, vectors), "cnn": (_cnn, images)}
    try:
        import transformers  # noqa: F401

        cases["gpt2"] = (_lm, tokens)
    except ImportError:
        pass
    return cases


def _to(data: Any, device: str, dtype: torch.dtype | None = None) -> Any:
    if isinstance(data, dict):
        return {k: _to(v, device, dtype) for k, v in data.items()}
    if isinstance(data, (tuple, list)):
        return type(data)(_to(v, device, dtype) for v in data)
    if dtype is not None and data.is_floating_point():
        data = data.to(dtype)
    return data.to(device)


def precision_checks(device: str) -> list[tuple[str, str, float, bool]]:
    """``(case, estimator, largest difference / largest entry, diagonal on the device)``."""
    rows = []
    for name, (factory, make_data) in _cases().items():
        torch.manual_seed(0)
        reference_model = factory().double().eval()
        model = factory().eval()
        model.load_state_dict({k: v.float() if v.is_floating_point() else v
                               for k, v in reference_model.state_dict().items()})
        model = model.to(device)
        data = make_data(torch.Generator().manual_seed(1))
        for estimator in ESTIMATORS:
            if estimator == "exact" and name == "gpt2":
                continue  # one Hessian-vector product per weight: too many for this check's budget
            options = {"estimator": estimator, "progress": False}
            if estimator in ("ggn-mc", "hutchinson"):
                options["samples"] = 4
            ref = normflat.hessian_diagonal(reference_model, _to(data, "cpu", torch.float64), **options)
            got = normflat.hessian_diagonal(model, _to(data, device), **options)
            scale = max(float(v.abs().max()) for v in ref.values())
            worst = max(float((got[k].double().cpu() - ref[k]).abs().max()) for k in ref) / scale
            on_device = all(v.device.type == torch.device(device).type for v in got.values())
            rows.append((name, estimator, worst, on_device))
    return rows


class HostCalls(TorchFunctionMode):
    """Counts, by name, the :data:`HOST_CALLS` made while the mode is active.

    Shared with ``tests/backends/test_torch.py::test_no_host_round_trip_per_batch``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_CALLS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def host_calls_per_batch(device: str, estimator: str = "ggn") -> dict[str, float]:
    """Host round trips per batch of ``estimator`` on the CNN, from analyses of two and of four
    batches (both read the deferred checks once, after the loop)."""
    factory, make_data = _cases()["cnn"]
    torch.manual_seed(0)
    model = factory().eval().to(device)
    batch = _to(make_data(torch.Generator().manual_seed(1)), device)
    totals = {}
    for batches in (2, 4):
        mode = HostCalls()
        with mode:
            normflat.hessian_diagonal(model, [batch] * batches, estimator=estimator, progress=False)
        totals[batches] = sum(mode.count.values())
    return {"per batch": (totals[4] - totals[2]) / 2, "two batches with the set-up": totals[2]}


def jax_check() -> str:
    """Every estimator on the MLP and the token-logit estimators on a small LM (per sequence, in
    steps, per token), float32 on JAX's default device against float64 on its CPU (the ``dtype``
    option), or why it did not run."""
    try:
        import jax
        from flax import nnx
    except ImportError as why:
        return f"JAX not run ({why})"

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(6, 8, rngs=rngs), nnx.Linear(8, 5, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.tanh(self.a(x)))

    class LM(nnx.Module):  # token logits (n, T, 50)
        def __init__(self, rngs):
            self.emb, self.head = nnx.Embed(50, 8, rngs=rngs), nnx.Linear(8, 50, rngs=rngs)

        def __call__(self, ids):
            return self.head(nnx.tanh(self.emb(ids)))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 6)).astype(np.float32), rng.integers(0, 5, 6)
    ids = rng.integers(0, 50, (3, 6))
    next_ids = np.concatenate([ids[:, 1:], np.full((3, 1), -100)], axis=1)
    # Every estimator on the MLP; on the LM the per-sequence ggn-topk (auto's), also with one
    # example's signals in steps (a small memory_budget: the lax.scan path), and the per-token ggn.
    cases = [("mlp", MLP, (x, y), {"estimator": estimator, **_samples(estimator)}) for estimator in ESTIMATORS]
    cases += [("lm", LM, (ids, next_ids), options) for options in (
        {"estimator": "ggn-topk", "loss": "ce"}, {"estimator": "ggn-topk", "loss": "ce", "memory_budget": "64KB"},
        {"estimator": "ggn", "loss": "ce"})]
    default = jax.devices()[0]
    rows = []
    for name, make, data, options in cases:
        options = {"progress": False, **options}
        with jax.default_device(jax.devices("cpu")[0]):
            ref = {k: np.asarray(v, np.float64) for k, v in normflat.hessian_diagonal(
                make(nnx.Rngs(0)), data, dtype="float64", **options).items()}
        with jax.default_device(default):
            got = normflat.hessian_diagonal(make(nnx.Rngs(0)), data, **options)
            on_device = all(d.platform == default.platform for v in got.values() for d in v.devices())
        scale = max(float(np.abs(v).max()) for v in ref.values())
        worst = max(float(np.abs(np.asarray(got[k], np.float64) - ref[k]).max()) for k in ref) / scale
        label = options["estimator"] + (f", memory_budget={options['memory_budget']}" if "memory_budget" in options
                                        else "")
        rows.append(f"| {name} | {label} | {worst:.1e} | {'yes' if on_device else 'NO'} |")
    head = f"JAX {jax.__version__} on {default} (float32) against float64 on its CPU:"
    return "\n".join([head, "| model | estimator | difference | diagonal on the device |", "|---|---|---|---|", *rows])


def _samples(estimator: str) -> dict[str, int]:
    return {"samples": 4} if estimator in ("ggn-mc", "hutchinson") else {}


def keras_check() -> str:
    """Every estimator on a Keras CNN (Conv2D, BatchNormalization, max-pooling, Dense; TensorFlow
    backend), float32 where TensorFlow places it (its GPU when it has one) against a float64 copy
    with the same weights, or why it did not run."""
    import os

    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")  # beside torch and JAX on one device
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    try:
        import keras
        import tensorflow as tf
    except ImportError as why:
        return f"Keras not run ({why})"
    if keras.backend.backend() != "tensorflow":
        return f"Keras not run (backend {keras.backend.backend()!r}, not tensorflow)"

    def cnn(dtype):
        layers = keras.layers
        inputs = keras.Input((8, 8, 2))
        h = layers.Conv2D(4, 3, padding="same", dtype=dtype, name="conv1")(inputs)
        h = layers.BatchNormalization(dtype=dtype, name="bn")(h)
        h = layers.MaxPooling2D(2, dtype=dtype)(layers.ReLU(dtype=dtype)(h))
        h = layers.Conv2D(3, 3, dtype=dtype, name="conv2")(h)
        h = layers.Flatten(dtype=dtype)(layers.ReLU(dtype=dtype)(h))
        return keras.Model(inputs, layers.Dense(5, dtype=dtype, name="head")(h))

    keras.utils.set_random_seed(0)
    reference_model, model = cnn("float64"), cnn("float32")
    rng = np.random.default_rng(2)
    for v64, v32 in zip(reference_model.weights, model.weights):
        value = rng.normal(size=v64.shape) * 0.5 if "variance" not in v64.path else rng.uniform(0.5, 1.5, v64.shape)
        v64.assign(value)
        v32.assign(value.astype(np.float32))
    x, y = rng.normal(size=(6, 8, 8, 2)), rng.integers(0, 5, 6)
    gpu = bool(tf.config.list_physical_devices("GPU"))
    rows = []
    for estimator in ESTIMATORS:
        options = {"estimator": estimator, "progress": False, **_samples(estimator)}
        ref = {k: np.asarray(v, np.float64) for k, v in normflat.hessian_diagonal(
            reference_model, (x, y), **options).items()}
        got = normflat.hessian_diagonal(model, (x.astype(np.float32), y), **options)
        on_device = all("GPU" in getattr(v, "device", "").upper() for v in got.values()) if gpu else True
        scale = max(float(np.abs(v).max()) for v in ref.values())
        worst = max(float(np.abs(np.asarray(got[k], np.float64) - ref[k]).max()) for k in ref) / scale
        rows.append(f"| cnn | {estimator} | {worst:.1e} | {'yes' if on_device else 'NO'} |")
    head = (f"Keras {keras.__version__} / TensorFlow {tf.__version__} on {'its GPU' if gpu else 'the CPU'} "
            "(float32) against float64:")
    return "\n".join([head, "| model | estimator | difference | diagonal on the device |", "|---|---|---|---|", *rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="the checks, then two rounds of each table")
    parser.add_argument("--no-tables", action="store_true", help="the checks only")
    args = parser.parse_args(argv)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"torch {torch.__version__} on {args.device} ({name}), normflat {normflat.__version__}")
    start = time.perf_counter()
    print("\nfloat32 on the device against float64 on the CPU (largest difference / largest entry):")
    print("| model | estimator | difference | diagonal on the device |\n|---|---|---|---|")
    for model, estimator, worst, on_device in precision_checks(args.device):
        print(f"| {model} | {estimator} | {worst:.1e} | {'yes' if on_device else 'NO'} |", flush=True)
    print()
    for estimator in ("ggn", "ggn-topk", "hutchinson"):
        calls = host_calls_per_batch(args.device, estimator)
        print(f"host round trips ({estimator}, CNN): {calls['per batch']:.0f} per batch, "
              f"{calls['two batches with the set-up']} for two batches with the set-up and the final checks")
    print()
    print(jax_check())
    print()
    print(keras_check())
    print(f"(checks: {time.perf_counter() - start:.0f} s)")
    if args.no_tables:
        return
    rounds = ["--rounds", "2"] if args.quick else []
    from benchmarks import classes, torch_diag

    print()
    torch_diag.main(["--device", args.device, *(["--repeats", "2"] if args.quick else [])])
    print()
    classes.main(["--device", args.device, "--memory", "--no-accuracy", *rounds])
    try:
        from benchmarks import jax_diag
    except ImportError as why:
        print(f"jax_diag not run ({why})")
        return
    print()
    jax_diag.main(["--no-torch", *(["--repeats", "2"] if args.quick else [])])


if __name__ == "__main__":
    main()
