"""Keras 3 / TensorFlow backend: Hessian and GGN diagonals of Keras models (SPEC §3, §6, §7).

The model is only read: every estimator differentiates with respect to the
model's own kernel variables through ``tf.GradientTape`` and never assigns
them. For the fast GGN path the backend temporarily wraps the ``call`` and
``activation`` attributes of recognised ``Dense``/``Conv`` instances to see
each layer's input and pre-activation; the original attributes are restored
before returning, also after an error.

Backend options (keyword arguments of ``normflat.analyze``):

``batch_size`` (int, default 128)
    Batch size when ``data`` is an ``(x, y)`` pair of arrays.
``layers`` (list of str, default all)
    Analyze only these layers (names as reported).
``chunk_size`` (int, default automatic)
    Samples per compiled GGN step; lower it if memory runs out.
``memory_budget`` (int bytes or str such as ``"512MB"``/``"2GiB"``, default None)
    Bounds the estimated memory of the per-sample work of one GGN step (the
    back-propagated signals and per-sample gradients of a chunk); the chunk
    size is the largest that fits (see :mod:`normflat.core.memory`). A
    ``ValueError`` names the need when even one sample does not fit. Fixed
    costs (weights, the compiled graph, the input batch) are not counted.
    Exclusive with ``chunk_size``; with a strategy it applies per replica.
    Used by ``ggn`` and ``ggn-mc``; ``exact`` and ``hutchinson`` process their
    probes in fixed blocks.
``distributed`` (bool or None, default None = automatic)
    A model built under a ``tf.distribute.MirroredStrategy`` or
    ``MultiWorkerMirroredStrategy`` scope (or analyzed inside one) is analyzed
    with the strategy's replicas: batches are dealt round-robin to the
    replicas of all workers (every worker passes the same full data), each
    replica sums over its batches, and the per-layer sums and sample counts
    are added with ``strategy.reduce(SUM)``. The result equals the
    single-device one up to rounding. ``False`` analyzes on one device;
    ``True`` requires a strategy.
``max_exact_params`` (int, default 20000) and ``force`` (bool, default False)
    ``estimator="exact"`` needs one Hessian-vector product per weight and
    refuses models with more analyzed weights than ``max_exact_params``
    unless ``force=True``.
``fast`` (bool, default True)
    ``False`` sends every layer through the generic per-sample Jacobian GGN
    path (slower; for cross-checks).
"""

from __future__ import annotations

import itertools
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

import keras

try:
    import tensorflow as tf
except ImportError as _err:  # Keras on JAX/torch without TensorFlow installed
    raise ImportError(
        "normflat's Keras support needs TensorFlow: it analyzes Keras 3 models on Keras' 'tensorflow' "
        "backend. Install tensorflow and set KERAS_BACKEND=tensorflow before importing keras."
    ) from _err

from normflat.core.memory import chunk_size_for, parse_memory_budget
from normflat.core.options import NSCE_EPS, AnalysisOptions, limited, progress_bar
from normflat.core.problem import LayerProblem

__all__ = [
    "KerasWeight",
    "register_layer",
    "registered_layers",
    "layer_problems",
    "hessian_diagonal",
]

_DEFAULT_BATCH_SIZE = 128
_DEFAULT_EXACT_MAX_PARAMS = 20_000
#: Budget of one GGN chunk's largest intermediate (bytes); sets the default chunk size.
_CHUNK_BYTES = 2**28
#: Layers with parameters that never enter the measures (SPEC §9: normalization parameters).
_PARAMETER_LAYERS_IGNORED = (
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "RMSNormalization",
    "UnitNormalization",
    "Normalization",
)
_BACKEND_OPTIONS = ("batch_size", "layers", "chunk_size", "memory_budget", "max_exact_params", "force", "fast",
                    "distributed")


# ----------------------------------------------------------------------------- layer registry


@dataclass(frozen=True)
class KerasWeight:
    """One weight tensor of a Keras layer, as an extractor reports it.

    Attributes:
        variable: The layer's Keras variable holding the weight.
        to_canonical: Maps a tensor in the variable's layout to the canonical
            ``(out, in, *kernel)`` layout (used for the weight and its diagonal).
        kind: Short layer label for reports (``"dense"``, ``"conv2d"``, ...).
        suffix: Appended to the layer name (``"/pointwise"``) when a layer has
            several weight tensors; empty for one.
    """

    variable: Any
    to_canonical: Callable[[Any], Any]
    kind: str
    suffix: str = ""


_REGISTRY: dict[type, Callable[[Any], list[KerasWeight]]] = {}


def register_layer(layer_class: type, extractor: Callable[[Any], list[KerasWeight]]) -> None:
    """Register how to read the weight matrices of a Keras layer class.

    Registered layers are analyzed with the generic (per-sample Jacobian) GGN
    path; the built-in ``Dense`` and ``Conv1D/2D/3D`` have a faster one.

    Args:
        layer_class: A ``keras.layers.Layer`` subclass; subclasses of it match too
            unless they are registered themselves.
        extractor: ``extractor(layer) -> [KerasWeight, ...]``.

    Example:
        >>> register_layer(MyDense, lambda layer: [
        ...     KerasWeight(layer.w, lambda t: tf.transpose(t), "dense")])
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"register_layer needs a keras.layers.Layer subclass, got {layer_class!r}.")
    if not callable(extractor):
        raise TypeError("register_layer needs a callable extractor(layer) -> list[KerasWeight].")
    _REGISTRY[layer_class] = extractor


def registered_layers() -> dict[type, Callable[[Any], list[KerasWeight]]]:
    """A copy of the layer registry ``{layer class: extractor}``."""
    return dict(_REGISTRY)


def _extractor_for(layer: Any) -> Callable[[Any], list[KerasWeight]] | None:
    for cls in type(layer).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return None


def _transpose_fn(perm: tuple[int, ...]) -> Callable[[Any], Any]:
    return lambda t: tf.transpose(t, perm)


def _dense_weights(layer: Any) -> list[KerasWeight]:
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise _Unsupported("LoRA-enabled or quantized Dense layers are not supported")
    return [KerasWeight(layer._kernel if hasattr(layer, "_kernel") else layer.kernel, _transpose_fn((1, 0)), "dense")]


def _conv_weights(layer: Any) -> list[KerasWeight]:
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise _Unsupported("LoRA-enabled or quantized convolutions are not supported")
    r = layer.rank
    # (*k, in/groups, out) -> (out, in/groups, *k)
    return [KerasWeight(layer.kernel, _transpose_fn((r + 1, r) + tuple(range(r))), f"conv{r}d")]


def _depthwise_canonical(rank: int) -> Callable[[Any], Any]:
    # (*k, in, m) -> (in * m, 1, *k): output channel i*m + j reads input channel i only.
    def convert(t):
        t = tf.transpose(t, (rank, rank + 1) + tuple(range(rank)))
        shape = tf.shape(t)
        return tf.reshape(t, tf.concat([[shape[0] * shape[1], 1], shape[2:]], 0))

    return convert


def _depthwise_weights(layer: Any) -> list[KerasWeight]:
    return [KerasWeight(layer.kernel, _depthwise_canonical(layer.rank), f"depthwise_conv{layer.rank}d")]


def _separable_weights(layer: Any) -> list[KerasWeight]:
    r = layer.rank
    return [
        KerasWeight(layer.depthwise_kernel, _depthwise_canonical(r), f"depthwise_conv{r}d", "/depthwise"),
        KerasWeight(layer.pointwise_kernel, _transpose_fn((r + 1, r) + tuple(range(r))), f"conv{r}d", "/pointwise"),
    ]


class _Unsupported(Exception):
    """An extractor's way of saying: this instance cannot be analyzed (reason)."""


register_layer(keras.layers.Dense, _dense_weights)
for _cls in (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D):
    register_layer(_cls, _conv_weights)
for _name in ("DepthwiseConv1D", "DepthwiseConv2D"):
    if hasattr(keras.layers, _name):
        register_layer(getattr(keras.layers, _name), _depthwise_weights)
for _name in ("SeparableConv1D", "SeparableConv2D"):
    if hasattr(keras.layers, _name):
        register_layer(getattr(keras.layers, _name), _separable_weights)


# ----------------------------------------------------------------------------- model walk


@dataclass
class _Entry:
    name: str
    layer: Any
    weight: KerasWeight
    fast: str | None = None  # "dense" | "conv" | None (generic path)
    input_rank: int | None = None  # rank of the tapped input, seen by the probe
    in_size: int = 0  # per-sample elements of the tapped input (memory estimate)
    pre_size: int = 0  # per-sample elements of the tapped pre-activation (memory estimate)

    @property
    def variable(self):
        return self.weight.variable


def _fast_kind(layer: Any) -> str | None:
    """Whether a layer's pre-activation and input can be tapped (its call is Keras' own)."""
    cls = type(layer)
    if isinstance(layer, keras.layers.Dense) and cls.call is keras.layers.Dense.call:
        return "dense"
    try:
        from keras.src.layers.convolutional.base_conv import BaseConv
    except ImportError:  # another Keras layout: convolutions take the generic path
        return None
    if (
        isinstance(layer, BaseConv)
        and isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D))
        and cls.call in (BaseConv.call, keras.layers.Conv1D.call)
        and cls.convolution_op is BaseConv.convolution_op
    ):
        return "conv"
    return None


def _children(layer: Any) -> list[Any]:
    return [child for child in getattr(layer, "_layers", []) if isinstance(child, keras.layers.Layer)]


def _walk(model: Any, options: AnalysisOptions, select: list[str] | None) -> tuple[list[_Entry], list[str]]:
    """Recognised weight layers in model order, and the unsupported layers."""
    entries: list[_Entry] = []
    unsupported: list[str] = []
    seen: set[int] = set()

    def visit(layer: Any, prefix: str) -> None:
        for child in _children(layer):
            if id(child) in seen:
                continue
            seen.add(id(child))
            name = prefix + child.name
            extractor = _extractor_for(child)
            if extractor is not None:
                try:
                    weights = extractor(child)
                except _Unsupported as err:
                    unsupported.append(f"{name} ({type(child).__name__}: {err})")
                    continue
                fast = _fast_kind(child) if len(weights) == 1 else None
                for w in weights:
                    entries.append(_Entry(name + w.suffix, child, w, fast))
            elif _children(child):
                visit(child, name + "/")
                own = _own_weights(child)
                if own:
                    unsupported.append(f"{name} ({type(child).__name__}: own weights {own})")
            elif child.weights and type(child).__name__ not in _PARAMETER_LAYERS_IGNORED:
                unsupported.append(f"{name} ({type(child).__name__})")

    visit(model, "")
    if unsupported:
        message = (
            "normflat skips layers with parameters it does not recognise: "
            + ", ".join(unsupported)
            + ". Register them with normflat.backends.keras.register_layer(cls, extractor), or pass "
            "on_unsupported='skip' to silence this."
        )
        if options.on_unsupported == "error":
            raise ValueError(message.replace("normflat skips", "normflat cannot analyze"))
        if options.on_unsupported == "warn":
            warnings.warn(message, UserWarning, stacklevel=4)
    if select is not None:
        if isinstance(select, str) or not all(isinstance(s, str) for s in select):
            raise TypeError("layers must be a list of layer names (str).")
        known = [e.name for e in entries]
        unknown = [s for s in select if s not in known]
        if unknown:
            raise ValueError(
                f"Unknown layer name(s) {unknown}; this model's analyzable layers are {known}."
            )
        entries = [e for e in entries if e.name in set(select)]
    if not entries:
        raise ValueError(
            "The model has no layer normflat can analyze (Dense, Conv1D/2D/3D, DepthwiseConv, "
            "SeparableConv, or classes added with register_layer)."
        )
    return entries, unsupported


def _own_weights(layer: Any) -> list[str]:
    sub = {id(w) for child in _children(layer) for w in child.weights}
    return [w.path for w in layer.weights if id(w) not in sub]


# ----------------------------------------------------------------------------- patching


class _Taps:
    """Temporarily wraps layer attributes to record inputs and pre-activations.

    ``records[name]`` collects ``(input, pre_activation)`` per call of a tapped
    layer during a forward pass; ``strip`` makes a final softmax the identity.
    """

    def __init__(self, tapped: list[_Entry], strip: Any | None, grouped: list[Any] = ()):
        self.tapped = tapped
        self.grouped = list(grouped)
        self.strip = strip
        self.records: dict[str, list] = {}
        self.tape: tf.GradientTape | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    def _set(self, obj: Any, attr: str, value: Any) -> None:
        self._saved.append((obj, attr, obj.__dict__.get(attr, _MISSING)))
        # object.__setattr__: bypass Keras' attribute tracking, which would record the wrapper.
        object.__setattr__(obj, attr, value)

    def __enter__(self) -> "_Taps":
        try:
            self._fix_moments()
            if self.strip is not None:
                layer, attr = self.strip
                if attr == "activation":
                    self._set(layer, "activation", keras.activations.linear)
                else:
                    self._set(layer, "call", lambda inputs, *a, **k: inputs)
            for layer in self.grouped:
                self._set(layer, "call", _grouped_conv_call(layer))
            for entry in self.tapped:
                self._tap(entry)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _fix_moments(self) -> None:
        # tf.nn.moments, which Keras' TF backend uses for LayerNormalization and
        # GroupNormalization, stops the gradient of the mean inside the variance. First
        # derivatives are unaffected, second derivatives (exact, hutchinson) are wrong.
        # Swap in the plain formula while analyzing.
        try:
            from keras.src.backend.tensorflow import nn as tf_nn
        except ImportError:  # pragma: no cover - other Keras layouts
            return
        if getattr(tf_nn, "_compute_moments", None) is not None:
            self._saved.append((tf_nn, "_compute_moments", tf_nn.__dict__["_compute_moments"]))
            tf_nn._compute_moments = _moments_twice_differentiable

    def _tap(self, entry: _Entry) -> None:
        layer, name = entry.layer, entry.name
        original_call = layer.call  # bound method (or the instance attribute)
        original_activation = layer.activation

        def call(inputs, *args, **kwargs):
            self.records.setdefault(name, []).append([inputs, None])
            return original_call(inputs, *args, **kwargs)

        def activation(y):
            if self.tape is not None:
                self.tape.watch(y)
            record = self.records.get(name)
            if record and record[-1][1] is None:
                record[-1][1] = y
            return original_activation(y)

        self._set(layer, "call", call)
        self._set(layer, "activation", activation)

    def __exit__(self, *exc: Any) -> None:
        for obj, attr, old in reversed(self._saved):
            if isinstance(obj, type(math)):
                setattr(obj, attr, old)
            elif old is _MISSING:
                obj.__dict__.pop(attr, None)
            else:
                object.__setattr__(obj, attr, old)
        self._saved.clear()


_MISSING = object()


def _grouped_conv_call(layer: Any) -> Callable[..., Any]:
    """A call of a grouped convolution as one convolution per group.

    TensorFlow has no CPU kernel for the derivatives of grouped convolutions
    (``Conv2DBackpropInput`` with groups); per-group convolutions compute the
    same function and are differentiable to any order everywhere.
    """
    from keras import ops

    groups = layer.groups
    channel_axis = -1 if layer.data_format == "channels_last" else 1

    def call(inputs, *args, **kwargs):
        padding = layer.padding
        if padding == "causal":
            inputs = ops.pad(inputs, layer._compute_causal_padding())
            padding = "valid"
        xs = ops.split(inputs, groups, axis=channel_axis)
        ks = ops.split(layer.kernel, groups, axis=-1)
        outputs = ops.concatenate(
            [ops.conv(x, k, strides=list(layer.strides), padding=padding, dilation_rate=layer.dilation_rate,
                      data_format=layer.data_format) for x, k in zip(xs, ks)],
            axis=channel_axis,
        )
        if layer.use_bias:
            shape = [1] * len(outputs.shape)
            shape[channel_axis] = layer.filters
            outputs = ops.add(outputs, ops.reshape(layer.bias, shape))
        return layer.activation(outputs) if layer.activation is not None else outputs

    return call


def _moments_twice_differentiable(x: Any, axes: Any, keepdims: bool) -> tuple[Any, Any]:
    mean = tf.reduce_mean(x, axis=axes, keepdims=True)
    variance = tf.reduce_mean(tf.math.squared_difference(x, mean), axis=axes, keepdims=True)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


def _final_softmax(model: Any) -> tuple[Any, str] | None:
    """The (layer, attribute) applying a final softmax of a Sequential/functional model."""
    try:
        from keras.src.models.functional import Functional
    except ImportError:  # another Keras layout: only Sequential models are inspected
        Functional = keras.Sequential

    layer = model
    for _ in range(16):
        if isinstance(layer, keras.Sequential):
            inner = [l for l in layer.layers]
            if not inner:
                return None
            layer = inner[-1]
        elif isinstance(layer, Functional) and layer.outputs:
            if len(layer.outputs) != 1:
                return None
            layer = layer.outputs[0]._keras_history[0]
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


def _is_softmax(fn: Any) -> bool:
    return fn is keras.activations.softmax or getattr(fn, "__name__", "") == "softmax"


# ----------------------------------------------------------------------------- data


def _batches(data: Any, batch_size: int) -> tuple[Iterable, int | None]:
    """An iterable of ``(x, y)`` batches and its length when known."""
    if isinstance(data, (tf.distribute.DistributedDataset, tf.distribute.DistributedIterator)):
        raise TypeError(
            "data is a distributed dataset (strategy.experimental_distribute_dataset); pass the plain "
            "tf.data.Dataset instead: normflat deals its batches to the strategy's replicas itself."
        )
    if isinstance(data, tf.data.Dataset):
        card = int(data.cardinality())
        return data, card if card >= 0 else None
    if isinstance(data, (tuple, list)) and len(data) == 2 and _is_array(data[1]) and _is_inputs(data[0]):
        x, y = data
        n = int(y.shape[0])
        for leaf in tf.nest.flatten(x):
            if int(leaf.shape[0]) != n:
                raise ValueError(f"x has {leaf.shape[0]} samples but y has {n}; they must match.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
        if n <= batch_size:  # one batch: no slicing (it costs more than a small model's step)
            return [(x, y)], 1
        slices = [(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
        return ((_take(x, a, b), y[a:b]) for a, b in slices), len(slices)
    if isinstance(data, dict) or not hasattr(data, "__iter__"):
        raise TypeError(
            f"data of type {type(data).__name__} is not supported; pass a tf.data.Dataset of (x, y) "
            "batches, an (x, y) pair of arrays (with batch_size=...), or an iterable of (x, y) batches."
        )
    try:
        length = len(data)
    except TypeError:
        length = None
    return data, length


def _is_array(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and len(a.shape) >= 1


def _is_inputs(x: Any) -> bool:
    """An array, or a dict/list/tuple of arrays (multi-input models)."""
    if isinstance(x, dict):
        return bool(x) and all(_is_array(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return bool(x) and all(_is_array(v) for v in x)
    return _is_array(x)


def _take(x: Any, a: int, b: int) -> Any:
    return tf.nest.map_structure(lambda t: t[a:b], x)


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, dict) or not isinstance(batch, (tuple, list)) or len(batch) != 2:
        extra = ""
        if isinstance(batch, (tuple, list)) and len(batch) == 3:
            extra = " Sample weights (x, y, w) are not supported: the Hessian is that of the plain mean loss."
        raise ValueError(
            f"Each batch must be an (x, y) pair; got {type(batch).__name__}"
            f"{' of length ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}.{extra}"
        )
    return batch[0], batch[1]


def _to_tensor(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _to_tensor(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_tensor(v) for v in x)
    return tf.convert_to_tensor(x)


def _check_finite_inputs(x: Any, batch_index: int) -> None:
    for leaf in tf.nest.flatten(x):
        if leaf.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(leaf))):
            raise ValueError(
                f"Batch {batch_index} contains NaN or infinite inputs; clean the data before analyzing."
            )


def _targets(y: Any, num_classes: int, dtype: Any, batch_index: int) -> Any:
    """Integer class ids or one-hot/probability rows -> (n, C) probability rows."""
    y_np = np.asarray(y.numpy() if hasattr(y, "numpy") else y)
    if y_np.ndim == 2 and y_np.shape[1] == 1 and num_classes > 1:
        y_np = y_np[:, 0]
    if y_np.ndim == 1:
        if np.issubdtype(y_np.dtype, np.floating):
            if not np.all(np.isfinite(y_np)):
                raise ValueError(f"Batch {batch_index} has NaN or infinite labels.")
            if not np.all(y_np == np.round(y_np)):
                raise ValueError(
                    f"Batch {batch_index}: 1-D labels must be integer class ids, got non-integer values."
                )
        elif not np.issubdtype(y_np.dtype, np.integer):
            raise ValueError(f"Batch {batch_index}: labels of dtype {y_np.dtype} are not class ids.")
        ids = y_np.astype(np.int64)
        bad = ids[(ids < 0) | (ids >= num_classes)]
        if bad.size:
            raise ValueError(
                f"Batch {batch_index} has label {int(bad[0])} out of range: the model has "
                f"{num_classes} outputs, so class ids must be in [0, {num_classes - 1}]."
            )
        return tf.one_hot(ids, num_classes, dtype=dtype)
    if y_np.ndim == 2 and y_np.shape[1] == num_classes:
        if not np.all(np.isfinite(y_np)):
            raise ValueError(f"Batch {batch_index} has NaN or infinite labels.")
        if np.any(y_np < 0) or not np.allclose(y_np.sum(axis=1), 1.0, atol=1e-5):
            raise ValueError(
                f"Batch {batch_index}: 2-D labels must be one-hot (or probability) rows summing to 1."
            )
        return tf.convert_to_tensor(y_np, dtype=dtype)
    raise ValueError(
        f"Batch {batch_index}: labels of shape {y_np.shape} do not fit a model with {num_classes} "
        "outputs; pass integer class ids (n,) or one-hot rows (n, classes)."
    )


# ----------------------------------------------------------------------------- losses


def _output_transform(z: Any, options: AnalysisOptions) -> Any:
    """The logits the softmax cross-entropy sees: ``z`` (ce) or ``τ ẑ`` (nsce, SPEC §7)."""
    if options.loss == "nsce":
        zc = z - tf.reduce_mean(z, axis=-1, keepdims=True)
        scale = tf.sqrt(tf.reduce_mean(tf.square(zc), axis=-1, keepdims=True) + tf.cast(NSCE_EPS, z.dtype))
        return tf.cast(options.temperature, z.dtype) * zc / scale
    return z


def _mean_loss(z: Any, target: Any, options: AnalysisOptions) -> Any:
    if callable(options.loss):
        return options.loss(z, target)
    u = _output_transform(z, options)
    return -tf.reduce_mean(tf.reduce_sum(target * tf.nn.log_softmax(u, axis=-1), axis=-1))


# ----------------------------------------------------------------------------- the analysis


@dataclass
class _Run:
    """State of one analysis: the model, its layers, the options."""

    model: Any
    options: AnalysisOptions
    entries: list[_Entry]
    batch_size: int
    chunk_size: int | None
    exact_max_params: float
    strip: Any = None
    num_classes: int = 0
    dtype: Any = None
    out_dtype: Any = None
    checked: bool = True
    grouped: list = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    memory_budget: int | None = None
    input_size: int = 0  # per-sample input elements, seen by the probe
    dist: "_Dist | None" = None


def _prepare(
    model: Any, data: Any, options: AnalysisOptions, backend_options: dict
) -> tuple[_Run, Iterable, int | None]:
    unknown = sorted(set(backend_options) - set(_BACKEND_OPTIONS))
    if unknown:
        raise TypeError(
            f"Unknown Keras backend option(s) {unknown}; the Keras backend accepts {list(_BACKEND_OPTIONS)}."
        )
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"The Keras backend needs a Keras 3 model (keras.Model / keras.layers.Layer), got "
            f"{type(model).__name__}. tf.keras (Keras 2) models are not supported; build the model with "
            "Keras 3."
        )
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"This Keras model runs on Keras' {keras.backend.backend()!r} backend; normflat's Keras support "
            "needs the 'tensorflow' backend. Set the environment variable KERAS_BACKEND=tensorflow before "
            "importing keras (for JAX models, pass an equinox/flax model or an (apply_fn, params) pair)."
        )
    if not model.built:
        raise ValueError(
            f"The Keras model {model.name!r} is not built (it has no weights yet). Call it on a batch "
            "(model(x)) or call model.build(input_shape) before analyzing it."
        )
    chunk_size = backend_options.get("chunk_size")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    memory_budget = parse_memory_budget(backend_options.get("memory_budget"))
    if memory_budget is not None and chunk_size is not None:
        raise ValueError(
            "Pass either chunk_size (samples per step) or memory_budget (the chunk size is then chosen "
            "from it), not both."
        )
    distributed = backend_options.get("distributed")
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True, False or None (automatic), got {distributed!r}.")
    exact_max = backend_options.get("max_exact_params", _DEFAULT_EXACT_MAX_PARAMS)
    if isinstance(exact_max, bool) or not isinstance(exact_max, int) or exact_max < 1:
        raise ValueError(f"max_exact_params must be a positive int, got {exact_max!r}.")
    if backend_options.get("force", False):
        exact_max = math.inf
    entries, unsupported = _walk(model, options, backend_options.get("layers"))
    if not backend_options.get("fast", True):
        for entry in entries:
            entry.fast = None
    run = _Run(model, options, entries, backend_options.get("batch_size", _DEFAULT_BATCH_SIZE), chunk_size,
               exact_max)
    run.memory_budget = memory_budget
    run.dist = _Dist.detect(model, distributed)
    if not callable(options.loss):
        run.strip = _final_softmax(model)
    run.grouped = [l for l in model._flatten_layers(include_self=False)
                   if isinstance(l, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D))
                   and getattr(l, "groups", 1) > 1 and _fast_kind(l)]
    batches, length = _batches(data, run.batch_size)
    if options.max_batches is not None and length is not None:
        length = min(length, options.max_batches)
    run.dtype = tf.as_dtype(entries[0].variable.dtype)
    run.metadata = {
        "keras_version": keras.__version__,
        "tensorflow_version": tf.__version__,
        "dtype": run.dtype.name,
        "device": str(entries[0].variable.value.device) or "cpu",
        "unsupported": unsupported,
    }
    if run.strip is not None:
        run.metadata["stripped_softmax"] = run.strip[0].name
    if memory_budget is not None:
        run.metadata["memory_budget"] = memory_budget
    if run.dist is not None:
        run.metadata.update(run.dist.describe())
    return run, batches, length


def _iterate(run: _Run, batches: Iterable, length: int | None, owned: Callable[[int], bool] | None = None):
    """Yield ``(x, target, n)`` tensors, validating each batch.

    With ``owned``, yield ``(x, target, n, k)`` only for the non-empty batches
    ``k`` (counted from 0) that ``owned(k)`` accepts; the others are skipped
    unconverted (another replica validates them). The first non-empty batch is
    always probed, so every worker knows the output shape.
    """
    desc = f"normflat {run.options.estimator}"
    count = 0
    for index, batch in enumerate(progress_bar(limited(batches, run.options.max_batches),
                                               enabled=run.options.progress, desc=desc, total=length)):
        x, y = _split_batch(batch)
        if owned is not None:
            n = int(y.shape[0]) if hasattr(y, "shape") else len(y)
            if n == 0:
                continue
            if not owned(count):
                if count == 0:
                    _probe(run, _to_tensor(x))
                count += 1
                continue
        x = _to_tensor(x)
        _check_finite_inputs(x, index)
        n = int(y.shape[0]) if hasattr(y, "shape") else len(y)
        if n == 0:
            continue
        if count == 0:
            _probe(run, x)
        if callable(run.options.loss):
            target = _to_tensor(y)
        else:
            target = _targets(y, run.num_classes, run.out_dtype, index)
        count += 1
        yield (x, target, n) if owned is None else (x, target, n, count - 1)
    if count == 0:
        raise ValueError("The data is empty: it yielded no (x, y) batch with samples.")


def _probe(run: _Run, x: Any) -> None:
    """One eager forward on the first batch: output shape, softmax check, tap counts.

    For the GGN the result is cached per model and input signature (an eager
    Keras forward costs as much as a compiled GGN step of a small model); the
    compiled step then repeats the logits checks on the first chunk.
    """
    signature = tuple((tuple(t.shape[1:]), t.dtype.name) for t in tf.nest.flatten(x))
    key = (signature, tuple((e.name, id(e.variable.value), e.fast) for e in run.entries),
           None if run.strip is None else id(run.strip[0]), tuple(id(l) for l in run.grouped),
           callable(run.options.loss))
    cacheable = run.options.estimator in ("ggn", "ggn-mc")
    try:
        cache = _PROBES.setdefault(run.model, {})
    except TypeError:
        cache, cacheable = {}, False
    if cacheable and key in cache:
        run.num_classes, run.out_dtype, run.input_size, fast = cache[key]
        for entry, (f, rank, in_size, pre_size) in zip(run.entries, fast):
            entry.fast, entry.input_rank, entry.in_size, entry.pre_size = f, rank, in_size, pre_size
        run.checked = False
        return
    _probe_eager(run, x)
    run.checked = True
    if cacheable:
        cache[key] = (run.num_classes, run.out_dtype, run.input_size,
                      [(e.fast, e.input_rank, e.in_size, e.pre_size) for e in run.entries])


_PROBES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _check_logits(run: _Run, finite: bool, probabilities: bool) -> None:
    if not finite:
        raise ValueError(
            "The model's logits contain NaN or infinite values on the first batch; check the weights."
        )
    if probabilities and not callable(run.options.loss):
        raise ValueError(
            "The model seems to output probabilities (non-negative rows summing to 1), but the "
            f"loss {run.options.loss!r} expects logits. Remove the final softmax from the model (a "
            "final softmax activation of a Sequential/functional model is removed automatically)."
        )


def _looks_like_probabilities(z: Any) -> Any:
    return tf.logical_and(tf.reduce_all(z >= 0),
                          tf.reduce_all(tf.abs(tf.reduce_sum(z, axis=-1) - 1) <= 1e-6))


def _probe_eager(run: _Run, x: Any) -> None:
    first = tf.nest.map_structure(lambda t: t[:2], x)
    with _Taps([e for e in run.entries if e.fast], run.strip, run.grouped) as taps:
        z = run.model(first, training=False)
    if isinstance(z, (list, tuple, dict)) or len(z.shape) != 2:
        shape = getattr(z, "shape", type(z).__name__)
        raise ValueError(
            f"The model's output has shape {shape}; normflat needs one (batch, classes) logits tensor."
        )
    run.num_classes = int(z.shape[-1])
    run.out_dtype = z.dtype
    if run.num_classes < 2 and not callable(run.options.loss):
        raise ValueError("The model has a single output; the built-in losses need at least 2 classes.")
    _check_logits(run, bool(tf.reduce_all(tf.math.is_finite(z))), bool(_looks_like_probabilities(z)))
    for entry in run.entries:
        if entry.fast:
            recs = taps.records.get(entry.name, [])
            if len(recs) != 1 or recs[0][1] is None:
                entry.fast = None  # shared or bypassed layer: per-sample Jacobian path
            else:
                entry.input_rank = len(recs[0][0].shape)
                entry.in_size = _per_sample_elements(recs[0][0])
                entry.pre_size = _per_sample_elements(recs[0][1])
    run.input_size = sum(_per_sample_elements(t) for t in tf.nest.flatten(first))


def _per_sample_elements(t: Any) -> int:
    return int(np.prod([int(d) for d in t.shape[1:]], dtype=np.int64))


def _layer_weights_canonical(run: _Run) -> list[np.ndarray]:
    return [np.asarray(e.weight.to_canonical(tf.convert_to_tensor(e.variable.value)).numpy(), dtype=np.float64)
            for e in run.entries]


def _estimate(run: _Run, batches: Iterable, length: int | None) -> tuple[list[Any], list[Any] | None, int, int]:
    """Per-layer diagonals (float64, canonical) and optional (K, ...) group estimates."""
    est = run.options.estimator
    if est in ("ggn", "ggn-mc"):
        return _ggn(run, batches, length) if run.dist is None else _ggn_distributed(run, batches, length)
    return _hvp_estimators(run, batches, length)


def _groups(run: _Run) -> int:
    samples = run.options.samples or 1
    return min(samples, 10) if samples >= 2 else 1


# ----------------------------------------------------------------------------- GGN


def _same_padding(size: int, k: int, s: int, d: int) -> tuple[int, int]:
    total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
    return total // 2, total - total // 2


def _patches(x: Any, layer: Any) -> Any:
    """Channels-last input -> (n, positions, kernel offsets, in) windows matching the convolution."""
    r = layer.rank
    k, s, d = tuple(layer.kernel_size), tuple(layer.strides), tuple(layer.dilation_rate)
    spatial = [int(v) for v in x.shape[1:-1]]
    pads = []
    for i in range(r):
        if layer.padding == "same":
            pads.append(list(_same_padding(spatial[i], k[i], s[i], d[i])))
        elif layer.padding == "causal":
            pads.append([(k[i] - 1) * d[i], 0])
        else:
            pads.append([0, 0])
    if any(p != [0, 0] for p in pads):
        x = tf.pad(x, [[0, 0]] + pads + [[0, 0]])
    padded = [spatial[i] + sum(pads[i]) for i in range(r)]
    outs = [(padded[i] - (k[i] - 1) * d[i] - 1) // s[i] + 1 for i in range(r)]
    windows = []
    for offset in itertools.product(*[range(ki) for ki in k]):
        index = [slice(None)]
        for i in range(r):
            start = offset[i] * d[i]
            index.append(slice(start, start + (outs[i] - 1) * s[i] + 1, s[i]))
        index.append(slice(None))
        windows.append(x[tuple(index)])
    stacked = tf.stack(windows, axis=-2)  # (n, *outs, koff, in)
    return tf.reshape(stacked, [tf.shape(x)[0], math.prod(outs), len(windows), int(x.shape[-1])])


def _per_sample_squares(a: Any, g: Any, seg: Any, groups: int) -> Any:
    """``Σ_n (per-sample gradient)²`` per signal group, with per-sample gradients as batched matmuls.

    ``a``: (n, T, K) layer inputs (patches); ``g``: (n, T, B, O) signals. The
    per-sample gradient of signal b is ``g[n, :, b]ᵀ a[n]`` (O × K); returns (groups, O, K).
    """
    b, o, k = int(g.shape[-2]), int(g.shape[-1]), int(a.shape[-1])
    n, t = tf.shape(a)[0], tf.shape(a)[1]
    # transpose_a: no copy of the (large) signal tensor.
    sq = tf.reduce_sum(tf.square(tf.matmul(tf.reshape(g, [n, t, b * o]), a, transpose_a=True)), axis=0)
    return tf.math.unsorted_segment_sum(tf.reshape(sq, [b, o, k]), seg, groups)


def _fast_squares(entry: _Entry, x: Any, gs: list[Any], seg: Any, groups: int) -> Any:
    """Per-group sums over samples and signals of squared per-sample gradients, canonical layout.

    ``x``: the layer input (n, ...); ``gs``: the B back-propagated signals at
    the pre-activation, each shaped like it.
    """
    layer = entry.layer
    b = len(gs)
    if entry.fast == "dense":
        if len(x.shape) == 2:
            # Per-sample gradient x ⊗ g is rank one: its square is x² ⊗ g², summed over n by a matmul.
            g2 = tf.math.unsorted_segment_sum(tf.square(tf.stack(gs)), seg, groups)  # (K, n, out)
            return tf.matmul(g2, tf.square(x)[None], transpose_a=True)  # (K, out, in)
        n = tf.shape(x)[0]
        xf = tf.reshape(x, [n, -1, int(x.shape[-1])])
        gf = tf.reshape(tf.stack(gs, axis=-2), [n, -1, b, int(gs[0].shape[-1])])
        return _per_sample_squares(xf, gf, seg, groups)
    # convolution
    r = layer.rank
    if layer.data_format == "channels_first":
        x = tf.transpose(x, [0] + list(range(2, r + 2)) + [1])
        gs = [tf.transpose(g, [0] + list(range(2, r + 2)) + [1]) for g in gs]
    patches = _patches(x, layer)  # (n, P, koff, cin)
    n = tf.shape(patches)[0]
    npos, koff, cin = int(patches.shape[1]), int(patches.shape[2]), int(patches.shape[3])
    cout = int(gs[0].shape[-1])
    groups_conv = int(getattr(layer, "groups", 1))
    gf = tf.reshape(tf.stack(gs, axis=-2), [n, npos, b, cout])
    cin_g, cout_g = cin // groups_conv, cout // groups_conv
    parts = []
    for gi in range(groups_conv):
        a = patches if groups_conv == 1 else patches[..., gi * cin_g:(gi + 1) * cin_g]
        g = gf if groups_conv == 1 else gf[..., gi * cout_g:(gi + 1) * cout_g]
        parts.append(_per_sample_squares(tf.reshape(a, [n, npos, koff * cin_g]), g, seg, groups))
    sq = parts[0] if groups_conv == 1 else tf.concat(parts, axis=1)  # (K, out, koff·cin_g)
    k = tuple(layer.kernel_size)
    sq = tf.reshape(sq, [groups, cout, *k, cin_g])
    return tf.transpose(sq, [0, 1, r + 2] + list(range(2, r + 2)))  # (K, out, in, *k)


def _signals(u: Any, options: AnalysisOptions, seed: Any, groups: int) -> tuple[Any, Any]:
    """Output-side signals (D, n, C) with ``Σ_d s_d s_dᵀ`` = the (MC) loss Hessian, and group ids."""
    p = tf.stop_gradient(tf.nn.softmax(u, axis=-1))
    num_classes = int(u.shape[-1])
    if options.estimator == "ggn":
        # Symmetric factor of diag(p) - p pᵀ: column c is sqrt(p_c) (e_c - p).
        eye = tf.eye(num_classes, dtype=u.dtype)
        sp = tf.sqrt(p)
        s = tf.transpose(sp)[:, :, None] * (eye[:, None, :] - p[None, :, :])  # (C, n, C)
        # diag(p) - ppᵀ has rank C-1 (S √p = 0): rotate S by the Householder reflection Q
        # with Q e_last = -√p; the last column of S Q vanishes, the other C-1 still give
        # S Q Qᵀ Sᵀ = H. Column j of S Q is s_j - √p_j / (1 + √p_last) s_last.
        coef = tf.transpose(sp[:, :-1] / (1 + sp[:, -1:]))[:, :, None]  # (C-1, n, 1)
        s = s[:-1] - coef * s[-1][None]
        return s, tf.zeros([num_classes - 1], tf.int32)
    draws = options.samples
    ids = tf.random.stateless_categorical(tf.math.log(p), draws, seed)  # (n, D)
    onehot = tf.one_hot(tf.transpose(ids), num_classes, dtype=u.dtype)  # (D, n, C)
    seg = tf.range(draws, dtype=tf.int32) % groups
    sizes = tf.math.bincount(seg, minlength=groups, dtype=u.dtype)
    weight = tf.math.rsqrt(tf.gather(sizes, seg))  # group sum of squares = group mean
    return (p[None] - onehot) * weight[:, None, None], seg


def _compiled(run: _Run, kind: str, extra: tuple, factory: Callable[[], Any]) -> Any:
    """A compiled function for this model and these settings, traced once and reused.

    Tracing costs far more than a step of a small model, so repeated analyses
    (a callback every epoch, benchmarks) reuse the graph. Cached functions hold
    the model only through a weak reference; the cache entry dies with the model.
    """
    key = (
        kind,
        run.options.estimator,
        run.options.loss,
        run.options.temperature,
        run.options.samples,
        tuple((e.name, e.fast, id(e.variable.value), e.weight.kind) for e in run.entries),
        None if run.strip is None else (id(run.strip[0]), run.strip[1]),
        tuple(id(layer) for layer in run.grouped),
        extra,
    )
    try:
        per_model = _COMPILED.setdefault(run.model, {})
    except TypeError:  # not weak-referenceable: no caching
        return factory()
    if key not in per_model:
        per_model[key] = factory()
    return per_model[key]


_COMPILED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


#: Signals back-propagated per compiled step (unrolled in the graph; more are done in blocks).
_SIGNAL_BLOCK = 16


def _ggn_step_fn(run: _Run, groups: int, block: int, holder: dict):
    """The compiled GGN step of one chunk of samples and one block of signals.

    Returns the (K, *canonical) sums per layer and two logits checks (all
    finite, looks like probabilities). ``holder["taps"]`` is the
    :class:`_Taps` active when the function (re)traces.
    """
    entries = run.entries
    fast = [e for e in entries if e.fast]
    generic = [e for e in entries if not e.fast]
    model_ref = weakref.ref(run.model)
    options = run.options

    @tf.function(reduce_retracing=True)
    def step(x, seed, start):
        taps = holder["taps"]
        taps.records.clear()
        with tf.GradientTape(persistent=True) as tape:
            taps.tape = tape
            for e in generic:
                tape.watch(e.variable.value)
            z = model_ref()(x, training=False)
            u = _output_transform(z, options)
        taps.tape = None
        checks = [tf.reduce_all(tf.math.is_finite(z)), _looks_like_probabilities(z)]
        s, seg = _signals(u, options, seed, groups)
        # A fixed-size block of signals; past the end, zero (padding) signals add nothing.
        s = tf.pad(s, [[0, block], [0, 0], [0, 0]])[start:start + block]
        seg = tf.pad(seg, [[0, block]])[start:start + block]
        s = tf.ensure_shape(s, [block, None, int(u.shape[-1])])
        out = {}
        if fast:
            pre = [taps.records[e.name][0][1] for e in fast]
            # One back-propagation per signal, unrolled: much faster on CPU than pfor here.
            back = [tape.gradient(u, pre, output_gradients=s[i]) for i in range(block)]
            for j, e in enumerate(fast):
                gs = [back[i][j] for i in range(block)]
                out[e.name] = _fast_squares(e, taps.records[e.name][0][0], gs, seg, groups)
        if generic:
            n = tf.shape(u)[0]
            # One signal per (signal, sample): per-sample gradients through the whole model.
            flat = tf.reshape(s, [-1, int(u.shape[-1])])  # (B*n, C)
            rows = tf.tile(tf.range(n), [block])
            og = tf.one_hot(rows, n, dtype=u.dtype)[:, :, None] * flat[:, None, :]  # (B*n, n, C)
            variables = [e.variable.value for e in generic]

            def per_sample(o):
                grads = tape.gradient(u, variables, output_gradients=o)
                return [tf.zeros_like(v) if gr is None else gr for gr, v in zip(grads, variables)]

            grads = tf.vectorized_map(per_sample, og)
            sample_seg = tf.repeat(seg, n)
            for e, gr in zip(generic, grads):
                sq = tf.math.unsorted_segment_sum(tf.square(gr), sample_seg, groups)
                out[e.name] = tf.vectorized_map(e.weight.to_canonical, sq)
        del tape
        return [out[e.name] for e in entries], checks

    return step


def _with_holder(factory: Callable[..., Any], *args: Any) -> tuple[Any, dict]:
    holder: dict = {}
    return factory(*args, holder), holder


def _ggn_bytes(run: _Run, block: int) -> tuple[int, int]:
    """Estimated bytes of one GGN step as ``linear * n + quadratic * n²`` for a chunk of n samples.

    Counts the per-sample intermediates that grow with the chunk: the
    back-propagated signals at every tapped pre-activation and layer input
    (the unrolled signals of a block may be live at once),
    the largest per-layer per-sample-gradient work (batched matmul result and
    its square, convolution patches), and for layers on the generic path the
    per-sample Jacobian products, whose output-gradient tensor and vectorized
    backward pass grow with n² (one signal per sample of the chunk).
    """
    item = tf.as_dtype(run.dtype).size
    linear = run.input_size + run.num_classes * (block + 2)
    work = 0
    for e in run.entries:
        if not e.fast:
            continue
        size = int(np.prod(e.variable.shape))
        # Activations, the B signals at the pre-activation and, transiently, at the layer input.
        linear += e.in_size * (block + 1) + e.pre_size * (block + 1)
        if e.fast == "dense" and e.input_rank == 2:
            work = max(work, block * e.pre_size)  # stacked squared signals
        else:
            layer = e.layer
            positions = e.pre_size // max(1, int(layer.filters if e.fast == "conv" else e.variable.shape[-1]))
            patches = positions * size // max(1, int(e.variable.shape[-1])) if e.fast == "conv" else e.in_size
            work = max(work, 2 * block * size + block * e.pre_size + patches)
    generic = [e for e in run.entries if not e.fast]
    quadratic = 0
    if generic:
        activations = run.input_size + run.num_classes + sum(e.in_size + e.pre_size for e in run.entries)
        linear += 2 * block * sum(int(np.prod(e.variable.shape)) for e in generic)
        quadratic = block * (run.num_classes + 2 * activations)
    return (linear + work) * item, quadratic * item


def _chunk_size(run: _Run, block: int) -> int:
    """Samples per step: ``chunk_size``, or the largest chunk whose step fits the memory budget."""
    if run.chunk_size is not None:
        return run.chunk_size
    linear, quadratic = _ggn_bytes(run, block)
    if run.memory_budget is None:  # default budget: never an error, at least one sample
        return int(max(1, min(1024, _CHUNK_BYTES // (linear + quadratic))))
    what = f"the GGN step ({block} back-propagated signals per sample, estimated)"
    chunk = chunk_size_for(run.memory_budget, linear + quadratic, what=what, maximum=1024)
    while chunk > 1 and chunk * linear + chunk * chunk * quadratic > run.memory_budget:
        chunk = max(1, min(chunk - 1, int(chunk * 0.9)))
    return chunk


def _ggn(run: _Run, batches: Iterable, length: int | None):
    groups = _groups(run)
    draws = run.options.samples if run.options.estimator == "ggn-mc" else None
    counter = 0  # stateless draws: seed (options.seed, chunk counter), no global RNG involved
    totals: list[Any] | None = None
    examples = nbatches = 0
    with _Taps([e for e in run.entries if e.fast], run.strip, run.grouped) as taps:
        step = None
        for x, _, n in _iterate(run, batches, length):
            if step is None:  # after the probe, which settles the fast/generic paths
                signals = draws or run.num_classes - 1  # rank of the softmax CE Hessian
                block = min(signals, _SIGNAL_BLOCK)
                step, holder = _compiled(run, "ggn", (groups, block),
                                         lambda: _with_holder(_ggn_step_fn, run, groups, block))
                chunk = _chunk_size(run, block)
            holder["taps"] = taps
            nbatches += 1
            examples += n
            # Balanced chunks: fewer distinct shapes to trace.
            size = -(-n // -(-n // chunk))
            for a in range(0, n, size):
                xc = x if size >= n else tf.nest.map_structure(lambda t: t[a:a + size], x)
                seed = tf.constant([run.options.seed, counter], tf.int64)
                counter += 1
                for start in range(0, signals, block):
                    sums, checks = step(xc, seed, tf.constant(start, tf.int32))
                    if not run.checked:
                        _check_logits(run, bool(checks[0]), bool(checks[1]))
                        run.checked = True
                    sums = [tf.cast(v, tf.float64) for v in sums]
                    totals = sums if totals is None else [t + v for t, v in zip(totals, sums)]
    run.metadata["chunk_size"] = chunk
    scale = 1.0 / examples
    samples = [t * scale for t in totals]  # (K, *canonical) group means
    diags = [tf.reduce_mean(s, axis=0) for s in samples]
    return diags, (samples if groups > 1 else None), examples, nbatches


# ----------------------------------------------------------------------------- exact / hutchinson


def _hvp_estimators(run: _Run, batches: Iterable, length: int | None):
    variables = [e.variable.value for e in run.entries]
    sizes = [int(np.prod(v.shape)) for v in variables]
    total_params = sum(sizes)
    est = run.options.estimator
    if est == "exact" and total_params > run.exact_max_params:
        raise ValueError(
            f"estimator='exact' needs one Hessian-vector product per weight; the analyzed layers have "
            f"{total_params} weights (limit {run.exact_max_params}). Use estimator='ggn' or 'hutchinson', "
            "restrict layers=[...], or pass force=True (or max_exact_params=...) to run it anyway."
        )
    step_fns = _compiled(run, "hvp", (_groups(run),), lambda: _hvp_step_fns(run, variables, sizes))
    loop = _hvp_loop if run.dist is None else _hvp_loop_distributed
    return loop(run, batches, length, variables, sizes, total_params, *step_fns)


def _hvp_step_fns(run: _Run, variables: list, sizes: list[int]):
    """Compiled exact (one-hot probes of one layer) and Hutchinson (Rademacher probes) steps."""
    options = run.options
    model_ref = weakref.ref(run.model)

    def grads_and_hvp(x, target, probes, layer):
        with tf.GradientTape(persistent=True) as outer:
            for v in variables:
                outer.watch(v)
            with tf.GradientTape() as inner:
                for v in variables:
                    inner.watch(v)
                loss = _mean_loss(model_ref()(x, training=False), target, options)
            g = inner.gradient(loss, variables)
            g = [tf.zeros_like(v) if gi is None else gi for gi, v in zip(g, variables)]
        if layer is not None:
            sources, targets_ = [variables[layer]], [g[layer]]
        else:
            sources, targets_ = variables, g

        def hvp(vs):
            out = outer.gradient(targets_, sources, output_gradients=vs)
            return [tf.zeros_like(s) if o is None else o for o, s in zip(out, sources)]

        return tf.vectorized_map(hvp, probes)

    @tf.function(reduce_retracing=True)
    def exact_step(x, target, indices, layer):
        v = variables[layer]
        probes = tf.reshape(tf.one_hot(indices, sizes[layer], dtype=v.dtype), [-1, *v.shape])
        (hv,) = grads_and_hvp(x, target, [probes], layer)
        return tf.reduce_sum(tf.reshape(hv * probes, [tf.shape(indices)[0], -1]), axis=1)

    groups = _groups(run)

    @tf.function(reduce_retracing=True)
    def hutchinson_step(x, target, probes, seg):
        hv = grads_and_hvp(x, target, probes, None)
        return [tf.math.unsorted_segment_sum(p * h, seg, groups) for p, h in zip(probes, hv)]

    return exact_step, hutchinson_step


def _hvp_loop(run, batches, length, variables, sizes, total_params, exact_step, hutchinson_step):
    options = run.options
    est = options.estimator
    groups = _groups(run)
    totals = None
    examples = nbatches = 0
    rng = tf.random.Generator.from_seed(options.seed) if est == "hutchinson" else None
    with _Taps([], run.strip, run.grouped):
        for x, target, n in _iterate(run, batches, length):
            nbatches += 1
            examples += n
            if est == "exact":
                sums = []
                for li, (v, size) in enumerate(zip(variables, sizes)):
                    chunk = max(1, min(size, 2**22 // max(total_params, 1)))
                    parts = [exact_step(x, target, tf.range(a, min(a + chunk, size)), li)
                             for a in range(0, size, chunk)]
                    diag = tf.reshape(tf.concat(parts, 0), v.shape)
                    sums.append(tf.cast(diag, tf.float64)[None] * n)
            else:
                samples = options.samples
                chunk = max(1, min(samples, 2**24 // max(total_params, 1)))
                sums = [tf.zeros([groups, *v.shape], tf.float64) for v in variables]
                sizes_g = np.bincount(np.arange(samples) % groups, minlength=groups)
                for a in range(0, samples, chunk):
                    m = min(chunk, samples - a)
                    probes = [tf.sign(rng.uniform([m, *v.shape], -1.0, 1.0, dtype=v.dtype)) for v in variables]
                    probes = [tf.where(p == 0, tf.ones_like(p), p) for p in probes]
                    seg = tf.constant(np.arange(a, a + m) % groups, tf.int32)
                    part = hutchinson_step(x, target, probes, seg)
                    sums = [s + tf.cast(p, tf.float64) for s, p in zip(sums, part)]
                group_scale = tf.constant((n / sizes_g), tf.float64)
                sums = [s * tf.reshape(group_scale, [groups] + [1] * (len(s.shape) - 1)) for s in sums]
            totals = sums if totals is None else [t + s for t, s in zip(totals, sums)]
    return _hvp_finish(run, totals, examples, nbatches)


def _hvp_finish(run: _Run, totals: list[Any], examples: int, nbatches: int):
    """Per-layer sums over samples (K, *variable shape) -> canonical diagonals and group means."""
    est, groups = run.options.estimator, _groups(run)
    scale = 1.0 / examples
    samples_out = []
    for e, t in zip(run.entries, totals):
        t = t * scale
        samples_out.append(tf.vectorized_map(e.weight.to_canonical, t) if t.shape[0] > 1
                           else e.weight.to_canonical(t[0])[None])
    diags = [tf.reduce_mean(s, axis=0) for s in samples_out]
    return diags, (samples_out if groups > 1 and est == "hutchinson" else None), examples, nbatches


# ----------------------------------------------------------------------------- tf.distribute


class _Dist:
    """The ``tf.distribute`` strategy of an analysis and this worker's share of the work.

    Non-empty batches are dealt round-robin to the strategy's replicas (batch
    ``k`` to global replica ``k % replicas``); every worker iterates the same
    full data and keeps its replicas' batches. Each replica sums over its own
    samples; the per-layer sums and sample counts are added with
    ``strategy.reduce(SUM)`` once at the end, so the result is the
    single-process one up to the order of floating-point additions.
    """

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.total = int(strategy.num_replicas_in_sync)
        self.devices = list(strategy.extended.worker_devices)
        ids: list[int] = []

        def record(ctx):
            ids.append(int(ctx.replica_id_in_sync_group))
            return tf.constant(0)

        # The global ids of this worker's replicas, in local order (public API only).
        strategy.experimental_distribute_values_from_function(record)
        self.ids = ids
        self.local = len(ids)

    @classmethod
    def detect(cls, model: Any, distributed: bool | None) -> "_Dist | None":
        """The strategy to analyze ``model`` with, or None for a plain single-device run."""
        if distributed is False:
            return None
        strategy = getattr(model, "_distribute_strategy", None)
        if strategy is None and tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
        if strategy is None:
            if distributed:
                raise ValueError(
                    "distributed=True, but the model was not built under a tf.distribute strategy scope and "
                    "no strategy scope is active. Build the model inside `with strategy.scope():` or call "
                    "normflat.analyze inside it."
                )
            return None
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            raise RuntimeError(
                "normflat.analyze was called inside strategy.run (a replica context); call it from the "
                "outer program: it distributes the work over the replicas itself."
            )
        supported = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy,
                     tf.distribute.OneDeviceStrategy)
        if not isinstance(strategy, supported):
            if strategy.num_replicas_in_sync == 1 and not distributed:
                return None
            raise NotImplementedError(
                f"normflat distributes over MirroredStrategy and MultiWorkerMirroredStrategy, not "
                f"{type(strategy).__name__}. Pass distributed=False to analyze on one device."
            )
        if strategy.num_replicas_in_sync < 2:
            return None  # one replica: the single-device path computes the same, without overhead
        return cls(strategy)

    @property
    def workers(self) -> int:
        resolver = getattr(self.strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
        return sum(len(v) for k, v in spec.items() if k in ("chief", "worker")) or 1

    def describe(self) -> dict:
        return {
            "distributed": type(self.strategy).__name__,
            "replicas": self.total,
            "workers": self.workers,
            "replica_devices": list(self.devices),
        }

    def owns(self, k: int) -> bool:
        return (k % self.total) in self.ids

    def rounds(self, items: Iterable) -> Iterable[dict[int, tuple]]:
        """Group ``(x, target, n, k)`` items by round ``k // replicas``: ``{local replica: item}``."""
        current, batch = None, {}
        for item in items:
            r = item[3] // self.total
            if current is not None and r != current:
                yield batch
                batch = {}
            current = r
            batch[self.ids.index(item[3] % self.total)] = item
        if batch:
            yield batch

    def call(self, fn: Callable, per_replica: list[tuple], shared: tuple = ()) -> list[Any]:
        """``fn(*per_replica[i], *shared)`` on every local replica i, in parallel; local results."""

        def value(ctx):
            i = self.ids.index(int(ctx.replica_id_in_sync_group))
            with tf.device(self.devices[i]):
                return tf.nest.map_structure(tf.identity, per_replica[i])

        args = self.strategy.experimental_distribute_values_from_function(value)
        out = self.strategy.run(fn, args=tuple(args) + tuple(shared))
        flat = [self.strategy.experimental_local_results(v) for v in tf.nest.flatten(out)]
        return [tf.nest.pack_sequence_as(out, [f[i] for f in flat]) for i in range(self.local)]

    def reduce_sum(self, per_replica: list[Any]) -> Any:
        """Cross-replica (and cross-worker) sum of one nest of float64 tensors per local replica.

        The leaves travel as one flat vector: a single collective per analysis.
        """
        structure = per_replica[0]
        shapes = [t.shape for t in tf.nest.flatten(structure)]
        flat = [tf.concat([tf.reshape(t, [-1]) for t in tf.nest.flatten(nest)], 0) for nest in per_replica]

        def value(ctx):
            i = self.ids.index(int(ctx.replica_id_in_sync_group))
            with tf.device(self.devices[i]):
                return tf.identity(flat[i])

        values = self.strategy.experimental_distribute_values_from_function(value)
        total = self.strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)
        parts = tf.split(total, [int(np.prod(shape)) for shape in shapes])
        return tf.nest.pack_sequence_as(structure, [tf.reshape(p, shape) for p, shape in zip(parts, shapes)])


def _padded(round_items: dict[int, tuple], local: int) -> tuple[list[tuple], list[bool]]:
    """One item per local replica; replicas without a batch get a one-sample stand-in (ignored)."""
    spare = next(iter(round_items.values()))
    stand_in = (tf.nest.map_structure(lambda t: t[:1], spare[0]), spare[1][:1], 0, -1)
    return [round_items.get(i, stand_in) for i in range(local)], [i in round_items for i in range(local)]


def _zeros_canonical(run: _Run, groups: int) -> list[Any]:
    return [tf.zeros([groups, *e.weight.to_canonical(tf.convert_to_tensor(e.variable.value)).shape], tf.float64)
            for e in run.entries]


def _reduce_guarded(run: _Run, local: Callable[[], tuple[list, list]], zeros: list[Any]):
    """Run this worker's share ``local() -> (totals, counts)`` and sum over all replicas.

    ``totals``: per local replica, the per-layer sums (None: no data);
    ``counts``: per local replica, ``[examples, batches]``. With several
    workers, an error in ``local`` is still followed by this worker's part of
    the (single) collective, with a failure flag, so that every worker raises
    instead of the others waiting for it forever.
    """
    dist = run.dist
    error = None
    try:
        totals, counts = local()
    except Exception as err:
        if dist.workers == 1:
            raise
        error = err
        totals, counts = [None] * dist.local, [[0, 0]] * dist.local
    nest = [
        ([tf.identity(z) for z in zeros] if t is None else t, tf.constant([*c, error is not None], tf.float64))
        for t, c in zip(totals, counts)
    ]
    sums, count = dist.reduce_sum(nest)
    examples, nbatches, failed = (int(round(float(v))) for v in count.numpy())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"The analysis failed on {failed} replica(s) of another worker; see that worker's error. "
            "(This worker stopped too, instead of waiting for it.)"
        )
    if examples == 0:  # pragma: no cover - _iterate raises first
        raise ValueError("The data is empty: it yielded no (x, y) batch with samples.")
    return list(sums), examples, nbatches


def _ggn_distributed(run: _Run, batches: Iterable, length: int | None):
    """The GGN of :func:`_ggn`, each replica on its own batches (see :class:`_Dist`)."""
    dist = run.dist
    groups = _groups(run)
    draws = run.options.samples if run.options.estimator == "ggn-mc" else None

    def local():
        totals: list[Any] = [None] * dist.local
        counts = [[0, 0] for _ in range(dist.local)]
        step = None
        with _Taps([e for e in run.entries if e.fast], run.strip, run.grouped) as taps:
            for round_items in dist.rounds(_iterate(run, batches, length, owned=dist.owns)):
                if step is None:
                    signals = draws or run.num_classes - 1
                    block = min(signals, _SIGNAL_BLOCK)
                    step, holder = _compiled(run, "ggn", (groups, block),
                                             lambda: _with_holder(_ggn_step_fn, run, groups, block))
                    run.metadata["chunk_size"] = chunk = _chunk_size(run, block)
                holder["taps"] = taps
                items, real = _padded(round_items, dist.local)
                pieces = []  # per local replica: [(x chunk, seed)]
                for i, ((x, _, n, k), ok) in enumerate(zip(items, real)):
                    size = -(-n // -(-n // chunk)) if ok else 1
                    own = []
                    for c, a in enumerate(range(0, max(n, 1), size)):
                        xc = x if size >= n else tf.nest.map_structure(lambda t: t[a:a + size], x)
                        # Stateless draws seeded by (seed, batch, chunk): independent across replicas,
                        # reproducible for a given data order and replica count.
                        own.append((xc, tf.constant([run.options.seed, (k + 1) * 2**20 + c], tf.int64)))
                    pieces.append(own)
                    if ok:
                        counts[i][0] += n
                        counts[i][1] += 1
                for c in range(max(len(p) for p in pieces)):
                    active = [ok and c < len(p) for p, ok in zip(pieces, real)]
                    args = [p[c] if c < len(p) else p[0] for p in pieces]
                    for start in range(0, signals, block):
                        outs = dist.call(step, args, (tf.constant(start, tf.int32),))
                        for i, (sums, checks) in enumerate(outs):
                            if not active[i]:
                                continue
                            if not run.checked:
                                _check_logits(run, bool(checks[0]), bool(checks[1]))
                                run.checked = True
                            sums = [tf.cast(v, tf.float64) for v in sums]
                            totals[i] = sums if totals[i] is None else [t + v for t, v in zip(totals[i], sums)]
        return totals, counts

    sums, examples, nbatches = _reduce_guarded(run, local, _zeros_canonical(run, groups))
    samples = [t * (1.0 / examples) for t in sums]
    diags = [tf.reduce_mean(s, axis=0) for s in samples]
    return diags, (samples if groups > 1 else None), examples, nbatches


def _hvp_loop_distributed(run, batches, length, variables, sizes, total_params, exact_step, hutchinson_step):
    """:func:`_hvp_loop` with each replica on its own batches (see :class:`_Dist`)."""
    dist = run.dist
    options = run.options
    est = options.estimator
    groups = _groups(run)

    def local():
        totals: list[Any] = [None] * dist.local
        counts = [[0, 0] for _ in range(dist.local)]
        rng = tf.random.Generator.from_seed(options.seed) if est == "hutchinson" else None
        with _Taps([], run.strip, run.grouped):
            for round_items in dist.rounds(_iterate(run, batches, length, owned=dist.owns)):
                items, real = _padded(round_items, dist.local)
                ns = [item[2] for item in items]
                if est == "exact":
                    sums = [[] for _ in items]
                    for li, (v, size) in enumerate(zip(variables, sizes)):
                        chunk = max(1, min(size, 2**22 // max(total_params, 1)))
                        parts = [dist.call(exact_step, [item[:2] for item in items],
                                           (tf.range(a, min(a + chunk, size)), li))
                                 for a in range(0, size, chunk)]
                        for i in range(dist.local):
                            diag = tf.reshape(tf.concat([p[i] for p in parts], 0), v.shape)
                            sums[i].append(tf.cast(diag, tf.float64)[None] * ns[i])
                else:
                    samples = options.samples
                    chunk = max(1, min(samples, 2**24 // max(total_params, 1)))
                    sums = [[tf.zeros([groups, *v.shape], tf.float64) for v in variables] for _ in items]
                    sizes_g = np.bincount(np.arange(samples) % groups, minlength=groups)
                    for a in range(0, samples, chunk):
                        m = min(chunk, samples - a)
                        args = []
                        for item in items:  # independent probes per replica
                            probes = [tf.sign(rng.uniform([m, *v.shape], -1.0, 1.0, dtype=v.dtype)) for v in variables]
                            args.append((item[0], item[1], [tf.where(p == 0, tf.ones_like(p), p) for p in probes]))
                        seg = tf.constant(np.arange(a, a + m) % groups, tf.int32)
                        parts = dist.call(hutchinson_step, args, (seg,))
                        sums = [[s + tf.cast(p, tf.float64) for s, p in zip(si, pi)] for si, pi in zip(sums, parts)]
                    for i in range(dist.local):
                        scale = tf.constant(ns[i] / sizes_g, tf.float64)
                        sums[i] = [s * tf.reshape(scale, [groups] + [1] * (len(s.shape) - 1)) for s in sums[i]]
                for i in range(dist.local):
                    if real[i]:
                        counts[i][0] += ns[i]
                        counts[i][1] += 1
                        totals[i] = sums[i] if totals[i] is None else [t + s for t, s in zip(totals[i], sums[i])]
        return totals, counts

    zeros = [tf.zeros([groups if est == "hutchinson" else 1, *v.shape], tf.float64) for v in variables]
    sums, examples, nbatches = _reduce_guarded(run, local, zeros)
    return _hvp_finish(run, sums, examples, nbatches)


# ----------------------------------------------------------------------------- entry points


def _run_analysis(model: Any, data: Any, options: AnalysisOptions, backend_options: dict):
    run, batches, length = _prepare(model, data, options, backend_options)
    diags, samples, examples, nbatches = _estimate(run, batches, length)
    run.metadata.update({"examples": examples, "batches": nbatches})
    return run, diags, samples


def layer_problems(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any):
    """Per-layer problems of a Keras model (backend contract, see ``normflat.backends``).

    Returns:
        ``(problems, metadata)``: one :class:`LayerProblem` per analyzed weight
        tensor in model order (float64 numpy arrays, canonical layout) and
        metadata (examples, batches, dtype, device, versions, ...).
    """
    run, diags, samples = _run_analysis(model, data, options, backend_options)
    weights = _layer_weights_canonical(run)
    problems = []
    for i, (entry, w, h) in enumerate(zip(run.entries, weights, diags)):
        details = {"path": "fast" if entry.fast else "generic", "layer_class": type(entry.layer).__name__}
        problems.append(
            LayerProblem(
                entry.name, w, np.asarray(h.numpy(), dtype=np.float64), kind=entry.weight.kind,
                hessian_diag_samples=None if samples is None else np.asarray(samples[i].numpy()),
                details=details,
            )
        )
    return problems, run.metadata


def hessian_diagonal(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any) -> dict[str, Any]:
    """``{layer name: tf.Tensor}`` of the Hessian (or GGN) diagonal, canonical layout, weight dtype."""
    run, diags, _ = _run_analysis(model, data, options, backend_options)
    return {e.name: tf.cast(h, e.variable.dtype) for e, h in zip(run.entries, diags)}
