"""The Keras :class:`~normflat.engine.driver.Session`: one model, one analysis.

The engine's driver owns the data loop, the estimator sums, the distributed
protocol and the problem building; the session holds the analyzed layers and,
for one checked batch at a time, runs the estimator kernels (:mod:`.ggn`,
:mod:`.hvp`) over chunks of the batch, dealt to the local ``tf.distribute``
replicas when there are several, and adds the ``(K', *layout)`` sums to the
engine's state (``K' = options.state_groups``; ``estimator="auto"`` is resolved on
the first batch, once the number of classes and of tokens is known). The layout of the sums is
canonical for the GGN kernels (they produce it directly) and the variable's own
for the HVP kernels (:meth:`KerasSession.canonical` converts at the end).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from normflat.backends.keras import compat
from normflat.backends.keras.calls import grouped_conv_call, is_plain_norm, norm_call, state_blocks
from normflat.backends.keras.data import ADAPTER, to_tensor
from normflat.backends.keras.distributed import Replicas
from normflat.backends.keras.ggn import (SIGNAL_BLOCK, TableRows, Taps, compute_dtype, exact_head, ggn_bytes,
                                         ggn_chunk_size, ggn_step_fn, logits_rounding, model_logits, open_batch,
                                         signal_layout, starts_at_head_input)
from normflat.backends.keras.hvp import (EXACT_BLOCK, PROBE_BLOCK, has_recurrence, hvp_step_fns, native_positions,
                                        native_probes, probes_in_sequence)
from normflat.backends.keras.layers import LORA_KINDS, RECURRENT_KINDS, UNUSED, Entry, fast_kind, is_lora, walk
from normflat.backends.keras.ops import TF
from normflat.backends.keras.state import ModelState
from normflat.backends.keras_shared import final_softmax, logits_only
from normflat.core.memory import chunk_size_for, default_budget, equal_step, training_step_bytes
from normflat.engine import estimators
from normflat.engine.data import PENDING_CHECKS, Batch, first_forward, labels_for, raised_by_normflat
from normflat.engine.estimators import SumState
from normflat.engine.losses import (SAMPLES_APART_ROWS, check_logit_stats, check_loss_value, check_output_shape,
                                    check_samples_apart, classes_first, logit_stats, one_sample_error)
from normflat.engine.options import AnalysisOptions, resolve_estimator
from normflat.engine.problems import UNUSED_NOTE, LayerSpec
from normflat.engine.random import sample_uniforms

__all__ = ["BackendConfig", "KerasSession", "HVP_CHUNK"]

#: Default samples per exact/hutchinson step (their probes are processed in fixed blocks).
HVP_CHUNK = 512
#: Hutchinson probes of all layers are kept for the whole analysis up to this many bytes.
PROBE_CACHE_BYTES = 2**28


@dataclass(frozen=True)
class BackendConfig:
    """The checked Keras backend options (see the package docstring)."""

    layers: list[str] | None = None
    chunk_size: int | None = None
    memory_budget: int | None = None
    max_exact_params: float = 20_000
    fast: bool = True
    distributed: bool | None = None


# Compiled functions and eager probes are cached per model (weakly: an entry dies with its
# model), so repeated analyses (a callback every epoch, benchmarks) trace only once.
_CACHE_GUARD = threading.Lock()
_COMPILED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_PROBES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
#: The canonical shapes of a model's analyzed weights: reading one transposes the weight itself
#: (``to_canonical`` works on tensors), milliseconds per analysis of a small model.
_SHAPES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
#: The input signatures each compiled step was traced for with its batch axis open.
_OPEN_TRACES: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


def _cached(cache: "weakref.WeakKeyDictionary[Any, dict]", model: Any, key: Any,
            factory: Callable[[], Any] | None) -> Any:
    with _CACHE_GUARD:
        try:
            per_model = cache.setdefault(model, {})
        except TypeError:  # not weak-referenceable: no caching
            return None if factory is None else factory()
        if key not in per_model:
            if factory is None:
                return None
            per_model[key] = factory()
        return per_model[key]


def _store(cache: "weakref.WeakKeyDictionary[Any, dict]", model: Any, key: Any, value: Any) -> None:
    with _CACHE_GUARD:
        try:
            cache.setdefault(model, {})[key] = value
        except TypeError:
            pass


def canonical_shapes(model: Any, entries: list[Entry]) -> list[tuple[int, ...]]:
    """The canonical ``(out, in/groups, *kernel)`` shape of each entry's weight, kept per model
    (:data:`_SHAPES`): ``to_canonical`` works on tensors, so reading a shape transposes the weight
    itself, milliseconds per analysis of a small model."""
    key = tuple((e.name, id(e.variable.value), tuple(int(d) for d in e.variable.shape), e.weight.kind)
                for e in entries)
    return _cached(_SHAPES, model, key, lambda: [
        tuple(int(d) for d in e.weight.to_canonical(tf.convert_to_tensor(e.variable.value)).shape)
        for e in entries
    ])


def _per_sample_elements(t: Any) -> int:
    return int(np.prod([int(d) for d in t.shape[1:]], dtype=np.int64))


def trace_open_batch(fn: Any, args: tuple, batched: list[bool]) -> None:
    """Trace the ``tf.function`` ``fn`` for ``args`` with the leading (batch) axis of each argument
    marked in ``batched`` left open.

    A later call with another batch size (a chunk, the last batch) then finds this trace, where
    TensorFlow would trace the second size again (``reduce_retracing`` only generalizes then):
    seconds for a step with second derivatives. Arguments that are not all tensors are left to
    TensorFlow's own tracing rules. Each signature is traced once per function, also across
    analyses (looking an existing trace up again costs a millisecond per analysis).
    """
    if not all(isinstance(t, tf.Tensor) for t in tf.nest.flatten(args)):
        return

    def spec(t: Any, open_batch: bool) -> Any:
        return tf.TensorSpec([None, *t.shape[1:]] if open_batch and t.shape.rank else t.shape, t.dtype)

    specs = [tf.nest.map_structure(lambda t, b=b: spec(t, b), a) for a, b in zip(args, batched)]
    key = repr(specs)
    with _CACHE_GUARD:
        try:
            done = _OPEN_TRACES.setdefault(fn, set())
        except TypeError:  # not weak-referenceable: trace (a lookup if it exists)
            done = set()
        if key in done:
            return
    batched_args = [t for a, b in zip(args, batched) if b for t in tf.nest.flatten(a) if t.shape.rank]
    with open_batch(int(batched_args[0].shape[0]) if batched_args else None):
        fn.get_concrete_function(*specs)
    with _CACHE_GUARD:
        done.add(key)


class OpenBatchTraces:
    """:func:`trace_open_batch` once per compiled step, on its first call.

    Not for a custom loss: its value is checked while tracing, with the batch's own shape (the
    error names that shape).
    """

    def __init__(self, custom_loss: bool) -> None:
        self._custom_loss = custom_loss
        self._done: set[int] = set()

    def trace(self, fn: Any, args: tuple, batched: list[bool]) -> None:
        if self._custom_loss or id(fn) in self._done:
            return
        self._done.add(id(fn))
        trace_open_batch(fn, args, batched)


def _slice(x: Any, a: int, b: int) -> Any:
    return tf.nest.map_structure(lambda t: t[a:b], x)


def _readable(variable: Any) -> list[Any]:
    """The variables a forward run here reads for ``variable``, for a tape to watch.

    Inside a strategy's scope (a cross-replica context) a mirrored variable cannot be watched
    (its ``handle`` exists only in a replica context) and a forward reads one of its per-device
    copies: those copies, from ``experimental_local_results``. Anywhere else, the variable itself
    (a variable that is not mirrored is its own only local result).
    """
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
        return list(tf.distribute.get_strategy().experimental_local_results(variable))
    return [variable]


#: The largest integer up to which every integer is exact in each floating dtype.
_EXACT_INTEGERS = {"float16": 2**11, "bfloat16": 2**8, "float32": 2**24, "float64": 2**53}


def _whole_rows(entry: Entry, rows: Any, out: Any, features: Any) -> bool:
    """Whether a ``PositionEmbedding``'s output ``out`` is table rows, one per position.

    ``rows`` and ``features`` are the layer's output for tables of row and of feature indices
    (:meth:`~normflat.backends.keras.ggn.Taps.rows`): every output entry must read one row
    (an exact integer in range, the same along the features) and the feature of its own place,
    and ``out`` must equal the table's rows at those numbers exactly.
    """
    table = tf.convert_to_tensor(entry.variable.value)
    count, width = (int(d) for d in table.shape)
    exact = min(_EXACT_INTEGERS.get(tf.as_dtype(t.dtype).name, 0) for t in (table, out, rows, features))
    if count > exact or int(out.shape[-1]) != width or tuple(rows.shape) != tuple(out.shape):
        return False
    r = tf.cast(rows, tf.float64)
    ids = tf.cast(tf.round(r[..., 0]), tf.int64)
    ok = (tf.reduce_all(tf.equal(r, tf.round(r))) and tf.reduce_all(tf.equal(r, r[..., :1]))
          and tf.reduce_all((ids >= 0) & (ids < count))
          and tf.reduce_all(tf.equal(tf.cast(features, tf.float64), tf.range(width, dtype=tf.float64))))
    if not bool(ok):
        return False
    return bool(tf.reduce_all(tf.equal(tf.gather(table, ids), tf.cast(out, table.dtype))))


def _check_model(model: Any) -> None:
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"The Keras backend needs a Keras 3 model (keras.Model / keras.layers.Layer), got "
            f"{type(model).__name__}. tf.keras (Keras 2) models are not supported; build the model with "
            "Keras 3."
        )
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"This Keras model runs on Keras' {keras.backend.backend()!r} backend; normflat analyzes Keras "
            "models on the 'tensorflow' backend and on the 'jax' one. Set the environment variable "
            "KERAS_BACKEND=tensorflow (or jax) before importing keras, and build or load the model there "
            "(a .keras file loads on either)."
        )
    if not model.built:
        raise ValueError(
            f"The Keras model {model.name!r} is not built (it has no weights yet). Call it on a batch "
            "(model(x)) or call model.build(input_shape) before analyzing it."
        )
    for layer in compat.flatten_layers(model):
        if isinstance(layer, keras.layers.RNN) and layer.stateful:
            raise ValueError(
                f"The recurrent layer {layer.name!r} is stateful (stateful=True): every forward of the analysis "
                "would start from the states the previous batch left and write its own back into the model. "
                "Analyze a copy built with stateful=False and the same weights (from the model's config with "
                "stateful=False, then copy.set_weights(model.get_weights())): every sequence then starts from the "
                "layer's initial state."
            )


def grouped_convolutions(model: Any) -> list[Any]:
    """The recognised grouped convolutions of ``model`` (``groups > 1``), whose call is replaced.

    TensorFlow has no CPU kernel for the derivatives of grouped convolutions, so
    these run as :func:`~normflat.backends.keras.calls.grouped_conv_call` instead.
    """
    return [layer for layer in compat.flatten_layers(model)
            if isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D))
            and getattr(layer, "groups", 1) > 1 and fast_kind(layer)]


def install_logit_calls(state: ModelState, strip: tuple[Any, str] | None, grouped: list[Any]) -> None:
    """Make the model compute the logits the analysis differentiates, as instance attributes on ``state``.

    The final softmax (:func:`~normflat.backends.keras_shared.final_softmax`) becomes
    the identity, since the built-in losses take logits, and the layers of a mixed precision
    policy compute in their variables' dtype (:func:`~normflat.backends.keras_shared.logits_only`,
    as Keras on the JAX backend does); the grouped convolutions (:func:`grouped_convolutions`)
    get their CPU-differentiable call. ``state.restore()`` puts the user's attributes back.

    Args:
        state: The model state that records and restores the attributes.
        strip: The ``(layer, attribute)`` of the final softmax, or None to keep it.
        grouped: The grouped convolutions.
    """
    logits_only(state, strip)
    for layer in grouped:
        state.set(layer, "call", grouped_conv_call(layer))


class KerasSession:
    """One Keras model under analysis (the engine's ``Session`` protocol).

    Args:
        model: A built Keras 3 model on the TensorFlow backend.
        options: The validated common options.
        config: The Keras backend options.
        strategy: The ``tf.distribute`` strategy to use (``None``: one device).
        rank: This worker's rank (the stream of the ``ggn-mc``/``ggn-topk`` draws).
        as_tensors: Return ``tf.Tensor`` diagonals in the kernel dtype
            (``hessian_diagonal``) instead of float64 numpy arrays (problems).
    """

    framework = "keras"

    def __init__(self, model: Any, options: AnalysisOptions, config: BackendConfig, strategy: Any = None,
                 rank: int = 0, as_tensors: bool = False) -> None:
        _check_model(model)
        # Taken first: the walk and the softmax detection read instance attributes that a
        # concurrent analysis of the same model may have set.
        self.state = ModelState(model)
        try:
            self._setup(model, options, config, strategy, rank, as_tensors)
            self._install()
        except BaseException:
            self.state.restore()
            raise

    def _setup(self, model: Any, options: AnalysisOptions, config: BackendConfig, strategy: Any, rank: int,
               as_tensors: bool) -> None:
        self.framework_version = keras.__version__
        self.adapter = ADAPTER
        self.model = model
        self.options = options
        self.config = config
        self.rank = rank
        self.as_tensors = as_tensors
        self.hvp = options.estimator in ("exact", "hutchinson")
        entries, self.unsupported, self.parameters = walk(model, options.on_unsupported, config.layers)
        if not config.fast:
            for e in entries:
                e.fast, e.reason = None, "fast=False"
        self.entries: list[Entry] = entries
        sizes = [int(np.prod(e.variable.shape)) for e in entries]
        self.total_params = sum(sizes)
        if options.estimator == "exact" and self.total_params > config.max_exact_params:
            raise ValueError(
                f"estimator='exact' needs one Hessian-vector product per weight; the analyzed layers have "
                f"{self.total_params} weights (limit {config.max_exact_params}). Use estimator='ggn' or "
                "'hutchinson', restrict layers=[...], or pass force=True (or max_exact_params=...) to run it "
                "anyway."
            )
        self.dtype = tf.as_dtype(entries[0].variable.dtype)
        self.device = str(entries[0].variable.value.device) or "cpu"
        self.host = "GPU" not in self.device.upper() and "TPU" not in self.device.upper()
        self._canonical_shapes: list[tuple[int, ...]] | None = None  # computed when first needed
        self.layers = [
            LayerSpec(e.name, e.weight.kind, e.variable.path, groups=int(e.weight.groups),
                      path="hvp" if self.hvp else ("fast" if e.fast else "generic"),
                      reason=None if self.hvp else e.reason, shared_with=list(e.shared_with),
                      extra={"layer_class": type(e.layer).__name__},
                      blocks=list(e.weight.blocks) if e.weight.blocks else None)
            for e in entries
        ]
        self.replicas = Replicas(strategy) if strategy is not None else None
        self.strip = None if callable(options.loss) else final_softmax(model)
        self.grouped = grouped_convolutions(model)
        self.num_classes = 0
        self.tokens: int | None = None  # T of token logits (n, T, C), None for (n, C) logits
        # Keras models compute no loss themselves, so nothing marks one that wants shifted
        # labels (keras-hub's CausalLM preprocessors shift the labels in the data): no shift
        # unless asked for (method §6.3).
        self.shift = bool(options.shift_labels)
        self._probed_for: Any = None
        self.input_size = 0
        self._logits_dense: Entry | None = None  # the Dense whose pre-activation is the logits (_probe_eager)
        # The logits' shape of the first probe: every later call of the model must have as many classes
        # (the probes, and the compiled steps while they are traced: model_logits).
        self._first_logits: tuple[int, ...] | None = None
        self._probe_logits: tuple[int, ...] | None = None  # the last probe's (cached with it)
        self.chunk: int | None = None
        self._probed = False
        self._step: Any = None
        self._step_tokens: Any = None
        self._holder: dict = {}
        self._probe_cache: list[tuple[range, list[Any]]] | None = None
        self._open_traces = OpenBatchTraces(callable(options.loss))
        # The value checks of the logits (and the loss) of every batch after the first, read in one
        # transfer after the loop (_run_checks): reading them per batch would wait for the device.
        self._pending: list[tuple[int, Any, Any, float]] = []
        self.saturation = math.inf  # the least softmax saturation of the checked batches (driver)
        self._updates = 0

    # ------------------------------------------------------------------ model state

    def _install(self) -> None:
        """Set the instance attributes this analysis needs (restored by :meth:`close`)."""
        state = self.state
        install_logit_calls(state, self.strip, self.grouped)
        if self.hvp:
            # Second derivatives through Layer/GroupNormalization need the plain variance.
            for layer in compat.flatten_layers(self.model):
                if is_plain_norm(layer):
                    state.set(layer, "call", norm_call(layer))
            self.taps = None
        else:
            self.taps = Taps(state, [e for e in self.entries if e.fast])

    def close(self) -> None:
        self.state.restore()

    # ------------------------------------------------------------------ engine protocol

    def signature(self) -> list[Any]:
        return [(e.name, tuple(int(d) for d in e.variable.shape), tf.as_dtype(e.variable.dtype).name)
                for e in self.entries]

    def _sum_shape(self, layer: int) -> tuple[int, ...]:
        """The shape of one group's sums: the variable's (Hessian-vector products) or canonical."""
        entry = self.entries[layer]
        if self.hvp:
            return tuple(int(d) for d in entry.variable.shape)
        if self._canonical_shapes is None:
            self._canonical_shapes = canonical_shapes(self.model, self.entries)
        return self._canonical_shapes[layer]

    def kernel_axes(self, layer: int) -> tuple[int, ...]:
        """A convolution's kernel axes, over which its groups are kept summed: the canonical ones
        (the GGN kernels' sums are canonical), or for the Hessian-vector products' sums, in the
        variable's layout, those its extractor declares (``KerasWeight.kernel_axes``)."""
        axes = self.entries[layer].weight.kernel_axes if self.hvp else tuple(range(2, len(self._sum_shape(layer))))
        shape = self._sum_shape(layer)
        return axes if int(np.prod([shape[a] for a in axes], dtype=np.int64)) > 1 else ()

    def zeros(self, layer: int) -> Any:
        shape = self._sum_shape(layer)
        if self.host:
            return np.zeros((self.options.sum_groups, *shape))
        return tf.zeros((self.options.sum_groups, *shape), tf.float64)

    def all_finite(self, array: Any) -> bool:
        # The engine's first call after the data: the deferred checks first, so that bad logits
        # get their own message rather than "the diagonal is not finite".
        self._run_checks()
        if isinstance(array, np.ndarray):
            return bool(np.isfinite(array).all())
        return bool(tf.reduce_all(tf.math.is_finite(array)))

    def canonical(self, layer: int, array: Any) -> Any:
        entry = self.entries[layer]
        if self.hvp:
            array = entry.weight.to_canonical(tf.convert_to_tensor(array))
        if self.as_tensors:
            if isinstance(array, np.ndarray):  # astype then constant: twice as fast as constant(dtype=)
                return tf.constant(array.astype(tf.as_dtype(entry.variable.dtype).as_numpy_dtype, copy=False))
            return tf.cast(array, entry.variable.dtype)
        return np.asarray(array, dtype=np.float64)

    def _add(self, state: SumState, layer: int, value: Any) -> None:
        """Add a kernel's output to the sums, which are float64 from the second contribution on.

        On the CPU the sums are numpy arrays: a CPU tensor's ``__array__`` is a
        view, and numpy's arithmetic has a fraction of TensorFlow's per-op
        overhead, which matters for small models. The first contribution is kept
        as it is (a float32 view for a float32 model): a batch in one chunk is
        then only divided by its size, correctly rounded, instead of being cast
        back and forth. On an accelerator the sums stay on the device, in float64.
        """
        if isinstance(value, TableRows):
            self._add_rows(state, layer, value)
            return
        # An exact Dense head's step returns its one shared sum (ggn._head_squares): SumState.add_sums.
        if self.host:
            arr = np.asarray(value)
            state.add_sums(layer, arr if state.sums[layer] is None else arr.astype(np.float64), self.options.sum_groups)
        else:
            state.add_sums(layer, tf.cast(value, tf.float64), self.options.sum_groups)

    def _add_rows(self, state: SumState, layer: int, value: TableRows) -> None:
        """Add an embedding's squares on the rows a step read (:class:`~normflat.backends.keras.ggn.
        TableRows`) into its running ``(K, features, vocabulary)`` sums, in place on the host (float64
        zeros at the first contribution); on a device, or into sums the state may not write, as the
        dense table."""
        if self.host:
            if state.sums[layer] is None:
                state.add(layer, np.zeros((int(value.values.shape[0]), *self._sum_shape(layer))), owned=True)
            sums = state.accumulator(layer)
            if sums is not None:
                sums[:, :, np.asarray(value.rows)] += np.asarray(value.values)  # distinct rows
                return
        self._add(state, layer, value.dense(int(self.entries[layer].variable.shape[0])))

    def weight(self, layer: int) -> Any:
        if self.as_tensors:
            return None  # hessian_diagonal reports no weights: skip the copy (it costs as much as a small step)
        e = self.entries[layer]
        return np.asarray(e.weight.to_canonical(tf.convert_to_tensor(e.variable.value)).numpy(), dtype=np.float64)

    def metadata(self) -> dict[str, Any]:
        backend: dict[str, Any] = {"keras_version": keras.__version__, "tensorflow_version": tf.__version__}
        if self.strip is not None:
            backend["stripped_softmax"] = self.strip[0].name
        if self.replicas is not None:
            backend.update(self.replicas.describe())
        return {
            "dtype": self.dtype.name,
            "device": self.device,
            "chunk_size": self.chunk,
            "memory_budget": self.config.memory_budget,
            "backend": backend,
            "token_logits": self.tokens is not None,
        }

    def update(self, batch: Batch, state: SumState) -> int | None:
        # A mapping batch (Hugging Face style, ``batch.keywords``) is the dict of the model's
        # named inputs: Keras models take it positionally, model(x_dict) (keras-hub backbones).
        x = to_tensor(batch.x)
        signature = self._signature(x)
        if not self._probed or signature != self._probed_for:
            self._probe(x, batch)  # again when the shapes change: T of token logits may differ
            self._probed_for = signature
        if self.options.estimator == "auto":
            # The classes and tokens are known now (the probe): the driver reads the resolved
            # options back for the finalize and the metadata, and every compiled step is keyed on
            # them. Token logits count the signals per sequence (method §6.3).
            self.options = resolve_estimator(self.options, self.num_classes, tokens=self.tokens)
        # Before a label refused for the probe's classes: logits whose classes follow the rows show
        # only in the steps' traces, which come after the labels (the probe of 2 rows against one row).
        with classes_first(self._first_logits, self._one_row(x)):
            labels = labels_for(batch, self.num_classes, ADAPTER, self.options, tokens=self.tokens, shift=self.shift)
        if self.hvp:
            self._update_hvp(x, labels, batch, state)
        else:
            self._update_ggn(x, labels, batch, state)
        self._updates += 1
        if self.replicas is not None or len(self._pending) >= PENDING_CHECKS:
            self._run_checks()  # distributed: every worker must learn of a bad batch in this step
        if self.tokens is None or labels is None:
            return None
        return int(np.count_nonzero(labels >= 0))  # the counted tokens (method §6.3)

    # ------------------------------------------------------------------ first forward

    @staticmethod
    def _signature(x: Any) -> Any:
        return tuple((tuple(t.shape[1:]), t.dtype.name) for t in tf.nest.flatten(x))

    def _probe_key(self, x: Any) -> Any:
        return (self._signature(x), self._probe_key_output(),
                tuple((e.name, id(e.variable.value), e.fast) for e in self.entries),
                None if self.strip is None else id(self.strip[0]), tuple(id(l) for l in self.grouped),
                callable(self.options.loss), self.hvp)

    def _probe(self, x: Any, batch: Batch) -> None:
        """The first forward: number of classes, logits checks, which taps really fired.

        For the GGN the result is cached per model and input signature (an eager
        Keras forward costs as much as a compiled GGN step of a small model); the
        compiled steps check the logits of every chunk anyway.
        """
        key = self._probe_key(x)
        cached = None if self.hvp else _cached(_PROBES, self.model, key, None)
        if cached is not None:
            self.num_classes, self.tokens, self.input_size, fast, head, self._probe_logits = cached
            # The shape checks again (shapes only): this analysis' options may refuse what the cached
            # probe's accepted (2 classes with nsce), and its first call is compared with the probe's.
            check_output_shape(self._probe_logits, self.options, batch.index, self._probe_logits[0],
                               seen=self._first_logits, other_rows=self._one_row(x))
            for entry, (f, rank, in_size, pre_size, fold, calls, reason) in zip(self.entries, fast):
                entry.fast, entry.input_rank, entry.in_size, entry.pre_size, entry.fold, entry.calls, entry.reason = (
                    f, rank, in_size, pre_size, fold, calls, reason)
            self._logits_dense = None if head is None else self.entries[head]
        else:
            self._probe_eager(x, batch)
            if not self.hvp:
                head = None if self._logits_dense is None else self.entries.index(self._logits_dense)
                _store(_PROBES, self.model, key, (self.num_classes, self.tokens, self.input_size,
                                                  [(e.fast, e.input_rank, e.in_size, e.pre_size, e.fold, e.calls,
                                                    e.reason) for e in self.entries], head, self._probe_logits))
        if self._first_logits is None:
            self._first_logits = self._probe_logits
        if not self.hvp:
            for spec, e in zip(self.layers, self.entries):
                spec.path, spec.reason = ("fast", None) if e.fast else ("generic", e.reason)
                if e.fast == UNUSED:
                    spec.extra["unused"] = UNUSED_NOTE
                else:
                    spec.extra.pop("unused", None)
        self._probed = True

    def _one_row(self, x: Any) -> Callable[[], tuple[int, ...]]:
        """The shape of the logits of the model called on the first row of ``x`` alone, as a function
        (:func:`~normflat.engine.losses.classes_first`: asked before refusing the first logits' classes)."""
        return lambda: tuple(model_logits(self.model, _slice(x, 0, 1), self.options).shape)

    def _rows_alone(self, x: Any, rows: int) -> list[Any] | Exception:
        """The logits of each of the first ``rows`` rows of ``x`` from a forward of that row alone (host
        arrays, :func:`~normflat.engine.losses.check_samples_apart`), or the error of a model that fails
        on one row: nothing to compare, and the generic path would fail the same way
        (:func:`~normflat.engine.losses.one_sample_error`, raised by :meth:`_probe_eager` where a weight
        takes it)."""
        try:
            return [np.asarray(model_logits(self.model, _slice(x, i, i + 1), self.options), dtype=np.float64)
                    for i in range(rows)]
        except Exception as err:  # noqa: BLE001 - see the docstring
            return err

    def forward_error(self, batch: Batch) -> BaseException | None:
        """The model's error on the first rows of ``batch`` (inputs it does not take), from an eager
        forward without a tape, its taps' records left as they were; ``None`` where it runs or where
        normflat raised the error itself (engine protocol)."""
        records = None if self.taps is None else {k: list(v) for k, v in self.taps.records.items()}
        try:
            x = to_tensor(batch.x)
            model_logits(self.model, _slice(x, 0, min(batch.n, SAMPLES_APART_ROWS)), self.options)
        except Exception as err:  # noqa: BLE001 - returned, as the protocol asks
            return None if raised_by_normflat(err) else err
        finally:
            if records is not None:
                self.taps.records.clear()
                self.taps.records.update(records)
        return None

    def _probe_eager(self, x: Any, batch: Batch) -> None:
        rows = min(batch.n, 2)
        first = _slice(x, 0, rows)
        # Before the taps' records are cleared: these forwards must leave none of their own.
        alone = self._rows_alone(x, rows) if rows == SAMPLES_APART_ROWS else None
        if self.taps is not None:
            self.taps.records.clear()
        with first_forward("keras", batch):
            z = model_logits(self.model, first, self.options)
        self._probe_logits = tuple(int(d) for d in z.shape)
        self.num_classes = check_output_shape(self._probe_logits, self.options, batch.index, rows,
                                              seen=self._first_logits, other_rows=self._one_row(x))
        self.tokens = int(z.shape[1]) if len(z.shape) == 3 else None
        zc = tf.cast(tf.reshape(z, [-1, self.num_classes]), compute_dtype(z.dtype))
        self.saturation = min(self.saturation, check_logit_stats(
            logit_stats(TF, zc), self.options, batch.index, self.num_classes,
            float(np.finfo(zc.dtype.as_numpy_dtype).eps)))
        if isinstance(alone, list):
            check_samples_apart(np.asarray(z, dtype=np.float64), alone, dtype=logits_rounding(self.model, z))
        if self.taps is not None:
            # The one Dense whose pre-activation is the logits themselves (the step's head test).
            heads = [e for e in self.entries if e.fast == "dense" and not is_lora(e.layer)
                     and any(r[1] is z for r in self.taps.records.get(e.name, []))]
            self._logits_dense = heads[0] if len(heads) == 1 else None
            idle: list[Entry] = []  # called by no forward: perhaps unused (_unused)
            for entry in self.entries:
                if entry.fast and entry.fast != "table" and not self.taps.records.get(entry.name):
                    idle.append(entry)
                if entry.fast == "tied":
                    self._probe_tied(entry, self.taps.records.get(entry.name, []))
                elif entry.fast in RECURRENT_KINDS:
                    self._probe_recurrent(entry, self.taps.records.get(entry.name, []))
                elif entry.fast and entry.fast != "table":  # a loose table has no call: _first_checks
                    recs = self.taps.records.get(entry.name, [])
                    entry.calls = 1
                    if (entry.fast in ("dense", "einsum", "conv", "depthwise", "embedding", *LORA_KINDS)
                            and len(recs) > 1
                            and all(r[1] is not None for r in recs) and entry is not self._logits_dense):
                        # A Dense, EinsumDense, convolution or Embedding called several times per
                        # forward (shared by branches, applied in a loop): every call is recorded,
                        # their per-sample gradients summed (the step).
                        entry.calls = len(recs)
                        entry.input_rank = len(recs[0][0].shape)
                        entry.in_size = sum(_per_sample_elements(r[0]) for r in recs)
                        entry.pre_size = sum(_per_sample_elements(r[1]) for r in recs)
                    elif len(recs) != 1 or recs[0][1] is None:
                        # A shared or bypassed layer: its one input/pre-activation is not the whole story.
                        entry.fast, entry.reason = None, "called more than once per forward, or bypassed"
                    else:
                        entry.input_rank = len(recs[0][0].shape)
                        entry.in_size = _per_sample_elements(recs[0][0])
                        entry.pre_size = _per_sample_elements(recs[0][1])
            self.taps.records.clear()
            self._unused(idle, first)
            self._first_checks(x, batch, z)
        self.input_size = sum(_per_sample_elements(t) for t in tf.nest.flatten(first))
        if isinstance(alone, Exception) and not self.hvp:
            # The weights are on their paths now: the generic path runs each sample alone.
            generic = [e.name for e in self.entries if not e.fast]
            if generic:
                raise one_sample_error("keras", alone, generic, self.config.fast) from alone

    def _unused(self, idle: list[Entry], first: Any) -> None:
        """The weights whose layers the first forward never called and that the logits do not depend
        on (an untied reverse projection left out by a backbone-only model): zero curvature, no
        path (``Entry.fast == "unused"``, method §6.1, "Weights no forward uses"), as in the torch
        backend; a weight the logits reach another way keeps the generic path. One forward under
        a tape on the probe's rows, only when some layer was not called. The probe is per input
        signature, and so is a step: a signature that calls the layer takes its own path."""
        if not idle:
            return
        variables = [e.variable.value for e in idle]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(variables)
            z = model_logits(self.model, first, self.options)
        grads = tape.gradient(z, variables)
        if self.taps is not None:
            self.taps.records.clear()
        for entry, grad in zip(idle, grads):
            if grad is None:
                entry.fast, entry.reason, entry.calls = UNUSED, None, 0

    @staticmethod
    def _probe_recurrent(entry: Entry, recs: list) -> None:
        """A recurrent cell's weight keeps its fast rule when its layer ran the recorded recurrence
        once: one record for ``kernel``, one per column range for ``recurrent_kernel``
        (:func:`~normflat.backends.keras.calls.state_blocks`). A layer called twice (shared by two
        inputs) records twice, a cell run by another loop (``StackedRNNCells``, a custom ``RNN``
        call) not at all."""
        entry.calls = 1
        expected = 1 if entry.fast == RECURRENT_KINDS[0] else len(state_blocks(entry.layer))
        if len(recs) != expected:
            runs = len(recs) // expected
            entry.fast, entry.reason = None, (
                f"its recurrent layer ran {runs} times per forward (the fast rule takes one run)" if runs > 1 else
                "its cell is not run by the loop of an LSTM, GRU or SimpleRNN layer of its own")
            return
        entry.input_rank = len(recs[0][0].shape)
        entry.in_size = sum(_per_sample_elements(r[0]) for r in recs)
        entry.pre_size = sum(_per_sample_elements(r[1]) for r in recs)

    @staticmethod
    def _probe_tied(entry: Entry, recs: list) -> None:
        """A tied ``ReversibleEmbedding`` keeps its fast rule when the first forward calls it as a
        lookup any number of times (an encoder's and a decoder's ids: their positions go together)
        and at most once as the reverse projection (``reverse`` a Python bool): its squares sum the
        recorded calls' per-sample gradients, so every use of the table must be one of them (uses
        outside the layer are :meth:`_first_checks`')."""
        modes = [r[2] for r in recs]
        if not recs:
            entry.fast, entry.reason = None, "called more than once per forward, or bypassed"
        elif None in modes:
            entry.fast, entry.reason = None, "its reverse argument is not a Python bool (no tied fast rule)"
        elif modes.count(True) > 1:
            entry.fast, entry.reason = None, (
                f"{modes.count(False)} lookup call(s) and {modes.count(True)} reverse call(s) per forward (the tied "
                "fast rule takes any lookups and at most one reverse call)")
        else:
            entry.input_rank = len(recs[0][0].shape)
            entry.in_size = sum(_per_sample_elements(r[0]) for r in recs)
            entry.pre_size = sum(_per_sample_elements(r[1]) for r in recs)

    def _first_checks(self, x: Any, batch: Batch, z: Any) -> None:
        """The fast rules need each weight used by its own layer's call only, and the position
        tables each sample's gradient where the signal is taken.

        Every fast rule forms a weight's squares from its layer's input and pre-activation (or
        output): a weight also read elsewhere (another layer or op reading ``layer.kernel``)
        would miss that use's share of every per-sample gradient. A loose table
        (``Entry.fast == "table"``) runs with its attribute set to the table expanded over the
        batch (:meth:`~normflat.backends.keras.ggn.Taps.expanded`); a ``PositionEmbedding``
        (``"position"``) is tapped at its output. On two rows of the first batch (one row twice if
        it has one), one forward under a tape, in which every tapped layer reads its weight
        without a gradient (:meth:`~normflat.backends.keras.ggn.Taps.own_read`), checks, as the
        torch backend does (method §6.1):

        * no gradient reaches the variable itself (the layer's own read, and a table's expanded
          view, carry none here): the weight is not used another way;
        * the forward runs with the expanded tables and computes the same logits;
        * a signal at the last sample's logits reaches only that sample's row of a table's view
          (or of the layer's output): the samples are not mixed;
        * a ``PositionEmbedding``'s output is whole rows of its table, one per position, each
          feature in its place (:meth:`~normflat.backends.keras.ggn.Taps.rows`), and its row
          numbers are exact in the dtypes involved.

        A weight failing a check takes the generic path, the reason in its ``generic_reason``.
        """
        checked = [e for e in self.entries if e.fast and e.fast != UNUSED]
        if not checked or self.taps is None:
            return
        taps, options = self.taps, self.options
        n = batch.n
        x2 = _slice(x, 0, 2) if n >= 2 else tf.nest.map_structure(lambda t: tf.concat([t, t], 0), x)
        if n < 2:
            z = model_logits(self.model, x2, options)
        z = z[:2]

        def refuse(entries: list[Entry], reason: str) -> None:
            for e in entries:
                e.fast, e.reason = None, reason

        taps.checking = True
        try:
            while True:
                checked = [e for e in checked if e.fast]
                if not checked:
                    return
                taps.records.clear()
                taps.refused.clear()
                try:
                    with tf.GradientTape(persistent=True) as tape:
                        taps.tape = tape
                        watched = [_readable(e.variable.value) for e in checked]
                        for variables in watched:
                            tape.watch(variables)
                        with taps.expanded(x2):
                            expanded = model_logits(self.model, x2, options)
                    break
                except Exception as why:  # noqa: BLE001 - any failure of the checking forward
                    loose = [e for e in checked if e.fast == "table"]
                    looked_up = [e for e in checked if e.name in taps.broadcast]
                    what = f"({type(why).__name__}: {str(why)[:200]})"
                    if not loose and not looked_up:
                        refuse(checked, f"the first forward's check of its layer fails {what}")
                        return
                    refuse(loose, f"the forward fails with the position table expanded over the batch {what}")
                    refuse(looked_up, f"the forward fails with its one row of ids looked up per sample {what}")
                finally:
                    taps.tape = None
            for e in checked:
                if e.name in taps.refused:
                    refuse([e], taps.refused[e.name])
            for e, grads in zip(checked, tape.gradient(expanded, watched)):
                if not e.fast or all(g is None for g in grads):
                    continue
                if e.fast == "table":
                    refuse([e], "the position table is also used outside its layer attribute")
                elif e.fast == "position":
                    refuse([e], "the position table is also used outside its PositionEmbedding layer")
                else:
                    refuse([e], "its weight is also used outside its layer's call (another layer or op reads it)")
            substituted = [e for e in checked if e.fast == "table" or (e.fast and e.name in taps.broadcast)]
            if substituted:
                zc = tf.cast(z, tf.float64)
                tol = 64 * float(np.finfo(z.dtype.as_numpy_dtype).eps) * (float(tf.reduce_max(tf.abs(zc))) + 1.0)
                if tuple(expanded.shape) != tuple(z.shape) or \
                        float(tf.reduce_max(tf.abs(tf.cast(expanded, tf.float64) - zc))) > tol:
                    refuse([e for e in substituted if e.fast == "table"],
                           "the model computes other logits with the position table expanded over the batch")
                    refuse([e for e in substituted if e.fast == "embedding"],
                           "the model computes other logits with its one row of ids looked up per sample")
            self._check_rows(tape, expanded, [e for e in checked if e.fast])
            del tape
            for e in [e for e in checked if e.fast in ("table", "position")]:
                record = taps.records[e.name][0]
                if e.fast == "position" and not _whole_rows(e, *record):
                    refuse([e], "its output is not whole rows of its table, one per position")
                    continue
                view = record[1]
                e.input_rank, e.pre_size = len(view.shape), _per_sample_elements(view)
                e.in_size = 0 if e.fast == "table" else _per_sample_elements(record[0])  # rows: like the output
        finally:
            taps.checking = False
            taps.records.clear()

    def _check_rows(self, tape: Any, expanded: Any, entries: list[Entry]) -> None:
        """Which rows of each fast layer's tapped tensors belong to which of the two checked samples.

        The fast rules take the leading axis for the samples: a signal at the last sample's
        logits ``expanded`` (recorded on ``tape``) must reach only the last row of each layer's tapped output (which
        catches a layer on a batch-independent table that happens to have two rows). A ``Dense``
        or ``EinsumDense`` may see the batch folded into that axis instead (``(n·f, ...)``:
        attention windows, each sample's ``f`` windows one after the other): its per-sample
        gradient sums the sample's block of rows (:attr:`Entry.fold`), accepted when the signal
        reaches only the last block. A lookup of one row of ids looked up per sample
        (:attr:`~normflat.backends.keras.ggn.Taps.broadcast`) and a position table's output (a loose
        table's view, a ``PositionEmbedding``'s rows) are checked the same way, one row per sample.
        Any other leading axis takes the generic path, which is exact.
        """
        checks = []
        for e in entries:
            records = self.taps.records.get(e.name, [])
            if e.fast in ("table", "position"):
                view = records[0][1] if records else None
                if view is None or int(view.shape[0]) != 2:
                    e.fast, e.reason = None, "its output is not one row per sample"
                else:
                    checks.append((e, 1, [view]))
                continue
            sizes = {int(t.shape[0]) if t is not None and len(t.shape) else -1 for r in records for t in r[:2]}
            e.fold = 1
            size = sizes.pop() if len(sizes) == 1 else -1
            if size != 2 and e.calls > 1:
                e.fast, e.reason = None, (
                    f"called {e.calls} times per forward with a leading axis ({size if size > 0 else 'varies'}) "
                    "that is not one row per sample")
                continue
            dense = e.fast in ("dense", "einsum") or (e.fast in LORA_KINDS and fast_kind(e.layer) in ("dense", "einsum"))
            if size != 2 and (not dense or size < 2 or size % 2):
                e.fast, e.reason = None, (
                    f"its input or output's leading axis ({size if size > 0 else 'varies'}) is not one row (or, for a "
                    "dense layer, one block of rows) per sample")
                continue
            checks.append((e, size // 2, [r[1] for r in records]))
        if not checks:
            return
        probe = np.zeros(tuple(expanded.shape), np.float64)
        probe[-1] = np.linspace(1.0, 2.0, probe[-1].size).reshape(probe[-1].shape)
        probe = tf.constant(probe, expanded.dtype)
        grads = iter(tape.gradient(expanded, [out for _, _, outs in checks for out in outs], output_gradients=probe))
        for e, fold, outs in checks:
            reached = [g for g in (next(grads) for _ in outs) if g is not None]
            if any(float(tf.reduce_max(tf.abs(tf.convert_to_tensor(g)[:-fold]))) > 0 for g in reached):
                if e.fast in ("table", "position"):
                    why = "the position table is not added to each sample's own activations"
                elif e.name in self.taps.broadcast:
                    why = "its one row of ids looked up per sample is not added to each sample's own activations"
                elif fold == 1:
                    why = "its output's leading axis is not the batch"
                else:
                    why = f"its input's leading axis has {fold} rows per sample, but not one block of rows per sample"
                e.fast, e.reason = None, f"{why} (one sample's signal reaches the other samples' rows)"
                continue
            e.fold = fold
            e.in_size, e.pre_size = e.in_size * fold, e.pre_size * fold  # per sample: the whole block

    # ------------------------------------------------------------------ chunks and replicas

    def _pieces(self, n: int, chunk: int) -> list[tuple[int, int]]:
        """Balanced chunks of a batch of ``n`` (fewer distinct shapes to trace), at least one per replica."""
        count = -(-n // chunk)
        if self.replicas is not None:
            count = min(n, max(count, self.replicas.local))
        size = -(-n // count)
        return [(a, min(a + size, n)) for a in range(0, n, size)]

    def _map(self, fn: Callable[..., Any], args: list[tuple], shared: tuple = (), batched: int = 2) -> Iterator[Any]:
        """``fn(*a, *shared)`` for every ``a`` in ``args``: in order on one device, or dealt to the replicas.

        The results come one at a time (one round of the replicas at a time), each computed when
        the caller asks for it: a caller that adds each into its sums before taking the next holds
        one piece's weight-sized outputs, not every piece's (a language model's head and
        embedding: 25 MiB per piece on the 50000-token model of ``benchmarks.keras_diag``).

        ``batched``: how many leading arguments of each ``a`` have the batch axis first (traced
        with it open, :class:`OpenBatchTraces`).
        """
        if self.replicas is None:
            if args:
                count = len(args[0]) + len(shared)
                self._open_traces.trace(fn, (*args[0], *shared), [i < batched for i in range(count)])
            return (fn(*a, *shared) for a in args)
        return self._map_replicas(fn, args, shared)

    def _map_replicas(self, fn: Callable[..., Any], args: list[tuple], shared: tuple) -> Iterator[Any]:
        local = self.replicas.local
        for r in range(0, len(args), local):
            round_args = list(args[r:r + local])
            real = len(round_args)
            round_args += [round_args[0]] * (local - real)  # idle replicas recompute a piece, ignored
            yield from self.replicas.call(fn, round_args, shared)[:real]

    # ------------------------------------------------------------------ GGN

    def _default_budget(self, rows: int) -> int:
        """The GGN working memory without ``memory_budget``: about twice a training step (method §9).

        A training step of the model on this batch (per replica under a strategy), from
        :func:`~normflat.core.memory.training_step_bytes`: every model variable, and as
        activations the pre-activations of the tapped layers and the logits; less the
        per-layer sums the estimator holds (``K'`` per analyzed weight entry, one pooled), at least
        :data:`~normflat.core.memory.DEFAULT_BUDGET_FLOOR` (the rule of the torch backend).
        """
        item = self.dtype.size
        if self.replicas is not None:
            rows = -(-rows // max(1, self.replicas.local))
        params = sum(int(np.prod(v.shape, dtype=np.int64)) for v in self.model.weights)
        # (A LoRA factor's record is its frozen kernel's: one pre-activation.)
        per_sample = sum(e.pre_size for e in self.entries if e.fast and e.fast not in LORA_KINDS) \
            + self.num_classes * (self.tokens or 1)
        step = training_step_bytes(params, per_sample * rows, item)
        state = item * estimators.state_entries(self.options, [
            (int(np.prod(e.variable.shape, dtype=np.int64)),
             int(np.prod([self._sum_shape(i)[a] for a in self.kernel_axes(i)], dtype=np.int64)))
            for i, e in enumerate(self.entries)])
        return default_budget(step, state)

    def _ggn_step(self, rows: int) -> tuple[Any, int, int]:
        options = self.options
        # The real signals of the engine's layout, padding (and per-sequence ggn-topk's zero
        # group 0) dropped: (K', M·T) per token, (K', M') per sequence (ggn.signal_layout).
        signals = len(signal_layout(options, self.num_classes, self.tokens)[0])
        # Equal blocks of at most SIGNAL_BLOCK: the last block's padding is back-propagated too
        # (a compiled step has a fixed block), so 20 signals go as 10 + 10, not 16 + 16.
        block = equal_step(signals, SIGNAL_BLOCK) if signals else 1
        sequence = options.sequence_layout(self.tokens)
        # The default budget, formed at most once per call (the block's and the chunk's choices).
        budget_by_default = functools.cache(lambda: self._default_budget(rows))
        if self._step is not None and self._step_tokens[0] == self.tokens \
                and self._step_tokens[2:] == (options.estimator, sequence):
            block = self._step_tokens[1]  # chosen with the step (a smaller last batch keeps it)
        elif self.config.chunk_size is None:
            explicit = self.config.memory_budget is not None
            block = self._budget_block(signals, block, self.config.memory_budget if explicit
                                       else budget_by_default(), refuse=explicit)
        key_tokens = (self.tokens, block, options.estimator, sequence)
        if self._step is not None and self._step_tokens != key_tokens:
            self._step = None  # another sequence length: another signal layout
        if self._step is None:
            self._step_tokens = key_tokens
            key = ("ggn", options.estimator, options.pooled, options.loss, options.temperature, options.samples,
                   options.top_classes, self.num_classes, self.tokens, sequence, self._probe_key_output(),
                   tuple((e.name, e.fast, id(e.variable.value), e.weight.kind, e.fold) for e in self.entries),
                   None if self.strip is None else (id(self.strip[0]), self.strip[1]),
                   tuple(id(layer) for layer in self.grouped), block)

            def factory():
                holder: dict = {}
                return ggn_step_fn(self.model, self.entries, options, options.state_groups, block, self.num_classes,
                                   holder, tokens=self.tokens), holder

            self._step, self._holder = _cached(_COMPILED, self.model, key, factory)
            if self.config.chunk_size is not None:
                self.chunk = self.config.chunk_size
            else:
                linear, fixed = self._step_bytes(block)
                budget = None if self.config.memory_budget is not None else budget_by_default()
                self.chunk = ggn_chunk_size(linear, self.config.memory_budget, block, budget, fixed)
        self._holder["taps"] = self.taps
        self._holder["logits"] = self._first_logits  # checked as the step is traced (model_logits)
        return self._step, signals, block

    def _step_bytes(self, block: int) -> tuple[int, int]:
        """:func:`~normflat.backends.keras.ggn.ggn_bytes` of a step of ``block`` signals per sample."""
        return ggn_bytes(self.entries, self.dtype, self.input_size, self.num_classes * (self.tokens or 1), block,
                         head=self._structured_head(), groups=self.options.sum_groups)

    def _structured_head(self) -> Entry | None:
        """The ``Dense`` head whose input the step starts the other layers' signals at, as
        :func:`~normflat.backends.keras.ggn.ggn_step_fn` decides it (the first forward's one fast
        ``Dense`` whose pre-activation is the logits, an exact head rule, ``(n, C)`` logits or
        per-sequence signals, an input of rank 2 or 3 with the tokens), for the memory estimate."""
        e = self._logits_dense
        if e is None or e.fast != "dense" or not exact_head(self.options, self.num_classes):
            return None
        others = sum(1 for f in self.entries if f.fast) - 1  # the fast layers whose signals start there
        if not others or not starts_at_head_input(self.options, self.tokens, e.input_rank):
            return None
        return e

    def _budget_block(self, signals: int, block: int, budget: int, refuse: bool) -> int:
        """Signals per block within ``budget`` bytes: ``block``, or fewer (equal blocks, down to one)
        when one sample with ``block`` of them does not fit, as the torch and JAX backends step
        through one sample's signals (method §9, "Memory"). ``refuse`` (the user's
        ``memory_budget``): a budget that one signal does not fit is an error."""
        while block > 1 and sum(self._step_bytes(block)) > budget:
            most = max(1, block // 2)
            block = equal_step(signals, most)
        if block == 1 and refuse:
            chunk_size_for(budget, sum(self._step_bytes(1)), "one back-propagated GGN signal")
        return block

    def _update_ggn(self, x: Any, labels: np.ndarray | None, batch: Batch, state: SumState) -> None:
        step, signals, block = self._ggn_step(batch.n)
        options = self.options
        out_dtype = compute_dtype(self.dtype)
        pieces = self._pieces(batch.n, self.chunk)
        if self.tokens is not None:
            counted = (labels >= 0).astype(np.float64)  # (n, T): tokens whose label is counted
        else:
            counted = np.zeros((batch.n, 0))
        args = []
        for a, b in pieces:
            xc = x if (a, b) == (0, batch.n) else _slice(x, a, b)
            if options.draws:
                # Token t of a sequence takes columns t·D .. (t+1)·D − 1: its S class draws, then
                # per-sequence ggn-topk's sign columns (options.uniform_columns, losses.token_signals).
                u = sample_uniforms(options.seed, self.rank, batch.offset + a, b - a,
                                    options.uniform_columns(self.tokens))
            else:
                u = np.zeros((b - a, 0))
            args.append((xc, tf.constant(u, out_dtype), tf.constant(counted[a:b], out_dtype)))
        eps = float(np.finfo(out_dtype.as_numpy_dtype).eps)
        for start in range(0, signals, block):
            results = self._map(step, args, (tf.constant(start, tf.int32),), batched=3)
            for sums, stats in results:
                if start == 0:
                    self._defer(batch.index, stats, None, eps)
                for i in range(len(sums)):
                    self._add(state, i, sums[i])
                    sums[i] = None  # added: released before the next piece is computed

    # ------------------------------------------------------------------ exact / hutchinson

    def _probe_key_output(self) -> Any:
        output = self.options.output
        return output if output is None or isinstance(output, (str, int)) else id(output)

    def _hvp_steps(self) -> tuple[Any, Any]:
        if self._step is None:
            options = self.options
            key = ("hvp", options.estimator, options.loss, options.temperature, options.groups,
                   self._probe_key_output(),
                   tuple((e.name, id(e.variable.value), e.weight.kind) for e in self.entries),
                   None if self.strip is None else (id(self.strip[0]), self.strip[1]),
                   tuple(id(layer) for layer in self.grouped))

            def factory():
                holder: dict = {}
                return hvp_step_fns(self.model, self.entries, options, options.groups, holder,
                                    sequential=has_recurrence(self.model),
                                    probes_sequential=probes_in_sequence(self.model)), holder

            self._step, self._holder = _cached(_COMPILED, self.model, key, factory)
            self.chunk = self.config.chunk_size or HVP_CHUNK
        return self._step

    def _probe_blocks(self) -> list[tuple[range, list[Any]]]:
        """The Hutchinson probes in blocks: ``[(probe indices, per-layer (m, *shape) tensors)]``."""
        if self._probe_cache is not None:
            return self._probe_cache
        samples = self.options.samples
        chunk = max(1, min(samples, PROBE_BLOCK // max(self.total_params, 1)))
        layout = [native_positions(e) for e in self.entries]
        blocks = []
        for a in range(0, samples, chunk):
            probes = range(a, min(a + chunk, samples))
            blocks.append((probes, [
                tf.constant(native_probes(self.options.seed, i, probes, pos, shape,
                                          tuple(int(d) for d in e.variable.shape)), e.variable.dtype)
                for i, (e, (pos, shape)) in enumerate(zip(self.entries, layout))
            ]))
        if samples * self.total_params * self.dtype.size <= PROBE_CACHE_BYTES:
            self._probe_cache = blocks  # the same probes for every batch (method §6)
        return blocks

    def _check(self, loss: Any, stats: Any, batch: Batch) -> None:
        self._defer(batch.index, stats, loss, float(np.finfo(compute_dtype(self.dtype).as_numpy_dtype).eps))

    def _defer(self, index: int, stats: Any, loss: Any, eps: float) -> None:
        """Queue a piece's logit statistics (and loss) for :meth:`_run_checks`; the first batch's
        are checked at once."""
        self._pending.append((index, stats, loss, eps))
        if self._updates == 0:
            self._run_checks()

    def _run_checks(self) -> None:
        """Read the queued checks in one transfer, in batch order, and raise the first failure
        with the message an eager check gives."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        parts = []
        for _, stats, loss, _ in pending:
            parts.append(tf.cast(tf.reshape(stats, [-1]), tf.float64))
            if loss is not None:
                parts.append(tf.cast(tf.reshape(loss, [-1]), tf.float64))
        values = iter(np.asarray(tf.concat(parts, 0)))
        for index, stats, loss, eps in pending:
            got = np.asarray([next(values) for _ in range(int(np.prod(stats.shape)))])
            self.saturation = min(self.saturation, check_logit_stats(got, self.options, index,
                                                                     self.num_classes, eps))
            if loss is not None:
                value = np.asarray([next(values) for _ in range(int(np.prod(loss.shape)))])
                check_loss_value((), bool(np.all(np.isfinite(value))), index, self.options)

    def _update_hvp(self, x: Any, labels: np.ndarray | None, batch: Batch, state: SumState) -> None:
        exact_step, hutchinson_step = self._hvp_steps()
        self._holder["index"] = batch.index
        self._holder["logits"] = self._first_logits  # checked as the steps are traced (model_logits)
        if callable(self.options.loss):
            target = to_tensor(batch.y)
        else:
            target = tf.constant(labels, tf.int32)
        pieces = self._pieces(batch.n, self.chunk)
        args = [((x, target) if (a, b) == (0, batch.n) else (_slice(x, a, b), target[a:b])) for a, b in pieces]
        if self.options.estimator == "exact":
            total = self.total_params
            block = max(1, min(total, EXACT_BLOCK // max(total, 1)))
            sizes = [int(np.prod(e.variable.shape)) for e in self.entries]
            parts: list[list[Any]] = [[] for _ in pieces]
            for a in range(0, total, block):
                # Every block as long as the first (the last one repeats the final entry), so that
                # one trace serves them all.
                indices = tf.minimum(tf.range(a, a + block), total - 1)
                results = self._map(exact_step, args, (indices,))
                for p, (diag, loss, stats) in enumerate(results):
                    if a == 0:
                        self._check(loss, stats, batch)
                    parts[p].append(diag[:min(block, total - a)])
            for p in parts:
                for li, (e, diag) in enumerate(zip(self.entries, tf.split(tf.concat(p, 0), sizes))):
                    self._add(state, li, tf.cast(tf.reshape(diag, e.variable.shape), e.variable.dtype)[None])
            return
        groups = self.options.groups
        for probes, tensors in self._probe_blocks():
            seg = tf.constant(np.asarray(probes) % groups, tf.int32)
            results = self._map(hutchinson_step, [(xa, ta, tensors) for xa, ta in args], (seg,))
            for sums, loss, stats in results:
                if probes.start == 0:
                    self._check(loss, stats, batch)
                for i, v in enumerate(sums):
                    self._add(state, i, v)

