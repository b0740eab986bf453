"""Benchmark: a keras-hub language model with LoRA adapters against the same model without them.

keras-hub's LoRA recipe (``backbone.enable_lora(rank)``) makes every query and value projection
compute its kernel as ``W + (α/r)·A·B`` in its call (method §3 and §6.1, "LoRA adapters"). The
figures printed are ``normflat.analyze`` (default estimator, ``loss="ce"``) on the model with and
without the adapters, as multiples of one gradient of the plain model's mean loss over all its
weights (a full fine-tuning step's gradient) on the same batch, and the weights on each path.

Problem: ``keras_hub.models.LlamaCausalLM`` from a config (4 layers, width 128, 4 query and 2
key-value heads, MLP width 256, vocabulary 5,000; float32, random init), 16 sequences of 64 random
tokens, next-token labels; the adapters of rank 4 with their ``B`` drawn away from zero. Each figure
is the minimum over ``--rounds`` interleaved rounds after a warm-up call (the tracing), one thread
by default.

``python -m benchmarks.keras_lora [--rounds 5] [--threads 1]``
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks._common import time_rounds  # noqa: E402

__all__ = ["lora_figures", "main"]

VOCABULARY, SEQUENCES, TOKENS, RANK = 5000, 16, 64, 4


def _model(lora: bool) -> Any:
    """The causal LM (Keras' seed 0), with rank-:data:`RANK` adapters whose ``B`` is drawn."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=VOCABULARY, num_layers=4, num_query_heads=4,
                                              hidden_dim=128, intermediate_dim=256, num_key_value_heads=2)
    model = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    if lora:
        backbone.enable_lora(RANK)
        rng = np.random.default_rng(1)
        for v in model.weights:
            if "lora_kernel_b" in v.path:
                v.assign(0.02 * rng.normal(size=v.shape).astype("float32"))
    return model


def _data() -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCABULARY, (SEQUENCES, TOKENS)).astype("int32")
    labels = np.concatenate([ids[:, 1:], np.full((SEQUENCES, 1), -100)], axis=1)
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, labels


def _gradient(model: Any, x: Any, y: np.ndarray) -> Callable[[], Any]:
    """One compiled gradient of the mean cross-entropy over the counted tokens, every weight."""
    import tensorflow as tf

    weights = [v.value for v in model.weights]
    counted = tf.constant(y >= 0, tf.float32)
    labels = tf.constant(np.maximum(y, 0))

    @tf.function
    def gradient():
        with tf.GradientTape() as tape:
            tape.watch(weights)
            logits = tf.cast(model(x, training=False), tf.float32)
            ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
            loss = tf.reduce_sum(ce * counted) / tf.reduce_sum(counted)
        return tape.gradient(loss, weights)

    return gradient


def lora_figures(rounds: int = 5) -> dict[str, Any]:
    """``{"gradient": s, "plain": s, "lora": s, "paths": {model: {path: weights}}}``: minima over the rounds."""
    import normflat

    x, y = _data()
    models = {"plain": _model(False), "lora": _model(True)}
    runs = {"gradient": _gradient(models["plain"], x, y)}
    for name, model in models.items():
        runs[name] = lambda model=model: normflat.analyze(model, [(x, y)], loss="ce", progress=False)
    times = {name: min(t) for name, t in time_rounds(runs, rounds).items()}
    paths = {}
    for name, model in models.items():
        report = normflat.analyze(model, [(x, y)], loss="ce", progress=False)
        counts: dict[str, int] = {}
        for layer in report.layers:
            counts[layer.details["path"]] = counts.get(layer.details["path"], 0) + 1
        paths[name] = counts
    return {**times, "paths": paths}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    figures = lora_figures(args.rounds)
    print(f"one gradient of the plain model: {figures['gradient']:.3f} s")
    print("| model | weights by path | `analyze` (s) | × gradient |")
    print("|---|---|---|---|")
    for name in ("plain", "lora"):
        paths = ", ".join(f"{count} {path}" for path, count in sorted(figures["paths"][name].items()))
        print(f"| {name} | {paths} | {figures[name]:.2f} | {figures[name] / figures['gradient']:.1f} |")
    print(f"LoRA / plain: {figures['lora'] / figures['plain']:.2f}")
    return figures


if __name__ == "__main__":
    main()
