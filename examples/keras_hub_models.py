"""Normalized sharpness of keras-hub and keras.applications models built from configs (no downloads).

A tiny BERT classifier (keyword batch of named inputs), a tiny GPT-2 causal
language model (token logits, tied embedding, padding marked with
``ignore_index``) and MobileNetV2 at 32×32, all randomly initialized, each
analyzed on one small random batch. Runs in well under 30 s on a CPU:

    python examples/keras_hub_models.py
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import normflat  # noqa: E402


def summary(title: str, report: normflat.Report) -> None:
    meta = report.metadata
    print(f"{title}: {len(report.layers)} matrices, coverage {meta['coverage']:.3f}, "
          f"loss terms {meta['loss_terms']}, normalized sharpness {report.normalized_sharpness:.4g}")
    for layer in report.layers[:4]:
        print(f"    {layer.name:<60} {str(layer.shape):<10} NS {layer.normalized_sharpness:.4g}")


def main() -> None:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)

    # BERT from a config: a mapping batch holds the backbone's named inputs and the labels.
    bert = keras_hub.models.BertTextClassifier(
        keras_hub.models.BertBackbone(vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16,
                                      intermediate_dim=32, max_sequence_length=16),
        num_classes=2, preprocessor=None)
    batch = {"token_ids": rng.integers(0, 50, (4, 8)).astype("int32"),
             "segment_ids": np.zeros((4, 8), "int32"),
             "padding_mask": np.ones((4, 8), "int32"),
             "labels": np.array([0, 1, 1, 0])}
    # Random weights give nearly equal logits, for which the normalized loss is ill-posed: use "ce".
    summary("BERT classifier", normflat.analyze(bert, batch, loss="ce", progress=False))

    # GPT-2 from a config: token logits (batch, T, vocabulary); the labels are the next tokens,
    # shifted in the data as keras-hub's preprocessor does, padding set to ignore_index.
    gpt2 = keras_hub.models.GPT2CausalLM(
        keras_hub.models.GPT2Backbone(vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16,
                                      intermediate_dim=32, max_sequence_length=16),
        preprocessor=None)
    ids = rng.integers(0, 50, (2, 8)).astype("int32")
    mask = np.array([[1] * 8, [1] * 5 + [0] * 3], "int32")
    labels = np.concatenate([ids[:, 1:], np.zeros((2, 1), "int64")], axis=1)
    labels[np.concatenate([mask[:, 1:], np.zeros((2, 1), "int32")], axis=1) == 0] = -100
    summary("GPT-2 causal LM", normflat.analyze(gpt2, ({"token_ids": ids, "padding_mask": mask}, labels),
                                                loss="ce", estimator="ggn-mc", samples=1, progress=False))

    # keras.applications with weights=None at 32×32.
    mobilenet = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10)
    images = rng.uniform(0, 255, (2, 32, 32, 3)).astype("float32")
    summary("MobileNetV2", normflat.analyze(mobilenet, (images, np.array([3, 7])), loss="ce",
                                            estimator="ggn-mc", samples=1, progress=False))


if __name__ == "__main__":
    main()
