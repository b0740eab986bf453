"""Torch attention, embeddings, recurrent layers and position tables against brute force (float64).

``ggn`` must equal the per-sample-Jacobian GGN diagonal (``torch.func.jacrev`` of
the logits w.r.t. every parameter, the per-token loss Hessian in the logits) to
1e-10, and ``exact`` the diagonal of the full autodiff Hessian (method §6, §6.3),
in the canonical layouts of method §3.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import normflat
from tests.arch import _torch_reference as ref

DT = torch.float64
V, D, T, N, C = 13, 8, 5, 3, 4


def _close(got: dict, want: dict, rtol: float = 1e-10) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        g = torch.as_tensor(got[k], dtype=DT)
        assert g.shape == want[k].shape, (k, g.shape, want[k].shape)
        scale = want[k].abs().max()
        assert scale > 0, k  # every analyzed weight reaches the loss in these models
        err = (g - want[k]).abs().max() / scale
        assert err < rtol, (k, float(err))


def _check_ggn(model, data, loss="nsce", tables=None, shift=False, **kw):
    got = normflat.hessian_diagonal(model, data, loss=loss, estimator="ggn", progress=False, **kw)
    want = ref.problems(model, ref.ggn_diagonal(model, data, loss, shift=shift), tables)
    _close(got, want)
    return got


def _ids(*shape, low=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, V, shape, generator=g)


def _labels(*shape, classes=C, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, classes, shape, generator=g)


# ----------------------------------------------------------------------------- models


class AttentionClassifier(nn.Module):
    """Embedding -> nn.MultiheadAttention (packed, or kdim/vdim) -> mean -> Linear."""

    def __init__(self, kdim=None, vdim=None):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.kdim, self.vdim = kdim, vdim
        self.to_k = nn.Linear(D, kdim, bias=False) if kdim else None
        self.to_v = nn.Linear(D, vdim, bias=False) if vdim else None
        self.att = nn.MultiheadAttention(D, 2, batch_first=True, kdim=kdim, vdim=vdim)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.emb(ids)
        k = self.to_k(h) if self.to_k is not None else h
        v = self.to_v(h) if self.to_v is not None else h
        a, _ = self.att(h, k, v)
        return self.head(torch.tanh(a).mean(1))


class TokenTagger(nn.Module):
    """Embedding (padding_idx) -> tanh -> Linear per token: token logits (n, T, C)."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


class BagClassifier(nn.Module):
    def __init__(self, mode, padding_idx=None, weighted=False, offsets=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode=mode, padding_idx=padding_idx)
        self.weighted, self.offsets = weighted, offsets
        self.head = nn.Linear(D, C)

    def forward(self, ids, w):
        psw = w if self.weighted else None
        if self.offsets:  # 1-D input with offsets, the bags of the rows
            n, length = ids.shape
            off = torch.arange(0, n * length, length, device=ids.device)
            h = self.bag(ids.reshape(-1), off, per_sample_weights=None if psw is None else psw.reshape(-1))
        else:
            h = self.bag(ids, per_sample_weights=psw)
        return self.head(torch.tanh(h))


class TinyLM(nn.Module):
    """Embedding + position table + transformer layer + LM head tied to the embedding."""

    def __init__(self, tied=True, padding_idx=None):
        super().__init__()
        self.wte = nn.Embedding(V, D, padding_idx=padding_idx)
        self.pos_embed = nn.Parameter(torch.randn(1, T, D) * 0.3)
        self.block = nn.TransformerEncoderLayer(D, 2, 12, dropout=0.0, batch_first=True)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, attention_mask=None):
        h = self.wte(input_ids) + self.pos_embed[:, :input_ids.shape[1]]
        mask = None if attention_mask is None else attention_mask == 0
        h = self.block(h, src_key_padding_mask=mask)
        return {"logits": self.lm_head(h)}


class Recurrent(nn.Module):
    def __init__(self, cell, **kw):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.rnn = cell(D, 3, batch_first=True, **kw)
        out = (kw.get("proj_size") or 3) * (2 if kw.get("bidirectional") else 1)
        self.head = nn.Linear(out, C)

    def forward(self, ids, h0=None):
        out, _ = self.rnn(self.emb(ids)) if h0 is None else self.rnn(self.emb(ids), h0)
        return self.head(out.mean(1))  # every step of both directions reaches the loss


class StateFirst(nn.Module):
    """A recurrent model's initial state given per sample, batch-first, as data: ``(n, layers, h)``
    moved to the ``(layers, n, h)`` torch's recurrent layers take."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids, h):
        return self.inner(ids, h.transpose(0, 1).contiguous())


def _init(model, seed=0):
    """``model`` in float64, eval mode, with weights drawn from ``seed`` alone (not from whatever
    ran before it was built): each module's own initialization again, every other parameter
    (the models' own tables) drawn anew, then noise (non-zero biases, asymmetric weights)."""
    torch.manual_seed(seed)
    model = model.to(DT).eval()
    reset = set()
    for module in model.modules():
        if hasattr(module, "reset_parameters") and module is not model:
            module.reset_parameters()
            reset.update(id(p) for p in module.parameters(recurse=False))
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in reset:
                p.copy_(torch.randn_like(p) * 0.3)
            p.add_(torch.randn_like(p) * 0.2)  # non-zero biases, asymmetric weights
    return model


# ----------------------------------------------------------------------------- ggn vs brute force


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_multihead_attention_packed(loss):
    model = _init(AttentionClassifier())
    data = [(_ids(N, T), _labels(N))]
    got = _check_ggn(model, data, loss)
    assert {"att.query", "att.key", "att.value", "att.out_proj"} <= set(got)


def test_multihead_attention_separate_kdim_vdim():
    model = _init(AttentionClassifier(kdim=6, vdim=5))
    data = [(_ids(N, T), _labels(N))]
    got = _check_ggn(model, data)
    assert got["att.key"].shape == (D, 6) and got["att.value"].shape == (D, 5)
    report = normflat.analyze(model, data, progress=False)
    assert {layer.details["path"] for layer in report.layers} == {"fast"}


class AttentionOptions(nn.Module):
    """Embedding -> ``nn.MultiheadAttention`` called one way -> tanh -> mean -> Linear: ``self``
    (packed self-attention), ``seq_first`` (``batch_first=False``), ``cross`` (another sequence
    as key and value), ``three`` (distinct query, key and value), ``masks`` (a key padding mask and a
    causal mask), ``bias_kv`` (``add_bias_kv``), ``zero_attn`` (``add_zero_attn``), ``weights`` (the
    per-head attention weights it returns used by the model), ``plain`` and ``plain_cross`` (no
    mask, ``need_weights=False``: the scaled dot-product attention without identity projections),
    ``plain_padding`` and ``plain_padding_float`` (the same with a boolean or an additive key padding
    mask, as ``nn.TransformerEncoderLayer`` given ``src_key_padding_mask``), ``plain_causal`` and
    ``plain_causal_float`` (a boolean or an additive causal ``attn_mask``), ``plain_is_causal`` (the
    causal mask with torch's ``is_causal`` hint, as ``nn.TransformerEncoder`` passes it),
    ``plain_causal_padding`` (a causal mask, the hint and a key padding mask) and ``plain_heads_mask``
    (an additive ``(N·heads, L, S)`` mask computed from each sample))."""

    def __init__(self, option):
        super().__init__()
        self.option = option
        self.emb = nn.Embedding(V, D)
        self.src = nn.Embedding(V, D) if option in ("cross", "three", "plain_cross") else None
        kw = {"add_bias_kv": True} if option == "bias_kv" else {"add_zero_attn": True} if option == "zero_attn" else {}
        self.att = nn.MultiheadAttention(D, 2, batch_first=option != "seq_first", **kw)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.emb(ids)
        other = None if self.src is None else torch.tanh(self.src(ids.flip(1)))
        if self.option == "seq_first":
            a, _ = self.att(h.transpose(0, 1), h.transpose(0, 1), h.transpose(0, 1))
            a = a.transpose(0, 1)
        elif self.option == "cross":
            a, _ = self.att(h, other[:, :-1], other[:, :-1])
        elif self.option == "three":
            a, _ = self.att(h, other, other * h)
        elif self.option == "masks":
            t = ids.shape[1]
            padding = (torch.arange(t) == t - 1)[None, :] & (ids[:, -1:] % 2 == 0)  # from the sample itself
            causal = torch.ones(t, t, dtype=torch.bool).triu(1)
            a, _ = self.att(h, h, h, key_padding_mask=padding, attn_mask=causal)
        elif self.option in ("plain_padding", "plain_padding_float"):
            t = ids.shape[1]
            padding = (torch.arange(t) >= t - 2)[None, :] & (ids[:, -1:] % 2 == 0)  # from the sample itself
            if self.option == "plain_padding_float":
                padding = padding.to(h.dtype) * -3.0
            a, _ = self.att(h, h, h, key_padding_mask=padding, need_weights=False)
        elif self.option.startswith("plain_causal") or self.option == "plain_is_causal":
            t = ids.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool).triu(1)
            if self.option == "plain_causal_float":
                causal = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
            padding = None
            if self.option == "plain_causal_padding":
                padding = (torch.arange(t) >= t - 2)[None, :] & (ids[:, -1:] % 2 == 0)
            a, _ = self.att(h, h, h, key_padding_mask=padding, attn_mask=causal, need_weights=False,
                            is_causal=self.option in ("plain_is_causal", "plain_causal_padding"))
        elif self.option == "plain_heads_mask":
            n, t = ids.shape
            scores = (ids[:, None, :, None] - ids[:, None, None, :]).to(h.dtype) / V  # (n, 1, T, T), per sample
            mask = (scores * torch.tensor([1.0, -2.0], dtype=h.dtype)[None, :, None, None]).reshape(n * 2, t, t)
            a, _ = self.att(h, h, h, attn_mask=mask, need_weights=False)
        elif self.option == "plain":
            a, _ = self.att(h, h, h, need_weights=False)
        elif self.option == "plain_cross":
            a, _ = self.att(h, other, other, need_weights=False)
        elif self.option == "weights":
            a, w = self.att(h, h, h, need_weights=True, average_attn_weights=False)  # w: (n, heads, T, T)
            a = a + w.sum(1) @ h
        else:
            a, _ = self.att(h, h, h)
        return self.head(torch.tanh(a).mean(1))


_ATTENTION_OPTIONS = ["self", "seq_first", "cross", "three", "masks", "bias_kv", "zero_attn", "weights", "plain",
                      "plain_cross", "plain_padding", "plain_padding_float", "plain_causal", "plain_causal_float",
                      "plain_is_causal", "plain_causal_padding", "plain_heads_mask"]


@pytest.mark.parametrize("option", _ATTENTION_OPTIONS)
def test_multihead_attention_options_take_the_fast_rule(option, monkeypatch):
    """``nn.MultiheadAttention`` applies its projections inside ``F.multi_head_attention_forward``;
    normflat applies them itself, recorded batch first, with the attention between them computed
    as torch's function computes it (method §6.1, "Attention projections applied functionally"):
    every projection on the fast path with every option of the call, against brute force;
    ``ggn-mc`` equal to the generic path."""
    from normflat.backends.torch import ggn as ggn_kernels

    plain, identities = [], []
    real = ggn_kernels.F.scaled_dot_product_attention
    monkeypatch.setattr(ggn_kernels.F, "scaled_dot_product_attention",
                        lambda *a, **k: plain.append(True) or real(*a, **k))
    with_identities = ggn_kernels._attention_with_identities
    monkeypatch.setattr(ggn_kernels, "_attention_with_identities",
                        lambda *a, **k: identities.append(True) or with_identities(*a, **k))
    model = _init(AttentionOptions(option))
    data = [(_ids(N, T), _labels(N)), (_ids(2, T, seed=3), _labels(2, seed=4))]
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    # The identity-free call (the heads' attention called by normflat itself) for the plain ones;
    # the attention written out where it returns its weights; torch's function with identity
    # projections only for a bias or zero attention added to the keys.
    assert bool(plain) == option.startswith("plain")
    assert bool(identities) == (option in ("bias_kv", "zero_attn"))
    paths = {layer.name: layer.details for layer in report.layers}
    assert all(paths[f"att.{name}"]["path"] == "fast" for name in ("query", "key", "value", "out_proj")), paths
    _check_ggn(model, data)
    _check_ggn(model, data, chunk_size=1)
    fast = normflat.hessian_diagonal(model, data, estimator="ggn-mc", samples=3, seed=2, progress=False)
    generic = normflat.hessian_diagonal(model, data, estimator="ggn-mc", samples=3, seed=2, progress=False,
                                        fast=False)
    _close(fast, {k: v.to(DT) for k, v in generic.items()})


class UnbatchedAttention(nn.Module):
    """``nn.MultiheadAttention`` called once per sample on a 2-D ``(T, E)`` input."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.att = nn.MultiheadAttention(D, 2)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(torch.stack([torch.tanh(self.att(x, x, x)[0]).mean(0) for x in h]))


def test_multihead_attention_called_unbatched_takes_the_generic_path_with_its_reason():
    model = _init(UnbatchedAttention())
    data = [(_ids(N, T), _labels(N))]
    report = normflat.analyze(model, data, progress=False)
    details = report.layer("att.query").details
    assert details["path"] == "generic" and "unbatched" in details["generic_reason"], details
    _check_ggn(model, data)


@pytest.mark.parametrize("loss", ["nsce", "ce"])
def test_embedding_repeated_ids_padding_and_token_logits_with_ignore_index(loss):
    model = _init(TokenTagger(padding_idx=2))
    ids = torch.tensor([[2, 5, 5, 7, 5], [1, 2, 2, 1, 9], [4, 4, 4, 4, 4]])
    y = _labels(N, T)
    y[0, 1], y[2, 4] = ref.IGNORE, ref.IGNORE
    data = [(ids, y)]
    got = _check_ggn(model, data, loss)
    assert got["emb"].shape == (D, V)
    assert torch.all(torch.as_tensor(got["emb"])[:, 2] == 0)  # no gradient at padding_idx
    report = normflat.analyze(model, data, loss=loss, progress=False)
    assert report.metadata["loss_terms"] == N * T - 2
    assert report.layers[0].details["path"] == "fast"


@pytest.mark.parametrize("shift", [True, False])
def test_embedding_fast_rule_equals_generic_path(shift):
    model = _init(TokenTagger())
    y = _labels(N, T, classes=C)
    data = [(_ids(N, T), y)]
    # The exact ggn (auto would take per-sequence ggn-topk for token logits, method §6.3).
    fast = normflat.hessian_diagonal(model, data, shift_labels=shift, progress=False, estimator="ggn")
    generic = normflat.hessian_diagonal(model, data, shift_labels=shift, progress=False, fast=False,
                                        estimator="ggn")
    want = ref.problems(model, ref.ggn_diagonal(model, data, "nsce", shift=shift))
    _close(fast, want)
    _close(generic, want)


@pytest.mark.parametrize("mode, padding_idx, weighted, offsets", [
    ("sum", None, True, False), ("mean", 3, False, False), ("mean", None, False, True), ("sum", 3, True, True),
    ("max", None, False, False)])
def test_embedding_bag(mode, padding_idx, weighted, offsets):
    model = _init(BagClassifier(mode, padding_idx, weighted, offsets))
    ids = torch.tensor([[3, 5, 5, 1], [7, 3, 3, 3], [0, 12, 12, 6]])
    w = torch.rand(N, 4, dtype=DT, generator=torch.Generator().manual_seed(3)) + 0.5
    data = [((ids, w), _labels(N))]
    _check_ggn(model, data)
    report = normflat.analyze(model, data, progress=False)
    assert report.layers[0].details["path"] == ("generic" if mode == "max" else "fast")


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_tied_lm_head_position_table_and_shifted_token_labels(padding_idx):
    """The head tied to the embedding takes the fast path: the lookup's and the head's per-sample
    gradients summed before squaring (the padding row gets the head's part only)."""
    model = _init(TinyLM(padding_idx=padding_idx))
    ids = _ids(2, T)
    if padding_idx is not None:
        ids[0, 1] = padding_idx
    y = ids.clone()
    y[1, 2] = ref.IGNORE  # after the shift: the label of position 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": y}
    data = [({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, y)]
    # The exact ggn: auto takes per-sequence ggn-topk for 5 tokens of 13 classes (method §6.3).
    got = normflat.hessian_diagonal(model, batch, shift_labels=True, estimator="ggn", progress=False)
    want = ref.problems(model, ref.ggn_diagonal(model, data, "nsce", shift=True), {"pos_embed": D})
    _close(got, want)
    report = normflat.analyze(model, batch, shift_labels=True, progress=False)
    names = [layer.name for layer in report.layers]
    assert "lm_head" not in names and names.count("wte") == 1
    wte = report.layers[names.index("wte")]
    assert wte.details["shared_with"] == ["lm_head"] and wte.shape == (D, V)
    assert wte.details["path"] == "fast"
    assert report.layers[names.index("pos_embed")].shape == (D, T)
    assert report.metadata["loss_terms"] == 2 * (T - 1) - 1


class PositionTagger(nn.Module):
    """Token embedding plus a learned position table, a dense mixer and a head (one logit row per
    sequence). ``use`` is how the forward reads the table: ``add`` as timm and Hugging Face do
    (sliced to the sequence), ``first`` indexing its leading axis, ``view`` reshaping it without a
    batch axis, ``alias`` through a second reference the module attributes do not hold."""

    def __init__(self, use="add", name="pos_embed", shape=(1, T, D)):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.name, self.use = name, use
        self.register_parameter(name, nn.Parameter(torch.randn(*shape) * 0.3))
        self.alias = [getattr(self, name)]
        self.mix = nn.Linear(D, 6)
        self.head = nn.Linear(6, C)

    def table(self, t):
        p = getattr(self, self.name)
        if self.use == "add":
            return p[:, :t] if p.dim() == 3 else p[:t]
        if self.use == "first":
            return p[0, :t]
        if self.use == "view":
            return p.view(T, D)[:t]
        return self.alias[0][:, :t]

    def forward(self, ids):
        h = self.emb(ids) + self.table(ids.shape[1])
        return self.head(torch.tanh(self.mix(h))).mean(1)


@pytest.mark.parametrize("name, shape, estimator", [
    ("pos_embed", (1, T, D), "ggn"), ("pos_embed", (1, T, D), "ggn-mc"), ("position_embeddings", (T, D), "ggn")])
def test_position_table_fast_rule_equals_brute_force_and_the_generic_path(name, shape, estimator):
    """The table's fast rule (method §6.1): the model runs with the table expanded over the batch,
    whose gradient is each sample's gradient of the table; the same numbers as the generic path,
    for every chunking (a chunk of one row, a remainder)."""
    model = _init(PositionTagger(name=name, shape=shape))
    data = [(_ids(N, T), _labels(N)), (_ids(2, T - 1, seed=5), _labels(2, seed=6))]
    kw = dict(progress=False, estimator=estimator, loss="nsce")
    fast = normflat.hessian_diagonal(model, data, **kw)
    generic = normflat.hessian_diagonal(model, data, fast=False, **kw)
    chunked = normflat.hessian_diagonal(model, data, chunk_size=2, **kw)
    if estimator == "ggn":
        _close(fast, ref.problems(model, ref.ggn_diagonal(model, data, "nsce"), {name: D}))
    _close(fast, {k: torch.as_tensor(v) for k, v in generic.items()})
    _close(chunked, {k: torch.as_tensor(v) for k, v in generic.items()})
    report = normflat.analyze(model, data, progress=False, estimator=estimator)
    table = report.layer(name)
    assert table.shape == (D, T) and table.kind == "position_embedding"
    assert table.details["path"] == "fast", table.details
    assert getattr(model, name).grad is None and getattr(model, name).shape == shape


@pytest.mark.parametrize("use", ["first", "view"])
@pytest.mark.parametrize("batches", [(N,), (1, N)])
def test_position_table_read_as_one_row_is_followed_to_the_batch(use, batches):
    """A forward that indexes or reshapes the table's leading axis would give wrong per-sample
    gradients with the expanded table (or break): the checks refuse the expansion, and the table is
    followed to where it meets the batch instead (method §6.1, "Layers on no batch axis"), on its
    fast rule with the brute-force diagonal. A first batch of one row cannot show the samples
    mixed (one sample's gradient is the whole gradient): that check waits for the second."""
    model = _init(PositionTagger(use=use))
    data = [(_ids(b, T, seed=i), _labels(b, seed=i + 5)) for i, b in enumerate(batches)]
    got = _check_ggn(model, data, tables={"pos_embed": D})
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    assert all(layer.details["path"] == "fast" for layer in report.layers), report.layer("pos_embed").details
    assert set(got) == {"emb", "pos_embed", "mix", "head"}


class WindowPositions(nn.Module):
    """TNT's pixel positions: a ``(1, 4, D)`` table added to every window of a batch folded into the
    leading axis, ``(n·2, 4, D)``, each sample's two windows in one block (``blocks``) or the windows
    of all samples interleaved (``interleaved``: no sample's own block)."""

    def __init__(self, layout="blocks"):
        super().__init__()
        self.layout = layout
        self.embed = nn.Linear(3, D)
        self.pixel_pos = nn.Parameter(torch.randn(1, 4, D) * 0.3)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, x):  # (n, 8, 3)
        n = x.shape[0]
        h = torch.tanh(self.embed(x))
        if self.layout == "blocks":
            w = h.reshape(2 * n, 4, D) + self.pixel_pos
            h = w.reshape(n, 8, D)
        else:
            w = h.reshape(n, 2, 4, D).transpose(0, 1).reshape(2 * n, 4, D) + self.pixel_pos
            h = w.reshape(2, n, 4, D).transpose(0, 1).reshape(n, 8, D)
        return self.head(torch.tanh(self.mix(h)).mean(1))


@pytest.mark.parametrize("layout, path", [("blocks", "fast"), ("interleaved", "generic")])
def test_position_table_over_a_folded_batch_is_followed(layout, path):
    """A table added to a batch folded into windows (TNT's pixel positions): its view expanded over
    the samples breaks the forward, so it is followed to the windows it meets, each sample's block
    of rows summed (method §6.1, "Layers on no batch axis"); windows of all samples interleaved
    take the generic path with the reason. The brute-force diagonal either way, in chunks too."""
    model = _init(WindowPositions(layout))
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(5, 8, 3, generator=g, dtype=DT), _labels(5))]
    for kw in ({}, {"chunk_size": 2}):
        _check_ggn(model, data, tables={"pixel_pos": D}, **kw)
    details = normflat.analyze(model, data, progress=False, estimator="ggn").layer("pixel_pos").details
    assert details["path"] == path, details
    if path == "generic":
        assert "one sample's signal reaches the other samples' rows where it meets the batch" in details["generic_reason"]


def test_position_table_reached_outside_its_module_attribute_is_refused(monkeypatch):
    """A table the forward reaches through a reference of its own (not the module attribute that
    ``functional_call`` swaps) would get no gradient at the expanded view: the graph check sees the
    parameter itself used and refuses the fast rule. The generic path swaps it with
    ``functional_call`` too, and would read its curvature as zero: the analysis is refused with the
    cause and the fix, never a silent zero."""
    from normflat.backends.torch import session

    reasons = []
    disable = session.TorchLayer.disable_fast
    monkeypatch.setattr(session.TorchLayer, "disable_fast", lambda self, why: (reasons.append((self.name, why)),
                                                                                disable(self, why))[1])
    model = _init(PositionTagger(use="alias"))
    with pytest.raises(ValueError, match=r"'pos_embed' through a reference other than their module attribute.*"
                                         r"nn\.ParameterList"):
        normflat.analyze(model, [(_ids(N, T), _labels(N))], progress=False, estimator="ggn")
    assert [name for name, why in reasons if "also used outside its module attribute" in why] == ["pos_embed"]


class PositionIds(nn.Module):
    """Position embeddings looked up from position ids of shape ``(1, T)`` (BERT, GPT-2), one row
    for the whole batch, broadcast when added. ``use``: ``add``; ``first`` taking row 0 of the
    lookup; ``view`` reshaping it without a batch axis; ``rows`` scaling the logits by its rows."""

    def __init__(self, use="add"):
        super().__init__()
        self.use = use
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.mix = nn.Linear(D, 6)
        self.head = nn.Linear(6, C)

    def forward(self, ids):
        p = self.pos(torch.arange(ids.shape[1])[None])
        if self.use == "first":
            p = p[0]
        elif self.use == "view":
            p = p.view(ids.shape[1], D)
        h = self.emb(ids) + p
        z = self.head(torch.tanh(self.mix(h))).mean(1)
        return z * p.shape[0] if self.use == "rows" else z


def test_embedding_of_position_ids_broadcast_over_the_batch_takes_its_fast_rule():
    """A lookup of ``(1, T)`` position ids has one output row for the batch: the capture expands
    its ids and output to the chunk's samples (views), so the gradient at the output is each
    sample's and the embedding's own fast rule applies (method §6.1)."""
    model = _init(PositionIds())
    data = [(_ids(N, T), _labels(N)), (_ids(2, T - 1, seed=5), _labels(2, seed=6))]
    got = _check_ggn(model, data)
    generic = normflat.hessian_diagonal(model, data, loss="nsce", estimator="ggn", fast=False, progress=False)
    _close(got, {k: torch.as_tensor(v) for k, v in generic.items()})
    _close(normflat.hessian_diagonal(model, data, loss="nsce", estimator="ggn", chunk_size=2, progress=False),
           {k: torch.as_tensor(v) for k, v in generic.items()})
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    assert report.layer("pos").details["path"] == "fast", report.layer("pos").details


@pytest.mark.parametrize("use", ["first", "view"])
@pytest.mark.parametrize("rows", [2, 7])
def test_one_row_output_used_as_one_row_is_followed_to_the_batch(use, rows):
    """A one-row output the model reads as one row before adding it to the activations (``p[0]``,
    ``p.view(T, D)``): expanded, it would mix the samples or break the forward, so the layer is
    followed to where its output meets the batch instead (method §6.1, "Layers on no batch
    axis"): the fast path, with the brute-force diagonal, in chunks too. Two rows: the first
    chunk's own forward is the one redone; seven: the probe's."""
    model = _init(PositionIds(use))
    data = [(_ids(rows, T), _labels(rows))]
    got = _check_ggn(model, data)
    _close(normflat.hessian_diagonal(model, data, loss="nsce", estimator="ggn", chunk_size=3, progress=False), got)
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    assert all(layer.details["path"] == "fast" for layer in report.layers), report.layer("pos").details


@pytest.mark.parametrize("use, reason", [
    ("rows", "computes other logits with the layer's one-row output expanded"),
])
def test_one_row_output_read_otherwise_takes_the_exact_generic_path(use, reason):
    """The expanded output must leave the logits alone: otherwise the layer takes the generic
    path, and the numbers stay exact (the forward runs again without the expansion where the
    logits changed). Two rows: no probe forward before the first chunk, whose own forward is the
    one checked and redone."""
    model = _init(PositionIds(use))
    data = [(_ids(2, T), _labels(2))]
    got = _check_ggn(model, data)
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    details = report.layer("pos").details
    assert details["path"] == "generic" and reason in details["generic_reason"], details
    assert report.layer("mix").details["path"] == "fast"
    assert set(got) == {"emb", "pos", "mix", "head"}


class MaskPositions(nn.Embedding):
    """OPT's learned positions: ids from the attention mask's running count, offset by 2, then
    ``nn.Embedding``'s lookup (``super().forward``). ``how``: ``super`` (that, its output then
    doubled in place), ``broadcast``
    (mBART's given position ids: one ``(1, T)`` row for the batch), ``twice`` (two lookups),
    ``index`` (``self.weight[ids]``, no ``F.embedding``), ``max_norm`` (a lookup renormalizing rows)."""

    def __init__(self, how="super"):
        super().__init__(T + 2, D)
        self.how = how

    def forward(self, mask):
        ids = (torch.cumsum(mask, dim=1) * mask - 1).long() + 2
        if self.how == "broadcast":
            return super().forward(torch.arange(mask.shape[1])[None] + 2)
        if self.how == "twice":
            return super().forward(ids) + super().forward(ids.flip(1))
        if self.how == "index":
            return self.weight[ids]
        if self.how == "max_norm":
            return nn.functional.embedding(ids, self.weight, max_norm=1e9)
        # An in-place operation on the lookup's output: the recorded output must stay apart.
        return super().forward(ids).mul_(2.0)


class MaskedTagger(nn.Module):
    def __init__(self, how="super"):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = MaskPositions(how)
        self.mix = nn.Linear(D, 6)
        self.head = nn.Linear(6, C)

    def forward(self, ids, mask):
        h = self.emb(ids) + self.pos(mask)
        return self.head(torch.tanh(self.mix(h)))


def _mask(n, t, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, t, dtype=torch.long)
    for i in range(n):
        mask[i, :int(torch.randint(0, 2, (1,), generator=g))] = 0  # some left padding
    return mask


@pytest.mark.parametrize("how", ["super", "broadcast"])
def test_embedding_with_its_own_forward_takes_the_recorded_lookup(how):
    """An ``nn.Embedding`` subclass computing its ids inside (OPT's and mBART's learned positions)
    takes ``nn.Embedding``'s fast rule on the ids and output of its one ``F.embedding`` lookup,
    recorded where it happens (method §6.1, "Embeddings with their own forward"): the same
    diagonal as brute force and as the generic path, for the exact and the sampled estimators."""
    model = _init(MaskedTagger(how))
    data = [((_ids(N, T), _mask(N, T, 1)), _labels(N, T)), ((_ids(2, T, seed=5), _mask(2, T, 2)), _labels(2, T, seed=6))]
    got = _check_ggn(model, data)
    assert set(got) == {"emb", "pos", "mix", "head"}
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    assert report.layer("pos").details["path"] == "fast", report.layer("pos").details
    for estimator, extra in (("ggn", {}), ("ggn-mc", {"samples": 4})):
        fast = normflat.hessian_diagonal(model, data, estimator=estimator, progress=False, seed=2, **extra)
        generic = normflat.hessian_diagonal(model, data, estimator=estimator, progress=False, seed=2, fast=False,
                                            **extra)
        _close(fast, generic)


class FunctionalQKV(nn.Module):
    """timm's BEiT attention: the packed projection's module is never called; its weight enters
    through ``F.linear`` with a bias put together from separate query and value biases. ``how``:
    ``keyword`` (``weight=`` given by name, as timm does), ``positional``, ``matmul`` (``x @ W.T``),
    ``einsum`` (no call to record), ``twice`` (two ``F.linear`` calls on the weight)."""

    def __init__(self, how="keyword"):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(D))
        self.v_bias = nn.Parameter(torch.zeros(D))
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        x = self.emb(ids)
        bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias), self.v_bias))
        if self.how == "keyword":
            qkv = F.linear(x, weight=self.qkv.weight, bias=bias)
        elif self.how == "positional":
            qkv = F.linear(x, self.qkv.weight, bias)
        elif self.how == "matmul":
            qkv = x @ self.qkv.weight.T + bias
        elif self.how == "einsum":
            qkv = torch.einsum("ntd,ed->nte", x, self.qkv.weight) + bias
        else:
            qkv = F.linear(x, self.qkv.weight, bias) + F.linear(x.flip(1), self.qkv.weight)
        q, k, v = qkv.chunk(3, -1)
        att = torch.softmax(q @ k.transpose(1, 2) / D ** 0.5, -1)
        return self.head(torch.tanh(att @ v))


@pytest.mark.parametrize("how", ["keyword", "positional", "matmul"])
def test_dense_weight_applied_through_f_linear_is_recorded_there(how):
    """A dense layer whose module the model never calls, its weight applied by one ``F.linear``
    call (timm's BEiT and EVA attention) or ``x @ W.T``: recorded at that call, ``nn.Linear``'s rule;
    the same diagonal as brute force and the generic path."""
    model = _init(FunctionalQKV(how))
    data = [(_ids(N, T), _labels(N, T)), (_ids(2, T, seed=5), _labels(2, T, seed=6))]
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    assert report.layer("qkv").details["path"] == "fast", report.layer("qkv").details
    got = _check_ggn(model, data)
    generic = normflat.hessian_diagonal(model, data, estimator="ggn", progress=False, fast=False)
    _close(got, generic)


class ProjectionsHandedToAttention(nn.Module):
    """WavLM's attention: four ``nn.Linear`` modules never called, their weights and biases handed to
    ``F.multi_head_attention_forward`` as separate projections, with a float ``attn_mask`` per sample
    and head (a gated position bias computed from the tokens) and a key padding mask; ``masks=False``:
    neither, and the attention weights not returned (the plain call)."""

    def __init__(self, masks=True):
        super().__init__()
        self.masks = masks
        self.emb = nn.Embedding(V, D)
        # o_proj: WavLM's out_proj (the reference reads a name ending in out_proj as nn.MultiheadAttention's)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        self.gate = nn.Linear(D // 2, 1) if masks else None
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        x = self.emb(ids)  # (n, T, D)
        n, t = ids.shape
        bias = mask = None
        if self.masks:
            gates = torch.sigmoid(self.gate(x.view(n, t, 2, D // 2).transpose(1, 2)))  # (n, heads, T, 1)
            bias = (gates * torch.linspace(-1.0, 1.0, t, dtype=x.dtype)).reshape(n * 2, t, t)
            mask = ids == 0
        seq = x.transpose(0, 1)
        out, _ = F.multi_head_attention_forward(
            seq, seq, seq, D, 2, torch.empty([0]),
            torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)), None, None, False, 0.0,
            self.o_proj.weight, self.o_proj.bias, False, mask, need_weights=self.masks, attn_mask=bias,
            use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight)
        return self.head(torch.tanh(out.transpose(0, 1)).mean(1))


@pytest.mark.parametrize("masks", [True, False])
def test_dense_weights_handed_to_multi_head_attention_are_recorded_there(masks):
    """Dense layers whose modules the model never calls, their weights handed to
    ``F.multi_head_attention_forward`` (WavLM): recorded where that call applies them, as
    ``nn.MultiheadAttention``'s (method §6.1, "Attention projections applied functionally"), with
    ``nn.Linear``'s rule; the same diagonal as brute force and the generic path."""
    model = _init(ProjectionsHandedToAttention(masks))
    data = [(_ids(N, T, low=1), _labels(N)), (_ids(2, T, seed=5), _labels(2, seed=6))]
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    assert all(layer.details["path"] == "fast" for layer in report.layers), [lr.details for lr in report.layers]
    got = _check_ggn(model, data)
    _close(got, normflat.hessian_diagonal(model, data, estimator="ggn", progress=False, fast=False))


@pytest.mark.parametrize("how, reason", [
    ("einsum", "not used through one F.linear call or product W @ x or x @ W.T"),
    ("twice", "module called 0 times per forward"),  # its weight used twice: never recorded
])
def test_dense_weight_applied_otherwise_takes_the_generic_path(how, reason):
    """An einsum (no call to record) or two ``F.linear`` calls: the generic path, exact."""
    model = _init(FunctionalQKV(how))
    data = [(_ids(N, T), _labels(N, T))]
    details = normflat.analyze(model, data, progress=False, estimator="ggn").layer("qkv").details
    assert details["path"] == "generic" and reason in details["generic_reason"], details
    _check_ggn(model, data)


class AppliedItself(nn.Module):
    """transformers' Mamba mixer, reduced: a depthwise causal ``nn.Conv1d`` the model never calls,
    applied by ``F.conv1d`` on a view of its weight (``weight.squeeze(1).unsqueeze(1)``) with the
    module's padding and groups, its first ``T`` positions kept; a dense ``proj`` never called,
    applied as ``proj.weight @ h`` on ``(n, D, T)`` with its bias added after (Mamba's ``dt_proj``);
    relus after both, so their output units can be rescaled. ``how``: ``functional``; ``transposed``,
    the product written ``(hᵀ @ Wᵀ)ᵀ``; ``padding``, the convolution called with another padding than
    its module's; ``einsum``, the product by ``torch.einsum``."""

    def __init__(self, how="functional"):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(V, D)
        self.conv = nn.Conv1d(D, D, 3, groups=D, padding=2)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.emb(ids).transpose(1, 2)  # (n, D, T)
        padding = 1 if self.how == "padding" else 2
        h = F.conv1d(h, self.conv.weight.squeeze(1).unsqueeze(1), self.conv.bias, padding=padding, groups=D)
        h = torch.relu(h[..., :ids.shape[1]])
        if self.how == "transposed":
            p = (h.transpose(1, 2) @ self.proj.weight.T).transpose(1, 2)
        elif self.how == "einsum":
            p = torch.einsum("oi,nil->nol", self.proj.weight, h)
        else:
            p = self.proj.weight @ h
        return self.head(torch.relu(p + self.proj.bias[:, None]).mean(-1))


class ImageAppliedItself(nn.Module):
    """A 2-D convolution the model never calls, applied by ``F.conv2d`` on its own weight with the
    module's stride and padding (keywords), a relu, a head on the flattened maps."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.head = nn.Linear(3 * 9, C)

    def forward(self, x):  # (n, 2, 6, 6)
        h = F.conv2d(x, weight=self.conv.weight, bias=self.conv.bias, stride=2, padding=(1, 1))
        return self.head(torch.relu(h).flatten(1))


def _image_data():
    g = torch.Generator().manual_seed(8)
    return [(torch.randn(N, 2, 6, 6, generator=g, dtype=DT), _labels(N)),
            (torch.randn(2, 2, 6, 6, generator=g, dtype=DT), _labels(2, seed=9))]


@pytest.mark.parametrize("build", ["tokens", "transposed", "image"])
def test_weights_the_model_applies_itself_are_recorded_where_applied(build):
    """Dense and convolution weights whose modules the model never calls, applied by the model itself
    (``F.conv1d`` on a view of the weight, ``W @ x`` or ``x @ W.T``, ``F.conv2d`` with keywords;
    transformers' Mamba):
    recorded at those calls, their modules' rules (method §6.1, "Weights the model applies itself");
    the same diagonal as brute force and the generic path, over batches of two sizes."""
    if build != "image":
        model = _init(AppliedItself("functional" if build == "tokens" else build))
        data = [(_ids(N, T), _labels(N)), (_ids(2, T, seed=5), _labels(2, seed=6))]
    else:
        model, data = _init(ImageAppliedItself()), _image_data()
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    assert all(layer.details["path"] == "fast" for layer in report.layers), [lr.details for lr in report.layers]
    got = _check_ggn(model, data)
    _close(got, normflat.hessian_diagonal(model, data, estimator="ggn", progress=False, fast=False))


@pytest.mark.parametrize("how, layer, reason", [
    ("padding", "conv", "not used through one functional convolution with the module's stride, padding"),
    ("einsum", "proj", "not used through one F.linear call or product W @ x or x @ W.T"),
])
def test_weights_applied_otherwise_than_their_module_take_the_generic_path(how, layer, reason):
    """A convolution applied with another padding than its module's (its rule reads the module's), or
    a dense weight applied by an einsum: the generic path with the reason, exact."""
    model = _init(AppliedItself(how))
    data = [(_ids(N, T), _labels(N))]
    details = normflat.analyze(model, data, progress=False, estimator="ggn").layer(layer).details
    assert details["path"] == "generic" and reason in details["generic_reason"], details
    _check_ggn(model, data)


@pytest.mark.parametrize("build", ["tokens", "image"])
def test_weights_the_model_applies_itself_rescaling_invariance(build):
    """The output units of the weights applied by the model itself times positive factors, the next
    layer's matching inputs divided by them (relus between): the depthwise convolution's channels
    against ``proj``'s columns, ``proj``'s rows against the head's columns; the 2-D convolution's
    channels against the head's columns of their maps. The function, the fast paths and every
    layer's normalized sharpness stay, the rescaled layers' traces move (method §8)."""
    g = torch.Generator().manual_seed(10)
    if build == "tokens":
        model, data = _init(AppliedItself()), [(_ids(N, T), _labels(N))]
        other = copy.deepcopy(model)
        a, b = (torch.exp(torch.randn(D, generator=g, dtype=DT)) for _ in range(2))
        with torch.no_grad():
            other.conv.weight.mul_(a[:, None, None]), other.conv.bias.mul_(a)
            other.proj.weight.div_(a[None, :]).mul_(b[:, None]), other.proj.bias.mul_(b)
            other.head.weight.div_(b[None, :])
        moved = ("conv", "proj", "head")
    else:
        model, data = _init(ImageAppliedItself()), _image_data()[:1]
        other = copy.deepcopy(model)
        a = torch.exp(torch.randn(3, generator=g, dtype=DT))
        with torch.no_grad():
            other.conv.weight.mul_(a[:, None, None, None]), other.conv.bias.mul_(a)
            other.head.weight.div_(a.repeat_interleave(9)[None, :])
        moved = ("conv", "head")
    torch.testing.assert_close(other(data[0][0]), model(data[0][0]), rtol=1e-12, atol=1e-13)
    before = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, data, loss="ce", estimator="ggn", progress=False)
    assert {layer.details["path"] for layer in (*before.layers, *after.layers)} == {"fast"}
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
    for name in moved:
        tb, ta = before.layer(name).hessian_trace, after.layer(name).hessian_trace
        assert abs(ta - tb) > 1e-3 * abs(tb), name


@pytest.mark.parametrize("how, reason", [
    ("twice", "module called 2 times per forward"),
    ("index", "does not look its weight up once with F.embedding"),
    ("max_norm", "does not look its weight up once with F.embedding"),
])
def test_embedding_with_its_own_forward_otherwise_takes_the_generic_path(how, reason):
    """Two lookups, a table read by indexing, or a lookup that renormalizes rows: not the lookup
    ``nn.Embedding``'s rule assumes, so the exact generic path, with the reason."""
    model = _init(MaskedTagger(how))
    data = [((_ids(N, T), _mask(N, T, 1)), _labels(N, T))]
    report = normflat.analyze(model, data, progress=False, estimator="ggn")
    details = report.layer("pos").details
    assert details["path"] == "generic" and reason in details["generic_reason"], details
    if how != "max_norm":  # a max_norm far above the rows' norms renormalizes nothing: brute force agrees
        _check_ggn(model, data)


@pytest.mark.parametrize("cell, kw", [
    (nn.RNN, dict(nonlinearity="tanh", num_layers=2, bidirectional=True)),
    (nn.RNN, dict(nonlinearity="relu")),
    (nn.LSTM, dict(num_layers=2, bidirectional=True, proj_size=2)),
    (nn.GRU, dict(num_layers=2, bidirectional=True)),
])
def test_recurrent_layers(cell, kw):
    model = _init(Recurrent(cell, **kw))
    data = [(_ids(N, 4), _labels(N))]
    got = _check_ggn(model, data)
    gates = {nn.LSTM: "ifgo", nn.GRU: "rzn", nn.RNN: ""}[cell]
    for g in gates:
        assert f"rnn.weight_ih_l0.{g}" in got and f"rnn.weight_hh_l0.{g}" in got
    if kw.get("bidirectional"):
        assert any(k.startswith("rnn.weight_ih_l1_reverse") for k in got)


@pytest.mark.parametrize("cell, kw", [
    (nn.RNN, dict(nonlinearity="tanh", num_layers=2, bidirectional=True)),
    (nn.RNN, dict(nonlinearity="relu", bias=False)),
    (nn.LSTM, dict(num_layers=2, bidirectional=True, proj_size=2)),
    (nn.LSTM, dict(bias=False)),
    (nn.GRU, dict(num_layers=2, bidirectional=True)),
])
@pytest.mark.parametrize("batch_first", [True, False])
def test_recurrent_fast_rules_equal_the_generic_path(cell, kw, batch_first):
    """Every recurrent weight takes its fast rule (the plain recurrence records what it multiplies
    at each step and a tap at its product, method §6.1, "Recurrent weights"), and every estimator's
    report equals the generic path's: the diagonals, the measures, the standard errors; the
    model's function is unchanged by the recording (the logits equal torch's fused kernel's)."""

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.rnn = cell(D, 3, batch_first=batch_first, **kw)
            out = (kw.get("proj_size") or 3) * (2 if kw.get("bidirectional") else 1)
            self.head = nn.Linear(out, C)

        def forward(self, ids, h0):
            x = self.emb(ids)
            if not batch_first:
                x = x.transpose(0, 1)
            state = (h0, torch.ones_like(h0[..., :1]).expand(*h0.shape[:-1], 3).contiguous()) \
                if cell is nn.LSTM else h0
            out, _ = self.rnn(x, state)
            if not batch_first:
                out = out.transpose(0, 1)
            return self.head(out)  # token logits

    model = _init(Tagger())
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    g = torch.Generator().manual_seed(3)
    h0 = torch.randn(N, layers, kw.get("proj_size") or 3, dtype=DT, generator=g)

    wrapped = StateFirst(model)
    data = [((_ids(N, T), h0), _labels(N, T)), ((_ids(2, T, seed=5), h0[:2] * 0.5), _labels(2, T, seed=6))]
    logits = wrapped(*data[0][0]).detach().clone()
    for estimator, extra in (("ggn", {}), ("ggn-mc", {"samples": 4}), ("ggn-topk", {"top_classes": 2})):
        fast = normflat.analyze(wrapped, data, estimator=estimator, progress=False, seed=3, **extra)
        generic = normflat.analyze(wrapped, data, estimator=estimator, progress=False, seed=3, fast=False, **extra)
        names = [layer.name for layer in fast.layers]
        assert [layer.name for layer in generic.layers] == names
        for lf, lg in zip(fast.layers, generic.layers):
            if lf.name.startswith("inner.rnn."):
                assert lf.details["path"] == "fast", (lf.name, lf.details)
            assert lg.details["path"] == "generic"
            if estimator == "ggn-topk" and lf.name == "inner.head":
                continue  # ggn-topk's fast dense head is exact (method §6.2); the generic path samples it
            for field in ("normalized_sharpness", "hessian_trace", "matrix_normalized_sharpness"):
                assert math.isclose(getattr(lf, field), getattr(lg, field), rel_tol=1e-10, abs_tol=1e-14), \
                    (estimator, lf.name, field)
            assert (lf.standard_error is None) == (lg.standard_error is None)
            for key, value in (lf.standard_error or {}).items():
                assert math.isclose(value, lg.standard_error[key], rel_tol=1e-8, abs_tol=1e-14), (lf.name, key)
        sampled = [layer for layer in fast.layers if layer.name.startswith("inner.rnn.") and layer.standard_error]
        assert bool(sampled) == (estimator != "ggn")  # the sampled estimators' errors compared too
        want = normflat.hessian_diagonal(wrapped, data, estimator=estimator, progress=False, seed=3, fast=False,
                                         **extra)
        got = normflat.hessian_diagonal(wrapped, data, estimator=estimator, progress=False, seed=3, **extra)
        if estimator == "ggn-topk":
            del got["inner.head"], want["inner.head"]
        _close(got, want)
    assert torch.equal(wrapped(*data[0][0]), logits)
    with torch.no_grad():
        state = (h0.transpose(0, 1).contiguous(), torch.ones(layers, N, 3, dtype=DT)) if cell is nn.LSTM \
            else h0.transpose(0, 1).contiguous()
        x = model.emb(data[0][0][0])
        fused, _ = model.rnn(x if batch_first else x.transpose(0, 1), state)
        plain = compat_recurrence_output(model.rnn, x if batch_first else x.transpose(0, 1), state)
    assert torch.allclose(plain, fused, rtol=1e-12, atol=1e-14)


def compat_recurrence_output(rnn, x, state):
    """The recorded recurrence's output (taps on every weight) for the fused kernel's input."""
    from normflat.backends.torch import compat

    seen = {}
    record = {id(p): (lambda name: lambda a, out, uses: seen.setdefault(name, uses))(n)
              for n, p in rnn.named_parameters() if n.startswith("weight_")}
    with compat.FunctionalKernels(attention=False), compat.recurrent_taps(record):
        out, _ = rnn(x, state)
    steps = x.shape[1] if rnn.batch_first else x.shape[0]
    assert all(uses == (1 if n.startswith("weight_ih") else steps) for n, uses in seen.items()), seen
    assert set(seen) == {n for n, _ in rnn.named_parameters() if n.startswith("weight_")}
    return out


def test_recurrent_with_initial_state():
    model = _init(Recurrent(nn.GRU))
    h0 = torch.randn(1, N, 3, dtype=DT, generator=torch.Generator().manual_seed(4))
    # h0 is per sample along axis 1: give it batch-first, the model moves the axis.
    wrapped = StateFirst(model)
    data = [((_ids(N, 4), h0.transpose(0, 1).contiguous()), _labels(N))]
    _check_ggn(wrapped, data)


def test_exact_matches_autodiff_hessian_on_attention_lstm_embedding():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.att = nn.MultiheadAttention(4, 2, batch_first=True)
            self.lstm = nn.LSTM(4, 2, batch_first=True)
            self.head = nn.Linear(2, 3)

        def forward(self, ids):
            h = self.emb(ids)
            a, _ = self.att(h, h, h, need_weights=False)  # the fused attention kernel
            out, _ = self.lstm(a)
            return self.head(out)  # token logits

    model = _init(Mixed())
    ids = torch.tensor([[1, 3, 3, 6], [0, 2, 5, 1]])
    y = torch.tensor([[0, 2, ref.IGNORE, 1], [1, 1, 0, 2]])
    data = [(ids, y)]
    names = [k for k, _ in model.named_parameters() if "weight" in k and "bias" not in k]
    want = ref.problems(model, ref.hessian_diagonal(model, data, "nsce", names))
    got = normflat.hessian_diagonal(model, data, estimator="exact", progress=False)
    _close(got, want)


def test_exact_through_transformer_encoder_layer_double_backward():
    model = _init(TinyLM(tied=False))
    ids = _ids(2, 3)
    data = [(ids, ids)]
    names = [k for k, _ in model.named_parameters()
             if k.endswith("weight") and "norm" not in k] + ["pos_embed"]
    want = ref.problems(model, ref.hessian_diagonal(model, data, "ce", names, shift=True), {"pos_embed": D})
    got = normflat.hessian_diagonal(model, data, loss="ce", estimator="exact", shift_labels=True,
                                    progress=False, force=True)
    _close(got, want)


def test_lstm_packing_its_padded_input_inside_the_forward():
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.lstm = nn.LSTM(D, 3, batch_first=True)
            self.head = nn.Linear(3, C)

        def forward(self, ids, lengths):
            packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths.cpu(), batch_first=True,
                                                       enforce_sorted=False)
            _, (h, _) = self.lstm(packed)
            return self.head(h[-1])

    model = _init(Packed())
    data = [((_ids(N, T), torch.tensor([5, 2, 3])), _labels(N))]
    _check_ggn(model, data)
    # torch's fused kernel runs a packed sequence: its steps cannot be recorded, so the recurrent
    # weights take the exact generic path and say why.
    for layer in normflat.analyze(model, data, estimator="ggn", progress=False).layers:
        if layer.name.startswith("lstm."):
            assert layer.details["path"] == "generic" and "fused kernel" in layer.details["generic_reason"]


def test_frozen_transformer_decoder_layer_in_eval_mode():
    """A frozen model in eval mode: torch's fused fast paths must not replace the layers whose
    gradients normflat needs (ggn against brute force)."""

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.enc = nn.TransformerEncoderLayer(D, 2, 12, dropout=0.0, batch_first=True)
            self.dec = nn.TransformerDecoderLayer(D, 2, 12, dropout=0.0, batch_first=True)
            self.head = nn.Linear(D, C)

        def forward(self, src, tgt):
            memory = self.enc(self.emb(src))
            causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=DT)
            return self.head(self.dec(self.emb(tgt), memory, tgt_mask=causal, tgt_is_causal=True))

    model = _init(Decoder())
    for p in model.parameters():
        p.requires_grad_(False)
    data = [((_ids(2, 4, seed=7), _ids(2, 3, seed=8)), _labels(2, 3))]
    _check_ggn(model, data)
    assert not any(p.requires_grad for p in model.parameters())


def test_register_layer_for_a_transposed_dense_layer_with_its_fast_rule():
    """A dense layer storing its weight (in, out), like Hugging Face's Conv1D: canonical transposed,
    fast rule ``transposed_linear_squares``; the same diagonal as the generic path and brute force."""
    from normflat.backends.torch import register_layer, registered_layers
    from normflat.backends.torch.ggn import transposed_linear_squares
    from normflat.backends.torch.layers import REGISTRY

    class InOut(nn.Module):
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.5)
            self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

        def forward(self, x):
            return x @ self.weight + self.bias

    model = _init(nn.Sequential(nn.Embedding(V, D), InOut(D, 6), nn.Tanh(), InOut(6, C)))
    data = [(_ids(N, T), _labels(N, T))]
    assert InOut not in registered_layers()
    register_layer(InOut, kind="dense", to_canonical=lambda m, t: t.T, ggn_squares=transposed_linear_squares)
    try:
        fast = normflat.analyze(model, data, progress=False)
        assert [layer.details["path"] for layer in fast.layers] == ["fast", "fast", "fast"]
        assert fast.layers[1].shape == (6, D)
        got = normflat.hessian_diagonal(model, data, progress=False, estimator="ggn")  # token logits: not auto
        generic = normflat.hessian_diagonal(model, data, progress=False, fast=False, estimator="ggn")
    finally:
        REGISTRY.unregister(InOut)
    native = ref.ggn_diagonal(model, data, "nsce")
    want = {"0": native["0.weight"].T, "1": native["1.weight"].T, "3": native["3.weight"].T}
    _close(got, want)
    _close(generic, want)


@pytest.mark.parametrize("cell, kw", [
    (nn.LSTM, dict(num_layers=2, bidirectional=True, proj_size=2)), (nn.LSTM, dict(bias=False)),
    (nn.GRU, dict(num_layers=2, bidirectional=True)), (nn.GRU, dict(bias=False)),
    (nn.RNN, dict(nonlinearity="relu", bidirectional=True)), (nn.RNN, dict(num_layers=2)),
])
@pytest.mark.parametrize("batch_first", [True, False])
def test_functional_recurrence_equals_the_fused_kernel(cell, kw, batch_first, monkeypatch):
    """The plain recurrence normflat differentiates (compat.FunctionalKernels) computes what torch's
    fused kernel computes: outputs and final states, batched and unbatched, with a given state."""
    from normflat.backends.torch import compat
    from normflat.backends.torch.compat import FunctionalKernels

    calls = []
    plain = compat._recurrence
    monkeypatch.setattr(compat, "_recurrence", lambda *a: calls.append(a[0]) or plain(*a))

    torch.manual_seed(0)
    rnn = cell(3, 4, batch_first=batch_first, **kw).to(DT).eval()
    x = torch.randn(2, 5, 3, dtype=DT)  # 2 sequences of 5 steps
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    h0 = torch.randn(layers, 2, kw.get("proj_size") or 4, dtype=DT)
    state = (h0, torch.randn(layers, 2, 4, dtype=DT)) if cell is nn.LSTM else h0
    for args in ((x,), (x, state), (torch.randn(5, 3, dtype=DT),)):  # the last one unbatched
        want = rnn(*args)
        with FunctionalKernels():
            got = rnn(*args)
        flat = [want[0], *(want[1] if isinstance(want[1], tuple) else (want[1],))]
        flat_got = [got[0], *(got[1] if isinstance(got[1], tuple) else (got[1],))]
        for a, b in zip(flat, flat_got):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    assert len(calls) == 3  # the plain recurrence ran, not the fused kernel


def test_subclass_with_its_own_forward_takes_the_exact_generic_path():
    """A Linear subclass that changes the computation must not get nn.Linear's fast rule."""
    import torch
    from torch import nn

    import normflat

    class Doubled(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(2 * x, self.weight, self.bias)

    class Plain(nn.Linear):
        pass

    torch.manual_seed(0)  # the test's own model init; normflat draws nothing from it
    model = nn.Sequential(Doubled(4, 5), nn.Tanh(), Plain(5, 3)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    rep = normflat.analyze(model, (x, y), progress=False)
    paths = {layer.name: layer.details["path"] for layer in rep.layers}
    assert paths == {"0": "generic", "2": "fast"}
    assert "overrides the forward of Linear" in rep.layers[0].details["generic_reason"]
    ref = normflat.analyze(model, (x, y), progress=False, fast=False)
    for a, b in zip(rep.layers, ref.layers):
        assert a.hessian_trace == pytest.approx(b.hessian_trace, rel=1e-12)


class Windowed(nn.Module):
    """Dense -> the batch folded into windows -> a dense layer per window -> merged -> mean -> head.

    ``layout``: ``"blocks"`` (each sample's two windows one after the other, as Swin's and
    MaxViT's window partitions), ``"window-major"`` (all samples' first windows, then their
    second ones), ``"time-major"`` (the dense layer on ``(positions, samples, d)``, a sequence-first
    layout: four rows, as many as a batch of four), or ``"shared"`` (the windows in blocks, plus a
    dense layer on a batch-independent ``(4, 2)`` coordinate table, a relative-position MLP, added
    to every sample).
    """

    def __init__(self, layout, activation=torch.tanh):
        super().__init__()
        self.layout, self.activation = layout, activation
        self.embed = nn.Linear(3, D)
        self.windowed = nn.Linear(D, D)
        self.coords_mlp = nn.Linear(2, D) if layout == "shared" else None
        self.register_buffer("coords", torch.linspace(-1, 1, 8, dtype=DT).reshape(4, 2))
        self.head = nn.Linear(D, C)

    def forward(self, x):  # (n, 4, 3)
        h = torch.tanh(self.embed(x))
        n = h.shape[0]
        if self.layout == "window-major":
            w = h.reshape(n, 2, 2, D).transpose(0, 1).reshape(2 * n, 2, D)
        elif self.layout == "time-major":
            w = h.transpose(0, 1)  # (4, n, D): as many rows as a batch of 4
        else:
            w = h.reshape(2 * n, 2, D)
        w = self.activation(self.windowed(w))
        if self.layout == "window-major":
            h = w.reshape(2, n, 2, D).transpose(0, 1).reshape(n, 4, D)
        elif self.layout == "time-major":
            h = w.transpose(0, 1)
        else:
            h = w.reshape(n, 4, D)
        if self.coords_mlp is not None:
            h = h + torch.tanh(self.coords_mlp(self.coords))  # (4, D), the same for every sample
        return self.head(h.mean(1))


@pytest.mark.parametrize("layout, generic", [
    ("blocks", {}),
    ("window-major", {"windowed": "not one block of rows per sample"}),
    ("shared", {}),
    ("time-major", {}),
])
@pytest.mark.parametrize("batches, kw", [((1, 4), {}), ((5,), {"chunk_size": 2}), ((3,), {"chunk_size": 1})])
def test_dense_layer_on_a_batch_folded_into_windows(layout, generic, batches, kw):
    """A dense layer whose input holds a block of rows per sample (attention windows) keeps its fast
    rule, each sample's gradient summed over its block (method §6.1), checked by a signal at one
    sample on the first chunk of two samples or more; rows of several samples in another order
    take the generic path. A layer on a batch-independent table (here of as many rows as a batch
    of 4) is followed to where it meets the batch (method §6.1, "Layers on no batch axis"), and a
    sequence-first layer is read with the samples on its second axis (method §6.1, "A batch folded
    into the leading axis").
    Against brute force with a first batch of one sample, chunks of two and of one (before, a
    chunk of one sample read the windows as samples: 60 % off on Swin's layers)."""
    model = _init(Windowed(layout), seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(batches), 4, 3, generator=g, dtype=DT)
    y = _labels(sum(batches))
    bounds = [0, *torch.tensor(batches).cumsum(0).tolist()]
    data = [(x[a:b], y[a:b]) for a, b in zip(bounds, bounds[1:])]
    rep = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False, **kw)
    several = kw.get("chunk_size") != 1  # a chunk of several samples (one sample owns every row)
    for layer in rep.layers:
        if layer.name in generic and several:
            assert layer.details["path"] == "generic", layer.name
            assert generic[layer.name] in layer.details["generic_reason"], layer.details
        else:
            assert layer.details["path"] == "fast", layer.details
    _check_ggn(model, data, loss="ce", **kw)


def test_folded_dense_layer_rescaling_invariance():
    """The windowed layer's output units times positive factors (a relu after it: positively
    homogeneous), the head's matching input columns divided by them: the function is unchanged,
    every layer's normalized sharpness stays, the rescaled layers' traces move (method §8), with
    the windowed layer on its folded fast rule."""
    model = _init(Windowed("blocks", activation=torch.relu), seed=5)
    other = copy.deepcopy(model)
    factors = torch.exp(torch.linspace(-1.0, 1.0, D, dtype=DT))
    with torch.no_grad():
        other.windowed.weight.mul_(factors[:, None])
        other.windowed.bias.mul_(factors)
        other.head.weight.div_(factors[None, :])
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(4, 4, 3, generator=g, dtype=DT), _labels(4)
    torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-13)
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, (x, y), loss="ce", estimator="ggn", progress=False)
    assert {layer.details["path"] for layer in before.layers} == {"fast"}
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
    for name in ("windowed", "head"):
        assert abs(after.layer(name).hessian_trace - before.layer(name).hessian_trace) > \
            1e-3 * abs(before.layer(name).hessian_trace), name


# ----------------------------------------------------------------------------- layers on no batch axis


HEADS = 2


class RelativeBias(nn.Module):
    """Windowed attention with a continuous relative-position bias (Swin V2): a small MLP maps a
    ``(1, 3, 3, 2)`` table of relative coordinates, the same for every sample, to one bias per head,
    gathered into ``(heads, 4, 4)``, squashed (``16·sigmoid``) and added to every window's attention
    logits; each sample's 8 tokens are 2 windows of 4. ``meet`` says where that bias meets the batch:
    ``add`` (``attn + bias[None]``, each sample's windows in one block of rows), ``mask`` (the bias
    as ``F.scaled_dot_product_attention``'s ``attn_mask``), ``repeat`` (also XCiT's positions: a 1×1
    convolution on a ``(1, 2, 2, 4)`` grid, repeated over the batch by the model itself and added to
    the tokens, and a second one after the attention), ``tile`` (DeBERTa's relative keys: the ``(heads, 4, 4)`` bias tiled over the windows
    by the model, ``repeat(2n, 1, 1)``, and added), ``window-major`` (the windows of all samples
    interleaved: a row of the attention is no sample's own block), ``matmul`` (the bias
    multiplies the attention: not a broadcast) or ``mixed`` (``add``, and a second batch-less layer
    whose output meets the batch in a matrix product); ``window-major+repeat`` and ``mask+repeat``
    add ``repeat``'s convolutions beside the bias (two chains, one of them failing a check)."""

    def __init__(self, meet: str = "add") -> None:
        super().__init__()
        self.meet = meet
        parts = set(meet.split("+"))
        self.embed = nn.Linear(3, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.cpb_in = nn.Linear(2, 6)
        self.cpb_out = nn.Linear(6, HEADS, bias=False)
        # Two of them: the second one's expansion breaks the forward after the first is followed.
        self.pos = nn.Conv2d(2, D, 1) if "repeat" in parts else None
        self.pos2 = nn.Conv2d(2, D, 1) if "repeat" in parts else None
        self.gain = nn.Linear(2, D) if meet == "mixed" else None
        self.head = nn.Linear(D, C)
        axis = torch.arange(-1.0, 2.0, dtype=DT)
        self.register_buffer("coords", torch.stack(torch.meshgrid(axis, axis, indexing="ij"), -1)[None])
        cells = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(2), indexing="ij"), -1).reshape(4, 2)
        relative = cells[:, None] - cells[None] + 1  # (4, 4, 2) in 0..2
        self.register_buffer("index", (relative[..., 0] * 3 + relative[..., 1]).reshape(-1))
        grid = torch.stack(torch.meshgrid(torch.linspace(-1, 1, 2), torch.linspace(-1, 1, 4), indexing="ij"))
        self.register_buffer("grid", grid[None].to(DT))

    def bias(self) -> torch.Tensor:
        table = self.cpb_out(torch.relu(self.cpb_in(self.coords))).view(-1, HEADS)  # (9, heads)
        return 16 * torch.sigmoid(table[self.index].view(4, 4, HEADS).permute(2, 0, 1))  # (heads, 4, 4)

    def forward(self, x):  # (n, 8, 3)
        n, parts = x.shape[0], set(self.meet.split("+"))
        h = torch.tanh(self.embed(x))
        if self.gain is not None:  # a second batch-less chain, meeting the batch in a matrix product
            h = h @ torch.diag(torch.tanh(self.gain(self.coords)).mean((0, 1, 2)))
        if self.pos is not None:
            h = h + self.pos(self.grid).repeat(n, 1, 1, 1).flatten(2).transpose(1, 2)
        if "window-major" in parts:
            w = h.reshape(n, 2, 4, D).transpose(0, 1).reshape(2 * n, 4, D)
        else:
            w = h.reshape(2 * n, 4, D)
        q, k, v = self.qkv(w).reshape(2 * n, 4, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        bias = self.bias()
        if "mask" in parts:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])
        else:
            attn = q @ k.transpose(-1, -2) / math.sqrt(D // HEADS)
            if self.meet == "matmul":
                attn = attn @ bias
            elif self.meet == "tile":
                attn = attn + bias.repeat(2 * n, 1, 1).view(2 * n, HEADS, 4, 4)
            else:
                attn = attn + bias[None]
            out = attn.softmax(-1) @ v
        out = out.transpose(1, 2).reshape(2 * n, 4, D)
        if "window-major" in parts:
            out = out.reshape(2, n, 4, D).transpose(0, 1)  # each sample's windows in one block again
        if self.pos2 is not None:
            out = out + self.pos2(self.grid).repeat(n, 1, 1, 1).flatten(2).transpose(1, 2).reshape(out.shape)
        return self.head(torch.tanh(out.reshape(n, 8, D)).mean(1))


def _relative_data(batches, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 8, 3, generator=g, dtype=DT), torch.randint(0, C, (b,), generator=g)) for b in batches]


@pytest.mark.parametrize("meet", ["add", "mask", "repeat", "tile"])
@pytest.mark.parametrize("batches, kw", [((5,), {}), ((1, 4), {"chunk_size": 3}), ((3,), {"chunk_size": 1})])
def test_layers_on_no_batch_axis_are_followed_to_the_batch(meet, batches, kw):
    """A relative-position MLP on a table shared by every sample, and a convolution whose one-row
    map the model repeats over the batch, take their fast rules (method §6.1, "Layers on no batch
    axis"): each sample's signals are read where their output meets the batch and pulled back to
    their outputs. The brute-force diagonal with a first batch of one sample (its rows checked on
    the second), chunks of three and of one."""
    model = _init(RelativeBias(meet), seed=2)
    data = _relative_data(batches)
    report = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False, **kw)
    assert all(layer.details["path"] == "fast" for layer in report.layers), [lr.details for lr in report.layers]
    _check_ggn(model, data, loss="ce", **kw)


def test_layers_on_no_batch_axis_sampled_estimators_equal_the_generic_path():
    """``ggn-mc`` and ``ggn-topk`` draw the same signals on both paths: the followed layers' sums equal
    the generic path's (under ``ggn-topk`` the fast path's dense head is exact, the generic path's
    estimated: method §6.2)."""
    model = _init(RelativeBias("add"), seed=2)
    data = _relative_data((6,))
    for kw in ({"estimator": "ggn-mc", "samples": 3}, {"estimator": "ggn-topk", "top_classes": 1, "samples": 2}):
        got = normflat.hessian_diagonal(model, data, loss="nsce", seed=4, progress=False, **kw)
        want = normflat.hessian_diagonal(model, data, loss="nsce", seed=4, progress=False, fast=False, **kw)
        if kw["estimator"] == "ggn-topk":
            del got["head"], want["head"]
        _close(got, {k: torch.as_tensor(v) for k, v in want.items()})


@pytest.mark.parametrize("meet, reason", [
    ("window-major", "one sample's signal reaches the other samples' rows where it meets the batch"),
    ("matmul", "meets the batch in matmul"),
])
def test_layers_on_no_batch_axis_that_cannot_be_followed_take_the_generic_path(meet, reason):
    """Where the batch-less bias meets the attention of interleaved windows, or enters a matrix
    product: the MLP takes the generic path with both reasons (why it failed the rows check, why
    it could not be followed), and the diagonal stays the brute-force one."""
    model = _init(RelativeBias(meet), seed=2)
    data = _relative_data((4,))
    report = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    for name in ("cpb_in", "cpb_out"):
        details = report.layer(name).details
        assert details["path"] == "generic" and reason in details["generic_reason"], details
        assert "followed to where it meets the batch" in details["generic_reason"]
    _check_ggn(model, data, loss="ce")


def test_a_chain_that_cannot_be_followed_leaves_the_others_followed():
    """Two batch-less chains, one meeting the batch in an addition, the other in a matrix product:
    only the second chain's layer takes the generic path, with its reason; the diagonal stays the
    brute-force one."""
    model = _init(RelativeBias("mixed"), seed=2)
    data = _relative_data((4,))
    report = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    details = report.layer("gain").details
    assert details["path"] == "generic" and "meets the batch in matmul" in details["generic_reason"], details
    assert all(report.layer(name).details["path"] == "fast" for name in ("cpb_in", "cpb_out", "qkv", "embed"))
    _check_ggn(model, data, loss="ce")


@pytest.mark.parametrize("batches, kw", [((4,), {}), ((1, 4), {"chunk_size": 3})])
def test_a_chain_failing_the_rows_check_where_it_meets_leaves_the_others_followed(batches, kw):
    """Two batch-less chains: the bias MLP meets the attention of interleaved windows (no sample's
    own block of rows), the position convolutions meet the batch where the model repeats them
    per sample (each sample's tokens in one block). The rows check at the meetings refuses only
    the chain it fails at (method §6.1, "Layers on no batch axis"), with its reason; the
    convolutions stay followed on their fast rule, and the diagonal is the brute-force one, also
    with a first batch of one sample (checked on the second)."""
    model = _init(RelativeBias("window-major+repeat"), seed=2)
    data = _relative_data(batches)
    report = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False, **kw)
    for name in ("cpb_in", "cpb_out"):
        details = report.layer(name).details
        assert details["path"] == "generic", details
        assert "one sample's signal reaches the other samples' rows where it meets the batch" in \
            details["generic_reason"], details
    assert all(report.layer(name).details["path"] == "fast" for name in ("pos", "pos2", "embed", "head"))
    _check_ggn(model, data, loss="ce", **kw)


def test_a_path_the_meetings_miss_sends_the_followed_layers_to_the_generic_path(monkeypatch):
    """The first forward that follows the layers checks that every path from their outputs to the
    logits goes through a recorded meeting: with one meeting hidden (the bias passed to the
    attention mask as it is), the layers take the generic path and the diagonal stays exact; a
    second chain whose paths are whole (the position convolutions) stays followed."""
    from normflat.backends.torch import ggn as ggn_kernels

    real = ggn_kernels.BatchlessTaps._meet

    def hide_masks(self, func, args, kwargs, batchless):
        if func is F.scaled_dot_product_attention:
            return args, kwargs
        return real(self, func, args, kwargs, batchless)

    monkeypatch.setattr(ggn_kernels.BatchlessTaps, "_meet", hide_masks)
    for meet in ("mask", "mask+repeat"):  # beside a chain whose paths are whole, which stays followed
        model = _init(RelativeBias(meet), seed=2)
        data = _relative_data((4,))
        report = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
        for name in ("cpb_in", "cpb_out"):
            details = report.layer(name).details
            assert details["path"] == "generic", details
            assert "reaches the logits other than where it meets the batch" in details["generic_reason"], details
        others = [layer for layer in report.layers if not layer.name.startswith("cpb")]
        assert all(layer.details["path"] == "fast" for layer in others), [lr.details for lr in others]
        assert {layer.name for layer in others} >= ({"pos", "pos2"} if meet == "mask+repeat" else set())
        _check_ggn(model, data, loss="ce")


def test_relative_bias_rescaling_invariance():
    """The MLP's hidden units times positive factors (a ReLU between: ``cpb_in`` rows and bias
    times ``c``, ``cpb_out`` columns over ``c``) leave the bias unchanged: the followed layers'
    normalized sharpness stays and their trace moves (method §8)."""
    model = _init(RelativeBias("add"), seed=2)
    other = copy.deepcopy(model)
    c = torch.exp(torch.randn(6, generator=torch.Generator().manual_seed(3), dtype=DT))
    with torch.no_grad():
        other.cpb_in.weight.mul_(c[:, None]), other.cpb_in.bias.mul_(c)
        other.cpb_out.weight.div_(c[None])
    data = _relative_data((5,))
    x = data[0][0]
    torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-12)
    before = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, data, loss="ce", estimator="ggn", progress=False)
    for name in ("cpb_in", "cpb_out"):
        lb, la = before.layer(name), after.layer(name)
        assert la.details["path"] == "fast"
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), name
        assert abs(la.hessian_trace - lb.hessian_trace) > 1e-3 * abs(lb.hessian_trace), name


class SharedProjection(nn.Module):
    """DeBERTa-v3's disentangled attention in small: the key projection applied to the tokens and
    to relative embeddings (the weight of an ``nn.Embedding`` read as a tensor, normalized: its
    module never runs), those keys tiled per sample by the model (``repeat``) and their
    content-to-position scores gathered at each pair's relative distance and added."""

    def __init__(self, eps=1e-5, p2c=False):
        super().__init__()
        self.eps, self.p2c = eps, p2c
        self.emb = nn.Embedding(V, D)
        self.rel = nn.Embedding(2 * T - 1, D)
        self.query, self.key, self.value = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, C)
        position = torch.arange(T)
        self.register_buffer("distance", (position[None] - position[:, None] + T - 1))  # (T, T) in 0..2T-2

    def forward(self, ids):
        x = self.emb(ids)
        n = x.shape[0]
        q, k, v = self.query(x), self.key(x), self.value(x)
        rel = F.layer_norm(self.rel.weight, (D,), eps=self.eps)  # (2T-1, D), the same for every sample
        keys = self.key(rel[None]).repeat(n, 1, 1)  # (n, 2T-1, D)
        c2p = torch.gather(torch.bmm(q, keys.transpose(1, 2)), -1, self.distance.expand(n, T, T))
        if self.p2c:  # DeBERTa-v2's position-to-content scores: the weight read again, unnormalized
            queries = self.query(self.rel.weight[None]).repeat(n, 1, 1)
            c2p = c2p + torch.gather(torch.bmm(k, queries.transpose(1, 2)), -1, self.distance.expand(n, T, T))
        att = torch.softmax((q @ k.transpose(1, 2) + c2p) / D ** 0.5, -1)
        return self.head(torch.tanh(att @ v).mean(1))


@pytest.mark.parametrize("p2c", [False, True])
@pytest.mark.parametrize("batches, kw", [((N,), {}), ((1, 4), {"chunk_size": 3}), ((3,), {"chunk_size": 1})])
def test_weight_applied_to_the_batch_and_to_a_batchless_tensor(batches, kw, p2c):
    """A projection called on the tokens and on relative embeddings, and the embeddings' weight read
    as a tensor (DeBERTa-v3): the batch-less call is followed to where it meets the batch, its
    per-sample gradients summed with the other call's before squaring (method §6.1, "Tied
    weights"), and the weight read as a tensor is its own followed output, squared as a table
    (method §6.1, "Layers on no batch axis"); ``p2c``: the query projection too, and the weight
    read twice (DeBERTa-v2's position-to-content scores). The brute-force diagonal, first batch of
    one sample, chunks of three and one."""
    model = _init(SharedProjection(p2c=p2c))
    data = [(_ids(b, T, seed=i), _labels(b, seed=i + 5)) for i, b in enumerate(batches)]
    report = normflat.analyze(model, data, progress=False, estimator="ggn", **kw)
    assert all(layer.details["path"] == "fast" for layer in report.layers), [lr.details for lr in report.layers]
    _check_ggn(model, data, **kw)


def test_shared_projection_and_weight_read_as_a_tensor_rescaling_invariance():
    """The key projection's output units times positive factors and the query's over them leave
    every score unchanged (the keys of the tokens and of the relative embeddings alike), and a row
    of the relative embeddings times a positive factor leaves its normalization unchanged (a
    negligible ``eps``): the followed layers' normalized sharpness stays and their trace moves
    (method §8)."""
    model = _init(SharedProjection(eps=1e-30))
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    c = torch.exp(torch.randn(D, generator=g, dtype=DT))
    r = torch.exp(torch.randn(2 * T - 1, generator=g, dtype=DT))
    with torch.no_grad():
        other.key.weight.mul_(c[:, None]), other.key.bias.mul_(c)
        other.query.weight.div_(c[:, None]), other.query.bias.div_(c)
        other.rel.weight.mul_(r[:, None])
    data = [(_ids(5, T), _labels(5))]
    torch.testing.assert_close(other(data[0][0]), model(data[0][0]), rtol=1e-12, atol=1e-12)
    before = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, data, loss="ce", estimator="ggn", progress=False)
    for name in ("query", "key", "rel"):
        lb, la = before.layer(name), after.layer(name)
        assert la.details["path"] == "fast", la.details
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), name
        assert abs(la.hessian_trace - lb.hessian_trace) > 1e-3 * abs(lb.hessian_trace), name


class GridPositions(nn.Module):
    """XCiT's positions with a hidden layer: two 1×1 convolutions (a ReLU between) on a batch-less
    ``(1, 2, 2, 4)`` grid, the map repeated over the batch by the model and added to the tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.pos_in, self.pos_out = nn.Conv2d(2, 6, 1), nn.Conv2d(6, D, 1)
        self.head = nn.Linear(D, C)
        grid = torch.stack(torch.meshgrid(torch.linspace(-1, 1, 2), torch.linspace(-1, 1, 4), indexing="ij"))
        self.register_buffer("grid", grid[None].to(DT))

    def forward(self, x):  # (n, 8, 3)
        pos = self.pos_out(torch.relu(self.pos_in(self.grid))).repeat(x.shape[0], 1, 1, 1)
        return self.head(torch.tanh(self.embed(x) + pos.flatten(2).transpose(1, 2)).mean(1))


def test_followed_convolutions_rescaling_invariance():
    """The hidden channels of two followed convolutions times positive factors (``pos_in``'s output
    channels and bias by ``c``, ``pos_out``'s input channels by ``1/c``): the function, the fast path
    and the normalized sharpness stay, the traces move (method §8); the diagonal is the brute-force
    one."""
    model = _init(GridPositions())
    other = copy.deepcopy(model)
    c = torch.exp(torch.randn(6, generator=torch.Generator().manual_seed(4), dtype=DT))
    with torch.no_grad():
        other.pos_in.weight.mul_(c[:, None, None, None]), other.pos_in.bias.mul_(c)
        other.pos_out.weight.div_(c[None, :, None, None])
    data = _relative_data((5,))
    torch.testing.assert_close(other(data[0][0]), model(data[0][0]), rtol=1e-12, atol=1e-12)
    _check_ggn(model, data, loss="ce")
    before = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, data, loss="ce", estimator="ggn", progress=False)
    for name in ("pos_in", "pos_out"):
        lb, la = before.layer(name), after.layer(name)
        assert la.details["path"] == "fast", la.details
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), name
        assert abs(la.hessian_trace - lb.hessian_trace) > 1e-3 * abs(lb.hessian_trace), name


class SequenceFirst(nn.Module):
    """PyTorch's transformer tutorial layout: token ids ``(T, n)``, an embedding, an
    ``nn.TransformerEncoder`` without ``batch_first`` (every dense layer on ``(T, n, d)``), then a
    dense layer on the first token alone, ``(1, n, d)`` (Longformer's global projections: one row
    that is a position, not the batch), added to every token, the mean over the tokens, a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 2, 12, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.first = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, ids):  # (n, T), read as the tutorial's (T, n)
        h = self.enc(self.emb(ids.t()))
        h = h + torch.tanh(self.first(h[:1]))
        return self.head(h.mean(0))


@pytest.mark.parametrize("batches, kw", [((N,), {}), ((1, 4), {"chunk_size": 3}), ((3,), {"chunk_size": 1})])
def test_sequence_first_layers_take_their_fast_rules(batches, kw):
    """A dense layer or an embedding with the samples on its second axis (``(T, n, d)``) is read
    with them brought to the front, once a signal at the last sample's logits is seen to reach only
    its own column (method §6.1, "A batch folded into the leading axis"): the fast path, with the
    brute-force diagonal, a first batch of one sample, chunks of three and one."""
    model = _init(SequenceFirst())
    data = [(_ids(b, T, seed=i), _labels(b, seed=i + 5)) for i, b in enumerate(batches)]
    report = normflat.analyze(model, data, progress=False, estimator="ggn", **kw)
    assert all(layer.details["path"] == "fast" for layer in report.layers), [lr.details for lr in report.layers]
    _check_ggn(model, data, **kw)


def two_analyses_beside_a_forward(model, analyze, forward):
    """``analyze(copy)`` in two threads at once, each on its own copy of ``model``, while a third
    thread calls ``forward(copy)`` on another copy until both end: the two results (the first
    error raised)."""
    import threading

    results, errors = {}, []
    stop = threading.Event()

    def run(key, m):
        try:
            results[key] = analyze(m)
        except BaseException as why:  # noqa: BLE001 - reported by the main thread
            errors.append(why)

    def loop(m):
        while not stop.is_set():
            forward(m)

    threads = [threading.Thread(target=run, args=(i, copy.deepcopy(model))) for i in range(2)]
    other = threading.Thread(target=loop, args=(copy.deepcopy(model),))
    other.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    other.join()
    assert not errors, errors
    return results[0], results[1]


@pytest.mark.parametrize("meet", ["add", "repeat"])
def test_followed_layers_in_threads(meet):
    """The function mode that follows layers on no batch axis is the analysis thread's own: two
    analyses at once, while a third thread runs the model outside any analysis, give the sequential
    numbers, and no mode is left on any thread."""
    model = _init(RelativeBias(meet), seed=2)
    data = _relative_data((4,))
    want = normflat.hessian_diagonal(model, data, loss="ce", estimator="ggn", progress=False)
    modes = []

    def analyze(m):
        got = normflat.hessian_diagonal(m, data, loss="ce", estimator="ggn", progress=False)
        modes.append(len(torch.overrides._get_current_function_mode_stack()))
        return got

    def forward(m):
        with torch.no_grad():
            m(data[0][0])
        modes.append(len(torch.overrides._get_current_function_mode_stack()))

    results = two_analyses_beside_a_forward(model, analyze, forward)
    assert set(modes) == {0} and not torch.overrides._get_current_function_mode_stack()
    for got in results:
        for name in want:
            assert torch.equal(torch.as_tensor(got[name]), torch.as_tensor(want[name])), name


# ----------------------------------------------------------------------------- one-sample batch norm


class _NormTokens(nn.Module):
    """A convolution, a normalization of its channels, then the channels read as tokens
    (``flatten(2).transpose(1, 2)``, CvT's and LeViT's layout), a dense layer, the mean token, a
    head. The gradient that reaches the normalization is laid out channels-last, and the
    convolution's output, whose gradient the fast rule takes, is the normalization's input."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = norm
        self.mix = nn.Linear(4, 5)
        self.head = nn.Linear(5, C)

    def forward(self, x):
        tokens = self.norm(self.conv(x)).flatten(2).transpose(1, 2)
        return self.head(torch.tanh(self.mix(tokens)).mean(1))


@pytest.mark.parametrize("norm", ["batch", "batch3d", "instance"])
@pytest.mark.parametrize("estimator", ["ggn", "exact"])
def test_norm_layers_on_one_sample_chunks(norm, estimator):
    """Normalization layers (eval-mode BatchNorm2d/3d, InstanceNorm) read as tokens, on chunks of one
    sample and on batches of one sample, against brute force, with the workaround for torch's CPU
    backward of batch normalization on one sample in place (compat.one_sample_norm_gradients; the
    bug itself shows in Hugging Face CvT, tests/arch/test_huggingface_models.py), whose hooks are
    gone afterwards."""
    if norm == "batch3d":
        class Model3d(_NormTokens):
            def forward(self, x):  # the same with a depth axis of 1 around the normalization
                tokens = self.norm(self.conv(x)[:, :, None]).flatten(2).transpose(1, 2)
                return self.head(torch.tanh(self.mix(tokens)).mean(1))

        model = Model3d(nn.BatchNorm3d(4))
    else:
        model = _NormTokens(nn.BatchNorm2d(4) if norm == "batch" else nn.InstanceNorm2d(4, affine=True))
    model = _init(model.to(DT), seed=3).eval()
    with torch.no_grad():
        if norm != "instance":
            model.norm.running_mean.normal_(0.0, 0.5)
            model.norm.running_var.uniform_(0.5, 2.0)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(3, 2, 4, 4, generator=g, dtype=DT), torch.tensor([0, 3, 1])
    singles = [(x[i:i + 1], y[i:i + 1]) for i in range(3)]
    if estimator == "ggn":
        want = ref.problems(model, ref.ggn_diagonal(model, [(x, y)], "nsce"))
    else:
        names = ["conv.weight", "mix.weight", "head.weight"]
        want = ref.problems(model, ref.hessian_diagonal(model, [(x, y)], "nsce", names))
    for data, kw in (((x, y), dict(chunk_size=1)), (singles, {})):
        got = normflat.hessian_diagonal(model, data, loss="nsce", estimator=estimator, progress=False, **kw)
        _close({k: got[k] for k in want}, want, rtol=1e-9)
    assert not model.conv._forward_hooks and not model.norm._forward_hooks  # the workaround's hooks are gone


class _ConvertingRouter(nn.Module):
    """A router that converts its classifier in its forward, as Hugging Face's Switch Transformers and
    NLLB-MoE routers do (``self.classifier = self.classifier.to(self.dtype)``), before an expert."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(D, D)
        self.expert = nn.Linear(D, C)
        self.convert = True  # False: the same function without the conversion (the references')

    def forward(self, x):
        if self.convert:
            self.classifier = self.classifier.to(self.expert.weight.dtype)
        return self.expert(torch.softmax(self.classifier(x), -1) * x)


@pytest.mark.parametrize("estimator", ["ggn", "exact"])
def test_module_converted_in_its_forward_under_torch_func(estimator):
    """A ``.to()`` that changes nothing, in the forward, under the ``torch.func`` transforms of the generic
    path and of the Hessian-vector products: it used to re-assign the parameters' ``.data`` inside the
    transform, which failed in torch and left the parameter broken (the next use crashed the process).
    Now the numbers are brute force's, on the generic path, and the model is as it was."""
    model = _init(_ConvertingRouter(), seed=5)
    weights = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(4, D, generator=g, dtype=DT), torch.tensor([0, 1, 3, 2])
    plain = copy.deepcopy(model)  # torch.func's references run the same function without the conversion
    plain.convert = False
    if estimator == "ggn":
        want = ref.problems(plain, ref.ggn_diagonal(plain, [(x, y)], "nsce"))
        _close(normflat.hessian_diagonal(model, (x, y), loss="nsce", estimator="ggn", fast=False, progress=False),
               want)
    else:
        names = ["classifier.weight", "expert.weight"]
        want = ref.problems(plain, ref.hessian_diagonal(plain, [(x, y)], "nsce", names))
        _close(normflat.hessian_diagonal(model, (x, y), loss="nsce", estimator="exact", progress=False), want)
    for name, (p, value) in weights.items():
        assert model.get_parameter(name) is p and torch.equal(p, value), name
    assert all("to" not in m.__dict__ for m in model.modules())
    model(x)  # still usable


class _InBatchScores(nn.Module):
    """Each sample's embedding scored against every sample's of the batch (a contrastive model's
    ``logits_per_image``): the logits of a sample depend on the others."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, 4)

    def forward(self, x):
        e = torch.tanh(self.embed(x))
        return e @ e.T


class _QueriesAgainstInputs(nn.Module):
    """Projections of each sample scored against the batch's raw inputs: ``(n, n)`` logits whose
    layers all have fast rules, each sample's signal reaching only its own rows of them."""

    def __init__(self):
        super().__init__()
        self.query = nn.Linear(D, 6)
        self.key = nn.Linear(6, D)

    def forward(self, x):
        return self.key(torch.tanh(self.query(x))) @ x.T


#: The distinctive part of the engine's error (normflat.engine.losses.check_same_classes).
MIXED = "follows the number of samples the model is called on, so each sample's logits depend on the other samples"


@pytest.mark.parametrize("n,fast", [(3, True), (2, False)])
def test_logits_mixing_the_samples_are_refused_clearly(n, fast):
    """Logits whose width is the batch (scores against in-batch candidates) cannot be analyzed per sample:
    a clear error naming the cause, not a shape mismatch from inside torch. Found by the probe of 2 rows
    against the batch of 3; in a batch of 2 (no probe) on the generic path, by its forwards of one sample."""
    model = _init(_InBatchScores(), seed=7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, D, generator=g, dtype=DT)
    with pytest.raises(ValueError, match=MIXED):
        normflat.hessian_diagonal(model, (x, torch.arange(n) % 2), loss="ce", estimator="ggn", fast=fast,
                                  progress=False)


def test_logits_mixing_the_samples_on_the_fast_path():
    """In-batch scores whose layers all take the fast rules (no signal crosses the samples inside them, so
    the rows check passes and no generic path meets them): numbers that depended on the chunking, now
    refused where the rows of two calls differ, the probe's (2) and the batch's (8), or two batches'."""
    model = _init(_QueriesAgainstInputs(), seed=9)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(8, D, generator=g, dtype=DT)
    y = torch.arange(8) % 2
    for data, kw in [((x, y), {}), ([(x[:4], y[:4]), (x[4:7], y[4:7])], {"chunk_size": 4})]:
        with pytest.raises(ValueError, match=MIXED):
            normflat.hessian_diagonal(model, data, loss="ce", estimator="ggn", progress=False, **kw)
