"""Torch sequence models: invariances of attention, embeddings and recurrent layers (method §8,
items 5–7), token logits with keyword batches and model outputs (method §6.3, §9), and the
errors for bad sequence data."""

from __future__ import annotations

import copy
import math
import threading

import numpy as np
import pytest
import torch
from torch import nn

import normflat
from normflat.backends import torch as tb
from normflat.backends.torch import ggn as ggn_kernels
from normflat.backends.torch import session as torch_session
from normflat.engine import losses
from normflat.engine.options import validate_options
from normflat.engine.random import sample_uniforms
from tests.arch import _torch_reference as ref
from tests.arch.test_torch_layers import DT, PositionIds, PositionTagger, TinyLM, TokenTagger, _ids, _init, _labels

V, D, T, N, C = 13, 8, 5, 3, 4


def _analyze(model, data, **kw):
    return normflat.analyze(model, data, progress=False, **kw)


def _assert_invariant(before, after, x_call, **kw):
    """Function unchanged, normalized sharpness unchanged per layer and in total, trace moved.

    Args:
        before: The model as trained.
        after: The rescaled copy, the same function.
        x_call: A ``_Call``: its first batch runs both models, all its batches are analyzed.
        **kw: Options of ``normflat.analyze`` (``chunk_size``), the same for both analyses.
    """
    with torch.no_grad():
        a, b = x_call(before), x_call(after)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    data = x_call.data
    r0, r1 = _analyze(before, data, **kw), _analyze(after, data, **kw)
    assert [layer.name for layer in r0.layers] == [layer.name for layer in r1.layers]
    for l0, l1 in zip(r0.layers, r1.layers):
        assert math.isclose(l0.normalized_sharpness, l1.normalized_sharpness, rel_tol=1e-8), l0.name
    assert math.isclose(r0.normalized_sharpness, r1.normalized_sharpness, rel_tol=1e-8)
    assert not math.isclose(r0.hessian_trace, r1.hessian_trace, rel_tol=1e-3)


class _Call:
    def __init__(self, data):
        self.data = data

    def __call__(self, model):
        x = self.data[0][0]
        return model(*x) if isinstance(x, tuple) else model(x)


class AttentionTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.att = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.emb(ids)
        a, _ = self.att(h, h, h)
        return self.head(torch.tanh(a + h))


def _head_factors(heads, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(heads, generator=g, dtype=DT) * 3 + 0.3


def _rescale_attention_heads(att, seed_q=5, seed_v=6):
    """Rescales an ``nn.MultiheadAttention`` per head in place, the same function (method §8, item 5).

    Args:
        att: The attention, its packed ``(3E, E)`` ``in_proj_weight`` (query, key, value rows).
        seed_q: Seed of the factors ``c_h``: head h's query rows and bias times ``c_h``, its key
            rows and bias times ``1/c_h``.
        seed_v: Seed of the factors ``v_h``: head h's value rows and bias times ``v_h``, the output
            projection's columns of head h times ``1/v_h``.
    """
    e, heads = att.embed_dim, att.num_heads
    cq = _head_factors(heads, seed_q).repeat_interleave(e // heads)  # one factor per head, over its rows
    cv = _head_factors(heads, seed_v).repeat_interleave(e // heads)
    with torch.no_grad():
        w, b = att.in_proj_weight, att.in_proj_bias
        w[:e] *= cq[:, None]
        b[:e] *= cq
        w[e:2 * e] /= cq[:, None]
        b[e:2 * e] /= cq
        w[2 * e:] *= cv[:, None]
        b[2 * e:] *= cv
        att.out_proj.weight /= cv[None, :]


def test_attention_per_head_query_key_and_value_output_rescaling():
    model = _init(AttentionTagger())
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    _rescale_attention_heads(moved.att)
    paths = {layer.name: layer.details["path"] for layer in _analyze(model, data).layers}
    assert all(paths[f"att.{name}"] == "fast" for name in ("query", "key", "value", "out_proj")), paths
    _assert_invariant(model, moved, _Call(data))


class MaskedAttentionTagger(nn.Module):
    """``AttentionTagger`` with its attention called with masks and ``need_weights=False``.

    ``masks`` names what the call gets: ``padding`` (a boolean key padding mask from the sample
    itself, its last ``ids[:, 0] % 3`` positions), ``causal`` (a boolean ``(T, T)`` ``attn_mask``),
    ``is_causal`` (the hint beside the causal mask).
    """

    def __init__(self, masks):
        super().__init__()
        self.masks = masks
        self.emb = nn.Embedding(V, D)
        self.att = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.emb(ids)
        t = ids.shape[1]
        kw = {"need_weights": False}
        if "padding" in self.masks:  # every query keeps key 0, causal or not: no row all masked
            kw["key_padding_mask"] = torch.arange(t)[None, :] >= t - ids[:, :1] % 3
        if "causal" in self.masks:
            kw["attn_mask"] = torch.ones(t, t, dtype=torch.bool).triu(1)
        if "is_causal" in self.masks:
            kw["is_causal"] = True
        a, _ = self.att(h, h, h, **kw)
        return self.head(torch.tanh(a + h))


@pytest.mark.parametrize("masks", [("padding",), ("causal",), ("causal", "padding"), ("causal", "is_causal")],
                         ids=lambda m: "+".join(m))
def test_masked_attention_per_head_query_key_and_value_output_rescaling(masks):
    """Per-head rescaling (query rows times c_h, key rows over it; value rows times v_h, the output
    projection's columns over it: method §8, item 5) of an attention called with masks and
    ``need_weights=False``: a key padding mask, a causal mask, both, and the causal mask with the
    ``is_causal`` hint. The function is unchanged, so are the normalized sharpness per layer and in
    total, the trace moves; every projection on its fast path, before and after (method §6.1,
    "Attention projections applied functionally"), whichever way normflat evaluates the call."""
    model = _init(MaskedAttentionTagger(masks))
    data = [(_ids(N, T), _labels(N, T)), (_ids(2, T, seed=1), _labels(2, T, seed=2))]
    pads = torch.cat([ids[:, 0] % 3 for ids, _ in data])
    assert 0 in pads and (pads > 0).sum() >= 2  # padded and unpadded samples in the batches
    moved = copy.deepcopy(model)
    _rescale_attention_heads(moved.att)
    for m in (model, moved):
        paths = {layer.name: layer.details["path"] for layer in _analyze(m, data).layers}
        assert all(paths[f"att.{name}"] == "fast" for name in ("query", "key", "value", "out_proj")), paths
        with torch.no_grad():
            assert torch.isfinite(m(data[1][0])).all()
    with torch.no_grad():
        assert torch.allclose(model(data[1][0]), moved(data[1][0]), rtol=1e-12, atol=1e-12)
    _assert_invariant(model, moved, _Call(data))


class EmbedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, 6)
        self.head = nn.Linear(6, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.emb(ids))))


def test_embedding_feature_scaling_against_the_next_linear():
    model = _init(EmbedLinear())
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 7)
    with torch.no_grad():
        moved.emb.weight *= c[None, :]
        moved.proj.weight /= c[None, :]
    _assert_invariant(model, moved, _Call(data))


class SequenceFirstRescalable(nn.Module):
    """PyTorch's transformer tutorial layout with rescalable pieces: token ids ``(n, T)`` read as
    ``(T, n)``, an embedding, a dense layer and a ReLU on ``(T, n, D)``, an ``nn.TransformerEncoder``
    without ``batch_first``, then a dense pair with a ReLU between on the first token alone,
    ``(1, n, D)`` (Longformer's global projections), added to every token, the mean over the
    tokens, a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)
        layer = nn.TransformerEncoderLayer(D, 2, 12, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.glob_in = nn.Linear(D, 6)
        self.glob_out = nn.Linear(6, D)
        self.head = nn.Linear(D, C)

    def forward(self, ids):  # (n, T), read as the tutorial's (T, n)
        h = self.enc(torch.relu(self.proj(self.emb(ids.t()))))
        h = h + self.glob_out(torch.relu(self.glob_in(h[:1])))
        return self.head(h.mean(0))


@pytest.mark.parametrize("batches, kw", [((N,), {}), ((1, 4), {"chunk_size": 3})])
def test_sequence_first_layers_rescaling(batches, kw):
    """Layers with the samples on their second axis, ``(T, n, d)``, and the one-position pair on
    ``(1, n, d)``, read with the samples brought to the front (method §6.1, "A batch folded into the
    leading axis"), rescaled without changing the function (method §8): the embedding's feature j
    times c_j and the next dense layer's column j over it (item 6); the encoder's attention per head
    (item 5); its feed-forward hidden units (``linear1`` rows and bias times c_k, ``linear2``
    columns over it, a ReLU between) and the one-position pair's likewise (item 2). Every layer on
    its fast path before and after, the function unchanged on every batch, the normalized
    sharpness unchanged per layer and in total, the trace moved; also with chunks of three and a
    first batch of one sample, where the sequence-first reading has its special cases."""
    model = _init(SequenceFirstRescalable())
    data = [(_ids(b, T, seed=i), _labels(b, seed=i + 5)) for i, b in enumerate(batches)]
    moved = copy.deepcopy(model)
    block = moved.enc.layers[0]
    _rescale_attention_heads(block.self_attn, 15, 16)
    with torch.no_grad():
        c = _head_factors(D, 17)
        moved.emb.weight *= c[None, :]
        moved.proj.weight /= c[None, :]
        for first, second, seed in ((block.linear1, block.linear2, 18), (moved.glob_in, moved.glob_out, 19)):
            c = _head_factors(first.out_features, seed)
            first.weight *= c[:, None]
            first.bias *= c
            second.weight /= c[None, :]
    for m in (model, moved):
        report = _analyze(m, data, **kw)
        assert len(report.layers) == 11, [layer.name for layer in report.layers]
        assert all(layer.details["path"] == "fast" for layer in report.layers), [lr.details for lr in report.layers]
    with torch.no_grad():
        for ids, _ in data:
            assert torch.allclose(model(ids), moved(ids), rtol=1e-12, atol=1e-12)
    _assert_invariant(model, moved, _Call(data), **kw)


class RecurrentTagger(nn.Module):
    def __init__(self, cell, **kw):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.rnn = cell(D, 4, batch_first=True, **kw)
        self.head = nn.Linear(kw.get("proj_size") or 4, C)  # an LSTM's projection sets the output width

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out)


def test_relu_rnn_hidden_unit_rescaling():
    model = _init(RecurrentTagger(nn.RNN, nonlinearity="relu"))
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    c = _head_factors(4, 8)
    with torch.no_grad():
        r = moved.rnn
        r.weight_ih_l0 *= c[:, None]
        r.bias_ih_l0 *= c
        r.bias_hh_l0 *= c
        r.weight_hh_l0.copy_(c[:, None] * r.weight_hh_l0 / c[None, :])  # D W D^-1
        moved.head.weight /= c[None, :]
    _assert_invariant(model, moved, _Call(data))


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_gated_input_column_scaling_against_a_scaled_embedding(cell):
    model = _init(RecurrentTagger(cell))
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 9)
    with torch.no_grad():
        moved.emb.weight *= c[None, :]
        moved.rnn.weight_ih_l0 /= c[None, :]
    _assert_invariant(model, moved, _Call(data))


def test_dense_weight_applied_through_f_linear_feature_scaling():
    """timm BEiT-style attention (the packed projection's module never called, its weight applied
    by one ``F.linear`` call, recorded there, method §6.1): feature j of the token embedding times
    c_j, input column j of the packed projection times 1/c_j; the projection on its fast path."""
    from tests.arch.test_torch_layers import FunctionalQKV

    model = _init(FunctionalQKV())
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 14)
    with torch.no_grad():
        moved.emb.weight *= c[None, :]
        moved.qkv.weight /= c[None, :]
    _assert_invariant(model, moved, _Call(data))
    assert _analyze(moved, data).layer("qkv").details["path"] == "fast"


def test_lstm_projection_rescaling():
    """An LSTM with ``proj_size``: unit k of the projected state times c_k scales row k of the
    projection ``weight_hr``, and takes 1/c_k on column k of the recurrent ``weight_hh`` and of the
    head (the state is the next step's recurrent input and the layer's output). Every recurrent
    weight is on its fast path (method §6.1, "Recurrent weights")."""
    model = _init(RecurrentTagger(nn.LSTM, proj_size=3))
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    c = _head_factors(3, 11)
    with torch.no_grad():
        r = moved.rnn
        r.weight_hr_l0 *= c[:, None]
        r.weight_hh_l0 /= c[None, :]
        moved.head.weight /= c[None, :]
    report = _analyze(model, data)
    assert {layer.details["path"] for layer in report.layers if layer.name.startswith("rnn.")} == {"fast"}
    assert "rnn.weight_hr_l0" in [layer.name for layer in report.layers]
    _assert_invariant(model, moved, _Call(data))


class TiedMixer(nn.Module):
    """Token LM whose head is tied to its embedding, with two dense layers between them."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.wte = nn.Embedding(V, D, padding_idx=padding_idx)
        self.mix_in = nn.Linear(D, 6)
        self.mix_out = nn.Linear(6, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(self.mix_out(torch.tanh(self.mix_in(self.wte(ids)))))


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_tied_embedding_feature_scaling_against_both_of_its_uses(padding_idx):
    """Feature j of the tied table times c_j scales the lookup's output and the head's input:
    the next layer's input column j and the previous layer's output row j take 1/c_j. The tied
    weight is on its fast path (per-use per-sample gradients summed, method §6.1)."""
    model = _init(TiedMixer(padding_idx))
    ids = _ids(N, T)
    if padding_idx is not None:
        ids[0, 1] = padding_idx
    data = [(ids, _ids(N, T, seed=4))]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 10)
    with torch.no_grad():
        moved.wte.weight *= c[None, :]  # the head's weight too: one tensor
        moved.mix_in.weight /= c[None, :]
        moved.mix_out.weight /= c[:, None]
        moved.mix_out.bias /= c
    assert moved.lm_head.weight is moved.wte.weight
    _assert_invariant(model, moved, _Call(data))
    wte = _analyze(moved, data).layer("wte")
    assert wte.details["shared_with"] == ["lm_head"] and wte.details["path"] == "fast"


class SharedTable(nn.Module):
    """BART's layout: ``shared``, a table the model never looks up itself, tied to the encoder's and
    decoder's embeddings and the head. ``wake``: from the second forward with gradients on the model
    also looks ``shared`` up (a use the first forward did not see; normflat's forwards without
    gradients, the first rows together and alone, are all of the first kind)."""

    def __init__(self, wake=False):
        super().__init__()
        self.shared = nn.Embedding(V, D)
        self.enc = nn.Embedding(V, D)
        self.dec = nn.Embedding(V, D)
        self.enc.weight = self.dec.weight = self.shared.weight
        self.mix_in = nn.Linear(D, 6)
        self.mix_out = nn.Linear(6, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.shared.weight
        self.wake, self.forwards = wake, 0

    def forward(self, ids):
        self.forwards += int(torch.is_grad_enabled())
        h = self.mix_out(torch.tanh(self.mix_in(self.enc(ids) + self.dec(ids.flip(1)))))
        if self.wake and self.forwards > 1:
            h = h + self.shared(ids)
        return self.head(h)


def test_tied_table_whose_own_module_never_runs():
    """The uses that run are the tied weight's uses (method §6.1, "Tied weights"): the fast path
    with the three of them, the same diagonal as brute force and the generic path, and the
    feature-rescaling invariance through all three."""
    model = _init(SharedTable())
    data = [(_ids(N, T), _ids(N, T, seed=4))]
    report = _analyze(model, data)
    shared = report.layer("shared")
    assert shared.details["path"] == "fast" and shared.details["shared_with"] == ["enc", "dec", "head"]
    want = ref.problems(model, ref.ggn_diagonal(model, data, "nsce"))
    got = normflat.hessian_diagonal(model, data, estimator="ggn", progress=False)
    generic = normflat.hessian_diagonal(model, data, estimator="ggn", progress=False, fast=False)
    assert set(got) == set(want) == set(generic) == {"shared", "mix_in", "mix_out"}
    for name in want:
        torch.testing.assert_close(got[name], torch.as_tensor(want[name]), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got[name], generic[name], rtol=1e-10, atol=1e-14)
    moved = copy.deepcopy(model)
    c = _head_factors(D, 13)
    with torch.no_grad():
        moved.shared.weight *= c[None, :]  # every use's weight: one tensor
        moved.mix_in.weight /= c[None, :]
        moved.mix_out.weight /= c[:, None]
        moved.mix_out.bias /= c
    _assert_invariant(model, moved, _Call(data))
    assert _analyze(moved, data).layer("shared").details["path"] == "fast"


def test_tied_table_whose_idle_module_wakes_up_takes_the_generic_path():
    """A use the first forward did not run, running later, would miss its share of the gradient:
    the chunk that sees it sends the weight to the generic path (earlier chunks' sums stay
    valid), with its reason; the numbers are the generic path's."""
    model = _init(SharedTable(wake=True))
    data = [(_ids(2, T), _ids(2, T, seed=4)), (_ids(2, T, seed=5), _ids(2, T, seed=6))]
    report = normflat.analyze(model, data, estimator="ggn", progress=False, chunk_size=2)
    shared = report.layer("shared")
    assert shared.details["path"] == "generic" and "not called exactly once" in shared.details["generic_reason"]


def test_position_table_feature_scaling_with_the_embedding():
    """Feature j of the token embedding and of the position table (rows j of both canonical
    ``(features, ·)`` matrices) times c_j, the next layer's input column j times 1/c_j: the same
    function, the same normalized sharpness per layer, the table on its fast path (method §6.1)."""
    model = _init(PositionTagger())
    data = [(_ids(N, T), _labels(N))]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 11)
    with torch.no_grad():
        moved.emb.weight *= c[None, :]
        moved.pos_embed *= c
        moved.mix.weight /= c[None, :]
    moved.alias = [moved.pos_embed]
    _assert_invariant(model, moved, _Call(data))
    assert _analyze(moved, data).layer("pos_embed").details["path"] == "fast"


class FoldedWindowTable(nn.Module):
    """TNT's pixel positions with rescalable features: a dense layer on ``(n, 8, 3)``, its output
    folded into windows ``(n·2, 4, D)`` (each sample's two windows in one block), a ``(1, 4, D)``
    table on no batch axis added to every window, a ReLU, a dense layer, tanh, the mean, a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.pixel_pos = nn.Parameter(torch.randn(1, 4, D) * 0.3)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, x):  # (n, 8, 3)
        n = x.shape[0]
        w = self.embed(x).reshape(2 * n, 4, D) + self.pixel_pos
        return self.head(torch.tanh(self.mix(torch.relu(w.reshape(n, 8, D)))).mean(1))


@pytest.mark.parametrize("batches, kw", [((5,), {}), ((1, 4), {"chunk_size": 3})])
def test_followed_position_table_feature_scaling(batches, kw, monkeypatch):
    """A position table added to a batch folded into windows, followed to the windows it meets
    (method §6.1, "Layers on no batch axis", "Position tables"): output row j and bias of the dense
    layer before it and feature j of the table times c_j (the sum times c_j, through the ReLU),
    column j of the next dense layer times 1/c_j (method §8, item 6). The table is reported as a
    position embedding, followed and on its fast path, before and after; the function, the
    normalized sharpness per layer and in total unchanged, the trace moved; also in chunks with a
    first batch of one sample."""
    followed = []
    follow = torch_session.TorchSession._follow
    monkeypatch.setattr(torch_session.TorchSession, "_follow",
                        lambda self, layer, *a, **k: (followed.append(layer.name), follow(self, layer, *a, **k))[1])
    model = _init(FoldedWindowTable())
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(b, 8, 3, generator=g, dtype=DT), _labels(b, seed=i + 5)) for i, b in enumerate(batches)]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 20)
    with torch.no_grad():
        moved.embed.weight *= c[:, None]
        moved.embed.bias *= c
        moved.pixel_pos *= c
        moved.mix.weight /= c[None, :]
    for m in (model, moved):
        followed.clear()
        report = _analyze(m, data, **kw)
        assert followed == ["pixel_pos"], followed
        table = report.layer("pixel_pos")
        assert table.kind == "position_embedding" and table.shape == (D, 4), (table.kind, table.shape)
        assert all(layer.details["path"] == "fast" for layer in report.layers), [lr.details for lr in report.layers]
    with torch.no_grad():
        for x, _ in data:
            assert torch.allclose(model(x), moved(x), rtol=1e-12, atol=1e-12)
    _assert_invariant(model, moved, _Call(data), **kw)


@pytest.mark.parametrize("kind", ["position ids", "own forward"])
def test_position_lookup_feature_scaling_with_the_token_embedding(kind):
    """The same feature scaling (feature j of both tables times c_j, column j of the next dense
    layer times 1/c_j) through an embedding of ``(1, T)`` position ids (one output row, broadcast
    over the batch, on its fast rule with the row expanded to the samples), and through OPT-style
    learned positions (an ``nn.Embedding`` subclass computing its ids from the mask, on its
    recorded lookup, method §6.1 "Embeddings with their own forward")."""
    from tests.arch.test_torch_layers import MaskedTagger, _mask, two_analyses_beside_a_forward

    if kind == "position ids":
        model, data = _init(PositionIds()), [(_ids(N, T), _labels(N))]
    else:
        model, data = _init(MaskedTagger()), [((_ids(N, T), _mask(N, T, 1)), _labels(N, T))]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 12)
    with torch.no_grad():
        moved.emb.weight *= c[None, :]
        moved.pos.weight *= c[None, :]
        moved.mix.weight /= c[None, :]
    _assert_invariant(model, moved, _Call(data))
    assert _analyze(moved, data).layer("pos").details["path"] == "fast"


# ----------------------------------------------------------------------------- token logits


def test_keyword_batches_model_outputs_and_chunking():
    model = _init(TinyLM())
    ids = _ids(2, T, seed=3)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    whole = normflat.hessian_diagonal(model, batch, shift_labels=True, progress=False)
    chunked = normflat.hessian_diagonal(model, batch, shift_labels=True, progress=False, chunk_size=1)
    for k in whole:
        assert torch.allclose(torch.as_tensor(whole[k]), torch.as_tensor(chunked[k]), rtol=1e-10, atol=0)
    # output= picks the logits by key or callable, the same numbers.
    by_key = normflat.hessian_diagonal(model, batch, shift_labels=True, progress=False, output="logits")
    by_call = normflat.hessian_diagonal(model, batch, shift_labels=True, progress=False,
                                        output=lambda out: out["logits"])
    for k in whole:
        assert torch.equal(torch.as_tensor(whole[k]), torch.as_tensor(by_key[k]))
        assert torch.equal(torch.as_tensor(whole[k]), torch.as_tensor(by_call[k]))


def test_token_logits_ggn_mc_within_its_standard_error_of_ggn():
    model = _init(TokenTagger())
    data = [(_ids(N, T), _labels(N, T))]
    ggn = _analyze(model, data)
    mc = _analyze(model, data, estimator="ggn-mc", samples=400, seed=1)
    # ggn-mc with many draws per token is within a few of its own standard errors of ggn.
    se = mc.standard_error["hessian_trace"]
    assert abs(mc.hessian_trace - ggn.hessian_trace) < 5 * se
    assert mc.metadata["loss_terms"] == ggn.metadata["loss_terms"] == N * T


def test_padding_mask_keyword_reaches_the_model():
    model = _init(TinyLM(tied=False))
    ids = _ids(2, T, seed=5)
    mask = torch.ones_like(ids)
    mask[0, 3:] = 0
    labels = ids.clone()
    labels[mask == 0] = ref.IGNORE
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    data = [({"input_ids": ids, "attention_mask": mask}, labels)]
    got = normflat.hessian_diagonal(model, batch, shift_labels=True, estimator="ggn", progress=False)
    want = ref.problems(model, ref.ggn_diagonal(model, data, "nsce", shift=True), {"pos_embed": D})
    for k in want:
        err = (torch.as_tensor(got[k]) - want[k]).abs().max() / want[k].abs().max()
        assert err < 1e-10, k


def test_the_model_is_untouched_and_analyses_run_in_threads():
    model = _init(TinyLM())
    model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _ids(2, T)
    batch = {"input_ids": ids, "labels": ids}
    results = {}

    def run(key, m):
        results[key] = normflat.hessian_diagonal(m, batch, estimator="hutchinson", samples=2,
                                                 shift_labels=True, progress=False)

    threads = [threading.Thread(target=run, args=(i, copy.deepcopy(model))) for i in range(2)]
    for t in threads:
        t.start()
    run("main", model)
    for t in threads:
        t.join()
    assert model.training and not any(p.requires_grad for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for k in results["main"]:
        assert torch.equal(torch.as_tensor(results[0][k]), torch.as_tensor(results["main"][k]))


@pytest.mark.parametrize("kind", ["recurrence", "lookup"])
def test_recorded_fast_rules_in_two_threads(kind):
    """The recurrence and the lookup of an embedding with its own forward record into the capture
    of the analysis running in their own thread: two analyses of one architecture at once, while
    a third thread runs the model outside any analysis, give the sequential numbers, and leave no
    recording behind."""
    from normflat.backends.torch import compat
    from tests.arch.test_torch_layers import MaskedTagger, _mask, two_analyses_beside_a_forward

    if kind == "recurrence":
        model = _init(RecurrentTagger(nn.LSTM, num_layers=2))
        data = [(_ids(N, T), _labels(N, T))]
    else:
        model = _init(MaskedTagger())
        data = [((_ids(N, T), _mask(N, T, 1)), _labels(N, T))]
    want = normflat.hessian_diagonal(model, data, estimator="ggn", progress=False)

    def forward(m):
        with torch.no_grad(), compat.FunctionalKernels(attention=False):
            _Call(data)(m)

    results = two_analyses_beside_a_forward(
        model, lambda m: normflat.hessian_diagonal(m, data, estimator="ggn", progress=False), forward)
    for got in results:
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(torch.as_tensor(got[name]), torch.as_tensor(want[name])), name
    assert getattr(compat._TAPS, "record", None) is None


# ----------------------------------------------------------------------------- errors


def test_token_errors_are_clear():
    model = _init(TokenTagger())
    ids = _ids(N, T)
    with pytest.raises(ValueError, match="one class per sample"):
        _analyze(model, (ids, _labels(N)))
    bad = _labels(N, T)
    bad[0, 0] = C
    with pytest.raises(ValueError, match=r"in \[0, 3\]"):
        _analyze(model, (ids, bad))
    with pytest.raises(ValueError, match="ignore"):
        _analyze(model, (ids, torch.full((N, T), ref.IGNORE)))


def test_output_without_logits_is_clear():
    class NoLogits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return {"hidden": self.lin(x)}

    model = NoLogits().to(DT)
    data = (torch.randn(3, 4, dtype=DT), torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="output="):
        _analyze(model, data)
    report = _analyze(model, data, output="hidden")
    assert report.layers[0].name == "lin"


def test_embedding_max_norm_is_refused_and_the_table_unchanged():
    model = _init(TokenTagger())
    model.emb.max_norm = 0.1
    before = model.emb.weight.detach().clone()
    with pytest.raises(ValueError, match="max_norm"):
        _analyze(model, (_ids(N, T), _labels(N, T)))
    assert torch.equal(model.emb.weight, before)


@pytest.mark.parametrize("estimator", ["ggn", "ggn-topk"])
def test_token_signals_formed_a_few_tokens_at_a_time_give_the_same_diagonal(estimator, monkeypatch):
    """Per token (ggn) the signals are formed a few tokens at a time, per sequence (ggn-topk)
    formed a few members of every group at a time: the same sums."""
    model = _init(TinyLM(tied=False))
    ids = _ids(1, T, seed=9)
    data = [(ids, ids)]
    kw = dict(estimator=estimator, shift_labels=True, progress=False)
    whole = normflat.hessian_diagonal(model, data, **kw)
    calls: list[int] = []
    backprop = ggn_kernels.backprop_signals

    def counting(logits, outs, sig, batched):
        calls.append(int(sig.shape[0]))
        return backprop(logits, outs, sig, batched)

    monkeypatch.setattr(ggn_kernels, "backprop_signals", counting)
    monkeypatch.setattr(torch_session, "TOKEN_SIGNAL_ENTRIES", 1)  # one token per block of signals
    monkeypatch.setattr(torch_session, "SEQUENCE_SIGNAL_ENTRIES", 1)  # one member of every group per block
    blocks = normflat.hessian_diagonal(model, data, **kw)
    assert len(calls) == (T if estimator == "ggn" else 2 + 2)  # ggn-topk: k = 2 top classes, 10 / 5 draws
    for k in whole:
        assert torch.allclose(torch.as_tensor(whole[k]), torch.as_tensor(blocks[k]), rtol=1e-12, atol=0), k


# ----------------------------------------------------------------------------- signals per sequence


class SequenceTagger(nn.Module):
    """Embedding, a dense layer of the (n, D) mean embedding added to every token (a 2-D input
    inside a token model), causal attention, a dense layer per token and a dense head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.ctx = nn.Linear(D, D)
        self.att = nn.MultiheadAttention(D, 2, batch_first=True)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        e = self.emb(ids)
        h = e + torch.tanh(self.ctx(e.mean(1)))[:, None]
        causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)
        a, _ = self.att(h, h, h, attn_mask=causal)
        return self.head(torch.tanh(self.proj(a + h)))


def _options(**kw):
    return validate_options(progress=False, **kw)


def _signal_reference(model, batches, options, shift=False, exact=(), tables=None):
    """Brute-force ``(K, *canonical)`` group estimates per problem (float64).

    Every sequence's full Jacobian of its logits w.r.t. every parameter (``jacrev``) is
    contracted with the engine's signals of the same uniforms (normflat's counter-based
    draws at the sample's position in the data), each square summed per group and divided
    by the counted tokens; a ``ggn-topk`` group estimate is the shared sum plus its own
    (method §6.2, §6.3). ``exact``: the problems of a dense head, squared exactly: the exact
    GGN (the same Jacobians contracted with the exact ``ggn``'s per-token factor) in every group.
    """
    params = {k: v.detach() for k, v in model.named_parameters()}
    # The exact GGN's per-token factor of the same logits, for a dense head squared exactly.
    exact_options = _options(loss=options.loss, estimator="ggn") if exact else None
    sums = {k: None for k in params}
    exact_sums = {k: None for k in params}
    offset = terms = 0
    for x, y in batches:
        n = y.shape[0]
        counted = (ref._token_labels(y, shift) != ref.IGNORE).to(DT)
        terms += int(counted.sum())
        with torch.no_grad():
            z = ref._logits(model(x))
        u = sample_uniforms(options.seed, 0, offset, n, options.uniform_columns(z.shape[1]))
        signals = [(sums, torch.from_numpy(losses.token_signals(np, z.numpy(), options, counted.numpy(), u)))]
        if exact:
            signals.append((exact_sums, torch.from_numpy(
                losses.token_signals(np, z.numpy(), exact_options, counted.numpy()))))
        for i in range(n):
            args, kwargs = ref._sample(x, i)
            jac = torch.func.jacrev(
                lambda ps, a=args, kw=kwargs: ref._logits(torch.func.functional_call(model, ps, a, kw))[0])(params)
            for name, j in jac.items():  # (T, C, *shape)
                for into, sig in signals:
                    g = torch.einsum("kmtc,tcp->kmp", sig[:, :, i], j.reshape(*j.shape[:2], -1))
                    s = g.square().sum(1).reshape(-1, *params[name].shape)
                    into[name] = s if into[name] is None else into[name] + s
        offset += n
    k = options.groups
    shared = 1 if options.shared_group else 0
    groups = [{name: ((s[0] + s[shared + g]) if shared else s[g]) / terms for name, s in sums.items()}
              for g in range(k)]
    out = [ref.problems(model, native, tables) for native in groups]
    if exact:
        want = ref.problems(model, {name: s[0] / terms for name, s in exact_sums.items()}, tables)
        for per_group in out:
            for name in exact:
                per_group[name] = want[name]
    return {name: torch.stack([per_group[name] for per_group in out]) for name in out[0]}


def _sequence_case(case):
    """A model, two batches (the second's draws start at its offset in the data), its options and
    the reference's ``(shift, exact problems, position tables)``."""
    if case == "tagger":
        model = _init(SequenceTagger())
        ids, y = _ids(N, T, seed=11), _labels(N, T, seed=12)
        y[0, 1], y[2, 4] = ref.IGNORE, ref.IGNORE
        return model, [(ids[:2], y[:2]), (ids[2:], y[2:])], {"loss": "nsce"}, (False, ("head",), None)
    model = _init(TinyLM())  # the tied head (no exact head) and the attention take the generic path
    ids = _ids(N, T, seed=13)
    y = ids.clone()
    y[1, 2] = ref.IGNORE  # after the shift: the label of position 1
    return model, [(ids[:1], y[:1]), (ids[1:], y[1:])], {"loss": "ce", "shift_labels": True}, \
        (True, (), {"pos_embed": D})


def _relative_error(got, want):
    scale = want.abs().max()
    assert scale > 0
    return float((torch.as_tensor(got, dtype=DT) - want).abs().max() / scale)


@pytest.mark.parametrize("sequence_signals", [None, False])
@pytest.mark.parametrize("estimator", ["ggn-topk", "ggn-mc"])
@pytest.mark.parametrize("case", ["tagger", "tied_lm"])
def test_token_signals_equal_brute_force_jacobians(case, estimator, sequence_signals):
    """Per sequence (the default) and per token (``sequence_signals=False``), the group estimates
    of analyze and the pooled mean of hessian_diagonal equal the engine's signals of the same
    draws contracted with full per-sequence Jacobians, on the fast path (2-D and per-token dense
    layers, the embedding, the attention projections, a tied head), the generic path (``fast=False``)
    and the exact dense head of ggn-topk; ignored tokens and shifted labels included (method §6.3)."""
    model, batches, kw, (shift, exact, tables) = _sequence_case(case)
    kw = {**kw, "estimator": estimator, "seed": 5, "sequence_signals": sequence_signals,
          **({"samples": 4, "top_classes": 2} if estimator == "ggn-topk" else {"samples": 3})}
    options = _options(**kw)
    # ggn-topk squares a dense head whose output is the logits exactly; ggn-mc samples it too.
    want = _signal_reference(model, batches, options, shift, exact if estimator == "ggn-topk" else (), tables)
    # The generic path samples the head too.
    sampled = _signal_reference(model, batches, options, shift, (), tables) if estimator == "ggn-topk" else want
    for fast, reference in ((True, want), (False, sampled)):
        problems, _ = tb.layer_problems(model, batches, options, fast=fast)
        assert sorted(p.name for p in problems) == sorted(want)
        for p in problems:
            assert p.hessian_diag_samples.shape == reference[p.name].shape == (options.groups, *p.shape)
            assert _relative_error(p.hessian_diag_samples, reference[p.name]) < 1e-10, (fast, p.name)
        assert {p.details["path"] for p in problems} == ({"fast"} if fast else {"generic"})
    runs = [normflat.hessian_diagonal(model, batches, progress=False, **kw)]
    if sequence_signals is None:  # one sequence per step: the draws follow the samples
        runs.append(normflat.hessian_diagonal(model, batches, progress=False, chunk_size=1, **kw))
    for got in runs:
        for name, value in want.items():
            assert _relative_error(got[name], value.mean(0)) < 1e-10, name


class StructuredHeadTagger(nn.Module):
    """Embedding, a dense layer per token and a dense head whose output is the token logits: an
    ``nn.Linear``, or Hugging Face's ``Conv1D`` (its weight stored ``(in, out)``)."""

    def __init__(self, head: str):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)
        if head == "conv1d":
            from transformers.pytorch_utils import Conv1D

            self.head = Conv1D(C, D)
        else:
            self.head = nn.Linear(D, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.emb(ids))))


@pytest.mark.parametrize("head", ["linear", "conv1d"])
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_sequence_signals_start_at_the_heads_input(head, loss, monkeypatch):
    """Per-sequence ggn-topk with a dense head whose output is the token logits: the other layers'
    signals start at the head's input, each token's signed class signal pulled through the head
    (losses.sequence_factor), and no ``(K', M', n, T, C)`` signals are formed; a member of every
    group at a time here. Every group estimate equals the brute force's; the head stays exact
    (method §6.2, §6.3)."""
    linear = _init(StructuredHeadTagger("linear"), seed=3)
    model = linear
    if head == "conv1d":  # the same function: the reference's layers are the nn.Linear model's
        model = StructuredHeadTagger("conv1d").to(DT).eval()
        with torch.no_grad():
            model.emb.weight.copy_(linear.emb.weight), model.proj.weight.copy_(linear.proj.weight)
            model.proj.bias.copy_(linear.proj.bias), model.head.bias.copy_(linear.head.bias)
            model.head.weight.copy_(linear.head.weight.t())
    ids, y = _ids(N, T, seed=21), _labels(N, T, seed=22)
    y[1, 3] = ref.IGNORE
    batches = [(ids[:2], y[:2]), (ids[2:], y[2:])]
    torch.testing.assert_close(model(ids), linear(ids), rtol=1e-14, atol=1e-14)
    options = _options(loss=loss, estimator="ggn-topk", seed=7, samples=4, top_classes=2)
    want = _signal_reference(linear, batches, options, False, ("head",), None)
    formed, dense = [], losses.sequence_dense
    monkeypatch.setattr(losses, "sequence_dense", lambda *a, **kw: (formed.append(1), dense(*a, **kw))[1])
    monkeypatch.setattr(torch_session, "SEQUENCE_SIGNAL_ENTRIES", 1)  # one member of every group per block
    problems, _ = tb.layer_problems(model, batches, options)
    assert not formed
    assert {p.details["path"] for p in problems} == {"fast"}
    assert sorted(p.name for p in problems) == sorted(want)
    for p in problems:
        assert _relative_error(p.hessian_diag_samples, want[p.name]) < 1e-10, p.name


class WideHeadTagger(nn.Module):
    """A small embedding and dense layer under a dense head of 3000 classes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3000)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.emb(ids))))


def test_chunk_counts_the_signals_where_they_start(monkeypatch):
    """The chunk estimate counts per-sequence signals that start at a dense head's input at that
    input (4 entries per token here), not at the token logits (3000): under a budget the whole
    batch is one chunk, its signals back-propagated at once, where counting them at the logits
    took one sequence at a time with its signals in steps (method §9). The same numbers."""
    model = WideHeadTagger().to(DT).eval()
    ids = _ids(4, 8, seed=25)
    labels = torch.randint(0, 3000, (4, 8), generator=torch.Generator().manual_seed(26))
    options = _options(loss="ce", estimator="ggn-topk", seed=7, samples=10, top_classes=2)
    chosen, choose = [], torch_session.TorchSession._choose_chunk

    def spy(self, *args, **kwargs):
        chosen.append((choose(self, *args, **kwargs), self.signal_step))
        return chosen[-1][0]

    monkeypatch.setattr(torch_session.TorchSession, "_choose_chunk", spy)
    got, _ = tb.layer_problems(model, [(ids, labels)], options, memory_budget="8MB")
    assert chosen[0][0] >= 4 and chosen[0][1] is None  # the whole batch of 4 sequences
    monkeypatch.setattr(torch_session.TorchSession, "_head_input", lambda *args: None)  # counted at the logits
    chosen.clear()
    tb.layer_problems(model, [(ids, labels)], options, memory_budget="8MB")
    assert chosen[0][0] == 1 and chosen[0][1] is not None
    monkeypatch.undo()
    want, _ = tb.layer_problems(model, [(ids, labels)], options, chunk_size=1)
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.as_tensor(a.hessian_diag_samples), torch.as_tensor(b.hessian_diag_samples),
                                   rtol=1e-12, atol=1e-18)


@pytest.mark.parametrize("head", ["linear", "conv1d"])
def test_embedding_feature_rescaling_with_the_head_on_token_logits(head):
    """The default per-sequence ggn-topk with a dense head on the token logits (its squares from the
    token rows, the other layers' signals from its input, method §6.3): an embedding feature scaled
    by c and the next layer's input column by 1/c keep the function, every layer's normalized
    sharpness and the total; the trace moves."""
    model = _init(StructuredHeadTagger(head), seed=4)
    data = [(_ids(N, T, seed=23), _labels(N, T, seed=24))]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 10)
    with torch.no_grad():
        moved.emb.weight *= c[None, :]
        moved.proj.weight /= c[None, :]
    _assert_invariant(model, moved, _Call(data))


class MixingTagger(nn.Module):
    """Embedding, a convolution across the tokens (every position's gradient involves its
    neighbours' signals) and a dense head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Conv1d(D, D, 3, padding=1)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids).transpose(1, 2))).transpose(1, 2))


@pytest.mark.parametrize("estimator", ["ggn-topk", "ggn-mc"])
def test_sequence_signals_average_to_the_ggn_within_their_standard_errors(estimator):
    """Over several seeds the per-sequence estimates approach the exact per-token ggn, within a
    few of their reported standard errors, which hold the cross-token terms' spread: the seeds'
    own spread agrees with them. ggn-topk's dense head stays exact (method §6.3)."""
    model = _init(MixingTagger())
    data = [(_ids(4, T, seed=21), _labels(4, T, seed=22))]
    exact = _analyze(model, data, estimator="ggn")
    runs = [_analyze(model, data, estimator=estimator, samples=10, seed=s) for s in range(8)]
    assert all(r.metadata["sequence_signals"] for r in runs)
    for i, want in enumerate(exact.layers):
        traces = np.array([r.layers[i].hessian_trace for r in runs])
        errors = np.array([r.layers[i].standard_error["hessian_trace"] for r in runs])
        if estimator == "ggn-topk" and want.name == "head":
            np.testing.assert_allclose(traces, want.hessian_trace, rtol=1e-10)
            assert np.all(errors < 1e-12 * want.hessian_trace)
            continue
        se = math.sqrt(np.sum(errors ** 2)) / len(runs)  # of the mean over the seeds
        assert 0 < se < 0.2 * want.hessian_trace, want.name
        assert abs(traces.mean() - want.hessian_trace) < 4 * se, want.name
        spread = traces.std(ddof=1) / math.sqrt(len(runs))
        assert 0.3 < spread / se < 3, want.name


def test_per_token_signals_with_every_class_on_top_are_the_exact_ggn():
    """sequence_signals=False keeps one square per (token, signal) pair: ggn-topk with every class
    on top is the exact ggn; per sequence the signed top classes are an estimate (method §6.3)."""
    model = _init(TokenTagger())
    data = [(_ids(N, T), _labels(N, T))]
    exact = normflat.hessian_diagonal(model, data, estimator="ggn", progress=False)
    kw = dict(estimator="ggn-topk", top_classes=C, progress=False)
    per_token = normflat.hessian_diagonal(model, data, sequence_signals=False, **kw)
    per_sequence = normflat.hessian_diagonal(model, data, **kw)
    for name in exact:
        want = torch.as_tensor(exact[name])
        assert _relative_error(per_token[name], want) < 1e-10, name
    assert _relative_error(per_sequence["emb"], torch.as_tensor(exact["emb"])) > 1e-3
    assert _relative_error(per_sequence["head"], torch.as_tensor(exact["head"])) < 1e-10  # the exact head


def test_sequence_signals_in_the_report_metadata():
    """True/False for token logits under a GGN estimator (auto with sequence_signals=True takes
    ggn-topk), None without output signals or for (n, C) logits."""
    model = _init(TokenTagger())
    data = [(_ids(N, T), _labels(N, T))]
    cases = [({"estimator": "ggn-topk"}, True), ({"estimator": "ggn-mc", "sequence_signals": False}, False),
             ({"estimator": "ggn"}, False), ({"estimator": "hutchinson", "samples": 2}, None),
             ({"sequence_signals": True}, True)]
    for kw, want in cases:
        report = _analyze(model, data, **kw)
        assert report.metadata["sequence_signals"] is want, kw
    assert _analyze(model, data, sequence_signals=True).metadata["estimator"] == "ggn-topk"
    classifier = _init(AttentionTagger())
    pooled = [(_ids(N, T), _labels(N))]

    class Pooled(nn.Module):  # (n, C) logits: no token signals
        def __init__(self):
            super().__init__()
            self.inner = classifier

        def forward(self, ids):
            return self.inner(ids).mean(1)

    assert _analyze(Pooled(), pooled, estimator="ggn-topk").metadata["sequence_signals"] is None


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("estimator", ["ggn-topk", "ggn-mc"])
def test_signals_back_propagated_per_sequence_do_not_grow_with_the_tokens(estimator, fast, monkeypatch):
    """Per sequence, ggn-topk back-propagates K(min(k, C) + ⌈S/K⌉) signals (20 with the defaults;
    its empty shared group is skipped) and ggn-mc ⌈S/K⌉ per group, whatever T; per token T times
    as many, each (token, signal) pair its own (method §6.3)."""
    seen: list[int] = []
    backprop, generic = ggn_kernels.backprop_signals, ggn_kernels.generic_ggn

    def counting_backprop(logits, outs, sig, batched):
        seen.append(int(sig.shape[0]))
        return backprop(logits, outs, sig, batched)

    def counting_generic(model, inputs, sig, layers, pick, counts=None):
        seen.append(int(sig.shape[0]) if counts is not None else int(sig.shape[0] * sig.shape[1]))
        return generic(model, inputs, sig, layers, pick, counts=counts)

    monkeypatch.setattr(ggn_kernels, "backprop_signals", counting_backprop)
    monkeypatch.setattr(ggn_kernels, "generic_ggn", counting_generic)
    model = _init(TokenTagger())
    data = [(_ids(N, T), _labels(N, T))]
    per_sequence, per_token = (5 * (2 + 2), (1 + 5) * 2 * T) if estimator == "ggn-topk" else (10 * 1, 10 * 1 * T)
    for sequence_signals in (None, False):
        for run in (_analyze, normflat.hessian_diagonal):  # the group sums, and the pooled ones
            seen.clear()
            kw = {"progress": False} if run is normflat.hessian_diagonal else {}
            run(model, data, estimator=estimator, samples=10, sequence_signals=sequence_signals, fast=fast, **kw)
            if sequence_signals is None:
                assert seen == [per_sequence], run
            else:
                assert seen == [per_token], run
