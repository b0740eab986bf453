"""Benchmark: the cost of the GGN diagonal as the number of classes grows, and the accuracy of ``auto``.

For each problem (float32, random data, one batch, BatchNorm in eval mode) the
script times, interleaved, one gradient of the mean cross-entropy, normflat's
``hessian_diagonal`` with the default ``estimator="auto"`` (``ggn-topk`` above 25
classes, method §6.2; only the mean, so its group sums are pooled), the whole
``normflat.analyze`` report with the defaults (standard errors, the solver and the
measures), the exact ``ggn``, ``ggn-mc`` with one draw and, where BackPACK runs, BackPACK's
``DiagGGNExact`` and ``DiagGGNMC`` (one draw); it prints each as a multiple of the gradient (minimum over the
rounds: the machine is shared). Then it measures the accuracy of ``auto``
against the exact ``ggn``: every layer's normalized sharpness, its relative
error, the reported standard error and their ratio. With ``--memory`` it also
prints the peak resident memory that ``auto``, ``analyze`` and ``ggn`` (default options) add
to the model and its batch, next to that of a training step (forward, backward,
SGD with momentum: activations, gradients and the momentum buffers), each in a
fresh process.

Problems:

* ``mlp-10`` / ``mlp-1000``: 784-512-256-C ReLU MLP, batch 128;
* ``3c3d-100``: the DeepOBS 3C3D CNN with 100 classes, batch 32;
* ``resnet18-10`` / ``resnet18-1000``: torchvision ``resnet18`` (random init) on
  32×32 images, batch 16;
* ``vit-1000``: timm ``vit_tiny_patch16_224`` at 32×32 with 4×4 patches, 1000 classes, batch 16
  (its exact ``ggn``, 999 signals through 12 blocks, is not run);
* ``gpt2-5000``: a 2-layer GPT-2 (width 64) with a 5000-token vocabulary, 4 sequences of 32
  tokens with ``labels = input_ids`` (its exact ``ggn`` needs 32 · 4999 signals per sequence
  and is not run). Its ``auto`` and ``ggn-mc`` back-propagate one signal per sequence (method
  §6.3); the "per token" column is ``auto`` with ``sequence_signals=False``, one signal per
  token, and the accuracy table compares the two (no exact reference: the difference over
  the combined standard error).
* ``gpt2-untied-50000``: the same GPT-2 with a 50000-token vocabulary and its own head (not
  tied to the token embedding: a dense head whose output is the logits), 2 sequences of 128
  tokens (no "per token" column).
* ``lstm-10`` / ``gru-10``: a sequence classifier (a 2000-token embedding of width 64, one
  ``nn.LSTM`` / ``nn.GRU`` layer of 128 units, the last step's state into a 10-class head), 32
  sequences of 32 tokens; the "generic path" column is the exact ``ggn`` with ``fast=False``,
  the recurrent weights' only path before their fast rules (method §6.1, "Recurrent weights").
* ``albert-10``: Hugging Face ALBERT (a 2000-token vocabulary, width 128, 4 layers that are one
  shared layer called 4 times, 10 classes), 16 sequences of 32 tokens; its "generic path" column
  (``fast=False``) stands for the path the shared layer's weights took before their calls were
  recorded one by one (method §6.1, "Tied weights").
* ``bit-10`` / ``nfnet-10`` / ``tf-efficientnet-10``: timm ``resnetv2_50x1_bit`` (BiT, every
  convolution weight-standardized), ``nf_resnet26`` (scaled weight standardization) and
  ``tf_efficientnet_b0`` (its strided convolutions pad their input "SAME" themselves), random init,
  32×32 images, batch 16, 10 classes; their "generic path" column (``fast=False``) is the path
  those convolutions took before their rules (method §6.1, "Weight-standardized and self-padded
  convolutions").
* ``tv-vit-10`` / ``transformer-10``: torchvision ``VisionTransformer`` (32×32 images, 4×4 patches,
  4 layers of width 128, 4 heads, MLP 256, batch 16) and a token classifier (a 2000-token
  embedding of width 128, ``nn.TransformerEncoder`` of 2 layers, 4 heads, MLP 256, the mean over
  32 tokens into a 10-class head, 32 sequences): their ``nn.MultiheadAttention`` projections,
  and the "generic path" column (``fast=False``) the path those took before their rule (method
  §6.1, "Attention projections applied functionally").
* ``wav2vec2-10``: Hugging Face wav2vec 2.0 (a feature encoder of 7 convolutions of 128 channels,
  4 layers of width 256, 4 heads, MLP 512), 4 clips of one second at 16 kHz, 10 classes: its
  positional convolution (128 taps, 16 groups) is weight-normalized per kernel position, and the
  "generic path" column (``fast=False``) the path its direction took before its rule (method
  §6.1, "Weight-normalized layers").
* ``swin-t-10`` / ``swin-v2-t-10``: torchvision ``swin_t`` and ``swin_v2_t`` (random init, 10
  classes), 8 images of 64×64: Swin V2's continuous position bias MLPs (two dense layers per
  block on a table of relative coordinates, the same for every sample) run on no batch axis
  (method §6.1, "Layers on no batch axis"); Swin V1 beside it has a bias table instead.
* ``transformer-seq-first-10``: ``transformer-10`` in PyTorch's tutorial layout, sequence first
  (``batch_first=False``, the ids transposed to ``(T, n)``): its embedding and dense layers see
  ``(T, n, d)`` (method §6.1, "A batch folded into the leading axis").
* ``transformer-padded-10``: ``transformer-10`` given a key padding mask (ids below 200, about
  one token in ten, taken for padding): its attention calls pass the mask, with
  ``need_weights=False`` (method §6.1, "Attention projections applied functionally").
* ``attention-weights-10``: two ``nn.MultiheadAttention`` blocks called with their defaults,
  ``attention(h, h, h)``: the attention weights returned (and discarded), which torch's function
  computes without the fused attention (method §6.1, "Attention projections applied
  functionally").
* ``transformer-causal-10``: ``transformer-10`` with a causal mask and ``is_causal=True`` (a
  decoder-only layout), the head on the last token: its attention calls pass the causal hint,
  with ``need_weights=False`` (method §6.1, "Attention projections applied functionally").
* ``deberta-v3-10``: Hugging Face DeBERTa-v3 (deberta-v3-base's attention settings: relative
  positions in 32 buckets, the query and key projections shared with the normalized relative
  embeddings; 4 layers of width 128, 4 heads, MLP 256, a 2000-token vocabulary, 10 classes), 16
  sequences of 32 tokens: each layer's query and key projections are also applied to the
  relative embeddings, with no batch axis, and the relative embeddings' weight is read as a
  tensor (method §6.1, "Layers on no batch axis"); its "generic path" column is ``fast=False``.
* ``bart-5000``: a BART encoder-decoder (2 + 2 layers, width 64) with a 5000-token vocabulary,
  4 sequences of 32 tokens fed ``labels = input_ids`` (the decoder reads them shifted right): its
  table is held by ``model.shared``, which never runs, and used by the encoder's and decoder's
  embeddings and the tied head.
* ``t5-5000``: a T5 encoder-decoder (2 + 2 layers, width 64, 4 heads, MLP 128) with a 5000-token
  vocabulary, 4 sequences of 32 tokens fed ``labels = input_ids``: its relative-position bias
  tables (``relative_attention_bias``) are excluded, not weight matrices (method §3).
* ``opt-5000``: a 2-layer OPT (width 64, MLP 256) with a 5000-token vocabulary, 4 sequences of
  32 tokens: its learned positions are an ``nn.Embedding`` subclass computing its ids from the
  attention mask (method §6.1, "Embeddings with their own forward").
* ``llama-5000`` / ``mixtral-5000``: a 2-layer Llama (width 64, MLP 256) and a 2-layer Mixtral
  (width 64, 8 experts of 128 units, two per token: the same active width) with a 5000-token
  vocabulary, 4 sequences of 32 tokens: the cost of the mixture-of-experts layers' rules
  against the dense MLP's.
* ``mamba-5000``: a 2-layer Mamba (width 64, 16 states, expansion 2, convolution of 4) with a
  5000-token vocabulary, 4 sequences of 32 tokens, on transformers' reference kernels (no
  ``mamba_ssm``): its causal convolutions and ``dt_proj`` are applied by the mixer itself
  (``F.conv1d``, ``dt_proj.weight @ x``; method §6.1, "Weights the model applies itself").

Run::

    python -m benchmarks.classes [--rounds 5] [--problems mlp-1000 resnet18-1000] [--threads 1] [--memory]
    python -m benchmarks.classes --problems resnet18-1000 --no-timing --samples 15 --top-classes 3 --seed 1
    python -m benchmarks.classes --problems mlp-1000 resnet18-1000 --no-timing --seeds 12
    python -m benchmarks.classes --problems resnet18-1000 --no-timing --seeds 6 --train-to 0.5
    python -m benchmarks.classes --problems mlp-10 3c3d-100 --no-accuracy --loader-batches 10
    python -m benchmarks.classes --device cuda --memory    # on a GPU: the same tables
"""

from __future__ import annotations

import argparse
import gc
import math
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

import normflat
from benchmarks._common import proc_status_kib, reset_peak_kib, time_rounds, value_from_fresh_process
from benchmarks.torch_diag import _runner as torch_diag_runner
from benchmarks.torch_diag import cnn_3c3d


def _mlp(classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                         nn.Linear(256, classes))


def _3c3d(classes: int) -> nn.Module:
    model = cnn_3c3d()
    model[-1] = nn.Linear(256, classes)
    return model


def _resnet18(classes: int) -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=classes)


def _vit(classes: int) -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                             num_classes=classes)


def _timm(name: str) -> Callable[[int], nn.Module]:
    def build(classes: int) -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=classes)
    return build


class _RecurrentClassifier(nn.Module):
    """Token ids -> embedding (2000 × 64) -> one recurrent layer of 128 units -> the last step's
    state -> dense head."""

    def __init__(self, cell: type, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(SEQUENCE_VOCABULARY, 64)
        self.rnn = cell(64, 128, batch_first=True)
        self.head = nn.Linear(128, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


def _lstm(classes: int) -> nn.Module:
    return _RecurrentClassifier(nn.LSTM, classes)


def _gru(classes: int) -> nn.Module:
    return _RecurrentClassifier(nn.GRU, classes)


class _TransformerClassifier(nn.Module):
    """Token ids -> embedding (2000 × 128) -> ``nn.TransformerEncoder`` (2 layers, 4 heads, MLP
    256, no dropout) -> mean over the tokens -> dense head; ``batch_first=False``: the same in
    PyTorch's tutorial layout, sequence first (the ids transposed to ``(T, n)``)."""

    def __init__(self, classes: int, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(SEQUENCE_VOCABULARY, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.batch_first:
            return self.head(self.encoder(self.embed(ids)).mean(1))
        return self.head(self.encoder(self.embed(ids.t())).mean(0))


def _sequence_first_classifier(classes: int) -> nn.Module:
    return _TransformerClassifier(classes, batch_first=False)


class _PaddedClassifier(_TransformerClassifier):
    """``transformer-10`` given a key padding mask (the tokens with ids below 200, about one in ten,
    taken for padding), as ``nn.TransformerEncoder`` is with ``src_key_padding_mask``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=ids < 200).mean(1))


class _CausalClassifier(_TransformerClassifier):
    """``transformer-10`` with a causal mask, each token attending to itself and those before it
    (a decoder-only model's layout), as ``nn.TransformerEncoder`` is given
    ``mask=nn.Transformer.generate_square_subsequent_mask(T), is_causal=True``; the head reads the
    last token."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=self.head.weight.dtype,
                                                                device=ids.device)
        return self.head(self.encoder(self.embed(ids), mask=causal, is_causal=True)[:, -1])


class _AttentionCalledPlainly(nn.Module):
    """Token ids -> embedding (2000 × 128) -> two blocks of ``nn.MultiheadAttention`` (4 heads)
    called as ``attention(h, h, h)``, its defaults (the attention weights returned, averaged over
    the heads, and discarded by the model), a residual and a tanh -> mean over the tokens -> dense
    head: the call most hand-written models make."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(SEQUENCE_VOCABULARY, 128)
        self.blocks = nn.ModuleList(nn.MultiheadAttention(128, 4, batch_first=True) for _ in range(2))
        self.head = nn.Linear(128, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for attention in self.blocks:
            a, _ = attention(h, h, h)
            h = torch.tanh(h + a)
        return self.head(h.mean(1))


def _torchvision_vit(classes: int) -> nn.Module:
    import torchvision

    model = torchvision.models.VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4,
                                                 hidden_dim=128, mlp_dim=256, num_classes=classes)
    nn.init.normal_(model.heads.head.weight, std=0.02)  # zero-initialized: equal logits (an untrained head)
    return model


def _torchvision_swin(name: str) -> Callable[[int], nn.Module]:
    def make(classes: int) -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, num_classes=classes)
    return make


class _DebertaV3(nn.Module):
    """Hugging Face DeBERTa-v3 for sequence classification (deberta-v3's attention settings: relative
    positions in buckets, the query and key projections shared with the normalized relative
    embeddings; 4 layers of width 128, 4 heads, MLP 256, a 2000-token vocabulary), the logits of
    token ids."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        from transformers import DebertaV2Config, DebertaV2ForSequenceClassification
        config = DebertaV2Config(vocab_size=SEQUENCE_VOCABULARY, hidden_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, intermediate_size=256, max_position_embeddings=64,
                                 relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"],
                                 share_att_key=True, norm_rel_ebd="layer_norm", num_labels=classes)
        self.inner = DebertaV2ForSequenceClassification(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids).logits


class _Wav2Vec2(nn.Module):
    """Hugging Face wav2vec 2.0 for audio classification (a 7-layer feature encoder of 128 channels,
    4 transformer layers of width 256, its 128-tap positional convolution in 16 groups
    weight-normalized per kernel position), the logits of raw audio."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification
        config = Wav2Vec2Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
                                num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16,
                                conv_dim=(128,) * 7, classifier_proj_size=64, num_labels=classes)
        self.inner = Wav2Vec2ForSequenceClassification(config)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return self.inner(audio).logits


class _Albert(nn.Module):
    """Hugging Face ALBERT for sequence classification (its 4 layers one shared layer, called
    4 times per forward), the logits of token ids."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        from transformers import AlbertConfig, AlbertForSequenceClassification
        config = AlbertConfig(vocab_size=SEQUENCE_VOCABULARY, embedding_size=64, hidden_size=128, num_hidden_layers=4,
                              num_attention_heads=2, intermediate_size=256, max_position_embeddings=64,
                              num_labels=classes)
        self.inner = AlbertForSequenceClassification(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids).logits


def _gpt2(vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def _gpt2_untied(vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=128, n_embd=64, n_layer=2, n_head=2, tie_word_embeddings=False)
    return GPT2LMHeadModel(config)


def _bart(vocab: int) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration
    config = BartConfig(vocab_size=vocab, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        max_position_embeddings=64)
    return BartForConditionalGeneration(config)


def _t5(vocab: int) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration
    config = T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config)


def _opt(vocab: int) -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM
    config = OPTConfig(vocab_size=vocab, hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=2,
                       max_position_embeddings=64, word_embed_proj_dim=64)
    return OPTForCausalLM(config)


def _llama(vocab: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _mamba(vocab: int) -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=vocab, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
                         conv_kernel=4, pad_token_id=0)
    return MambaForCausalLM(config)


def _mixtral(vocab: int) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    # Two of 8 experts of 128 units per token: the same active width as _llama's 256.
    config = MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                           num_local_experts=8, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


#: name -> (factory, classes, input shape with batch axis, BackPACK runs on it, exact ggn is run)
PROBLEMS: dict[str, tuple[Callable[[int], nn.Module], int, tuple[int, ...], bool, bool]] = {
    "mlp-10": (_mlp, 10, (128, 1, 28, 28), True, True),
    "mlp-1000": (_mlp, 1000, (128, 1, 28, 28), True, True),
    "3c3d-100": (_3c3d, 100, (32, 3, 32, 32), True, True),
    "resnet18-10": (_resnet18, 10, (16, 3, 32, 32), False, True),
    "resnet18-1000": (_resnet18, 1000, (16, 3, 32, 32), False, True),
    "vit-1000": (_vit, 1000, (16, 3, 32, 32), False, False),
    "gpt2-5000": (_gpt2, 5000, (4, 32), False, False),
    "gpt2-untied-50000": (_gpt2_untied, 50000, (2, 128), False, False),
    "llama-5000": (_llama, 5000, (4, 32), False, False),
    "mixtral-5000": (_mixtral, 5000, (4, 32), False, False),
    "mamba-5000": (_mamba, 5000, (4, 32), False, False),
    "bart-5000": (_bart, 5000, (4, 32), False, False),
    "t5-5000": (_t5, 5000, (4, 32), False, False),
    "opt-5000": (_opt, 5000, (4, 32), False, False),
    "bit-10": (_timm("resnetv2_50x1_bit"), 10, (16, 3, 32, 32), False, True),
    "nfnet-10": (_timm("nf_resnet26"), 10, (16, 3, 32, 32), False, True),
    "tf-efficientnet-10": (_timm("tf_efficientnet_b0"), 10, (16, 3, 32, 32), False, True),
    "tv-vit-10": (_torchvision_vit, 10, (16, 3, 32, 32), False, True),
    "transformer-10": (_TransformerClassifier, 10, (32, 32), False, True),
    "transformer-seq-first-10": (_sequence_first_classifier, 10, (32, 32), False, True),
    "transformer-padded-10": (_PaddedClassifier, 10, (32, 32), False, True),
    "transformer-causal-10": (_CausalClassifier, 10, (32, 32), False, True),
    "attention-weights-10": (_AttentionCalledPlainly, 10, (32, 32), False, True),
    "wav2vec2-10": (_Wav2Vec2, 10, (4, 16000), False, True),
    "swin-t-10": (_torchvision_swin("swin_t"), 10, (8, 3, 64, 64), False, True),
    "swin-v2-t-10": (_torchvision_swin("swin_v2_t"), 10, (8, 3, 64, 64), False, True),
    "lstm-10": (_lstm, 10, (32, 32), False, True),
    "gru-10": (_gru, 10, (32, 32), False, True),
    "albert-10": (_Albert, 10, (16, 32), False, True),
    "deberta-v3-10": (_DebertaV3, 10, (16, 32), False, True),
}
#: The sequence classifiers (token ids in, one label per sequence) and their vocabulary.
SEQUENCE_CLASSIFIERS = ("lstm-10", "gru-10", "albert-10", "transformer-10", "transformer-seq-first-10",
                        "transformer-padded-10", "transformer-causal-10", "attention-weights-10", "deberta-v3-10")
#: The problems timed with ``fast=False`` too (the "generic path" column): the path their
#: recurrent, shared, weight-standardized, self-padded or weight-normalized weights took before their rules.
GENERIC_TIMED = (*SEQUENCE_CLASSIFIERS, "bit-10", "nfnet-10", "tf-efficientnet-10", "tv-vit-10", "wav2vec2-10")
SEQUENCE_VOCABULARY = 2000
LANGUAGE_MODELS = ("gpt2-5000", "gpt2-untied-50000", "llama-5000", "mixtral-5000", "mamba-5000", "bart-5000",
                   "t5-5000", "opt-5000")
#: The language models timed with one signal per token too (the "per token" column).
PER_TOKEN_TIMED = ("gpt2-5000",)


def make_problem(name: str, seed: int = 0, device: str = "cpu"
                 ) -> tuple[nn.Module, Any, Callable[[nn.Module], torch.Tensor]]:
    """Model (eval mode, on ``device``), the data normflat is given, and the mean loss of the batch."""
    factory, classes, shape, _, _ = PROBLEMS[name]
    torch.manual_seed(seed)
    model = factory(classes).eval().to(device)
    if name in LANGUAGE_MODELS:  # a causal LM fed labels = input_ids (Hugging Face shifts them), every token counted
        ids = torch.randint(0, classes, shape).to(device)
        return model, {"input_ids": ids, "labels": ids}, lambda m: m(input_ids=ids, labels=ids).loss
    if name in SEQUENCE_CLASSIFIERS:
        x = torch.randint(0, SEQUENCE_VOCABULARY, shape).to(device)
    else:
        x = torch.randn(*shape).to(device)
    y = torch.randint(0, classes, (shape[0],)).to(device)
    return model, (x, y), lambda m: nn.functional.cross_entropy(m(x), y)


def _synced(runs: dict[str, Callable[[], Any]], device: str) -> dict[str, Callable[[], Any]]:
    """On a CUDA device each run waits for its kernels, so that its wall time is its own."""
    if not device.startswith("cuda"):
        return runs

    def synced(run: Callable[[], Any]) -> Callable[[], Any]:
        def wrapped():
            out = run()
            torch.cuda.synchronize()
            return out
        return wrapped
    return {name: synced(run) for name, run in runs.items()}


def _runs(name: str, model: nn.Module, data: Any, loss_of: Callable[[nn.Module], torch.Tensor],
          loader_batches: int = 0) -> dict[str, Callable[[], Any]]:
    def gradient():
        model.zero_grad(set_to_none=True)
        loss_of(model).backward()

    def normflat_run(**options):
        return lambda: normflat.hessian_diagonal(model, data, loss="ce", progress=False, **options)

    def analyze_run():
        return normflat.analyze(model, data, loss="ce", progress=False)

    # "auto": hessian_diagonal with the defaults (only the mean: pooled group sums); "analyze":
    # the whole report with standard errors (1 + K sums for ggn-topk, the solver, the measures).
    runs = {"gradient": gradient, "auto": normflat_run(), "analyze": analyze_run}
    if loader_batches:
        # A loader of the same batch repeated: its time over the batches is the cost per batch
        # once the per-call work (session, probe, checks, finalize) is shared.
        def loader_run():
            return normflat.hessian_diagonal(model, [data] * loader_batches, loss="ce", progress=False)
        runs["auto per batch"] = loader_run
    if name in PER_TOKEN_TIMED:
        runs["per token"] = normflat_run(sequence_signals=False)
    if PROBLEMS[name][4]:  # too slow for the ViT (999 signals through 12 blocks) and the LM
        runs["ggn"] = normflat_run(estimator="ggn")
    runs["ggn-mc"] = normflat_run(estimator="ggn-mc")
    if name in GENERIC_TIMED:  # the generic path: the only one of some of their weights before their rules
        runs["ggn generic"] = normflat_run(estimator="ggn", fast=False)
    if PROBLEMS[name][3]:
        try:
            import backpack  # noqa: F401
        except ImportError:
            return runs
        runs["backpack"] = torch_diag_runner("backpack", model, *data)
        runs["backpack mc"] = torch_diag_runner("backpack_mc", model, *data)
    return runs


def accuracy(model: nn.Module, data: Any, exact: Any = None, **options: Any) -> list[dict[str, Any]]:
    """Per layer: exact and ``auto`` normalized sharpness, relative error, standard error.

    ``exact``: the exact ``ggn`` report (computed when ``None``); ``options``: ``samples``,
    ``top_classes``, ``seed`` of ``auto`` (its defaults when absent).
    """
    if exact is None:
        exact = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    auto = normflat.analyze(model, data, loss="ce", progress=False, **options)
    rows = []
    for a, b in zip(exact.layers, auto.layers):
        se = (b.standard_error or {}).get("normalized_sharpness", 0.0)
        err = b.normalized_sharpness - a.normalized_sharpness
        rows.append({"layer": a.name, "exact": a.normalized_sharpness, "auto": b.normalized_sharpness,
                     "rel_error": err / a.normalized_sharpness if a.normalized_sharpness else 0.0,
                     "rel_se": se / a.normalized_sharpness if a.normalized_sharpness else 0.0,
                     "z": err / se if se > 0 else (0.0 if err == 0 else math.inf)})
    total_se = (auto.standard_error or {}).get("normalized_sharpness", 0.0)
    rows.append({"layer": "total", "exact": exact.normalized_sharpness, "auto": auto.normalized_sharpness,
                 "rel_error": auto.normalized_sharpness / exact.normalized_sharpness - 1,
                 "rel_se": total_se / exact.normalized_sharpness,
                 "z": (auto.normalized_sharpness - exact.normalized_sharpness) / total_se if total_se else 0.0,
                 "estimator": auto.metadata["estimator"]})
    return rows


def lm_accuracy(model: nn.Module, data: Any, **options: Any) -> list[dict[str, Any]]:
    """Per layer of a language model: per-sequence ``auto`` against per-token ``auto``.

    Both are unbiased estimates of the same GGN (method §6.3) with reported standard errors;
    ``z`` is their difference over the combined standard error.
    """
    per_token = normflat.analyze(model, data, loss="ce", progress=False, sequence_signals=False, **options)
    per_seq = normflat.analyze(model, data, loss="ce", progress=False, **options)
    rows = []
    for a, b in zip(per_token.layers, per_seq.layers):
        sa = (a.standard_error or {}).get("normalized_sharpness", 0.0)
        sb = (b.standard_error or {}).get("normalized_sharpness", 0.0)
        both = math.hypot(sa, sb)
        rows.append({"layer": a.name, "rel_diff": b.normalized_sharpness / a.normalized_sharpness - 1,
                     "rel_se": sb / b.normalized_sharpness, "rel_se_token": sa / a.normalized_sharpness,
                     "z": (b.normalized_sharpness - a.normalized_sharpness) / both if both else 0.0})
    return rows


def train_to(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor], target: float,
             max_steps: int = 1000) -> tuple[int, float]:
    """Adam (lr 1e-3) on the problem's batch until its mean loss is below ``target``; the model
    stays in eval mode, so the function trained is the one analyzed. Returns (steps, loss)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(max_steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model)
        if float(loss.detach()) < target:
            break
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return step, float(loss.detach())


def _training_step(model: nn.Module, data: Any, loss_of: Callable[[nn.Module], torch.Tensor]) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_of(model).backward()
        optimizer.step()
    return step


def _peak_worker(name: str, method: str, threads: int, device: str, queue) -> None:
    torch.set_num_threads(threads)
    # One-time imports and initialization (normflat's backend, the optimizer, tqdm) on a tiny model
    # first, so that they are not counted.
    tiny = make_problem("mlp-10", device=device)
    warm = _training_step(*tiny) if method == "training step" else _runs("mlp-10", *tiny).get(method, lambda: None)
    warm()
    del tiny
    problem = make_problem(name, device=device)
    run = _training_step(*problem) if method == "training step" else _runs(name, *problem)[method]
    gc.collect()
    if device.startswith("cuda"):  # the device's allocations: the model and its batch are there before
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        run()
        torch.cuda.synchronize()
        queue.put((torch.cuda.max_memory_allocated() - base) / 2**20)
        return
    before = reset_peak_kib()
    run()  # everything the method allocates counts: gradients and optimizer state, normflat's sums
    run()
    queue.put((proc_status_kib("VmHWM") - before) / 1024)


def peak_mib(name: str, method: str, threads: int = 1, device: str = "cpu") -> float:
    """Peak memory (MiB) that two runs of ``method`` add to the model and its batch, in a fresh
    process: the resident set on the CPU (Linux), the device's allocations on a CUDA device; a
    training step's gradients, optimizer state and activations; normflat's sums, signals and
    per-sample squares."""
    return value_from_fresh_process(_peak_worker, (name, method, threads, device))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--problems", nargs="*", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--no-accuracy", action="store_true")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--methods", nargs="*", default=None, metavar="METHOD",
                        help="time only these columns beside the gradient (auto, analyze, ggn, ggn-mc, "
                             "'ggn generic', backpack, 'backpack mc', 'per token', 'auto per batch'); default: all")
    parser.add_argument("--memory", action="store_true", help="peak memory against a training step")
    parser.add_argument("--samples", type=int, default=None, help="auto's draws in the accuracy table")
    parser.add_argument("--top-classes", type=int, default=None, help="auto's exact classes in the accuracy table")
    parser.add_argument("--seed", type=int, default=0, help="auto's seed in the accuracy table")
    parser.add_argument("--loader-batches", type=int, default=0, metavar="N",
                        help="also time auto on a loader of N copies of the batch, per batch (the per-call "
                             "work shared)")
    parser.add_argument("--train-to", type=float, default=None, metavar="LOSS",
                        help="accuracy table: first train each model on its batch (Adam, lr 1e-3, in eval mode, so "
                             "the analyzed function is the trained one) until its mean loss is below LOSS")
    parser.add_argument("--seeds", type=int, default=1,
                        help="accuracy over seeds seed .. seed + seeds - 1 (a second table when more than one)")
    parser.add_argument("--device", default="cpu", help="the models' device: cpu or cuda (CUDA times wait for "
                        "the kernels; CUDA memory is the device's allocations)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, device {args.device}, {args.threads} thread(s), minimum of {args.rounds} "
          "interleaved rounds")
    if args.memory:
        print("| problem | training step (MiB) | auto (MiB) | auto / step | analyze (MiB) | analyze / step | "
              "ggn (MiB) | ggn / step |")
        print("|---|---|---|---|---|---|---|---|")
        for name in args.problems:
            step = peak_mib(name, "training step", args.threads, args.device)
            auto = peak_mib(name, "auto", args.threads, args.device)
            report = peak_mib(name, "analyze", args.threads, args.device)
            if PROBLEMS[name][4]:
                exact = peak_mib(name, "ggn", args.threads, args.device)
                exact_cells = f"{exact:.0f} | {exact / step:.1f}×"
            else:
                exact_cells = "— | —"
            print(f"| {name} | {step:.0f} | {auto:.0f} | {auto / step:.1f}× | {report:.0f} | {report / step:.1f}× | "
                  f"{exact_cells} |", flush=True)
    if args.no_timing:
        args.problems = [] if args.no_accuracy else args.problems
    print("| problem | auto | auto per batch of a loader | analyze | ggn (exact) | ggn-mc (1 draw) | BackPACK exact | "
          "BackPACK MC (1 draw) | auto per token | ggn, generic path | gradient (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ([] if args.no_timing else args.problems):
        runs = _synced(_runs(name, *make_problem(name, device=args.device), loader_batches=args.loader_batches),
                       args.device)
        if args.methods is not None:  # the others' cells stay empty
            runs = {m: run for m, run in runs.items() if m == "gradient" or m in args.methods}
        times = {m: min(t) for m, t in time_rounds(runs, args.rounds).items()}
        if "auto per batch" in times:
            times["auto per batch"] /= args.loader_batches
        g = times["gradient"]

        def cell(method: str) -> str:
            return f"{times[method] / g:.1f}×" if method in times else "—"

        print(f"| {name} | {cell('auto')} | {cell('auto per batch')} | {cell('analyze')} | {cell('ggn')} | "
              f"{cell('ggn-mc')} | {cell('backpack')} "
              f"| {cell('backpack mc')} | {cell('per token')} | {cell('ggn generic')} | {g:.4f} |",
              flush=True)
    if args.no_accuracy:
        return
    print("\nAccuracy of auto against the exact ggn (normalized sharpness per layer)")
    print("| problem | estimator | max abs. relative error (hidden layers) | max abs. relative error / reported "
          "standard error | head error | total error (SE) |")
    print("|---|---|---|---|---|---|")
    over_seeds = []
    for name in args.problems:
        if not PROBLEMS[name][4]:
            continue  # no exact reference
        model, data, loss_of = make_problem(name, device=args.device)
        if args.train_to is not None:
            steps, loss = train_to(model, loss_of, args.train_to)
            probs = torch.softmax(model(data[0]), -1).detach()
            print(f"| {name}: trained {steps} steps to loss {loss:.3f}; per sample, median top probability "
                  f"{float(probs.max(-1).values.median()):.2f}, median mass beyond the top two "
                  f"{float((1 - probs.topk(2).values.sum(-1)).median()):.2f} | | | | | |")
        exact = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
        runs = []
        for seed in range(args.seed, args.seed + args.seeds):
            chosen = {"samples": args.samples, "top_classes": args.top_classes, "seed": seed}
            rows = accuracy(model, data, exact, **{key: value for key, value in chosen.items() if value is not None})
            runs.append(rows)
            hidden, head, total = rows[:-2], rows[-2], rows[-1]
            worst = max(abs(r["rel_error"]) for r in hidden)
            worst_z = max(abs(r["z"]) for r in hidden)
            print(f"| {name} (seed {seed}) | {total['estimator']} | {worst:.2%} | {worst_z:.1f} | "
                  f"{abs(head['rel_error']):.1e} | {total['rel_error']:+.2%} ({total['rel_se']:.2%}) |", flush=True)
        over_seeds.append((name, runs))
    if args.seeds > 1 and over_seeds:
        print(f"\nOver {args.seeds} seeds (hidden layers): the worst layer of each seed, how many seeds have every "
              "layer within 1 %, each layer's mean signed error (the estimate's bias; the range over the layers), "
              "and its root-mean-square error over the mean reported standard error (the range over the layers)")
        print("| problem | worst layer: median (max) | seeds within 1 % | mean signed error per layer | "
              "RMS error / mean SE per layer |")
        print("|---|---|---|---|---|")
        for name, runs in over_seeds:
            errors = np.array([[r["rel_error"] for r in rows[:-2]] for rows in runs])  # (seeds, layers)
            ses = np.array([[r["rel_se"] for r in rows[:-2]] for rows in runs])
            worst = np.abs(errors).max(axis=1)
            ratio = np.sqrt((errors ** 2).mean(axis=0)) / np.maximum(ses.mean(axis=0), 1e-300)
            bias = errors.mean(axis=0)
            print(f"| {name} | {np.median(worst):.2%} ({worst.max():.2%}) | {int((worst <= 0.01).sum())} of "
                  f"{len(runs)} | {bias.min():+.2%} to {bias.max():+.2%} | {ratio.min():.2f} to {ratio.max():.2f} |",
                  flush=True)
    lms = [name for name in args.problems if name in PER_TOKEN_TIMED]  # against per token: too slow for the 50k LM
    if lms:
        print("\nLanguage models: auto per sequence against auto per token (normalized sharpness per layer)")
        print("| problem | layers | max abs. relative difference | max |difference| / combined SE | "
              "median relative SE per sequence | median relative SE per token |")
        print("|---|---|---|---|---|---|")
    for name in lms:
        model, data, _ = make_problem(name, device=args.device)
        chosen = {"samples": args.samples, "top_classes": args.top_classes, "seed": args.seed}
        rows = lm_accuracy(model, data, **{key: value for key, value in chosen.items() if value is not None})
        med = sorted(r["rel_se"] for r in rows)[len(rows) // 2]
        med_token = sorted(r["rel_se_token"] for r in rows)[len(rows) // 2]
        print(f"| {name} | {len(rows)} | {max(abs(r['rel_diff']) for r in rows):.2%} | "
              f"{max(abs(r['z']) for r in rows):.1f} | {med:.2%} | {med_token:.2%} |", flush=True)


if __name__ == "__main__":
    main()
