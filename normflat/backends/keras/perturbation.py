"""The Keras :class:`~normflat.engine.perturbation.PerturbationModel`: the loss at moved weights (method §10).

The rival measures of :mod:`normflat.engine.rivals` evaluate the training loss
with the recognised weight matrices moved by a perturbation ``delta``. This
module runs a Keras 3 model (TensorFlow backend) at ``W + delta`` without ever
assigning a variable: every forward runs inside a :class:`keras.StatelessScope`
that maps each recognised kernel variable to a tensor, so the user's variables,
``trainable`` flags and BatchNormalization statistics are never touched.

Everything else is the analysis' own (so ``analyze`` and ``measures`` see the
same network and the same predictions): the layer walk of :mod:`.layers`
(names, kinds, canonical layout, method §3), the inference-mode call
``model(x, training=False)`` with ``options.output`` applied
(:func:`~normflat.backends.keras.ggn.model_logits`), the stripped final softmax
and the CPU-differentiable grouped convolutions of the session (set on the layer
instances through :class:`~normflat.backends.keras.state.ModelState` for the
duration of each call only, then restored), and the data contract of
:mod:`normflat.engine.data`.

The per-chunk work is compiled with ``tf.function(reduce_retracing=True, autograph=False)``, once
per :class:`KerasPerturbationModel`: the engine calls :meth:`~KerasPerturbationModel.evaluate`
and :meth:`~KerasPerturbationModel.gradient` many times, with the same shapes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from normflat.backends.keras import compat
from normflat.backends.keras.data import ADAPTER, to_tensor
from normflat.backends.keras.ggn import compute_dtype, logits_rounding, model_logits
from normflat.backends.keras.hvp import native_positions
from normflat.backends.keras.layers import Entry, walk
from normflat.backends.keras.ops import TF
from normflat.backends.keras.session import (HVP_CHUNK, OpenBatchTraces, _check_model, canonical_shapes,
                                             grouped_convolutions, install_logit_calls)
from normflat.backends.keras.state import ModelState
from normflat.backends.keras_shared import final_softmax
from normflat.engine.data import Batch, batches, first_forward, labels_for
from normflat.engine.losses import SAMPLES_APART_ROWS, check_output_shape, check_samples_apart, classes_first
from normflat.engine.options import AnalysisOptions
from normflat.engine.perturbation import (PATH_NORM_SCOPE, UnsupportedMeasureError, check_rival_options,
                                          prediction_losses, require_reiterable)

__all__ = ["KerasPerturbationModel", "perturbation_model"]

def perturbation_model(model: Any, data: Any, options: AnalysisOptions,
                       **backend_options: Any) -> "KerasPerturbationModel":
    """The :class:`~normflat.engine.perturbation.PerturbationModel` of a Keras model.

    Args:
        model: A built Keras 3 model on the TensorFlow backend (only read).
        data: The training data, in the engine's data contract (passed over once per call).
        options: The validated analysis options (built-in loss, ``output``,
            ``ignore_index``, ``shift_labels``, ``max_batches``, ``on_unsupported``).
        **backend_options: ``layers`` (list of str: perturb only these layers, names
            as reported) and ``chunk_size`` (int: samples per compiled step, default
            512; results do not depend on it).

    Returns:
        A :class:`KerasPerturbationModel`; call its ``close()`` when done.

    Raises:
        TypeError: For a model that is not a Keras 3 model, an unknown backend option
            or one of the wrong type, and for one-shot iterator data.
        ValueError: For a custom loss callable, an unbuilt model or a model with no
            recognised layer.
    """
    check_rival_options(options)
    require_reiterable(data)
    from normflat.backends.keras import _config

    # The same options, and the same checks, as analyze: measures() passes one set to both. Only
    # layers and chunk_size concern the perturbed passes; the rest tune the Hessian estimators.
    chunk_size = _config(backend_options).chunk_size
    return KerasPerturbationModel(model, data, options, layers=backend_options.get("layers"),
                                  chunk_size=chunk_size or HVP_CHUNK)


@dataclass(frozen=True)
class _Unit:
    """One reported weight: a whole recognised variable, or one block of its canonical rows.

    Attributes:
        entry: Index of the variable's :class:`~normflat.backends.keras.layers.Entry`.
        name: The report name (``f"{layer}.{block}"`` for a block).
        kind: The report kind.
        rows: ``(start, stop)`` canonical rows of a block (recurrent gates), ``None``: all.
    """

    entry: int
    name: str
    kind: str
    rows: tuple[int, int] | None = None


def _units(entries: list[Entry]) -> list[_Unit]:
    """The report's problems in model order: packed weights split into their blocks (method §3)."""
    units = []
    for i, e in enumerate(entries):
        if not e.weight.blocks:
            units.append(_Unit(i, e.name, e.weight.kind))
        else:
            units.extend(_Unit(i, f"{e.name}.{suffix}", e.weight.kind, (int(start), int(stop)))
                         for suffix, start, stop in e.weight.blocks)
    return units


def _slice(x: Any, a: int, b: int) -> Any:
    return tf.nest.map_structure(lambda t: t[a:b], x)


def _signature(x: Any) -> Any:
    return tuple((tuple(t.shape[1:]), t.dtype.name) for t in tf.nest.flatten(x))


class KerasPerturbationModel:
    """A Keras model whose recognised weight matrices are perturbed statelessly (method §10).

    Use :func:`perturbation_model` to build one. Every array in and out is float64
    numpy in the canonical ``(out, in/groups, *kernel)`` layout; the model itself
    computes in its own dtype.

    Attributes:
        names: The recognised weight layers, as ``analyze`` reports them, model order.
        kinds: Their kinds, as in the report.
    """

    def __init__(self, model: Any, data: Any, options: AnalysisOptions, layers: list[str] | None = None,
                 chunk_size: int = HVP_CHUNK) -> None:
        _check_model(model)
        self.model = model
        self.data = data
        self.options = options
        self.chunk_size = int(chunk_size)
        # The walk and the softmax detection read instance attributes a concurrent analysis of
        # the same model may have set: done under the model's lock, as the session does.
        state = ModelState(model)
        try:
            self.entries, _, _ = walk(model, options.on_unsupported, layers)
            self.strip = final_softmax(model)
            self.grouped = grouped_convolutions(model)
        finally:
            state.restore()
        self.units = _units(self.entries)
        self.names = [u.name for u in self.units]
        self.kinds = [u.kind for u in self.units]
        self.variables = [e.variable for e in self.entries]
        self.dtype = tf.as_dtype(self.entries[0].variable.dtype)
        # As the session: no label shift unless asked for (Keras models compute no loss, method §6.3).
        self.shift = bool(options.shift_labels)
        self._canonical_shapes: list[tuple[int, ...]] | None = None
        self._positions: list[np.ndarray] | None = None  # flat native index of each canonical entry
        self._outputs: dict[Any, tuple[int, int | None]] = {}  # input signature -> (classes, tokens)
        # The logits' shape of the first forward (_output_shape): every later one, and every step as it is
        # traced (_logits), must have as many classes.
        self._first_logits: tuple[int, ...] | None = None
        self._compiled: dict[str, Any] = {}
        self._open_traces = OpenBatchTraces(callable(self.options.loss))
        self._closed = False

    # ------------------------------------------------------------------ protocol

    def weights(self) -> list[np.ndarray]:
        """Each reported weight: a float64 copy in the canonical layout (method §3)."""
        self._check_open()
        canonical = [np.array(e.weight.to_canonical(tf.convert_to_tensor(e.variable.value)).numpy(),
                              dtype=np.float64) for e in self.entries]
        return [self._unit_part(canonical, u) for u in self.units]

    def evaluate(self, deltas: list[np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
        """Per-prediction losses and correctness at ``W + delta`` over all the data.

        Args:
            deltas: One canonical-layout array per reported weight, or ``None``.

        Returns:
            ``(losses, correct)``: float64 ``(m,)`` and bool ``(m,)``, in data order.
        """
        self._check_open()
        losses, correct = [], []
        with self._installed():
            kernels = self._kernels(deltas)
            step = self._step("evaluate")
            for x, target in self._chunks(kernels):
                value, right, counted = step(kernels, x, target)
                mask = counted.numpy()
                losses.append(np.asarray(value.numpy(), dtype=np.float64)[mask])
                correct.append(np.asarray(right.numpy(), dtype=bool)[mask])
        return np.concatenate(losses), np.concatenate(correct)

    def gradient(self, deltas: list[np.ndarray] | None) -> tuple[float, list[np.ndarray]]:
        """Mean loss over all predictions at ``W + delta`` and its gradient (canonical float64).

        The mean is over every counted prediction of every batch: the sum of the
        chunks' loss sums over the total count, and so is the gradient.
        """
        self._check_open()
        total, count = 0.0, 0
        sums: list[np.ndarray] | None = None
        with self._installed():
            kernels = self._kernels(deltas)
            step = self._step("gradient")
            for x, target in self._chunks(kernels):
                loss_sum, counted, grads = step(kernels, x, target)
                total += float(loss_sum.numpy())
                count += int(counted.numpy())
                parts = [np.asarray(g.numpy(), dtype=np.float64) for g in grads]
                sums = parts if sums is None else [s + p for s, p in zip(sums, parts)]
        self._require_predictions(count)
        assert sums is not None
        canonical = [np.asarray(e.weight.to_canonical(tf.constant(s / count)).numpy(), dtype=np.float64)
                     for e, s in zip(self.entries, sums)]
        return total / count, [self._unit_part(canonical, u) for u in self.units]

    def weight_derivatives(self) -> np.ndarray:
        """``<W, grad_W loss_i>`` of every prediction at the unperturbed weights (exact, by autodiff).

        ``W`` is the recognised weight matrices (biases excluded): the derivative of
        ``loss_i(W (1 + t))`` at ``t = 0``.

        Returns:
            float64 ``(m,)``, in data order.
        """
        self._check_open()
        out = []
        with self._installed():
            kernels = self._kernels(None)
            step = self._step("weight_derivatives")
            for x, target in self._chunks(kernels):
                derivative, counted = step(kernels, x, target)
                out.append(np.asarray(derivative.numpy(), dtype=np.float64)[counted.numpy()])
        return np.concatenate(out)

    def squared_output(self) -> float:
        """``sum_k f(1)_k`` of the network with every parameter squared (the squared path norm).

        Inference-mode BatchNormalization is folded into its per-channel map
        ``y = a x + b`` (``a = gamma / sqrt(var + eps)``, ``b = beta - a mean``), whose
        ``a`` and ``b`` are squared; every other parameter (kernels and biases of
        every layer) is squared as it is. The input is one example of ones.

        Raises:
            UnsupportedMeasureError: For any layer but Dense/EinsumDense and
                convolutions (ReLU or linear activations), BatchNormalization, ReLU,
                pooling, flattening/reshaping, dropout and identity in a Sequential or
                functional model, naming it; and for multi-input models.
        """
        self._check_open()
        batch_norms = self._path_norm_layers()
        x = self._ones_input()
        with self._installed(fold=batch_norms):
            # The dense and convolution layers hold every parameter left (the check above):
            # BatchNormalization squares its folded a and b itself, nothing else has any.
            squared = [(v, tf.square(tf.convert_to_tensor(v.value)))
                       for layer in compat.flatten_layers(self.model) if type(layer) in _LINEAR
                       for v in layer.weights]
            with keras.StatelessScope(state_mapping=squared):
                z = model_logits(self.model, x, self.options)
            return float(tf.reduce_sum(tf.cast(z, tf.float64)).numpy())

    def close(self) -> None:
        """Drop the compiled steps and the cached layouts (the model was never changed)."""
        self._compiled.clear()
        self._positions = None
        self._closed = True

    # ------------------------------------------------------------------ model state

    @contextlib.contextmanager
    def _installed(self, fold: list[Any] | tuple = ()) -> Iterator[None]:
        """The analysis' instance attributes for one call, restored when it ends (also on errors).

        The stripped final softmax and the grouped convolutions' CPU-differentiable
        call are the session's; ``fold`` lists BatchNormalization layers whose call
        becomes the squared folded map of :meth:`squared_output`.
        """
        state = ModelState(self.model)
        try:
            install_logit_calls(state, self.strip, self.grouped)
            for layer in fold:
                state.set(layer, "call", _squared_batch_norm_call(layer))
            yield
        finally:
            state.restore()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This perturbation model was closed; build a new one with perturbation_model(...).")

    # ------------------------------------------------------------------ weights and layouts

    @staticmethod
    def _unit_part(canonical: list[np.ndarray], unit: _Unit) -> np.ndarray:
        """A unit's canonical array out of its variable's (a copy of the rows of a block)."""
        full = canonical[unit.entry]
        if unit.rows is None:
            return full
        start, stop = unit.rows
        return np.array(full[start:stop])

    def _shapes(self) -> list[tuple[int, ...]]:
        if self._canonical_shapes is None:
            self._canonical_shapes = canonical_shapes(self.model, self.entries)
        return self._canonical_shapes

    def _kernels(self, deltas: list[np.ndarray] | None) -> list[Any]:
        """The recognised kernels at ``W + delta`` in their variables' layout and dtype, uploaded once."""
        values = [tf.convert_to_tensor(v.value) for v in self.variables]
        if deltas is None:
            return values
        native = self._native_deltas(deltas)
        return [value + tf.constant(d.astype(value.dtype.as_numpy_dtype)) for value, d in zip(values, native)]

    def _native_deltas(self, deltas: list[np.ndarray]) -> list[np.ndarray]:
        """Canonical per-unit deltas as one array per variable, in the variable's layout.

        ``to_canonical`` only moves entries, so its permutation (found once by moving
        the entries' own indices, :func:`~normflat.backends.keras.hvp.native_positions`)
        inverts it, for registered layers' converters too.
        """
        if not isinstance(deltas, (list, tuple)) or len(deltas) != len(self.units):
            got = f"{len(deltas)} arrays" if isinstance(deltas, (list, tuple)) else type(deltas).__name__
            raise ValueError(
                f"deltas must be a list of {len(self.units)} arrays, one per layer {self.names} (or None), "
                f"got {got}."
            )
        shapes = self._shapes()
        full = [np.zeros(s) for s in shapes]
        for unit, delta in zip(self.units, deltas):
            delta = np.asarray(delta, dtype=np.float64)
            target = full[unit.entry] if unit.rows is None else full[unit.entry][unit.rows[0]:unit.rows[1]]
            if delta.shape != target.shape:
                raise ValueError(
                    f"The delta of layer {unit.name!r} has shape {delta.shape}; it must have the canonical "
                    f"(out, in, *kernel) shape {target.shape} of that layer's weight (method §3)."
                )
            target[...] = delta
        if self._positions is None:
            self._positions = [native_positions(e)[0] for e in self.entries]
        out = []
        for variable, positions, canonical in zip(self.variables, self._positions, full):
            flat = np.empty(positions.size)
            flat[positions] = canonical.reshape(-1)
            out.append(flat.reshape(tuple(int(d) for d in variable.shape)))
        return out

    # ------------------------------------------------------------------ data

    def _chunks(self, kernels: list[Any]) -> Iterator[tuple[Any, Any]]:
        """``(inputs, labels)`` chunks of every batch, in data order; labels as ``analyze`` reads them."""
        iterator, _ = batches(self.data, ADAPTER, self.options)
        for batch in iterator:
            # A mapping batch (Hugging Face style) is passed positionally, as the session does.
            x = to_tensor(batch.x)
            num_classes, tokens = self._output_shape(kernels, x, batch)
            # Before a label refused for the first forward's classes: logits whose classes follow the rows
            # show only in the steps' traces, which come after the labels (2 rows against one row).
            with classes_first(self._first_logits, self._one_row(kernels, x)):
                labels = labels_for(batch, num_classes, ADAPTER, self.options, tokens=tokens, shift=self.shift)
            target = tf.constant(labels, tf.int32)
            count = -(-batch.n // self.chunk_size)
            size = -(-batch.n // count)  # balanced chunks: fewer distinct shapes to trace
            for a in range(0, batch.n, size):
                b = min(a + size, batch.n)
                yield (x, target) if (a, b) == (0, batch.n) else (_slice(x, a, b), target[a:b])

    def _output_shape(self, kernels: list[Any], x: Any, batch: Batch) -> tuple[int, int | None]:
        """``(classes, tokens)`` of the logits for inputs of this signature (one forward of 2 rows)."""
        key = _signature(x)
        if key not in self._outputs:
            rows = min(batch.n, 2)
            with first_forward("keras", batch):
                z = self._step("logits")(kernels, _slice(x, 0, rows))
            num_classes = check_output_shape(tuple(z.shape), self.options, batch.index, rows, seen=self._first_logits,
                                             other_rows=self._one_row(kernels, x))
            if self._first_logits is None:
                self._check_samples_apart(kernels, x, z, rows)
                self._first_logits = tuple(int(d) for d in z.shape)
            self._outputs[key] = (num_classes, int(z.shape[1]) if len(z.shape) == 3 else None)
        return self._outputs[key]

    def _require_predictions(self, count: int) -> None:
        if count == 0:
            raise ValueError(
                "The data has no counted prediction: every token label is ignore_index="
                f"{self.options.ignore_index}. Pass data with at least one counted label."
            )

    # ------------------------------------------------------------------ compiled steps

    def _step(self, name: str) -> Any:
        """The compiled ``_{name}_step(kernels, x[, target])``, traced with the batch axis open on
        its first call (:class:`~normflat.backends.keras.session.OpenBatchTraces`)."""
        if name not in self._compiled:
            fn = tf.function(getattr(self, f"_{name}_step"), reduce_retracing=True, autograph=False)

            def call(*args: Any, fn: Any = fn) -> Any:
                self._open_traces.trace(fn, args, [False] + [True] * (len(args) - 1))
                return fn(*args)
            self._compiled[name] = call
        return self._compiled[name]

    def _check_samples_apart(self, kernels: list[Any], x: Any, z: Any, rows: int) -> None:
        """:func:`~normflat.engine.losses.check_samples_apart` on the first rows, as the analysis does
        (a model that fails on one row is not compared)."""
        if rows != SAMPLES_APART_ROWS or not z.dtype.is_floating:
            return
        try:
            alone = [np.asarray(self._step("logits")(kernels, _slice(x, i, i + 1)), dtype=np.float64)
                     for i in range(rows)]
        except Exception:  # noqa: BLE001 - nothing to compare: the measures' own forwards stand
            return
        check_samples_apart(np.asarray(z, dtype=np.float64), alone, dtype=logits_rounding(self.model, z))

    def _one_row(self, kernels: list[Any], x: Any) -> Callable[[], tuple[int, ...]]:
        """The shape of the logits of the model called on the first row of ``x`` alone, as a function
        (:func:`~normflat.engine.losses.classes_first`: asked before refusing the first logits' classes)."""
        return lambda: tuple(self._step("logits")(kernels, _slice(x, 0, 1)).shape)

    def _logits(self, kernels: list[Any], x: Any) -> Any:
        """The logits with the recognised kernels replaced by ``kernels`` (no variable assigned), with as
        many classes as the first forward's (checked as a step is traced, :func:`model_logits`)."""
        with keras.StatelessScope(state_mapping=list(zip(self.variables, kernels))):
            return model_logits(self.model, x, self.options, self._first_logits)

    def _losses(self, kernels: list[Any], x: Any, target: Any) -> tuple[Any, Any, Any]:
        z = self._logits(kernels, x)
        return prediction_losses(XP, tf.cast(z, compute_dtype(z.dtype)), target, self.options)

    def _logits_step(self, kernels: list[Any], x: Any) -> Any:
        return self._logits(kernels, x)

    def _evaluate_step(self, kernels: list[Any], x: Any, target: Any) -> tuple[Any, Any, Any]:
        return self._losses(kernels, x, target)

    def _gradient_step(self, kernels: list[Any], x: Any, target: Any) -> tuple[Any, Any, list[Any]]:
        with tf.GradientTape() as tape:
            tape.watch(kernels)
            losses, _, counted = self._losses(kernels, x, target)
            # Uncounted tokens hold the loss of a stand-in label: masked out of the sum.
            loss_sum = tf.reduce_sum(tf.where(counted, losses, tf.zeros_like(losses)))
        grads = tape.gradient(loss_sum, kernels)
        return loss_sum, tf.reduce_sum(tf.cast(counted, tf.int64)), _dense(grads, kernels)

    def _weight_derivatives_step(self, kernels: list[Any], x: Any, target: Any) -> tuple[Any, Any]:
        """``J_loss W`` per prediction by the double-backward trick.

        ``g(u) = d(u . loss)/dW`` is linear in ``u``, so ``d<g(u), W>/du = J W`` exactly.
        Reverse over reverse, unlike ``tf.autodiff.ForwardAccumulator``, also runs
        through the ``tf.while_loop`` of recurrent layers.
        """
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(kernels)
                losses, _, counted = self._losses(kernels, x, target)
                u = tf.zeros_like(losses)
                outer.watch(u)
                weighted = tf.reduce_sum(u * losses)
            grads = _dense(inner.gradient(weighted, kernels), kernels)
            directional = tf.add_n([tf.reduce_sum(g * k) for g, k in zip(grads, kernels)])
        derivative = outer.gradient(directional, u)
        if derivative is None:  # the losses do not depend on the weights
            derivative = tf.zeros_like(losses)
        return derivative, counted

    # ------------------------------------------------------------------ path norm

    def _path_norm_layers(self) -> list[Any]:
        """Check that the squared forward is a path norm; return the BatchNormalization layers.

        Raises:
            UnsupportedMeasureError: Naming the first layer that is not allowed.
        """
        batch_norms: list[Any] = []
        strip_layer = None if self.strip is None else self.strip[0]

        def visit(layer: Any, name: str) -> None:
            reason = _path_norm_refusal(layer, layer is strip_layer)
            if reason is not None:
                detail = f", {reason}" if reason else ""
                raise UnsupportedMeasureError(
                    f"Layer {name!r} ({type(layer).__name__}{detail}): {PATH_NORM_SCOPE}."
                )
            if isinstance(layer, keras.layers.BatchNormalization):
                batch_norms.append(layer)
            for child in compat.children(layer):
                visit(child, f"{name}/{child.name}" if layer is not self.model else child.name)

        visit(self.model, self.model.name)
        return batch_norms

    def _ones_input(self) -> Any:
        """One example of ones, of the shape of one example of the data's inputs."""
        iterator, _ = batches(self.data, ADAPTER, self.options)
        first = next(iterator)
        if first.keywords or isinstance(first.x, (tuple, list, dict)):
            raise UnsupportedMeasureError(
                f"The model {self.model.name!r} takes several inputs; the path norm is the output of the "
                "squared network at one input of ones, defined for a model with one input array: "
                f"{PATH_NORM_SCOPE}."
            )
        shape = tuple(int(d) for d in first.x.shape[1:])
        return tf.ones((1, *shape), self.dtype)


#: The array namespace of the per-prediction losses.
XP = TF


def _dense(grads: list[Any], kernels: list[Any]) -> list[Any]:
    """Dense gradients (embedding tables give ``IndexedSlices``, unused kernels ``None``)."""
    return [tf.zeros_like(k) if g is None else tf.convert_to_tensor(g) for g, k in zip(grads, kernels)]


def _squared_batch_norm_call(layer: Any) -> Any:
    """The call of an inference-mode BatchNormalization folded to ``a x + b``, ``a``, ``b`` squared."""

    def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        x = tf.convert_to_tensor(inputs)
        compute = compute_dtype(x.dtype)
        mean = tf.cast(tf.convert_to_tensor(layer.moving_mean), compute)
        variance = tf.cast(tf.convert_to_tensor(layer.moving_variance), compute)
        gamma = tf.cast(tf.convert_to_tensor(layer.gamma), compute) if layer.scale else tf.ones_like(mean)
        beta = tf.cast(tf.convert_to_tensor(layer.beta), compute) if layer.center else tf.zeros_like(mean)
        scale = gamma / tf.sqrt(variance + layer.epsilon)
        shift = beta - scale * mean
        shape = [1] * len(x.shape)
        shape[layer.axis % len(x.shape)] = int(mean.shape[0])
        out = tf.cast(x, compute) * tf.reshape(tf.square(scale), shape) + tf.reshape(tf.square(shift), shape)
        return tf.cast(out, x.dtype)

    return call


def _keras_classes(*names: str) -> tuple[type, ...]:
    """The ``keras.layers`` classes of these names that this Keras release has."""
    return tuple(getattr(keras.layers, n) for n in names if isinstance(getattr(keras.layers, n, None), type))


#: Linear layers whose kernels and biases are squared (Keras' own classes, not subclasses).
_LINEAR = _keras_classes("Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
                         "Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D")
#: Layers without parameters that commute with the path sum (or are inactive at inference).
_STRUCTURAL = _keras_classes(
    "InputLayer", "Flatten", "Reshape", "Identity", "Dropout", "SpatialDropout1D", "SpatialDropout2D",
    "SpatialDropout3D", "GaussianDropout", "AlphaDropout",
    "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D", "AveragePooling3D",
    "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D", "GlobalAveragePooling1D",
    "GlobalAveragePooling2D", "GlobalAveragePooling3D", "AdaptiveMaxPooling1D", "AdaptiveMaxPooling2D",
    "AdaptiveMaxPooling3D", "AdaptiveAveragePooling1D", "AdaptiveAveragePooling2D", "AdaptiveAveragePooling3D",
    # Zero padding adds inputs that are 0 and stay 0 in the squared network: no new path.
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D",
    # A residual sum of activations adds the paths of its branches (method §10.4).
    "Add",
)


def _activation_refusal(layer: Any, stripped: bool) -> str | None:
    activation = getattr(layer, "activation", None)
    if activation is None or activation is keras.activations.relu or activation is keras.activations.linear:
        return None
    if stripped:  # the final softmax made the identity while measuring (logits)
        return None
    return f"activation {getattr(activation, '__name__', type(activation).__name__)}"


def _path_norm_refusal(layer: Any, stripped: bool) -> str | None:
    """``None`` if ``layer`` may be part of a path-norm network, else why not (``""``: its type)."""
    cls = type(layer)
    if cls in (keras.Sequential, compat.functional_class()):
        return None  # a plain container: its own call only chains its layers
    if cls in _LINEAR:
        if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
            return "LoRA-enabled or quantized"
        return _activation_refusal(layer, stripped)
    if cls is keras.layers.BatchNormalization or cls in _STRUCTURAL:
        return None
    if cls is keras.layers.ReLU:
        plain = (layer.max_value is None and float(layer.negative_slope) == 0.0
                 and float(layer.threshold) == 0.0)
        return None if plain else "a clipped, leaky or thresholded ReLU"
    if cls is keras.layers.Activation or (cls is keras.layers.Softmax and stripped):
        return None if cls is keras.layers.Softmax else _activation_refusal(layer, stripped)
    if isinstance(layer, keras.Model):
        return "a model with its own call"
    return ""
