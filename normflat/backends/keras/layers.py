"""The Keras layer registry, its built-in entries and the model walk.

One :class:`~normflat.engine.registry.LayerRegistry` maps a Keras layer class
to an extractor ``layer -> [KerasWeight, ...]`` (MRO lookup: subclasses
match); normalization layers are registered as
:data:`~normflat.engine.registry.IGNORE` (their parameters never enter the
measures, method §9). Built in: ``Dense``, ``EinsumDense`` (so ``MultiHeadAttention``
through its projections), ``Embedding`` (and keras-hub's ``ReversibleEmbedding``,
``PositionEmbedding``), the recurrent cells (``LSTMCell``, ``GRUCell``,
``SimpleRNNCell``, split per gate), convolutions (method §3). The walk returns
the analyzed weights in model order, collects what it cannot analyze in a
:class:`~normflat.engine.registry.Skipped`, and lists every variable of the
model with its :class:`~normflat.engine.problems.ParameterStatus`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import sys

import keras
import tensorflow as tf

from normflat.backends.keras import compat
from normflat.backends.keras.calls import recurrent_cell
from normflat.backends.keras_shared import (HUB_EXPERTS, HUB_OWN_WEIGHTS, KERAS_IGNORED_LAYERS, holding_attribute,
                                           rank_equation)
from normflat.engine.problems import ParameterStatus
from normflat.engine.registry import (IGNORE, IGNORED_REASON, LayerRegistry, Skipped, Unsupported, excluded_reason,
                                      position_table, relative_bias_table)

__all__ = [
    "KerasWeight",
    "REGISTRY",
    "register_layer",
    "registered_layers",
    "Entry",
    "walk",
    "fast_kind",
    "UnsupportedLayer",
    "einsum_layout",
    "einsum_fast_axes",
    "RECURRENT_KINDS",
    "LORA_KINDS",
    "LORA_BASE_KINDS",
    "is_lora",
    "loops_through_time",
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
        blocks: For a weight that packs several linear maps along its canonical rows
            (the gates of a recurrent kernel), ``(suffix, start, stop)`` per map; each
            is reported as its own matrix ``f"{name}.{suffix}"`` (method §3).
        kernel_axes: The axes of the variable's layout that become the canonical kernel
            axes, where ``to_canonical`` also accepts them with size 1 (then the group
            sums of ``analyze`` on the Hessian-vector-product path are kept as kernel
            sums, method §6.2); ``()``: not declared.
    """

    variable: Any
    to_canonical: Callable[[Any], Any]
    kind: str
    suffix: str = ""
    groups: int = 1
    blocks: tuple[tuple[str, int, int], ...] | None = None
    kernel_axes: tuple[int, ...] = ()


class UnsupportedLayer(Exception):
    """Raised by an extractor: this instance cannot be analyzed (the message is the reason)."""


#: ``{Keras layer class: extractor | IGNORE | Unsupported}``.
REGISTRY: LayerRegistry[Callable[[Any], list[KerasWeight]]] = LayerRegistry(
    "keras", keras.layers.Layer, "normflat.backends.keras.register_layer(cls, extractor)"
)


def register_layer(layer_class: type, extractor: Callable[[Any], list[KerasWeight]]) -> None:
    """Register how to read the weight matrices of a Keras layer class.

    Registered layers are analyzed with the generic (per-sample Jacobian) GGN
    path; the built-in ``Dense``, ``EinsumDense``, ``Embedding``,
    ``Conv1D/2D/3D``, ``Conv1DTranspose/2D/3D``, ``DepthwiseConv1D/2D``,
    ``SeparableConv1D/2D``, the recurrent cells and keras-hub's ``PositionEmbedding`` have faster ones.

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


def _refuse_quantized(layer: Any) -> None:
    if getattr(layer, "quantization_mode", None):
        raise UnsupportedLayer(f"quantized layers ({layer.quantization_mode}) are not supported: their "
                               "kernel is not a floating-point variable")


#: Why a LoRA-enabled layer without the fast rule (:func:`_lora_fast_kind`) takes the generic path.
LORA_REASON = ("LoRA-enabled: the layer computes its kernel as kernel + s·A·B from three variables "
               "(a fast rule for Keras' own Dense, Embedding and ungrouped channels-last convolution calls, and an "
               "EinsumDense whose kernel's last axis is an output, only)")

#: The fast kinds of a LoRA-enabled ``Dense``'s or ``EinsumDense``'s factors ``A`` and ``B`` (the frozen
#: kernel keeps its layer's kind): all three from the layer's one tapped call (method §6.1, "LoRA adapters").
LORA_KINDS = ("lora_a", "lora_b")
#: The layer kinds whose LoRA factors have the fast rule (:func:`_lora_fast_kind`).
LORA_BASE_KINDS = ("dense", "einsum", "embedding", "conv")


def is_lora(layer: Any) -> bool:
    """Whether Keras' ``enable_lora`` was called on ``layer`` (its kernel is ``W + (α/r)·A·B``)."""
    return bool(getattr(layer, "lora_enabled", False))


def _lora_factors(a: Any, b: Any, a_canonical: Callable[[Any], Any], a_kind: str,
                  b_into_rank: bool) -> list[KerasWeight]:
    """The two LoRA factors ``a`` and ``b`` of a layer as the linear maps they are (method §3, "LoRA adapters").

    Keras' ``enable_lora`` keeps the frozen kernel ``W`` and adds ``(α/r) · A · B``, the product over the
    rank axis of ``A`` (the kernel's axes but the last, then the rank) and ``B`` (the rank, then the
    kernel's last axis). Where the kernel's last axis is an output, ``x ↦ (x·A)·B``: ``A`` maps the
    layer's input to ``r`` values (``a_canonical``, of kind ``a_kind``) and ``B`` those to the outputs,
    canonical ``(out, r)``. Where it is an input (``b_into_rank``), ``B`` maps it to the ``r`` values
    first, canonical ``(r, in)`` as stored.
    """
    b_canonical = (lambda t: t) if b_into_rank else _transpose_fn((1, 0))
    return [KerasWeight(a, a_canonical, a_kind, "/lora_a"), KerasWeight(b, b_canonical, "dense", "/lora_b")]


def _dense_weights(layer: Any) -> list[KerasWeight]:
    _refuse_quantized(layer)
    weights = [KerasWeight(compat.dense_kernel(layer), _transpose_fn((1, 0)), "dense")]
    if is_lora(layer):  # A (in, r), B (r, out)
        weights += _lora_factors(layer.lora_kernel_a, layer.lora_kernel_b, _transpose_fn((1, 0)), "dense",
                                 b_into_rank=False)
    return weights


def _conv_weights(layer: Any) -> list[KerasWeight]:
    _refuse_quantized(layer)
    r = layer.rank
    groups = int(getattr(layer, "groups", 1) or 1)
    # (*k, in/groups, out) -> (out, in/groups, *k)
    to_canonical = _transpose_fn((r + 1, r) + tuple(range(r)))
    weights = [KerasWeight(compat.dense_kernel(layer), to_canonical, f"conv{r}d", groups=groups,
                           kernel_axes=tuple(range(r)))]
    if is_lora(layer):
        if groups > 1:
            raise UnsupportedLayer("a LoRA-enabled grouped convolution (its B factor mixes the groups) is not "
                                   "supported")
        # A (*k, in, r): a convolution with r output channels; B (r, out): a 1x1 map of its outputs.
        weights += _lora_factors(layer.lora_kernel_a, layer.lora_kernel_b, to_canonical, f"conv{r}d",
                                 b_into_rank=False)
    return weights


def _conv_transpose_weights(layer: Any) -> list[KerasWeight]:
    _refuse_lora(layer)
    r = layer.rank
    # (*k, out, in) -> (out, in, *k): Keras stores the kernel of the convolution whose input
    # gradient the layer computes, whose input channels are the layer's outputs (method §3).
    return [KerasWeight(layer.kernel, _transpose_fn((r, r + 1) + tuple(range(r))), f"conv_transpose{r}d",
                        kernel_axes=tuple(range(r)))]


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
    return [KerasWeight(layer.kernel, _depthwise_canonical(r), f"depthwise_conv{r}d", groups=cin,
                        kernel_axes=tuple(range(r)))]


def _separable_weights(layer: Any) -> list[KerasWeight]:
    r = layer.rank
    cin = int(layer.depthwise_kernel.shape[r])
    return [
        KerasWeight(layer.depthwise_kernel, _depthwise_canonical(r), f"depthwise_conv{r}d", "/depthwise",
                    groups=cin, kernel_axes=tuple(range(r))),
        KerasWeight(layer.pointwise_kernel, _transpose_fn((r + 1, r) + tuple(range(r))), f"conv{r}d",
                    "/pointwise", kernel_axes=tuple(range(r))),
    ]


def einsum_layout(equation: str, kernel_rank: int) -> tuple[tuple[int, ...], int, int]:
    """The canonical layout of an ``EinsumDense`` kernel (method §3, multi-axis kernels).

    The kernel's axes are either *contracted* (they appear in the input, not in the
    output) or *output-only* (in the output, not in the input). The layer is then the
    linear map from the flattened contracted input axes to the flattened output-only
    axes, one matrix ``(∏ output-only axes, ∏ contracted axes)``, each group flattened
    in the order its axes appear in the output and in the input.

    Returns:
        ``(perm, rows, cols)``: the kernel transposition to (output-only axes,
        contracted axes) and the numbers of their axes.

    Raises:
        UnsupportedLayer: For a kernel axis that is also a batch-like axis (in the
            input and the output: a separate matrix per index, not one map) or that
            is summed out (in neither), and for equations that cannot be parsed.
    """
    text = equation.replace(" ", "")
    try:
        lhs, out = text.split("->")
        inp, ker = lhs.split(",")
    except ValueError:
        raise UnsupportedLayer(f"EinsumDense equation {equation!r} is not of the form 'input,kernel->output'")
    inp, out = inp.replace("...", ""), out.replace("...", "")
    if "." in ker or len(ker) != kernel_rank or len(set(ker)) != len(ker):
        raise UnsupportedLayer(f"EinsumDense equation {equation!r} does not name each kernel axis once")
    batch_like = [a for a in ker if a in inp and a in out]
    summed = [a for a in ker if a not in inp and a not in out]
    if batch_like or summed:
        what = (f"kernel axes {batch_like} appear in the input and the output (one matrix per index, "
                "not one linear map)" if batch_like else f"kernel axes {summed} are summed out")
        raise UnsupportedLayer(
            f"EinsumDense equation {equation!r}: {what}; normflat analyzes kernels whose axes are either "
            "contracted with the input or output-only. Register the layer with register_layer to choose "
            "its matrices"
        )
    outputs = [a for a in out if a in ker]
    contracted = [a for a in inp if a in ker]
    perm = tuple(ker.index(a) for a in outputs + contracted)
    return perm, len(outputs), len(contracted)


def einsum_fast_axes(equation: str) -> tuple[str, str, str, str, str, str] | None:
    """``(input, kernel, output, shared, input_only, contracted)`` subscripts for the fast GGN path.

    The fast path needs the sample axis first in the input and the output (and not
    in the kernel), and no ellipsis. ``shared`` are the other axes of both the
    input and the output but not of the kernel (positions, heads' sequence axes),
    over which a sample's gradient sums; ``input_only`` axes are summed by the
    einsum itself. ``None``: take the generic path.
    """
    text = equation.replace(" ", "")
    if "." in text or "->" not in text or "," not in text:
        return None
    lhs, out = text.split("->")
    inp, ker = lhs.split(",")
    if not inp or not out or inp[0] != out[0] or inp[0] in ker:
        return None
    shared = "".join(a for a in inp[1:] if a in out and a not in ker)
    input_only = "".join(a for a in inp if a not in out and a not in ker)
    contracted = "".join(a for a in inp if a in ker)
    return inp, ker, out, shared, input_only, contracted


def _einsum_canonical(perm: tuple[int, ...], rows: int) -> Callable[[Any], Any]:
    def convert(t):
        t = tf.transpose(t, perm)
        shape = tf.shape(t)
        return tf.reshape(t, tf.stack([tf.reduce_prod(shape[:rows]), tf.reduce_prod(shape[rows:])]))

    return convert


def _einsum_weights(layer: Any) -> list[KerasWeight]:
    _refuse_quantized(layer)
    kernel = compat.dense_kernel(layer)
    perm, rows, _ = einsum_layout(layer.equation, len(kernel.shape))
    weights = [KerasWeight(kernel, _einsum_canonical(perm, rows), "einsum_dense")]
    if is_lora(layer):
        equation, last_is_input = rank_equation(layer.equation)
        a_perm, a_rows, _ = einsum_layout(equation, len(kernel.shape))
        weights += _lora_factors(layer.lora_kernel_a, layer.lora_kernel_b, _einsum_canonical(a_perm, a_rows),
                                 "einsum_dense", b_into_rank=last_is_input)
    return weights


def _embedding_weights(layer: Any) -> list[KerasWeight]:
    """An embedding table ``(vocabulary, features)`` is the matrix ``(features, vocabulary)`` (method §3).

    keras-hub's ``ReversibleEmbedding`` also maps features back to the vocabulary:
    with ``tie_weights`` through the same table (one variable, reported once, its
    diagonal covering both uses; fast kind ``"tied"``, :func:`fast_kind`), otherwise
    through its own ``reverse_embeddings`` ``(features, vocabulary)``, a dense kernel
    (canonical ``(vocabulary, features)``).
    """
    _refuse_quantized(layer)
    table = getattr(layer, "_embeddings", None)
    if table is None:
        table = layer.embeddings
    weights = [KerasWeight(table, _transpose_fn((1, 0)), "embedding")]
    reverse = getattr(layer, "reverse_embeddings", None)
    if reverse is not None and not getattr(layer, "tie_weights", True) and reverse is not table:
        weights.append(KerasWeight(reverse, _transpose_fn((1, 0)), "dense", "/reverse"))
    if is_lora(layer):  # A (vocabulary, r): a lookup of r features; B (r, features)
        weights += _lora_factors(layer.lora_embeddings_a, layer.lora_embeddings_b, _transpose_fn((1, 0)),
                                 "embedding", b_into_rank=False)
    return weights


def _position_embedding_weights(layer: Any) -> list[KerasWeight]:
    """keras-hub ``PositionEmbedding``: the table ``(positions, features)`` is the embedding of the positions."""
    table = getattr(layer, "position_embeddings", None)
    if table is None:
        raise UnsupportedLayer("PositionEmbedding without its position_embeddings table")
    return [KerasWeight(table, _transpose_fn((1, 0)), "position_embedding")]


def _relative_embedding_weights(layer: Any) -> list[KerasWeight]:
    """keras-hub's DeBERTa-v3 ``RelativeEmbedding``: the table ``(2·buckets, features)`` is the embedding
    of the relative-position buckets (as Hugging Face's ``rel_embeddings``, an ``nn.Embedding``)."""
    table = getattr(layer, "rel_embeddings", None)
    if table is None:
        raise UnsupportedLayer("RelativeEmbedding without its rel_embeddings table")
    return [KerasWeight(table, _transpose_fn((1, 0)), "position_embedding")]


#: Keras gate order of the recurrent cells' packed kernels (columns of ``kernel``/``recurrent_kernel``).
_GATES = {"LSTMCell": ("i", "f", "c", "o"), "GRUCell": ("z", "r", "h"), "SimpleRNNCell": ()}


def _recurrent_weights(gates: tuple[str, ...], kind: str) -> Callable[[Any], list[KerasWeight]]:
    """A recurrent cell's ``kernel`` (in, G·H) and ``recurrent_kernel`` (H, G·H), each one matrix per gate.

    Both are transposed to ``(G·H, in)`` / ``(G·H, H)`` (method §3) and split into the
    gate blocks with :attr:`KerasWeight.blocks`, named after Keras' own gate order.
    """

    def extract(layer: Any) -> list[KerasWeight]:
        _refuse_lora(layer)
        hidden = int(layer.units)
        blocks = tuple((g, k * hidden, (k + 1) * hidden) for k, g in enumerate(gates)) or None
        return [KerasWeight(layer.kernel, _transpose_fn((1, 0)), kind, "/kernel", blocks=blocks),
                KerasWeight(layer.recurrent_kernel, _transpose_fn((1, 0)), kind, "/recurrent_kernel",
                            blocks=blocks)]

    return extract


def _experts_canonical(interleaved: bool) -> Callable[[Any], Any]:
    """keras-hub's stacked experts kernel ``(experts, in, out)`` to the canonical ``(experts·out, in)``:
    expert after expert, each expert's gate rows before its up rows (de-interleaved if packed
    ``[gate₀, up₀, gate₁, ...]``)."""
    def convert(t: Any) -> Any:
        t = tf.transpose(t, (0, 2, 1))
        experts, rows, cols = int(t.shape[0]), int(t.shape[1]), int(t.shape[2])
        if interleaved:
            t = tf.transpose(tf.reshape(t, (experts, rows // 2, 2, cols)), (0, 2, 1, 3))
        return tf.reshape(t, (experts * rows, cols))
    return convert


def _hub_experts_weights(kernels: tuple[tuple[str, str], ...]) -> Callable[[Any], list[KerasWeight]]:
    """The stacked kernels of a keras-hub experts layer as one problem per expert and linear map
    (method §3, "Mixture-of-experts layers"): ``<layer>/gate.<e>``, ``/up.<e>``, ``/down.<e>``, and
    ``/gate_up.<e>.gate`` and ``.<e>.up`` for a kernel packing both."""

    def extract(layer: Any) -> list[KerasWeight]:
        out = []
        for attr, maps in kernels:
            v = getattr(layer, attr, None)
            shape = _shape(v) if v is not None else ()
            packed = maps.startswith("gate_up")
            if len(shape) != 3 or (packed and shape[2] % 2):
                raise UnsupportedLayer(f"{type(layer).__name__}.{attr} is not an (experts, in, out) kernel")
            experts, rows = shape[0], shape[2]
            if packed:
                half = rows // 2
                blocks = tuple(b for e in range(experts) for b in (
                    (f"{e}.gate", e * rows, e * rows + half), (f"{e}.up", e * rows + half, (e + 1) * rows)))
            else:
                blocks = tuple((f"{e}", e * rows, (e + 1) * rows) for e in range(experts))
            out.append(KerasWeight(v, _experts_canonical(maps == "gate_up_interleaved"), "expert",
                                   "/gate_up" if packed else f"/{maps}", blocks=blocks))
        return out

    return extract


def _loaded_class(module_name: str, cls_name: str) -> type | None:
    """The class ``cls_name`` of the module ``module_name`` if that module is already imported (normflat
    never imports keras-hub), else ``None``."""
    cls = getattr(sys.modules.get(module_name), cls_name, None)
    return cls if isinstance(cls, type) else None


def _own_weights_of(layer: Any) -> dict[str, str]:
    """:data:`HUB_OWN_WEIGHTS` of ``layer``'s class (``{}``: none)."""
    for (module_name, cls_name), weights in HUB_OWN_WEIGHTS.items():
        cls = _loaded_class(module_name, cls_name)
        if cls is not None and isinstance(layer, cls):
            return weights
    return {}


def _own_weight(variable: Any, layout: str) -> KerasWeight | None:
    """A :data:`HUB_OWN_WEIGHTS` entry's :class:`KerasWeight`, named after the variable (``None``: not
    of its shape)."""
    shape = _shape(variable)
    if len(shape) != 2:
        return None
    suffix = f"/{variable.name}"
    if layout == "dense":
        return KerasWeight(variable, _transpose_fn((1, 0)), "dense", suffix)
    return KerasWeight(variable, lambda t: tf.expand_dims(t, 1), "depthwise_conv1d", suffix, groups=shape[0],
                       kernel_axes=(1,))


#: keras-hub layers whose call loops through time (``ops.fori_loop``, a ``tf.while_loop``) outside
#: Keras' ``RNN``: RWKV-7's time mixing (its state of ``(heads, N, N)`` per sample, step by step).
_HUB_LOOPS_THROUGH_TIME = (("keras_hub.src.models.rwkv7.rwkv7_layer", "RWKV7TimeMix"),)


def loops_through_time(layer: Any) -> bool:
    """Whether ``layer`` runs a loop through time: a Keras ``RNN`` or one of
    :data:`_HUB_LOOPS_THROUGH_TIME`."""
    if isinstance(layer, keras.layers.RNN):
        return True
    return any(cls is not None and isinstance(layer, cls)
               for cls in (_loaded_class(module_name, cls_name) for module_name, cls_name in _HUB_LOOPS_THROUGH_TIME))


_KERAS_HUB_REGISTERED = False


def _register_keras_hub() -> None:
    """keras-hub's own embedding layers, registered once keras-hub is imported (never imported here)."""
    global _KERAS_HUB_REGISTERED
    if _KERAS_HUB_REGISTERED or "keras_hub" not in sys.modules:
        return
    _KERAS_HUB_REGISTERED = True
    hub_layers = getattr(sys.modules["keras_hub"], "layers", None)
    cls = getattr(hub_layers, "PositionEmbedding", None)
    if isinstance(cls, type) and cls not in REGISTRY.entries():  # a user's own entry wins
        register_layer(cls, _position_embedding_weights)
    # DeBERTa-v3's table of relative positions (not exported; loaded with keras_hub): the embedding
    # of the relative-position buckets, read whole and layer-normalized (the generic path).
    relative = _loaded_class("keras_hub.src.models.deberta_v3.relative_embedding", "RelativeEmbedding")
    if relative is not None and relative not in REGISTRY.entries():
        register_layer(relative, _relative_embedding_weights)
    for (module_name, cls_name), kernels in HUB_EXPERTS.items():
        experts = _loaded_class(module_name, cls_name)
        if experts is not None and experts not in REGISTRY.entries():
            register_layer(experts, _hub_experts_weights(kernels))


#: Keras' convolution layers (1-D to 3-D; plain, transposed, depthwise, separable) by name, each
#: group with the extractor of its weights.
_CONVOLUTIONS = ((("Conv1D", "Conv2D", "Conv3D"), _conv_weights),
                 (("Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose"), _conv_transpose_weights),
                 (("DepthwiseConv1D", "DepthwiseConv2D"), _depthwise_weights),
                 (("SeparableConv1D", "SeparableConv2D"), _separable_weights))


def convolution_classes() -> tuple[type, ...]:
    """Keras' convolution layer classes that this Keras has (:data:`_CONVOLUTIONS`)."""
    return tuple(getattr(keras.layers, name) for names, _ in _CONVOLUTIONS for name in names
                 if hasattr(keras.layers, name))


def _register_builtins() -> None:
    L = keras.layers
    register_layer(L.Dense, _dense_weights)
    register_layer(L.EinsumDense, _einsum_weights)
    register_layer(L.Embedding, _embedding_weights)
    register_layer(L.LSTMCell, _recurrent_weights(_GATES["LSTMCell"], "lstm"))
    register_layer(L.GRUCell, _recurrent_weights(_GATES["GRUCell"], "gru"))
    register_layer(L.SimpleRNNCell, _recurrent_weights(_GATES["SimpleRNNCell"], "simple_rnn"))
    for names, extractor in _CONVOLUTIONS:
        for name in names:
            if hasattr(L, name):
                register_layer(getattr(L, name), extractor)
    # Normalization and activation parameters never enter the measures (method §4): PReLU's slopes
    # (one per input entry by default, so shaped like a matrix after a convolution) as in PyTorch.
    for name in KERAS_IGNORED_LAYERS:
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
        fast: ``"dense"``/``"conv"``/``"conv_transpose"``/``"depthwise"``/``"einsum"``/``"embedding"``, a separable
            convolution's or a recurrent cell's kinds (:data:`SEPARABLE_KINDS`,
            :data:`RECURRENT_KINDS`), ``"position"``
            (keras-hub's ``PositionEmbedding``), ``"table"`` (a position table held as a loose
            weight, :attr:`attr`) or ``"tied"`` (a ``ReversibleEmbedding`` whose table is also
            its reverse projection, method §6.1 "Tied weights"), a LoRA-enabled layer's factors' kinds (:data:`LORA_KINDS`, beside the frozen kernel's layer
            kind, method §6.1 "LoRA adapters") for the fast GGN path,
            ``"unused"`` (:data:`UNUSED`: no forward calls its layer and the logits do not depend
            on it; zero curvature, no path), ``None`` for the generic one.
        reason: Why the generic path is used.
        input_rank: Rank of the tapped input (seen by the probe).
        in_size: Per-sample elements of the tapped input (memory estimate).
        pre_size: Per-sample elements of the tapped pre-activation (memory estimate).
        fold: Rows of the tapped input and pre-activation per sample (``Dense``, ``EinsumDense``
            on a batch folded into the leading axis, e.g. attention windows; checked by the first
            forward), 1 otherwise.
        calls: Calls of a ``Dense`` or convolution layer per forward (a layer shared by branches or
            applied in a loop): its per-sample gradient sums the calls' (method §6.1, "Tied
            weights"); 1 otherwise.
        attr: For a loose position table, the attribute of :attr:`layer` holding its variable,
            which the GGN step sets to the table expanded over the batch (method §6.1,
            "Position tables"); ``None`` otherwise.
        shared_with: Report names of the other layers whose weights list this variable
            (analyzed once, here; method §6.1 "Embeddings").
    """

    name: str
    layer: Any
    weight: KerasWeight
    fast: str | None = None
    reason: str | None = None
    input_rank: int | None = None
    in_size: int = 0
    pre_size: int = 0
    fold: int = 1
    calls: int = 1
    attr: str | None = None
    shared_with: list[str] = field(default_factory=list)

    @property
    def variable(self) -> Any:
        return self.weight.variable


def fast_kind(layer: Any) -> str | None:
    """Whether a layer's pre-activation and input can be tapped (its call is Keras' own)."""
    if getattr(layer, "quantization_mode", None):
        return None
    if is_lora(layer):
        return _lora_fast_kind(layer)
    return _own_call_kind(layer)


def _own_call_kind(layer: Any) -> str | None:
    """:func:`fast_kind` of a layer whose call is Keras' own, LoRA and quantization aside."""
    cls = type(layer)
    reversible = _reversible_embedding()
    if reversible is not None and isinstance(layer, reversible):
        reason = tied_reversible_reason(layer)
        # An untied reverse projection: the lookup on the embedding rule, the projection on the dense one.
        return "tied" if reason is None else "untied" if reason == UNTIED_REASON else None
    if isinstance(layer, keras.layers.Dense) and cls.call is keras.layers.Dense.call:
        return "dense"
    if isinstance(layer, keras.layers.EinsumDense) and cls.call is keras.layers.EinsumDense.call:
        return "einsum" if einsum_fast_axes(layer.equation) is not None else None
    if isinstance(layer, keras.layers.Embedding) and cls.call is keras.layers.Embedding.call:
        return "embedding"
    hub = _hub_position_embedding()
    if hub is not None and isinstance(layer, hub) and cls.call is hub.call:
        return "position"
    base = compat.base_conv_class()
    if (
        base is not None
        and isinstance(layer, base)
        and isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D))
        and cls.call in (base.call, keras.layers.Conv1D.call)
        and cls.convolution_op is base.convolution_op
    ):
        return "conv"
    transposed = compat.base_conv_transpose_class()
    if transposed is not None and isinstance(layer, transposed) and cls.call is transposed.call:
        return "conv_transpose"
    depthwise = _base_depthwise_class()
    if (
        depthwise is not None
        and isinstance(layer, depthwise)
        and cls.call is depthwise.call
        and int(layer.rank) in (1, 2)
    ):
        return "depthwise"
    separable = _base_separable_class()
    if separable is not None and isinstance(layer, separable) and cls.call is separable.call \
            and int(layer.rank) in (1, 2):
        return "separable"
    if recurrent_cell(layer) is not None:
        return "recurrent"
    return None


def _lora_fast_kind(layer: Any) -> str | None:
    """A LoRA-enabled layer's kind where its factors have the fast rule (method §6.1, "LoRA adapters"):
    Keras' own ``Dense``, ``Embedding`` or ungrouped channels-last convolution call, or ``EinsumDense`` call on the
    fast path's equations whose kernel's last axis (the one ``A·B`` forms) is an output; ``None``
    otherwise (the generic path)."""
    kind = _own_call_kind(layer)
    if kind == "einsum" and rank_equation(layer.equation)[1]:
        return None
    if kind == "conv" and (int(getattr(layer, "groups", 1) or 1) != 1 or layer.data_format != "channels_last"):
        return None  # (TensorFlow runs channels-first convolutions on GPUs only: the generic path there)
    return kind if kind in LORA_BASE_KINDS else None


#: ``Entry.fast`` of a weight no forward calls and the logits do not depend on: zero curvature,
#: no path (method §6.1, "Weights no forward uses").
UNUSED = "unused"

#: The fast kinds of a recurrent cell's two weights (``kernel``, ``recurrent_kernel``): the cell's
#: ``RNN`` layer runs its loop as a recurrence that records each weight's products
#: (:func:`~normflat.backends.keras.calls.recorded_inner_loop`, method §6.1 "Recurrent weights").
RECURRENT_KINDS = ("recurrent_input", "recurrent_state")

#: The fast kinds of a ``SeparableConv1D/2D``'s two weights: its call runs as a depthwise then a
#: pointwise (1×1) convolution, each tapped (:class:`~normflat.backends.keras.ggn.Taps`).
SEPARABLE_KINDS = ("separable_depthwise", "separable_pointwise")


def _base_separable_class() -> type | None:
    """Keras' internal ``BaseSeparableConv`` (``SeparableConv1D/2D``)."""
    try:
        from keras.src.layers.convolutional.base_separable_conv import BaseSeparableConv
    except ImportError:  # pragma: no cover - other Keras layouts: the generic path
        return None
    return BaseSeparableConv


def _reversible_embedding() -> type | None:
    """Keras' ``ReversibleEmbedding`` (keras-hub's is a subclass), ``None`` in Keras versions without it."""
    cls = getattr(keras.layers, "ReversibleEmbedding", None)
    return cls if isinstance(cls, type) else None


#: Why a ``ReversibleEmbedding`` with its own ``reverse_embeddings`` has no tied rule: its two
#: weights take the embedding and dense rules instead (fast kind ``"untied"``).
UNTIED_REASON = "several weight tensors in one layer (an untied reverse_embeddings)"


def tied_reversible_reason(layer: Any) -> str | None:
    """Why a ``ReversibleEmbedding`` has no tied fast rule (``None``: it has one).

    The rule (method §6.1 "Tied weights") needs the layer's own ``call`` as Keras writes it,
    whose two modes read the one table: a lookup, and with ``reverse=True`` the product of
    the input with the table's transpose, nothing else on the way to the output.
    """
    reversible = _reversible_embedding()
    name = type(layer).__name__
    if reversible is None or not isinstance(layer, reversible):
        return f"{name} is not a ReversibleEmbedding"
    if type(layer).call is not reversible.call:
        return f"{name} overrides ReversibleEmbedding's call (no fast rule for its own call)"
    if not getattr(layer, "tie_weights", False):
        return UNTIED_REASON
    if getattr(layer, "logit_soft_cap", None) is not None:
        return ("its reverse projection is soft-capped (logit_soft_cap): the logits are not a product with the "
                "table")
    return None


def _hub_position_embedding() -> type | None:
    """keras-hub's ``PositionEmbedding`` when keras-hub is imported (never imported here)."""
    hub_layers = getattr(sys.modules.get("keras_hub"), "layers", None)
    cls = getattr(hub_layers, "PositionEmbedding", None)
    return cls if isinstance(cls, type) else None


def _base_depthwise_class() -> type | None:
    """Keras' internal ``BaseDepthwiseConv`` (``DepthwiseConv1D/2D``): its ``call`` is tapped as is."""
    try:
        from keras.src.layers.convolutional.base_depthwise_conv import BaseDepthwiseConv
    except ImportError:  # pragma: no cover - other Keras layouts: the generic path
        return None
    return BaseDepthwiseConv


def _own_weights(layer: Any) -> list[Any]:
    """The variables of ``layer`` itself, not of its sub-layers."""
    sub = {id(w) for child in compat.children(layer) for w in child.weights}
    return [w for w in layer.weights if id(w) not in sub]


def _shape(variable: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in variable.shape)


class _Inventory:
    """Every variable of the model, once, with what became of it (method §3, ``ParameterStatus``)."""

    def __init__(self) -> None:
        self.status: dict[int, ParameterStatus] = {}
        self.order: list[int] = []

    def set(self, variable: Any, status: str, reason: str | None = None) -> None:
        key = id(variable)
        if key not in self.status:
            self.order.append(key)
        elif self.status[key].status == "analyzed":
            return  # a shared variable analyzed under its first user stays analyzed
        self.status[key] = ParameterStatus(variable.path, _shape(variable), status, reason)

    def __contains__(self, variable: Any) -> bool:
        return id(variable) in self.status

    def listing(self) -> list[ParameterStatus]:
        return [self.status[k] for k in self.order]


def walk(model: Any, on_unsupported: str,
         select: list[str] | None) -> tuple[list[Entry], list[str], list[ParameterStatus]]:
    """Recognised weights in model order, the messages of the skipped ones, and the parameter inventory.

    A variable used by several layers (a tied embedding) is analyzed once, under its
    first user. Parameters outside every recognised layer are excluded by the engine's
    rule (:func:`~normflat.engine.registry.excluded_reason`: biases, vectors, tokens,
    scales), analyzed as embeddings of the positions when they are learned position
    tables (:func:`~normflat.engine.registry.position_table`), and skipped (warned
    about, by weight name) otherwise.

    Raises:
        ValueError: With ``on_unsupported="error"`` and a skipped weight; for unknown
            names in ``select``; if nothing can be analyzed.
        TypeError: If ``select`` is not a list of names.
    """
    _register_keras_hub()
    entries: list[Entry] = []
    skipped = Skipped(REGISTRY)
    inventory = _Inventory()
    seen: set[int] = set()
    by_variable: dict[int, Entry] = {}  # id of an analyzed variable -> its entry

    def loose(name: str, layer: Any, variables: list[Any]) -> None:
        """Variables of a layer without a registry entry: excluded, position tables, or skipped."""
        unknown = []
        own = _own_weights_of(layer)
        for v in variables:
            if v in inventory:
                continue
            attr = holding_attribute(layer, v)
            layout = own.get(attr)
            weight = _own_weight(v, layout) if layout in ("dense", "depthwise") else None
            if weight is not None:
                entries.append(Entry(name + weight.suffix, layer, weight, None,
                                     f"{type(layer).__name__} applies its own {attr} (no layer to tap)"))
                inventory.set(v, "analyzed")
                continue
            if layout is not None and layout not in ("dense", "depthwise"):
                inventory.set(v, "excluded", layout)
                continue
            # keras-hub's T5 holds its relative-position bias table as `relative_attention_bias`.
            reason = excluded_reason(v.path, _shape(v)) or (relative_bias_table(attr) if attr else None)
            if reason is not None:
                inventory.set(v, "excluded", reason)
            elif position_table(v.path, _shape(v)) is not None:
                features, positions = position_table(v.path, _shape(v))
                # The fast rule replaces the attribute holding the table by the table expanded over
                # the batch (checked on the first forward, method §6.1 "Position tables").
                attr = holding_attribute(layer, v)
                entries.append(Entry(f"{name}/{v.name}", layer, KerasWeight(
                    v, _position_table_canonical(features, positions), "position_table", f"/{v.name}"),
                    "table" if attr else None,
                    None if attr else "a position table not held in one attribute of its layer (no fast rule)",
                    attr=attr))
                inventory.set(v, "analyzed")
            else:
                unknown.append(v)
        if unknown:
            for v in unknown:
                inventory.set(v, "skipped", f"{type(layer).__name__} has no registered extractor")
            paths = [v.path for v in unknown]
            skipped.add(name, layer, f"{type(layer).__name__} has weights {paths} but no registered extractor; "
                                     f"register it with {REGISTRY.hint}")

    def hold_fixed(layer: Any) -> None:
        """Every variable of an ignored layer (normalization, PReLU) not settled yet: excluded."""
        for v in layer.weights:
            if v not in inventory:
                inventory.set(v, "excluded", IGNORED_REASON)

    def visit(layer: Any, prefix: str) -> None:
        for child in compat.children(layer):
            if id(child) in seen:
                continue
            seen.add(id(child))
            name = prefix + child.name
            entry = REGISTRY.lookup(child)
            if entry is IGNORE:
                hold_fixed(child)
                continue
            if isinstance(entry, Unsupported):
                skipped.add(name, child, entry.reason)
                for v in child.weights:
                    if v not in inventory:
                        inventory.set(v, "skipped", entry.reason)
                continue
            # Named so, or held by its parent under that attribute (a layer's name is not its attribute).
            relative = (relative_bias_table(child.name) or relative_bias_table(holding_attribute(layer, child) or "")
                        if isinstance(child, keras.layers.Embedding) else None)
            if entry is not None and relative is not None:  # a table added to the scores (method §3)
                for v in child.weights:
                    if v not in inventory:
                        inventory.set(v, "excluded", relative)
                continue
            if entry is not None and not child.built and not child.weights:
                # Created but never called, so never built (keras-hub EfficientNet's squeeze-excite
                # convolutions of blocks without one): it has no weights, nothing to analyze.
                continue
            if entry is not None:
                try:
                    weights = entry(child)
                except UnsupportedLayer as err:
                    skipped.add(name, child, str(err))
                    for v in child.weights:
                        if v not in inventory:
                            inventory.set(v, "skipped", str(err))
                    continue
                kind = fast_kind(child)
                fast = kind if len(weights) == 1 else None
                separable = kind == "separable" and len(weights) == 2
                recurrent = kind == "recurrent" and len(weights) == 2
                untied = kind == "untied" and len(weights) == 2
                lora = kind in LORA_BASE_KINDS and is_lora(child) and len(weights) == 3
                reversible = _reversible_embedding()
                reason = None if fast or separable or recurrent or untied or lora else (
                    LORA_REASON if is_lora(child) else
                    "several weight tensors in one layer" if kind else
                    tied_reversible_reason(child) if reversible is not None and isinstance(child, reversible) else
                    f"{type(child).__name__}: keras-hub experts (every expert on every token) have no fast rule"
                    if weights and all(w.kind == "expert" for w in weights) else
                    f"{type(child).__name__} has no fast path (not Keras' own Dense/Conv call)")
                for j, w in enumerate(weights):
                    if separable:
                        fast = SEPARABLE_KINDS[j]  # the depthwise kernel, then the pointwise one
                    elif recurrent:
                        fast = RECURRENT_KINDS[j]  # the kernel, then the recurrent kernel
                    elif untied:
                        fast = ("embedding", "dense")[j]  # the table, then the reverse projection
                    elif lora:
                        fast = (kind, *LORA_KINDS)[j]  # the frozen kernel, then A and B
                    first = by_variable.get(id(w.variable))
                    if first is not None:  # shared with an earlier layer: analyzed there, as torch does
                        first.shared_with.append(name + w.suffix)
                        if first.fast is not None:
                            # Each fast rule sees its own layer's use only (the first forward's check
                            # would find the other one too); the generic path sums every use.
                            first.fast, first.reason = None, "weight shared between layers"
                        continue
                    if w.variable in inventory:  # already settled as excluded or skipped
                        continue
                    entries.append(Entry(name + w.suffix, child, w, fast, reason))
                    by_variable[id(w.variable)] = entries[-1]
                    inventory.set(w.variable, "analyzed")
                # The normalization layers inside it (DeBERTa's relative table's LayerNormalization):
                # excluded as such, as on every backend.
                for inner in compat.flatten_layers(child):
                    if REGISTRY.lookup(inner) is IGNORE:
                        hold_fixed(inner)
                for v in child.weights:  # its other weights: biases by definition, or skipped
                    if v not in inventory:
                        reason_v = excluded_reason(v.path, _shape(v))
                        if reason_v is not None:
                            inventory.set(v, "excluded", reason_v)
                        else:
                            inventory.set(v, "skipped", f"not among the weights the {type(child).__name__} "
                                                        "extractor reports")
                continue
            if compat.children(child):
                visit(child, name + "/")
            loose(name, child, _own_weights(child))

    visit(model, "")
    loose(model.name, model, [v for v in model.weights if v not in inventory])
    unsupported = skipped.report(on_unsupported)
    if select is not None:
        if isinstance(select, str) or not all(isinstance(s, str) for s in select):
            raise TypeError("layers must be a list of layer names (str).")
        known = [e.name for e in entries]
        unknown = [s for s in select if s not in known]
        if unknown:
            raise ValueError(f"Unknown layer name(s) {unknown}; this model's analyzable layers are {known}.")
        chosen = set(select)
        for e in entries:
            if e.name not in chosen:
                inventory.status[id(e.variable)] = ParameterStatus(
                    e.variable.path, _shape(e.variable), "skipped", "not selected (layers=...)")
        entries = [e for e in entries if e.name in chosen]
    if not entries:
        raise ValueError(
            "The model has no layer normflat can analyze (Dense, EinsumDense, MultiHeadAttention, Embedding, "
            "LSTM/GRU/SimpleRNN, Conv1D/2D/3D, Conv1D/2D/3DTranspose, DepthwiseConv, SeparableConv, or classes "
            "added with register_layer)."
        )
    return entries, unsupported, inventory.listing()


def _position_table_canonical(features: int, positions: int) -> Callable[[Any], Any]:
    """A loose position table (``(1, N, d)``, ``(N, d)``, ...) as its ``(features, positions)`` matrix."""
    return lambda t: tf.transpose(tf.reshape(t, [positions, features]))
