"""The Keras layer registry, its built-in entries and the model walk.

One :class:`~normflat.engine.registry.LayerRegistry` maps a Keras layer class
to an extractor ``layer -> [KerasWeight, ...]`` (MRO lookup: subclasses
match); normalization layers are registered as
:data:`~normflat.engine.registry.IGNORE` (their parameters never enter the
measures, method §9). The walk returns the analyzed weights in model order and
collects what it cannot analyze in a :class:`~normflat.engine.registry.Skipped`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import keras
import tensorflow as tf

from normflat.backends.keras import compat
from normflat.engine.registry import IGNORE, LayerRegistry, Skipped, Unsupported

__all__ = [
    "KerasWeight",
    "REGISTRY",
    "register_layer",
    "registered_layers",
    "Entry",
    "walk",
    "fast_kind",
    "final_softmax",
    "UnsupportedLayer",
]


@dataclass(frozen=True)
class KerasWeight:
    """One weight tensor of a Keras layer, as an extractor reports it.

    Attributes:
        variable: The layer's Keras variable holding the weight.
        to_canonical: Maps a tensor in the variable's layout to the canonical
            ``(out, in/groups, *kernel)`` layout (used for the weight and its
            diagonal). It must only move entries (transpose/reshape).
        kind: Short layer label for reports (``"dense"``, ``"conv2d"``, ...).
        suffix: Appended to the layer name (``"/pointwise"``) when a layer has
            several weight tensors; empty for one.
        groups: Groups of a grouped convolution (depthwise: the input channels);
            output channels of group ``k`` read only the input channels of group ``k``.
    """

    variable: Any
    to_canonical: Callable[[Any], Any]
    kind: str
    suffix: str = ""
    groups: int = 1


class UnsupportedLayer(Exception):
    """Raised by an extractor: this instance cannot be analyzed (the message is the reason)."""


#: ``{Keras layer class: extractor | IGNORE | Unsupported}``.
REGISTRY: LayerRegistry[Callable[[Any], list[KerasWeight]]] = LayerRegistry(
    "keras", keras.layers.Layer, "normflat.backends.keras.register_layer(cls, extractor)"
)


def register_layer(layer_class: type, extractor: Callable[[Any], list[KerasWeight]]) -> None:
    """Register how to read the weight matrices of a Keras layer class.

    Registered layers are analyzed with the generic (per-sample Jacobian) GGN
    path; the built-in ``Dense`` and ``Conv1D/2D/3D`` have a faster one.

    Args:
        layer_class: A ``keras.layers.Layer`` subclass; subclasses of it match too
            unless they are registered themselves.
        extractor: ``extractor(layer) -> [KerasWeight, ...]``; or
            :data:`normflat.engine.IGNORE` (parameters that are not weight
            matrices), or :class:`normflat.engine.Unsupported` (refused, with a reason).

    Example:
        >>> register_layer(MyDense, lambda layer: [
        ...     KerasWeight(layer.w, lambda t: tf.transpose(t), "dense")])
    """
    if not (extractor is IGNORE or isinstance(extractor, Unsupported) or callable(extractor)):
        raise TypeError("register_layer needs a callable extractor(layer) -> list[KerasWeight].")
    REGISTRY.register(layer_class, extractor)


def registered_layers() -> dict[type, Any]:
    """A copy of the layer registry ``{layer class: extractor}`` (also IGNORE/Unsupported entries)."""
    return REGISTRY.entries()


def _transpose_fn(perm: tuple[int, ...]) -> Callable[[Any], Any]:
    return lambda t: tf.transpose(t, perm)


def _refuse_lora(layer: Any) -> None:
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise UnsupportedLayer("LoRA-enabled or quantized layers are not supported")


def _dense_weights(layer: Any) -> list[KerasWeight]:
    _refuse_lora(layer)
    return [KerasWeight(compat.dense_kernel(layer), _transpose_fn((1, 0)), "dense")]


def _conv_weights(layer: Any) -> list[KerasWeight]:
    _refuse_lora(layer)
    r = layer.rank
    # (*k, in/groups, out) -> (out, in/groups, *k)
    return [KerasWeight(layer.kernel, _transpose_fn((r + 1, r) + tuple(range(r))), f"conv{r}d",
                        groups=int(getattr(layer, "groups", 1) or 1))]


def _depthwise_canonical(rank: int) -> Callable[[Any], Any]:
    # (*k, in, m) -> (in * m, 1, *k): output channel i*m + j reads input channel i only,
    # i.e. a convolution with groups = in and one input channel per group.
    def convert(t):
        t = tf.transpose(t, (rank, rank + 1) + tuple(range(rank)))
        shape = tf.shape(t)
        return tf.reshape(t, tf.concat([[shape[0] * shape[1], 1], shape[2:]], 0))

    return convert


def _depthwise_weights(layer: Any) -> list[KerasWeight]:
    r = layer.rank
    cin = int(layer.kernel.shape[r])
    return [KerasWeight(layer.kernel, _depthwise_canonical(r), f"depthwise_conv{r}d", groups=cin)]


def _separable_weights(layer: Any) -> list[KerasWeight]:
    r = layer.rank
    cin = int(layer.depthwise_kernel.shape[r])
    return [
        KerasWeight(layer.depthwise_kernel, _depthwise_canonical(r), f"depthwise_conv{r}d", "/depthwise",
                    groups=cin),
        KerasWeight(layer.pointwise_kernel, _transpose_fn((r + 1, r) + tuple(range(r))), f"conv{r}d",
                    "/pointwise"),
    ]


def _register_builtins() -> None:
    L = keras.layers
    register_layer(L.Dense, _dense_weights)
    for cls in (L.Conv1D, L.Conv2D, L.Conv3D):
        register_layer(cls, _conv_weights)
    for name in ("DepthwiseConv1D", "DepthwiseConv2D"):
        if hasattr(L, name):
            register_layer(getattr(L, name), _depthwise_weights)
    for name in ("SeparableConv1D", "SeparableConv2D"):
        if hasattr(L, name):
            register_layer(getattr(L, name), _separable_weights)
    # Normalization parameters never enter the measures (method §9).
    for name in ("BatchNormalization", "LayerNormalization", "GroupNormalization", "RMSNormalization",
                 "UnitNormalization", "Normalization", "SpectralNormalization"):
        if hasattr(L, name):
            register_layer(getattr(L, name), IGNORE)


_register_builtins()


@dataclass
class Entry:
    """One analyzed weight of the model.

    Attributes:
        name: Report name (layer path plus the weight's suffix).
        layer: The Keras layer.
        weight: Its :class:`KerasWeight`.
        fast: ``"dense"``/``"conv"`` for the fast GGN path, ``None`` for the generic one.
        reason: Why the generic path is used.
        input_rank: Rank of the tapped input (seen by the probe).
        in_size: Per-sample elements of the tapped input (memory estimate).
        pre_size: Per-sample elements of the tapped pre-activation (memory estimate).
    """

    name: str
    layer: Any
    weight: KerasWeight
    fast: str | None = None
    reason: str | None = None
    input_rank: int | None = None
    in_size: int = 0
    pre_size: int = 0

    @property
    def variable(self) -> Any:
        return self.weight.variable


def fast_kind(layer: Any) -> str | None:
    """Whether a layer's pre-activation and input can be tapped (its call is Keras' own)."""
    cls = type(layer)
    if isinstance(layer, keras.layers.Dense) and cls.call is keras.layers.Dense.call:
        return "dense"
    base = compat.base_conv_class()
    if (
        base is not None
        and isinstance(layer, base)
        and isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D))
        and cls.call in (base.call, keras.layers.Conv1D.call)
        and cls.convolution_op is base.convolution_op
    ):
        return "conv"
    return None


def _own_weights(layer: Any) -> list[str]:
    sub = {id(w) for child in compat.children(layer) for w in child.weights}
    return [w.path for w in layer.weights if id(w) not in sub]


def walk(model: Any, on_unsupported: str, select: list[str] | None) -> tuple[list[Entry], list[str]]:
    """Recognised weight layers in model order, and the messages of the skipped ones.

    Raises:
        ValueError: With ``on_unsupported="error"`` and a skipped layer; for unknown
            names in ``select``; if nothing can be analyzed.
        TypeError: If ``select`` is not a list of names.
    """
    entries: list[Entry] = []
    skipped = Skipped(REGISTRY)
    seen: set[int] = set()

    def visit(layer: Any, prefix: str) -> None:
        for child in compat.children(layer):
            if id(child) in seen:
                continue
            seen.add(id(child))
            name = prefix + child.name
            entry = REGISTRY.lookup(child)
            if entry is IGNORE:
                continue
            if isinstance(entry, Unsupported):
                skipped.add(name, child, entry.reason)
                continue
            if entry is not None:
                try:
                    weights = entry(child)
                except UnsupportedLayer as err:
                    skipped.add(name, child, str(err))
                    continue
                kind = fast_kind(child)
                fast = kind if len(weights) == 1 else None
                reason = None if fast else (
                    "several weight tensors in one layer" if kind else
                    f"{type(child).__name__} has no fast path (not Keras' own Dense/Conv call)")
                for w in weights:
                    entries.append(Entry(name + w.suffix, child, w, fast, reason))
            elif compat.children(child):
                visit(child, name + "/")
                own = _own_weights(child)
                if own:
                    skipped.add(name, child, f"{type(child).__name__} has own weights {own} outside its "
                                            f"sub-layers; register it with {REGISTRY.hint}")
            elif child.weights:
                skipped.add(name, child)

    visit(model, "")
    unsupported = skipped.report(on_unsupported)
    if select is not None:
        if isinstance(select, str) or not all(isinstance(s, str) for s in select):
            raise TypeError("layers must be a list of layer names (str).")
        known = [e.name for e in entries]
        unknown = [s for s in select if s not in known]
        if unknown:
            raise ValueError(f"Unknown layer name(s) {unknown}; this model's analyzable layers are {known}.")
        entries = [e for e in entries if e.name in set(select)]
    if not entries:
        raise ValueError(
            "The model has no layer normflat can analyze (Dense, Conv1D/2D/3D, DepthwiseConv, "
            "SeparableConv, or classes added with register_layer)."
        )
    return entries, unsupported


def _is_softmax(fn: Any) -> bool:
    return fn is keras.activations.softmax or getattr(fn, "__name__", "") == "softmax"


def final_softmax(model: Any) -> tuple[Any, str] | None:
    """The ``(layer, attribute)`` applying a final softmax of a Sequential/functional model.

    The built-in losses take logits, so that softmax is made the identity while
    analyzing (the report says so in ``metadata["backend"]["stripped_softmax"]``).
    """
    functional = compat.functional_class()
    layer = model
    for _ in range(16):
        if isinstance(layer, keras.Sequential):
            inner = list(layer.layers)
            if not inner:
                return None
            layer = inner[-1]
        elif isinstance(layer, functional) and layer.outputs:
            if len(layer.outputs) != 1:
                return None
            layer = compat.output_layer(layer)
            if layer is None:
                return None
        else:
            break
    act = getattr(layer, "activation", None)
    if isinstance(layer, keras.layers.Softmax):
        return layer, "call"
    if isinstance(layer, keras.layers.Activation) and _is_softmax(act):
        return layer, "call"
    if _is_softmax(act) and isinstance(layer, keras.layers.Layer):
        return layer, "activation"
    return None
