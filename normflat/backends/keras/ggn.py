"""The ``ggn``, ``ggn-topk`` and ``ggn-mc`` kernels: per-layer sums of squared per-sample gradients (method §6).

The GGN diagonal of the mean loss is ``(1/N) Σ_n Σ_d (J_nᵀ s_nd)²`` where the
output signals ``s_nd`` come from :func:`normflat.engine.losses.output_signals`
at the raw logits: the ``C − 1`` columns of a factor of the loss Hessian
(``ggn``), the exact top classes plus draws of the others (``ggn-topk``), or
``(e_ỹ − p)/√m_k`` with ``ỹ`` drawn from the engine's framework-free uniforms
(``ggn-mc``). One compiled step runs the forward pass
once, back-propagates a block of signals to the tapped pre-activations of every
``Dense``/``EinsumDense``/``Embedding``/``Conv``/``DepthwiseConv`` layer (the *fast*
path) and forms the per-sample squares there (grouped and depthwise kernels in one
batched matmul with the groups as a batch axis); an ``LSTM``/``GRU``/``SimpleRNN`` layer's
loop runs as a recurrence that records each weight's products (method §6.1 "Recurrent
weights", :func:`~normflat.backends.keras.calls.recorded_inner_loop`), the dense rule over
the steps; other layers (shared, subclassed, registered) take the *generic* path:
per-sample gradients of their weights from each sample's own forward, one sample at a
time (:func:`_generic_squares`).
Learned position tables (method §6.1 "Position tables") are fast too: keras-hub's
``PositionEmbedding`` by its output (per sample, so the signal there is each
sample's gradient of the rows it reads, :meth:`Taps.rows`), a position table held
as a loose weight by running the model with its layer attribute set to the table
expanded over the batch (:meth:`Taps.expanded`); both checked on the first forward
(:meth:`~normflat.backends.keras.session.KerasSession._first_checks`). A
``ReversibleEmbedding`` (Keras' or keras-hub's) with ``tie_weights=True`` (the LM head tied to the token
embedding) is fast too: tapped at the outputs of its lookup call and of its
``reverse=True`` call, its per-sample gradient is the sum of the two uses' (the signals
scattered into the rows of the sample's ids, and ``Σ_t s_t a_tᵀ``), squared one signal
at a time (:func:`_tied_squares`, method §6.1 "Tied weights"); it is never a head.
A LoRA-enabled ``Dense``, ``EinsumDense``, ``Embedding`` or convolution (kernel ``W + s·A·B``) is
tapped once, and its frozen kernel and both factors take their rules from that record (:func:`_lora_squares`, method §6.1
"LoRA adapters"); it is never a head either.
With ``ggn-topk``, and ``ggn`` above :data:`STRUCTURED_HEAD_CLASSES` classes
(:func:`exact_head`), a ``Dense`` head whose pre-activation is the logits takes its
exact squares from the logit-Hessian diagonal; for ``(n, C)`` logits the other fast
layers' signals start at the head's input, pulled back through it in structured
form (:class:`~normflat.engine.losses.Factor`): ``O(C·d)`` per sample instead of the
``O(C²·d)`` of pushing ``C − 1`` dense signals through the head (method §6.1–6.2),
and where dense signals are still needed (generic layers, no recognized head) only
the block's are formed, ``O(C)`` each. The stochastic estimators of token logits
back-propagate per-sequence signals (a signed sum over the tokens, one back-propagation
per signal and sequence, method §6.3) unless ``sequence_signals=False``; under ``ggn-topk``
those start at a ``Dense`` head's input too (:func:`~normflat.engine.losses.sequence_factor`:
each token's signed class signal, ``O(d)`` per signal and token through the head), while
per-token signals keep the head rule only.
The step returns the ``(K', *canonical)`` sums of one chunk of samples
(``K' = options.state_groups``); the engine divides.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
import threading
import weakref
from typing import Any, Callable, Iterator, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from normflat.backends.keras import compat
from normflat.backends.keras.calls import recorded_inner_loop
from normflat.backends.keras.layers import (LORA_BASE_KINDS, LORA_KINDS, RECURRENT_KINDS, SEPARABLE_KINDS, UNUSED,
                                            Entry, einsum_fast_axes, fast_kind, is_lora)
from normflat.backends.keras.ops import TF
from normflat.backends.keras_shared import rank_equation
from normflat.backends.keras.state import ModelState
from normflat.core.memory import chunk_size_for
from normflat.engine.estimators import mean_weights
from normflat.engine.losses import (LOGIT_BLOCK_ENTRIES, Factor, SequenceClasses, check_same_classes,
                                    classes_factor, combined_logit_stats, diagonal_signals, logit_stats, output_factor,
                                    output_signals, samples_apart_tolerance, sequence_classes, sequence_dense,
                                    sequence_factor, signal_slots)
from normflat.engine.options import AnalysisOptions
from normflat.engine.outputs import select_output

__all__ = ["Taps", "ggn_step_fn", "model_logits", "signal_layout",
           "ggn_bytes", "ggn_chunk_size", "squares_working_set", "squares_by_pairs", "SIGNAL_BLOCK",
           "compute_dtype", "exact_head", "starts_at_head_input", "STRUCTURED_HEAD_CLASSES",
           "CHUNK_BYTES", "MAX_CHUNK"]

#: Most signals back-propagated per compiled step (more are done in equal blocks).
SIGNAL_BLOCK = 16
#: A step unrolls its block's back-propagations (one per signal) while ``block ×`` the forward
#: pass's graph operations is at most this, and loops over them (``tf.map_fn``) above: building
#: the graph of 16 backward passes of a small transformer took most of its first analysis
#: (keras-hub's tiny GPT-2: 14 s, 5 s looped), where a small CNN runs about 20 % faster unrolled.
UNROLL_OPS = 2048
#: Upper bound on the estimated bytes of one GGN step without ``memory_budget`` (the default
#: budget is about twice a training step, :func:`normflat.core.memory.default_budget`, at most this).
CHUNK_BYTES = 2**28
#: Upper bound on the samples of one GGN step.
MAX_CHUNK = 1024
#: ``ggn`` squares a ``Dense`` head from the logit-Hessian diagonal and starts the other layers'
#: signals at its input (structured, method §6.1) above this many classes, as the torch backend;
#: below, pushing the ``C − 1`` dense signals through the head costs less than forming the
#: structured ones. ``ggn-topk`` always does (its head must be exact, as in every framework).
STRUCTURED_HEAD_CLASSES = 32


def starts_at_head_input(options: AnalysisOptions, tokens: int | None, input_rank: int) -> bool:
    """Whether the other fast layers' signals start at the input of an exact ``Dense`` head
    (:func:`exact_head`) whose input has rank ``input_rank``: ``(n, d)`` for ``(n, C)`` logits,
    ``(n, T, d)`` for token logits with per-sequence signals (method §6.3); per token each signal
    is one token's, and stays at the logits."""
    if tokens is not None and not options.sequence_layout(tokens):
        return False
    return input_rank == (2 if tokens is None else 3)


def exact_head(options: AnalysisOptions, num_classes: int) -> bool:
    """Whether a ``Dense`` head whose pre-activation is the logits gets its squares from the
    logit-Hessian diagonal (and, for ``(n, C)`` logits, the others their signals at its input)."""
    return options.estimator == "ggn-topk" or (options.estimator == "ggn" and num_classes > STRUCTURED_HEAD_CLASSES)


def compute_dtype(dtype: Any) -> Any:
    """Losses and signals are formed in at least float32 (half-precision logits lose the curvature)."""
    dtype = tf.as_dtype(dtype)
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def logits_rounding(model: Any, z: Any) -> str:
    """The name of the narrower of the logits' dtype and the model's compute dtype (a mixed policy's
    float32 logits of a bfloat16 computation): the rounding the logits carry
    (:func:`~normflat.engine.losses.check_samples_apart`)."""
    policy = str(getattr(getattr(model, "dtype_policy", None), "compute_dtype", z.dtype.name))
    return max([z.dtype.name, policy], key=samples_apart_tolerance)


def _is_tensor(a: Any) -> bool:
    return isinstance(a, tf.Tensor)


def model_logits(model: Any, x: Any, options: AnalysisOptions, seen: tuple[int, ...] | None = None) -> Any:
    """The model's logits for inputs ``x``: its output reduced by ``options.output`` (method §9).

    Works eagerly and inside ``tf.function``; a dict of named inputs is passed
    positionally, as Keras functional models take it (keras-hub backbones).

    Args:
        model: The Keras model.
        x: Its inputs.
        options: The analysis options (``output``).
        seen: The logits' shape of the model's first call in this analysis (the eager probe's):
            the logits must have as many classes
            (:func:`~normflat.engine.losses.check_same_classes`). Inside a compiled step it is
            checked while tracing, on the static shape (no cost per step): traced for any number
            of rows, logits whose classes follow the rows have no static class axis.
    """
    z = select_output(model(x, training=False), options.output, _is_tensor)
    _check_same_classes(tuple(z.shape) if isinstance(z, tf.Tensor) else None, seen)
    return z


@tf.autograph.experimental.do_not_convert
def _check_same_classes(shape: tuple[int | None, ...] | None, seen: tuple[int, ...] | None) -> None:
    """:func:`~normflat.engine.losses.check_same_classes`, whose error leaves a compiled step's trace as
    it is: autograph would re-raise it prefixed by "in user code" and the step's traceback, where every
    framework gives the engine's message. Not converted, so that the error is marked before autograph
    sees it."""
    try:
        check_same_classes(shape, seen)
    except ValueError as err:
        err.ag_pass_through = True  # type: ignore[attr-defined]  # autograph's mark: re-raised unchanged
        raise


def _sees_gpu() -> bool:
    """Whether TensorFlow sees a GPU (the step's kernels then run there: :func:`dense_product`,
    :func:`squares_chunk_entries`)."""
    return bool(tf.config.list_logical_devices("GPU"))


#: A signal of at most this many rows (samples × positions) goes back through a ``Dense`` kernel as
#: ``(W gᵀ)ᵀ`` (:func:`dense_product`).
DENSE_COLUMNS_ROWS = 32

#: The batch size of the call whose step is being traced with its batch axis left open
#: (:func:`open_batch`), for :func:`dense_product` to choose its backward product while tracing.
_OPEN_BATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("normflat_keras_open_batch", default=None)


@contextlib.contextmanager
def open_batch(size: int | None) -> Iterator[None]:
    """While a step is traced with an open batch axis (``session.trace_open_batch``), the batch size of
    the call it is traced for: :func:`dense_product` reads its rows from it where the graph's batch
    axis is unknown."""
    token = _OPEN_BATCH.set(size)
    try:
        yield
    finally:
        _OPEN_BATCH.reset(token)


def _product_rows(x: Any) -> int | None:
    """The rows of ``x`` flattened to a matrix (all axes but the last), from its static shape, the
    batch axis from :func:`open_batch` where the graph leaves it open; ``None`` if unknown."""
    lead = x.shape[0] if x.shape[0] is not None else _OPEN_BATCH.get()
    inner = list(x.shape[1:-1])
    if lead is None or any(d is None for d in inner):
        return None
    return int(lead) * int(np.prod([int(d) for d in inner], dtype=np.int64))


def _with_gradient(compute: Callable[[Any], tuple[Any, Callable[[Any], Any]]], x: Any) -> Any:
    """``out`` of ``compute(x) = (out, gradient)``, whose gradient with respect to ``x`` a tape takes as
    ``gradient(g)``, as ``tf.custom_gradient(compute)(x)`` gives it.

    In a graph (the compiled steps) by :func:`~normflat.backends.keras.compat.with_backward`:
    ``tf.custom_gradient`` there leaves every step's graph in TensorFlow's global gradient
    registry, 3 MiB per analysis of a new MLP (the ``Dense`` products of every signal). Eagerly,
    and where that shim finds no tape API, by ``tf.custom_gradient``.
    """
    if not tf.executing_eagerly():
        out, gradient = compute(x)
        wrapped = compat.with_backward(out, [x], lambda g: [gradient(g)])
        if wrapped is not None:
            return wrapped
    return tf.custom_gradient(compute)(x)


def dense_product(inputs: Any, kernel: Any) -> Any:
    """``inputs @ kernel`` as Keras' ``Dense`` forms it, whose gradient with respect to ``inputs``
    (the back-propagation of each GGN signal) is formed as ``(W gᵀ)ᵀ`` when ``g`` has few rows.

    TensorFlow's own gradient is ``g Wᵀ``. Without oneDNN (TensorFlow's default on CPUs without
    AVX-512) Eigen's product with few rows ran 2-6x slower than ``W gᵀ`` transposed: a signal of 16
    rows through a ``768 × 3072`` kernel 12.5 ms against 2.3 ms, of 2 rows 12.6 ms against 2.5 ms,
    of 6 rows through ``1152 × 512`` 2.8 ms against 0.9 ms; at 64 rows they are even and at 256
    ``g Wᵀ`` is faster (one thread, 2026-12-06). With oneDNN, or on a GPU, they are within 15%
    either way and TensorFlow's own gradient is kept. The forward product is Keras' (the inputs'
    rows by the kernel, in the compute dtype) and no gradient reaches the kernel: a fast layer's
    kernel is never differentiated in the step, its squares come from its taps.
    """
    x = tf.convert_to_tensor(inputs)
    w = tf.convert_to_tensor(keras.ops.convert_to_tensor(kernel))  # the kernel's value, autocast as Keras reads it
    compute = keras.backend.result_type(x.dtype.name, w.dtype.name, float)
    result = keras.backend.result_type(x.dtype.name, w.dtype.name)
    x, w = tf.cast(x, compute), tf.stop_gradient(tf.cast(w, compute))

    known = _product_rows(x)

    def transposed(g: Any) -> Any:  # (W gᵀ)ᵀ
        return tf.transpose(tf.matmul(w, g, transpose_b=True))

    def tensorflows(g: Any) -> Any:  # g Wᵀ
        return tf.matmul(g, w, transpose_b=True)

    def backward(g: Any) -> Any:
        if known is not None:
            # Chosen while tracing: a tf.cond's branch functions stay in TensorFlow's context after
            # the step is freed. A chunk of another size than the traced call's runs the same product.
            return transposed(g) if known <= DENSE_COLUMNS_ROWS else tensorflows(g)
        return tf.cond(tf.shape(g)[0] <= DENSE_COLUMNS_ROWS, lambda: transposed(g), lambda: tensorflows(g))

    def by_columns(rows):
        return _with_gradient(lambda r: (tf.matmul(r, w), backward), rows)

    def own_gradient(rows):  # TensorFlow's g Wᵀ
        return tf.matmul(rows, w)

    product = own_gradient if compat.onednn_enabled() or _sees_gpu() else by_columns

    features = int(w.shape[-1])
    if len(x.shape) == 2:
        y = product(x)
    else:
        y = tf.reshape(product(tf.reshape(x, [-1, int(w.shape[0])])),
                       tf.concat([tf.shape(x)[:-1], [features]], 0))
        y = tf.ensure_shape(y, list(x.shape[:-1]) + [features])
    return tf.cast(y, result)


def argmax_pooling_wins() -> bool:
    """Whether :func:`max_pool_by_argmax` replaces a ``MaxPooling1D/2D`` in the GGN step: TensorFlow
    without oneDNN on a CPU (measured there; elsewhere its own ``MaxPoolGrad`` is kept)."""
    return not compat.onednn_enabled() and not _sees_gpu()


def max_pool_by_argmax(inputs: Any, pool_size: Any, strides: Any, padding: str) -> Any:
    """A channels-last 2-D max pooling whose gradient scatters each signal to the maxima found once in
    the forward pass, rather than finding them again for every signal; a 1-D one (``(n, L, C)``
    inputs, one-entry ``pool_size`` and ``strides``) as the 2-D pooling of its ``(n, 1, L, C)`` view
    with windows ``(1, k)``, which is TensorFlow's own 1-D pooling too.

    TensorFlow's gradient of ``max_pool2d`` is ``MaxPoolGrad``, which recomputes every window's
    maximum on each call; the GGN step calls it once per signal. Without oneDNN it took 11.4 ms for
    a ``(32, 28, 28, 64)`` input pooled 2×2 (3C3D's first pooling), against 2.9 ms for
    ``MaxPoolGradWithArgmax`` given the positions of the maxima, which ``max_pool_with_argmax``
    finds in the forward in about one ``MaxPoolGrad``'s time (9.9 ms); the 3×3 poolings of stride 2
    5.4 and 2.1 ms against 0.8 ms each (one thread, 2026-12-06). Both send a window's gradient to
    the same entry, the first maximum (ties: the zeros after a ReLU), so the signals are TensorFlow's.
    The step's signals go back one by one (unrolled or in a ``tf.map_fn``), never vectorized:
    ``MaxPoolGradWithArgmax`` has no ``vectorized_map`` rule. The generic path's per-sample
    forwards (:func:`_generic_squares`) use Keras' own pooling.
    """
    if len(pool_size) == 1:  # (n, L, C): the (n, 1, L, C) view, windows of one row
        return tf.squeeze(_pool_by_argmax(tf.expand_dims(inputs, 1), (1, *pool_size), (1, *strides), padding), 1)
    return _pool_by_argmax(inputs, pool_size, strides, padding)


def _pool_by_argmax(inputs: Any, pool_size: Any, strides: Any, padding: str) -> Any:
    """:func:`max_pool_by_argmax` of ``(n, H, W, C)`` inputs."""
    ksize = [1, *pool_size, 1]
    stride = [1, *strides, 1]
    pad = padding.upper()

    def pooled(x):
        out, where = tf.nn.max_pool_with_argmax(x, ksize, stride, pad, include_batch_in_index=True)

        def gradient(g):
            return tf.raw_ops.MaxPoolGradWithArgmax(input=x, grad=g, argmax=where, ksize=ksize, strides=stride,
                                                    padding=pad, include_batch_in_index=True)

        return out, gradient

    return _with_gradient(pooled, inputs)


def _plain_max_pooling(layer: Any) -> bool:
    """Keras' own ``MaxPooling1D`` or ``MaxPooling2D`` on channels-last inputs (its call not
    overridden)."""
    return any(isinstance(layer, cls) and type(layer).call is cls.call and layer.data_format == "channels_last"
               for cls in (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D))


class _ThreadTaps(threading.local):
    """:class:`Taps`' per-thread state (each thread starts with none)."""

    def __init__(self) -> None:
        self.records: dict[str, list] = {}
        self.tape: tf.GradientTape | None = None
        self.checking = False
        self.pools_by_argmax = False  # the step's MaxPooling1D/2D layers run max_pool_by_argmax
        self.samples: Any = None  # the batch size while Taps.expanded holds (a (1,) tensor)
        self.broadcast: set[str] = set()  # the lookups expanded over the batch (Taps.expanded)
        self.refused: dict[str, str] = {}  # the checking forward's refusals: {entry name: reason}


class Taps:
    """Records each tapped layer's input and pre-activation during a forward pass.

    The wrappers are set on the layer instances through ``state`` (restored when
    the analysis ends). ``records[name]`` collects ``[input, pre_activation]`` per
    call; ``tape``, while set, watches the pre-activations (frozen kernels are
    not watched automatically). A lookup records ``[ids, output]``; keras-hub's
    ``PositionEmbedding`` ``[rows, output]`` (:meth:`rows`); a loose position table
    ``[view, view]`` while :meth:`expanded` holds it; a tied ``ReversibleEmbedding``
    ``[ids, output, False]`` for its lookup and ``[input, logits, True]`` for its
    reverse projection (``None`` in place of the mode when ``reverse`` is not a Python bool).
    """

    def __init__(self, state: ModelState, tapped: list[Entry]) -> None:
        # The records, the tape and the checking flag belong to the thread that runs the forward: a
        # MirroredStrategy traces the step in one thread per replica at once, and shared records let
        # one replica's trace clear or read the other's (its head not found: sampled, not exact).
        self._mine = _ThreadTaps()
        #: Loose position tables: no call of their own, :meth:`expanded` substitutes them.
        self.tables = [entry for entry in tapped if entry.fast == "table"]
        separable: dict[int, list[Entry]] = {}
        recurrent: dict[int, list[Entry]] = {}
        reversible: dict[int, list[Entry]] = {}
        lora: dict[int, list[Entry]] = {}
        for entry in tapped:
            if entry.fast in (*LORA_BASE_KINDS, *LORA_KINDS) and is_lora(entry.layer):
                lora.setdefault(id(entry.layer), []).append(entry)
            elif entry.fast in SEPARABLE_KINDS:
                separable.setdefault(id(entry.layer), []).append(entry)
            elif entry.fast in ("embedding", "dense") and fast_kind(entry.layer) == "untied":
                reversible.setdefault(id(entry.layer), []).append(entry)
            elif entry.fast in RECURRENT_KINDS:
                recurrent.setdefault(id(entry.layer), []).append(entry)
            elif entry.fast != "table":
                self._tap(state, entry)
        for pair in separable.values():
            self._tap_separable(state, pair[0].layer, pair)
        for pair in reversible.values():
            self._tap_untied(state, pair[0].layer, pair)
        for group in lora.values():
            # The frozen kernel and both factors from the one call (method §6.1, "LoRA adapters").
            self._tap(state, group[0], group[1:])
        for layer in compat.flatten_layers(state.model):
            if _plain_max_pooling(layer):
                self._tap_pooling(state, layer)
        if recurrent:
            layers = [layer for layer in compat.flatten_layers(state.model) if isinstance(layer, keras.layers.RNN)]
            for pair in recurrent.values():
                owners = [layer for layer in layers if layer.cell is pair[0].layer]
                if len(owners) == 1:  # otherwise nothing is recorded: the first forward refuses the cell
                    self._tap_recurrent(state, owners[0], pair)

    @property
    def records(self) -> dict[str, list]:
        """This thread's records of the tapped calls (see the class docstring)."""
        return self._mine.records

    @property
    def tape(self) -> tf.GradientTape | None:
        """The tape this thread's forward records on (``None``: none)."""
        return self._mine.tape

    @tape.setter
    def tape(self, tape: tf.GradientTape | None) -> None:
        self._mine.tape = tape

    @property
    def checking(self) -> bool:
        """The first forward's checks (``KerasSession._first_checks``) run in this thread: every
        tapped layer reads its weight without a gradient (any gradient that still reaches the
        variable comes from another use, which its fast rule would miss), and a
        ``PositionEmbedding`` also records which feature each output entry reads."""
        return self._mine.checking

    @checking.setter
    def checking(self, value: bool) -> None:
        self._mine.checking = value

    @property
    def pools_by_argmax(self) -> bool:
        """This thread's GGN step pools by :func:`max_pool_by_argmax` (set by the step around its
        forward where :func:`argmax_pooling_wins` and its signals go back one by one)."""
        return self._mine.pools_by_argmax

    @pools_by_argmax.setter
    def pools_by_argmax(self, value: bool) -> None:
        self._mine.pools_by_argmax = value

    def _tap_pooling(self, state: ModelState, layer: Any) -> None:
        """A ``MaxPooling1D`` or ``MaxPooling2D`` whose signals' gradient reuses the forward's maxima
        while :attr:`pools_by_argmax` holds (the same values; Keras' own call otherwise)."""
        original_call = layer.call
        rank = len(layer.pool_size) + 2

        def call(inputs, *args, **kwargs):
            if self.pools_by_argmax and not args and not kwargs and isinstance(inputs, tf.Tensor) \
                    and inputs.shape.rank == rank and inputs.dtype.is_floating:
                return max_pool_by_argmax(inputs, layer.pool_size, layer.strides, layer.padding)
            return original_call(inputs, *args, **kwargs)

        state.set(layer, "call", call)

    def _tap(self, state: ModelState, entry: Entry, partners: list[Entry] = ()) -> None:
        """Wraps the layer's call (and activation) to record ``[input, pre-activation]`` under ``entry``'s
        name, and under each of ``partners``' (the other weights of a LoRA-enabled layer, formed from the
        same record), every weight read without a gradient while :attr:`checking`."""
        layer, name = entry.layer, entry.name
        names = [name, *(partner.name for partner in partners)]
        original_call = layer.call  # bound method (or an instance attribute set before)
        if entry.fast == "embedding":
            # A lookup has no activation: its output is what the signals are pulled back to.
            def lookup(inputs, *args, **kwargs):
                samples = self._mine.samples
                if samples is not None and entry.fast == "embedding" and _is_tensor(inputs) \
                        and len(inputs.shape) and inputs.shape[0] == 1:
                    # One row of ids for the whole batch (position ids (1, N)), its output broadcast
                    # later: looked up once per sample, so that the signal at each row is that
                    # sample's (method §6.1, "Position tables"); checked by the first forward.
                    inputs = tf.broadcast_to(inputs, tf.concat([samples, tf.shape(inputs)[1:]], 0))
                    self._mine.broadcast.update(names)
                with self.own_read(entry, *partners):
                    out = original_call(inputs, *args, **kwargs)
                if self.tape is not None:
                    self.tape.watch(out)
                record = [inputs, out]
                for each in names:
                    self.records.setdefault(each, []).append(record)
                return out

            state.set(layer, "call", lookup)
            return
        if entry.fast == "tied":
            # Both modes of the layer's own call read the one table; each is recorded with its mode.
            def tied(inputs, *args, **kwargs):
                mode = _reverse_mode(args, kwargs)
                with self.own_read(entry):
                    out = original_call(inputs, *args, **kwargs)
                if self.tape is not None:
                    self.tape.watch(out)
                self.records.setdefault(name, []).append([inputs, out, mode])
                return out

            state.set(layer, "call", tied)
            return
        if entry.fast == "position":
            variable = entry.variable

            def position(inputs, *args, **kwargs):
                with self.own_read(entry):
                    out = original_call(inputs, *args, **kwargs)
                if self.tape is not None:
                    self.tape.watch(out)
                record = [self.rows(original_call, variable, 0, inputs, args, kwargs), out]
                if self.checking:
                    record.append(self.rows(original_call, variable, 1, inputs, args, kwargs))
                self.records.setdefault(name, []).append(record)
                return out

            state.set(layer, "call", position)
            return
        original_activation = layer.activation

        def call(inputs, *args, **kwargs):
            if entry.fast == "dense" and isinstance(layer, keras.layers.Dense) and isinstance(inputs, tf.Tensor) \
                    and (inputs.shape.rank or 0) >= 2 and inputs.shape[-1] is None:
                # A feature axis left open by the model's own reshape (keras-hub's RoFormerV2 attention):
                # the kernel's rows, static for the squares' shapes (the same tensor, the same forward).
                inputs = tf.ensure_shape(inputs, [*inputs.shape[:-1], int(layer.kernel.shape[0])])
            record = [inputs, None]  # one record for every weight of the layer: the pre-activation set below
            for each in names:
                self.records.setdefault(each, []).append(record)
            with self.own_read(entry, *partners):
                if entry.fast == "dense" and self.tape is not None and not self.checking \
                        and isinstance(inputs, tf.Tensor) and (inputs.shape.rank or 0) >= 2:
                    # Keras' Dense.call (fast_kind: not quantized, not overridden; with LoRA its kernel
                    # property forms W + s·A·B), its product's input gradient chosen for the signals
                    # (dense_product).
                    y = dense_product(inputs, layer.kernel)
                    if layer.bias is not None:
                        y = keras.ops.add(y, layer.bias)
                    return layer.activation(y) if layer.activation is not None else y
                return original_call(inputs, *args, **kwargs)

        def activation(y):
            if self.tape is not None:
                self.tape.watch(y)
            record = self.records.get(name)
            if record and record[-1][1] is None:
                record[-1][1] = y
            return original_activation(y)

        state.set(layer, "call", call)
        state.set(layer, "activation", activation)

    def _tap_separable(self, state: ModelState, layer: Any, entries: list[Entry]) -> None:
        """A ``SeparableConv1D/2D`` runs its depthwise and pointwise (1×1) convolutions one after the
        other (TensorFlow's own separable convolution does the same two), so that each kernel's
        input and output are recorded: ``[input, depthwise output]`` for the depthwise kernel,
        ``[depthwise output, pre-activation]`` for the pointwise one."""
        names = {entry.fast: entry.name for entry in entries}
        rank = int(layer.rank)

        def separable(inputs, *args, **kwargs):
            with self.own_read(*entries):
                middle = keras.ops.depthwise_conv(inputs, layer.depthwise_kernel, strides=layer.strides,
                                                  padding=layer.padding, data_format=layer.data_format,
                                                  dilation_rate=layer.dilation_rate)
                if self.tape is not None:
                    self.tape.watch(middle)
                y = keras.ops.conv(middle, layer.pointwise_kernel, strides=1, padding="valid",
                                   data_format=layer.data_format)
                if layer.use_bias:
                    shape = ((1,) * (rank + 1) + (layer.filters,) if layer.data_format == "channels_last"
                             else (1, layer.filters) + (1,) * rank)
                    y = keras.ops.add(y, keras.ops.reshape(layer.bias, shape))
            if self.tape is not None:
                self.tape.watch(y)
            for kind, record in (("separable_depthwise", [inputs, middle]), ("separable_pointwise", [middle, y])):
                if kind in names:
                    self.records.setdefault(names[kind], []).append(record)
            return layer.activation(y) if layer.activation is not None else y

        state.set(layer, "call", separable)

    def _tap_untied(self, state: ModelState, layer: Any, entries: list[Entry]) -> None:
        """A ``ReversibleEmbedding`` with its own ``reverse_embeddings`` (keras-hub's Llama, Mistral, Phi-3
        heads): its lookup calls record ``[ids, output]`` for the table (the embedding rule), its
        ``reverse=True`` calls ``[input, logits]`` for the reverse projection, a dense kernel
        ``(features, vocabulary)`` (the dense rule; the exact head rule when those are the logits).
        A call whose ``reverse`` is not a Python bool records nothing (its weights go generic)."""
        by_kind = {entry.fast: entry for entry in entries}
        original_call = layer.call

        def call(inputs, *args, **kwargs):
            mode = _reverse_mode(args, kwargs)
            with self.own_read(*entries):
                out = original_call(inputs, *args, **kwargs)
            entry = None if mode is None else by_kind.get("dense" if mode else "embedding")
            if entry is not None:
                if self.tape is not None:
                    self.tape.watch(out)
                if mode and getattr(layer, "reverse_dtype", None) is not None:
                    inputs = keras.ops.cast(inputs, layer.reverse_dtype)  # the projection's own input
                self.records.setdefault(entry.name, []).append([inputs, out])
            return out

        state.set(layer, "call", call)

    def _tap_recurrent(self, state: ModelState, layer: Any, entries: list[Entry]) -> None:
        """An ``LSTM``/``GRU``/``SimpleRNN`` layer runs its loop as the recorded recurrence
        (:func:`~normflat.backends.keras.calls.recorded_inner_loop`, method §6.1 "Recurrent weights"):
        ``kernel`` records ``[sequences, x W]`` once, ``recurrent_kernel`` ``[inputs, zero tap]`` per
        column range. While :attr:`checking`, the layer's own loop runs beside it, off the tape, and a
        recurrence that computes other outputs or states refuses the cell's weights (:attr:`refused`)."""
        by_kind = {entry.fast: entry for entry in entries}
        original = layer.inner_loop  # bound method (or an instance attribute set before)

        def watch(t: Any) -> None:
            if self.tape is not None:
                self.tape.watch(t)

        def record(which: int, inputs: Any, product: Any) -> None:
            entry = by_kind.get(RECURRENT_KINDS[which])
            if entry is not None:
                self.records.setdefault(entry.name, []).append([inputs, product])

        def active() -> bool:
            return any(entry.fast for entry in entries)

        recorded = recorded_inner_loop(layer, original, lambda: self.own_read(*entries), watch, record, active)

        def inner_loop(sequences, initial_state, mask, training=False):
            result = recorded(sequences, initial_state, mask, training=training)
            if self.checking and active():
                quiet = self.tape.stop_recording() if self.tape is not None else contextlib.nullcontext()
                with quiet:
                    reference = original(sequences, initial_state, mask, training=training)
                ours, theirs = [result[0], *result[2]], [reference[0], *reference[2]]
                if layer.return_sequences:
                    ours.append(result[1])
                    theirs.append(reference[1])
                if not all(_close(a, b) for a, b in zip(ours, theirs)):
                    for entry in entries:
                        self._mine.refused[entry.name] = (
                            f"its recorded recurrence computes other outputs than {type(layer).__name__}'s own loop")
            return result

        state.set(layer, "inner_loop", inner_loop)

    @property
    def refused(self) -> dict[str, str]:
        """The fast weights this thread's checking forward refused, with the reason."""
        return self._mine.refused

    def own_read(self, *entries: Entry) -> Any:
        """While :attr:`checking`: the layer's call reads its weight as a value without a gradient
        (a ``StatelessScope`` holding it), so a gradient that still reaches the variable comes from
        another use (a layer or an op reading ``layer.kernel`` too), which the fast rule, built on
        this call's input and pre-activation alone, would miss."""
        if not self.checking:
            return contextlib.nullcontext()
        return keras.StatelessScope(state_mapping=[
            (entry.variable, tf.stop_gradient(tf.convert_to_tensor(entry.variable.value))) for entry in entries])

    def rows(self, call: Callable[..., Any], variable: Any, axis: int, inputs: Any, args: tuple,
             kwargs: dict) -> Any:
        """The layer's ``call`` on a table of its own indices: entry ``(r, j)`` of the table is
        ``r`` (``axis=0``) or ``j`` (``axis=1``), so each output entry holds the table row (the
        feature) it reads. Whatever the call's arguments (``start_index``, ``positions``), the rows
        follow the layer's own indexing; the first forward checks that the output really is the
        table's rows (``KerasSession._first_checks``)."""
        shape = tuple(int(d) for d in variable.shape)
        index = tf.range(shape[axis], dtype=variable.dtype)
        code = tf.broadcast_to(index[:, None] if axis == 0 else index[None, :], shape)
        quiet = self.tape.stop_recording() if self.tape is not None else contextlib.nullcontext()
        with quiet, keras.StatelessScope(state_mapping=[(variable, code)]):
            return call(inputs, *args, **kwargs)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """A forward in this thread that records and watches nothing: the tapped layers compute what
        they compute in the step (the same function), their records kept apart and dropped (the
        generic path's per-sample forwards, :func:`_generic_squares`)."""
        mine = self._mine
        saved = mine.records, mine.tape, mine.pools_by_argmax, mine.samples
        mine.records, mine.tape, mine.pools_by_argmax, mine.samples = {}, None, False, None
        try:
            yield
        finally:
            mine.records, mine.tape, mine.pools_by_argmax, mine.samples = saved

    @property
    def broadcast(self) -> set[str]:
        """The lookups this thread's last forward under :meth:`expanded` expanded over the batch."""
        return self._mine.broadcast

    @contextlib.contextmanager
    def expanded(self, x: Any) -> Iterator[None]:
        """Run the model with every loose position table expanded over the batch of ``x``.

        The attribute holding the table (:attr:`Entry.attr`) is set, on the layer instance, to
        a view ``(n, *table)`` (``(n, N, d)`` for a ``(1, N, d)`` table) of the table's value
        without a gradient, watched by :attr:`tape`: the gradient at the view is each sample's
        gradient of the table (method §6.1 "Position tables"). The variable is put back on exit.
        A fast ``Embedding`` called on one row of ids (position ids ``(1, N)``) looks them up
        once per sample (:attr:`broadcast`).
        """
        tables = [e for e in self.tables if e.fast == "table"]
        n = tf.shape(tf.nest.flatten(x)[0])[:1]
        saved = []
        self._mine.samples = n
        self._mine.broadcast = set()
        try:
            for e in tables:
                value = tf.stop_gradient(tf.convert_to_tensor(e.variable.value))
                shape = [int(d) for d in value.shape]
                rest = shape[1:] if shape[0] == 1 else shape
                view = tf.broadcast_to(value, tf.concat([n, tf.constant(rest, tf.int32)], 0))
                if self.tape is not None:
                    self.tape.watch(view)
                saved.append((e.layer, e.attr, compat.instance_attr(e.layer, e.attr)))
                compat.set_instance_attr(e.layer, e.attr, view)
                self.records[e.name] = [[view, view]]
            yield
        finally:
            self._mine.samples = None
            for layer, attr, old in reversed(saved):
                compat.del_instance_attr(layer, attr, old)


def _reverse_mode(args: tuple, kwargs: dict) -> bool | None:
    """The ``reverse`` argument of a ``ReversibleEmbedding`` call (after its input): ``False`` a lookup,
    ``True`` the reverse projection, ``None`` when it is not a Python bool (a tensor: unknown here)."""
    reverse = kwargs.get("reverse", args[0] if args else False)
    return bool(reverse) if isinstance(reverse, (bool, np.bool_)) else None


def _close(a: Any, b: Any) -> bool:
    """The same tensor up to rounding: within ``√eps`` (of ``b``'s dtype) of its largest magnitude
    (a step taken in another order or a gate in another place is off by far more)."""
    a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
    if tuple(a.shape) != tuple(b.shape):
        return False
    if not int(tf.size(b)):
        return True
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float64": 2.0**-52}.get(b.dtype.name, 2.0**-23)
    a, b = tf.cast(a, tf.float64), tf.cast(b, tf.float64)
    return float(tf.reduce_max(tf.abs(a - b))) <= math.sqrt(eps) * (float(tf.reduce_max(tf.abs(b))) + 1.0)


def signal_layout(options: AnalysisOptions, num_classes: int,
                  tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Which of the flattened engine signals are real, and their group ids.

    ``(n, C)`` logits (``tokens`` ``None``): the real ``(group, member)`` slots of the
    ``(K', M)`` layout are :func:`~normflat.engine.losses.signal_slots`'s: ``ggn`` all
    ``C − 1``; ``ggn-mc`` draw ``d`` as member ``d // K`` of group ``d mod K``;
    ``ggn-topk`` the exact top-class signals of the shared group 0, then the draws of
    groups ``1..K``. The engine pads shorter groups with zero signals, which are dropped
    here (they would cost a back-propagation each and add nothing).

    Token logits of ``T = tokens`` tokens (:func:`normflat.engine.losses.token_signals`):
    per token, ``T`` signals per member, one per token (signal ``m·T + t``), so slot
    ``(g, m)`` of token ``t`` is flat index ``(g·M + m)·T + t``; per sequence
    (:meth:`~normflat.engine.options.AnalysisOptions.sequence_layout`), one signal per
    slot of the ``(K', M')`` layout, ``M' = token_signals_per_group(C, T)``, flat index
    ``g·M' + m``, whose real slots are ``signal_slots(..., sequence=True)``'s: ``ggn-topk``'s
    shared group 0 is all zero there and is never back-propagated (method §6.3).
    """
    if options.sequence_layout(tokens):
        assert tokens is not None
        m, per = options.token_signals_per_group(num_classes, tokens), 1
        slots = np.asarray(signal_slots(options, num_classes, sequence=True), dtype=np.int64).reshape(-1, 2)
    else:
        m, per = options.signals_per_group(num_classes), tokens or 1
        slots = np.asarray(signal_slots(options, num_classes), dtype=np.int64).reshape(-1, 2)
    # Vectorized: the exact ggn of an LM head has (C − 1)·T signals, far too many for a Python loop.
    index = ((slots[:, 0] * m + slots[:, 1]) * per)[:, None] + np.arange(per)[None, :]
    seg = np.repeat(slots[:, 0], per)
    return index.reshape(-1), seg


def _head_squares(x: Any, zc: Any, counted: Any, options: AnalysisOptions, tokens: int | None) -> Any:
    """``(1, out, in)`` exact squares of a ``Dense`` head whose pre-activation is the logits.

    For such a layer only ``Σ_m s_m²`` per output unit enters the per-sample squares,
    which is the logit-Hessian diagonal: the one-signal
    :func:`~normflat.engine.losses.diagonal_signals` give its exact GGN diagonal
    (``ggn-topk``, and ``ggn`` with many classes: :func:`exact_head`; method §6.2): the shared
    group 0 alone, which the session adds as an exact layer's only sum
    (:meth:`~normflat.engine.estimators.SumState.add_exact`), not ``K'`` head-sized sums of
    which ``K' − 1`` are zero.
    Each (token, signal) pair of token logits is its own per-sample gradient (method §6.3),
    so token rows are simply more rows: ``Σ_rows d ⊗ x²`` is one matmul, and the signals
    are never placed at their tokens.
    """
    c = int(zc.shape[-1])
    blocks = token_blocks(tokens, c)

    def squares(zc: Any, counted: Any, x: Any) -> Any:
        root = diagonal_signals(TF, tf.reshape(zc, [-1, c]), options)[0, 0]  # (rows, C): group 0
        if tokens is not None:
            root = root * tf.reshape(tf.cast(counted, root.dtype), [-1, 1])  # ignored tokens: no curvature
        d = tf.square(tf.cast(root, x.dtype))  # in the layer's dtype, as its back-propagated signals
        x2 = tf.square(tf.reshape(x, [-1, int(x.shape[-1])]))
        return tf.matmul(d, x2, transpose_a=True)  # (out, in)

    if blocks is None:
        return squares(zc, counted, x)[None]  # (1, out, in)
    # A block of tokens at a time (token_blocks): the same sum over the token rows.
    return tf.add_n(_in_order(blocks, lambda a, b, deps: squares(_after(deps, zc[:, a:b]), counted[:, a:b],
                                                                   x[:, a:b])))[None]


def token_blocks(tokens: int | None, num_classes: int) -> list[tuple[int, int]] | None:
    """Token ranges ``[a, b)`` in which the step takes the work at token logits ``(n, T, C)``: at
    most :data:`~normflat.engine.losses.LOGIT_BLOCK_ENTRIES` entries of one sequence each (at least
    one token); ``None`` for ``(n, C)`` logits, or when one block holds every token.

    The probabilities, each token's classes and draws, the head's logit-Hessian diagonal and the
    logit checks each hold up to about ten temporaries of their input's size; a block of tokens at
    a time (:func:`_in_order`) they are those of one block of every sequence of the chunk, not of
    all its token logits (method §9), as the numpy and torch code takes rows in blocks."""
    if tokens is None or tokens * num_classes <= LOGIT_BLOCK_ENTRIES:
        return None
    step = max(1, LOGIT_BLOCK_ENTRIES // num_classes)
    return [(a, min(tokens, a + step)) for a in range(0, tokens, step)]


def _in_order(blocks: list[tuple[int, int]], fn: Callable[[int, int, list], Any]) -> list[Any]:
    """``fn(a, b, deps)`` for each block, each starting after the previous one's results exist
    (``deps``: those results, for ``tf.control_dependencies`` on the block's first operation):
    the graph's executor would otherwise run the independent blocks in any order, their
    temporaries alive together."""
    out: list[Any] = []
    for a, b in blocks:
        out.append(fn(a, b, tf.nest.flatten(out[-1]) if out else []))
    return out


def _after(deps: list, x: Any) -> Any:
    """``x`` read once ``deps`` exist (an identity under control dependencies; ``None`` entries,
    absent fields of a result, are no dependency)."""
    deps = [d for d in deps if d is not None]
    if not deps:
        return x
    with tf.control_dependencies(deps):
        return tf.identity(x)


def _blocked_logit_stats(zc: Any, blocks: list[tuple[int, int]] | None) -> Any:
    """:func:`~normflat.engine.losses.logit_stats` of ``(n, T, C)`` token logits, a block of tokens
    at a time (:func:`token_blocks`)."""
    c = int(zc.shape[-1])
    if blocks is None:
        return logit_stats(TF, tf.reshape(zc, [-1, c]))
    parts = _in_order(blocks, lambda a, b, deps: logit_stats(TF, tf.reshape(_after(deps, zc[:, a:b]), [-1, c])))
    return combined_logit_stats(TF, parts)


def _blocked_sequence_factor(zc: Any, options: AnalysisOptions, counted: Any, u: Any,
                             blocks: list[tuple[int, int]] | None) -> Factor:
    """:func:`~normflat.engine.losses.sequence_factor` of ``(n, T, C)`` token logits, its classes
    found a block of tokens at a time (:func:`token_blocks`; each token's classes depend on its own
    logits and uniform columns only) and assembled in the engine's token-major row order."""
    if blocks is None:
        return sequence_factor(TF, zc, options, counted, u)
    tokens = int(zc.shape[1])
    columns = int(u.shape[-1]) // tokens  # token t's uniforms: columns t·D .. (t+1)·D − 1

    parts = _in_order(blocks, lambda a, b, deps: sequence_classes(
        TF, _after(deps, zc[:, a:b]), options, counted[:, a:b], u[:, a * columns:b * columns]))

    def joined(field: str) -> Any:
        first = getattr(parts[0], field)
        if first is None:  # zhat, sigma: nsce only
            return None
        pieces = [(getattr(q, field), b - a) for q, (a, b) in zip(parts, blocks)]
        if field in ("index", "scale"):  # (K', M', n·t) blocks -> (K', M', n·T)
            k, m = int(first.shape[0]), int(first.shape[1])
            return tf.reshape(tf.concat([tf.reshape(v, [k, m, -1, t]) for v, t in pieces], axis=3), [k, m, -1])
        width = int(first.shape[-1])  # (n·t, width) blocks -> (n·T, width), token-major per sample
        return tf.reshape(tf.concat([tf.reshape(v, [-1, t, width]) for v, t in pieces], axis=1), [-1, width])

    return classes_factor(TF, SequenceClasses(*[joined(field) for field in SequenceClasses._fields]), options)


def _runtime_zeros(shape: list[int], dtype: Any, nonnegative: Any) -> Any:
    """Zeros of a static ``shape`` made at run time: TensorFlow's graph optimizer folds ``tf.zeros``
    of a static shape into a constant that the compiled step keeps as long as it lives (a
    language model's head- or table-sized sums, hundreds of MiB held between analyses); filled
    with a value computed from a run-time integer that is never negative (the step's ``start``,
    a signal's group: ``min(·, 0) = 0``), it cannot."""
    return tf.fill(shape, tf.cast(tf.minimum(nonnegative, 0), dtype))


def _block_of(values: Any, index: Any, start: Any, block: int) -> Any:
    """The ``(block, n)`` entries of a ``(K', M, n)`` per-signal array for signals ``start ..``.

    The same selection as the dense signals' (:func:`signal_layout`'s real slots, then a
    zero-padded block): a padded slot has scale and coefficients 0, a zero signal.
    """
    flat = tf.gather(tf.reshape(values, [-1, tf.shape(values)[-1]]), index)
    return tf.pad(flat, [[0, block], [0, 0]])[start:start + block]


def _factor_block(factor: Factor, index: Any, start: Any, block: int) -> tuple[Any, Any, list, list]:
    """A block of the estimator's signals in structured form.

    Signal ``b`` of row ``i`` (a sample of ``(n, C)`` logits, a token of per-sequence signals)
    is ``scale[b, i] · e_cls[b, i] + Σ_j coefs_j[b, i] · vectors_j[i]``
    (:class:`~normflat.engine.losses.Factor`), for the block of the real signals starting at
    ``start`` (the selection of :func:`_block_of`): ``(B, rows)`` classes (float; padding ``-1``
    or ``0`` with scale and coefficients 0), scales and coefficients, ``(rows, C)`` vectors.
    Only the block's signals are formed, in ``O(C)`` per signal and row (:meth:`Factor.through
    <normflat.engine.losses.Factor.through>` would form all of them); ``nsce``'s pull-back is the
    engine's, in the factor's coefficients.
    """
    cls = _block_of(factor.index, index, start, block)
    scale = _block_of(factor.scale, index, start, block)
    coefs = [_block_of(tf.broadcast_to(w, tf.shape(factor.index)), index, start, block) for w in factor.coefs]
    return cls, scale, list(factor.vectors), coefs


def _head_input_signals(factor: Factor, kernel: Any, index: Any, start: Any, block: int) -> Any:
    """``(block, rows, d)``: a block of the estimator's signals pulled back through a ``Dense`` head.

    ``factor`` holds the signals at the logits (:func:`~normflat.engine.losses.output_factor` of
    ``(n, C)`` logits, rows the samples; :func:`~normflat.engine.losses.sequence_factor` per
    sequence, rows the ``n·T`` tokens). ``kernel`` is the head's ``(d, C)`` kernel, so the
    signal ``s`` at the logits becomes ``kernel @ s`` at the head's input: with
    :func:`_factor_block`'s form, one gathered kernel column per signal and one ``(rows, C) ×
    (C, d)`` product per vector, ``O(C·d)`` per row instead of ``O(C²·d)`` per sample (method
    §6.1), ``O(d)`` per signal and token per sequence (method §6.3); the dense signals are never
    formed.
    """
    cls, scale, _, coefs = _factor_block(factor, index, start, block)
    # Factor.through's sum, written here for a block whose size is not static inside the step.
    weight = tf.transpose(kernel)  # (C, d): row c is class c's column of the kernel
    out = scale[..., None] * tf.gather(weight, tf.cast(tf.maximum(cls, 0), tf.int32))  # (B, rows, d)
    for vw, w in zip(factor.projected(TF, weight), coefs):
        out = out + w[..., None] * vw[None]
    return out


def _dense_block(zc: Any, u: Any, options: AnalysisOptions, index: Any, start: Any, block: int) -> Any:
    """``(block, n, C)``: the same block of signals, dense, from :func:`_factor_block`: ``O(C)`` per
    signal, where forming every signal (``ggn``'s ``(n, C, C)`` factor) at each block would cost
    ``O(C²)`` per sample and block."""
    cls, scale, vectors, coefs = _factor_block(output_factor(TF, zc, options, u), index, start, block)
    out = scale[..., None] * tf.one_hot(tf.cast(cls, tf.int32), int(zc.shape[-1]), dtype=zc.dtype)  # -1: zeros
    for v, w in zip(vectors, coefs):
        out = out + w[..., None] * v[None]
    return out


def _token_block(zc: Any, u: Any, counted: Any, options: AnalysisOptions, index: Any, start: Any, block: int,
                 tokens: int) -> Any:
    """``(block, n, T, C)``: a block of per-token signals of token logits, formed alone.

    Per token, signal ``(g·M + m)·T + t`` (:func:`signal_layout`) is the ``m``-th factor
    signal of token ``t`` of group ``g`` (:func:`~normflat.engine.losses.token_signals`),
    times whether the token is counted, placed at token ``t``. From the per-token
    :class:`~normflat.engine.losses.Factor` of the ``n·T`` rows (each token's draws from its
    own uniform columns) only the block's signals are formed, ``O(T·C)`` each, instead of the
    whole ``(K', M·T, n, T, C)`` tensor at every block.
    """
    c = int(zc.shape[-1])
    rows = tf.reshape(zc, [-1, c])  # (n·T, C), token-major within each sample
    per_token = None
    if options.draws:
        per_token = tf.reshape(u, [-1, int(u.shape[-1]) // tokens])[:, :options.draws]
    factor = output_factor(TF, rows, options, per_token)  # (K', M, n·T)

    def by_signal(values):  # (K', M, n·T) -> (K', M, T, n): flat signal (g·M + m)·T + t
        values = tf.broadcast_to(values, tf.shape(factor.index))
        k, m = int(factor.index.shape[0]), int(factor.index.shape[1])
        return tf.transpose(tf.reshape(values, [k, m, -1, tokens]), [0, 1, 3, 2])

    cls = _block_of(by_signal(factor.index), index, start, block)  # (B, n)
    scale = _block_of(by_signal(factor.scale), index, start, block)
    where = tf.pad(tf.constant(np.asarray(index) % tokens, tf.int32), [[0, block]])[start:start + block]  # (B,)
    out = scale[..., None] * tf.one_hot(tf.cast(cls, tf.int32), c, dtype=zc.dtype)  # padding (-1): zeros
    for v, w in zip(factor.vectors, factor.coefs):
        at = tf.transpose(tf.gather(tf.reshape(v, [-1, tokens, c]), where, axis=1), [1, 0, 2])  # (B, n, C)
        out = out + _block_of(by_signal(w), index, start, block)[..., None] * at
    out = out * tf.transpose(tf.gather(tf.cast(counted, zc.dtype), where, axis=1))[..., None]
    return out[:, :, None, :] * tf.one_hot(where, tokens, dtype=zc.dtype)[:, None, :, None]


def _sequence_block(zc: Any, u: Any, counted: Any, options: AnalysisOptions, index: Any, start: Any,
                    block: int) -> Any:
    """``(block, n, T, C)``: a block of per-sequence signals of token logits, formed alone.

    Per sequence, signal ``g·M' + m`` (:func:`signal_layout`) is the signed sum over the tokens
    of one per-token signal each (:func:`~normflat.engine.losses.token_signals`): from the
    tokens' classes and scales (:func:`~normflat.engine.losses.sequence_classes`, a few numbers
    per token and signal) only the block's signals are formed, ``O(T·C)`` each, instead of the
    whole ``(K', M', n, T, C)`` tensor at every block.
    """
    n, t, c = tf.shape(zc)[0], int(zc.shape[1]), int(zc.shape[2])
    classes = sequence_classes(TF, zc, options, tf.cast(counted, zc.dtype), u)  # (K', M', n·T)
    picked = [_block_of(v, index, start, block)[None] for v in (classes.index, classes.scale)]  # (1, B, n·T)
    sig = sequence_dense(TF, classes, options, *picked)  # (1, B, n·T, C)
    return tf.reshape(sig, [block, n, t, c])


def _same_padding(size: int, k: int, s: int, d: int) -> tuple[int, int]:
    total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
    return total // 2, total - total // 2


def _patches(x: Any, layer: Any) -> Any:
    """Channels-last input -> (n, positions, kernel offsets, in) windows matching the convolution."""
    r = layer.rank
    k, s, d = tuple(layer.kernel_size), tuple(layer.strides), tuple(layer.dilation_rate)
    spatial = [int(v) for v in x.shape[1:-1]]
    if r == 2 and layer.padding in ("same", "valid") and any(si > 1 for si in s):
        # A strided convolution (or the one a strided transposed convolution is the input gradient of):
        # TensorFlow's own unfolding, padded as its convolution pads, is one op, 4-5x faster than the
        # strided slices below (the offsets major, the channels minor, as they are). At stride 1 the
        # slices are contiguous and 1.5-3x faster than it (measured per shape, one thread).
        windows = tf.image.extract_patches(x, [1, *k, 1], [1, *s, 1], [1, *d, 1], layer.padding.upper())
        return tf.reshape(windows, [tf.shape(x)[0], int(windows.shape[1]) * int(windows.shape[2]), k[0] * k[1],
                                    int(x.shape[-1])])
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


#: Entries of the per-sample gradients formed at once by :func:`_summed_squares` (a few samples'
#: at a time, or one sample's when larger): they stay in cache while squared and summed.
SQUARES_CHUNK_ENTRIES = 1 << 16
#: The same where TensorFlow sees a GPU: there each iteration of the loop costs kernel launches,
#: and a cache-sized chunk buys nothing (16 MiB in float32; not measured on a GPU yet).
GPU_SQUARES_CHUNK_ENTRIES = 1 << 22


def squares_chunk_entries() -> int:
    """:data:`SQUARES_CHUNK_ENTRIES`, or :data:`GPU_SQUARES_CHUNK_ENTRIES` when TensorFlow sees a GPU."""
    return GPU_SQUARES_CHUNK_ENTRIES if _sees_gpu() else SQUARES_CHUNK_ENTRIES
#: Above this many entries, one sample's per-sample gradients of the signals are formed one signal
#: at a time (:func:`_summed_squares`), which bounds the step's working set (16 MiB in float32).
SIGNAL_SPLIT_ENTRIES = 1 << 22


def _summed_squares(a: Any, gs: list[Any], conv_groups: int = 1) -> Any:
    """Each sample's gradients ``g_b[n]ᵀ a[n]`` over the positions, squared and summed over ``n``.

    ``a``: ``(n, P, W)`` inputs over ``P`` positions, or ``(n, G, P, W/G)`` by group of a
    convolution with ``conv_groups = G > 1``; ``gs``: the ``B`` signals ``(n, P, O)``, a
    group's output channels one block of ``O``. Returns ``(B·O, W)``, or ``(G, B·O/G, W/G)``,
    the signals major. The per-sample gradients are formed a few samples at a time
    (:func:`squares_chunk_entries`), one sample's when they are larger (and one signal's above
    :data:`SIGNAL_SPLIT_ENTRIES`), in a loop, the signals joined per sample: forming all ``n``
    in one batched matmul and then squaring them was 1.3-5x slower on one thread (a batched
    matmul with a large output runs well below a plain one's speed, and its output leaves the
    cache before it is squared), and stacking the signals of the whole chunk beforehand was a
    copy about as slow as the squares (measured on the 3C3D CNN's convolutions and ResNet-sized
    ones, 2026-12-06). The working set no longer grows with the chunk
    (:func:`squares_working_set`).
    """
    b, o, w = len(gs), int(gs[0].shape[-1]), int(a.shape[-1])
    one = o * w  # entries of one signal's per-sample gradient (o·w/G per group, G groups)
    parts = [[g] for g in gs] if b > 1 and b * one > SIGNAL_SPLIT_ENTRIES else [gs]
    per = max(1, squares_chunk_entries() // (len(parts[0]) * one))
    n = tf.shape(a)[0]

    def joined(signals: list[Any], rows: Any) -> Any:  # (..., P, k·O), or by group (..., G, P, k·O/G)
        k = len(signals)
        g = signals[0][rows] if k == 1 else tf.concat([s[rows] for s in signals], axis=-1)
        if conv_groups == 1:
            return g
        lead = [] if per == 1 else [tf.shape(g)[0]]
        p, first = int(a.shape[-2]), len(lead)
        g = tf.reshape(g, [*lead, p, k, conv_groups, o // conv_groups])
        g = tf.transpose(g, [*range(first), first + 2, first, first + 1, first + 3])
        return tf.reshape(g, [*lead, conv_groups, p, k * o // conv_groups])

    def body(start: Any, *totals: Any) -> tuple[Any, ...]:
        rows = start if per == 1 else slice(start, start + per)
        out = []
        for signals, total in zip(parts, totals):
            grads = tf.matmul(joined(signals, rows), a[rows], transpose_a=True)
            out.append(total + (tf.square(grads) if per == 1 else tf.reduce_sum(tf.square(grads), axis=0)))
        return (start + per, *out)

    def zeros(k: int) -> Any:
        return tf.zeros([k * o, w] if conv_groups == 1 else [conv_groups, k * o // conv_groups, w], a.dtype)

    totals = tf.while_loop(lambda start, *_: start < n, body,
                           [tf.constant(0), *(zeros(len(signals)) for signals in parts)], parallel_iterations=1)[1:]
    return totals[0] if len(totals) == 1 else tf.concat(totals, axis=-2)


def squares_working_set(signals: int, size: int, pre_size: int) -> int:
    """Entries :func:`_summed_squares` holds at once for ``signals`` signals of a weight of ``size``
    entries whose pre-activation has ``pre_size`` entries per sample: the signals joined (and
    regrouped) for the samples of one iteration, their per-sample gradients and squares, and
    the running sums. Not per sample of the chunk."""
    k = 1 if signals > 1 and signals * size > SIGNAL_SPLIT_ENTRIES else signals
    per = max(1, squares_chunk_entries() // (k * size))
    return per * k * (2 * pre_size + 2 * size) + 2 * signals * size


#: Most positions a weight's squares are summed over by pairs of positions (:func:`_paired_squares`).
MAX_PAIR_POSITIONS = 16
#: Nanoseconds per entry, measured with TensorFlow on one core (2026-12-06, Dense and convolution
#: shapes of ConvNeXt-Tiny and ResNets: 4-36 positions, 192-1536 features): a matmul's multiply-add,
#: a pair's product of a signal or an input (gathered, multiplied, stacked, summed into its group),
#: and an entry of a formed per-sample gradient squared and summed (:func:`squares_by_pairs`).
PAIR_COSTS_NS = {"multiply-add": 0.033, "pair product": 3.0, "square": 1.2}


def squares_by_pairs(positions: int, signals: int, groups: int, out: int, width: int) -> bool:
    """Whether a weight ``(out, width)`` whose per-sample gradients sum over ``positions`` positions
    takes its squares by pairs of positions (:func:`_paired_squares`), for ``signals`` signals summed
    into ``groups`` sums: when the estimated time per sample is lower (:data:`PAIR_COSTS_NS`).

    By pairs: ``P(P+1)/2`` products of each signal and of the input, and a matmul over the pairs per
    group; by samples: a matmul over the positions per signal and the per-sample gradients squared.
    Measured against each other on ConvNeXt's and ResNets' shapes: 8-10x faster at 4 positions,
    2.6x at 9; at 16, 1.6x faster to 1.6x slower (the signals' products grow with ``out``); 3.6x
    slower at 36.
    """
    if not 1 < positions <= MAX_PAIR_POSITIONS:
        return False
    pairs = positions * (positions + 1) // 2
    cost = PAIR_COSTS_NS
    by_pairs = 2 * groups * pairs * out * width * cost["multiply-add"] \
        + pairs * (signals * out + width) * cost["pair product"]
    by_samples = 2 * positions * signals * out * width * cost["multiply-add"] + signals * out * width * cost["square"]
    return by_pairs < by_samples


def _squares_entries(positions: int, signals: int, groups: int, out: int, width: int, pre_size: int,
                     pairs: bool) -> tuple[int, int]:
    """``(per sample, fixed)`` entries of :func:`_per_sample_squares` for a weight ``(out, width)``
    over ``positions`` positions (``pre_size`` entries of signal per sample), as it chooses
    (``pairs``: the pairs of positions allowed): by pairs, per sample, the signals' products over
    the pairs (stacked), their group sums (and a transposed copy) and the input's products; in
    the loop, its working set once (:func:`squares_working_set`)."""
    if pairs and squares_by_pairs(positions, signals, groups, out, width):
        return positions * (positions + 1) // 2 * (2 * signals * out + 2 * groups * out + 2 * width), 0
    return 0, squares_working_set(signals, out * width, pre_size)


def _paired_squares(a: Any, gs: list[Any], seg: Any, groups: int) -> Any:
    """``(groups, O, W)`` sums of squared per-sample gradients ``Σ_l g_b[n, l] a[n, l]ᵀ`` by pairs of positions.

    ``a``: ``(n, P, W)`` inputs, ``gs``: the B signals ``(n, P, O)``, ``seg``: each signal's group.
    A per-sample gradient's square is ``Σ_{l,l'} (g_l ⊙ g_l') (a_l ⊙ a_l')ᵀ``: over the pairs
    ``l <= l'`` (the others twice), the signals' products summed into their group first (the
    inputs' products do not depend on the signal), then one matmul over the samples and pairs
    per group. No per-sample gradient is formed (method §6.1, "Squares by pairs of positions").
    """
    p, w, o = int(a.shape[1]), int(a.shape[-1]), int(gs[0].shape[-1])
    first, second = np.triu_indices(p)
    twice = np.where(first == second, 1.0, 2.0)[:, None]
    a2 = tf.gather(a, first, axis=1) * tf.gather(a, second, axis=1) * tf.constant(twice, a.dtype)  # (n, pairs, W)
    d = tf.stack([tf.gather(g, first, axis=1) * tf.gather(g, second, axis=1) for g in gs])  # (B, n, pairs, O)
    d = tf.math.unsorted_segment_sum(d, seg, groups)  # (K, n, pairs, O)
    if groups == 1:
        return tf.matmul(tf.reshape(d, [-1, o]), tf.reshape(a2, [-1, w]), transpose_a=True)[None]
    d = tf.reshape(tf.transpose(d, [1, 2, 0, 3]), [-1, groups * o])  # (n·pairs, K·O): one matmul
    return tf.reshape(tf.matmul(d, tf.reshape(a2, [-1, w]), transpose_a=True), [groups, o, w])


def _per_sample_squares(a: Any, gs: list[Any], seg: Any, groups: int, pairs: bool = False) -> Any:
    """``Σ_n (per-sample gradient)²`` per signal group (:func:`_summed_squares`).

    ``a``: (n, T, K) layer inputs (patches); ``gs``: the B signals (n, T, O). The
    per-sample gradient of signal b is ``gs[b][n]ᵀ a[n]`` (O × K); returns (groups, O, K).
    ``pairs``: by pairs of positions where :func:`squares_by_pairs` finds it faster.
    """
    b, o, k = len(gs), int(gs[0].shape[-1]), int(a.shape[-1])
    if pairs and a.shape[1] is not None and squares_by_pairs(int(a.shape[1]), b, groups, o, k):
        return _paired_squares(a, gs, seg, groups)
    sq = _summed_squares(a, gs)
    return tf.math.unsorted_segment_sum(tf.reshape(sq, [b, o, k]), seg, groups)


class TableRows(NamedTuple):
    """An embedding's per-sample squares on the rows a step reads: ``values`` ``(K, features, U)``
    for the table rows ``rows`` ``(U,)`` (distinct), zero elsewhere. The session adds them into the
    running ``(K, features, vocabulary)`` sums (:meth:`dense` where those are not writable): a
    step never forms ``K`` tables of the vocabulary for the few hundred rows a batch reads."""

    values: Any
    rows: Any

    def dense(self, vocabulary: int) -> Any:
        """``(K, features, vocabulary)``: the squares with the rows not read at zero."""
        table = tf.scatter_nd(self.rows[:, None], tf.transpose(self.values, [2, 0, 1]),
                              tf.cast(tf.stack([vocabulary, *tf.unstack(tf.shape(self.values)[:2])]), tf.int64))
        return tf.transpose(table, [1, 2, 0])


def _embedding_squares(ids: Any, gs: list[Any], seg: Any, groups: int, vocabulary: int) -> TableRows:
    """Per-sample squares of an embedding table (method §3, Embeddings) on the rows the chunk reads
    (:class:`TableRows`; canonical layout ``(K, features, vocabulary)`` once added).

    The per-sample gradient of row ``v`` is the sum of the output signals at the
    positions of sample ``n`` that look up ``v``: a scatter of the signals per
    (sample, id) pair, squared, then summed per row. Only the pairs that occur are
    formed (at most ``n·T`` of them), never an ``(n, vocabulary)`` array.
    """
    b = len(gs)
    d = int(gs[0].shape[-1])
    n = tf.shape(ids)[0]
    ids = _table_rows(ids, vocabulary)  # (n, T)
    t = tf.shape(ids)[1]
    pair = tf.range(tf.cast(n, tf.int64))[:, None] * vocabulary + ids  # one key per (sample, id)
    keys, slot = tf.unique(tf.reshape(pair, [-1]))
    g = tf.reshape(tf.stack(gs, axis=-2), [n * t, b * d])  # (n·T, B·d)
    per_pair = tf.math.unsorted_segment_sum(g, slot, tf.shape(keys)[0])  # (U, B·d)
    sq = tf.transpose(tf.reshape(tf.square(per_pair), [-1, b, d]), [1, 0, 2])  # (B, U, d)
    sq = tf.math.unsorted_segment_sum(sq, seg, groups)  # (K, U, d)
    rows, at = tf.unique(tf.math.floormod(keys, vocabulary))  # the distinct table rows read
    per_row = tf.math.unsorted_segment_sum(tf.transpose(sq, [1, 0, 2]), at, tf.shape(rows)[0])  # (R, K, d)
    return TableRows(tf.transpose(per_row, [1, 2, 0]), rows)  # (K, d, R)


def _table_rows(ids: Any, vocabulary: int) -> Any:
    """``(n, T)`` int64 rows a lookup of ``ids`` reads: Keras' ``take`` reads row ``V + i`` for a
    negative id ``i`` (ids past the table fail in the forward pass)."""
    ids = tf.reshape(tf.cast(ids, tf.int64), [tf.shape(ids)[0], -1])
    return tf.where(ids < 0, ids + vocabulary, ids)


def _joined_lookups(calls: list[tuple[Any, list[Any]]]) -> list[Any]:
    """``[ids (n, P), signals]`` of one lookup standing for several calls of a table's lookup, each
    ``(ids, its B signals at the output)``: a sample's gradient is the sum of the calls' scatters of
    their signals into the rows of their ids, which is the scatter of the calls' positions together
    (method §6.1, "Tied weights")."""
    if len(calls) == 1:
        return [calls[0][0], calls[0][1]]
    n = tf.shape(calls[0][0])[0]
    ids = tf.concat([tf.reshape(c[0], [n, -1]) for c in calls], axis=1)
    signals = [tf.concat([tf.reshape(c[1][j], [n, -1, int(c[1][j].shape[-1])]) for c in calls], axis=1)
               for j in range(len(calls[0][1]))]
    return [ids, signals]


def _tied_squares(entry: Entry, lookup: list | None, reverse: list | None, seg: Any, groups: int) -> Any:
    """``(K, features, vocabulary)`` per-sample squares of a ``ReversibleEmbedding``'s tied table.

    ``lookup`` is ``[ids (n, T), signals]`` of its lookup call and ``reverse`` ``[input (n, ..., d),
    signals]`` of its ``reverse=True`` call (``None``: the forward has no such call), with one
    signal per back-propagated column (each shaped like that call's output). Per sample and
    signal the table's gradient is the sum of the uses' (method §6.1 "Tied weights"): the
    lookup's signals added into the rows of the sample's ids, and the reverse projection's
    ``Σ_t s_t a_tᵀ``, ``(vocabulary, features)``; it is squared, summed over the samples and
    added into the signal's group. The signals go one at a time (a ``tf.while_loop`` of one
    iteration in flight), so the step holds ``samples × vocabulary × features`` gradients of
    one signal, never of the block.
    """
    variable = entry.variable
    vocab, dim = (int(d) for d in variable.shape)
    dtype = tf.as_dtype(variable.dtype)
    first = (lookup or reverse)[1]
    b = len(first)
    n = tf.shape((lookup or reverse)[0])[0]
    parts = []  # per use, a function: signal index -> (n, V, d) per-sample gradients
    if lookup is not None:
        ids, gl = lookup
        rows = _table_rows(ids, vocab)
        keys = tf.reshape(tf.range(tf.cast(n, tf.int64))[:, None] * vocab + rows, [-1])
        gl = tf.stack(gl)  # (B, n, T, d)

        def scatter(j, gl=gl, keys=keys):
            signal = tf.cast(tf.reshape(gl[j], [-1, dim]), dtype)
            return tf.reshape(tf.math.unsorted_segment_sum(signal, keys, n * vocab), [n, vocab, dim])

        parts.append(scatter)
    if reverse is not None:
        a, gr = reverse
        gr = tf.stack(gr)  # (B, n, ..., V)
        a = tf.reshape(a, [n, -1, dim])
        gr = tf.reshape(gr, [b, n, -1, vocab])

        def product(j, a=a, gr=gr):
            s = gr[j]
            # logits = a @ tableᵀ (in the signals' dtype: the layer's reverse_dtype): s_tᵀ a_t per sample
            return tf.cast(tf.matmul(s, tf.cast(a, s.dtype), transpose_a=True), dtype)

        parts.append(product)

    def body(j, acc):
        g = parts[0](j)
        for part in parts[1:]:
            g = g + part(j)
        square = tf.reduce_sum(tf.square(g), axis=0)  # (V, d)
        return j + 1, tf.tensor_scatter_nd_add(acc, [[seg[j]]], square[None])

    acc = _runtime_zeros([groups, vocab, dim], dtype, seg[0])
    _, acc = tf.while_loop(lambda j, acc: j < b, body, (tf.constant(0), acc), parallel_iterations=1)
    return tf.transpose(acc, [0, 2, 1])  # (K, d, V)


def _table_squares(entry: Entry, view: Any, gs: list[Any], seg: Any, groups: int) -> Any:
    """``(K, features, positions)`` per-sample squares of a loose position table.

    ``gs`` are the signals at the table's ``view`` expanded over the batch
    (:meth:`Taps.expanded`): each sample's gradient of the table, squared and summed over
    the samples, then over the signals of each group (method §6.1, "Position tables").
    """
    gs = [tf.zeros_like(view) if g is None else g for g in gs]  # a table the logits do not reach
    sq = tf.reduce_sum(tf.square(tf.stack(gs)), axis=1)  # (B, *table without a leading 1)
    sq = tf.math.unsorted_segment_sum(sq, seg, groups)
    sq = tf.reshape(sq, [groups, *(int(d) for d in entry.variable.shape)])
    return tf.vectorized_map(entry.weight.to_canonical, sq)


def _einsum_positions(equation: str, x: Any, gs: list[Any]) -> tuple[Any, Any]:
    """An ``EinsumDense`` input and its B signals as ``(n, P, ∏ contracted)`` and B ``(n, P,
    ∏ output-only)``: the positions (shared axes) over which a sample's gradient sums."""
    inp, _, out, shared, input_only, contracted = einsum_fast_axes(equation)
    outputs = "".join(a for a in out[1:] if a not in shared)
    n = tf.shape(x)[0]
    if input_only:
        x = tf.reduce_sum(x, axis=[inp.index(a) for a in input_only])
        inp = "".join(a for a in inp if a not in input_only)
    x = tf.transpose(x, [inp.index(a) for a in inp[0] + shared + contracted])
    in_size = int(np.prod([int(x.shape[1 + len(shared) + i]) for i in range(len(contracted))]))
    xf = tf.reshape(x, [n, -1, in_size])
    perm = [0] + [1 + out[1:].index(a) for a in shared + outputs]
    out_size = int(np.prod([int(gs[0].shape[perm[1 + len(shared) + i]]) for i in range(len(outputs))]))
    # Each signal (n, shared..., outputs...) as (n, P, O).
    return xf, [tf.reshape(tf.transpose(g, perm), [n, -1, out_size]) for g in gs]


def _einsum_squares(equation: str, x: Any, gs: list[Any], seg: Any, groups: int, samples: Any = None,
                    fold: int = 1) -> Any:
    """``(K, ∏ output-only, ∏ contracted)`` per-sample squares of an ``EinsumDense`` kernel.

    The pre-activation is linear in the kernel: per sample it is the dense map from
    the flattened contracted input axes to the flattened output-only axes, applied
    at every index of the shared axes (positions). The per-sample gradient is then
    ``Σ_positions g ⊗ x``, formed by batched matmuls as for a dense layer on sequences.
    """
    xf, gf = _einsum_positions(equation, x, gs)
    if samples is not None:
        xf, gf = _blocks_per_sample(xf, gf, samples, fold)
    return _per_sample_squares(xf, gf, seg, groups)


def _blocks_per_sample(xf: Any, gf: list[Any], samples: Any, fold: int) -> tuple[Any, list[Any]]:
    """``(n·f, P, in)`` inputs and B ``(n·f, P, O)`` signals of a batch folded into the leading
    axis (each sample's ``f`` rows one after the other, :attr:`Entry.fold`) as ``n`` samples of
    ``f·P`` positions: the per-sample gradient sums the sample's block."""
    tf.debugging.assert_equal(tf.shape(xf)[0], samples * fold, message=(
        f"normflat: a layer's leading axis does not hold {fold} rows per sample in this chunk, as it did on "
        "the first batch; pass fast=False"))
    # f·P positions per sample, static where P is (squares_by_pairs, as ggn_bytes estimates it).
    p = -1 if xf.shape[1] is None else fold * int(xf.shape[1])
    return (tf.reshape(xf, [samples, p, int(xf.shape[-1])]),
            [tf.reshape(g, [samples, p, int(g.shape[-1])]) for g in gf])


def _dense_positions(x: Any, gs: list[Any]) -> tuple[Any, list[Any]]:
    """A ``Dense`` input ``(n, ..., in)`` and its B signals ``(n, ..., out)`` as ``(n, P, in)`` and
    B ``(n, P, out)``: the positions :func:`_per_sample_squares` sums each sample's gradient over."""
    n = tf.shape(x)[0]
    # The positions' count static where the shape is (pairs of positions, squares_by_pairs).
    p = -1 if any(d is None for d in x.shape[1:-1]) else math.prod(int(d) for d in x.shape[1:-1])
    return tf.reshape(x, [n, p, int(x.shape[-1])]), [tf.reshape(g, [n, p, int(g.shape[-1])]) for g in gs]


def _repeated_squares(calls: list[tuple[Any, list[Any]]], seg: Any, groups: int,
                      positions: Callable[[Any, list[Any]], tuple[Any, Any]] = None) -> Any:
    """``(K, out, in)`` squares of a ``Dense`` (or, with ``positions`` :func:`_einsum_positions`'s, an
    ``EinsumDense``) kernel used by several calls per forward, each ``(input, its B signals at the
    pre-activation)``: a sample's gradient is the sum over the calls and their positions of the
    signal times the input, so the calls' positions are concatenated and the dense rule applied
    once (method §6.1, "Tied weights")."""
    xs, gs = zip(*((positions or _dense_positions)(x, signals) for x, signals in calls))
    joined = [tf.concat([call[j] for call in gs], 1) for j in range(len(gs[0]))]
    return _per_sample_squares(tf.concat(xs, 1), joined, seg, groups, pairs=positions is None)


def _step_squares(x: Any, gs: list[Any], seg: Any, groups: int) -> Any:
    """``(K, out, in)`` squares of a recurrent weight from what it multiplied at every step, ``x``
    ``(n, T, in)``, and the B signals at its product ``(n, T, out)``: the dense rule with the steps as
    positions (method §6.1, "Recurrent weights"), one signal at a time, so that the ``(n, out, in)``
    per-sample gradients of one signal are alive at once, not of the B (a recurrent kernel's are
    larger than the activations of all steps)."""
    squares = [tf.reduce_sum(tf.square(tf.matmul(g, x, transpose_a=True)), axis=0) for g in gs]
    return tf.math.unsorted_segment_sum(tf.stack(squares), seg, groups)


def _fast_squares(entry: Entry, x: Any, gs: list[Any], seg: Any, groups: int, samples: Any) -> Any:
    """Per-group sums over samples and signals of squared per-sample gradients, canonical layout.

    ``x``: the layer input (n, ...), or ``(n·f, ...)`` for a ``Dense``/``EinsumDense`` on a batch
    folded into the leading axis (:attr:`Entry.fold`); ``gs``: the B back-propagated signals at
    the pre-activation, each shaped like it; ``samples``: ``n``. Grouped convolutions give
    ``(K, out, in/groups, *k)``: each output channel's own input channels only.
    """
    folded = samples if entry.fold > 1 else None
    layer = entry.layer
    if entry.fast == "embedding":
        return _embedding_squares(x, gs, seg, groups, int(entry.variable.shape[0]))
    if entry.fast == "position":
        # Each output entry is one table row (the first forward checked it): a lookup of the rows.
        rows = tf.cast(x[..., 0], tf.int64)
        return _embedding_squares(rows, gs, seg, groups, int(entry.variable.shape[0]))
    if entry.fast == "table":
        return _table_squares(entry, x, gs, seg, groups)
    if entry.fast == "einsum":
        return _einsum_squares(layer.equation, x, gs, seg, groups, folded, entry.fold)
    if entry.fast == "separable_pointwise":
        return _conv_squares(_Pointwise(layer), x, gs, seg, groups, 1)
    if entry.fast == "conv_transpose":
        return _conv_transpose_squares(layer, x, gs, seg, groups)
    if entry.fast == "dense":
        return _dense_squares(x, gs, seg, groups, folded, entry.fold)
    return _conv_squares(layer, x, gs, seg, groups, int(entry.weight.groups))


def _dense_squares(x: Any, gs: list[Any], seg: Any, groups: int, folded: Any = None, fold: int = 1) -> Any:
    """``(K, out, in)`` squares of a ``Dense`` kernel from its input ``x`` ``(n, ..., in)`` (``(n·f, ...)``
    on a batch folded into the leading axis: ``folded`` the samples ``n``, ``fold`` the ``f``) and the
    B signals at its pre-activation ``(n, ..., out)``."""
    if folded is None and (len(x.shape) == 2 or all(int(d or 0) == 1 for d in x.shape[1:-1])):
        # One position (also (n, 1, 1, in) after a global pooling): the per-sample gradient
        # x ⊗ g is rank one, its square x² ⊗ g², summed over n by a matmul.
        x2 = tf.square(tf.reshape(x, [-1, int(x.shape[-1])]))
        g2 = tf.square(tf.reshape(tf.stack(gs), [len(gs), -1, int(gs[0].shape[-1])]))
        g2 = tf.math.unsorted_segment_sum(g2, seg, groups)  # (K, n, out)
        return tf.matmul(g2, x2[None], transpose_a=True)  # (K, out, in)
    xf, gf = _dense_positions(x, gs)
    if folded is not None:
        xf, gf = _blocks_per_sample(xf, gf, folded, fold)
    return _per_sample_squares(xf, gf, seg, groups, pairs=True)


def _lora_factors(layer: Any) -> tuple[Any, Any]:
    """The ``A`` and ``B`` variables of a LoRA-enabled layer (an ``Embedding``'s are ``lora_embeddings_*``)."""
    if hasattr(layer, "lora_embeddings_a"):
        return layer.lora_embeddings_a, layer.lora_embeddings_b
    return layer.lora_kernel_a, layer.lora_kernel_b


def _into_rank(g: Any, b: Any, axis: int) -> Any:
    """``g`` with its axis ``axis`` (the kernel's last axis) contracted with ``B``'s last one: ``g Bᵀ``, the
    rank in that axis' place."""
    out = tf.tensordot(g, b, [[axis], [1]])  # the rank last
    last = len(out.shape) - 1
    return out if axis == last else tf.transpose(out, [*range(axis), last, *range(axis, last)])


def _lora_views(layer: Any, factor: str, x: Any, gs: list[Any]) -> tuple[Any, list[Any], Any]:
    """One call of a LoRA-enabled layer as the product of one of its factors: ``(input, B signals at the
    product, rule)`` (method §6.1, "LoRA adapters"), ``rule`` as :func:`_lora_squares` reads it.

    The layer's kernel is ``K = W + s·A·B`` (``s = α/r``; ``A`` the kernel's axes but the last, then the
    rank; ``B`` the rank, then the kernel's last axis, an output). A sample's gradient of ``K`` is the
    layer's rule on its input and signals; of ``A`` it is that contracted with ``s·B`` over the last
    axis, which is ``A``'s own rule (the layer's kind, with ``r`` outputs) on the input ``x`` and the
    signals ``s·g·Bᵀ``; of ``B`` it is ``s·Aᵀ`` times it, the dense rule on ``B``'s input ``u = s·(x
    through A)`` (``A``'s product: a matmul, the einsum, a lookup, the convolution) and ``g``, every
    other axis a position. ``x`` and ``gs``: the layer's input (an ``Embedding``'s ids) and the B
    signals at its pre-activation (output).
    """
    scale = float(layer.lora_alpha) / float(layer.lora_rank)
    a_var, b_var = _lora_factors(layer)
    a = tf.cast(tf.stop_gradient(tf.convert_to_tensor(a_var.value)), gs[0].dtype)
    b = tf.cast(tf.stop_gradient(tf.convert_to_tensor(b_var.value)), gs[0].dtype)
    kind = fast_kind(layer)
    if kind == "einsum":
        equation, _ = rank_equation(layer.equation)
        last = layer.equation.replace(" ", "").split("->")[0].split(",")[1][-1]
        out = layer.equation.replace(" ", "").split("->")[1]
        axis = out.index(last)
        if factor == "lora_a":
            return x, [scale * _into_rank(g, b, axis) for g in gs], ("einsum", equation)
        u = scale * tf.einsum(equation, tf.cast(x, a.dtype), a)  # (…, r) where the output has the last axis
        perm = [i for i in range(len(out)) if i != axis] + [axis]  # the rank (last axis) to the end
        return tf.transpose(u, perm), [tf.transpose(g, perm) for g in gs], "dense"
    if kind == "conv" and factor == "lora_b":  # A (*k, in, r): a convolution of r outputs (channels last)
        return scale * layer.convolution_op(tf.cast(x, a.dtype), a), gs, "dense"
    if factor == "lora_a":  # "dense", "embedding", "conv": r outputs
        return x, [scale * _into_rank(g, b, len(g.shape) - 1) for g in gs], kind
    if kind == "embedding":  # u: the rows of A the ids read
        return scale * tf.gather(a, tf.cast(x, tf.int32)), gs, "dense"
    return scale * tf.tensordot(tf.cast(x, a.dtype), a, [[len(x.shape) - 1], [0]]), gs, "dense"


def _lora_squares(entry: Entry, calls: list[tuple[Any, list[Any]]], seg: Any, groups: int, samples: Any) -> Any:
    """Canonical per-group squares of one weight of a LoRA-enabled layer from its recorded calls, each
    ``(input, B signals at the pre-activation)``: the frozen kernel by its layer's rule, a factor by its
    own (:func:`_lora_views`; method §6.1, "LoRA adapters"); several calls' positions together (method
    §6.1, "Tied weights")."""
    layer = entry.layer
    if entry.fast in LORA_KINDS:
        views = [_lora_views(layer, entry.fast, x, gs) for x, gs in calls]
        rule = views[0][2]
        calls = [(x, gs) for x, gs, _ in views]
    else:
        rule = ("einsum", layer.equation) if entry.fast == "einsum" else entry.fast
    vocabulary = int(_lora_factors(layer)[0].shape[0]) if rule == "embedding" else 0
    return _calls_squares(rule, layer, calls, seg, groups, vocabulary, 1, samples, entry.fold)


def _calls_squares(rule: Any, layer: Any, calls: list[tuple[Any, list[Any]]], seg: Any, groups: int,
                   vocabulary: int = 0, conv_groups: int = 1, samples: Any = None, fold: int = 1) -> Any:
    """Per-group squares of a weight from the ``(input, B signals at its output)`` of each call that applies
    it, by ``rule``: ``"dense"``, ``("einsum", equation)``, ``"embedding"`` (a table of ``vocabulary`` rows
    looked up at the ids) or ``"conv"`` (the layer's convolution, ``conv_groups`` groups). Several calls
    go as one over their positions together (method §6.1, "Tied weights"); one call's input may hold
    ``fold`` rows per sample (``samples`` samples, :attr:`Entry.fold`)."""
    if rule == "embedding":
        return _embedding_squares(*(_joined_lookups(calls) if len(calls) > 1 else calls[0]), seg, groups, vocabulary)
    if rule == "conv":
        return _conv_squares(layer, *calls[0], seg, groups, conv_groups, calls[1:])
    equation = rule[1] if isinstance(rule, tuple) else None
    if len(calls) > 1:
        return _repeated_squares(calls, seg, groups,
                                 None if equation is None else functools.partial(_einsum_positions, equation))
    (x, gs), = calls
    folded = samples if fold > 1 else None
    if equation is not None:
        return _einsum_squares(equation, x, gs, seg, groups, folded, fold)
    return _dense_squares(x, gs, seg, groups, folded, fold)


class _Pointwise:
    """The pointwise (1×1, stride 1) convolution of a ``SeparableConv1D/2D`` as
    :func:`_conv_squares` reads a layer (the depthwise one is the layer's own attributes)."""

    def __init__(self, layer: Any) -> None:
        self.rank, self.data_format, self.padding = int(layer.rank), layer.data_format, "valid"
        self.kernel_size = self.strides = self.dilation_rate = (1,) * self.rank


def _conv_squares(layer: Any, x: Any, gs: list[Any], seg: Any, groups: int, conv_groups: int,
                  more: list[tuple[Any, list[Any]]] = ()) -> Any:
    """``(K, out, in/groups, *k)`` per-sample squares of a (grouped, depthwise) convolution kernel.

    ``more``: the ``(input, signals)`` of the layer's further calls in the forward (a layer shared
    by branches): a sample's gradient sums every call's, so their positions join the first call's.

    The per-sample gradient of output channel ``o`` (group ``k``) and signal ``b``
    is ``Σ_positions g[b, o] ⊗ patch[group k's input channels]``: with the groups
    as a batch axis of one batched matmul per chunk of samples (``(groups, P, B·out/groups)ᵀ ×
    (groups, P, koff·in/groups)`` per sample, :func:`_summed_squares`), never a loop over
    groups. A depthwise kernel
    is the case ``in/groups = 1``, ``out/groups = depth_multiplier``. With a single
    output position (``P = 1``) the per-sample gradient is rank one and its square
    ``g² ⊗ patch²`` is summed over the samples by the matmul itself, so the
    ``(n, B·out, koff·in/groups)`` per-sample gradients are never formed.
    """
    b = len(gs)
    r = layer.rank
    a_parts, g_parts = [], []
    for x, gs in [(x, gs), *more]:
        if layer.data_format == "channels_first":
            x = tf.transpose(x, [0] + list(range(2, r + 2)) + [1])
            gs = [tf.transpose(g, [0] + list(range(2, r + 2)) + [1]) for g in gs]
        patches = _patches(x, layer)  # (n, P, koff, cin)
        n = tf.shape(patches)[0]
        npos, koff, cin = int(patches.shape[1]), int(patches.shape[2]), int(patches.shape[3])
        cout = int(gs[0].shape[-1])
        cin_g, cout_g = cin // conv_groups, cout // conv_groups
        # Group k's input channels k·cin_g ... and output channels k·cout_g ... (method §3, grouped layout).
        a_parts.append(tf.reshape(patches, [n, npos, koff, conv_groups, cin_g]))
        g_parts.append([tf.reshape(g, [n, npos, cout]) for g in gs])
    a = a_parts[0] if len(a_parts) == 1 else tf.concat(a_parts, 1)
    # Each signal (n, P, out) over every call's positions.
    gl = g_parts[0] if len(g_parts) == 1 else [tf.concat([p[j] for p in g_parts], 1) for j in range(b)]
    npos = int(a.shape[1])
    width = koff * cin_g
    if npos > 1 and conv_groups == 1:
        # The dense rule over the positions (by pairs of them where faster): (K, cout, width).
        sq = _per_sample_squares(tf.reshape(a, [n, npos, width]), gl, seg, groups, pairs=True)
    else:
        if npos == 1:
            g = tf.reshape(tf.stack(gl, axis=-2), [n, npos, b, conv_groups, cout_g])  # small: one position
            a2 = tf.reshape(tf.transpose(tf.square(a), [3, 0, 1, 2, 4]), [conv_groups, n, width])
            g2 = tf.reshape(tf.transpose(tf.square(g), [3, 0, 1, 2, 4]), [conv_groups, n, b * cout_g])
            sq = tf.matmul(g2, a2, transpose_a=True)  # (groups, B·cout_g, width)
        else:
            a = tf.reshape(tf.transpose(a, [0, 3, 1, 2, 4]), [n, conv_groups, npos, width])
            sq = _summed_squares(a, gl, conv_groups)  # (groups, B·cout_g, width)
        sq = tf.transpose(tf.reshape(sq, [conv_groups, b, cout_g, width]), [1, 0, 2, 3])  # (B, groups, cout_g, width)
        sq = tf.math.unsorted_segment_sum(sq, seg, groups)  # (K, groups, cout_g, width)
    k = tuple(layer.kernel_size)
    sq = tf.reshape(sq, [groups, cout, *k, cin_g])
    return tf.transpose(sq, [0, 1, r + 2] + list(range(2, r + 2)))  # (K, out, in/groups, *k)


def _conv_transpose_squares(layer: Any, x: Any, gs: list[Any], seg: Any, groups: int) -> Any:
    """``(K, out, in, *k)`` per-sample squares of a transposed convolution's kernel.

    A ``ConvNDTranspose`` computes the input gradient of the convolution with its kernel
    ``(*k, out, in)`` from the layer's output space to its input space (its strides, dilation and
    ``"same"``/``"valid"`` padding, as TensorFlow pads that convolution): ``⟨g, y⟩ = ⟨conv(g), x⟩``,
    so the per-sample gradient for signal ``b`` is the convolution's rule with the roles swapped,
    ``Σ_positions patch(g_b) ⊗ x`` over the input's positions: the patches of each signal (not of the
    input) times the input there. With one input position (a generator's first layer on a 1×1 code)
    it is rank one and its square ``patch(g_b)² ⊗ x²`` is summed over the samples by the matmul itself.
    """
    b, r = len(gs), int(layer.rank)
    if layer.data_format == "channels_first":
        x = tf.transpose(x, [0] + list(range(2, r + 2)) + [1])
        gs = [tf.transpose(g, [0] + list(range(2, r + 2)) + [1]) for g in gs]
    n = tf.shape(x)[0]
    cin, cout = int(x.shape[-1]), int(gs[0].shape[-1])
    npos = math.prod(int(d) for d in x.shape[1:-1])
    patches = [_patches(g, layer) for g in gs]  # each (n, positions of the input, koff, cout)
    if int(patches[0].shape[1]) != npos:
        raise ValueError(f"{layer.name}: the transposed convolution's {int(patches[0].shape[1])} windows do not "
                         f"match its input's {npos} positions")
    width = int(patches[0].shape[2]) * cout
    patches = [tf.reshape(p, [n, npos, width]) for p in patches]
    if npos == 1:
        p2 = tf.reshape(tf.square(tf.concat(patches, axis=-1)), [n, b * width])
        x2 = tf.reshape(tf.square(x), [n, cin])
        sq = tf.reshape(tf.matmul(p2, x2, transpose_a=True), [b, width, cin])
    else:
        sq = tf.reshape(_summed_squares(tf.reshape(x, [n, npos, cin]), patches), [b, width, cin])
    sq = tf.math.unsorted_segment_sum(sq, seg, groups)  # (K, koff·cout, cin)
    sq = tf.reshape(sq, [groups, *layer.kernel_size, cout, cin])
    return tf.transpose(sq, [0, r + 1, r + 2] + list(range(1, r + 1)))  # (K, out, in, *k)


def _signal_gradients(tape: Any, target: Any, pre: list[Any], signals: Any, block: int,
                      unrolled: bool) -> list[list[Any]]:
    """``back[i][j]``: the gradient at ``pre[j]`` of signal ``i`` of ``signals`` (``(block, *target.shape)``,
    each put at ``target``); ``None`` (unrolled) or zeros (looped) where ``target`` does not depend
    on ``pre[j]``.

    ``unrolled``: one back-propagation per signal in the graph, the fastest to run on a CPU (the
    loop's per-iteration bookkeeping and the graph optimizations that stop at its boundary cost
    3C3D about 20 %); otherwise one back-propagation in a ``tf.map_fn`` over the signals, which
    builds ``block`` times less graph (:data:`UNROLL_OPS`).
    """
    if unrolled or block == 1:
        return [tape.gradient(target, pre, output_gradients=signals[i]) for i in range(block)]

    def one(signal):
        grads = tape.gradient(target, pre, output_gradients=signal)
        return [tf.zeros_like(p) if g is None else tf.convert_to_tensor(g) for g, p in zip(grads, pre)]

    # As many signals in flight as the unrolled graph allows (the same working set).
    stacked = tf.map_fn(one, signals, fn_output_signature=[tf.TensorSpec(p.shape, p.dtype) for p in pre],
                        parallel_iterations=block)
    return [[t[i] for t in stacked] for i in range(block)]


def _generic_squares(model: Any, x: Any, options: AnalysisOptions, taps: Taps, variables: list[Any], signals: Any,
                     seg: Any, sums: int, block: int, unrolled: bool) -> list[Any]:
    """The generic path's squares: each sample's gradients of ``variables`` for the block's
    ``signals`` ``(block, n, *logits)``, squared and summed into the signals' groups ``seg``;
    ``(sums, *variable shape)`` per variable.

    One sample at a time (a ``tf.while_loop`` over the chunk): the sample's own forward (the
    tapped layers quiet, :meth:`Taps.quiet`), then one back-propagation of each signal from its
    logits (written out, or in a loop over the signals: :func:`_signal_gradients`, ``unrolled``).
    The model's samples are apart (checked on the first forward), so these are the per-sample
    gradients of the chunk's forward: ``n`` forwards and ``block·n`` back-propagations of one
    sample each. A signal put at one sample of the chunk's logits instead would go back through
    all ``n`` samples, ``block·n²`` sample-passes (vectorized, as this path ran before: a tiny
    gated delta net took 138 s for 64 samples, 1.8 s this way; ``benchmarks/keras_generic.py``).
    """
    n = tf.shape(signals)[1]

    def body(i: Any, *totals: Any) -> tuple[Any, ...]:
        xi = tf.nest.map_structure(lambda t: tf.expand_dims(t[i], 0), x)  # a static batch of one
        with taps.quiet(), tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
            for v in variables:
                tape.watch(v)
            zi = model_logits(model, xi, options)
        back = _signal_gradients(tape, zi, variables, signals[:, i:i + 1], block, unrolled)
        del tape
        out = []
        for j, (v, total) in enumerate(zip(variables, totals)):
            # An embedding's gradient is sparse (IndexedSlices): made dense to be squared.
            grads = [tf.zeros_like(v) if g[j] is None else tf.convert_to_tensor(g[j]) for g in back]
            out.append(total + tf.math.unsorted_segment_sum(tf.square(tf.stack(grads)), seg, sums))
        return (i + 1, *out)

    zeros = [tf.zeros([sums, *v.shape], v.dtype) for v in variables]
    return list(tf.while_loop(lambda i, *_: i < n, body, [tf.constant(0), *zeros], parallel_iterations=1)[1:])


def ggn_step_fn(model: Any, entries: list[Entry], options: AnalysisOptions, groups: int, block: int,
                num_classes: int, holder: dict, tokens: int | None = None) -> Callable[..., Any]:
    """The compiled GGN step of one chunk of samples and one block of signals.

    ``step(x, uniforms, counted, start)`` returns the ``(K', *canonical)`` sums per
    layer (``groups = K'``, :attr:`~normflat.engine.options.AnalysisOptions.state_groups`;
    one sum, their weighted mean, under :attr:`~normflat.engine.options.AnalysisOptions.pooled`)
    and the :func:`~normflat.engine.losses.logit_stats` of the chunk.
    ``uniforms`` are the chunk's ``(n, options.uniform_columns(T))`` uniforms (``ggn-mc``,
    ``ggn-topk``; ``(n, 0)`` for ``ggn``); ``counted`` is the ``(n, T)`` 0/1 mask of the counted
    tokens of token logits ``(n, T, C)`` (``tokens = T``, method §6.3; ``(n, 0)`` for ``(n, C)``
    logits), whose signals are per sequence or per token as :func:`signal_layout` lays them
    out: either way the fast and generic squares are those of per-sequence gradients (a
    per-token signal is zero at the other tokens); ``start`` selects the block of signals
    (an exact head's squares (:func:`exact_head`) come with the block at ``start = 0``).
    ``holder["taps"]`` is the :class:`Taps` active when the function (re)traces; the model is
    held weakly.
    The generic path's weights get their squares from per-sample forwards (:func:`_generic_squares`).
    """
    unused = [e for e in entries if e.fast == UNUSED]  # zero curvature, nothing to compute
    fast = [e for e in entries if e.fast and e.fast != UNUSED]
    generic = [e for e in entries if not e.fast]
    model_ref = weakref.ref(model)
    index, seg_list = signal_layout(options, num_classes, tokens)
    head_rule = exact_head(options, num_classes)
    pool = mean_weights(options) if options.pooled else None  # the K' sums' weights in their mean

    @tf.function(reduce_retracing=True, autograph=False)
    def step(x, uniforms, counted, start):
        taps = holder["taps"]
        taps.records.clear()
        graph = tf.compat.v1.get_default_graph()
        ops_before = len(graph.get_operations())
        with tf.GradientTape(persistent=True) as tape:
            taps.tape = tape
            taps.pools_by_argmax = argmax_pooling_wins()
            try:
                with taps.expanded(x):  # loose position tables: each sample its own view (method §6.1)
                    z = model_logits(model_ref(), x, options, holder.get("logits"))
            finally:
                taps.pools_by_argmax = False
        taps.tape = None
        # Unrolled, the graph to build grows with the block times the forward pass's operations.
        unrolled = block * (len(graph.get_operations()) - ops_before) <= UNROLL_OPS
        zc = tf.cast(tf.stop_gradient(z), compute_dtype(z.dtype))
        c = int(z.shape[-1])
        if tokens is not None:
            zc = tf.ensure_shape(zc, [None, tokens, c])
        blocks = token_blocks(tokens, c)
        stats = _blocked_logit_stats(zc, blocks)
        u = tf.cast(uniforms, zc.dtype)
        rest = [c] if tokens is None else [tokens, c]
        seg = tf.constant(seg_list, tf.int32)
        # A fixed-size block of signals; past the end, zero (padding) signals add nothing.
        seg = tf.pad(seg, [[0, block]])[start:start + block]
        sums_per_layer = groups
        root_weight = None
        if pool is not None:
            # Only the groups' weighted mean is wanted (options.pooled): each signal scaled by the
            # square root of its group's weight in the mean and one sum for all (as the torch backend
            # pools its signals, losses.pool_signals), not K' sums of every layer per step (an
            # embedding's or a head's K' vocabulary-sized sums, then their weighted sum).
            root_weight = tf.gather(tf.constant(np.sqrt(pool)), seg)  # (block,)
            seg = tf.zeros_like(seg)
            sums_per_layer = 1
        out = {}
        for e in unused:
            # The canonical shape, read off a run-time tensor that nothing consumes (pruned).
            canonical = e.weight.to_canonical(_runtime_zeros([int(d) for d in e.variable.shape], z.dtype, start)).shape
            out[e.name] = _runtime_zeros([sums_per_layer, *(int(d) for d in canonical)], z.dtype, start)
        # A Dense head whose pre-activation is the logits themselves (ggn-topk; ggn above
        # STRUCTURED_HEAD_CLASSES classes) gets its exact squares from the logit-Hessian diagonal,
        # once per chunk (the first block), and nothing is back-propagated to it (method §6.1-6.2).
        # (Not a LoRA-enabled head: its factors need the signals at its output.)
        heads = [e for e in fast if head_rule and e.fast == "dense" and not is_lora(e.layer) and e.calls == 1
                 and taps.records[e.name][0][1] is z]
        for e in heads:
            x_in = taps.records[e.name][0][0]
            shape = [1, c, int(x_in.shape[-1])]  # the shared group only (exact)
            out[e.name] = tf.cond(
                tf.equal(start, 0),
                lambda x_in=x_in: _head_squares(x_in, _after([stats], zc), counted, options, tokens),
                lambda x_in=x_in, shape=shape: _runtime_zeros(shape, x_in.dtype, start))
        rest_fast = [e for e in fast if e not in heads]
        # The other fast layers' signals start at the head's input, pulled back through the head
        # in structured form: O(C·d) per sample instead of O(C²·d) (method §6.1); per sequence
        # O(d) per signal and token (method §6.3). Not per token (each signal is one token's);
        # the generic layers keep the signals at the logits, as in the torch backend.
        head_input = None
        if rest_fast and len(heads) == 1:
            x_in = taps.records[heads[0].name][0][0]
            if starts_at_head_input(options, tokens, len(x_in.shape)) and x_in.shape[1:-1] == z.shape[1:-1] \
                    and x_in.dtype.is_floating:
                head_input = x_in
        s = None
        if (generic or (rest_fast and head_input is None)) and head_rule and tokens is None:
            # Only the block's signals, O(C) each (many classes: forming all C − 1 at every block
            # would cost O(C²) per sample and block).
            s = tf.cast(_dense_block(zc, u, options, index, start, block), z.dtype)
            s = tf.ensure_shape(s, [block, None, *rest])
        elif (generic or (rest_fast and head_input is None)) and tokens is not None \
                and not options.sequence_layout(tokens):
            # Per token: only the block's signals, from the per-token factor (the whole tensor,
            # M·T signals of T·C numbers per sample, grows with T²).
            s = tf.cast(_token_block(zc, u, counted, options, index, start, block, tokens), z.dtype)
            s = tf.ensure_shape(s, [block, None, *rest])
        elif (generic or (rest_fast and head_input is None)) and tokens is not None:
            # Per sequence: only the block's signals, from the tokens' classes and scales.
            s = tf.cast(_sequence_block(zc, u, counted, options, index, start, block), z.dtype)
            s = tf.ensure_shape(s, [block, None, *rest])
        elif generic or (rest_fast and head_input is None):
            sig = output_signals(TF, zc, options, u)  # (K', M, n, C)
            s = tf.gather(tf.reshape(sig, [-1, tf.shape(zc)[0], *rest]), index)
            s = tf.cast(s, z.dtype)
            s = tf.pad(s, [[0, block]] + [[0, 0]] * (1 + len(rest)))[start:start + block]
            s = tf.ensure_shape(s, [block, None, *rest])
        if s is not None and root_weight is not None:
            s = s * tf.reshape(tf.cast(root_weight, s.dtype), [block] + [1] * (len(s.shape) - 1))
        if rest_fast:
            # The records whose outputs get the signals: one per call (a tied table's, a shared Dense's).
            records = [taps.records[e.name] if e.fast in ("tied", *RECURRENT_KINDS) else taps.records[e.name][:e.calls]
                       for e in rest_fast]
            pre = [r[1] for rec in records for r in rec]
            # One back-propagation per signal (unrolled or in a loop, not pfor: much faster on CPU here).
            if head_input is not None:
                kernel = tf.cast(tf.stop_gradient(tf.convert_to_tensor(heads[0].variable.value)), zc.dtype)
                if tokens is None:
                    factor = output_factor(TF, zc, options, u)
                else:  # each token's signed class signal, over the n·T token rows
                    factor = _blocked_sequence_factor(_after([stats] + [out[h.name] for h in heads], zc), options,
                                                      tf.cast(counted, zc.dtype), u, blocks)
                sx = tf.cast(_head_input_signals(factor, kernel, index, start, block), head_input.dtype)
                sx = tf.reshape(sx, [block, -1, *head_input.shape[1:]])  # per sequence: (B, n, T, d)
                sx = tf.ensure_shape(sx, [block, None, *head_input.shape[1:]])
                if root_weight is not None:
                    sx = sx * tf.reshape(tf.cast(root_weight, sx.dtype), [block] + [1] * (len(sx.shape) - 1))
                back = _signal_gradients(tape, head_input, pre, sx, block, unrolled)
            else:
                back = _signal_gradients(tape, z, pre, s, block, unrolled)
            j = 0
            for e, rec in zip(rest_fast, records):
                # An output the logits do not reach (a backbone's pooler beside the sequence output a
                # head reads) gets no signal: zeros.
                per_call = [[tf.zeros_like(r[1]) if back[i][j + c] is None else back[i][j + c] for i in range(block)]
                            for c, r in enumerate(rec)]
                j += len(rec)
                if e.fast == "tied":
                    # Several lookups (an encoder's and a decoder's) go as one over their positions together.
                    uses = {mode: [(r[0], gs) for r, gs in zip(rec, per_call) if r[2] is mode] for mode in (False, True)}
                    out[e.name] = _tied_squares(e, _joined_lookups(uses[False]) if uses[False] else None,
                                                [*uses[True][0]] if uses[True] else None, seg, sums_per_layer)
                elif is_lora(e.layer):
                    out[e.name] = _lora_squares(e, [(r[0], gs) for r, gs in zip(rec, per_call)], seg, sums_per_layer,
                                                tf.shape(z)[0])
                elif e.fast in RECURRENT_KINDS:
                    parts = [_step_squares(r[0], gs, seg, sums_per_layer) for r, gs in zip(rec, per_call)]
                    # Range after range of the weight's rows (a GRU's candidate columns multiply r ⊙ h_{t-1}).
                    out[e.name] = parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)
                elif e.calls > 1:  # every call's positions
                    calls = [(r[0], gs) for r, gs in zip(rec, per_call)]
                    rule = ("einsum", e.layer.equation) if e.fast == "einsum" else \
                        "conv" if e.fast in ("conv", "depthwise") else e.fast
                    out[e.name] = _calls_squares(rule, e.layer, calls, seg, sums_per_layer, int(e.variable.shape[0]),
                                                 int(e.weight.groups))
                else:
                    out[e.name] = _fast_squares(e, rec[0][0], per_call[0], seg, sums_per_layer, tf.shape(z)[0])
        if generic:
            squares = _generic_squares(model_ref(), x, options, taps, [e.variable.value for e in generic], s, seg,
                                       sums_per_layer, block, unrolled)
            for e, sq in zip(generic, squares):
                out[e.name] = tf.vectorized_map(e.weight.to_canonical, sq)
        del tape
        # Pooled (options.pooled): one sum per weight, its signals weighted above; an exact head's
        # one shared sum has weight 1 in the mean (estimators.mean_weights).
        return [out[e.name] for e in entries], stats

    return step


def ggn_bytes(entries: list[Entry], dtype: Any, input_size: int, num_classes: int, block: int,
              head: Entry | None = None, groups: int = 1) -> tuple[int, int]:
    """Estimated bytes of one GGN step as ``fixed + linear * n`` for a chunk of n samples:
    ``(linear, fixed)``.

    Counts the per-sample intermediates that grow with the chunk: the
    back-propagated signals at every tapped pre-activation and layer input
    (the unrolled signals of a block may be live at once), the largest
    per-layer work per sample (convolution patches, stacked squared signals);
    and, as ``fixed``, the largest working set of the per-sample gradients formed a few
    samples at a time (:func:`squares_working_set`), and for layers on the generic path one
    sample's forward, its back-propagated signals and its gradients of those layers' weights
    (:func:`_generic_squares`, one sample at a time), none of which grows with the chunk.

    Args:
        num_classes: Logits per sample (``T·C`` for token logits). A block's signals are formed
            alone (:func:`_dense_block`, :func:`_token_block`, :func:`_sequence_block`).
        head: The ``Dense`` head whose input the other layers' signals start at (structured,
            :func:`_head_input_signals`), if the step takes that path: the block's signals
            exist at its input, not at the logits (which hold the probabilities and a few
            vectors of the factor), and nothing is back-propagated to its output.
        groups: The sums per layer of the step (``K'``, one when pooled): an embedding's squares
            per row read (:func:`_embedding_squares`), counted here per sample.
    """
    item = tf.as_dtype(dtype).size
    structured = head is not None and not any(not e.fast for e in entries)  # generic layers: signals at the logits
    linear = input_size + num_classes * (6 if structured else block + 2)
    work = fixed = 0
    for e in entries:
        if not e.fast or e.fast == UNUSED:
            continue
        size = int(np.prod(e.variable.shape))
        if e is head:
            # its input, the block's signals there, its output; its squares from one signal per row
            linear += e.in_size * (block + 1) + e.pre_size
            work = max(work, 2 * e.pre_size + e.in_size)
            continue
        if e.fast in LORA_KINDS:
            # The layer's record and signals are its frozen kernel's (counted there); a factor adds its
            # own view of them (_lora_views): the rank in place of the kernel's last axis, A's signals
            # or B's input, and its squares as its rule forms them.
            a_var, b_var = _lora_factors(e.layer)
            rank, last = int(e.layer.lora_rank), int(b_var.shape[-1])
            view = e.pre_size * rank // max(1, last)
            linear += view * (block if e.fast == "lora_a" else 1)
            base = fast_kind(e.layer)
            if e.fast == "lora_a" and base == "embedding":  # as an embedding of r features (below)
                work = max(work, 4 * block * view + 2 * groups * view)
                continue
            if e.fast == "lora_a" and base == "conv":  # as a convolution of r outputs (below)
                shape = [int(d) for d in a_var.shape]  # (*k, in, r)
                koff, positions = int(np.prod(shape[:-2])), view // max(1, rank)
                per_sample, once = _squares_entries(positions, block, groups, rank, koff * shape[-2], view, pairs=True)
                work, fixed = max(work, 2 * positions * koff * shape[-2] + per_sample), max(fixed, once)
                continue
            out, width = (int(d) for d in e.weight.to_canonical(tf.zeros(e.variable.shape, e.variable.dtype)).shape)
            pre = view if e.fast == "lora_a" else e.pre_size
            positions = max(1, e.fold) * pre // max(1, out)
            per_sample, once = _squares_entries(positions, block, groups, out, width, pre,
                                                pairs=e.fast == "lora_b" or base == "dense")
            work, fixed = max(work, view + (per_sample or block * pre)), max(fixed, once)
            continue
        linear += e.in_size * (block + 1) + e.pre_size * (block + 1)
        if e.fast == "dense" and (e.input_rank == 2 or e.pre_size == int(e.variable.shape[-1])):
            work = max(work, block * e.pre_size)  # one position (rank one): stacked squared signals
        elif e.fast == "embedding":
            # The block's signals stacked, summed per (sample, id) pair and squared, then per row
            # read (_embedding_squares): no table of the vocabulary in the step.
            work = max(work, 4 * block * e.pre_size + 2 * groups * e.pre_size)
        elif e.fast == "tied":
            # One signal's per-sample gradients of each use, their sum and its square (_tied_squares),
            # beside the block's signals at both outputs, stacked.
            work = max(work, 3 * size + block * e.pre_size)
        elif e.fast in RECURRENT_KINDS:
            # One signal's per-sample gradients and their squares at a time (_step_squares).
            work = max(work, 2 * size)
        elif e.fast == "conv_transpose":
            shape = [int(d) for d in e.variable.shape]  # (*k, out, in)
            koff, cout, cin = int(np.prod(shape[:-2])), shape[-2], shape[-1]
            positions = e.in_size // max(1, cin)
            # The block's signals unfolded at the input's positions (and reshaped).
            work = max(work, 2 * block * positions * koff * cout + block * e.pre_size)
            fixed = max(fixed, squares_working_set(block, size, positions * koff * cout))
        elif e.fast in ("conv", "depthwise", *SEPARABLE_KINDS):
            shape = [int(d) for d in e.variable.shape]  # (*k, in/groups, out) or (*k, in, multiplier)
            koff = int(np.prod(shape[:-2]))
            dense_kernel = e.fast in ("conv", "separable_pointwise")
            cin = shape[-2] * (int(e.weight.groups) if dense_kernel else 1)
            cout = shape[-1] if dense_kernel else shape[-2] * shape[-1]
            positions = e.pre_size // max(1, cout)
            patches = positions * koff * cin
            # Patches, also regrouped (one copy); a single position's signals stacked and squared
            # (rank one, summed inside a matmul), else the per-sample gradients a few samples at a time.
            if positions == 1:
                work = max(work, 2 * block * e.pre_size + 2 * patches)
            else:
                ungrouped = dense_kernel and int(e.weight.groups) == 1
                per_sample, once = _squares_entries(positions, block, groups, cout, size // cout, e.pre_size,
                                                    pairs=ungrouped)
                work, fixed = max(work, 2 * patches + per_sample), max(fixed, once)
        else:
            # Dense on positions, EinsumDense: the signals transposed (einsum), the per-sample
            # gradients a few samples at a time, or a Dense's by pairs of positions.
            out = int(e.variable.shape[-1])
            positions = max(1, e.fold) * e.pre_size // max(1, out)
            per_sample, once = _squares_entries(positions, block, groups, out, size // max(1, out), e.pre_size,
                                                pairs=e.fast == "dense")
            # (the signals' transposed copies only where the loop takes them)
            work, fixed = max(work, e.in_size + (per_sample or block * e.pre_size)), max(fixed, once)
    generic = [e for e in entries if not e.fast]
    if generic:
        # One sample at a time (_generic_squares): its forward's activations and their gradients
        # for the block's signals, its block of gradients of the generic weights and their
        # squares, and the running sums (the old and the new).
        activations = input_size + num_classes + sum(e.in_size + e.pre_size for e in entries)
        size = sum(int(np.prod(e.variable.shape)) for e in generic)
        fixed += (block + 1) * activations + 2 * block * size + 2 * groups * size
    return (linear + work) * item, fixed * item


def ggn_chunk_size(linear: int, memory_budget: int | None, block: int, default_budget: int | None = None,
                   fixed: int = 0) -> int:
    """Samples per GGN step: the largest chunk whose estimated step fits the budget, at most :data:`MAX_CHUNK`.

    The step takes ``fixed + linear · n`` bytes for ``n`` samples (:func:`ggn_bytes`).
    ``memory_budget``: the user's budget (an error if one sample does not fit). Without it,
    ``default_budget`` (about twice a training step, :func:`normflat.core.memory.default_budget`),
    at most :data:`CHUNK_BYTES` (also the budget when ``default_budget`` is ``None``), and at
    least one sample, without an error.
    """
    if memory_budget is None:
        budget = CHUNK_BYTES if default_budget is None else min(CHUNK_BYTES, int(default_budget))
    else:
        budget = memory_budget
        what = f"the GGN step ({block} back-propagated signals per sample, estimated)"
        chunk_size_for(memory_budget, fixed + linear, what=what)  # one sample fits, or the error
    chunk = int(max(1, min(MAX_CHUNK, (budget - fixed) // max(1, linear))))
    return chunk
