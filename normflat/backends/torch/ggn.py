"""The ``ggn`` / ``ggn-mc`` kernels: fast per-layer rules and the generic ``vmap`` path.

The GGN of the mean loss is ``(1/N) Σ_n J_nᵀ H_n J_n`` with ``H_n = S_n S_nᵀ`` the
loss Hessian in the logits, factored by :func:`normflat.engine.losses.output_signals`
(``C − 1`` signals for ``ggn``, drawn signals for ``ggn-mc``, pulled back through the
normalization for ``nsce``; method §6, §7). The diagonal is a sum of squared
per-sample, per-signal weight gradients ``(J_nᵀ s)²``:

* the **fast** path back-propagates the signals to the outputs of the weight
  layers (captured by forward hooks) and forms the squares from each layer's
  input: ``Σ δ² (a²)ᵀ`` for a dense layer, per-sample gradients of the unfolded
  input for a convolution, a chunk of samples at a time;
* the **generic** path (shared or functionally used weights, layers without a
  rule, ``fast=False``) runs ``vmap`` over samples of a per-sample ``vjp``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp, vmap

from normflat.backends.torch import compat
from normflat.engine import losses

__all__ = [
    "NoFastPath",
    "Deltas",
    "linear_squares",
    "transposed_linear_squares",
    "recurrent_squares",
    "attention_squares",
    "conv_squares",
    "conv_transpose_squares",
    "embedding_squares",
    "embedding_bag_squares",
    "recorded_lookup_squares",
    "FunctionalTaps",
    "position_table_squares",
    "PER_SAMPLE_GRADIENTS",
    "PREPARED_GRADIENTS",
    "tied_squares",
    "lookup_squares",
    "weight_normalization",
    "weight_norm_rule",
    "spectral_normalization",
    "spectral_norm_rule",
    "normalizes_weight",
    "normalization_edges",
    "Capture",
    "inspect_graph",
    "backprop_signals",
    "generic_ggn",
    "unswapped",
    "unswapped_error",
]

#: Elements of one chunk of per-sample squares: bounds memory, and small enough to stay in
#: cache while squared and summed (30% faster than 16M elements on the 3C3D CNN, measured).
_SQUARES_BUDGET = 1 << 20

#: Backward ops that have a vmap batching rule in torch 2.13 (checked one by one with
#: ``torch._C._debug_only_display_vmap_fallback_warnings``). When every op between the
#: logits and the captured layer outputs is one of these, one batched backward
#: (``is_grads_batched=True``) is fastest; any other op (convolution, pooling, tanh,
#: normalization backward...) makes vmap loop op by op, slower than a plain loop of
#: backward passes (measured), so the loop is used.
BATCHED_BACKWARD_OPS = frozenset({
    "AddmmBackward0", "MmBackward0", "BmmBackward0", "TBackward0", "ReluBackward0", "AddBackward0",
    "AddBackward1", "SubBackward0", "SubBackward1", "MulBackward0", "MulBackward1", "DivBackward0",
    "DivBackward1", "NegBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
    "PermuteBackward0", "TransposeBackward0", "CloneBackward0", "ExpandBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "UnsqueezeBackward0", "MeanBackward0", "MeanBackward1", "SumBackward0",
    "SumBackward1", "SigmoidBackward0", "CatBackward0", "StackBackward0", "SliceBackward0",
    "SelectBackward0", "ExpBackward0", "LogBackward0", "PowBackward0", "SqrtBackward0", "AbsBackward0",
    "AmaxBackward0", "SplitBackward0", "UnbindBackward0", "RsubBackward1",
    "RecurrentTanhBackward",  # compat.RecurrentTanh: tanh in the recorded recurrence
    # State-space and gated language models (transformers' Mamba reference kernels, Llama's MLP and
    # RMS norm): batched without a fallback warning, and faster batched (mamba-5000's auto 0.71 s
    # against 0.99 s, 2026-12-08); a CNN of convolutions, ReLUs and linear maps alone is as fast
    # either way (pooling and BatchNorm keep the CNNs of benchmarks/torch_diag.py looped).
    "ConvolutionBackward0", "SiluBackward0", "SoftplusBackward0", "RsqrtBackward0", "SplitWithSizesBackward0",
    "AliasBackward0", "EmbeddingBackward0",
})


class NoFastPath(Exception):
    """A fast rule cannot handle this module configuration; use the generic path."""


#: The cost of squaring and summing one entry of one formed per-sample gradient, in units of
#: one pair of positions of one entry (measured on CPU, 2026-12-01, see :func:`squares_by_pairs`):
#: by the entries of a per-sample gradient, larger than the cache (memory-bound) or not.
SQUARES_COST = ((1 << 18, 60), (1 << 16, 40), (0, 12))
#: Above this many output positions the pairs' inputs outgrow the cache (6×6 maps: 3× slower).
MAX_PAIR_POSITIONS = 16


def squares_by_pairs(positions: int, signals: int, entries: int) -> bool:
    """Whether a convolution with ``positions`` output positions sums its squares by pairs.

    Per sample and weight entry (``entries`` per sample), forming and squaring the per-sample
    gradients of a group of ``signals`` signals costs about ``signals · s`` (the square and sum
    dominate the matmul over the positions; ``s`` from :data:`SQUARES_COST`), the pairs
    ``positions · (positions + 1) / 2`` for the whole group (one matmul over the symmetric pairs
    of positions, the signals' products summed before it). Measured on resnet18-sized layers:
    1×1 to 3×3 maps of 256–512 channels 0.01–0.65× the per-sample time, 4×4 maps of 128
    channels 0.84× with 9 signals and 2× with 2, 6×6 maps 3× with 9.
    """
    if positions > MAX_PAIR_POSITIONS:
        return False
    cost = next(c for size, c in SQUARES_COST if entries > size)
    return positions * (positions + 1) // 2 <= signals * cost


#: From this many weight entries, a dense layer on positions forms its per-sample gradients one
#: sample at a time (:func:`_dense_squares`).
_ONE_BY_ONE_ENTRIES = 1 << 13
#: From this many weight entries, a convolution forms its per-sample gradients one sample at a
#: time (:func:`_patch_squares`, where it does not take the pairs).
_ONE_BY_ONE_CONV_ENTRIES = 1 << 15


def _chunks(n: int, per_item: int) -> Iterable[slice]:
    step = max(1, _SQUARES_BUDGET // max(per_item, 1))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


class Deltas:
    """Back-propagated signals at one layer output: ``K`` groups of ``M`` per-signal tensors
    ``(n, *out)``, kept as a list so the built-in rules can avoid stacking copies. A ``None``
    part is a zero padding signal that was not back-propagated: the built-in rules skip it."""

    def __init__(self, parts: list[torch.Tensor | None], k: int, m: int) -> None:
        self.parts, self.k, self.m = parts, k, m

    def stacked(self) -> torch.Tensor:
        """``(K, M, n, *out)`` (zeros for the padding); the per-signal tensors are released."""
        like = next(p for p in self.parts if p is not None)
        parts = [torch.zeros_like(like) if p is None else p for p in self.parts]
        out = torch.stack(parts).reshape(self.k, self.m, *like.shape)
        self.parts.clear()
        return out


def _builtin(rule):
    rule._normflat_deltas = True  # receives Deltas instead of a stacked tensor
    return rule


def _with_call(rule):
    rule._normflat_call = True  # also receives the module's other positional and keyword inputs
    return rule


def _first_of_tuple(rule):
    rule._normflat_first_of_tuple = True  # the module returns (its map's output, ...)
    return rule


def first_of_tuple(rule: Any) -> bool:
    """Whether a fast rule's module returns a tuple whose first element is its weight's map of the
    input (a router's logits; the rest computed from them inside the module): the signals are taken
    there, where they include every use of those logits, inside the module and after it."""
    return bool(getattr(rule, "_normflat_first_of_tuple", False))


def _inner_uses(rule):
    rule._normflat_inner_uses = True  # the module reads its weight several times (once per expert)
    return rule


def inner_uses(rule: Any) -> bool:
    """Whether a fast rule's module reads its weight more than once in its own forward (an experts
    module: once per expert), which the rule accounts for; uses outside the module it cannot."""
    return bool(getattr(rule, "_normflat_inner_uses", False))


def wants_call(rule: Any) -> bool:
    """Whether a fast rule takes the module's other inputs ``(args[1:], kwargs)`` too."""
    return bool(getattr(rule, "_normflat_call", False))


def wants_deltas(rule: Any) -> bool:
    """Whether a fast rule takes :class:`Deltas` (the built-in ones) or a stacked tensor."""
    return bool(getattr(rule, "_normflat_deltas", False))


def _takes_kernel_sums(rule):
    rule._normflat_kernel_sums = True  # also adds into a KernelSums, one group's squares at a time
    return rule


def takes_kernel_sums(rule: Any) -> bool:
    """Whether a fast rule adds one group's squares at a time into a :class:`KernelSums`."""
    return bool(getattr(rule, "_normflat_kernel_sums", False))


class KernelSums:
    """The running sums of a kernel-summed layer (``SumState.kernel_axes``, method §6.2), which a
    rule adds each group's squares into as soon as they are formed: the weighted numerator of
    the diagonal, ``Σ_k c_k · squares_k`` (``c`` :func:`~normflat.engine.estimators.mean_weights`),
    and the group's kernel sums. The ``K'`` full-size group sums of the layer are never held at
    once (on resnet18 with 1000 classes, ``analyze`` held six arrays of 2.4M weights per
    convolution, and their zeroing alone took a tenth of its estimator's time).

    ``mean`` and ``sums`` are the state's own running arrays (added into in place) or ``None``
    on a layer's first contribution (formed here, then handed to the state through
    :meth:`compact`).
    """

    def __init__(self, weights: Any, axes: tuple[int, ...], shape: tuple[int, ...], like: torch.Tensor,
                 mean: torch.Tensor | None = None, sums: torch.Tensor | None = None):
        self.weights = [float(w) for w in weights]
        self.axes = tuple(axes)
        lead = len(shape) - len(self.axes)
        # The kernel axes of torch's layouts are the trailing ones (TorchLayer.kernel_axes).
        assert self.axes == tuple(range(lead, len(shape))), (axes, shape)
        self.shape = (len(self.weights), *shape)
        self.kernel = math.prod(shape[lead:])
        self.reduced = (*shape[:lead], *([1] * len(self.axes)))  # one group's kernel sums
        self.like = like
        self.mean, self.sums = mean, sums

    def add(self, k: int, squares: torch.Tensor) -> None:
        """Add group ``k``'s squares (any shape of the layer's size; read, not kept)."""
        squares = squares.reshape(self.shape[1:])
        # The kernel sums by a matrix-vector product with ones: twice as fast as torch's
        # reduction over a few contiguous entries (3×3: 0.66 against 1.3 ms on 512×512).
        reduced = (squares.reshape(-1, self.kernel) @ squares.new_ones(self.kernel)).reshape(self.reduced)
        if self.sums is None:
            self.sums = reduced.new_zeros((self.shape[0], *self.reduced))
        self.sums[k] += reduced
        weight = self.weights[k]
        if self.mean is None:
            self.mean = squares * weight
        else:
            self.mean.add_(squares, alpha=weight)

    def compact(self, weights: Any, axes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(numerator, kernel sums)`` for ``SumState`` (the weights and axes it was made with)."""
        assert list(map(float, weights)) == self.weights and tuple(axes) == self.axes
        if self.mean is None:  # no group had a signal
            self.mean = self.like.new_zeros(self.shape[1:])
        if self.sums is None:
            self.sums = self.like.new_zeros((self.shape[0], *self.reduced))
        return self.mean, self.sums


def _accumulator(out: torch.Tensor | None, *shape: int, like: torch.Tensor) -> torch.Tensor:
    """The sums to add into: ``out`` viewed as ``shape`` (the state's own sums, so that a
    second chunk or batch allocates nothing), or fresh zeros."""
    return like.new_zeros(shape) if out is None else out.view(shape)


def _dense_squares(a: torch.Tensor, deltas: Deltas, out_f: int, in_f: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``(K, out, in)`` sums of squared per-sample gradients of ``y = W a`` (``W`` ``(out, in)``),
    added into ``out`` when given."""
    K, M = deltas.k, deltas.m
    n = a.shape[0]
    if a.dim() == 2:
        # Per-sample gradient δ aᵀ is rank one: its square is δ² (a²)ᵀ, summed over n by a matmul.
        d2 = []
        like = next(d for d in deltas.parts if d is not None)
        for k in range(K):
            group = [d for d in deltas.parts[k * M:(k + 1) * M] if d is not None]
            if not group:  # a group of zero signals only (per-sequence ggn-topk's shared group, §6.3)
                d2.append(like.new_zeros(like.shape))
                continue
            acc = group[0].square()
            for d in group[1:]:
                acc.addcmul_(d, d)
            d2.append(acc)
        d2t = torch.stack(d2) if K > 1 else d2[0][None]  # (K, n, out)
        if out is None:
            return torch.matmul(d2t.transpose(1, 2), a.square())
        return out.baddbmm_(d2t.transpose(1, 2), a.square()[None].expand(K, n, in_f))
    # Inputs with extra axes (sequences): per-sample gradients are sums over positions.
    a = a.reshape(n, -1, in_f)
    res = _accumulator(out, K, out_f, in_f, like=a)
    positions = int(a.shape[1])
    if squares_by_pairs(positions, M, out_f * in_f):
        # Few positions (a late stage's windows, short sequences): the squares by pairs of
        # positions, a 1×1 convolution's (method §6.1, "Squares by pairs of positions"), the
        # signals' products summed per group before one matmul; no per-sample gradient formed.
        parts = [None if d is None else d.reshape(n, positions, out_f).transpose(1, 2) for d in deltas.parts]
        fresh = res if res.is_contiguous() else None  # a transposed layout's sums: added below
        got = _patch_squares(a.transpose(1, 2)[:, None], Deltas(parts, K, M), (out_f, in_f), fresh)
        if fresh is None:
            res += got
        return res
    # A layer's per-sample gradients one sample at a time, squared into the sums in one pass
    # (addcmul_): 1.1-2.6x faster than chunks of them squared and summed over the samples from
    # 64x128 entries on (memory-bound; measured on 64x128 to 768x3072 layers, 4 to 256
    # positions), 2-3x slower below 64x64 (the Python loop).
    one_by_one = out_f * in_f >= _ONE_BY_ONE_ENTRIES
    for j, d in enumerate(deltas.parts):
        if d is None:
            continue
        d = d.reshape(n, -1, out_f)
        if one_by_one:
            acc = res[j // M]
            for i in range(n):
                g = torch.mm(d[i].t(), a[i])
                acc.addcmul_(g, g)
            continue
        for sl in _chunks(n, out_f * in_f):
            g = torch.matmul(d[sl].transpose(1, 2), a[sl])  # (c, out, in) per-sample gradients
            res[j // M] += g.square_().sum(0)
    return res


@_builtin
def linear_squares(module: nn.Module, a: torch.Tensor, deltas: Deltas, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Fast GGN rule of ``nn.Linear``: ``(K, out, in)`` sums of squared per-sample gradients
    (added into ``out``, the running sums, when given: the built-in rules all take it)."""
    out_f, in_f = module.weight.shape
    return _dense_squares(a, deltas, out_f, in_f, out)


@_builtin
def transposed_linear_squares(module: nn.Module, a: torch.Tensor, deltas: Deltas,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """Fast GGN rule of a dense layer storing its weight as ``(in, out)`` (``y = a W + b``, e.g.
    Hugging Face ``Conv1D``): ``(K, in, out)`` sums, in the parameter's own layout."""
    in_f, out_f = module.weight.shape
    return _dense_squares(a, deltas, out_f, in_f, None if out is None else out.transpose(1, 2)).transpose(1, 2)


def _recorded_inside(rule):
    rule._normflat_recorded = True  # its weight's map is recorded where it is applied (recorded_inside)
    return rule


def recorded_inside(rule: Any) -> bool:
    """Whether a fast rule's weight is applied where a forward hook on its module cannot see it,
    and is recorded there instead: inside the plain recurrence
    (:func:`~normflat.backends.torch.compat.recurrent_taps`), or at an embedding's own lookup
    (:class:`FunctionalTaps`)."""
    return bool(getattr(rule, "_normflat_recorded", False))


@_builtin
@_recorded_inside
def recurrent_squares(module: nn.Module, a: torch.Tensor, deltas: Deltas, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Fast GGN rule of a recurrent weight (``nn.RNN``/``nn.LSTM``/``nn.GRU``): ``(K, out, in)`` sums of
    squared per-sample gradients. The recurrence records what the weight multiplies at every step,
    ``a`` ``(n, T, in)``, and the signals at its product, ``(n, T, out)``: a sample's gradient is
    ``Σ_t δ_t a_tᵀ``, a dense layer's over positions (method §6.1, "Recurrent weights")."""
    like = next(d for d in deltas.parts if d is not None)
    return _dense_squares(a, deltas, int(like.shape[-1]), int(a.shape[-1]), out)


def _foldable(rule):
    rule._normflat_foldable = True
    return rule


@_foldable
@_builtin
@_recorded_inside
def attention_squares(module: nn.Module, a: torch.Tensor, deltas: Deltas, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Fast GGN rule of a projection of ``nn.MultiheadAttention`` (the packed or the separate query,
    key and value weights, the output projection): ``(K, out, in)`` sums of squared per-sample
    gradients. ``F.multi_head_attention_forward`` applies each by one ``F.linear`` call, sequence
    first; :class:`Capture` records it batch first, the input ``(n, L, in)`` and the signals at its
    output ``(n, L, out)``: a dense layer over the positions (method §6.1, "Attention projections
    applied functionally")."""
    like = next(d for d in deltas.parts if d is not None)
    return _dense_squares(a, deltas, int(like.shape[-1]), int(a.shape[-1]), out)


def foldable(rule: Any) -> bool:
    """Whether a fast rule's per-sample gradient sums over every axis between the samples and the
    features, so that a sample's block of rows (a batch folded into the leading axis) can be given
    as positions: ``(n·f, *, in)`` viewed as ``(n, f, *, in)`` (the dense rules; the experts'); a
    convolution's sums over its output positions, and takes ``(n, f, C, *space)`` with the ``f``
    maps' positions as one sample's (:func:`folded_patches`)."""
    return bool(getattr(rule, "_normflat_foldable", False))


_foldable(linear_squares)
_foldable(transposed_linear_squares)
_foldable(recurrent_squares)


def _conv_pads(module: nn.Module) -> list[int]:
    """``F.pad`` amounts (last axis first), as the module's forward pads."""
    k, dil = module.kernel_size, module.dilation
    pads: list[int] = []
    for d in reversed(range(len(k))):
        if isinstance(module.padding, str):
            if module.padding == "valid":
                left = right = 0
            else:  # "same": torch puts the odd extra element on the right
                total = dil[d] * (k[d] - 1)
                left, right = total // 2, total - total // 2
        else:
            left = right = module.padding[d]
        pads += [left, right]
    return pads


def _unfold(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """Input patches ``(n, C·∏k, L)``, channel-major like the flattened weight."""
    k, dil, stride = module.kernel_size, module.dilation, module.stride
    pads = _conv_pads(module)
    if len(k) == 2 and module.padding_mode == "zeros" and pads[0] == pads[1] and pads[2] == pads[3]:
        return F.unfold(a, k, dilation=dil, padding=(pads[2], pads[0]), stride=stride)
    if any(pads):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        a = F.pad(a, pads, mode=mode)
    a = a.contiguous()
    n, c, *space = a.shape
    out = [(space[d] - dil[d] * (k[d] - 1) - 1) // stride[d] + 1 for d in range(len(k))]
    st = a.stride()
    view = a.as_strided(
        (n, c, *k, *out),
        (st[0], st[1], *(st[2 + d] * dil[d] for d in range(len(k))),
         *(st[2 + d] * stride[d] for d in range(len(k)))),
    )
    return view.reshape(n, c * math.prod(k), math.prod(out))


def _conv_patches(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """A convolution's unfolded input by group, ``(n, groups, in/groups·∏k, L)``: channel-major as
    the flattened weight, so a group's channels are one block of the rows."""
    unf = _unfold(module, a)
    return unf.reshape(a.shape[0], module.groups, -1, unf.shape[-1])


def _pair_products(x: torch.Tensor, pairs: torch.Tensor, doubled: torch.Tensor | None = None) -> torch.Tensor:
    """``(c, g, P, d)`` products ``x_l ⊙ x_l'`` over the ``P`` pairs ``l <= l'`` of the last axis
    of ``x`` ``(c, g, d, L)`` (``pairs``: their flat indices ``l·L + l'``).

    ``doubled``: ``(P,)`` mask of the pairs whose product is doubled (the off-diagonal ones,
    each standing for ``(l, l')`` and ``(l', l)``). The products are formed position-major and the pairs picked as whole rows:
    a gather along the strided position axis was 5× slower than the matmul it feeds (measured).
    """
    c, g, d, L = x.shape
    rows = x.transpose(-1, -2).contiguous()  # (c, g, L, d)
    full = (rows[:, :, :, None] * rows[:, :, None]).reshape(c, g, L * L, d)
    out = full.index_select(2, pairs)
    if doubled is not None:
        out[:, :, doubled] *= 2
    return out


@_foldable
@_takes_kernel_sums
@_builtin
def conv_squares(module: nn.Module, a: torch.Tensor, deltas: Deltas,
                 out: torch.Tensor | KernelSums | None = None) -> torch.Tensor | KernelSums:
    """Fast GGN rule of ``nn.ConvNd``: per-sample gradients ``δ Uᵀ`` of the unfolded input ``U``,
    group by group, squared and summed; into ``out`` (the running ``(K, *weight)`` sums, or a
    :class:`KernelSums` that takes each group's squares as they are done) when given."""
    return _patch_squares(folded_patches(module, a, deltas), deltas, tuple(module.weight.shape), out)


def folded_patches(module: nn.Module, a: torch.Tensor, deltas: Deltas,
                   pad: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """A convolution's patches ``(n, groups, in/groups·∏k, L)`` of its input ``a``, padded first by
    ``pad(module, input)`` when given.

    An input ``(n, f, C, *space)`` is each sample's ``f`` maps folded into the batch axis (MViTv2's
    pooling convolutions see ``(n·heads, d, h, w)``; :func:`foldable`): its patches are the ``f``
    maps' positions one after the other, ``L = f · positions``, and the signals' parts ``(n, f,
    out, *positions)`` are viewed in place as ``(n, out, f, *positions)`` to match."""
    if a.dim() != len(module.kernel_size) + 3:
        return _conv_patches(module, a if pad is None else pad(module, a))
    n, f = int(a.shape[0]), int(a.shape[1])
    flat = a.flatten(0, 1)
    patches = _conv_patches(module, flat if pad is None else pad(module, flat))  # (n·f, g, m, L)
    _, g, m, positions = patches.shape
    deltas.parts[:] = [None if p is None else p.transpose(1, 2) for p in deltas.parts]
    return patches.reshape(n, f, g, m, positions).permute(0, 2, 3, 1, 4).reshape(n, g, m, f * positions)


def _patch_squares(unf: torch.Tensor, deltas: Deltas, shape: tuple[int, ...],
                   out: torch.Tensor | KernelSums | None = None) -> torch.Tensor | KernelSums:
    """:func:`conv_squares` on the unfolded input ``unf`` ``(n, groups, in/groups·∏k, L)`` of a
    convolution whose weight has ``shape`` ``(out, in/groups, *k)``."""
    K, M = deltas.k, deltas.m
    n, g = unf.shape[0], unf.shape[1]
    cout, cin_g, *k = shape
    cout_g, kk = cout // g, cin_g * math.prod(k)
    L = unf.shape[-1]
    sink = out if isinstance(out, KernelSums) else None
    # The groups' sums: the running ones, or fresh ones; with a sink, one group's at a time.
    res = None if sink is not None else _accumulator(out, K, g, cout_g, kk, like=unf)
    if squares_by_pairs(L, M, g * cout_g * kk):
        # A per-sample gradient Σ_l δ_l u_lᵀ has the square Σ_{l,l'} (δ_l ⊙ δ_l') (u_l ⊙ u_l')ᵀ:
        # over the pairs l <= l' (off-diagonal ones twice), and the products of the signals of
        # a group summed before one matmul per group, since the input's products do not depend
        # on the signal. No per-sample gradient is formed: the fast way for few output positions
        # (the small maps of a deep CNN on small images) or many signals per group.
        first, second = torch.triu_indices(L, L, device=unf.device)
        pairs, off_diagonal = first * L + second, first != second
        P = int(pairs.shape[0])
        for sl in _chunks(n, L * L * g * (cout_g + kk)):
            c = sl.stop - sl.start
            u2 = _pair_products(unf[sl], pairs).transpose(0, 1).reshape(g, c * P, kk)
            for group in range(K):
                d2 = None
                for j in range(group * M, (group + 1) * M):
                    if deltas.parts[j] is None:
                        continue
                    prod = _pair_products(deltas.parts[j].reshape(n, g, cout_g, L)[sl], pairs, off_diagonal)
                    d2 = prod if d2 is None else d2.add_(prod)
                if d2 is None:
                    continue
                d2 = d2.transpose(0, 1).reshape(g, c * P, cout_g)
                if sink is None:
                    res[group].baddbmm_(d2.transpose(1, 2), u2)
                else:
                    sink.add(group, torch.bmm(d2.transpose(1, 2), u2))
        deltas.parts.clear()
        return sink if sink is not None else res.reshape(K, *shape)
    # One signal at a time: no stacked copy of the signals, and each chunk of per-sample
    # gradients stays in cache while it is squared and summed; from _ONE_BY_ONE_CONV_ENTRIES
    # entries, one sample's at a time, squared into the sums in one pass (addcmul_: 1.2-1.5x
    # faster there, measured on 64x576 to 144x864 kernels; slower below, the Python loop).
    one_by_one = g * cout_g * kk >= _ONE_BY_ONE_CONV_ENTRIES
    for group in range(K):
        total = res[group] if sink is None else None
        for j in range(group * M, (group + 1) * M):
            if deltas.parts[j] is None:
                continue
            d, deltas.parts[j] = deltas.parts[j].reshape(n, g, cout_g, L), None
            if one_by_one:
                if total is None:
                    total = unf.new_zeros(g, cout_g, kk)
                for i in range(n):
                    ps = torch.bmm(d[i], unf[i].transpose(-1, -2))  # one sample's gradient (g, cout_g, kk)
                    total.addcmul_(ps, ps)
                del d
                continue
            for sl in _chunks(n, g * cout_g * kk):
                ps = torch.matmul(d[sl], unf[sl].transpose(-1, -2))  # per-sample gradients (c, g, cout_g, kk)
                squares = ps.square_().sum(0)
                total = squares if total is None else total.add_(squares)
            del d
        if sink is not None and total is not None:
            sink.add(group, total)
    return sink if sink is not None else res.reshape(K, *shape)


@_takes_kernel_sums
@_builtin
def conv_transpose_squares(module: nn.Module, a: torch.Tensor, deltas: Deltas,
                           out: torch.Tensor | KernelSums | None = None) -> torch.Tensor | KernelSums:
    """ConvTranspose is the adjoint of the convolution with the same weight, so its
    per-sample weight gradient is the conv weight gradient with the roles of the
    input and the output signal swapped: patches of the signal times the input. Into a
    :class:`KernelSums` ``out``, one group's squares at a time."""
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        raise NoFastPath("ConvTranspose with string padding or non-zero padding mode")
    K, M = deltas.k, deltas.m
    signals = deltas.stacked()
    n = a.shape[0]
    cin, cout_g, *k = module.weight.shape  # (in, out/groups, *k)
    g = module.groups
    cin_g, kk = cin // g, cout_g * math.prod(k)
    unf = _unfold(module, signals.reshape(K * M * n, *signals.shape[3:]))  # (KMn, cout·∏k, L)
    L = unf.shape[-1]
    unf = unf.reshape(K * M, n, g, kk, L).permute(1, 2, 0, 3, 4)  # (n, g, KM, kk, L)
    x = a.reshape(n, g, 1, cin_g, L)
    sink = out if isinstance(out, KernelSums) else None
    # One group at a time: into the sink as soon as it is done, or into its slot of the K sums.
    res = None if sink is not None else a.new_zeros(g, K, cin_g, kk)
    for group in range(K):
        signals_k = unf[:, :, group * M:(group + 1) * M]  # (n, g, M, kk, L)
        squares = a.new_zeros(g, cin_g, kk) if sink is not None else res[:, group]
        for sl in _chunks(n, g * M * cin_g * kk):
            ps = torch.matmul(x[sl], signals_k[sl].transpose(-1, -2))  # (c, g, M, cin_g, kk)
            squares += ps.square_().sum((0, 2))
        if sink is not None:
            sink.add(group, squares.reshape(cin, cout_g, *k))
    if sink is not None:
        return sink
    res = res.permute(1, 0, 2, 3).reshape(K, cin, cout_g, *k)
    return res if out is None else out.add_(res)


def _scatter_squares(table: torch.Tensor, keys: torch.Tensor, entry_weights: torch.Tensor | None,
                     entry_rows: torch.Tensor, deltas: Deltas, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sums of squared per-sample gradients of a looked-up table ``(V, d)``.

    Entry ``e`` of the lookups adds ``weight_e · table[row of key_e]`` to output row
    ``entry_rows[e]``; ``keys`` (``sample · V + id``) identify the table rows of one
    sample. A sample's gradient of row ``v`` is the sum of the output signals of its
    entries with id ``v``: sum equal keys, square, and scatter-add into the table rows,
    without any ``(n, V, d)`` tensor.
    """
    K, M = deltas.k, deltas.m
    vocab, d = table.shape
    uniq, inverse = torch.unique(keys, return_inverse=True)
    rows = uniq % vocab
    res = _accumulator(out, K, vocab, d, like=table)
    for j in range(len(deltas.parts)):
        part, deltas.parts[j] = deltas.parts[j], None
        if part is None:
            continue
        signal = part.reshape(-1, d)[entry_rows]
        if entry_weights is not None:
            signal = signal * entry_weights[:, None]
        per_sample = signal.new_zeros(uniq.shape[0], d).index_add_(0, inverse, signal)
        res[j // M].index_add_(0, rows, per_sample.square_())
    return res


@_builtin
def embedding_squares(module: nn.Module, ids: torch.Tensor, deltas: Deltas, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Fast GGN rule of ``nn.Embedding``: ``(K, V, d)`` sums of squared per-sample gradients.

    Rows at ``padding_idx`` get no gradient (as in torch's backward).
    """
    return lookup_squares(module.weight, ids, module.padding_idx, deltas, out)


def lookup_squares(table: torch.Tensor, ids: torch.Tensor, padding_idx: int | None, deltas: Deltas,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``(K, V, d)`` sums of squared per-sample gradients of a table ``(V, d)`` looked up at ``ids``
    ``(n, ...)`` (``F.embedding``), from the signals at the lookup's output; rows at ``padding_idx`` get
    no gradient (as in torch's backward)."""
    vocab = table.shape[0]
    n = ids.shape[0]
    flat = ids.reshape(n, -1)
    sample = torch.arange(n, device=ids.device).repeat_interleave(flat.shape[1])
    flat = flat.reshape(-1).long()
    entry_rows = torch.arange(flat.shape[0], device=ids.device)
    if padding_idx is not None:
        keep = flat != padding_idx
        flat, sample, entry_rows = flat[keep], sample[keep], entry_rows[keep]
    return _scatter_squares(table, sample * vocab + flat, None, entry_rows, deltas, out)


@_builtin
@_recorded_inside
def recorded_lookup_squares(module: nn.Module, ids: torch.Tensor, deltas: Deltas, out: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Fast GGN rule of an ``nn.Embedding`` subclass with its own ``forward`` (OPT's and mBART's
    learned positions: ids computed inside, then ``nn.Embedding``'s lookup): ``nn.Embedding``'s rule
    on the ids and the signals of the one ``F.embedding`` call on its weight, which
    :class:`FunctionalTaps` records (method §6.1, "Embeddings with their own forward")."""
    return embedding_squares(module, ids, deltas, out)


@_with_call
@_builtin
def embedding_bag_squares(module: nn.Module, ids: torch.Tensor, deltas: Deltas, args: tuple = (),
                          kwargs: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fast GGN rule of ``nn.EmbeddingBag`` (modes ``sum`` and ``mean``, with offsets,
    ``per_sample_weights`` and ``padding_idx``); each bag is one sample (output row)."""
    kwargs = kwargs or {}
    if module.mode == "max":
        raise NoFastPath("EmbeddingBag mode='max'")
    offsets = args[0] if len(args) > 0 else kwargs.get("offsets")
    weights = args[1] if len(args) > 1 else kwargs.get("per_sample_weights")
    vocab = module.weight.shape[0]
    bags = next(p for p in deltas.parts if p is not None).shape[0]
    if ids.dim() == 2:
        flat = ids.reshape(-1).long()
        bag = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(ids.shape[1])
    else:
        if offsets is None:
            raise NoFastPath("EmbeddingBag with 1-D input and no offsets")
        flat = ids.long()
        starts = offsets[:bags].long()
        bag = torch.searchsorted(starts, torch.arange(flat.shape[0], device=ids.device), right=True) - 1
    w = torch.ones(flat.shape[0], dtype=module.weight.dtype, device=ids.device)
    if weights is not None:
        w = w * weights.reshape(-1).to(w.dtype)
    keep = bag >= 0
    if module.padding_idx is not None:
        keep = keep & (flat != module.padding_idx)  # padding entries are left out of the bag
    flat, bag, w = flat[keep], bag[keep], w[keep]
    if module.mode == "mean":
        counts = torch.zeros(bags, dtype=w.dtype, device=w.device).index_add_(0, bag, torch.ones_like(w))
        w = w / counts[bag]
    return _scatter_squares(module.weight, bag * vocab + flat, w, bag, deltas, out)


@_builtin
def position_table_squares(module: nn.Module, table: torch.Tensor, deltas: Deltas,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Fast GGN rule of a learned position table added to the activations (method §6.1,
    "Position tables"): ``(K, *table.shape)`` sums of squared per-sample gradients.

    The session runs the model with the table (``table``, the detached parameter) replaced by
    its view expanded over the batch, ``(n, *table.shape[1:])`` for a leading axis of 1, else
    ``(n, *table.shape)``; the signal at that view is each sample's gradient of the table
    itself, squared and summed over the samples. ``module`` is the table's owner (unused).
    """
    K, M = deltas.k, deltas.m
    res = _accumulator(out, K, *table.shape, like=table)
    rows = res.reshape(K, -1)
    for j in range(len(deltas.parts)):
        part, deltas.parts[j] = deltas.parts[j], None
        if part is None:
            continue
        flat = part.reshape(part.shape[0], -1)
        for sl in _chunks(flat.shape[0], flat.shape[1]):
            rows[j // M] += flat[sl].square().sum(0)
    return res


def _linear_gradients(module: nn.Module, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``(n, out, in)`` per-sample gradients of ``nn.Linear``'s weight for one signal ``d``
    ``(n, ..., out)`` at its output (summed over the positions of sequence inputs)."""
    n, out_f, in_f = a.shape[0], module.weight.shape[0], module.weight.shape[1]
    return torch.matmul(d.reshape(n, -1, out_f).transpose(1, 2), a.reshape(n, -1, in_f))


def _embedding_gradients(module: nn.Module, ids: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``(n, V, dim)`` per-sample gradients of ``nn.Embedding``'s table for one signal ``d``
    ``(n, ..., dim)`` at its output: each sample's signals added into the rows of its ids (none
    at ``padding_idx``, as in torch's backward)."""
    vocab, dim = module.weight.shape
    n = ids.shape[0]
    flat = ids.reshape(n, -1).long()
    rows = (torch.arange(n, device=ids.device)[:, None] * vocab + flat).reshape(-1)
    signal = d.reshape(-1, dim)
    if module.padding_idx is not None:
        keep = flat.reshape(-1) != module.padding_idx
        rows, signal = rows[keep], signal[keep]
    return d.new_zeros(n * vocab, dim).index_add_(0, rows, signal).reshape(n, vocab, dim)


def _embed_scale(module: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """The factor a scaled word embedding multiplies its rows by, as its forward applies it (a
    float, or a 0-d buffer cast to the weight's dtype, then to the signals')."""
    scale = module.embed_scale
    if isinstance(scale, torch.Tensor):
        return scale.to(module.weight.dtype).to(like.dtype)
    return torch.tensor(float(scale), dtype=like.dtype, device=like.device)


@_builtin
def scaled_embedding_squares(module: nn.Module, ids: torch.Tensor, deltas: Deltas, out: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """Fast GGN rule of a scaled word embedding (Hugging Face's ``*ScaledWordEmbedding``: Gemma,
    BART, Pegasus-X, ...; ``embedding(ids) · embed_scale``): ``nn.Embedding``'s rule on the
    signals times the scale."""
    like = next((p for p in deltas.parts if p is not None), None)
    if like is not None:
        scale = _embed_scale(module, like)
        deltas.parts[:] = [None if p is None else p * scale for p in deltas.parts]
    return embedding_squares(module, ids, deltas, out)


def _conv_gradients(module: nn.Module, patches: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``(n, out, in/groups, *k)`` per-sample gradients of a convolution's weight for one signal ``d``
    ``(n, out, *positions)`` at its output, from its input's :func:`_conv_patches`: per group, the
    signal at every output position times the input patch there, summed over the positions."""
    n, groups, _, positions = patches.shape
    weight = module.weight
    signal = d.reshape(n, groups, weight.shape[0] // groups, positions)
    return torch.matmul(signal, patches.transpose(-1, -2)).reshape(n, *weight.shape)


def _conv_transpose_gradients(module: nn.Module, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``(n, in, out/groups, *k)`` per-sample gradients of a transposed convolution's weight for one
    signal ``d`` ``(n, out, *positions)`` at its output: per group, the input at every input position
    times the patch of the signal it wrote to (:func:`conv_transpose_squares`)."""
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        raise NoFastPath("ConvTranspose with string padding or non-zero padding mode")
    weight = module.weight
    n, g = a.shape[0], module.groups
    cin, cout_g = weight.shape[0], weight.shape[1]
    patches = _unfold(module, d)  # (n, out·∏k, L): L = the input's positions
    patches = patches.reshape(n, g, cout_g * math.prod(weight.shape[2:]), patches.shape[-1])
    x = a.reshape(n, g, cin // g, patches.shape[-1])
    return torch.matmul(x, patches.transpose(-1, -2)).reshape(n, *weight.shape)


def _scaled_embedding_gradients(module: nn.Module, ids: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return _embedding_gradients(module, ids, d * _embed_scale(module, d))


#: Per-sample weight gradients ``(module, layer input, one signal at its output) -> (n, *weight
#: shape)`` of the layers whose fast rule is the key: a weight used by several such modules (an
#: output layer tied to the token embedding), or by several calls of one module (ALBERT's shared
#: layers, a siamese encoder), sums its uses' gradients before squaring. The layer input is as
#: :data:`USE_INPUTS` prepares it.
PER_SAMPLE_GRADIENTS: dict[Any, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    linear_squares: _linear_gradients,
    conv_squares: _conv_gradients,
    conv_transpose_squares: _conv_transpose_gradients,
    embedding_squares: _embedding_gradients,
    scaled_embedding_squares: _scaled_embedding_gradients,
}
#: ``module -> (input, signals) -> per-sample gradients``: the rule's :data:`PER_SAMPLE_GRADIENTS`
#: for one module with what it reads from the module formed once (a weight normalization's
#: Jacobian, :func:`weight_norm_rule`), where that is worth doing.
PREPARED_GRADIENTS: dict[Any, Callable[[nn.Module], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {}
#: ``(module, captured input) -> input`` of :data:`PER_SAMPLE_GRADIENTS` where a use's input is
#: prepared once for all its signals (a convolution's patches); the others take it as captured.
USE_INPUTS: dict[Any, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {conv_squares: _conv_patches}


def tied_squares(uses: list[tuple[nn.Module, Any, torch.Tensor]], deltas: list[Deltas],
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``(K, *weight shape)`` sums of squared per-sample gradients of one weight used by several
    modules: per signal, the sum over the uses of each use's per-sample gradient
    (:data:`PER_SAMPLE_GRADIENTS`), squared and summed over the samples, a chunk of samples at a time.

    Args:
        uses: ``(module, its squares rule, its captured input)`` per use, all with the same weight.
        deltas: Each use's signals at its output (the same ``K``, ``M``).
        out: The running sums to add into.
    """
    first = deltas[0]
    k, m = first.k, first.m
    weight = uses[0][0].weight
    res = _accumulator(out, k, *weight.shape, like=weight.detach())
    n = uses[0][2].shape[0]
    # Each use's input prepared once, not once per signal (a convolution's unfolded patches).
    inputs = [USE_INPUTS[rule](module, a) if rule in USE_INPUTS else a for module, rule, a in uses]
    # And each use's gradient map made once (a weight normalization's Jacobian), not per signal.
    maps = [PREPARED_GRADIENTS[rule](module) if rule in PREPARED_GRADIENTS
            else functools.partial(PER_SAMPLE_GRADIENTS[rule], module) for module, rule, _ in uses]
    for j in range(k * m):
        parts = [(gradients, a, d.parts[j]) for gradients, a, d in zip(maps, inputs, deltas)
                 if d.parts[j] is not None]
        if not parts:
            continue
        for sl in _chunks(n, weight.numel()):
            g = None
            for gradients, a, part in parts:
                gi = gradients(a[sl], part[sl])
                g = gi if g is None else g.add_(gi)
            res[j // m] += g.square_().sum(0)
    for d in deltas:
        d.parts.clear()
    return res


def weight_normalization(module: nn.Module) -> tuple[nn.Parameter, nn.Parameter, int] | None:
    """``(v, g, dim)`` of a module whose ``weight`` is torch's weight normalization
    ``W = g · v / ‖v‖`` of a direction ``v`` by norms ``g`` over every axis but ``dim`` (``-1``: the
    whole tensor), by ``torch.nn.utils.parametrizations.weight_norm`` or the older
    ``torch.nn.utils.weight_norm`` hook; ``None`` otherwise (any other parametrization)."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(module, "weight"):
        chain = module.parametrizations["weight"]
        if len(chain) == 1 and type(chain[0]).__name__ == "_WeightNorm" and type(chain[0]).__module__.startswith(
                "torch.nn.utils"):
            g, v = getattr(chain, "original0", None), getattr(chain, "original1", None)
            if isinstance(g, nn.Parameter) and isinstance(v, nn.Parameter):
                return v, g, int(chain[0].dim)
        return None
    hooks = [h for h in module._forward_pre_hooks.values()
             if type(h).__name__ == "WeightNorm" and type(h).__module__ == "torch.nn.utils.weight_norm"
             and getattr(h, "name", None) == "weight"]
    v, g = getattr(module, "weight_v", None), getattr(module, "weight_g", None)
    if len(hooks) == 1 and isinstance(v, nn.Parameter) and isinstance(g, nn.Parameter):
        return v, g, int(hooks[0].dim)
    return None


def _direction_jacobian(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """``(û, c, axes)`` of a weight-normalized module: per slice of ``v`` normalized together (over
    ``axes``), ``∂W/∂v = c (I − û ûᵀ)`` with ``û = v / ‖v‖`` and ``c = g / ‖v‖`` (method §6.1,
    "Weight-normalized layers"). Checks that the weight the forward applies is ``c · v``."""
    read = weight_normalization(module)
    if read is None:
        raise NoFastPath("its weight normalization is no longer torch's weight_norm")
    v, g, dim = (read[0].detach(), read[1].detach(), read[2])
    if not -1 <= dim < v.dim():
        raise NoFastPath(f"weight normalization over dim={dim}, which torch reads as no slice of the weight")
    norms = torch.norm_except_dim(v, 2, dim)
    if not bool((norms > 0).all()):
        raise NoFastPath("a slice of its direction v is zero, where W = g · v / ‖v‖ is undefined")
    direction, factor = v / norms, g / norms
    with torch.no_grad():
        applied = module.weight.detach()
    eps = torch.finfo(v.dtype).eps
    if applied.shape != v.shape or not torch.allclose(applied, factor * v, rtol=64 * eps,
                                                      atol=64 * eps * float(applied.abs().max())):
        raise NoFastPath("the weight its forward applies is not g · v / ‖v‖ of its weight normalization")
    axes = tuple(i for i in range(v.dim()) if i != dim)
    return direction, factor, axes


def _direction_gradients(gw: torch.Tensor, direction: torch.Tensor, factor: torch.Tensor,
                         axes: tuple[int, ...]) -> torch.Tensor:
    """Per-sample gradients ``(n, *v.shape)`` of the direction ``v`` from those of the applied weight:
    ``c (G − û ⟨û, G⟩)``, the inner product over each normalized slice."""
    along = (gw * direction).sum(tuple(a + 1 for a in axes), keepdim=True)
    return (gw - direction * along).mul_(factor)


def spectral_normalization(module: nn.Module) -> tuple[nn.Parameter, torch.Tensor, torch.Tensor, int] | None:
    """``(original, u, v, dim)`` of a module whose ``weight`` is torch's spectral normalization
    ``W = V / σ``, ``σ = uᵀ V_dim v`` (``V_dim``: ``V`` with axis ``dim`` first, the others flattened;
    ``u``, ``v`` the power iteration's vectors, buffers), by
    ``torch.nn.utils.parametrizations.spectral_norm`` or the older ``torch.nn.utils.spectral_norm``
    hook; ``None`` otherwise (any other parametrization, or a vector's ``V / ‖V‖``)."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(module, "weight"):
        chain = module.parametrizations["weight"]
        norm = chain[0] if len(chain) == 1 else None
        if type(norm).__name__ == "_SpectralNorm" and type(norm).__module__.startswith("torch.nn.utils"):
            original = getattr(chain, "original", None)
            if isinstance(original, nn.Parameter) and original.dim() > 1:
                return original, norm._u, norm._v, int(norm.dim)
        return None
    hooks = [h for h in module._forward_pre_hooks.values()
             if type(h).__name__ == "SpectralNorm" and type(h).__module__ == "torch.nn.utils.spectral_norm"
             and getattr(h, "name", None) == "weight"]
    original = getattr(module, "weight_orig", None)
    u, v = getattr(module, "weight_u", None), getattr(module, "weight_v", None)
    if len(hooks) == 1 and isinstance(original, nn.Parameter) and isinstance(u, torch.Tensor) \
            and isinstance(v, torch.Tensor):
        return original, u, v, int(hooks[0].dim)
    return None


class _WeightMap(NamedTuple):
    """How a normalized layer's per-sample gradients of its applied weight ``W`` become those of the
    parameter it is computed from: ``parameter`` (detached: its shape, dtype and device) and
    ``of_weight``, the map ``(n, *W.shape) -> (n, *parameter.shape)`` (the transposed Jacobian)."""

    parameter: torch.Tensor
    of_weight: Callable[[torch.Tensor], torch.Tensor]


def _weight_norm_map(module: nn.Module) -> _WeightMap:
    """:class:`_WeightMap` of a weight-normalized layer: to the direction ``v`` (:func:`_direction_jacobian`)."""
    direction, factor, axes = _direction_jacobian(module)
    return _WeightMap(direction, lambda gw: _direction_gradients(gw, direction, factor, axes))


def _spectral_norm_map(module: nn.Module) -> _WeightMap:
    """:class:`_WeightMap` of a spectrally normalized layer (method §6.1, "Spectrally normalized layers"): with
    ``u``, ``v`` fixed (no power iteration in eval mode), ``∂σ/∂V = u vᵀ`` (laid out as ``V``), so a
    per-sample gradient of ``V`` is ``(G − ⟨G, W⟩ u vᵀ) / σ`` of the applied weight's ``G``, the inner
    product over the whole weight. Checks that the weight the forward applies is ``V / σ``."""
    read = spectral_normalization(module)
    if read is None:
        raise NoFastPath("its spectral normalization is no longer torch's spectral_norm")
    original, u, v, dim = read[0].detach(), read[1].detach(), read[2].detach(), read[3]
    if not -original.dim() <= dim < original.dim():
        raise NoFastPath(f"spectral normalization over dim={dim}, which is no axis of the weight")
    dim %= original.dim()
    order = [dim, *(d for d in range(original.dim()) if d != dim)]
    shape = [original.shape[d] for d in order]
    sigma = torch.dot(u, original.permute(order).reshape(shape[0], -1) @ v)
    if not bool(sigma.abs() > 0):
        raise NoFastPath("its spectral normalization divides by σ = uᵀ W v = 0")
    outer = torch.outer(u, v).reshape(shape).permute([order.index(d) for d in range(len(order))])
    weight = original / sigma
    with torch.no_grad():
        applied = module.weight.detach()
    eps = torch.finfo(original.dtype).eps
    if applied.shape != weight.shape or not torch.allclose(applied, weight, rtol=64 * eps,
                                                           atol=64 * eps * float(applied.abs().max())):
        raise NoFastPath("the weight its forward applies is not V / σ of its spectral normalization")
    axes = tuple(range(1, original.dim() + 1))

    def of_weight(gw: torch.Tensor) -> torch.Tensor:
        along = (gw * weight).sum(axes, keepdim=True)
        return (gw - outer * along).div_(sigma)

    return _WeightMap(original, of_weight)


#: The fast rules of normalized layers, one per normalization and rule of the layer beneath (made
#: once: a rule object is a layer kind's identity).
_NORMALIZED_RULES: dict[tuple[str, Any], Any] = {}
_NORMALIZED_LOCK = threading.Lock()
#: Each normalization's :class:`_WeightMap` maker.
_WEIGHT_MAPS: dict[str, Callable[[nn.Module], _WeightMap]] = {"weight_norm": _weight_norm_map,
                                                              "spectral_norm": _spectral_norm_map}


def normalizes_weight(rule: Any) -> bool:
    """Whether a fast rule is a normalized layer's (:func:`weight_norm_rule`, :func:`spectral_norm_rule`)."""
    return bool(getattr(rule, "_normflat_normalized", False))


def normalization_edges(module: nn.Module) -> int:
    """The autograd graph's edges from one evaluation of a normalized module's weight to the parameter
    analyzed: for weight normalization's direction ``v``, one through torch's fused kernel (norms over
    the first or the last axis), two where it composes the norm and the division (over any other
    axis, or the whole tensor); for spectral normalization's ``V``, the division's and ``σ``'s. The
    graph's count of the parameter's uses is this many per application of the weight."""
    read = weight_normalization(module)
    if read is not None:
        v, g, dim = read
        with torch.enable_grad():
            applied = compat.weight_norm(v, g, dim)
        edges, _ = inspect_graph(applied.grad_fn, {id(v): v}, [])
        return max(edges[id(v)], 1)
    spectral = spectral_normalization(module)
    if spectral is None:
        return 1
    original = spectral[0]
    from torch.nn.utils import parametrize

    with torch.enable_grad():
        if parametrize.is_parametrized(module, "weight"):
            norm = module.parametrizations["weight"][0]
            if norm.training:  # its forward would take a power-iteration step on the buffers
                return 2
            applied = norm(original)
        else:
            hook = next(h for h in module._forward_pre_hooks.values() if type(h).__name__ == "SpectralNorm")
            applied = hook.compute_weight(module, do_power_iteration=False)
    edges, _ = inspect_graph(applied.grad_fn, {id(original): original}, [])
    return max(edges[id(original)], 1)


def weight_norm_rule(base: Any) -> Any:
    """The fast GGN rule of a layer whose weight is torch's weight normalization ``W = g · v / ‖v‖``,
    for the direction ``v``, on top of the layer's own rule ``base`` (which must have per-sample
    gradients, :data:`PER_SAMPLE_GRADIENTS`), or ``None`` where it has none.

    Per slice of ``v`` normalized together, ``∂W/∂v = c (I − û ûᵀ)`` (:func:`_direction_jacobian`), a
    symmetric map, so each per-sample gradient of ``v`` is ``c (G − û ⟨û, G⟩)`` of the applied weight's
    ``G``: formed a chunk of samples at a time for every signal, mapped, squared and summed. The
    norms are over any axes (per output channel, per kernel position, the whole tensor), so the
    map needs the whole ``G``; its cost is that of the per-sample gradients.
    """
    return _normalized_rule("weight_norm", base)


def spectral_norm_rule(base: Any) -> Any:
    """The fast GGN rule of a layer whose weight is torch's spectral normalization ``W = V / σ``, for
    ``V``, on top of the layer's own rule ``base`` (which must have per-sample gradients), or ``None``
    where it has none: each per-sample gradient of the applied weight ``G`` is formed a chunk of
    samples at a time for every signal and mapped to ``(G − ⟨G, W⟩ u vᵀ) / σ``
    (:func:`_spectral_norm_map`), squared and summed; its cost is that of the per-sample gradients."""
    return _normalized_rule("spectral_norm", base)


def _normalized_rule(kind: str, base: Any) -> Any:
    with _NORMALIZED_LOCK:
        if (kind, base) not in _NORMALIZED_RULES:
            _NORMALIZED_RULES[kind, base] = _make_normalized_rule(kind, base)
        return _NORMALIZED_RULES[kind, base]


def _make_normalized_rule(kind: str, base: Any) -> Any:
    gradients = PER_SAMPLE_GRADIENTS.get(base)
    if gradients is None or not wants_deltas(base) or any(
            check(base) for check in (wants_call, first_of_tuple, inner_uses, recorded_inside)):
        return None  # a rule whose module does more than apply its weight to one input
    prepare = USE_INPUTS.get(base)
    weight_map = _WEIGHT_MAPS[kind]

    def parameter_gradients(module: nn.Module, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return prepared_gradients(module)(a, d)

    def prepared_gradients(module: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        of_weight = weight_map(module).of_weight
        return lambda a, d: of_weight(gradients(module, a, d))

    @_builtin
    def squares(module: nn.Module, a: torch.Tensor, deltas: Deltas, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        parameter, of_weight = weight_map(module)
        prepared = prepare(module, a) if prepare is not None else a
        res = _accumulator(out, deltas.k, *parameter.shape, like=parameter)
        n = a.shape[0]
        for j, part in enumerate(deltas.parts):
            if part is None:
                continue
            deltas.parts[j] = None
            for sl in _chunks(n, parameter.numel()):
                res[j // deltas.m] += of_weight(gradients(module, prepared[sl], part[sl])).square_().sum(0)
        deltas.parts.clear()
        return res

    squares._normflat_normalized = True  # type: ignore[attr-defined]
    squares.__doc__ = (weight_norm_rule if kind == "weight_norm" else spectral_norm_rule).__doc__
    squares.__name__ = squares.__qualname__ = f"{kind}_squares[{getattr(base, '__name__', 'rule')}]"
    PER_SAMPLE_GRADIENTS[squares] = parameter_gradients
    PREPARED_GRADIENTS[squares] = prepared_gradients
    if prepare is not None:
        USE_INPUTS[squares] = prepare
    return squares


# ============================================================================ capture and graph


class Capture:
    """Forward hooks recording each fast layer's input and output on one forward.

    The hooks act only in the thread that runs this analysis (another thread may call
    the same modules meanwhile) and only while :attr:`active`.
    """

    def __init__(self, layers: list[Any], broadcast: Iterable[int] = (), tuples: Iterable[int] = ()) -> None:
        #: The keys whose output, broadcast over the batch (leading axis 1 from an input with a
        #: leading axis 1, e.g. position ids of shape ``(1, T)``), is expanded to :attr:`rows`.
        self.broadcast = set(broadcast)
        #: The keys whose module returns a tuple led by the output of its weight's map (a router's
        #: logits before its softmax and top-k: :func:`first_of_tuple`).
        self.tuples = set(tuples)
        self.rows: int | None = None  # the samples of the forward (set by the session)
        self.expanded: set[int] = set()  # the keys expanded in this forward
        #: The keys whose layer runs on no batch axis (a table of coordinates through a small MLP),
        #: followed to where their output meets the batch (:class:`BatchlessTaps`).
        self.batchless: set[int] = set()
        #: In this forward: those of them that ran, the meetings ``(batch-less operand, its view
        #: expanded over the batch)``, and why one could not be followed.
        self.batchless_ran: set[int] = set()
        self.meetings: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Per meeting, the followed keys its batch-less operand is computed from (a failed check
        #: refuses those layers only).
        self.meeting_sources: list[frozenset[int]] = []
        #: The followed keys whose output met the batch where it cannot be followed, and why.
        self.batchless_refused: dict[int, str] = {}
        self._taps: BatchlessTaps | None = None
        self.inputs: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.live_inputs: dict[int, torch.Tensor] = {}  # not detached: a head's input starts a backward
        self.extras: dict[int, tuple[tuple, dict]] = {}
        self.calls: dict[int, int] = {}
        self.active = True  # off while the generic path runs the model
        #: Graph edges to the weight that a recorded layer's rule accounts for (one per step).
        self.weight_uses: dict[int, int] = {}
        #: A module called several times per forward: the keys its 2nd, 3rd, ... calls are recorded
        #: under (:meth:`repeat`), and the calls seen in this forward.
        self.repeats: dict[int, list[int]] = {}
        self._seen: dict[int, int] = {}
        self._thread = threading.get_ident()
        inside = [layer for layer in layers if recorded_inside(getattr(layer.ext, "ggn_squares", None))]
        #: ``id(weight) -> key`` of the layers recorded where their weight is applied (inside a
        #: recurrence, an embedding's own lookup): no hook of their own.
        self._recorded = {id(layer.param): id(layer) for layer in inside}
        #: The weights among them looked up by an embedding with its own forward (:class:`FunctionalTaps`),
        #: with the module's ``padding_idx``.
        self._lookups = {id(layer.param): layer.module.padding_idx for layer in inside
                         if layer.ext.ggn_squares is recorded_lookup_squares}
        #: ``id(weight) -> layer`` of the dense and convolution layers whose module the model never calls,
        #: recorded where it applies their weight itself (:meth:`watch_functional`, :class:`FunctionalTaps`;
        #: the key is ``id(layer)``, and a convolution's call must be its module's).
        self._functional: dict[int, Any] = {}
        #: The weights of ``nn.MultiheadAttention``'s projections, recorded where
        #: ``F.multi_head_attention_forward`` applies them (:class:`FunctionalTaps`).
        self._attention = {id(layer.param) for layer in inside if layer.ext.ggn_squares is attention_squares}
        unhooked = {id(layer) for layer in inside}
        self._handles = [layer.module.register_forward_hook(self._hook(id(layer)), with_kwargs=True)
                         for layer in layers if id(layer) not in unhooked]

    def taps(self) -> dict[int, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] | None:
        """The recorders of the layers recorded where their weight is applied, by ``id(weight)``
        (:meth:`recording`): ``None`` when there are none or the capture is off."""
        if not (self._recorded or self._functional) or not self.active or threading.get_ident() != self._thread:
            return None
        functional = ((weight, id(layer)) for weight, layer in self._functional.items())
        return {weight: self._recorder(key) for weight, key in (*self._recorded.items(), *functional)}

    def watch_functional(self, layer: Any) -> None:
        """Record a layer whose module is never called (the model applies the weight itself) from the
        next forward on, where its weight is applied (:class:`FunctionalTaps`): a dense weight at its
        ``F.linear`` call, its products ``W @ x`` and ``x @ W.T``, or where
        ``F.multi_head_attention_forward`` is handed it as a projection (:func:`recorded_attention`); a
        convolution's at its ``F.conv1d``, ``F.conv2d`` or ``F.conv3d`` call with the module's stride,
        padding, dilation and groups."""
        self._functional[id(layer.param)] = layer

    def watches(self, layer: Any) -> bool:
        """Whether :meth:`watch_functional` was called for ``layer``."""
        return id(layer.param) in self._functional

    def _recorder(self, key: int) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        def record(a: torch.Tensor, output: torch.Tensor, uses: int) -> torch.Tensor:
            """Record one call; return the output the model goes on with (expanded over the batch
            where one row serves every sample, as :meth:`_hook` does)."""
            self.calls[key] = self.calls.get(key, 0) + 1
            self.weight_uses[key] = uses
            return self._store(key, a, output, ((), {}))[1]
        return record

    def _store(self, key: int, live: torch.Tensor, output: torch.Tensor, extras: tuple[tuple, dict]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep one call's input (detached, with its version), output and other arguments under
        ``key``; returns the input and output as kept.

        One row for the whole batch (a ``key`` in :attr:`broadcast`, input and output with a leading
        axis of 1), broadcast later: both become as many rows as samples (views, the same numbers),
        so that the gradient at the output is each sample's own and the layer's fast rule applies;
        the session checks the model's logits unchanged and the samples kept apart (method §6.1,
        "Position tables")."""
        rows = self.rows or 0
        # Only a key's first call: a module called again on other inputs (DeBERTa-v3's projections,
        # on the tokens and on the relative embeddings) is told apart first (repeat).
        if (key in self.broadcast and rows > 1 and output.dim() > 0 and live.dim() > 0
                and output.shape[0] == 1 and live.shape[0] == 1 and self.calls.get(key, 0) <= 1):
            live = live.expand(rows, *live.shape[1:])
            output = output.expand(rows, *output.shape[1:])
            self.expanded.add(key)
        a = live.detach()
        self.inputs[key] = a
        self.live_inputs[key] = live
        self.versions[key] = compat.tensor_version(a)
        self.outputs[key] = output
        self.extras[key] = extras
        return live, output

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """The forward's recorders of the layers whose hook does not see them: the plain
        recurrence's (:func:`~normflat.backends.torch.compat.recurrent_taps`), the lookups of
        embeddings with their own forward and the weights the model applies itself
        (:class:`FunctionalTaps`); nothing when there are none."""
        taps = self.taps()
        if taps is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            if self._recorded:
                stack.enter_context(compat.recurrent_taps(taps))
            if self._lookups or self._functional or self._attention:
                # A dense weight the model applies functionally may also be a projection handed to
                # F.multi_head_attention_forward (WavLM's q_proj, k_proj, v_proj, out_proj).
                functional = {w: (taps[w], layer.module) for w, layer in self._functional.items()}
                stack.enter_context(FunctionalTaps({w: taps[w] for w in self._lookups}, self._lookups, functional,
                                                   {w: taps[w] for w in (*self._attention, *self._functional)}))
            yield

    def repeat(self, key: int, keys: list[int]) -> None:
        """Record the 2nd, 3rd, ... call of the module of ``key`` in each forward under ``keys``
        (a weight shared by the calls of one module: its per-sample gradients summed over them,
        method §6.1, "Tied weights"); a call beyond them counts as a second call of ``key``."""
        self.repeats[key] = list(keys)

    def _route(self, main: int) -> int:
        """The key this call of the module of ``main`` is recorded under (:meth:`repeat`)."""
        seen = self._seen[main] = self._seen.get(main, 0) + 1
        later = self.repeats.get(main)
        return later[seen - 2] if later and 2 <= seen <= len(later) + 1 else main

    def _hook(self, main: int):
        def hook(module, args, kwargs, output):
            if not self.active or threading.get_ident() != self._thread:
                return None
            key = self._route(main)
            self.calls[key] = self.calls.get(key, 0) + 1
            rest = None
            if key in self.tuples and isinstance(output, tuple) and output and type(output) is tuple:
                output, rest = output[0], output[1:]
                if (isinstance(output, torch.Tensor) and args and isinstance(args[0], torch.Tensor)
                        and args[0].dim() > 2 and output.dim() == 2 and args[0].shape[:-1].numel() == output.shape[0]):
                    # A router given (n, T, d) returns (n·T, experts): its input as the rows it maps.
                    args = (args[0].reshape(-1, args[0].shape[-1]), *args[1:])
            if not args or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
                return None
            _, output = self._store(key, args[0], output, (tuple(args[1:]), dict(kwargs)))
            # Downstream sees a copy, so an in-place op after the layer (ReLU(inplace=True))
            # cannot rebase the tensor whose gradient we ask for.
            copy = output.clone()
            if key in self.batchless and self._taps is not None:
                self._taps.seed(key, args[0], copy)
            return copy if rest is None else (copy, *rest)

        return hook

    def modified(self, key: int) -> bool:
        """Whether the recorded input of layer ``key`` was modified in place since the forward."""
        return compat.tensor_version(self.inputs[key]) != self.versions[key]

    @contextlib.contextmanager
    def following(self, inputs: Iterable[torch.Tensor], tables: dict[int, torch.Tensor] | None = None
                  ) -> Iterator[None]:
        """Follow the outputs of the :attr:`batchless` layers through the forward from the batch's
        ``inputs`` (:class:`BatchlessTaps`), and the followed position ``tables`` (by key) from the
        start; nothing when there are none."""
        if not self.batchless or not self.active or threading.get_ident() != self._thread:
            yield
            return
        self._taps = BatchlessTaps(self, inputs)
        for key, table in (tables or {}).items():
            self._taps.seed(key, None, table)
        try:
            with self._taps:
                yield
        finally:
            self._taps = None

    def reset(self) -> None:
        self.expanded.clear()
        self.batchless_ran.clear()
        self.meetings.clear()
        self.meeting_sources.clear()
        self.batchless_refused.clear()
        self.inputs.clear(), self.versions.clear(), self.outputs.clear(), self.calls.clear()
        self.live_inputs.clear()
        self.extras.clear()
        self.weight_uses.clear()
        self._seen.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


#: The functions at which a batch-less tensor may meet the batch: elementwise and broadcasting, so
#: the batch-less operand expanded to the broadcast shape gives the same value.
_BROADCASTING = frozenset({
    torch.add, torch.sub, torch.mul, torch.Tensor.add, torch.Tensor.sub, torch.Tensor.mul,
    torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__rsub__,
    torch.Tensor.__mul__, torch.Tensor.__rmul__,
})
#: Their in-place forms: the batch-less operand may only be the other one.
_BROADCASTING_INPLACE = frozenset({
    torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.mul_, torch.Tensor.__iadd__, torch.Tensor.__isub__,
    torch.Tensor.__imul__,
})


#: The functions by which a model may copy a batch-less tensor over the batch itself.
_SPREADING = frozenset({torch.Tensor.repeat, torch.Tensor.expand})


def _tensor_arguments(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


class BatchlessTaps(torch.overrides.TorchFunctionMode):
    """Follows, in this thread and for the ``with`` block, the outputs of layers that run on no
    batch axis (Swin V2's continuous position bias MLP on its table of relative coordinates) to
    where they meet the batch (method §6.1, "Layers on no batch axis").

    Two kinds of tensors are marked as the forward runs: *batched* ones, computed from the
    batch's inputs, and *batch-less* ones, computed from a batch-less layer's output and no
    batched tensor. An operation on batch-less tensors and tensors of neither kind gives a
    batch-less one; one with a batched operand a batched one. Where a batch-less operand meets a
    batched one, in an elementwise broadcasting operation (``attention + bias``) or as the mask of
    ``F.scaled_dot_product_attention``, it is replaced by its view expanded to the shape it
    broadcasts to: the same value, whose gradient, row by row, is each sample's. The capture
    keeps ``(operand, view)``; any other meeting is recorded as why the layers cannot be followed.
    Marks are weak references: nothing is kept alive by them.
    """

    def __init__(self, capture: Capture, inputs: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.capture = capture
        self._batched: dict[int, weakref.ref] = {}
        self._batchless: dict[int, weakref.ref] = {}
        #: The followed keys each batch-less tensor is computed from (a refusal names its layers).
        self._sources: dict[int, frozenset[int]] = {}
        for t in inputs:
            self._put(self._batched, t)

    @staticmethod
    def _put(marks: dict[int, weakref.ref], t: Any) -> None:
        if isinstance(t, torch.Tensor):
            marks[id(t)] = weakref.ref(t)
        elif isinstance(t, (list, tuple)):
            for item in t:
                BatchlessTaps._put(marks, item)

    @staticmethod
    def _has(marks: dict[int, weakref.ref], t: torch.Tensor) -> bool:
        ref = marks.get(id(t))
        return ref is not None and ref() is t

    def seed(self, key: int, given: Any, output: torch.Tensor) -> None:
        """A batch-less layer's call: its ``output`` is marked, or, if its input carries the batch,
        the layer cannot be followed."""
        if isinstance(given, torch.Tensor) and self._has(self._batched, given):
            return  # its input carries the batch: not one on no batch axis (the session says so)
        self.capture.batchless_ran.add(key)
        self._put(self._batchless, output)
        # With the layers upstream of it (Swin V2's first MLP layer feeds the second).
        upstream = [given] if isinstance(given, torch.Tensor) and self._has(self._batchless, given) else []
        self._sources[id(output)] = frozenset({key}) | self._source(upstream)

    def _source(self, tensors: list[torch.Tensor]) -> frozenset[int]:
        return frozenset().union(*(self._sources.get(id(t), frozenset()) for t in tensors))

    def _refuse(self, func: Any, batchless: list[torch.Tensor]) -> None:
        name = getattr(func, "__name__", repr(func))
        why = (f"its output meets the batch in {name}, which is not an elementwise broadcasting operation or an "
               "attention mask")
        for key in self._source(batchless):
            self.capture.batchless_refused.setdefault(key, why)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensor_arguments(args, kwargs)
        batchless = [t for t in tensors if self._has(self._batchless, t)]
        batched = any(self._has(self._batched, t) for t in tensors)
        if batchless and batched:
            args, kwargs = self._meet(func, args, kwargs, batchless)
        out = func(*args, **kwargs)
        if batched:
            self._put(self._batched, out)
        elif batchless:
            if func in _SPREADING and self._spreads(args[0], out):
                # The model copies the row over the batch itself (XCiT's positions: repeat(B, 1, 1, 1)):
                # the copies meet the batch here.
                self.capture.meetings.append((args[0], out))
                self.capture.meeting_sources.append(self._source(batchless))
                self._put(self._batched, out)
            else:
                self._put(self._batchless, out)
                self._mark_sources(out, self._source(batchless))
        return out

    def _mark_sources(self, out: Any, sources: frozenset[int]) -> None:
        if isinstance(out, torch.Tensor):
            self._sources[id(out)] = sources
        elif isinstance(out, (list, tuple)):
            for item in out:
                self._mark_sources(item, sources)

    def _spreads(self, operand: torch.Tensor, out: Any) -> bool:
        """Whether ``out`` copies ``operand``'s rows to a block of rows per sample (its one row
        expanded, or all its rows tiled, DeBERTa's relative keys repeated per sample), the other axes
        as they are."""
        rows = self.capture.rows or 0
        # With one sample, repeat(1, ...) is that copy too (and any block is the sample's).
        return (isinstance(out, torch.Tensor) and rows > 0 and operand.dim() > 0 and out.dim() == operand.dim()
                and operand.shape[0] > 0 and out.shape[0] > 0 and out.shape[0] % (rows * operand.shape[0]) == 0
                and out.shape[1:] == operand.shape[1:])

    def _meet(self, func: Any, args: tuple, kwargs: dict, batchless: list[torch.Tensor]) -> tuple[tuple, dict]:
        """The arguments with each batch-less operand replaced by its view expanded over the batch."""
        if func is F.scaled_dot_product_attention:
            call = dict(zip(("query", "key", "value", "attn_mask"), args))
            call.update(kwargs)
            mask = call.get("attn_mask")
            if any(t is not mask for t in batchless) or mask.dtype == torch.bool:
                self._refuse(func, batchless)
                return args, kwargs
            query, key = call["query"], call["key"]
            try:
                shape = torch.broadcast_shapes(mask.shape, (*query.shape[:-1], key.shape[-2]))
            except RuntimeError:
                return args, kwargs  # torch's own error follows
            call["attn_mask"] = self._view(mask, shape)
            return (), call
        inplace = func in _BROADCASTING_INPLACE
        if not (func in _BROADCASTING or inplace) or (inplace and args and any(args[0] is t for t in batchless)):
            self._refuse(func, batchless)
            return args, kwargs
        try:
            shape = torch.broadcast_shapes(*(t.shape for t in _tensor_arguments(args, kwargs)))
        except RuntimeError:
            return args, kwargs
        swap = {id(t): self._view(t, shape) for t in batchless}
        args = tuple(swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: swap.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return args, kwargs

    def _view(self, operand: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        view = operand.expand(shape)
        self.capture.meetings.append((operand, view))
        self.capture.meeting_sources.append(self._source([operand]))
        return view


class FunctionalTaps(torch.overrides.TorchFunctionMode):
    """Records, in this thread and for the ``with`` block, the functional calls through which some
    weights enter the model, where no hook on their module sees them:

    * the ``F.embedding`` lookup of an ``nn.Embedding`` subclass with its own ``forward``, which
      computes its ids inside (OPT's positions from the attention mask): ``lookups``;
    * the ``F.linear`` call on the weight of an ``nn.Linear`` the model never calls, using the
      weight itself (timm's BEiT and EVA attention: ``F.linear(x, weight=self.qkv.weight,
      bias=torch.cat(...))``), its product ``W @ x`` with a batch-first ``x`` ``(n, ..., in, L)``
      (transformers' Mamba: ``self.dt_proj.weight @ time_step.transpose(1, 2)``), recorded as
      ``F.linear`` on ``xᵀ``, or ``x @ W.T`` with a batch-first ``x`` ``(n, ..., in)``; and the
      ``F.conv1d`` / ``F.conv2d`` / ``F.conv3d`` call on the weight of an ``nn.ConvNd`` the model never
      calls, with the module's stride, padding, dilation and groups (Mamba's causal convolution:
      ``F.conv1d(x, self.conv1d.weight.squeeze(1).unsqueeze(1), ...)``): ``functional``, by
      ``id(weight)`` with the module. The weight may be handed as a view of itself with its shape and
      layout (the same numbers; its gradient is the weight's);
    * the projections of ``nn.MultiheadAttention``, which ``F.multi_head_attention_forward`` applies
      inside, where a mode does not see them: that call is evaluated by :func:`recorded_attention`
      (the same value), ``attention``.

    Each maps ``id(weight)`` to ``callback(input, output, uses)``, which returns the output the
    model goes on with; the model gets a copy of it, so that an in-place operation after the call
    cannot rebase the tensor whose gradient the signals are taken at. A lookup with options that
    change the gradient or the table (``max_norm``, ``scale_grad_by_freq``, ``sparse``, or another
    ``padding_idx`` than the module's, given in ``padding``) is not recorded, and its layer then
    takes the generic path. A thread-local torch function mode: nothing is patched, and it ends
    with the block."""

    def __init__(self, lookups: dict[int, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]],
                 padding: dict[int, int | None],
                 functional: dict[int, tuple[Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], nn.Module]],
                 attention: dict[int, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] | None = None
                 ) -> None:
        super().__init__()
        self.lookups, self.padding, self.functional = lookups, padding, functional
        self.attention = attention or {}

    def _watched(self, weight: Any, kind: type, transposed: bool = False) -> tuple[Callable, nn.Module] | None:
        """The callback and module of a watched weight of module type ``kind`` handed to a call: the
        weight itself, or a view of it with its shape, data and strides (``squeeze(1).unsqueeze(1)``:
        the same tensor, whose gradient is the weight's); with ``transposed``, only its transposed view
        ``W.T`` of a 2-D weight (the same numbers, read transposed)."""
        if not isinstance(weight, torch.Tensor):
            return None
        found = None if transposed else self.functional.get(id(weight))
        base = weight._base
        if found is None and base is not None and id(base) in self.functional:
            shape, stride = (base.shape, base.stride()) if not transposed else (base.shape[::-1], base.stride()[::-1])
            same = (weight.shape == shape and weight.data_ptr() == base.data_ptr()
                    and (not transposed or base.dim() == 2)
                    and all(a == b for a, b, size in zip(weight.stride(), stride, shape) if size > 1))
            found = self.functional[id(base)] if same else None
        return found if found is not None and isinstance(found[1], kind) else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and self.lookups:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            callback = self.lookups.get(id(weight))
            if callback is not None and _plain_lookup(args, kwargs, self.padding[id(weight)], int(weight.shape[0])):
                ids = args[0] if args else kwargs["input"]
                return callback(ids, func(*args, **kwargs), 1).clone()
        elif func is F.linear and self.functional:
            watched = self._watched(args[1] if len(args) > 1 else kwargs.get("weight"), nn.Linear)
            if watched is not None:
                x = args[0] if args else kwargs["input"]
                return watched[0](x, func(*args, **kwargs), 1).clone()
        elif func in _MATMULS and self.functional and len(args) == 2 and not kwargs:
            left, x = self._watched(args[0], nn.Linear), args[1]
            if left is not None and isinstance(x, torch.Tensor) and x.dim() >= 3 and args[0].dim() == 2:
                # W @ x is F.linear(xᵀ, W)ᵀ: recorded on the positions' rows, batch first; the model
                # goes on with the transposed view of the recorded output, the same numbers.
                out = func(*args)
                return left[0](x.transpose(-1, -2), out.transpose(-1, -2), 1).transpose(-1, -2).clone()
            right, x = self._watched(args[1], nn.Linear, transposed=True), args[0]
            if right is not None and isinstance(x, torch.Tensor) and x.dim() >= 2:
                # x @ W.T is F.linear(x, W), batch first.
                return right[0](x, func(*args), 1).clone()
        elif func in _CONVOLUTIONS and self.functional:
            call = dict(zip(_CONVOLUTION_PARAMETERS, args))
            call.update(kwargs)
            watched = self._watched(call.get("weight"), _CONVOLUTIONS[func])
            if watched is not None and _module_convolution(watched[1], call):
                return watched[0](call["input"], func(*args, **kwargs), 1).clone()
        elif func is F.multi_head_attention_forward and self.attention:
            out = recorded_attention(args, kwargs, self.attention)
            if out is not None:
                return out
        return func(*args, **kwargs)


#: The products ``W @ x`` of a dense weight the model applies itself (:class:`FunctionalTaps`).
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
#: The functional convolutions and the module each stands for; their parameters, in order.
_CONVOLUTIONS = {F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.conv3d: nn.Conv3d}
_CONVOLUTION_PARAMETERS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
#: The rules of layers whose module the model may never call, applying the weight itself where
#: :class:`FunctionalTaps` records it, with the module types they take there.
APPLIED_FUNCTIONALLY = {linear_squares: nn.Linear, conv_squares: tuple(_CONVOLUTIONS.values())}


def _module_convolution(module: nn.Module, call: dict) -> bool:
    """Whether a functional convolution call is ``module``'s own (what its rule reads from it): its
    stride, padding, dilation and groups, and zeros padding."""
    if module.padding_mode != "zeros":  # the module pads by itself first, then convolves unpadded
        return False
    d = len(module.kernel_size)

    def given(name: str, default: Any) -> Any:
        value = call.get(name, default)
        return value if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else (value,) * d

    return (given("stride", 1) == tuple(module.stride) and given("dilation", 1) == tuple(module.dilation)
            and int(call.get("groups", 1)) == module.groups
            and given("padding", 0) == (module.padding if isinstance(module.padding, str) else tuple(module.padding)))


#: ``F.multi_head_attention_forward``'s parameters, in order.
_ATTENTION_PARAMETERS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)


def recorded_attention(args: tuple, kwargs: dict,
                       records: dict[int, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]]) -> Any:
    """``F.multi_head_attention_forward(*args, **kwargs)`` with its projections recorded, or ``None``
    (an unbatched call, or none of its weights recorded): the caller runs it as it is.

    Torch's function applies its projections inside, where a function mode does not see them (it
    sees the function's own call, with the mode off). So the projections are applied here, batch
    first, each weight by one ``F.linear`` call whose input and output ``records[id(weight)](input,
    output, 1)`` records: the packed ``(3E, E)`` projection once on the positions of the distinct
    inputs one after the other (self-attention: the query's alone; a cross-attention's query,
    key and value positions each take their own rows of the result, so the signals at the other
    rows are zero and each row block's per-sample gradient is its own input's), the separate
    ``kdim``/``vdim`` ones once each, the output projection once. Between them torch's own
    function runs with identity projections and no biases, so masks, dropout, ``bias_k``/``bias_v``,
    ``add_zero_attn`` and the attention weights it returns are its own (``x @ I`` is ``x``
    exactly)."""
    call = dict(zip(_ATTENTION_PARAMETERS, args))
    call.update(kwargs)
    query, key, value = call["query"], call["key"], call["value"]
    separate = bool(call.get("use_separate_proj_weight", False))
    weights = ([call.get("q_proj_weight"), call.get("k_proj_weight"), call.get("v_proj_weight")] if separate
               else [call.get("in_proj_weight")])
    out_weight, out_bias = call.get("out_proj_weight"), call.get("out_proj_bias")
    if query.dim() != 3 or not any(id(w) in records for w in (*weights, out_weight) if w is not None):
        return None
    e = int(query.shape[-1])
    bias = call.get("in_proj_bias")

    def project(inputs: list[torch.Tensor], weight: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        a = torch.cat([x.transpose(0, 1) for x in inputs], 1) if len(inputs) > 1 else inputs[0].transpose(0, 1)
        y = F.linear(a, weight, b)
        record = records.get(id(weight))
        return y if record is None else record(a, y, 1).clone()

    if separate:
        biases = [None] * 3 if bias is None else list(bias.chunk(3))
        q, k, v = (project([x], w, b) for x, w, b in zip((query, key, value), weights, biases))
    else:
        distinct = list({id(x): x for x in (query, key, value)}.values())
        t = project(distinct, weights[0], bias)
        starts, at = {}, 0
        for x in distinct:
            starts[id(x)], at = at, at + int(x.shape[0])
        def rows(x: torch.Tensor, block: int) -> torch.Tensor:
            start = starts[id(x)]
            return t[:, start:start + int(x.shape[0]), block * e:(block + 1) * e]
        q, k, v = rows(query, 0), rows(key, 1), rows(value, 2)
    heads = int(call["num_heads"])
    direct = _direct_attention_masks(call, int(q.shape[0]), heads, int(q.shape[1]), int(k.shape[1]))
    if direct is None:
        return _attention_with_identities(call, q, k, v, project, out_weight, out_bias)
    # No bias, zero attention or dropout: torch's function is the attention of the heads with its
    # masks merged into one additive mask (or its causal hint), computed here without the
    # identities: the scaled dot-product attention, or, where it returns the attention weights,
    # the same products written out as torch's function writes them.
    mask, causal = direct

    def split(t: torch.Tensor) -> torch.Tensor:  # (N, L, E) -> (N, heads, L, E/heads)
        return t.reshape(t.shape[0], t.shape[1], heads, e // heads).transpose(1, 2)

    attention_weights = None
    if call.get("need_weights", True) is False:
        attended = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask, is_causal=causal)
    else:
        scores = (split(q) * math.sqrt(1.0 / float(e // heads))) @ split(k).transpose(-2, -1)
        probabilities = torch.softmax(scores if mask is None else mask + scores, dim=-1)
        attended = probabilities @ split(v)
        attention_weights = probabilities.mean(1) if call.get("average_attn_weights", True) else probabilities
    out = project([attended.transpose(1, 2).reshape(q.shape[0], q.shape[1], e).transpose(0, 1)], out_weight,
                  out_bias)
    return out.transpose(0, 1), attention_weights


def _attention_with_identities(call: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, project: Callable,
                               out_weight: torch.Tensor, out_bias: torch.Tensor | None) -> tuple:
    """Torch's own function between the recorded projections, with identity projections and no
    biases (``bias_k``/``bias_v``, ``add_zero_attn``, dropout, masks it reads its own way)."""
    e = int(q.shape[-1])
    eye = torch.eye(e, dtype=q.dtype, device=q.device)
    call = {**call, "query": q.transpose(0, 1), "key": k.transpose(0, 1), "value": v.transpose(0, 1),
            "in_proj_weight": None, "in_proj_bias": None, "use_separate_proj_weight": True, "q_proj_weight": eye,
            "k_proj_weight": eye, "v_proj_weight": eye, "out_proj_weight": eye, "out_proj_bias": None}
    attended, attention_weights = F.multi_head_attention_forward(**call)
    out = project([attended], out_weight, out_bias)
    return out.transpose(0, 1), attention_weights


def _keys_as_given(call: dict) -> bool:
    """Whether a ``F.multi_head_attention_forward`` call attends to its projected keys and values
    as they are, without dropout: no ``bias_k``/``bias_v``, no ``add_zero_attn``, no static keys
    or values, and no dropout in training. Its masks and the weights it returns are read by
    :func:`_direct_attention_masks`."""
    return (call.get("bias_k") is None and call.get("bias_v") is None and not call.get("add_zero_attn")
            and call.get("static_k") is None and call.get("static_v") is None
            and not (call.get("training", True) and float(call.get("dropout_p", 0.0)) > 0.0))


def _direct_attention_masks(call: dict, batch: int, heads: int, queries: int,
                            keys: int) -> tuple[torch.Tensor | None, bool] | None:
    """How torch's function would compute the heads' attention, for a call that attends to its
    keys as given (:func:`_keys_as_given`), whatever its masks and the attention weights it returns:
    ``(attn_mask, is_causal)``, the mask additive and ``(N, heads, L, S)``-broadcastable; else
    ``None`` (the caller runs torch's function with identity projections).

    As torch's function reads them: a boolean mask leaves out its ``True`` entries (``-inf``), a
    floating one in the query's dtype is added; ``attn_mask`` is ``(L, S)`` or ``(N·heads, L, S)``,
    ``key_padding_mask`` ``(N, S)``, and the two are added. With ``is_causal`` and no key padding
    mask and no weights returned, torch trusts the hint and passes SDPA ``is_causal=True`` without
    the mask (``nn.TransformerEncoder`` sets the hint when its mask is causal). Any other shape or dtype
    (mixed mask dtypes, which torch warns about) goes to torch's own function, which says what is
    wrong or reads it its own way."""
    padding, attention, causal = call.get("key_padding_mask"), call.get("attn_mask"), bool(call.get("is_causal"))
    if not _keys_as_given(call):
        return None
    weights = call.get("need_weights", True) is not False
    dtype = call["query"].dtype
    masks = [m for m in (padding, attention) if m is not None]
    if any(m.dtype != torch.bool and m.dtype != dtype for m in masks) or len({m.dtype for m in masks}) > 1:
        return None
    if padding is not None and tuple(padding.shape) != (batch, keys):
        return None
    if attention is not None and tuple(attention.shape) not in ((queries, keys), (batch * heads, queries, keys)):
        return None
    if causal and attention is None:
        return None  # torch's function raises
    if causal and padding is None and not weights:
        return None, True  # with the weights returned, torch's function reads the mask itself

    def additive(m: torch.Tensor) -> torch.Tensor:
        if m.dtype != torch.bool:
            return m
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))

    mask = None
    if attention is not None:
        mask = additive(attention)
        mask = mask if mask.dim() == 2 else mask.view(batch, heads, queries, keys)
    if padding is not None:
        rows = additive(padding)[:, None, None, :]
        mask = rows if mask is None else mask + rows
    return mask, False


#: ``F.embedding``'s parameters after ``input`` and ``weight``, in order.
_LOOKUP_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def _plain_lookup(args: tuple, kwargs: dict, padding_idx: int | None, rows: int) -> bool:
    """Whether an ``F.embedding`` call is the lookup ``nn.Embedding``'s rule assumes: the module's
    ``padding_idx`` (the row without gradient), no ``max_norm``, no ``scale_grad_by_freq``, not
    ``sparse``."""
    given = dict(zip(_LOOKUP_OPTIONS, args[2:]))
    given.update({k: v for k, v in kwargs.items() if k in _LOOKUP_OPTIONS})
    pad = given.get("padding_idx")
    if pad is not None and pad < 0:
        pad += rows  # F.embedding counts a negative padding_idx from the end, as nn.Embedding stores it
    return (pad == padding_idx and given.get("max_norm") is None and not given.get("scale_grad_by_freq")
            and not given.get("sparse"))


def inspect_graph(root: Any, weights: dict[int, Any], outputs: list[torch.Tensor],
                  stop: Iterable[Any] = ()) -> tuple[dict[int, int], bool]:
    """Walk the autograd graph of the logits once (not below the nodes ``stop``).

    Returns:
        ``(uses, batched)``: how many graph edges lead to each weight (more than one:
        shared or functional use, the fast path does not apply), and whether every
        backward op between the logits and the captured ``outputs`` has a vmap
        batching rule (:data:`BATCHED_BACKWARD_OPS`).
    """
    uses = {key: 0 for key in weights}
    targets = {o.grad_fn for o in outputs if o.grad_fn is not None}
    children: dict[Any, list[Any]] = {}
    todo, seen = [root], set(stop)
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        kids = []
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            var = compat.graph_leaf(nxt)
            if var is not None:
                if id(var) in uses:
                    uses[id(var)] += 1
                continue
            kids.append(nxt)
            todo.append(nxt)
        children[fn] = kids
    # A node runs in the backward to the outputs iff a target lies below it: decide the
    # nodes in post-order (children first), one pass.
    leads: dict[Any, bool] = {}
    stack: list[tuple[Any, int]] = [(root, 0)] if root is not None else []
    while stack:
        fn, i = stack.pop()
        kids = children.get(fn, [])
        if i < len(kids):
            stack.append((fn, i + 1))
            if kids[i] not in leads:
                stack.append((kids[i], 0))
            continue
        if fn not in leads:
            leads[fn] = any(k in targets or leads.get(k, False) for k in kids)
    batched = all(compat.graph_node_name(fn) in BATCHED_BACKWARD_OPS for fn, runs in leads.items() if runs)
    return uses, batched


def backprop_signals(logits: torch.Tensor, outs: list[torch.Tensor], sig: torch.Tensor,
                     batched: bool) -> list[list[torch.Tensor] | None]:
    """Per layer, the gradients of ``⟨signal_j, logits⟩`` w.r.t. its output, for every ``j``.

    ``batched`` (decided once from the graph by :func:`inspect_graph`) runs one
    ``is_grads_batched`` backward; otherwise one backward per signal. An output outside the graph
    (a module returning a detached tensor) gets ``None``, as an output the logits do not reach.
    """
    live = [i for i, o in enumerate(outs) if o.requires_grad]
    if len(live) < len(outs):
        got = backprop_signals(logits, [outs[i] for i in live], sig, batched) if live else []
        full: list[list[torch.Tensor] | None] = [None] * len(outs)
        for i, g in zip(live, got):
            full[i] = g
        return full
    if batched and sig.shape[0] > 1:
        grads = torch.autograd.grad(logits, outs, grad_outputs=sig, is_grads_batched=True,
                                    retain_graph=True, allow_unused=True)
        return [None if g is None else list(g.unbind(0)) for g in grads]
    per = [torch.autograd.grad(logits, outs, grad_outputs=s, retain_graph=True, allow_unused=True)
           for s in sig]
    return [None if per[0][i] is None else [p[i] for p in per] for i in range(len(outs))]


# ============================================================================ generic path


_VMAP_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError)


def unswapped(model: nn.Module, inputs: Any, params: dict[str, torch.Tensor],
              pick: Callable[[Any], torch.Tensor]) -> list[str]:
    """The names of ``params`` (``{registered name: parameter}``) that the model also reaches
    without their module attribute.

    ``torch.func.functional_call``, behind the generic path, the Hessian-vector products and the
    rival measures, swaps the registered attributes (and every name tied to them) for the
    tensors it is given; a forward that reaches a parameter through another reference (a plain
    list or dict holding it) computes with the original, and its curvature would read as zero.
    One forward of ``inputs`` (a row or two) with stand-ins for the parameters tells: the
    originals, made to require gradients for it, must not be in the graph.
    """
    flags = {name: p.requires_grad for name, p in params.items()}
    try:
        for p in params.values():
            p.requires_grad_(True)
        stand_ins = {name: p.detach().requires_grad_(True) for name, p in params.items()}
        with torch.enable_grad():
            out = pick(functional_call(model, stand_ins, inputs.args, inputs.kwargs, strict=False))
        root = out.grad_fn if isinstance(out, torch.Tensor) else None
        uses, _ = inspect_graph(root, {id(p): name for name, p in params.items()}, [])
    finally:
        for name, p in params.items():
            p.requires_grad_(flags[name])
    return [name for name, p in params.items() if uses[id(p)]]


def unswapped_error(names: list[str]) -> ValueError:
    """The error for :func:`unswapped` parameters: the cause and the fix."""
    return ValueError(
        f"The model uses the parameter(s) {', '.join(map(repr, names))} through a reference other than "
        "their module attribute (a plain Python list or dict holding the parameter, say). normflat "
        "computes per-sample gradients, Hessian-vector products and perturbed losses with "
        "torch.func.functional_call, which swaps registered attributes only, so the curvature of such "
        "a weight would read as zero. Use the parameter through its module, or hold the extra "
        "reference in an nn.ParameterList or nn.ParameterDict (the registered names of one parameter "
        "are swapped together)."
    )


def generic_ggn(model: nn.Module, inputs: Any, sig: torch.Tensor, layers: list[Any],
                pick: Callable[[Any], torch.Tensor], counts: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Per-sample, per-signal weight gradients by ``vmap`` over a per-sample ``vjp``.

    Args:
        model: The module.
        inputs: The :class:`~normflat.backends.torch.data.ModelInputs` of a chunk of ``n`` samples.
        sig: ``(K, M, n, *out)`` output signals (``out`` is ``(C,)`` or ``(T, C)``), or with
            ``counts`` ``(R, n, *out)``: groups of unequal sizes one after the other.
        layers: The layers on the generic path.
        pick: The logits inside the model's output (the ``output`` option).
        counts: The signals of each of the ``K`` groups in ``sig`` (``R = sum(counts)``): the
            real signals of a padded layout (:func:`~normflat.engine.losses.padding_signals`).

    Returns:
        ``{param name: (K, *shape)}`` sums of squares over samples and signals.
    """
    if counts is None:
        k, m, n = sig.shape[:3]
        s = sig.movedim(2, 0).reshape(n, k * m, *sig.shape[3:])
        owner = [j // m for j in range(k * m)]
    else:
        k, n = len(counts), sig.shape[1]
        assert sum(counts) == sig.shape[0]
        s = sig.movedim(1, 0)
        owner = [g for g, c in enumerate(counts) for _ in range(c)]
    ws = {layer.param_name: layer.param.detach() for layer in layers}
    args, batched, const = inputs.args, inputs.batched_kwargs(), inputs.constant_kwargs()

    def group_sums(squares: torch.Tensor) -> torch.Tensor:
        if counts is None:
            return squares.reshape(k, m, *squares.shape[1:]).sum(1)
        return torch.stack([part.sum(0) for part in squares.split(counts)])

    def per_sample(s_n, args_n, kw_n):
        def f(w):
            kw = {**const, **{key: v.unsqueeze(0) for key, v in kw_n.items()}}
            out = functional_call(model, w, tuple(xi.unsqueeze(0) for xi in args_n), kw, strict=False)
            return pick(out).squeeze(0)
        _, pullback = vjp(f, ws)
        g = vmap(pullback)(s_n)[0]
        return {name: group_sums(v.square()) for name, v in g.items()}

    try:
        res = vmap(per_sample)(s, args, batched)
        return {name: v.sum(0) for name, v in res.items()}
    except _VMAP_ERRORS:
        pass  # something vmap cannot batch (data-dependent control flow, .item(), fused RNN kernels)
    total: dict[str, torch.Tensor] | None = None
    for i in range(n):
        args_i = tuple(xi[i] for xi in args)
        kw_i = {key: v[i] for key, v in batched.items()}
        try:
            r = per_sample(s[i], args_i, kw_i)
        except _VMAP_ERRORS:
            r = _per_sample_loop(model, inputs.rows(slice(i, i + 1)), s[i], layers, k, owner, pick, n)
        total = r if total is None else {name: total[name] + r[name] for name in r}
    assert total is not None
    return total


def _per_sample_loop(model, x_n, s_n, layers, k, owner, pick, rows):
    # Plain autograd on detached copies of the weights swapped in by functional_call: the
    # user's parameters (their requires_grad flags) are never touched.
    ws = {layer.param_name: layer.param.detach().requires_grad_(True) for layer in layers}
    with torch.enable_grad():
        out = pick(functional_call(model, ws, x_n.args, x_n.kwargs, strict=False))[0]
        # The chunk's logits had the signals' shape: a sample alone with other classes mixes the samples.
        losses.check_same_classes((1, *out.shape), (rows, *s_n.shape[1:]))
        total = {name: torch.zeros((k, *w.shape), dtype=w.dtype, device=w.device) for name, w in ws.items()}
        params = list(ws.values())
        for j, group in enumerate(owner):  # owner: the group of each signal
            gs = torch.autograd.grad(out, params, grad_outputs=s_n[j], retain_graph=True, allow_unused=True)
            for name, g in zip(ws, gs):
                if g is not None:
                    total[name][group] += g.square()
    return total
