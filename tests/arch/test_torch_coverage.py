"""Whole torch architectures: every weight matrix analyzed (coverage, method §3), every other
parameter listed in ``excluded`` by name, and no unsupported warning."""

from __future__ import annotations

import math
import warnings

import torch
import torchvision
from torch import nn

import normflat
from tests.arch.test_torch_layers import DT, TinyLM, _ids, _init, _labels

V, D, T, N, C = 13, 8, 5, 3, 4


def _analyze_quietly(model, data, **kw):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="normflat skips")  # no unsupported warning
        return normflat.analyze(model, data, progress=False, **kw)


def _check(report, analyzed: set[str], excluded: set[str]):
    md = report.metadata
    assert md["coverage"] >= 0.99
    assert md["unsupported"] == []
    assert set(md["excluded"]) == excluded
    assert {layer.details["param"] for layer in report.layers} == analyzed
    assert math.isfinite(report.normalized_sharpness) and report.normalized_sharpness > 0


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        return self.head(self.encoder(self.emb(ids)).mean(1))


def _weights_and_rest(model, extra_weights=()):
    weights, rest = set(), set()
    for name, p in model.named_parameters():
        is_matrix = p.dim() >= 2 and "norm" not in name
        (weights if is_matrix or name in extra_weights else rest).add(name)
    return weights, rest


def test_transformer_encoder_classifier():
    model = _init(EncoderClassifier())
    report = _analyze_quietly(model, (_ids(N, T), _labels(N)))
    weights, rest = _weights_and_rest(model)
    _check(report, weights, rest)
    names = [layer.name for layer in report.layers]
    assert "encoder.layers.1.self_attn.value" in names and "encoder.layers.0.linear2" in names
    assert report.metadata["excluded"]["encoder.layers.0.norm1.weight"]


def test_lstm_classifier():
    class LSTMClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.lstm = nn.LSTM(D, 4, num_layers=2, bidirectional=True, batch_first=True)
            self.head = nn.Linear(8, C)

        def forward(self, ids):
            out, _ = self.lstm(self.emb(ids))
            return self.head(out.mean(1))

    model = _init(LSTMClassifier())
    report = _analyze_quietly(model, (_ids(N, T), _labels(N)))
    weights, rest = _weights_and_rest(model)
    _check(report, weights, rest)
    assert sum(1 for layer in report.layers if layer.name.startswith("lstm.")) == 2 * 2 * 2 * 4
    assert all(name.startswith("lstm.bias_") or name == "head.bias" for name in report.metadata["excluded"])


def test_token_level_language_model_with_tied_head():
    model = _init(TinyLM())
    ids = _ids(N, T)
    report = _analyze_quietly(model, {"input_ids": ids, "labels": ids}, shift_labels=True)
    weights, rest = _weights_and_rest(model)
    _check(report, weights, rest)
    assert report.metadata["loss_terms"] == N * (T - 1)


def test_torchvision_vision_transformer():
    model = _init(torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2,
                                                       hidden_dim=8, mlp_dim=16, num_classes=3))  # head: not 0
    x = torch.randn(2, 3, 16, 16, dtype=DT)
    report = _analyze_quietly(model, (x, torch.tensor([0, 2])))
    excluded = report.metadata["excluded"]
    assert "class_token" in excluded and "encoder.pos_embedding" not in excluded
    assert "encoder.layers.encoder_layer_0.ln_1.weight" in excluded and "heads.head.bias" in excluded
    names = {layer.name: layer for layer in report.layers}
    pos = names["encoder.pos_embedding"]
    assert pos.kind == "position_embedding" and pos.shape == (8, 5)  # (features, 1 + 4 patches)
    assert {"conv_proj", "encoder.layers.encoder_layer_0.self_attention.query", "heads.head"} <= set(names)
    weights, rest = _weights_and_rest(model, extra_weights=("encoder.pos_embedding",))
    rest.discard("class_token")
    weights.discard("class_token")
    _check(report, weights, rest | {"class_token"})
