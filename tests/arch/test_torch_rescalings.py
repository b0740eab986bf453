"""Function-preserving rescalings of the torch layer kinds no other test rescales (method §8).

Every layer kind normflat reads gets its own rescaling in the invariance suite: a tiny
float64 model containing the kind, a copy transformed so that it computes the same function
(checked to 1e-12), and then every layer's normalized sharpness and the total must be
unchanged (relative 1e-8) while the rescaled layers' Hessian traces move (more than 1e-3
relative), each layer on the path expected of it (``"fast"`` where a fast rule exists).
The transformations are row and column scalings of the canonical matrices of method §3 —
the positive homogeneity of (leaky) ReLUs between layers, per-head query/key and value/output factors,
feature scalings of an embedding against the next linear map, a grouped or transposed
convolution's per-channel factors compensated by its neighbours — which normalized
sharpness absorbs (method §8). The factors of a grouped layer's input channels differ per group
and per channel inside a group and are no product of a group factor and a position factor, so an
analysis that ignored the groups (the real matrix is block diagonal, every real input channel its
own column: method §3, "Grouped convolutions") fails these tests.

This file covers the kinds and configurations whose rescaling is tested nowhere else:
strided, dilated, grouped and depthwise ``Conv1d``/``Conv2d``/``Conv3d`` (different
factors per group and per input channel inside a group), ``ConvTranspose1d/2d/3d`` with
groups, ``nn.MultiheadAttention`` with ``kdim``/``vdim`` (separate projection weights),
``nn.EmbeddingBag``, multi-layer and bidirectional recurrent layers per gate, the older
``torch.nn.utils.weight_norm``, a transposed convolution and an embedding called several
times, GPT-2's packed key/value ``Conv1D`` of cross attention, the experts of every
transformers layout and GPT-OSS's router, timm's packed ``qkv`` (``Attention`` and
``AttentionRope``), a Hugging Face scaled word embedding tied to the head, and Hugging
Face ViT's position table. The kinds rescaled elsewhere (``tests/test_invariance.py``,
``tests/arch/test_torch_sequences.py``, ``tests/arch/test_torch_layers.py``,
``tests/backends/test_torch.py``, ``tests/arch/test_huggingface_models.py``,
``tests/arch/test_huggingface_moe.py``, ``tests/arch/test_timm_models.py``) are not
repeated here.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import normflat

DT = torch.float64
RTOL = 1e-8  # normalized sharpness, per layer and in total (method §8)
MOVED = 1e-3  # the least relative change of a rescaled layer's Hessian trace


# ----------------------------------------------------------------------------- helpers


def _factors(n: int, seed: int, spread: float = 1.2) -> torch.Tensor:
    """``n`` positive factors ``exp(u)``, ``u`` uniform in ``[-spread, spread]``, all different."""
    g = torch.Generator().manual_seed(seed)
    c = torch.exp((torch.rand(n, generator=g, dtype=DT) * 2 - 1) * spread)
    assert len(set(c.tolist())) == n
    return c


def _build(factory, *args, seed: int = 0, scale: float = 0.3, **kwargs) -> nn.Module:
    """``factory(*args, **kwargs)`` built under ``seed`` (its own initialization included), in float64
    and eval mode, every parameter perturbed by ``scale`` (non-zero biases, no symmetry)."""
    torch.manual_seed(seed)
    model = factory(*args, **kwargs).to(DT).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def _run(model: nn.Module, x):
    """The model's output on an input ``x`` (a tuple of positional inputs, a dict of keyword inputs,
    or one tensor), the logits of a Hugging Face output."""
    with torch.no_grad():
        out = model(*x) if isinstance(x, tuple) else model(**x) if isinstance(x, dict) else model(x)
    return out.logits if hasattr(out, "logits") else out


def _inputs(batch):
    """The model inputs of one batch: ``(x, y)`` or a mapping with ``labels``."""
    if isinstance(batch, dict):
        return {k: v for k, v in batch.items() if k != "labels"}
    return batch[0]


def _analyze(model: nn.Module, data, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a library's own warnings; the coverage is not checked here
        return normflat.analyze(model, data, progress=False, **{"loss": "ce", "estimator": "ggn", **kw})


def _assert_rescaling_invariant(model: nn.Module, other: nn.Module, data: list, rescaled, paths: dict, **kw):
    """``other`` (the rescaled copy) computes ``model``'s function on every batch of ``data`` (to
    1e-12); every layer's normalized sharpness and the total are the same (relative 1e-8), the
    Hessian traces of the ``rescaled`` layers move (more than 1e-3 relative), and the layers of
    ``paths`` (``{name: "fast" | "generic"}``) take that path before and after (method §8).

    Returns:
        The reports ``(before, after)``.
    """
    for batch in data:
        want, got = _run(model, _inputs(batch)), _run(other, _inputs(batch))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    before, after = _analyze(model, data, **kw), _analyze(other, data, **kw)
    assert [layer.name for layer in before.layers] == [layer.name for layer in after.layers]
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=RTOL, abs=0), lb.name
    assert after.normalized_sharpness == pytest.approx(before.normalized_sharpness, rel=RTOL)
    for name in rescaled:
        tb, ta = before.layer(name).hessian_trace, after.layer(name).hessian_trace
        assert tb != 0.0 and abs(ta - tb) > MOVED * abs(tb), (name, tb, ta)
    for report in (before, after):
        got_paths = {name: report.layer(name).details["path"] for name in paths}
        assert got_paths == paths, [(n, report.layer(n).details) for n in paths if got_paths[n] != paths[n]]
    return before, after


def _scale_conv(weight: torch.Tensor, out: torch.Tensor, inp: torch.Tensor, groups: int) -> None:
    """In place: entry ``[o, j]`` of a convolution's ``(out, in/groups, *k)`` weight times
    ``out[o] / inp[i]``, ``i`` the real input channel of column ``j`` in output ``o``'s group."""
    cout, cin_g = weight.shape[:2]
    group = torch.arange(cout) // (cout // groups)
    real_in = group[:, None] * cin_g + torch.arange(cin_g)[None, :]  # (out, in/groups)
    factor = out[:, None] / inp[real_in]
    weight.mul_(factor.reshape(*factor.shape, *([1] * (weight.dim() - 2))))


def _scale_conv_transpose(weight: torch.Tensor, out: torch.Tensor, inp: torch.Tensor, groups: int) -> None:
    """In place: entry ``[i, j]`` of a transposed convolution's ``(in, out/groups, *k)`` weight times
    ``out[o] / inp[i]``, ``o`` the real output channel ``j`` of input ``i``'s group."""
    cin, cout_g = weight.shape[:2]
    group = torch.arange(cin) // (cin // groups)
    real_out = group[:, None] * cout_g + torch.arange(cout_g)[None, :]  # (in, out/groups)
    factor = out[real_out] / inp[:, None]
    weight.mul_(factor.reshape(*factor.shape, *([1] * (weight.dim() - 2))))


def _leaky(x: torch.Tensor) -> torch.Tensor:
    """A leaky ReLU: positively homogeneous like a ReLU (``φ(c·x) = c·φ(x)`` for ``c > 0``), with no
    dead unit to leave a row or column of a tiny model without curvature."""
    return torch.nn.functional.leaky_relu(x, 0.1)


def _groups_differ(factors: torch.Tensor, groups: int) -> None:
    """The factors of a grouped layer's input channels differ between groups and inside each group,
    and are no product ``α_group · β_position``: a column scaling of the stored ``(out, in/groups)``
    kernel times a row scaling, which an analysis that ignored the groups would absorb too. Only
    then does the rescaling test that every real input channel has its own column (method §3,
    "Grouped convolutions")."""
    per = factors.reshape(groups, -1)
    assert len(set(per.prod(1).tolist())) == groups
    if per.shape[1] > 1:
        assert all(len(set(row.tolist())) == per.shape[1] for row in per)
        logs = per.log()
        interaction = logs - logs.mean(0, keepdim=True) - logs.mean(1, keepdim=True) + logs.mean()
        assert interaction.abs().max() > 0.1


# ----------------------------------------------------------------------------- convolutions


_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_IMAGE = {1: (9,), 2: (7, 6), 3: (5, 4, 5)}


class ConvStack(nn.Module):
    """A strided convolution, a dilated grouped one (two groups; circular padding in 3-D), a
    depthwise one (``padding="same"``), leaky ReLUs between, a dense head on the flattened maps."""

    def __init__(self, d: int):
        super().__init__()
        conv = _CONV[d]
        self.stem = conv(2, 4, (3, 2, 3)[:d], stride=2, padding=1)
        self.grouped = conv(4, 6, (3, 3, 2)[:d], dilation=2, padding=2, groups=2,
                            padding_mode="circular" if d == 3 else "zeros")
        self.depthwise = conv(6, 6, 3, padding="same", groups=6)
        with torch.no_grad():
            positions = self.features(torch.zeros(1, 2, *_IMAGE[d])).shape[2:].numel()
        self.head = nn.Linear(6 * positions, 3)

    def features(self, x):
        return _leaky(self.depthwise(_leaky(self.grouped(_leaky(self.stem(x))))))

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def _images(d: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, *_IMAGE[d], generator=g, dtype=DT), torch.arange(n) % 3


@pytest.mark.parametrize("d", [1, 2, 3], ids=["conv1d", "conv2d", "conv3d"])
def test_strided_dilated_grouped_and_depthwise_convolution_channel_rescaling(d):
    """Method §8 items 1–2 across ``ConvNd`` configurations (method §3, "Grouped convolutions"):
    the strided stem's output channel k times ``a_k`` (rows and bias); the dilated grouped
    convolution's input channel i over ``a_i`` — different factors in each group and for each input
    channel inside a group, each a column of the real block-diagonal matrix — and its output
    channel o times ``b_o``; the depthwise convolution's input over ``b`` and output times ``e``; the
    head's columns over ``e``. Leaky ReLUs between (positively homogeneous): the same function;
    every normalized sharpness unchanged, every trace moved, every convolution on its fast rule, the
    groups as declared."""
    model = _build(ConvStack, d, seed=d)
    other = copy.deepcopy(model)
    a, b, e = _factors(4, (27, 30, 50)[d - 1]), _factors(6, 10 * d + 1), _factors(6, 10 * d + 2)
    _groups_differ(a, 2)
    with torch.no_grad():
        _scale_conv(other.stem.weight, a, torch.ones(2, dtype=DT), 1)
        other.stem.bias.mul_(a)
        _scale_conv(other.grouped.weight, b, a, 2)
        other.grouped.bias.mul_(b)
        _scale_conv(other.depthwise.weight, e, b, 6)
        other.depthwise.bias.mul_(e)
        positions = other.head.in_features // 6
        other.head.weight.div_(e.repeat_interleave(positions)[None, :])  # channel-major flattening
    data = [_images(d, 6, seed=d)]
    names = ["stem", "grouped", "depthwise", "head"]
    before, _ = _assert_rescaling_invariant(model, other, data, names, dict.fromkeys(names, "fast"))
    assert before.layer("grouped").details["groups"] == 2 and before.layer("grouped").col_sigma.shape == (4,)
    assert before.layer("depthwise").details["groups"] == 6 and before.layer("depthwise").col_sigma.shape == (6,)


class ConvTransposeStack(nn.Module):
    """A strided grouped transposed convolution (two groups), a dilated grouped one (two groups),
    a depthwise one, leaky ReLUs between, a dense head on the flattened maps."""

    def __init__(self, d: int):
        super().__init__()
        conv = _CONV_T[d]
        self.up = conv(2, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.grouped = conv(4, 6, 2, dilation=2, groups=2)
        self.depthwise = conv(6, 6, (2, 1, 1)[:d], groups=6)
        with torch.no_grad():
            positions = self.features(torch.zeros(1, 2, *_SMALL[d])).shape[2:].numel()
        self.head = nn.Linear(6 * positions, 3)

    def features(self, x):
        return _leaky(self.depthwise(_leaky(self.grouped(_leaky(self.up(x))))))

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


_SMALL = {1: (4,), 2: (3, 2), 3: (2, 2, 1)}


@pytest.mark.parametrize("d", [1, 2, 3], ids=["conv_transpose1d", "conv_transpose2d", "conv_transpose3d"])
def test_grouped_conv_transpose_channel_rescaling(d):
    """Method §8 items 1–2 for ``ConvTransposeNd`` with groups, whose weight ``(in, out/groups, *k)``
    is canonical ``(out, in/groups, *k)`` group by group (method §3): the first layer's output
    channel k times ``a_k``; the grouped dilated layer's input channel i over ``a_i`` (different
    factors per group and per input channel inside a group) and its output o times ``b_o``; the
    depthwise layer's input over ``b`` and output times ``e``; the head's columns over ``e``. The same
    function; every normalized sharpness unchanged, every trace moved, the transposed convolutions
    on their fast rule."""
    model = _build(ConvTransposeStack, d, seed=d)
    other = copy.deepcopy(model)
    a, b, e = _factors(4, (51, 60, 68)[d - 1]), _factors(6, 20 * d + 1), _factors(6, 20 * d + 2)
    _groups_differ(a, 2)
    with torch.no_grad():
        _scale_conv_transpose(other.up.weight, a, torch.ones(2, dtype=DT), 2)
        other.up.bias.mul_(a)
        _scale_conv_transpose(other.grouped.weight, b, a, 2)
        other.grouped.bias.mul_(b)
        _scale_conv_transpose(other.depthwise.weight, e, b, 6)
        other.depthwise.bias.mul_(e)
        other.head.weight.div_(e.repeat_interleave(other.head.in_features // 6)[None, :])
    g = torch.Generator().manual_seed(d)
    data = [(torch.randn(6, 2, *_SMALL[d], generator=g, dtype=DT), torch.arange(6) % 3)]
    names = ["up", "grouped", "depthwise", "head"]
    before, _ = _assert_rescaling_invariant(model, other, data, names, dict.fromkeys(names, "fast"))
    assert before.layer("grouped").details["groups"] == 2 and before.layer("grouped").col_sigma.shape == (4,)
    assert before.layer("depthwise").details["groups"] == 6


# ----------------------------------------------------------------------------- attention with kdim / vdim


V, D, T, N, C = 13, 8, 5, 4, 3


def _ids(*shape, seed=0, low=0):
    return torch.randint(low, V, shape, generator=torch.Generator().manual_seed(seed))


def _labels(*shape, seed=1, classes=C):
    return torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(seed))


class KeyValueAttention(nn.Module):
    """Embedding -> ``nn.MultiheadAttention`` with ``kdim=6``, ``vdim=5`` (three projection
    weights of their own, ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``), its keys and
    values from dense maps of the tokens, optionally ``add_bias_kv`` -> tanh -> mean -> dense head."""

    def __init__(self, bias_kv: bool):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.to_k = nn.Linear(D, 6, bias=False)
        self.to_v = nn.Linear(D, 5, bias=False)
        self.att = nn.MultiheadAttention(D, 2, batch_first=True, kdim=6, vdim=5, add_bias_kv=bias_kv)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.emb(ids)
        a, _ = self.att(h, self.to_k(h), self.to_v(h))
        return self.head(torch.tanh(a).mean(1))


@pytest.mark.parametrize("bias_kv", [False, True], ids=["plain", "add_bias_kv"])
def test_multihead_attention_kdim_vdim_rescaling(bias_kv):
    """Method §8 items 5–6 on ``nn.MultiheadAttention`` with separate projection weights (method §3:
    ``att.query``, ``att.key``, ``att.value`` are the three parameters): head h's query rows and bias
    times ``c_h``, its key rows, bias (and ``bias_k``) over ``c_h``; its value rows, bias (and
    ``bias_v``) times ``v_h``, the output projection's columns of head h over ``v_h``; the token
    features times ``f_j`` against the columns of the query projection and of the key and value
    maps; the key map's outputs times ``g_j`` against the key projection's columns and the value
    map's outputs times ``u_j`` against the value projection's. Every weight moves, the function and
    every normalized sharpness do not; every projection on its fast rule."""
    model = _build(KeyValueAttention, bias_kv)
    other = copy.deepcopy(model)
    att = other.att
    e, heads = att.embed_dim, att.num_heads
    cq = _factors(heads, 1).repeat_interleave(e // heads)
    cv = _factors(heads, 2).repeat_interleave(e // heads)
    f, gk, uv = _factors(D, 3), _factors(6, 4), _factors(5, 5)
    with torch.no_grad():
        att.q_proj_weight.mul_(cq[:, None]).div_(f[None, :])
        att.k_proj_weight.div_(cq[:, None]).div_(gk[None, :])
        att.v_proj_weight.mul_(cv[:, None]).div_(uv[None, :])
        att.in_proj_bias[:e].mul_(cq)
        att.in_proj_bias[e:2 * e].div_(cq)
        att.in_proj_bias[2 * e:].mul_(cv)
        if bias_kv:
            att.bias_k.div_(cq)
            att.bias_v.mul_(cv)
        att.out_proj.weight.div_(cv[None, :])
        other.emb.weight.mul_(f[None, :])
        other.to_k.weight.div_(f[None, :]).mul_(gk[:, None])
        other.to_v.weight.div_(f[None, :]).mul_(uv[:, None])
    data = [(_ids(N, T), _labels(N))]
    names = ["emb", "to_k", "to_v", "att.query", "att.key", "att.value", "att.out_proj"]
    before, _ = _assert_rescaling_invariant(model, other, data, names, dict.fromkeys([*names, "head"], "fast"))
    assert before.layer("att.key").shape == (D, 6) and before.layer("att.value").shape == (D, 5)


# ----------------------------------------------------------------------------- EmbeddingBag


class BagMixer(nn.Module):
    """``nn.EmbeddingBag`` -> dense -> leaky ReLU -> dense head; the bags are the rows of ``ids``, or a
    1-D input with offsets, with per-sample weights or not."""

    def __init__(self, mode, padding_idx=None, weighted=False, offsets=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode=mode, padding_idx=padding_idx)
        self.weighted, self.offsets = weighted, offsets
        self.proj = nn.Linear(D, 6)
        self.head = nn.Linear(6, C)

    def forward(self, ids, w):
        psw = w if self.weighted else None
        if self.offsets:
            n, length = ids.shape
            off = torch.arange(0, n * length, length)
            h = self.bag(ids.reshape(-1), off, per_sample_weights=None if psw is None else psw.reshape(-1))
        else:
            h = self.bag(ids, per_sample_weights=psw)
        return self.head(_leaky(self.proj(h)))


@pytest.mark.parametrize("mode, padding_idx, weighted, offsets, path", [
    ("sum", None, True, False, "fast"), ("mean", 3, False, True, "fast"), ("max", None, False, False, "generic")])
def test_embedding_bag_feature_rescaling(mode, padding_idx, weighted, offsets, path):
    """Method §8 item 6 for ``nn.EmbeddingBag`` (canonical ``(features, vocabulary)``, method §3):
    feature j of the table times ``c_j`` scales feature j of every bag (a sum, a mean or a
    maximum — positive factors commute with each), the next dense layer's column j over ``c_j``;
    its output units times ``u_k`` (a leaky ReLU after it), the head's columns over ``u_k``. The same
    function, every normalized sharpness unchanged, the traces moved; the bag on its fast rule
    (``max`` has none: the generic path)."""
    model = _build(BagMixer, mode, padding_idx, weighted, offsets)
    other = copy.deepcopy(model)
    c, u = _factors(D, 6), _factors(6, 7)
    with torch.no_grad():
        other.bag.weight.mul_(c[None, :])
        other.proj.weight.div_(c[None, :]).mul_(u[:, None])
        other.proj.bias.mul_(u)
        other.head.weight.div_(u[None, :])
    ids = torch.tensor([[3, 5, 5, 1], [7, 3, 3, 3], [0, 12, 12, 6], [2, 9, 3, 11]])
    w = torch.rand(4, 4, dtype=DT, generator=torch.Generator().manual_seed(3)) + 0.5
    data = [((ids, w), _labels(4))]
    _assert_rescaling_invariant(model, other, data, ["bag", "proj", "head"],
                                {"bag": path, "proj": "fast", "head": "fast"})


# ----------------------------------------------------------------------------- recurrent layers


class DeepRecurrent(nn.Module):
    """Embedding -> a two-layer bidirectional recurrent layer -> mean over the steps -> dense head."""

    def __init__(self, cell, **kw):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.rnn = cell(D, 3, num_layers=2, bidirectional=True, batch_first=True, **kw)
        self.head = nn.Linear(2 * (kw.get("proj_size") or 3), C)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out.mean(1))


_GATES = {"lstm": "ifgo", "gru": "rzn", "rnn_tanh": "", "rnn_relu": ""}


def _blocks(name: str, cell: str) -> list[str]:
    gates = _GATES[cell]
    return [f"{name}.{g}" for g in gates] if gates else [name]


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_proj"])
def test_deep_bidirectional_recurrent_rescaling_per_gate(cell):
    """Method §8 item 7 on two-layer bidirectional ``nn.LSTM``/``nn.GRU``/``nn.RNN``, whose
    weights are split per gate (method §3, "Packed maps are split"): feature j of the embedding
    times ``c_j`` against column j of every gate's input weights of both first-layer directions.
    Where hidden units can be rescaled, each layer and direction too: a ReLU RNN's hidden unit k
    times ``h_k`` (its rows of the input weights and biases, ``W_hh -> D W_hh D⁻¹``), an LSTM's
    projected unit k times ``p_k`` (``weight_hr`` rows, ``weight_hh`` columns over it), each
    against its columns of the next layer's input weights (both directions) or of the head. The
    same function, every normalized sharpness unchanged, every rescaled gate block's trace moved,
    every recurrent weight on its fast rule."""
    kind, kw = {"lstm": (nn.LSTM, {}), "gru": (nn.GRU, {}), "rnn_tanh": (nn.RNN, {}),
                "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}), "lstm_proj": (nn.LSTM, {"proj_size": 2})}[cell]
    gates = "lstm" if cell == "lstm_proj" else cell
    model = _build(DeepRecurrent, kind, **kw, scale=0.4)
    other = copy.deepcopy(model)
    r = other.rnn
    c = _factors(D, 8)
    rescaled = ["emb", *(b for sfx in ("", "_reverse") for b in _blocks(f"rnn.weight_ih_l0{sfx}", gates))]
    with torch.no_grad():
        other.emb.weight.mul_(c[None, :])
        r.weight_ih_l0.div_(c[None, :])
        r.weight_ih_l0_reverse.div_(c[None, :])
        if cell in ("rnn_relu", "lstm_proj"):
            width = 2 if cell == "lstm_proj" else 3
            for layer in (0, 1):
                for direction, sfx in enumerate(("", "_reverse")):
                    k = _factors(width, 10 + 2 * layer + direction)
                    if cell == "rnn_relu":  # hidden unit k: an RNN's state is its output
                        getattr(r, f"weight_ih_l{layer}{sfx}").mul_(k[:, None])
                        getattr(r, f"bias_ih_l{layer}{sfx}").mul_(k)
                        getattr(r, f"bias_hh_l{layer}{sfx}").mul_(k)
                        getattr(r, f"weight_hh_l{layer}{sfx}").mul_(k[:, None] / k[None, :])
                        own = [f"rnn.weight_ih_l{layer}{sfx}", f"rnn.weight_hh_l{layer}{sfx}"]
                    else:  # projected unit k: the LSTM's state and output
                        getattr(r, f"weight_hr_l{layer}{sfx}").mul_(k[:, None])
                        getattr(r, f"weight_hh_l{layer}{sfx}").div_(k[None, :])
                        own = [f"rnn.weight_hr_l{layer}{sfx}", *_blocks(f"rnn.weight_hh_l{layer}{sfx}", gates)]
                    cols = slice(direction * width, (direction + 1) * width)  # the output: [forward, reverse]
                    if layer == 0:
                        r.weight_ih_l1[:, cols] /= k
                        r.weight_ih_l1_reverse[:, cols] /= k
                    else:
                        other.head.weight[:, cols] /= k
                    rescaled += own
            rescaled += [*_blocks("rnn.weight_ih_l1", gates), *_blocks("rnn.weight_ih_l1_reverse", gates), "head"]
    recurrent = [block for name, _ in model.rnn.named_parameters() if name.startswith("weight_")
                 for block in ([f"rnn.{name}"] if name.startswith("weight_hr") else _blocks(f"rnn.{name}", gates))]
    assert len(recurrent) == 8 * max(len(_GATES[gates]), 1) + (4 if cell == "lstm_proj" else 0)
    data = [(_ids(N, T), _labels(N))]
    before, _ = _assert_rescaling_invariant(model, other, data, sorted(set(rescaled)), dict.fromkeys(recurrent, "fast"))
    assert [layer.name for layer in before.layers if layer.name.startswith("rnn.")] == recurrent


# ----------------------------------------------------------------------------- weight normalization (older API)


class LegacyWeightNormalized(nn.Module):
    """``torch.nn.utils.weight_norm`` (the older hook: ``weight_g``, ``weight_v``) over the axis
    ``dims[i]`` (``None``: the whole tensor) of a strided ``Conv1d``, a ``ConvTranspose1d`` and a
    dense layer on a sequence, then a dense head."""

    def __init__(self, dims):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of the parametrization
            self.conv = nn.utils.weight_norm(nn.Conv1d(3, 4, 3, stride=2), dim=dims[0])
            self.up = nn.utils.weight_norm(nn.ConvTranspose1d(4, 4, 2, stride=2), dim=dims[1])
            self.lin = nn.utils.weight_norm(nn.Linear(4, 5), dim=dims[2])
        self.head = nn.Linear(5, C)

    def forward(self, x):  # (n, 3, 7)
        h = torch.tanh(self.up(torch.tanh(self.conv(x))))  # (n, 4, 6)
        return self.head(torch.tanh(self.lin(h.transpose(1, 2))).mean(1))


@pytest.mark.parametrize("dims", [(0, 0, 0), (1, 1, 1), (None, None, None)], ids=["dim0", "dim1", "whole"])
def test_legacy_weight_norm_direction_rescaling(dims):
    """``W = g · v / ‖v‖`` with the older ``torch.nn.utils.weight_norm``: each slice of ``v``
    normalized together (an output or input channel — a row or a column of the canonical matrix —
    or the whole tensor) times its own positive factor leaves ``W``, so the function, unchanged; the
    direction ``v`` is the weight analyzed (method §3, "Weight normalization"), so its normalized
    sharpness stays and its trace moves (method §8), on its layer's fast rule followed by the
    normalization's Jacobian."""
    model = _build(LegacyWeightNormalized, dims, scale=0.1)
    other = LegacyWeightNormalized(dims).to(DT).eval()  # the hook's module cannot be deep-copied
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 3, 7, generator=g, dtype=DT), torch.arange(6) % C
    with torch.no_grad():
        for name in ("conv", "up", "lin"):
            v = getattr(other, name).weight_v
            v.mul_(torch.exp(torch.randn(getattr(other, name).weight_g.shape, generator=g, dtype=DT)))
    names = ["conv", "up", "lin"]
    before, _ = _assert_rescaling_invariant(model, other, [(x, y)], names, dict.fromkeys([*names, "head"], "fast"))
    assert [before.layer(n).details["param"] for n in names] == [f"{n}.weight_v" for n in names]


# ----------------------------------------------------------------------------- layers called several times


class CalledTwice(nn.Module):
    """Two token sequences per sample through one embedding (two lookups, summed), then one grouped
    ``ConvTranspose1d`` called twice with a leaky ReLU between, a leaky ReLU, the mean over the steps,
    a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 4)
        self.up = nn.ConvTranspose1d(4, 4, 3, padding=1, groups=2)
        self.head = nn.Linear(4, C)

    def forward(self, ids):  # (n, 2, T)
        h = (self.emb(ids[:, 0]) + 0.5 * self.emb(ids[:, 1])).transpose(1, 2)
        return self.head(_leaky(self.up(_leaky(self.up(h)))).mean(2))


def test_embedding_and_grouped_conv_transpose_called_twice_conjugation():
    """Method §8 for weights used by several calls (their per-sample gradients summed before
    squaring, method §6.1): feature k of the embedding times ``c_k`` (both lookups), the grouped
    transposed convolution conjugated, ``W[i, j] -> c_o W[i, j] / c_i`` for input channel i and output
    channel o (different factors per group and inside each group) and its bias times ``c``, so each
    call maps inputs times ``c`` to outputs times ``c``; the head's columns over ``c``. The same
    function, every normalized sharpness unchanged, the traces moved, both on their fast rules."""
    model = _build(CalledTwice)
    other = copy.deepcopy(model)
    c = _factors(4, 9)
    _groups_differ(c, 2)
    with torch.no_grad():
        other.emb.weight.mul_(c[None, :])
        _scale_conv_transpose(other.up.weight, c, c, 2)
        other.up.bias.mul_(c)
        other.head.weight.div_(c[None, :])
    data = [(torch.stack([_ids(N, T, seed=3), _ids(N, T, seed=4)], 1), _labels(N))]
    _assert_rescaling_invariant(model, other, data, ["emb", "up", "head"], dict.fromkeys(["emb", "up", "head"], "fast"))


# ----------------------------------------------------------------------------- Hugging Face transformers


class CrossAttentionGPT2(nn.Module):
    """A one-layer GPT-2 with cross attention (``q_attn`` a ``Conv1D``, ``c_attn`` the ``Conv1D``
    packing key and value) reading an embedding of the reversed tokens, then a dense head on the
    mean of its last hidden states."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.GPT2Config(vocab_size=V, n_positions=8, n_embd=D, n_layer=1, n_head=2, n_inner=16,
                                         add_cross_attention=True, bos_token_id=1, eos_token_id=1, pad_token_id=0)
        self.source = nn.Embedding(V, D)
        self.gpt = transformers.GPT2Model(config)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        out = self.gpt(input_ids=ids, encoder_hidden_states=self.source(ids.flip(1))).last_hidden_state
        return self.head(out.mean(1))


def test_gpt2_conv1d_packed_self_and_cross_attention_per_head_rescaling():
    """Method §8 items 5–6 on Hugging Face ``Conv1D`` (stored ``(in, out)``, canonical transposed;
    method §3) and its packed projections: the self attention's ``c_attn`` split into query, key and
    value, the cross attention's ``q_attn`` and its ``c_attn`` split into key and value. In each
    attention, head h's query units (and bias) times ``c_h`` and key units over ``c_h``, value units
    times ``v_h`` and the output projection's input rows over ``v_h``; the encoder's features (an
    embedding's) times ``f_j`` against the cross attention's key/value input rows. The same
    function, every normalized sharpness unchanged, the traces moved, every ``Conv1D`` block on its
    fast rule (``ggn``)."""
    pytest.importorskip("transformers")
    model = _build(CrossAttentionGPT2, scale=0.1)
    other = copy.deepcopy(model)
    block = other.gpt.h[0]
    hd = D // 2
    f = _factors(D, 21)
    with torch.no_grad():
        for attn, seed in ((block.attn, 22), (block.crossattention, 24)):
            c = _factors(2, seed).repeat_interleave(hd)
            v = _factors(2, seed + 1).repeat_interleave(hd)
            if attn.is_cross_attention:
                attn.q_attn.weight.mul_(c[None, :]), attn.q_attn.bias.mul_(c)
                key, value = slice(0, D), slice(D, 2 * D)
                attn.c_attn.weight.div_(f[:, None])  # Conv1D (in, out): input j is row j
            else:
                attn.c_attn.weight[:, :D] *= c[None, :]
                attn.c_attn.bias[:D] *= c
                key, value = slice(D, 2 * D), slice(2 * D, 3 * D)
            attn.c_attn.weight[:, key] /= c[None, :]
            attn.c_attn.bias[key] /= c
            attn.c_attn.weight[:, value] *= v[None, :]
            attn.c_attn.bias[value] *= v
            attn.c_proj.weight.div_(v[:, None])
        other.source.weight.mul_(f[None, :])
    data = [(_ids(N, 6, seed=5, low=2), _labels(N))]
    self_attn, cross = "gpt.h.0.attn", "gpt.h.0.crossattention"
    names = ["source", *(f"{self_attn}.c_attn.{p}" for p in ("query", "key", "value")), f"{self_attn}.c_proj",
             f"{cross}.q_attn", f"{cross}.c_attn.key", f"{cross}.c_attn.value", f"{cross}.c_proj"]
    before, _ = _assert_rescaling_invariant(model, other, data, names, dict.fromkeys(names, "fast"))
    assert before.layer(f"{cross}.c_attn.key").shape == (D, D)  # (out, in): the transposed Conv1D block


EXPERTS, TOP_K, HIDDEN, INTER = 4, 2, 6, 5


def _experts_module(kind: str) -> nn.Module:
    """A transformers experts module of each stored layout (``experts_implementation="eager"``)."""
    import transformers

    common = dict(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=2, num_key_value_heads=1,
                  experts_implementation="eager")
    if kind == "mixtral":  # (E, 2I, H): gate rows then up rows
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
        return MixtralExperts(transformers.MixtralConfig(num_local_experts=EXPERTS, **common))
    if kind == "aria":  # (E, H, 2I): transposed, gate then up
        from transformers.models.aria.modeling_aria import AriaExperts
        return AriaExperts(transformers.AriaTextConfig(moe_num_experts=EXPERTS, **common))
    if kind == "llama4":  # (E, H, 2I) transposed, every expert on every token (no fast rule)
        from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
        return Llama4TextExperts(transformers.Llama4TextConfig(num_local_experts=EXPERTS, **common))
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts  # (E, I, H), no gate, relu²
    return NemotronHExperts(transformers.NemotronHConfig(
        n_routed_experts=EXPERTS, moe_intermediate_size=INTER, hidden_size=HIDDEN, num_attention_heads=2,
        num_key_value_heads=1, experts_implementation="eager", mlp_hidden_act="relu2"))


class RoutedExperts(nn.Module):
    """Features -> dense -> a block of experts -> mean over the tokens -> dense head. The block is a
    float64 softmax top-k routing by an ``nn.Linear`` router and a transformers experts module, or
    (``"gpt_oss"``) GPT-OSS's whole MLP: its ``GptOssTopKRouter`` (a router class of its own, float64
    throughout) and its experts, transposed, gate and up interleaved, with biases."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.embed = nn.Linear(4, HIDDEN)
        if kind == "gpt_oss":
            import transformers
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

            self.mlp = GptOssMLP(transformers.GptOssConfig(
                hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=2, num_key_value_heads=1,
                num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, experts_implementation="eager"))
        else:
            self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
            self.experts = _experts_module(kind)
        self.head = nn.Linear(HIDDEN, C)

    def forward(self, x):
        n, t, _ = x.shape
        h = self.embed(x)
        if self.kind == "gpt_oss":
            mixed, _ = self.mlp(h)
            return self.head(mixed.mean(1))
        h = h.reshape(n * t, HIDDEN)
        weights, index = torch.topk(torch.softmax(self.router(h), -1), TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.kind == "llama4":  # its block scales each expert's copy of the input by the routing
            scores = torch.zeros(n * t, EXPERTS, dtype=h.dtype).scatter(1, index, weights)
            mixed = self.experts(h.repeat(EXPERTS, 1) * scores.T.reshape(-1, 1)).reshape(EXPERTS, n * t, HIDDEN).sum(0)
        else:
            mixed = self.experts(h, index, weights)
        return self.head(mixed.reshape(n, t, HIDDEN).mean(1))


@pytest.mark.parametrize("kind", ["mixtral", "aria", "llama4", "nemotron", "gpt_oss"])
def test_experts_and_router_rescaling_in_every_stored_layout(kind):
    """Method §8 item 8 in float64 on every transformers experts layout (method §3,
    "Mixture-of-experts layers"): the features entering the block times ``f_j`` (the dense layer
    before it) against column j of the router and of every expert's gate and up maps; the block's
    output features times ``o_j`` (every expert's down rows and bias) against the head's columns;
    per expert, its up units times ``u_k`` against its down columns over ``u_k`` (``silu(gate)·up``
    is linear in ``up``), or over ``u_k²`` without a gate (relu², homogeneous of degree 2). GPT-OSS's
    gate (clamped, ``(up + 1)·glu``) has no per-expert rescaling; its router is its own class. The
    routing is unchanged, so is the function; every normalized sharpness stays (to 1e-8: nothing in
    float32), every expert map's, router's and neighbour's trace moves, each on its fast rule
    (Llama 4's older class: the generic path)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = RoutedExperts(kind).to(DT).eval()
    with torch.no_grad():  # the experts' parameters are allocated uninitialized
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    other = copy.deepcopy(model)
    experts = other.mlp.experts if kind == "gpt_oss" else other.experts
    router = other.mlp.router if kind == "gpt_oss" else other.router
    transposed = kind in ("aria", "llama4", "gpt_oss")
    first = experts.up_proj if kind == "nemotron" else experts.gate_up_proj
    f, o = _factors(HIDDEN, 33), _factors(HIDDEN, 34)
    with torch.no_grad():
        other.embed.weight.mul_(f[:, None]), other.embed.bias.mul_(f)
        router.weight.div_(f[None, :])
        first.div_(f[None, :, None] if transposed else f[None, None, :])
        experts.down_proj.mul_(o[None, None, :] if transposed else o[None, :, None])
        if kind == "gpt_oss":
            experts.down_proj_bias.mul_(o[None, :])
        other.head.weight.div_(o[None, :])
        for e in range(EXPERTS if kind != "gpt_oss" else 0):
            u = _factors(INTER, 40 + e)
            if kind == "nemotron":  # up (E, I, H), down (E, H, I)
                first[e].mul_(u[:, None])
                experts.down_proj[e].div_(u[None, :] ** 2)
            elif transposed:  # gate_up (E, H, [gate | up]), down (E, I, H)
                first[e, :, INTER:] *= u[None, :]
                experts.down_proj[e].div_(u[:, None])
            else:  # gate_up (E, [gate | up], H), down (E, H, I)
                first[e, INTER:] *= u[:, None]
                experts.down_proj[e].div_(u[None, :])
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(6, 4, 4, generator=g, dtype=DT), torch.arange(6) % C)]
    prefix = "mlp.experts" if kind == "gpt_oss" else "experts"
    maps = ["up_proj"] if kind == "nemotron" else ["gate_proj", "up_proj"]
    expert_maps = [f"{prefix}.{e}.{m}" for e in range(EXPERTS) for m in (*maps, "down_proj")]
    router_name = "mlp.router" if kind == "gpt_oss" else "router"
    paths = {**dict.fromkeys(expert_maps, "generic" if kind == "llama4" else "fast"),
             **dict.fromkeys(["embed", router_name, "head"], "fast")}
    before, _ = _assert_rescaling_invariant(model, other, data, ["embed", router_name, *expert_maps, "head"], paths)
    assert {before.layer(name).kind for name in expert_maps} == {"expert"}
    assert before.layer(router_name).kind == ("router" if kind == "gpt_oss" else "dense")


class TiedScaledLM(nn.Module):
    """BART's scaled word embedding (``embed_scale`` 2) tied to the LM head, two dense layers between."""

    def __init__(self):
        super().__init__()
        from transformers.models.bart.modeling_bart import BartScaledWordEmbedding

        self.emb = BartScaledWordEmbedding(V, D, padding_idx=0, embed_scale=2.0)
        self.mix_in = nn.Linear(D, 6)
        self.mix_out = nn.Linear(6, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, ids):
        return self.lm_head(self.mix_out(torch.tanh(self.mix_in(self.emb(ids)))))


def test_scaled_word_embedding_tied_to_the_head_feature_rescaling():
    """Method §8 item 6 for a Hugging Face scaled word embedding tied to the LM head (one weight,
    two uses, method §3 "Embeddings"): feature j of the table times ``c_j`` scales the lookup's
    output and the head's input column; the next layer's input column j and the previous layer's
    output row j (and bias) over ``c_j``. The same token logits, every normalized sharpness
    unchanged, the traces moved; the table reported once, with the head as ``shared_with``, on the
    scaled lookup's fast rule."""
    pytest.importorskip("transformers")
    model = _build(TiedScaledLM)
    other = copy.deepcopy(model)
    c = _factors(D, 51)
    with torch.no_grad():
        other.emb.weight.mul_(c[None, :])  # the head's weight too: one tensor
        other.mix_in.weight.div_(c[None, :])
        other.mix_out.weight.div_(c[:, None]), other.mix_out.bias.div_(c)
    assert other.lm_head.weight is other.emb.weight
    ids = _ids(N, T, seed=6, low=1)
    ids[0, 2] = 0  # a padding token
    data = [(ids, _ids(N, T, seed=7))]
    names = ["emb", "mix_in", "mix_out"]
    before, _ = _assert_rescaling_invariant(model, other, data, names, dict.fromkeys(names, "fast"))
    assert before.layer("emb").details["shared_with"] == ["lm_head"]
    assert [layer.name for layer in before.layers] == names


def test_vit_position_embeddings_residual_stream_rescaling():
    """Hugging Face ViT's ``position_embeddings`` (a loose ``(1, N, d)`` parameter, analyzed as the
    embedding of the positions, method §3 "Position tables") with its patch embedding, class token
    and every residual branch's output projection times ``c`` (the whole residual stream times
    ``c``), which the final LayerNorm removes (its ``eps`` and the blocks' negligible): the same
    logits, every normalized sharpness unchanged, the scaled layers' traces moved, the table and the
    projections on their fast rules."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=12, num_labels=C, layer_norm_eps=1e-300)
    model = _build(transformers.ViTForImageClassification, config, scale=0.2)
    other = copy.deepcopy(model)
    c = 3.5
    layer = other.vit.layers[0]
    with torch.no_grad():
        for p in (other.vit.embeddings.patch_embeddings.projection.weight,
                  other.vit.embeddings.patch_embeddings.projection.bias, other.vit.embeddings.cls_token,
                  other.vit.embeddings.position_embeddings, layer.attention.o_proj.weight,
                  layer.attention.o_proj.bias, layer.mlp.fc2.weight, layer.mlp.fc2.bias):
            p.mul_(c)
    g = torch.Generator().manual_seed(8)
    data = [{"pixel_values": torch.randn(5, 3, 8, 8, generator=g, dtype=DT), "labels": torch.arange(5) % C}]
    names = ["vit.embeddings.patch_embeddings.projection", "vit.embeddings.position_embeddings",
             "vit.layers.0.attention.o_proj", "vit.layers.0.mlp.fc2"]
    before, _ = _assert_rescaling_invariant(model, other, data, names, dict.fromkeys(names, "fast"))
    assert before.layer("vit.embeddings.position_embeddings").kind == "position_embedding"


# ----------------------------------------------------------------------------- timm


class TimmAttentionTagger(nn.Module):
    """A dense patch embedding -> timm ``Attention`` (``qkv`` packing query, key and value rows) or
    ``AttentionRope`` (the same, with rotary embeddings of the positions) -> tanh -> mean -> head."""

    def __init__(self, rope: bool):
        super().__init__()
        from timm.layers.attention import Attention, AttentionRope

        self.embed = nn.Linear(3, D)
        self.attn = AttentionRope(D, num_heads=2, num_prefix_tokens=0) if rope else Attention(D, num_heads=2,
                                                                                              qkv_bias=True)
        self.head = nn.Linear(D, C)
        angles = torch.arange(T, dtype=DT)[:, None] * torch.tensor([1.0, 0.3], dtype=DT)[None, :]  # head_dim 4
        angles = angles.repeat_interleave(2, -1)
        self.register_buffer("rope", torch.cat([angles.sin(), angles.cos()], -1) if rope else None)

    def forward(self, x):
        h = self.embed(x)
        a = self.attn(h) if self.rope is None else self.attn(h, rope=self.rope)
        return self.head(torch.tanh(a).mean(1))


@pytest.mark.parametrize("rope", [False, True], ids=["Attention", "AttentionRope"])
def test_timm_packed_qkv_per_head_rescaling(rope):
    """Method §8 items 5–6 on timm's packed ``qkv`` (split into query, key and value, method §3
    "Packed maps are split"): head h's query rows and bias times ``c_h``, its key rows and bias over
    ``c_h`` (a factor per head commutes with the rotary embedding of each head's queries and keys);
    its value rows and bias times ``v_h``, the output projection's columns over ``v_h``; the patch
    features times ``f_j`` against the columns of ``qkv``. The same function, every normalized
    sharpness unchanged, the traces moved, each block on ``nn.Linear``'s fast rule."""
    pytest.importorskip("timm")
    model = _build(TimmAttentionTagger, rope)
    other = copy.deepcopy(model)
    c = _factors(2, 61).repeat_interleave(D // 2)
    v = _factors(2, 62).repeat_interleave(D // 2)
    f = _factors(D, 63)
    qkv = other.attn.qkv
    with torch.no_grad():
        other.embed.weight.mul_(f[:, None]), other.embed.bias.mul_(f)
        qkv.weight.div_(f[None, :])
        for rows, factor in ((slice(0, D), c), (slice(D, 2 * D), 1 / c), (slice(2 * D, 3 * D), v)):
            qkv.weight[rows] *= factor[:, None]
            qkv.bias[rows] *= factor
        other.attn.proj.weight.div_(v[None, :])
    g = torch.Generator().manual_seed(9)
    data = [(torch.randn(N, T, 3, generator=g, dtype=DT), _labels(N))]
    names = ["embed", "attn.qkv.query", "attn.qkv.key", "attn.qkv.value", "attn.proj"]
    _assert_rescaling_invariant(model, other, data, names, dict.fromkeys([*names, "head"], "fast"))
