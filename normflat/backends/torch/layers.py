"""The torch layer registry, its built-in entries and the model walk.

One :class:`~normflat.engine.registry.LayerRegistry` maps module types to a
:class:`LayerExtractor` (how to read the weight, its canonical layout, its
groups and an optional fast GGN rule), to
:data:`~normflat.engine.registry.IGNORE` (normalization and activation
parameters, which never enter the measures, method §9) or to an
:class:`~normflat.engine.registry.Unsupported` reason. Lookups follow the MRO, so
subclasses of a registered type match too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from normflat.backends.torch import compat
from normflat.backends.torch.ggn import conv_squares, conv_transpose_squares, linear_squares
from normflat.engine.options import AnalysisOptions
from normflat.engine.problems import LayerSpec
from normflat.engine.registry import IGNORE, LayerRegistry, Skipped, Unsupported

__all__ = [
    "LayerExtractor",
    "REGISTRY",
    "register_layer",
    "registered_layers",
    "TorchLayer",
    "collect_layers",
    "unwrap",
]


def _default_weight(module: nn.Module) -> Any:
    return getattr(module, "weight", None)


@dataclass(frozen=True)
class LayerExtractor:
    """How normflat reads one module type.

    Args:
        kind: Short label recorded in reports (``"dense"``, ``"conv2d"``, ...).
        weight: ``module -> nn.Parameter``, the weight matrix or kernel (biases never
            enter the measures). Default: ``module.weight``.
        to_canonical: ``(module, tensor) -> tensor`` converting a tensor of the
            parameter's shape to the canonical ``(out, in/groups, *kernel)`` layout
            (applied to the weight and its Hessian diagonal). It must only move
            entries (reshape, transpose, permute): normflat inverts it to lay the
            Hutchinson probes, which are drawn in the canonical layout, onto the
            parameter. Default: identity.
        ggn_squares: Optional fast GGN rule ``(module, layer_input, signals) ->
            (K, *weight.shape)``: ``layer_input`` is the module's first positional
            input for a chunk of ``n`` samples, ``signals`` the back-propagated output
            signals of shape ``(K, M, n, *output.shape[1:])``; return, for each of the
            ``K`` groups, ``Σ_{m, sample} (∂⟨signal, output⟩/∂weight)²`` of the
            per-sample, per-signal weight gradients. Without it the layer uses the
            generic (``vmap``) path.
        unsupported: If set, modules of this type are reported as unsupported with
            this reason (their sub-modules are not analyzed either).
        groups: ``module -> int``, the groups of a grouped convolution (each output
            channel sees ``in/groups`` input channels). Default: 1.
    """

    kind: str = "layer"
    weight: Callable[[nn.Module], Any] = _default_weight
    to_canonical: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    ggn_squares: Callable[[nn.Module, torch.Tensor, Any], torch.Tensor] | None = None
    unsupported: str | None = None
    groups: Callable[[nn.Module], int] | None = None


#: ``{module type: LayerExtractor | IGNORE | Unsupported}``.
REGISTRY: LayerRegistry[LayerExtractor] = LayerRegistry(
    "torch", nn.Module, "normflat.backends.torch.register_layer")


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
    entry: Any = Unsupported(extractor.unsupported) if extractor.unsupported else extractor
    REGISTRY.register(module_type, entry)


def registered_layers() -> dict[type, Any]:
    """A copy of the registry ``{module type: LayerExtractor | IGNORE | Unsupported}``."""
    return REGISTRY.entries()


def _conv_transpose_canonical(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    # torch stores (in, out/groups, *k); canonical is (out, in/groups, *k), group by group.
    g = module.groups
    cin, cout_g, *k = t.shape
    return t.reshape(g, cin // g, cout_g, *k).transpose(1, 2).reshape(g * cout_g, cin // g, *k)


def _groups_of(module: nn.Module) -> int:
    return int(module.groups)


def _register_builtins() -> None:
    register_layer(nn.Linear, kind="dense", ggn_squares=linear_squares)
    for cls, kind in ((nn.Conv1d, "conv1d"), (nn.Conv2d, "conv2d"), (nn.Conv3d, "conv3d")):
        register_layer(cls, kind=kind, ggn_squares=conv_squares, groups=_groups_of)
    for cls, kind in ((nn.ConvTranspose1d, "conv_transpose1d"), (nn.ConvTranspose2d, "conv_transpose2d"),
                      (nn.ConvTranspose3d, "conv_transpose3d")):
        register_layer(cls, kind=kind, to_canonical=_conv_transpose_canonical,
                       ggn_squares=conv_transpose_squares, groups=_groups_of)
    register_layer(nn.MultiheadAttention, unsupported=(
        "attention projections are not supported yet; analyze the other layers with "
        "on_unsupported='skip' or 'warn'"))
    register_layer(nn.Embedding, unsupported=(
        "an embedding table is a lookup, not a weight matrix applied to inputs"))
    register_layer(nn.EmbeddingBag, unsupported="an embedding table is a lookup, not a weight matrix")
    register_layer(nn.RNNBase, unsupported="recurrent layers are not supported yet")
    # Normalization and activation parameters never enter the measures (method §9).
    ignored = [compat.NORM_BASE, nn.LayerNorm, nn.GroupNorm, nn.PReLU]
    if hasattr(nn, "RMSNorm"):
        ignored.append(nn.RMSNorm)
    for cls in ignored:
        REGISTRY.register(cls, IGNORE)


_register_builtins()


# ============================================================================ the model walk


@dataclass
class TorchLayer:
    """One analyzed weight: its report spec and what the kernels need."""

    spec: LayerSpec
    module: nn.Module
    param: nn.Parameter
    ext: LayerExtractor
    fast: bool
    _perm: torch.Tensor | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def param_name(self) -> str:
        return self.spec.param

    def canonical(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of the parameter's shape in the canonical layout."""
        return self.ext.to_canonical(self.module, t) if self.ext.to_canonical else t

    def canonical_shape(self) -> tuple[int, ...]:
        return tuple(self.canonical(torch.empty(self.param.shape, device="meta")).shape)

    def from_canonical(self, t: torch.Tensor) -> torch.Tensor:
        """``(m, *canonical)`` tensors laid onto the parameter's native ``(m, *shape)`` layout.

        ``to_canonical`` only moves entries, so applying it to the native positions
        ``0 .. numel-1`` gives, for each canonical entry, the native position it came from.
        """
        if self.ext.to_canonical is None:
            return t
        if self._perm is None:
            native = torch.arange(self.param.numel(), device=t.device).reshape(self.param.shape)
            self._perm = self.canonical(native).reshape(-1)
        out = torch.empty((t.shape[0], self.param.numel()), dtype=t.dtype, device=t.device)
        out[:, self._perm] = t.reshape(t.shape[0], -1)
        return out.reshape(t.shape[0], *self.param.shape)

    def disable_fast(self, reason: str) -> None:
        self.fast = False
        self.spec.path, self.spec.reason = "generic", reason


def unwrap(model: Any) -> nn.Module:
    """The user's module inside a DDP / DataParallel wrapper (layer names without ``module.``).

    Raises:
        TypeError: For non-modules, TorchScript modules and FSDP-sharded models.
    """
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
    if any(compat.is_fsdp(m) for m in model.modules()) or any(compat.is_dtensor(p) for p in model.parameters()):
        raise TypeError(
            "normflat cannot analyze an FSDP-sharded model: each rank holds only a shard of the "
            "weights, and the Hessian diagonal needs the full weights on every rank. Gather a full "
            "copy (torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True))), load it into an unwrapped model (or "
            "one wrapped in DistributedDataParallel) and analyze that: normflat shards the data "
            "across ranks, not the model."
        )
    return model


def collect_layers(model: nn.Module, options: AnalysisOptions, use_fast: bool,
                   on_unsupported: str) -> tuple[list[TorchLayer], list[str]]:
    """The analyzed weights of ``model`` in ``named_modules()`` order, and the skipped ones.

    Args:
        model: The (unwrapped) module.
        options: The analysis options (the estimator decides the reported path).
        use_fast: Whether the fast GGN rules may be used (backend option ``fast``).
        on_unsupported: ``"error"``, ``"warn"`` or ``"skip"`` (a distributed run warns
            on rank 0 only).

    Raises:
        ValueError: For no supported layer, non-finite weights, several devices, or an
            unsupported layer with ``on_unsupported="error"``.
        TypeError: For non-floating weights.
    """
    ggn = options.estimator in ("ggn", "ggn-mc")
    param_names = {id(p): n for n, p in model.named_parameters()}
    layers: list[TorchLayer] = []
    by_param: dict[int, TorchLayer] = {}
    skipped = Skipped(REGISTRY)
    skip_prefixes: list[str] = []
    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in skip_prefixes):
            continue
        label = name or type(module).__name__
        entry = REGISTRY.lookup(module)
        if entry is IGNORE:
            continue
        if isinstance(entry, Unsupported):
            if any(True for _ in module.parameters()):
                skipped.add(label, module, entry.reason)
            skip_prefixes.append(name)
            continue
        if entry is None:
            if any(True for _ in module.parameters(recurse=False)):
                skipped.add(label, module)
            continue
        ext: LayerExtractor = entry
        w = ext.weight(module)
        skip_prefixes.append(name)
        if w is None:
            continue
        if not isinstance(w, nn.Parameter) or id(w) not in param_names:
            skipped.add(label, module, (
                "its weight is not a parameter of the model, e.g. computed by "
                "torch.nn.utils.parametrize; remove the parametrization first"))
            continue
        if id(w) in by_param:  # tied weight: one Hessian diagonal, reported under the first name
            first = by_param[id(w)]
            first.spec.shared_with.append(label)
            if ggn:
                first.disable_fast("weight shared between modules")
            continue
        fast = ggn and use_fast and ext.ggn_squares is not None
        groups = int(ext.groups(module)) if ext.groups is not None else 1
        spec = LayerSpec(label, ext.kind, param_names[id(w)], groups=groups,
                         path=("fast" if fast else "generic") if ggn else "hvp",
                         reason=None if fast or not ggn else ("no fast rule" if use_fast else "fast=False"))
        layer = TorchLayer(spec, module, w, ext, fast)
        layers.append(layer)
        by_param[id(w)] = layer
    messages = skipped.report(on_unsupported)
    if not layers:
        raise ValueError(
            f"The model {type(model).__name__} has no supported weight layer (nn.Linear, nn.Conv1d/2d/3d, "
            "nn.ConvTranspose1d/2d/3d, or a type registered with "
            "normflat.backends.torch.register_layer)."
        )
    for layer in layers:
        if not torch.is_floating_point(layer.param):
            raise TypeError(f"Layer {layer.name!r}: weight dtype {layer.param.dtype} is not floating point.")
        if not all_finite(layer.param.detach()):
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
    return layers, messages


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor has no NaN or infinity.

    One reduction decides the common case; the element-wise test runs only if the sum
    is not finite (it can overflow for huge finite values).
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
