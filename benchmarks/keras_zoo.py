"""Model zoo, Keras: which weights of keras-hub's and keras.applications' architectures normflat
analyzes, and on which path.

Builds each architecture from a small config with random weights (no downloads): keras-hub text
classifiers, masked and causal language models, sequence-to-sequence models and image classifiers
(``preprocessor=None``, token ids drawn at random, next-token labels for the language models), and
``keras.applications`` at 32×32 (their own least size where they need more). For each,
``normflat.analyze`` with the defaults on two batches (of 2 and 3 samples), then prints the analyzed
fraction of the weight matrices (``coverage``), the layer classes skipped for want of an extractor
(with a warning), the layers on the fast and the generic path with the generic paths' reasons, and,
with ``--check``, the largest difference between the fast and the generic path's GGN diagonal
(relative to each tensor's largest entry; float32, so about 1e-6 is agreement). Models whose
random-init logits are (nearly) equal across classes are analyzed with ``loss="ce"`` (``nsce``
refuses them, as it should). The same table as ``benchmarks/zoo.py`` gives for PyTorch.

Run::

    python -m benchmarks.keras_zoo [--family hub applications] [--check] [--models NAME ...]

A table, not a timing: the seconds are one analysis on two small batches (the first, so with the
tracing of its compiled steps), for orientation only.
"""

from __future__ import annotations

import argparse
import os
import re
import warnings
from typing import Any, Callable

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
from benchmarks._common import ZOO_HEADER, zoo_row  # noqa: E402

__all__ = ["APPLICATIONS", "hub_models", "survey", "main"]

#: ``keras.applications`` models and their input size (``weights=None``, 3 classes).
APPLICATIONS = (
    ("MobileNetV2", 32), ("MobileNetV3Small", 32), ("EfficientNetB0", 32), ("EfficientNetV2B0", 32),
    ("NASNetMobile", 32), ("DenseNet121", 32), ("ResNet50V2", 32), ("InceptionV3", 75), ("InceptionResNetV2", 75),
    ("VGG16", 32), ("Xception", 71), ("ConvNeXtTiny", 32),
)

_VOCABULARY = 60


def _ids(rng: np.random.Generator, n: int, tokens: int = 8) -> np.ndarray:
    return rng.integers(1, _VOCABULARY, (n, tokens)).astype("int32")


def hub_models() -> dict[str, Callable[[], tuple[Any, Callable[[int], Any]]]]:
    """keras-hub architectures from tiny configs: ``name -> () -> (model, n -> batch)``."""
    import keras_hub

    M = keras_hub.models
    rng = np.random.default_rng(0)
    text = dict(vocabulary_size=_VOCABULARY, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
                max_sequence_length=16)
    decoder = dict(vocabulary_size=_VOCABULARY, num_layers=1, num_query_heads=2, num_key_value_heads=1,
                   hidden_dim=16, intermediate_dim=32)

    def inputs(model: Any, ids: np.ndarray) -> dict:
        x = {"token_ids": ids, "padding_mask": np.ones_like(ids), "segment_ids": np.zeros_like(ids)}
        return {k: v for k, v in x.items() if k in model.input}

    def classifier(make: Callable[[], Any]) -> Callable[[], tuple[Any, Callable[[int], Any]]]:
        def build():
            model = make()
            return model, lambda n: (inputs(model, _ids(rng, n)), rng.integers(0, 3, n))
        return build

    def masked(make: Callable[[], Any]) -> Callable[[], tuple[Any, Callable[[int], Any]]]:
        def build():
            model = make()

            def batch(n: int) -> tuple[dict, np.ndarray]:
                x = inputs(model, _ids(rng, n))
                x["mask_positions"] = np.stack([rng.choice(8, 2, replace=False) for _ in range(n)]).astype("int32")
                return x, rng.integers(1, _VOCABULARY, (n, 2))
            return model, batch
        return build

    def causal(make: Callable[[], Any]) -> Callable[[], tuple[Any, Callable[[int], Any]]]:
        def build():
            model = make()

            def batch(n: int) -> tuple[dict, np.ndarray]:
                ids = _ids(rng, n)  # the labels shifted in the data, as keras-hub's preprocessors do
                return inputs(model, ids), np.concatenate([ids[:, 1:], np.full((n, 1), -100)], axis=1)
            return model, batch
        return build

    def seq2seq(make: Callable[[], Any]) -> Callable[[], tuple[Any, Callable[[int], Any]]]:
        def build():
            model = make()

            def batch(n: int) -> tuple[dict, np.ndarray]:
                enc, dec = _ids(rng, n), _ids(rng, n, 6)
                x = {"encoder_token_ids": enc, "encoder_padding_mask": np.ones_like(enc), "decoder_token_ids": dec,
                     "decoder_padding_mask": np.ones_like(dec)}
                return x, np.concatenate([dec[:, 1:], np.full((n, 1), -100)], axis=1)
            return model, batch
        return build

    def images(make: Callable[[], Any], size: int = 32) -> Callable[[], tuple[Any, Callable[[int], Any]]]:
        def build():
            model = make()
            return model, lambda n: (rng.normal(size=(n, size, size, 3)).astype("float32"), rng.integers(0, 3, n))
        return build

    def text_classifier(name: str, **extra: Any) -> Callable[[], Any]:
        return lambda: getattr(M, f"{name}TextClassifier")(getattr(M, f"{name}Backbone")(**{**text, **extra}),
                                                           num_classes=3, preprocessor=None)

    def masked_lm(name: str, **extra: Any) -> Callable[[], Any]:
        return lambda: getattr(M, f"{name}MaskedLM")(getattr(M, f"{name}Backbone")(**{**text, **extra}),
                                                     preprocessor=None)

    def causal_lm(name: str, config: dict) -> Callable[[], Any]:
        return lambda: getattr(M, f"{name}CausalLM")(backbone=getattr(M, f"{name}Backbone")(**config),
                                                     preprocessor=None)

    def image_classifier(name: str, **config: Any) -> Callable[[], Any]:
        return lambda: getattr(M, f"{name}ImageClassifier")(getattr(M, f"{name}Backbone")(**config), num_classes=3,
                                                            preprocessor=None)

    gpt = dict(text)
    moe = dict(decoder, num_experts=4, top_k=2)
    return {
        "BERT classifier": classifier(text_classifier("Bert")),
        "DistilBERT classifier": classifier(text_classifier("DistilBert")),
        "RoBERTa classifier": classifier(text_classifier("Roberta")),
        "ALBERT classifier": classifier(text_classifier("Albert", embedding_dim=16, num_groups=1,
                                                        num_inner_repetitions=1)),
        "DeBERTa-v3 classifier": classifier(text_classifier("DebertaV3", bucket_size=4)),
        "FNet classifier": classifier(lambda: M.FNetTextClassifier(M.FNetBackbone(
            vocabulary_size=_VOCABULARY, num_layers=1, hidden_dim=16, intermediate_dim=32, max_sequence_length=16),
            num_classes=3, preprocessor=None)),
        "RoFormerV2 classifier": classifier(lambda: M.RoformerV2TextClassifier(M.RoformerV2Backbone(
            vocabulary_size=_VOCABULARY, num_layers=1, num_heads=2, head_size=8, hidden_dim=16, intermediate_dim=32),
            num_classes=3, preprocessor=None)),
        "ESM-2 protein classifier": classifier(lambda: M.ESMProteinClassifier(M.ESM2Backbone(
            vocabulary_size=_VOCABULARY, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32),
            num_classes=3, preprocessor=None)),
        "BERT masked LM": masked(masked_lm("Bert")),
        "DeBERTa-v3 masked LM": masked(masked_lm("DebertaV3", bucket_size=4)),
        "GPT-2": causal(causal_lm("GPT2", gpt)),
        "GPT-NeoX": causal(causal_lm("GPTNeoX", gpt)),
        "Llama 3": causal(causal_lm("Llama3", decoder)),
        "Mistral": causal(causal_lm("Mistral", decoder)),
        "Gemma": causal(causal_lm("Gemma", dict(decoder, head_dim=8))),
        "Gemma 3": causal(causal_lm("Gemma3", dict(decoder, head_dim=8, image_size=None))),
        "Phi-3": causal(causal_lm("Phi3", decoder)),
        "Qwen2": causal(causal_lm("Qwen2", decoder)),
        "Qwen3": causal(causal_lm("Qwen3", dict(decoder, head_dim=8))),
        "Qwen3.5 (linear attention)": causal(causal_lm("Qwen3_5", dict(
            decoder, num_layers=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8))),
        "Falcon": causal(causal_lm("Falcon", dict(vocabulary_size=_VOCABULARY, num_layers=1, num_attention_heads=2,
                                                   hidden_dim=16, intermediate_dim=32))),
        "OPT": causal(causal_lm("OPT", gpt)),
        "Bloom": causal(causal_lm("Bloom", dict(vocabulary_size=_VOCABULARY, num_layers=1, num_heads=2,
                                                 hidden_dim=16, intermediate_dim=32))),
        "Mixtral": causal(causal_lm("Mixtral", dict(decoder, num_experts=4, top_k=2))),
        "Qwen-MoE": causal(causal_lm("QwenMoe", dict(decoder, num_experts=4, top_k=2, moe_intermediate_dim=16,
                                                      shared_expert_intermediate_dim=16))),
        "GPT-OSS": causal(causal_lm("GptOss", dict(moe, head_dim=8))),
        "RWKV-7": causal(causal_lm("RWKV7", dict(vocabulary_size=_VOCABULARY, num_layers=2, hidden_size=16,
                                                  head_size=8, intermediate_dim=32, gate_lora=4, mv_lora=4,
                                                  aaa_lora=4, decay_lora=4))),
        "BART": seq2seq(lambda: M.BartSeq2SeqLM(M.BartBackbone(**text), preprocessor=None)),
        "T5": seq2seq(lambda: M.T5Seq2SeqLM(M.T5Backbone(
            vocabulary_size=_VOCABULARY, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32),
            preprocessor=None)),
        "ViT": images(image_classifier("ViT", image_shape=(32, 32, 3), patch_size=8, num_layers=1, num_heads=2,
                                       hidden_dim=16, mlp_dim=32)),
        "DeiT": images(image_classifier("DeiT", image_shape=(32, 32, 3), patch_size=8, num_layers=1, num_heads=2,
                                        hidden_dim=16, intermediate_dim=32)),
        "DenseNet": images(image_classifier("DenseNet", stackwise_num_repeats=[1, 1], image_shape=(32, 32, 3),
                                            growth_rate=8, compression_ratio=0.5)),
        "Xception (keras-hub)": images(image_classifier(
            "Xception", stackwise_conv_filters=[[8, 16], [16, 16]], stackwise_pooling=[True, False],
            image_shape=(32, 32, 3))),
        "MiT (SegFormer encoder)": images(image_classifier(
            "MiT", layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2], layerwise_sr_ratios=[2, 1],
            max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3], layerwise_strides=[4, 2],
            image_shape=(32, 32, 3), hidden_dims=[8, 16])),
        "Swin Transformer": images(image_classifier(
            "SwinTransformer", image_shape=(32, 32, 3), embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=4,
            patch_size=2, drop_path=0.0)),
        "HGNetV2": images(image_classifier(
            "HGNetV2", depths=[1, 1], embedding_size=8, hidden_sizes=[16, 16], stem_channels=[3, 8, 8],
            hidden_act="relu", use_learnable_affine_block=False,
            stackwise_stage_filters=[[8, 8, 16, 1, 2, 3], [16, 8, 16, 1, 2, 3]], apply_downsample=[False, True],
            use_lightweight_conv_block=[False, True], image_shape=(32, 32, 3))),
    }


def _application(name: str, size: int) -> tuple[Any, Callable[[int], Any]]:
    import keras

    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=3)
    rng = np.random.default_rng(0)
    # Inputs in [-1, 1]: a random network on raw 0-255 pixels saturates its softmax (every curvature 0).
    return model, lambda n: (rng.uniform(-1, 1, (n, size, size, 3)).astype("float32"), rng.integers(0, 3, n))


def survey(name: str, build: Callable[[], tuple[Any, Callable[[int], Any]]], check: bool) -> str:
    """One table row for the model ``build()`` makes (its errors, too: the row says what failed;
    :func:`benchmarks._common.zoo_row`), its random weights drawn from Keras' seed 0."""
    import keras

    def seeded():
        keras.utils.set_random_seed(0)
        return build()

    # One reason per layer class: "applies its own w1", "... w2": "its own weights".
    return zoo_row(name, seeded, check, parameters=lambda model: f"{model.count_params() / 1e3:.1f}k",
                   largest=lambda a: float(np.abs(np.asarray(a)).max()),
                   reason=lambda r: re.sub(r"its own \w+", "its own weights", r))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", default=["hub", "applications"], choices=["hub", "applications"])
    parser.add_argument("--check", action="store_true", help="fast against generic path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="*", default=None, metavar="NAME", help="only these rows (names as in the table)")
    args = parser.parse_args(argv)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    warnings.filterwarnings("ignore")
    print("\n".join(ZOO_HEADER))
    if "hub" in args.family:
        for name, build in hub_models().items():
            if args.models is None or name in args.models:
                print(survey(name, build, args.check), flush=True)
    if "applications" in args.family:
        for name, size in APPLICATIONS:
            if args.models is None or name in args.models:
                print(survey(name, lambda name=name, size=size: _application(name, size), args.check), flush=True)


if __name__ == "__main__":
    main()
