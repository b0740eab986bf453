"""The JAX backend's :class:`~normflat.engine.perturbation.PerturbationModel` (method §10).

The rival measures of method §10 evaluate the training loss with the recognised
weight matrices moved by a perturbation ``delta``. This module supplies them for
equinox modules, flax nnx modules, flax linen ``(module, variables)`` and
``(apply_fn, params)`` pairs:

* the layers are found exactly as ``analyze`` finds them: the model view of
  :mod:`~normflat.backends.jax.layers`, in the order in which the traced forward
  program (:mod:`~normflat.backends.jax.program`) first uses each weight, packed
  weights split into their blocks (same names, order and kinds as the report);
* the model is run as a pure function of its leaves (the view's batch call, in
  inference mode: equinox ``inference_mode``, an nnx private copy in ``eval()``
  mode, linen with the user's ``apply_kwargs``), the weight leaves replaced by
  ``w + delta``; the user's objects are only read;
* one compiled function per quantity (per-prediction losses, the gradient of the
  loss sum, the forward-mode derivative in the direction of the weights) takes
  the weight leaves as arguments, so every call with other deltas reuses it; the
  functions are cached by the model's structure (like the analysis kernels), so
  measuring the same architecture again, with other weights, does not recompile;
* :meth:`JaxPerturbationModel.squared_output` runs the network with every
  parameter squared on one input of ones (method §10.4): batch normalization is
  replaced by the square of the per-channel affine map it computes in inference
  mode, and the traced program is checked to be made of the layers a path norm is
  defined for.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from normflat.backends.jax.cache import LRU
from normflat.backends.jax.compat import Literal, enable_x64, x64_enabled
from normflat.backends.jax.data import ADAPTER, cast_inputs, device_inputs_finite
from normflat.backends.jax.layers import REGISTRY, LayerRule, check_has_weights, path_str, to_canonical, to_native
from normflat.backends.jax.session import example_signature, forward_error_of, trace_layers, view_for
from normflat.backends.jax.state import ModelState
from normflat.engine.data import Batch, batches, input_leaves, labels_for, model_failures, non_finite_inputs
from normflat.engine.losses import check_output_shape
from normflat.engine.options import AnalysisOptions
from normflat.engine.outputs import select_output
from normflat.engine.perturbation import UnsupportedMeasureError, check_rival_options, prediction_losses
from normflat.engine.registry import IGNORE, Unsupported

__all__ = ["perturbation_model", "JaxPerturbationModel", "PATH_NORM_SCOPE"]

#: What every refusal of ``squared_output`` says, in every framework (method §10.4).
PATH_NORM_SCOPE = ("path_norm is defined for feed-forward ReLU networks of dense and convolution layers "
                   "(inference-mode BatchNorm is folded); leave 'path_norm' out of measures=... for this model")


def perturbation_model(model: Any, data: Any, options: AnalysisOptions,
                       **backend_options: Any) -> "JaxPerturbationModel":
    """The :class:`~normflat.engine.perturbation.PerturbationModel` of a JAX model (method §10).

    Args:
        model: An equinox or flax nnx module, a ``(flax linen module, variables)``
            or an ``(apply_fn, params)`` pair.
        data: The training data (engine data contract, passed over once per call;
            the engine checks that it can be iterated again).
        options: The analysis options (``loss``, ``temperature``, ``output``,
            ``ignore_index``, ``shift_labels``, ``max_batches``, ``on_unsupported``).
        **backend_options: The options of :func:`normflat.analyze` for JAX models
            (``vmap``, ``state``, ``apply_kwargs``, ``layouts``, ``dtype``, ...);
            the estimator and chunking options are accepted and unused.

    Returns:
        A :class:`JaxPerturbationModel`; call its ``close()`` when done.

    Raises:
        ValueError: For a custom loss, or a multi-process run (not supported here).
    """
    from normflat.backends.jax import _settings  # the package imports this module: import on use

    check_rival_options(options)
    settings = _settings(backend_options)
    if settings["distributed"] is not False and jax.process_count() > 1:
        raise ValueError(
            f"The perturbation measures do not combine the data of several jax.distributed processes yet "
            f"(this is process {jax.process_index()} of {jax.process_count()}). Pass distributed=False to "
            "measure this process's data alone, or run them in a single process.")
    return JaxPerturbationModel(model, data, options, settings)


class JaxPerturbationModel:
    """A JAX model whose recognised weight matrices can be moved (see the module docstring).

    Attributes:
        names: The recognised weight layers, as in ``analyze``'s report, model order.
        kinds: Their kinds, as in the report.
        dtype: The compute dtype (the weights' dtype, at least float32, or ``dtype=``).
    """

    def __init__(self, model: Any, data: Any, options: AnalysisOptions, settings: dict) -> None:
        self._model, self._data, self._options, self._settings = model, data, options, settings
        # float64 without global x64: enable it for every call of this object only (thread-local).
        self._x64 = settings["dtype"] == jnp.float64 and not x64_enabled()
        self._closed = False
        #: The first batch's size: a shorter batch is padded to it (:func:`_padded`).
        self._block: int | None = None
        self._inputs_checked = False  # the device inputs, on the first complete pass (_batches)
        with self._context():
            self._prepare()
        self._steps = _steps_for(self._view, self._weight_ids, self._rest_ids, options)

    # ------------------------------------------------------------------ preparation

    def _prepare(self) -> None:
        """Find the layers as the session does on its first batch (same view, order and layouts)."""
        options, settings = self._options, self._settings
        first = next(iter(batches(self._data, ADAPTER, options)[0]))
        view = view_for(self._model, first, settings, options)
        self._state = ModelState(self._model, getattr(view, "user_states", ()))
        view.skipped.report(options.on_unsupported)  # warns or raises exactly as analyze does
        check_has_weights(view)
        dtype = view.dtype
        # The session's model order, layouts and trace cache. Half precision stays allowed: the
        # measures evaluate losses, and the refusal is worded for the analysis' Hessians.
        _, out_shape = trace_layers(view, first, allow_half_precision=True)
        self._num_classes = check_output_shape((first.n,) + out_shape, options, first.index, first.n)
        #: The per-example logits' shape for each input signature (a later batch of another sequence length).
        self._out_shapes = {example_signature(first.x): out_shape}
        self._view, self.dtype = view, dtype
        self._weight_ids = [w.leaf for w in view.weights]
        ids = set(self._weight_ids)
        self._rest_ids = [i for i in range(len(view.leaves)) if i not in ids]
        self._ws = [view.leaves[i] for i in self._weight_ids]
        self._rest = [view.leaves[i] for i in self._rest_ids]
        self._extra = list(view.extra)
        # One entry per reported layer: a packed weight is one entry per block of rows (method §3).
        self._entries: list[tuple[int, int | None, int | None]] = []
        self.names, self.kinds = [], []
        for k, w in enumerate(view.weights):
            for suffix, start, stop in (w.blocks or [(None, None, None)]):
                self._entries.append((k, start, stop))
                self.names.append(w.name if suffix is None else f"{w.name}.{suffix}")
                self.kinds.append(w.kind)
        self._canonical = [tuple(np.shape(to_canonical(np.zeros(np.shape(a), np.float64), w.layout)))
                           for a, w in zip(self._ws, view.weights)]
        # What squared_output needs of the inputs (not the batch itself, which may be large).
        leaves = input_leaves(first.x)
        single = not first.keywords and len(leaves) == 1 and ADAPTER.is_array(first.x)
        self._inputs = {"count": len(leaves), "keywords": first.keywords, "single": single,
                        "kind": ADAPTER.kind(first.x) if single else None,
                        "example": tuple(ADAPTER.shape(first.x)[1:]) if single else None,
                        "dtype": str(np.asarray(ADAPTER.to_numpy(first.x[:0])).dtype) if single else None}

    def _context(self):
        return enable_x64(True) if self._x64 else contextlib.nullcontext()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This perturbation model was closed; build a new one with perturbation_model().")

    # ------------------------------------------------------------------ data

    def _out_shape(self, batch: Batch) -> tuple[int, ...]:
        """The per-example logits' shape for this batch's inputs, traced once per input signature as
        the session does (the first program's number of classes)."""
        signature = example_signature(batch.x)
        shape = self._out_shapes.get(signature)
        if shape is None:
            with model_failures("jax", batch, self._forward_error):
                _, shape = trace_layers(self._view, batch, allow_half_precision=True)
            first = next(iter(self._out_shapes.values()))
            check_output_shape((batch.n,) + shape, self._options, batch.index, batch.n, seen=(batch.n,) + first)
            self._out_shapes[signature] = shape
        return shape

    def _forward_error(self, batch: Batch) -> BaseException | None:
        """The model's error on a batch's first rows (:func:`~normflat.engine.data.model_failures`)."""
        return forward_error_of(self._view, batch, self.dtype)

    def _batches(self):
        """``(batch, inputs, device labels, host mask of the predictions)`` of every batch, in data
        order."""
        options = self._options
        source, _ = batches(self._data, ADAPTER, options)
        for batch in source:
            out_shape = self._out_shape(batch)
            tokens = out_shape[0] if len(out_shape) == 2 else None
            check_output_shape((batch.n,) + out_shape, options, batch.index, batch.n)
            if not self._inputs_checked:
                # Device arrays: the adapter leaves their check to the caller. Once, on the first
                # pass over the data (the measures make several), before any perturbed loss.
                finite = device_inputs_finite(batch.x)
                if finite is not None and not bool(finite):
                    raise non_finite_inputs(batch.index)
            # JAX models have no config telling a causal LM: shift_labels=None means no shift (method §6.3).
            labels = labels_for(batch, self._num_classes, ADAPTER, options, tokens=tokens,
                                shift=bool(options.shift_labels) if tokens is not None else False)
            x, labels = cast_inputs(batch.x, self.dtype), np.asarray(labels)
            if self._block is None:
                self._block = batch.n
            elif batch.n < self._block:
                x, labels = _padded(x, labels, self._block)
            yield batch, x, jnp.asarray(labels, jnp.int32), labels.reshape(-1) >= 0
        self._inputs_checked = True

    # ------------------------------------------------------------------ weights and deltas

    def weights(self) -> list[np.ndarray]:
        """Each layer's weight: float64 copies in the canonical ``(out, in, *kernel)`` layout."""
        self._check_open()
        with self._context():
            host = jax.device_get(self._ws)
        out = []
        for k, start, stop in self._entries:
            w = np.asarray(to_canonical(np.asarray(host[k], np.float64), self._view.weights[k].layout))
            out.append(np.array(w if start is None else w[start:stop], dtype=np.float64))
        return out

    def _moved(self, deltas: list[np.ndarray] | None) -> list:
        """The weight leaves at ``w + delta``, in the framework's layout (uploaded once)."""
        if deltas is None:
            return self._ws
        deltas = list(deltas)
        if len(deltas) != len(self.names):
            raise ValueError(f"Got {len(deltas)} perturbations for the {len(self.names)} layers {self.names}; "
                             "pass one canonical-layout array per layer, in this order (or None).")
        full = [np.zeros(shape, np.float64) for shape in self._canonical]
        for (k, start, stop), name, d in zip(self._entries, self.names, deltas):
            d = np.asarray(d, dtype=np.float64)
            target = full[k] if start is None else full[k][start:stop]
            if d.shape != target.shape:
                raise ValueError(f"The perturbation of layer {name!r} has shape {d.shape}; it needs the layer's "
                                 f"canonical (out, in, *kernel) shape {target.shape}.")
            target[...] = d
        np_dtype = np.dtype(self.dtype)
        native = [np.ascontiguousarray(to_native(d, w.layout), dtype=np_dtype)
                  for d, w in zip(full, self._view.weights)]
        return _move(self._ws, jax.device_put(native))

    def _to_entries(self, grads: list) -> list[np.ndarray]:
        """Native-layout arrays of the weight leaves as float64 canonical arrays, one per layer."""
        out = []
        for k, start, stop in self._entries:
            g = np.asarray(to_canonical(np.asarray(grads[k], np.float64), self._view.weights[k].layout))
            out.append(np.array(g if start is None else g[start:stop], dtype=np.float64))
        return out

    # ------------------------------------------------------------------ the protocol

    def evaluate(self, deltas: list[np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
        """Per-prediction losses and correctness at ``w + delta`` over all the data, in data order."""
        self._check_open()
        with self._context():
            ws = self._moved(deltas)
            pending = []
            for batch, x, y, counted in self._batches():
                with model_failures("jax", batch, self._forward_error):
                    pending.append((self._steps.losses(ws, self._rest, self._extra, x, y), counted))
            # One synchronisation for all batches: the steps are dispatched asynchronously.
            fetched = jax.device_get([p for p, _ in pending])
        losses = np.concatenate([np.asarray(l, np.float64)[c] for (l, _), (_, c) in zip(fetched, pending)])
        correct = np.concatenate([np.asarray(r, bool)[c] for (_, r), (_, c) in zip(fetched, pending)])
        return losses, correct

    def gradient(self, deltas: list[np.ndarray] | None) -> tuple[float, list[np.ndarray]]:
        """Mean loss over all predictions at ``w + delta`` and its canonical gradient per layer."""
        self._check_open()
        with self._context():
            ws = self._moved(deltas)
            total = grads = None
            count = 0
            for batch, x, y, counted in self._batches():
                with model_failures("jax", batch, self._forward_error):
                    value, g = self._steps.gradient(ws, self._rest, self._extra, x, y)
                total = value if total is None else total + value
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
                count += int(np.count_nonzero(counted))
            if count == 0:
                raise ValueError("The data hold no counted prediction (every token label is ignore_index), "
                                 "so the mean loss is undefined.")
            total, grads = jax.device_get((total, grads))
        return float(total) / count, [g / count for g in self._to_entries(grads)]

    def weight_derivatives(self) -> np.ndarray:
        """``<w, grad_w loss_i>`` for every prediction at the unperturbed weights (exact, forward mode)."""
        self._check_open()
        with self._context():
            pending = []
            for batch, x, y, counted in self._batches():
                with model_failures("jax", batch, self._forward_error):
                    pending.append((self._steps.derivatives(self._ws, self._rest, self._extra, x, y), counted))
            fetched = jax.device_get([p for p, _ in pending])
        return np.concatenate([np.asarray(d, np.float64)[c] for d, (_, c) in zip(fetched, pending)])

    def squared_output(self) -> float:
        """``sum_k f(1)_k`` of the network with every parameter squared (method §10.4).

        Raises:
            UnsupportedMeasureError: For a model with a layer, or an operation on its
                activations, for which this is not a path norm (naming it), for an
                ``(apply_fn, params)`` pair (its layer types are unknowable), and for
                models with several or non-floating inputs.
        """
        self._check_open()
        inputs = self._inputs
        if not inputs["single"]:
            raise UnsupportedMeasureError(
                "path_norm runs the network on one input of ones, which needs a model with a single input "
                f"array; this model takes {inputs['count']} input array(s)"
                f"{' as keywords' if inputs['keywords'] else ''}. Leave 'path_norm' out of measures=... "
                "for this model.")
        if inputs["kind"] != "f":
            raise UnsupportedMeasureError(
                f"path_norm runs the network on one input of ones, but this model's inputs are not real-valued "
                f"({inputs['dtype']}: token ids?); {PATH_NORM_SCOPE}.")
        framework = self._view.framework
        if framework == "jax":
            raise UnsupportedMeasureError(
                "path_norm needs the type of every layer of the network (which are dense, convolution or "
                "BatchNorm layers, and where the biases are), but an (apply_fn, params) pair is a bare function "
                "whose layers normflat cannot see. Pass the equinox, flax nnx or flax linen module instead, or "
                "leave 'path_norm' out of measures=... for this model.")
        with self._context():
            ones = jnp.ones(inputs["example"], self.dtype)
            build = {"equinox": self._squared_equinox, "flax.nnx": self._squared_nnx,
                     "flax.linen": self._squared_linen}[framework]
            f, check_modules = build()
            try:
                closed = jax.make_jaxpr(f)(ones)  # linen's modules become known while tracing
            except Exception:
                check_modules()  # a layer with no place in a path norm explains a failure best
                raise
            check_modules()  # module types first: they give the clearest message
            _check_program(closed)
            out = jax.device_get(jax.jit(f)(ones))
        return float(np.sum(np.asarray(out, np.float64)))

    def close(self) -> None:
        """Drop the compiled steps and the model's arrays; put back any replaced nnx array."""
        if self._closed:
            return
        self._closed = True
        # normflat never writes into the user's model; the state is checked (and put back) all the same.
        self._state.restore()
        self._steps = None
        self._ws = self._rest = self._extra = []

    # ------------------------------------------------------------------ squared networks (method §10.4)

    def _select(self, out: Any) -> Any:
        return select_output(out, self._options.output, _is_array)

    def _squared_equinox(self) -> tuple[Callable, Callable]:
        import equinox as eqx

        dtype, state, vmap = self.dtype, self._settings["state"], self._view.vmap
        model = eqx.nn.inference_mode(self._model)  # a new pytree: running statistics, no dropout
        wrapper = _equinox_squared_norm()

        def square(node):
            if isinstance(node, eqx.nn.BatchNorm):
                return wrapper(_cast_tree(node, dtype))  # folded from its own (unsquared) parameters
            if isinstance(node, eqx.nn.State):
                return _cast_tree(node, dtype)  # running statistics held by the model: no parameters
            return jnp.square(jnp.asarray(node, dtype)) if eqx.is_inexact_array(node) else node

        squared = jax.tree_util.tree_map(square, model,
                                         is_leaf=lambda n: isinstance(n, (eqx.nn.BatchNorm, eqx.nn.State)))
        st = _cast_tree(state, dtype) if state is not None else None

        def call(x):
            if st is None:
                return self._select(squared(x))
            out = squared(x, st)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("With state=..., the equinox model must return (logits, state).")
            return self._select(out[0])

        def f(x):
            return call(x) if vmap else call(x[None])[0]

        def check_modules():
            for path, module, own, stateful in _equinox_modules(model):
                problem = _layer_problem(module, own)
                if problem is None and stateful:
                    problem = "keeps state of its own (only BatchNorm's running statistics are folded)"
                if problem is not None:
                    raise _refusal(path, module, problem)

        return f, check_modules

    def _squared_nnx(self) -> tuple[Callable, Callable]:
        from flax import nnx

        dtype = self.dtype
        graph, params, rest = nnx.split(self._model, nnx.Param, ...)  # reads only
        # Two private copies; mapping the states makes new Variable objects, so that nothing
        # done to a copy can reach the user's module (nnx.merge would share its Variables).
        plain = nnx.merge(graph, _cast_tree(params, dtype), _cast_tree(rest, dtype))
        plain.eval()  # BatchNorm on its running averages, dropout off (as analyze)
        squared = nnx.merge(graph, jax.tree_util.tree_map(lambda a: _square(a, dtype), params),
                            _cast_tree(rest, dtype))
        squared.eval()
        nodes = dict(nnx.iter_graph(plain))
        wrapper = _nnx_squared_norm()
        for path, node in list(nodes.items()):
            if path and isinstance(node, nnx.BatchNorm):
                parent = _walk_graph(squared, path[:-1])
                _set_child(parent, path[-1], wrapper(node))  # folded from the unsquared copy

        def f(x):
            return self._select(squared(x[None]))[0]

        def check_modules():
            owned: dict[tuple, int] = {}
            state_owner: dict[tuple, str] = {}
            for path, node in nodes.items():
                if isinstance(node, nnx.Variable) and _is_floating(node.get_value()):
                    if isinstance(node, nnx.Param):
                        owned[path[:-1]] = owned.get(path[:-1], 0) + 1
                    else:
                        state_owner.setdefault(path[:-1], type(node).__name__)
            for path, node in nodes.items():
                if not isinstance(node, nnx.Module):
                    continue
                problem = _layer_problem(node, owned.get(path, 0))
                if problem is None and path in state_owner and not _is_batch_norm(node):
                    problem = (f"keeps a floating-point {state_owner[path]} variable (only BatchNorm's running "
                               "statistics are folded)")
                if problem is not None:
                    raise _refusal(path_str(path), node, problem)

        return f, check_modules

    def _squared_linen(self) -> tuple[Callable, Callable]:
        import flax.linen as nn

        dtype = self.dtype
        module, variables = self._model
        plain = {k: _cast_tree(v, dtype) for k, v in variables.items()}
        squared = {**plain, "params": jax.tree_util.tree_map(lambda a: _square(a, dtype), variables["params"])}
        apply_kwargs = dict(self._settings["apply_kwargs"] or {})
        seen: dict[tuple, Any] = {}
        folding = [False]

        def interceptor(next_fun, args, kwargs, context):
            m = context.module
            seen.setdefault(tuple(m.path), m)
            if folding[0] or context.method_name != "__call__" or not isinstance(m, nn.BatchNorm):
                return next_fun(*args, **kwargs)
            # The module's own unsquared variables, applied alone in inference mode.
            own = {col: sub for col, tree in plain.items()
                   if (sub := _subtree(tree, tuple(m.path))) is not None}
            alone = m.clone(parent=None, use_running_average=True)
            kw = {k: v for k, v in kwargs.items() if k != "use_running_average"}
            folding[0] = True  # the call inside is the plain BatchNorm: not intercepted again
            try:
                return _squared_affine(lambda z: alone.apply(own, z, **kw), args[0])
            finally:
                folding[0] = False

        def f(x):
            with nn.intercept_methods(interceptor):
                return self._select(module.apply(squared, x[None], **apply_kwargs))[0]

        def check_modules():
            owned: dict[tuple, int] = {}
            for col, tree in plain.items():
                for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
                    if not _is_floating(a):
                        continue
                    owner = tuple(path_str([k]) for k in p[:-1])
                    if col == "params":
                        owned[owner] = owned.get(owner, 0) + 1
                        continue
                    m = seen.get(owner)  # None: a module the model never calls, which adds nothing
                    if m is not None and not _is_batch_norm(m):
                        raise _refusal("/".join(owner), m, f"keeps a floating-point {col!r} variable (only "
                                                           "BatchNorm's running statistics are folded)")
            for path, m in seen.items():
                problem = _layer_problem(m, owned.get(path, 0))
                if problem is not None:
                    raise _refusal("/".join(path), m, problem)

        return f, check_modules


def _padded(x: Any, labels: np.ndarray, size: int) -> tuple[Any, np.ndarray]:
    """A short batch padded to ``size`` examples, so that the compiled steps see the first
    batch's shapes again instead of compiling anew (a last short batch is the usual case).

    The padding repeats the first example with label -1: no loss, gradient or derivative
    counts it (the steps mask labels < 0), as the session's padded pieces. Inputs whose
    leaves do not all lead with the batch axis are left as they are.
    """
    n = labels.shape[0]
    leaves = jax.tree_util.tree_leaves(x)
    if not leaves or any(not hasattr(a, "shape") or not a.shape or a.shape[0] != n for a in leaves):
        return x, labels
    index = np.concatenate([np.arange(n), np.zeros(size - n, np.int64)])
    x = jax.tree_util.tree_map(lambda a: np.take(a, index, axis=0) if isinstance(a, np.ndarray)
                               else jnp.take(a, jnp.asarray(index), axis=0), x)
    labels = np.concatenate([labels, np.full((size - n,) + labels.shape[1:], -1, labels.dtype)])
    return x, labels


# ---------------------------------------------------------------------- compiled per-batch steps

# Compiled steps of recent models, keyed by the model's structure (the view's ``struct``: the
# treedefs, static parts and leaf shapes/dtypes), which is all the traced functions depend on.
_STEPS = LRU(8)


@jax.jit
def _move(ws: list, deltas: list) -> list:
    return [w + d for w, d in zip(ws, deltas)]


class _Steps:
    """The compiled per-batch functions of one model structure and loss.

    They hold only the view's pure batch call (no array of the model), the
    positions of the weight leaves and the loss options; the leaves are arguments:
    ``(weights, other leaves, extra state, inputs, labels)``.
    """

    def __init__(self, apply_batch: Callable, n_leaves: int, weight_ids: list[int], rest_ids: list[int],
                 options: AnalysisOptions) -> None:
        self._apply, self._n = apply_batch, n_leaves
        self._weight_ids, self._rest_ids, self._options = list(weight_ids), list(rest_ids), options
        #: Objects whose ids a cache key holds: alive with the entry, so no id is reused meanwhile.
        self.refs: list = []
        self.losses = jax.jit(self._losses)
        self.gradient = jax.jit(jax.value_and_grad(self._loss_sum))
        self.derivatives = jax.jit(self._derivatives)

    def _logits(self, ws, rest, extra, x):
        leaves = [None] * self._n
        for i, a in zip(self._weight_ids, ws):
            leaves[i] = a
        for i, a in zip(self._rest_ids, rest):
            leaves[i] = a
        return self._apply(leaves, extra, x)

    def _losses(self, ws, rest, extra, x, labels):
        losses, correct, _ = prediction_losses(jnp, self._logits(ws, rest, extra, x), labels, self._options)
        return losses, correct

    def _loss_sum(self, ws, rest, extra, x, labels):
        losses, _ = self._losses(ws, rest, extra, x, labels)
        # Entries that are not predictions (ignored tokens) were computed with a stand-in label.
        return jnp.sum(jnp.where(labels.reshape(-1) >= 0, losses, 0))

    def _derivatives(self, ws, rest, extra, x, labels):
        # d/dt loss_i(W (1 + t)) at t = 0 is the forward-mode derivative in the direction W.
        _, tangent = jax.jvp(lambda w: self._losses(w, rest, extra, x, labels)[0], (ws,), (ws,))
        return tangent


def _steps_for(view: Any, weight_ids: list[int], rest_ids: list[int], options: AnalysisOptions) -> _Steps:
    """The cached :class:`_Steps` of a model view (built when its structure is new or unhashable)."""
    key = None
    if view.struct is not None:
        key = (view.struct, tuple(weight_ids), options.loss, float(options.temperature))
    steps = _STEPS.get(key) if key is not None else None
    if steps is None:
        steps = _Steps(view.apply_batch, len(view.leaves), weight_ids, rest_ids, options)
        steps.refs = list(view.struct_refs)
        if key is not None:
            _STEPS.put(key, steps)
    return steps


# ---------------------------------------------------------------------- squared networks: helpers


def _squared_affine(norm: Callable[[Any], Any], x: Any) -> Any:
    """``a² x + b²`` for the per-channel affine map ``norm(z) = a z + b`` (inference-mode BatchNorm).

    ``b = norm(0)`` and ``a`` is its exact derivative in the direction of ones (the
    map is per-entry affine, so its Jacobian is the diagonal ``a``), both in the
    shape of ``x``: no knowledge of the layer's axes or its parametrisation needed.
    """
    b, a = jax.jvp(norm, (jnp.zeros_like(x),), (jnp.ones_like(x),))
    return a * a * x + b * b


@functools.lru_cache(maxsize=None)
def _equinox_squared_norm() -> type:
    """An equinox BatchNorm computing the square of its own folded affine map.

    A subclass, so that model code which dispatches on ``isinstance(layer,
    eqx.nn.BatchNorm)`` (to pass the state) treats it as the layer it replaces.
    """
    import dataclasses

    import equinox as eqx

    class SquaredBatchNorm(eqx.nn.BatchNorm):
        def __init__(self, norm: eqx.nn.BatchNorm):  # a copy of ``norm``'s fields (unsquared)
            for f in dataclasses.fields(norm):
                setattr(self, f.name, getattr(norm, f.name))

        def __call__(self, x, state, *, key=None, inference=None):
            del key, inference  # always the running statistics (inference mode)
            plain = functools.partial(eqx.nn.BatchNorm.__call__, self, state=state, inference=True)
            return _squared_affine(lambda z: plain(z)[0], x), state

    return SquaredBatchNorm


@functools.lru_cache(maxsize=None)
def _nnx_squared_norm() -> type:
    """An nnx BatchNorm computing the square of the folded affine map of the one it holds.

    A subclass, so that model code which dispatches on ``isinstance(layer,
    nnx.BatchNorm)`` treats it as the layer it replaces.
    """
    from flax import nnx

    class SquaredBatchNorm(nnx.BatchNorm):
        def __init__(self, norm: nnx.BatchNorm):  # the layer of the unsquared private copy
            self.norm = norm

        def __call__(self, x, use_running_average=None, **kwargs):
            del use_running_average  # always the running statistics (inference mode)
            return _squared_affine(lambda z: self.norm(z, use_running_average=True, **kwargs), x)

    return SquaredBatchNorm


def _is_batch_norm(module: Any) -> bool:
    """Whether ``module`` is the BatchNorm layer of equinox, flax nnx or flax linen."""
    if module is None:
        return False
    for lib, attr in (("equinox", "nn"), ("flax.nnx", None), ("flax.linen", None)):
        m = sys.modules.get(lib)
        api = getattr(m, attr, None) if attr else m
        if api is not None and isinstance(module, getattr(api, "BatchNorm", ())):
            return True
    return False


def _layer_problem(module: Any, own_parameters: int) -> str | None:
    """Why ``module`` has no place in a path norm, or None (containers and parameter-free layers pass here)."""
    if _is_batch_norm(module):
        return None
    entry = REGISTRY.lookup(module)
    if entry is IGNORE:
        return "is a normalization layer other than BatchNorm"
    if isinstance(entry, Unsupported):
        return f"is a layer normflat does not analyze ({entry.reason})"
    if isinstance(entry, LayerRule):
        if entry.kind not in (None, "dense", "conv_transpose"):  # a transposed convolution is linear too
            return f"is {'an' if entry.kind[0] in 'aeiou' else 'a'} {entry.kind} layer"
        return None
    if own_parameters:
        return "holds parameters of its own and is not a dense, convolution or BatchNorm layer"
    return None


def _refusal(name: str, module: Any, problem: str) -> UnsupportedMeasureError:
    label = repr(name) if name else "the model itself"
    return UnsupportedMeasureError(
        f"Cannot compute path_norm: layer {label} ({type(module).__name__}) {problem}. {PATH_NORM_SCOPE}.")


def _equinox_modules(root: Any):
    """``(path, module, number of its own floating arrays, whether it keeps state)`` of every equinox module.

    A BatchNorm is one entry (folded as a whole: its state indices are no
    parameters); another module holding an ``eqx.nn.StateIndex`` keeps state.
    """
    import equinox as eqx

    out = []

    def visit(node, path):
        own, stateful = 0, False
        flat = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda n: n is not node and isinstance(n, (eqx.Module, eqx.nn.State)))[0]
        for p, child in flat:
            if isinstance(child, eqx.nn.State):
                continue  # the state of stateful layers, each of which is checked itself
            if isinstance(child, eqx.nn.StateIndex):
                stateful = True
            elif _is_batch_norm(child):
                out.append((path_str(path + tuple(p)), child, 0, False))
            elif isinstance(child, eqx.Module):
                visit(child, path + tuple(p))
            elif eqx.is_inexact_array(child):
                own += 1
        out.append((path_str(path), node, own, stateful))

    visit(root, ())
    return out


def _walk_graph(root: Any, path: tuple) -> Any:
    node = root
    for key in path:
        node = node[key] if not isinstance(key, str) or isinstance(node, Mapping) else getattr(node, key)
    return node


def _set_child(parent: Any, key: Any, value: Any) -> None:
    if isinstance(key, str) and not isinstance(parent, Mapping):
        setattr(parent, key, value)
    else:
        parent[key] = value


def _subtree(tree: Any, path: tuple) -> Any:
    """The nested mapping at ``path`` in a linen variable collection (None if absent)."""
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _is_floating(a: Any) -> bool:
    try:
        return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)
    except TypeError:  # extended dtypes (PRNG keys) are no numpy dtypes
        return False


def _is_array(a: Any) -> bool:
    return isinstance(a, jax.Array) or (hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim"))


def _cast_tree(tree: Any, dtype: Any) -> Any:
    """Floating leaves in ``dtype``; mapping builds new containers (and new nnx Variables)."""
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype) if _is_floating(a) else a, tree)


def _square(a: Any, dtype: Any) -> Any:
    return jnp.square(jnp.asarray(a, dtype)) if _is_floating(a) else a


# ---------------------------------------------------------------------- squared networks: the program check

#: Operations on activations that a feed-forward ReLU network of dense and convolution
#: layers with pooling needs: affine maps, layout changes, comparisons and selections
#: (relu as ``where``), sums and maxima (pooling).
_ALLOWED = {
    "add", "add_any", "sub", "neg", "reduce_sum", "reduce_max", "reduce_window_sum", "reduce_window_max",
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "convert_element_type", "copy",
    "copy_p", "slice", "concatenate", "rev", "split", "reduce_precision", "sharding_constraint",
    "optimization_barrier", "select_n", "gt", "ge", "lt", "le", "eq", "ne",
}
#: Linear in the activations only when at most one operand is an activation (``max``: relu).
_ONE_ACTIVATION = {"mul", "dot_general", "conv_general_dilated", "max"}
#: Linear in their first operand only (``div``: by a constant; the others: indices, padding value).
_FIRST_ONLY = {"div", "pad", "dynamic_slice", "gather"}
#: Parameters holding the body of call-like primitives (jit, custom_jvp, remat, ...).
_BODIES = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _check_program(closed: Any) -> None:
    """Raise if the squared network applies an operation to its activations that no allowed layer has.

    Everything computed from parameters alone (a folded BatchNorm's map, say) is
    left alone; the input's data flow is followed through every nested call.
    """
    _walk_program(closed.jaxpr, [True] * len(closed.jaxpr.invars))


def _walk_program(jaxpr: Any, flags: list[bool]) -> list[bool]:
    data = dict(zip(jaxpr.invars, flags))

    def is_data(v):
        return not isinstance(v, Literal) and data.get(v, False)

    for eqn in jaxpr.eqns:
        ins = [is_data(v) for v in eqn.invars]
        if not any(ins):
            continue  # parameters only
        body = next((eqn.params[k] for k in _BODIES if k in eqn.params), None)
        body = getattr(body, "jaxpr", body)
        if body is not None and hasattr(body, "eqns") and len(body.invars) == len(eqn.invars):
            outs = _walk_program(body, ins)
        else:
            name = eqn.primitive.name
            ok = (name in _ALLOWED or (name in _ONE_ACTIVATION and sum(ins) == 1)
                  or (name in _FIRST_ONLY and ins[0] and not any(ins[1:])))
            if not ok:
                raise UnsupportedMeasureError(
                    f"Cannot compute path_norm: the model applies {_describe_op(name, ins)} to its activations "
                    f"({_where(eqn)}), which none of the allowed layers does. {PATH_NORM_SCOPE}.")
            outs = [True] * len(eqn.outvars)
        for v, flag in zip(eqn.outvars, outs):
            data[v] = flag
    return [is_data(v) for v in jaxpr.outvars]


def _describe_op(name: str, ins: list[bool]) -> str:
    if name in _ONE_ACTIVATION | _FIRST_ONLY:
        return f"the operation {name!r} with activations as {sum(ins)} of its operands"
    return f"the operation {name!r}"


def _where(eqn: Any) -> str:
    """The layer scope and the user's source line of a traced operation, as far as JAX recorded them."""
    parts = []
    scope = str(getattr(eqn.source_info, "name_stack", "") or "")
    if scope:
        parts.append(f"in {scope!r}")
    try:
        from jax.extend import source_info_util

        parts.append(f"at {source_info_util.summarize(eqn.source_info)}")
    except Exception:  # noqa: BLE001 - the location is a courtesy; an older JAX may lack it
        pass
    return ", ".join(parts) or "in the model's own code"
