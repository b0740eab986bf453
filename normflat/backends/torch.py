"""PyTorch backend: Hessian and GGN diagonals of ``torch.nn.Module`` models.

Entry points (called through :func:`normflat.analyze` / :func:`normflat.hessian_diagonal`):
:func:`layer_problems` and :func:`hessian_diagonal`. Public extension point:
:func:`register_layer` (with :class:`LayerExtractor`).

How the estimators are computed (SPEC §6), all on the model's device and dtype:

``exact``
    Forward-over-reverse Hessian-vector products (``torch.func.jvp`` of
    ``torch.func.grad``), one per weight entry, vectorized with ``vmap``.
``hutchinson``
    The same HVPs with Rademacher probes over all weights at once.
``ggn`` / ``ggn-mc``
    The GGN of the mean loss is ``(1/N) Σ_n J_nᵀ H_n J_n`` with ``H_n =
    diag(p_n) − p_n p_nᵀ`` the softmax cross-entropy Hessian in the (normalized)
    logits. ``H_n = S_n S_nᵀ`` with columns ``s_c = √p_c (e_c − p_n)``, so the
    diagonal is ``Σ_{n,c} (J_nᵀ s_c)²``: a sum of squared per-sample, per-signal
    gradients. ``S`` has ``√p`` in its null space, so a Householder reflection
    leaves ``C − 1`` signals. The *fast* path back-propagates the signals (one
    batched backward, or a loop where vmap lacks batching rules) to the outputs
    of the weight layers, captured by forward hooks, and forms the squares from
    the layer inputs: for a dense layer ``Σ_{n,c} δ_nc² (a_n²)ᵀ``, for a
    convolution the per-sample weight gradients of the unfolded input, a chunk
    of samples at a time; per-sample gradients of the whole model are never
    formed. It needs each weight to be used once, by its own module, called
    once per forward (checked on the autograd graph). Other layers take the
    *generic* path: ``vmap`` over samples of a per-sample ``vjp``. ``ggn-mc``
    uses signals ``e_ỹ − p`` with ``ỹ`` drawn from the model's predictive
    distribution. For ``nsce`` the signals are pulled back through the
    normalization, whose Jacobian is explicit.

Data parallelism: when ``torch.distributed`` is initialized (or ``distributed=`` names
a group), each rank's data is its shard. The ranks first agree on the layer structure
and options, exchange a status after every batch (so a failure on one rank raises on
all of them, and ranks with fewer batches wait for the others), and all-reduce the
per-layer (per-group) sums and sample counts at the end: every rank returns the same
result. Stochastic estimators seed each rank differently (rank 0 keeps ``seed``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.data
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap

from normflat.core.options import NSCE_EPS, AnalysisOptions, limited, progress_bar
from normflat.core.problem import LayerProblem

__all__ = [
    "LayerExtractor",
    "register_layer",
    "registered_layers",
    "layer_problems",
    "hessian_diagonal",
    "DEFAULT_MAX_EXACT_PARAMS",
]

#: ``estimator="exact"`` refuses models with more recognised weight entries unless ``force=True``.
DEFAULT_MAX_EXACT_PARAMS = 20_000
#: Default bound on ``signals × samples`` rows back-propagated at once by the GGN paths.
DEFAULT_SIGNAL_ROWS = 8192
#: Elements of one chunk of per-sample squares: bounds memory, and small enough to stay in
#: cache while squared and summed (30% faster than 16M elements on the 3C3D CNN, measured).
_SQUARES_BUDGET = 1 << 20
#: Maximum number of independent group estimates passed as ``hessian_diag_samples``.
_MAX_GROUPS = 10

_BACKEND_OPTIONS = ("force", "max_exact_params", "chunk_size", "memory_budget", "exact_chunk", "probe_chunk",
                    "fast", "distributed")


# ============================================================================ layer registry


@dataclass(frozen=True)
class LayerExtractor:
    """How normflat reads one module type.

    Args:
        kind: Short label recorded in reports (``"dense"``, ``"conv2d"``, ...).
        weight: ``module -> nn.Parameter``, the weight matrix or kernel (biases never
            enter the measures). Default: ``module.weight``.
        to_canonical: ``(module, tensor) -> tensor`` converting a tensor of the
            parameter's shape to the canonical ``(out, in, *kernel)`` layout
            (applied to the weight and its Hessian diagonal). Default: identity.
        ggn_squares: Optional fast GGN rule ``(module, layer_input, signals) ->
            (K, *weight.shape)``: ``layer_input`` is the module's first positional
            input for a chunk of ``n`` samples, ``signals`` the back-propagated output
            signals of shape ``(K, M, n, *output.shape[1:])``; return, for each of the
            ``K`` groups, ``Σ_{m, sample} (∂⟨signal, output⟩/∂weight)²`` of the
            per-sample, per-signal weight gradients. Without it the layer uses the
            generic (``vmap``) path.
        unsupported: If set, modules of this type are reported as unsupported with
            this reason (their sub-modules are not analyzed either).
    """

    kind: str = "layer"
    weight: Callable[[nn.Module], Any] = lambda m: getattr(m, "weight", None)
    to_canonical: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    ggn_squares: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    unsupported: str | None = None


_IGNORE = LayerExtractor(kind="ignored")
_LAYERS: dict[type, LayerExtractor] = {}


def register_layer(module_type: type, extractor: LayerExtractor | None = None, **kwargs: Any) -> None:
    """Register (or replace) how normflat reads a module type, in one call.

    Examples::

        register_layer(MyDense, kind="dense")                      # weight: module.weight, (out, in)
        register_layer(MyDense, LayerExtractor(kind="dense", weight=lambda m: m.kernel,
                                               to_canonical=lambda m, t: t.T))
        register_layer(MyAttention, unsupported="attention is not a weight matrix layer")

    Args:
        module_type: A ``torch.nn.Module`` subclass; subclasses of it are matched too
            unless registered themselves.
        extractor: A :class:`LayerExtractor`; or give its fields as keywords.
        **kwargs: Fields of :class:`LayerExtractor` when ``extractor`` is omitted.

    Raises:
        TypeError: If ``module_type`` is not an ``nn.Module`` subclass or the
            arguments are inconsistent.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_layer needs a torch.nn.Module subclass, got {module_type!r}.")
    if extractor is None:
        extractor = LayerExtractor(**kwargs)
    elif kwargs:
        raise TypeError("Pass either a LayerExtractor or its fields as keywords, not both.")
    if not isinstance(extractor, LayerExtractor):
        raise TypeError(f"extractor must be a LayerExtractor, got {type(extractor).__name__}.")
    _LAYERS[module_type] = extractor


def registered_layers() -> dict[type, LayerExtractor]:
    """A copy of the registry ``{module type: extractor}``."""
    return dict(_LAYERS)


def _lookup(module: nn.Module) -> LayerExtractor | None:
    for cls in type(module).__mro__:
        if cls in _LAYERS:
            return _LAYERS[cls]
    return None


def _conv_transpose_canonical(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    # torch stores (in, out/groups, *k); canonical is (out, in/groups, *k), group by group.
    g = module.groups
    cin, cout_g, *k = t.shape
    return t.reshape(g, cin // g, cout_g, *k).transpose(1, 2).reshape(g * cout_g, cin // g, *k)


# ----------------------------------------------------------------------------- fast GGN rules


def _chunks(n: int, per_item: int) -> Iterable[slice]:
    step = max(1, _SQUARES_BUDGET // max(per_item, 1))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


class _Deltas:
    """Back-propagated signals at one layer output: ``K`` groups of ``M`` per-signal tensors
    ``(n, *out)``, kept as a list so the built-in rules can avoid stacking copies."""

    def __init__(self, parts: list[torch.Tensor], k: int, m: int) -> None:
        self.parts, self.k, self.m = parts, k, m

    def stacked(self) -> torch.Tensor:
        """``(K, M, n, *out)``; the per-signal tensors are released."""
        shape = self.parts[0].shape
        out = torch.stack(self.parts).reshape(self.k, self.m, *shape)
        self.parts.clear()
        return out


def _builtin(rule):
    rule._normflat_deltas = True  # receives _Deltas instead of a stacked tensor
    return rule


@_builtin
def _linear_squares(module: nn.Module, a: torch.Tensor, deltas: _Deltas) -> torch.Tensor:
    """Fast GGN rule of ``nn.Linear``: ``(K, out, in)`` sums of squared per-sample gradients."""
    K, M = deltas.k, deltas.m
    out_f, in_f = module.weight.shape
    n = a.shape[0]
    if a.dim() == 2:
        # Per-sample gradient δ aᵀ is rank one: its square is δ² (a²)ᵀ, summed over n by a matmul.
        d2 = []
        for k in range(K):
            acc = deltas.parts[k * M].square()
            for d in deltas.parts[k * M + 1:(k + 1) * M]:
                acc.addcmul_(d, d)
            d2.append(acc)
        d2t = torch.stack(d2) if K > 1 else d2[0][None]  # (K, n, out)
        return torch.matmul(d2t.transpose(1, 2), a.square())
    # Inputs with extra axes (sequences): per-sample gradients are sums over positions.
    a = a.reshape(n, -1, in_f)
    res = a.new_zeros(K, out_f, in_f)
    for j, d in enumerate(deltas.parts):
        d = d.reshape(n, -1, out_f)
        for sl in _chunks(n, out_f * in_f):
            g = torch.matmul(d[sl].transpose(1, 2), a[sl])  # (c, out, in) per-sample gradients
            res[j // M] += g.square_().sum(0)
    return res


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


@_builtin
def _conv_squares(module: nn.Module, a: torch.Tensor, deltas: _Deltas) -> torch.Tensor:
    """Fast GGN rule of ``nn.ConvNd``: per-sample gradients ``δ Uᵀ`` of the unfolded input ``U``,
    group by group, squared and summed."""
    K, M = deltas.k, deltas.m
    n = a.shape[0]
    cout, cin_g, *k = module.weight.shape
    g = module.groups
    cout_g, kk = cout // g, cin_g * math.prod(k)
    unf = _unfold(module, a)  # (n, g·cin_g·∏k, L)
    L = unf.shape[-1]
    unf = unf.reshape(n, g, kk, L)
    res = a.new_zeros(K, g, cout_g, kk)
    # One signal at a time: no stacked copy of the signals, and each chunk of per-sample
    # gradients stays in cache while it is squared and summed.
    for j in range(len(deltas.parts)):
        d, deltas.parts[j] = deltas.parts[j].reshape(n, g, cout_g, L), None
        for sl in _chunks(n, g * cout_g * kk):
            ps = torch.matmul(d[sl], unf[sl].transpose(-1, -2))  # per-sample gradients (c, g, cout_g, kk)
            res[j // M] += ps.square_().sum(0)
        del d
    return res.reshape(K, cout, cin_g, *k)


@_builtin
def _conv_transpose_squares(module: nn.Module, a: torch.Tensor, deltas: _Deltas) -> torch.Tensor:
    """ConvTranspose is the adjoint of the convolution with the same weight, so its
    per-sample weight gradient is the conv weight gradient with the roles of the
    input and the output signal swapped: patches of the signal times the input."""
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        raise _NoFastPath("ConvTranspose with string padding or non-zero padding mode")
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
    res = a.new_zeros(g, K, cin_g, kk)
    for sl in _chunks(n, g * K * M * cin_g * kk):
        ps = torch.matmul(x[sl], unf[sl].transpose(-1, -2))  # (c, g, KM, cin_g, kk)
        res += ps.square_().reshape(-1, g, K, M, cin_g, kk).sum((0, 3))
    return res.permute(1, 0, 2, 3).reshape(K, cin, cout_g, *k)


class _NoFastPath(Exception):
    """A fast rule cannot handle this module configuration; use the generic path."""


def _register_builtins() -> None:
    register_layer(nn.Linear, kind="dense", ggn_squares=_linear_squares)
    for cls, kind in ((nn.Conv1d, "conv1d"), (nn.Conv2d, "conv2d"), (nn.Conv3d, "conv3d")):
        register_layer(cls, kind=kind, ggn_squares=_conv_squares)
    for cls, kind in ((nn.ConvTranspose1d, "conv_transpose1d"), (nn.ConvTranspose2d, "conv_transpose2d"),
                      (nn.ConvTranspose3d, "conv_transpose3d")):
        register_layer(cls, kind=kind, to_canonical=_conv_transpose_canonical,
                       ggn_squares=_conv_transpose_squares)
    register_layer(nn.MultiheadAttention, unsupported=(
        "attention projections are not supported yet; analyze the other layers with "
        "on_unsupported='skip' or 'warn'"))
    register_layer(nn.Embedding, unsupported=(
        "an embedding table is a lookup, not a weight matrix applied to inputs"))
    register_layer(nn.EmbeddingBag, unsupported="an embedding table is a lookup, not a weight matrix")
    for cls in (nn.RNNBase,):
        register_layer(cls, unsupported="recurrent layers are not supported yet")
    # Normalization and activation parameters never enter the measures (SPEC §9).
    ignored = [nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.PReLU]
    if hasattr(nn, "RMSNorm"):
        ignored.append(nn.RMSNorm)
    for cls in ignored:
        _LAYERS[cls] = _IGNORE


_register_builtins()


# ============================================================================ model discovery


@dataclass
class _Layer:
    name: str
    module: nn.Module
    param: nn.Parameter
    param_name: str  # name in model.named_parameters()
    ext: LayerExtractor
    fast: bool
    shared_with: list[str] = field(default_factory=list)
    reason: str | None = None  # why the generic path is used

    def canonical(self, t: torch.Tensor) -> torch.Tensor:
        return self.ext.to_canonical(self.module, t) if self.ext.to_canonical else t


def _collect_layers(model: nn.Module, options: AnalysisOptions, use_fast: bool) -> tuple[list[_Layer], list[str]]:
    param_names = {id(p): n for n, p in model.named_parameters()}
    layers: list[_Layer] = []
    by_param: dict[int, _Layer] = {}
    unsupported: list[str] = []
    skip_prefixes: list[str] = []
    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in skip_prefixes):
            continue
        label = name or type(module).__name__
        ext = _lookup(module)
        if ext is _IGNORE:
            continue
        if ext is not None and ext.unsupported:
            if any(True for _ in module.parameters()):
                unsupported.append(f"{label} ({type(module).__name__}: {ext.unsupported})")
            skip_prefixes.append(name)
            continue
        if ext is None:
            if any(True for _ in module.parameters(recurse=False)):
                unsupported.append(
                    f"{label} ({type(module).__name__} has parameters but no registered extractor; "
                    "register one with normflat.backends.torch.register_layer)"
                )
            continue
        w = ext.weight(module)
        skip_prefixes.append(name)
        if w is None:
            continue
        if not isinstance(w, nn.Parameter) or id(w) not in param_names:
            unsupported.append(
                f"{label} ({type(module).__name__}: its weight is not a parameter of the model, e.g. "
                "computed by torch.nn.utils.parametrize; remove the parametrization first)"
            )
            continue
        if id(w) in by_param:  # tied weight: one Hessian diagonal, reported under the first name
            first = by_param[id(w)]
            first.shared_with.append(label)
            first.fast, first.reason = False, "weight shared between modules"
            continue
        layer = _Layer(label, module, w, param_names[id(w)], ext, fast=use_fast and ext.ggn_squares is not None)
        if not layer.fast:
            layer.reason = "no fast rule" if use_fast else "fast=False"
        layers.append(layer)
        by_param[id(w)] = layer
    if unsupported:
        msg = "normflat skips layers it cannot analyze: " + "; ".join(unsupported)
        if options.on_unsupported == "error":
            raise ValueError(msg + ". Pass on_unsupported='warn' or 'skip' to analyze the other layers.")
        if options.on_unsupported == "warn":
            warnings.warn(msg + ".", UserWarning, stacklevel=4)
    if not layers:
        raise ValueError(
            f"The model {type(model).__name__} has no supported weight layer (nn.Linear, nn.Conv1d/2d/3d, "
            "nn.ConvTranspose1d/2d/3d, or a type registered with "
            "normflat.backends.torch.register_layer)."
        )
    for layer in layers:
        if not torch.is_floating_point(layer.param):
            raise TypeError(f"Layer {layer.name!r}: weight dtype {layer.param.dtype} is not floating point.")
        if not _all_finite(layer.param.detach()):
            raise ValueError(
                f"Layer {layer.name!r}: the weights contain NaN or infinite values; normflat needs "
                "a model with finite weights (check the training run or the checkpoint)."
            )
    devices = {layer.param.device for layer in layers}
    if len(devices) > 1:
        raise ValueError(
            f"The model's weights are on several devices {sorted(map(str, devices))}; normflat needs "
            "the whole model on one device (model.to(device))."
        )
    return layers, unsupported


# ============================================================================ model state


class _Preserved:
    """Records everything of the user's model normflat might touch, and restores it."""

    def __init__(self, model: nn.Module) -> None:
        self.modes = [(m, m.training) for m in model.modules()]
        self.params = [(p, p.requires_grad, p.grad) for p in model.parameters()]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.handles: list[Any] = []

    def restore(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for m, mode in self.modes:
            m.training = mode
        for p, req, g in self.params:
            if p.requires_grad != req:
                p.requires_grad_(req)
            if p.grad is not g:
                p.grad = g
        with torch.no_grad():
            for b, saved in self.buffers:
                if b.shape != saved.shape or not torch.equal(b, saved):
                    b.copy_(saved)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


@contextlib.contextmanager
def _quiet_jit_deprecation():
    # torch's forward-mode AD scripts helper functions with torch.jit.script, which
    # warns that it is deprecated on every call; that warning is not the user's concern.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated",
                                category=DeprecationWarning)
        yield


# ============================================================================ data


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def _iter_batches(data: Any) -> tuple[Iterable[Any], int | None]:
    def inputs_like(v: Any) -> bool:  # one input array, or a tuple of them (multi-input models)
        return _is_arraylike(v) or (isinstance(v, (tuple, list)) and len(v) > 0 and all(map(_is_arraylike, v)))

    if isinstance(data, (tuple, list)) and len(data) == 2 and inputs_like(data[0]) and _is_arraylike(data[1]):
        return [tuple(data)], 1
    if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        raise TypeError(
            f"data is a {type(data).__name__}, which yields single samples; wrap it in a DataLoader "
            "(torch.utils.data.DataLoader(dataset, batch_size=...))."
        )
    if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise TypeError(
            f"data must be a DataLoader, an iterable of (x, y) batches or one (x, y) pair, got "
            f"{type(data).__name__}."
        )
    try:
        total = len(data)
    except TypeError:
        total = None
    return data, total


def _to_model(t: Any, what: str, index: int, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if isinstance(t, np.ndarray):
        t = torch.as_tensor(t, device=device)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"Batch {index}: {what} must be a torch.Tensor (or numpy array), got {type(t).__name__}.")
    if t.device != device:
        raise ValueError(
            f"Batch {index}: {what} are on device {t.device} but the model is on {device}; move the "
            f"data to the model's device (x.to({str(device)!r})) or the model to the data's."
        )
    if t.is_inference():
        t = t.clone()  # tensors made under torch.inference_mode() cannot enter autograd
    if dtype is not None and torch.is_floating_point(t) and t.dtype != dtype:
        t = t.to(dtype)  # the analysis runs in the model's dtype
    return t


def _prepare(batch: Any, index: int, device: torch.device, dtype: torch.dtype) -> tuple[tuple, torch.Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            f"Batch {index} is a {type(batch).__name__}; every batch must be an (x, y) pair of inputs "
            "and integer class labels. A Dataset yields single samples: wrap it in a DataLoader."
        )
    x, y = batch
    xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    xs = tuple(_to_model(xi, "inputs", index, device, dtype) for xi in xs)
    for xi in xs:
        if torch.is_floating_point(xi) and not _all_finite(xi):
            raise ValueError(f"Batch {index}: the inputs contain NaN or infinite values.")
    y = _to_model(y, "labels", index, device, None)
    if y.dtype == torch.bool or torch.is_floating_point(y) or torch.is_complex(y):
        raise TypeError(
            f"Batch {index}: labels have dtype {y.dtype}; normflat needs integer class indices "
            "(y.long(); for one-hot labels use y.argmax(1))."
        )
    if y.dim() != 1:
        raise ValueError(
            f"Batch {index}: labels have shape {tuple(y.shape)}; expected a 1-D tensor of class "
            "indices, one per sample (a Dataset yields single samples: wrap it in a DataLoader)."
        )
    if xs and xs[0].dim() > 0 and xs[0].shape[0] != y.shape[0]:
        raise ValueError(f"Batch {index}: {xs[0].shape[0]} inputs but {y.shape[0]} labels.")
    return xs, y.long()


def _check_logits(logits: Any, y: torch.Tensor, index: int) -> int:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"The model returned a {type(logits).__name__}; normflat needs a forward that maps inputs "
            "to a (batch, classes) logits tensor."
        )
    if logits.dim() != 2:
        raise ValueError(
            f"Batch {index}: the model's output has shape {tuple(logits.shape)}; normflat needs logits "
            "of rank 2, (batch, classes). Flatten extra axes in the model or wrap it."
        )
    n, c = logits.shape
    if n != y.shape[0]:
        raise ValueError(f"Batch {index}: {n} logits rows but {y.shape[0]} labels.")
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"Batch {index}: the model's logits contain NaN or infinite values.")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= c):
        raise ValueError(
            f"Batch {index}: labels must be class indices in [0, {c - 1}] for {c} logits, got values "
            f"in [{int(y.min())}, {int(y.max())}]."
        )
    return c


# ============================================================================ losses


def _normalize(logits: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits - logits.mean(-1, keepdim=True)
    sigma = torch.sqrt(z.square().mean(-1, keepdim=True) + NSCE_EPS)
    return tau * z / sigma, sigma


def _loss_sum(logits: torch.Tensor, y: torch.Tensor, options: AnalysisOptions) -> torch.Tensor:
    """Sum of the per-sample losses of one batch."""
    if options.loss == "ce":
        return F.cross_entropy(logits, y, reduction="sum")
    if options.loss == "nsce":
        return F.cross_entropy(_normalize(logits, options.temperature)[0], y, reduction="sum")
    value = options.loss(logits, y)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(
            f"The loss callable must return a scalar tensor (the mean loss of the batch), got "
            f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}."
        )
    return value.reshape(()) * logits.shape[0]


def _check_loss(value: torch.Tensor, index: int) -> None:
    if not bool(torch.isfinite(value.detach()).all()):
        raise ValueError(f"Batch {index}: the loss is NaN or infinite.")


# ============================================================================ estimators


@dataclass
class _Settings:
    force: bool = False
    max_exact_params: int = DEFAULT_MAX_EXACT_PARAMS
    chunk_size: int | None = None
    memory_budget: Any = None
    exact_chunk: int = 64
    probe_chunk: int = 16
    fast: bool = True


def _settings(backend_options: dict[str, Any]) -> _Settings:
    unknown = sorted(set(backend_options) - set(_BACKEND_OPTIONS))
    if unknown:
        raise TypeError(
            f"Unknown option(s) for the torch backend: {unknown}; it accepts {list(_BACKEND_OPTIONS)}."
        )
    s = _Settings(**backend_options)
    for name in ("max_exact_params", "exact_chunk", "probe_chunk"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")
    if s.chunk_size is not None and (isinstance(s.chunk_size, bool) or not isinstance(s.chunk_size, int)
                                     or s.chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {s.chunk_size!r}.")
    if s.memory_budget is not None:
        from normflat.core.memory import parse_memory_budget

        if s.chunk_size is not None:
            raise ValueError(
                "Pass either chunk_size (samples per step) or memory_budget (the chunk size is then "
                "chosen from it), not both."
            )
        s.memory_budget = parse_memory_budget(s.memory_budget)
    return s


def _groups(samples: int) -> int:
    return min(samples, _MAX_GROUPS)


class _Accumulator:
    """Per-layer sums over batches of ``K`` group estimates (``K = 1``: deterministic)."""

    def __init__(self, layers: list[_Layer], k: int) -> None:
        self.k = k
        self.sums: dict[int, torch.Tensor | None] = {id(l): None for l in layers}

    def add(self, layer: _Layer, value: torch.Tensor) -> None:
        key = id(layer)
        value = value.detach()
        if self.sums[key] is None:
            self.sums[key] = value  # the rules return fresh tensors: no copy needed
        else:
            self.sums[key] = self.sums[key] + value

    def total(self, layer: _Layer) -> torch.Tensor:
        value = self.sums[id(layer)]
        if value is None:  # the layer never influenced the loss
            return torch.zeros((self.k, *layer.param.shape), dtype=layer.param.dtype, device=layer.param.device)
        return value


def _all_finite(t: torch.Tensor) -> bool:
    # One reduction decides the common case; the element-wise test only if the sum is not
    # finite (it can overflow for huge finite values).
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _functional_loss(model, xs, y, options):
    def f(ws: dict[str, torch.Tensor]) -> torch.Tensor:
        return _loss_sum(functional_call(model, ws, xs, strict=False), y, options)
    return f


def _hvp_batched(f: Callable, ws: dict, tangents: dict) -> dict:
    """``H v`` for a batch of tangents (leading axis), forward-over-reverse, with fallbacks."""
    def fwd_rev(v):
        return jvp(grad(f), (ws,), (v,))[1]

    def rev_rev(v):
        return vjp(grad(f), ws)[1](v)[0]

    for fn in (fwd_rev, rev_rev):
        try:
            return vmap(fn)(tangents)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            pass  # an op without a forward-AD or vmap rule, or data-dependent control flow
    m = next(iter(tangents.values())).shape[0]
    # Last resort: one HVP at a time by double back-propagation.
    outs = [rev_rev({k: v[i] for k, v in tangents.items()}) for i in range(m)]
    return {k: torch.stack([o[k] for o in outs]) for k in ws}


def _exact_batch(model, xs, y, layers, options, settings, acc):
    f = _functional_loss(model, xs, y, options)
    for layer in layers:
        w = layer.param.detach()
        fl = lambda wl, _n=layer.param_name: f({_n: wl})  # noqa: E731
        numel = w.numel()
        out = torch.empty(numel, dtype=w.dtype, device=w.device)
        for start in range(0, numel, settings.exact_chunk):
            idx = torch.arange(start, min(numel, start + settings.exact_chunk), device=w.device)
            basis = torch.zeros(idx.numel(), numel, dtype=w.dtype, device=w.device)
            basis[torch.arange(idx.numel(), device=w.device), idx] = 1
            hv = _hvp_batched(lambda d: fl(d["w"]), {"w": w}, {"w": basis.reshape(-1, *w.shape)})["w"]
            out[idx] = hv.reshape(idx.numel(), numel)[torch.arange(idx.numel(), device=w.device), idx]
        acc.add(layer, out.reshape(1, *w.shape))


def _hutchinson_batch(model, xs, y, layers, options, settings, acc, k, gen):
    ws = {l.param_name: l.param.detach() for l in layers}
    f = _functional_loss(model, xs, y, options)
    gen.manual_seed(options.seed)  # the same probes for every batch: Hutchinson of the full Hessian
    samples = options.samples
    for start in range(0, samples, settings.probe_chunk):
        m = min(samples, start + settings.probe_chunk) - start
        probes = {n: (torch.randint(0, 2, (m, *w.shape), generator=gen, device=w.device).to(w.dtype) * 2 - 1)
                  for n, w in ws.items()}
        hz = _hvp_batched(f, ws, probes)
        group = torch.arange(start, start + m, device=probes[layers[0].param_name].device) % k
        for layer in layers:
            est = probes[layer.param_name] * hz[layer.param_name]
            sums = torch.zeros((k, *est.shape[1:]), dtype=est.dtype, device=est.device)
            sums.index_add_(0, group, est)
            acc.add(layer, sums)


def _ggn_factor(p: torch.Tensor) -> torch.Tensor:
    """``C − 1`` signals ``(C−1, n, C)`` whose outer products sum to ``diag(p) − p pᵀ``.

    ``S = diag(√p) − p √pᵀ`` satisfies ``S Sᵀ = diag(p) − p pᵀ`` (its columns are
    ``√p_c (e_c − p)``) and ``S √p = 0``. With the Householder reflection ``R`` that maps
    ``e_C`` to ``−√p``, ``(S R)(S R)ᵀ = S Sᵀ`` and the last column of ``S R`` vanishes:
    one signal fewer to back-propagate (half the work for two classes).
    """
    n, c = p.shape
    u = p.sqrt()
    S = torch.diag_embed(u) - p[:, :, None] * u[:, None, :]  # (n, C, C)
    if c == 1:
        return S.permute(2, 0, 1)
    v = u.clone()
    v[:, -1] += 1  # v = √p + e_C, |v|² = 2 (1 + √p_C) >= 2: no cancellation
    # S R = S − (2/|v|²) (S v) vᵀ with S v = u ⊙ v − p (uᵀv): rank-one, O(C²) per sample.
    sv = u * v - p * (u * v).sum(1, keepdim=True)
    SR = S - (2 / (v * v).sum(1))[:, None, None] * sv[:, :, None] * v[:, None, :]
    return SR[:, :, : c - 1].permute(2, 0, 1)  # column j of S R -> signal j


def _signals(logits: torch.Tensor, options: AnalysisOptions, gen: torch.Generator | None) -> torch.Tensor:
    """Output signals ``(K, M, n, C)`` at the logits: ``Σ_m s sᵀ`` over a group is its GGN factor."""
    logits = logits.detach()
    n, c = logits.shape
    if options.loss == "nsce":
        z, sigma = _normalize(logits, options.temperature)
    else:
        z = logits
    p = torch.softmax(z, -1)
    if options.estimator == "ggn":
        sig = _ggn_factor(p)[None]
    else:
        s = options.samples
        k = _groups(s)
        draws = torch.multinomial(p, s, replacement=True, generator=gen).T  # (S, n)
        e = F.one_hot(draws, c).to(p.dtype) - p[None]  # (S, n, C)
        m = -(-s // k)
        sig = p.new_zeros(k, m, n, c)
        for j in range(k):
            members = e[j::k]  # draws of group j
            sig[j, : members.shape[0]] = members / math.sqrt(members.shape[0])
    if options.loss == "nsce":
        # Back through the normalization: its Jacobian (τ/σ)(P − ẑẑᵀ/C) is symmetric.
        zh = z / options.temperature
        centred = sig - sig.mean(-1, keepdim=True)
        proj = (sig * zh).sum(-1, keepdim=True) / c
        sig = options.temperature / sigma * (centred - zh * proj)
    return sig


def _generic_ggn(model, xs, sig, layers, acc):
    """Per-sample, per-signal weight gradients by ``vmap`` over a per-sample ``vjp``."""
    k, m, n, c = sig.shape
    ws = {l.param_name: l.param.detach() for l in layers}
    s = sig.permute(2, 0, 1, 3).reshape(n, k * m, c)

    def per_sample(s_n, *x_n):
        def f(w):
            return functional_call(model, w, tuple(xi.unsqueeze(0) for xi in x_n), strict=False).squeeze(0)
        _, pullback = vjp(f, ws)
        g = vmap(pullback)(s_n)[0]
        return {name: v.square().reshape(k, m, *v.shape[1:]).sum(1) for name, v in g.items()}

    def one(i):
        return per_sample(s[i], *(xi[i] for xi in xs))

    try:
        res = vmap(per_sample)(s, *xs)
        res = {name: v.sum(0) for name, v in res.items()}
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        # The model does something vmap cannot batch (data-dependent control flow, .item()):
        # one sample at a time.
        res = None
        for i in range(n):
            try:
                r = one(i)
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                r = _per_sample_loop(model, tuple(xi[i:i + 1] for xi in xs), s[i], layers, k, m)
            res = r if res is None else {name: res[name] + r[name] for name in r}
    for layer in layers:
        acc.add(layer, res[layer.param_name])


def _per_sample_loop(model, x_n, s_n, layers, k, m):
    params = [l.param for l in layers]
    for p in params:
        p.requires_grad_(True)  # restored by _Preserved
    with torch.enable_grad():
        out = model(*x_n)[0]
        total = {l.param_name: torch.zeros((k, *l.param.shape), dtype=l.param.dtype, device=l.param.device)
                 for l in layers}
        for j in range(k * m):
            gs = torch.autograd.grad(out, params, grad_outputs=s_n[j], retain_graph=True, allow_unused=True)
            for l, g in zip(layers, gs):
                if g is not None:
                    total[l.param_name][j // m] += g.square()
    return total


class _Capture:
    """Forward hooks recording each fast layer's input and output on one forward."""

    def __init__(self, layers: list[_Layer], preserved: _Preserved) -> None:
        self.layers = layers
        self.inputs: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.calls: dict[int, int] = {}
        self.active = True  # off while the generic path runs the model
        self._handles = []
        for layer in layers:
            h = layer.module.register_forward_hook(self._hook(layer))
            preserved.handles.append(h)
            self._handles.append(h)

    def _hook(self, layer: _Layer):
        key = id(layer)

        def hook(module, args, output):
            if not self.active:
                return None
            self.calls[key] = self.calls.get(key, 0) + 1
            if not args or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
                return None
            a = args[0].detach()
            self.inputs[key] = a
            self.versions[key] = a._version
            self.outputs[key] = output
            # Downstream sees a copy, so an in-place op after the layer (ReLU(inplace=True))
            # cannot rebase the tensor whose gradient we ask for.
            return output.clone()

        return hook

    def reset(self) -> None:
        self.inputs.clear(), self.versions.clear(), self.outputs.clear(), self.calls.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _weight_uses(root: Any, params: dict[int, _Layer]) -> dict[int, int]:
    """How many autograd edges lead to each weight (more than one: shared or functional use)."""
    counts = {key: 0 for key in params}
    seen, stack = set(), [root]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                if id(var) in counts:
                    counts[id(var)] += 1
            else:
                stack.append(nxt)
    return counts


def _ggn_batch(model, xs, y, layers, options, settings, acc, gen, capture, index, state):
    n = y.shape[0]
    if state.get("chunk") is None and settings.chunk_size is not None:
        state["chunk"] = settings.chunk_size
    step = state["chunk"] or n
    for start in range(0, n, step):
        sl = slice(start, min(n, start + step))
        xc = tuple(xi[sl] for xi in xs)
        capture.reset()
        with torch.enable_grad():
            logits = model(*xc)
        c = _check_logits(logits, y[sl], index)
        if state.get("chunk") is None:
            # Bound the signal rows back-propagated at once (signals per sample × samples); the
            # class count is known after the first forward, which is redone in chunks if too big.
            per_sample = c - 1 if options.estimator == "ggn" else \
                _groups(options.samples) * -(-options.samples // _groups(options.samples))
            per_sample = max(per_sample, 1)
            if settings.memory_budget is not None:
                from normflat.core.memory import chunk_size_for

                # Per sample: the signals at every fast layer output (and a stacked copy), and
                # the generic path's per-signal weight gradients.
                item = logits.element_size()
                rows = len(y[sl])
                outs = sum(capture.outputs[id(l)].numel() // rows for l in layers if id(l) in capture.outputs)
                weights = sum(l.param.numel() for l in layers if not l.fast)
                need = per_sample * item * (2 * (outs + c) + weights)
                state["chunk"] = chunk_size_for(settings.memory_budget, need, "the back-propagated GGN signals")
            else:
                state["chunk"] = max(1, DEFAULT_SIGNAL_ROWS // per_sample)
            if state["chunk"] < n:
                capture.reset()
                del logits
                return _ggn_batch(model, xs, y, layers, options, settings, acc, gen, capture, index, state)
        _check_loss(_loss_sum(logits.detach(), y[sl], options), index)
        sig = _signals(logits, options, gen)
        fast = [l for l in layers if l.fast]
        if not state.get("checked") and fast:
            # Structure check on the first forward: the fast rules need each weight used once,
            # by its own module, called once per forward.
            uses = _weight_uses(logits.grad_fn, {id(l.param): l for l in fast})
            for l in fast:
                calls = capture.calls.get(id(l), 0)
                if calls != 1 or uses[id(l.param)] != 1 or id(l) not in capture.outputs:
                    l.fast = False
                    l.reason = (f"module called {calls} times per forward" if calls != 1 else
                                f"weight used {uses[id(l.param)]} times in the graph" if uses[id(l.param)] != 1
                                else "module input or output is not a single tensor")
            state["checked"] = True
            fast = [l for l in fast if l.fast]
        for l in fast:
            if capture.calls.get(id(l), 0) != 1 or capture.inputs[id(l)]._version != capture.versions[id(l)]:
                # Dynamic models: re-checked on every chunk; earlier chunks' sums stay valid.
                l.fast, l.reason = False, "layer not called exactly once, or its input modified in place"
        fast = [l for l in fast if l.fast]
        if fast:
            k, m, nc, _ = sig.shape
            outs = [capture.outputs[id(l)] for l in fast]
            grads = list(_backprop_signals(logits, outs, sig.reshape(k * m, nc, -1), state["signature"]))
            for i, l in enumerate(fast):
                parts, grads[i] = grads[i], None  # the rule may free the parts once used
                if parts is None:  # the layer does not influence the logits
                    continue
                deltas = _Deltas(parts, k, m)
                del parts
                rule = l.ext.ggn_squares
                try:
                    acc.add(l, rule(l.module, capture.inputs[id(l)],
                                    deltas if getattr(rule, "_normflat_deltas", False) else deltas.stacked()))
                except _NoFastPath as why:  # handled by the generic path below, this chunk included
                    l.fast, l.reason = False, str(why)
        del logits
        capture.reset()
        generic = [l for l in layers if not l.fast]
        if generic:
            capture.active = False
            try:
                _generic_ggn(model, xc, sig, generic, acc)
            finally:
                capture.active = True


#: Model type signature -> whether a batched (vmap) backward ran without a slow fallback.
_BATCHED_BACKWARD_OK: dict[tuple[str, ...], bool] = {}


def _type_signature(model: nn.Module) -> tuple[str, ...]:
    return tuple(sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}))


def _backprop_signals(logits, outs, sig, signature) -> list[list[torch.Tensor] | None]:  # noqa: C901
    """Per layer, the gradients of ``⟨signal_j, logits⟩`` w.r.t. its output, for every ``j``.

    One batched (``is_grads_batched``) backward is fastest when every backward op has a
    vmap batching rule; otherwise vmap silently loops op by op (convolution and max-pool
    backward have no rule), and a loop of ordinary backward passes is faster (measured).
    The first call per model type signature finds out which case applies.
    """
    ok = _BATCHED_BACKWARD_OK.get(signature)
    if sig.shape[0] > 1 and ok is not False:
        flag = getattr(torch._C, "_debug_only_display_vmap_fallback_warnings", None)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if ok is None and flag is not None:
                    flag(True)
                try:
                    grads = torch.autograd.grad(logits, outs, grad_outputs=sig, is_grads_batched=True,
                                                retain_graph=True, allow_unused=True)
                finally:
                    if ok is None and flag is not None:
                        flag(False)
            fallback = any("performance drop" in str(w.message) for w in caught)
            for w in caught:  # re-emit anything else
                if "performance drop" not in str(w.message):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            if ok is None:
                _BATCHED_BACKWARD_OK[signature] = not fallback and flag is not None
            return [None if g is None else list(g.unbind(0)) for g in grads]
        except (RuntimeError, NotImplementedError):
            _BATCHED_BACKWARD_OK[signature] = False
    per = [torch.autograd.grad(logits, outs, grad_outputs=s, retain_graph=True, allow_unused=True)
           for s in sig]
    return [None if per[0][i] is None else [p[i] for p in per] for i in range(len(outs))]


# ============================================================================ distributed


class _Comm:
    """The all-reduces and gathers of a data-parallel run over a ``torch.distributed`` group.

    Every collective is entered by every rank in the same order, so a failure on one rank
    is announced to the others (which then raise too) instead of leaving them waiting in a
    collective that never completes; a rank that dies or hangs is caught by the process
    group's own timeout (``init_process_group(timeout=...)``).
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        # NCCL reduces CUDA tensors only, gloo and MPI CPU tensors; a mixed backend
        # ("cpu:gloo,cuda:nccl") takes tensors where they are.
        if backend == "nccl":
            self.device: torch.device | None = torch.device("cuda", torch.cuda.current_device())
        elif backend in ("gloo", "mpi"):
            self.device = torch.device("cpu")
        else:
            self.device = None

    @staticmethod
    def create(distributed: Any) -> _Comm | None:
        """The group to use for the ``distributed`` option, or ``None`` for a local run."""
        if distributed is False:
            return None
        if distributed is not None and distributed is not True:
            import torch.distributed as dist

            if not (dist.is_available() and isinstance(distributed, dist.ProcessGroup)):
                raise TypeError(
                    f"distributed must be None (automatic), True, False or a torch.distributed "
                    f"ProcessGroup, got {type(distributed).__name__}."
                )
            return _Comm(distributed)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return _Comm()
        if distributed is True:
            raise ValueError(
                "distributed=True but torch.distributed is not initialized; launch with torchrun and "
                "call torch.distributed.init_process_group() first, or pass distributed=False."
            )
        return None

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        moved = t if self.device is None else t.to(self.device)
        if moved is t:
            moved = t.clone()
        self.dist.all_reduce(moved, op=self.dist.ReduceOp.SUM, group=self.group)
        return moved.to(t.device)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def _fail(self, error: BaseException | None, phase: str) -> None:
        """Every rank knows that some rank failed: share the messages and raise everywhere."""
        mine = None if error is None else f"{type(error).__name__}: {str(error).rstrip('.')}"
        messages = self.gather(mine)
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise RuntimeError(
            f"normflat stopped on rank {self.rank} because {len(failed)} of {self.size} ranks failed "
            f"{phase} ({detail}). Fix the cause on the failing rank; every rank raises so that none "
            "waits forever."
        )

    def step(self, active: bool, error: BaseException | None, phase: str) -> bool:
        """One synchronization: raises on every rank if any failed; whether any rank is active."""
        flags = torch.tensor([int(active), int(error is not None)], dtype=torch.int64,
                             device=self.device or "cpu")
        flags = self._sum(flags)
        if int(flags[1]):
            self._fail(error, phase)
        return bool(int(flags[0]))

    def agree(self, error: BaseException | None, signature: Any, phase: str) -> None:
        """Raise on every rank if any rank failed or the ranks' ``signature`` differ."""
        gathered = self.gather((None if error is None else f"{type(error).__name__}: {str(error).rstrip('.')}",
                                signature))
        failed = [(r, m) for r, (m, _) in enumerate(gathered) if m is not None]
        if failed:
            if error is not None:
                raise error
            detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
            raise RuntimeError(
                f"normflat stopped on rank {self.rank} because {len(failed)} of {self.size} ranks failed "
                f"{phase} ({detail}). Fix the cause on the failing rank; every rank raises so that none "
                "waits forever."
            )
        for r, (_, sig) in enumerate(gathered):
            if sig != gathered[0][1]:
                diff = next((f"{a!r} on rank 0 vs {b!r} on rank {r}"
                             for a, b in zip(gathered[0][1], sig) if a != b),
                            f"{len(gathered[0][1])} entries on rank 0 vs {len(sig)} on rank {r}")
                raise ValueError(
                    "The ranks do not analyze the same model or options (layers, shapes, dtypes, "
                    f"estimator, loss): {diff}. Every rank must pass the same model architecture and "
                    "options and only its own shard of the data (or pass distributed=False to analyze "
                    "each rank's data alone)."
                )

    def sum_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """All-reduced copies of ``tensors`` (one collective for all of them)."""
        if not tensors:
            return []
        flat = self._sum(torch.cat([t.reshape(-1) for t in tensors]))
        out, start = [], 0
        for t in tensors:
            out.append(flat[start:start + t.numel()].reshape(t.shape).to(t.device))
            start += t.numel()
        return out


def _rank_seed(seed: int, rank: int) -> int:
    """Seed of one rank: independent probes and labels per rank, reproducible for a given world
    size; rank 0 keeps ``seed`` so a one-process group matches a local run."""
    if rank == 0:
        return seed
    state = np.random.SeedSequence([seed % 2**64, rank]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


def _is_fsdp(module: nn.Module) -> bool:
    # By class name: importing torch.distributed.fsdp just to check is slow and may fail.
    return any(c.__name__ in ("FullyShardedDataParallel", "FSDPModule") for c in type(module).__mro__)


def _unwrap(model: Any) -> Any:
    """The user's module inside a DDP / DataParallel wrapper (layer names without ``module.``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"The torch backend needs a torch.nn.Module, got {type(model).__name__}.")
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "normflat cannot analyze a TorchScript module: its compiled graph bypasses the forward "
            "hooks and torch.func transforms the estimators rely on. Analyze the eager nn.Module "
            "instead (save it with torch.save(model) or torch.save(model.state_dict()) and rebuild it)."
        )
    if any(_is_fsdp(m) for m in model.modules()) or any(
            type(p).__name__ == "DTensor" for p in model.parameters()):
        raise TypeError(
            "normflat cannot analyze an FSDP-sharded model: each rank holds only a shard of the "
            "weights, and the Hessian diagonal needs the full weights on every rank. Gather a full "
            "copy (torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True))), load it into an unwrapped model (or "
            "one wrapped in DistributedDataParallel) and analyze that: normflat shards the data "
            "across ranks, not the model."
        )
    return model


# ============================================================================ driver


def _run(model: nn.Module, data: Any, options: AnalysisOptions, backend_options: dict[str, Any]):
    backend_options = dict(backend_options)
    comm = _Comm.create(backend_options.pop("distributed", None))
    rank = comm.rank if comm is not None else 0
    # Setup: options, layers, size checks. In a distributed run every rank reports whether
    # its setup failed and what it will compute before any rank starts reducing.
    error, signature = None, None
    try:
        model = _unwrap(model)
        settings = _settings(backend_options)
        if comm is not None and rank != 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the skipped-layer warning: once, on rank 0
                layers, unsupported = _collect_layers(model, options, settings.fast)
        else:
            layers, unsupported = _collect_layers(model, options, settings.fast)
        device, dtype = layers[0].param.device, layers[0].param.dtype
        est = options.estimator
        if est == "exact" and not settings.force:
            total = sum(l.param.numel() for l in layers)
            if total > settings.max_exact_params:
                raise ValueError(
                    f"estimator='exact' needs one Hessian-vector product per weight entry per batch; this "
                    f"model has {total} weight entries, above the limit max_exact_params="
                    f"{settings.max_exact_params}. Use estimator='ggn' or 'hutchinson', or pass force=True "
                    "(or a larger max_exact_params) to run it anyway."
                )
        batches, total_batches = _iter_batches(data)
        signature = [(l.name, l.ext.kind, tuple(l.param.shape), str(l.param.dtype)) for l in layers] + [
            f"options(estimator={est!r}, loss={options.loss_name!r}, samples={options.samples}, "
            f"temperature={options.temperature}, seed={options.seed}, max_batches={options.max_batches})"]
    except Exception as e:
        if comm is None:
            raise
        error = e
    if comm is not None:
        comm.agree(error, signature, "while setting up the analysis")
    if options.max_batches is not None and total_batches is not None:
        total_batches = min(total_batches, options.max_batches)
    # Per-rank seeds: independent probes / drawn labels on every rank.
    local = replace(options, seed=_rank_seed(options.seed, rank), progress=options.progress and rank == 0)
    k = _groups(options.samples) if est in ("hutchinson", "ggn-mc") else 1
    acc = _Accumulator(layers, k)
    gen = torch.Generator(device=device)
    gen.manual_seed(local.seed)
    preserved = _Preserved(model)
    examples, n_batches = 0, 0
    try:
        model.eval()  # BatchNorm uses its running statistics, dropout is off
        capture = _Capture([l for l in layers if l.fast], preserved) if est in ("ggn", "ggn-mc") else None
        fast_weights = [l.param for l in layers if l.fast] if capture else []
        for p in fast_weights:
            p.requires_grad_(True)  # so the layer outputs carry gradients for the signals
        state: dict[str, Any] = {"chunk": None, "signature": _type_signature(model)}
        it = progress_bar(limited(batches, options.max_batches), enabled=local.progress,
                          desc=f"normflat {est}", total=total_batches)
        index, exhausted = 0, False
        # Autograd on, also when called under torch.no_grad() or torch.inference_mode().
        with _quiet_jit_deprecation(), torch.inference_mode(False), torch.enable_grad():
            while True:
                error, active = None, False
                try:
                    if not exhausted:
                        batch = next(it)
                        active = True
                        n = _run_batch(model, batch, index, device, dtype, layers, local, settings, acc, gen,
                                       capture, state, k)
                        examples, n_batches = examples + n, n_batches + (n > 0)
                except StopIteration:
                    exhausted = True
                except Exception as e:
                    if comm is None:
                        raise
                    error = e
                if comm is None:
                    if exhausted:
                        break
                # Ranks with fewer batches keep answering until every rank is done.
                elif not comm.step(active, error, f"on batch {index}"):
                    break
                index += 1
        if capture is not None:
            capture.remove()
    finally:
        preserved.restore()
    sums = [acc.total(layer) for layer in layers]
    metadata: dict[str, Any] = {"device": str(device)}
    if comm is not None:
        counts = comm.sum_tensors([torch.tensor([examples, n_batches], dtype=torch.int64, device=device)])[0]
        sums = comm.sum_tensors(sums)
        # Ranks that saw no batch never learned which layers need the generic path: merge.
        infos = comm.gather((n_batches > 0, str(device), [(l.fast, l.reason) for l in layers],
                             state.get("chunk")))
        ran = [info for info in infos if info[0]] or infos
        for i, layer in enumerate(layers):
            layer.fast = all(info[2][i][0] for info in ran)
            layer.reason = next((info[2][i][1] for info in ran if not info[2][i][0]), layer.reason)
        examples_per_rank = comm.gather(examples)
        examples, n_batches = int(counts[0]), int(counts[1])
        devices = list(dict.fromkeys(info[1] for info in infos))
        metadata.update(device=", ".join(devices), world_size=comm.size, examples_per_rank=examples_per_rank)
        chunks = [info[3] for info in infos if info[3] is not None]
        state["chunk"] = max(chunks) if chunks else None
    if examples == 0:
        raise ValueError("The data is empty: it yielded no samples. Pass at least one (x, y) batch.")
    results = []
    for layer, sums_l in zip(layers, sums):
        if est == "hutchinson":
            counts_k = torch.bincount(torch.arange(options.samples) % k, minlength=k)
            sums_l = sums_l / counts_k.to(sums_l).reshape(-1, *([1] * layer.param.dim()))
        if k >= 2:
            group = sums_l / examples
            diag = group.mean(0)
        else:
            group, diag = None, sums_l[0] / examples
        if not _all_finite(diag):
            raise ValueError(f"Layer {layer.name!r}: the Hessian diagonal is not finite (NaN/inf in the loss?).")
        results.append((layer, diag, group))
    metadata = {
        "examples": examples,
        "batches": n_batches,
        "dtype": str(dtype).replace("torch.", ""),
        **metadata,
        "unsupported": unsupported,
    }
    if settings.memory_budget is not None:
        metadata["memory_budget"] = settings.memory_budget
    if est in ("ggn", "ggn-mc") and state.get("chunk") is not None:
        metadata["chunk_size"] = state["chunk"]  # samples per GGN step (from chunk_size/memory_budget)
    return results, metadata


def _run_batch(model, batch, index, device, dtype, layers, options, settings, acc, gen, capture, state, k) -> int:
    """Add one batch's sums to ``acc``; returns its number of samples."""
    xs, y = _prepare(batch, index, device, dtype)
    if y.shape[0] == 0:
        return 0
    est = options.estimator
    if est in ("ggn", "ggn-mc"):
        _ggn_batch(model, xs, y, layers, options, settings, acc, gen, capture, index, state)
    else:
        with torch.no_grad():
            logits = model(*xs)
        _check_logits(logits, y, index)
        _check_loss(_loss_sum(logits, y, options), index)
        if est == "exact":
            _exact_batch(model, xs, y, layers, options, settings, acc)
        else:
            _hutchinson_batch(model, xs, y, layers, options, settings, acc, k, gen)
    return int(y.shape[0])


def _details(layer: _Layer, options: AnalysisOptions) -> dict[str, Any]:
    if options.estimator in ("ggn", "ggn-mc"):
        d: dict[str, Any] = {"path": "fast" if layer.fast else "generic"}
        if not layer.fast and layer.reason:
            d["generic_reason"] = layer.reason
    else:
        d = {"path": "hvp"}
    d["param"] = layer.param_name
    if layer.shared_with:
        d["shared_with"] = list(layer.shared_with)
    return d


def layer_problems(model: nn.Module, data: Any, options: AnalysisOptions, **backend_options: Any):
    """Per-layer problems of a torch model (backend contract, see ``normflat.backends``).

    Backend options: ``force`` (run ``exact`` above the size limit),
    ``max_exact_params`` (that limit, default 20 000), ``chunk_size`` (samples per
    GGN chunk; default bounds signals × samples by 8192) or ``memory_budget``
    (``"512MB"``; the GGN chunk size is chosen from it), ``exact_chunk`` /
    ``probe_chunk`` (HVPs vectorized at once), ``fast`` (``False`` forces the generic
    GGN path, for checking), ``distributed`` (``None``: shard over the default
    ``torch.distributed`` group when one is initialized; ``True``: require it;
    ``False``: analyze this process's data alone; or a ``ProcessGroup``).
    DistributedDataParallel / DataParallel wrappers are unwrapped; FSDP-sharded
    models are refused (they lack the full weights).
    """
    results, metadata = _run(model, data, options, backend_options)
    problems = []
    for layer, diag, group in results:
        w = layer.canonical(layer.param.detach())
        problems.append(LayerProblem(
            layer.name, w, layer.canonical(diag), kind=layer.ext.kind,
            hessian_diag_samples=None if group is None else torch.stack([layer.canonical(g) for g in group]),
            details=_details(layer, options),
        ))
    return problems, metadata


def hessian_diagonal(model: nn.Module, data: Any, options: AnalysisOptions, **backend_options: Any):
    """``{layer name: diagonal}`` in canonical ``(out, in, *kernel)`` layout, model order."""
    results, _ = _run(model, data, options, backend_options)
    return {layer.name: layer.canonical(diag) for layer, diag, _ in results}
