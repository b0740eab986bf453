"""The JAX backend's :class:`~normflat.engine.driver.Session`: one model under analysis.

The engine's driver (:func:`normflat.engine.driver.run`) owns the loop, the data
contract, the estimator state, the distributed protocol and the report; this
session supplies what is JAX-specific:

* the layers: the model view and its weights (:mod:`~normflat.backends.jax.layers`),
  in model order, the order in which the traced forward program
  (:mod:`~normflat.backends.jax.program`) first uses each weight. Tracing needs
  the shapes of one input, so the session prepares itself on the first batch;
* one batch's per-layer ``K'`` group sums (``options.state_groups``, canonical layout)
  from the cached, compiled kernels (:mod:`~normflat.backends.jax.hvp`,
  :mod:`~normflat.backends.jax.ggn`). ``estimator="auto"`` is resolved on the first
  batch, once the number of classes (and of tokens, for token logits) is known, before
  any kernel is built (:func:`normflat.engine.options.resolve_estimator`, method §6.2,
  §6.3);
* the value checks with the engine's messages: the logits' statistics
  (:func:`normflat.engine.losses.logit_stats`) and the finiteness of device inputs
  are computed inside the compiled steps and checked on the host together, with
  one device synchronisation at the end of the data (every batch in a
  multi-process run, so that the engine's step protocol stops every process);
* the canonical ``(out, in/groups, *k)`` layout and the metadata.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from normflat.backends.jax import distributed
from normflat.backends.jax.cache import LRU
from normflat.backends.jax.data import ADAPTER, cast_inputs, device_inputs_finite, to_jax
from normflat.backends.jax.ggn import GGN
from normflat.backends.jax.hvp import Exact, Hutchinson
from normflat.backends.jax.kernel import GroupSums, combine_stats
from normflat.backends.jax.layers import canonical_shape, check_has_weights, check_layouts, make_view, to_canonical
from normflat.backends.jax.program import UNUSED_REASON, trace_program
from normflat.backends.jax.state import ModelState
from normflat.engine.data import (PENDING_CHECKS, Batch, first_forward, labels_for, model_fails_on_inputs,
                                  non_finite_inputs, raised_by_normflat)
from normflat.engine.estimators import SumState
from normflat.engine.losses import (LOGIT_STATS, SAMPLES_APART_ROWS, check_logit_stats, check_loss_value,
                                    check_output_shape, check_same_classes, check_samples_apart, one_sample_error)
from normflat.engine.options import AnalysisOptions, resolve_estimator
from normflat.engine.problems import UNUSED_NOTE, LayerSpec, ParameterStatus

__all__ = ["JaxSession"]

_KERNELS = {"exact": Exact, "hutchinson": Hutchinson, "ggn": GGN, "ggn-topk": GGN, "ggn-mc": GGN}
# Compiled kernels of recent models, keyed by the traced per-example program, so that
# repeated analyses (e.g. during training) do not recompile. Small: each holds XLA executables.
_CACHE = LRU(8)
# Traced and analysed per-example programs, keyed by the model's structure.
_TRACES = LRU(8)



@jax.jit
def _finite(a):
    return jnp.all(jnp.isfinite(a))


@jax.jit
def _finite_each(parts):
    return [jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in p])) if p else jnp.asarray(True) for p in parts]


@functools.partial(jax.jit, static_argnums=0)
def _transpose_all(layouts, arrays):
    return [to_canonical(a, lay) for lay, a in zip(layouts, arrays)]


def _canonical_weights(view) -> list:
    """The canonical weights of every layer, in one compiled call."""
    return _transpose_all(tuple(w.layout for w in view.weights), [view.leaves[w.leaf] for w in view.weights])


def view_for(model: Any, batch: Batch, settings: dict, options: AnalysisOptions) -> Any:
    """The model view (:func:`~normflat.backends.jax.layers.make_view`) for the inputs of ``batch``.

    Args:
        model: The user's model.
        batch: A batch of the data (its inputs decide the view's input structure).
        settings: The backend's settings (``dtype``, ``vmap``, ``state``, ``apply_kwargs``, ``layouts``).
        options: The analysis options (``output``).
    """
    # The view calls the model on the batch (a linen module's owners, equinox's per-example test):
    # a model that fails on the data's inputs fails here first.
    with first_forward("jax", batch):
        return make_view(model, jax.tree_util.tree_map(to_jax, batch.x), dtype=settings["dtype"],
                         vmap=settings["vmap"], state=settings["state"],
                         apply_kwargs=dict(settings["apply_kwargs"] or {}),
                         layouts=dict(settings["layouts"] or {}), keywords=batch.keywords, output=options.output,
                         strip_softmax=not callable(options.loss))


def trace_layers(view: Any, batch: Batch, *, allow_half_precision: bool = False) -> tuple[Any, tuple[int, ...]]:
    """Trace the per-example forward program and put ``view``'s weights in model order.

    Model order is the order in which the forward program first uses each weight
    (where it first meets the data). The program is traced on the first example of
    ``batch``, cast to the view's dtype, and cached by the model's structure and
    the example's shapes (like ``jax.jit``'s cache), so a model of the same
    architecture is not traced again. ``view.weights`` is reordered in place and
    their layouts are checked against the program (which may supply the layout
    of a multi-axis kernel).

    Args:
        view: The model view, weights in discovery order; reordered in place.
        batch: The first batch of the data.
        allow_half_precision: Accept a forward pass that computes in float16 or
            bfloat16 (the analysis refuses one: its Hessians would be meaningless).

    Returns:
        ``(program, out_shape)``: the traced program, its weights in model order,
        and the per-example output shape (``(0, 0)`` for a program of several
        outputs).

    Raises:
        ValueError: For half-precision computation (unless allowed), weight
            layouts that do not fit the program, and logits whose number of classes
            follows the rows the model is called on (:func:`_check_classes_apart`).
    """
    x = cast_inputs(batch.x, view.dtype)
    x0 = jax.tree_util.tree_map(lambda a: a[0], x)
    tkey = None
    if view.struct is not None:
        tkey = (view.struct, tuple(w.path for w in view.weights),
                tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree_util.tree_leaves(x0)),
                str(jax.tree_util.tree_structure(x0)))
    entry = _TRACES.get(tkey) if tkey is not None else None
    if entry is None:
        ws, others = view.split()
        fn = view.example_fn()
        treedef = jax.tree_util.tree_structure(x0)
        failed: list[Exception] = []  # the model's own error, apart from the program's checks

        def example(w_: Any, o_: Any, xl: Any) -> list[Any]:
            try:
                return [fn(w_, o_, jax.tree_util.tree_unflatten(treedef, xl))]
            except Exception as err:
                failed.append(err)
                raise

        try:
            prog = trace_program(example, ws, others, jax.tree_util.tree_leaves(x0))
        except Exception as err:
            if failed and failed[0] is err and not raised_by_normflat(err):
                _check_runs_on_batches(view, batch, x, err)
            raise
        order = sorted(range(len(ws)), key=lambda k: (prog.first_use[k], k))
        prog.reorder(order)
        apart = False
        if tkey is not None:
            # The traced program depends only on the structure; the view's struct_refs keep the
            # objects whose ids the key holds alive while the entry is cached.
            _TRACES.put(tkey, (prog, order, view.struct_refs, apart))
    else:
        prog, order, _, apart = entry
    half = prog.half_precision_ops()
    if half and not allow_half_precision and view.framework == "keras":
        raise ValueError(
            f"The Keras model computes in half precision inside its forward pass ({', '.join(half)} in "
            "float16/bfloat16): layers whose variables are float16 or bfloat16 (dtype='float16'). Hessians in "
            "half precision are meaningless and normflat's JAX backend computes in at least float32: build the "
            "model in float32 and set_weights its weights, or use a mixed precision policy ('mixed_float16': "
            "float32 variables, analyzed in float32); Keras' TensorFlow backend analyzes such a model in its "
            "variables' dtype and says so in the report's dtype."
        )
    if half and not allow_half_precision:
        raise ValueError(
            f"The {view.framework} model computes in half precision inside its forward pass "
            f"({', '.join(half)} in float16/bfloat16), e.g. a layer built with dtype=jnp.float16. "
            "Hessians in half precision are meaningless and normflat computes in at least float32: build "
            "the layers with dtype=None or jnp.float32 (param_dtype may stay float16), or analyze a "
            "float32 copy of the model."
        )
    view.weights = [view.weights[k] for k in order]
    check_layouts(view, prog)
    out = prog.out_refs[0] if len(prog.out_refs) == 1 else None
    per_example = tuple(prog.shapes.get(out[1], ())) if out is not None and out[0] == "ref" else ()
    if not apart and out is not None and batch.n >= 2 and not view.vmap:
        # Once per traced structure (the cached entry records it), before the shape checks that
        # would misread the per-example logits of in-batch scores (one "class").
        _check_classes_apart(view, x, per_example)
        if tkey is not None:
            _TRACES.put(tkey, (prog, order, view.struct_refs, True))
    return prog, (per_example if len(prog.out_refs) == 1 else (0, 0))


def _check_runs_on_batches(view: Any, batch: Batch, x: Any, err: Exception) -> None:
    """The model's per-example trace failed with ``err``: raise
    :func:`~normflat.engine.losses.one_sample_error` for a model that runs on the batch's first two
    rows (a forward written for more than one sample: a fixed batch size, a squeeze of the batch
    axis), :func:`~normflat.engine.data.model_fails_on_inputs` for one that fails on them too (inputs
    that do not fit it; the batch's error chained); return for a model called per example by
    design (equinox's ``vmap=True``), whose error stands.
    """
    if view.vmap:
        return
    on_rows = _rows_error(view, x)
    if on_rows is not None:  # the inputs do not fit the model
        if raised_by_normflat(on_rows):
            return
        raise model_fails_on_inputs("jax", on_rows, batch) from on_rows
    if int(jax.tree_util.tree_leaves(x)[0].shape[0]) >= 2:
        raise one_sample_error("jax", err) from err


def _rows_error(view: Any, x: Any) -> Exception | None:
    """The error of the model's batch call on the first rows (:data:`SAMPLES_APART_ROWS`) of the
    inputs ``x``, traced abstractly (no computation), or ``None`` where it runs."""
    first = jax.tree_util.tree_map(lambda a: a[:SAMPLES_APART_ROWS], x)
    try:
        jax.eval_shape(lambda t: view.apply_batch(view.leaves, list(view.extra), t), first)
    except Exception as err:  # noqa: BLE001 - returned
        return err
    return None


def example_signature(x: Any) -> tuple:
    """The structure and per-example shapes and dtypes of a batch's inputs: what a traced program is
    for."""
    leaves, tree = jax.tree_util.tree_flatten(x)
    return (str(tree),) + tuple((tuple(int(d) for d in np.shape(a)[1:]), str(getattr(a, "dtype", type(a).__name__)))
                                for a in leaves)


def forward_error_of(view: Any, batch: Batch, dtype: Any) -> BaseException | None:
    """The model's error on the first rows of ``batch`` (inputs it does not take: a later batch of
    another shape or dtype), its batch call traced abstractly on the inputs cast to ``dtype``, or
    ``None`` where it runs or where normflat raised the error itself
    (:func:`~normflat.engine.data.model_failures`)."""
    err = _rows_error(view, cast_inputs(batch.x, dtype))
    return None if err is None or raised_by_normflat(err) else err


def _check_classes_apart(view: Any, x: Any, per_example: tuple[int, ...]) -> None:
    """Refuse logits of a sample that depend on the other samples: the model called on a batch (of
    two rows) must give as many classes as the per-example program
    (:func:`~normflat.engine.losses.check_same_classes`) and, row by row, the same logits as each
    row alone (:func:`~normflat.engine.losses.check_samples_apart`).

    The analysis runs the model per example (a batch model on one row, :meth:`ModelView.example_fn`),
    so the logits of scores against in-batch candidates (``(n, n)``) would be read as one class,
    and a model that mixes its samples (a mean over the batch axis in its ``__call__``) would be
    analyzed as another function, each sample alone. One forward of the two rows and one of each
    row (computed, not compiled) tell them apart. A model called per example (equinox's
    ``vmap=True``) cannot mix the samples and is not evaluated; nor is one that fails on two rows
    (the analysis never calls it on a batch).
    """
    two = jax.tree_util.tree_map(lambda a: a[:2], x)
    extra = list(view.extra)
    try:
        out = view.apply_batch(view.leaves, extra, two)
    except Exception:  # noqa: BLE001 - nothing to compare: the per-example analysis stands
        return
    if not hasattr(out, "shape"):
        return
    check_same_classes(tuple(out.shape), (1, *per_example))
    if not (len(out.shape) >= 1 and out.shape[0] == 2 and jnp.issubdtype(out.dtype, jnp.floating)):
        return
    alone = [view.apply_example(view.leaves, extra, jax.tree_util.tree_map(lambda a: a[i], x)) for i in range(2)]
    check_samples_apart(np.asarray(out, dtype=np.float64), [np.asarray(a, dtype=np.float64) for a in alone],
                        dtype=jnp.dtype(out.dtype).name)


class JaxSession:
    """One JAX model and one set of options under analysis."""

    framework = "jax"
    adapter = ADAPTER

    def __init__(self, model: Any, options: AnalysisOptions, settings: dict, comm: Any = None,
                 host_outputs: bool = False, host_results: bool = False) -> None:
        self.framework_version = jax.__version__
        self.model, self.options, self.settings, self.comm = model, options, settings, comm
        #: Every result goes out as numpy (float64 without global x64: JAX cannot hold it).
        self.host_outputs = host_outputs
        #: Results in host memory go out as numpy (for the core's report, not hessian_diagonal).
        self.host_results = host_results
        self.layers: list[LayerSpec] = []
        self.unsupported: list[str] = []
        #: What became of every parameter leaf (the report's ``excluded`` and ``coverage``).
        self.parameters: list[ParameterStatus] | None = None
        self._state = ModelState(model)
        self._finished = False
        self._mesh = distributed.mesh(settings)
        self._stream = comm.rank if comm is not None else 0
        self._pending: list = []
        self.saturation = math.inf  # the least softmax saturation of the checked batches (driver)
        # Labels on an accelerator that only need checking (the GGN of (n, C) logits does not use
        # them): copied to the host without waiting, checked with the deferred checks.
        self._label_checks: dict[int, Batch] = {}
        self._updates = 0
        self.view = self.kernel = self.run = None
        self._weights = None
        self._sum_state: SumState | None = None
        self._flags: list | None = None
        self._finite_calls = 0

    # ------------------------------------------------------------------ engine protocol

    def signature(self) -> list[Any]:
        tree = self.model
        nnx = sys.modules.get("flax.nnx")
        if nnx is not None and isinstance(self.model, nnx.Module):
            tree = nnx.state(self.model)
        leaves = [a for a in jax.tree_util.tree_leaves(tree) if hasattr(a, "shape") and hasattr(a, "dtype")]
        return [type(self.model).__name__, [(tuple(a.shape), str(a.dtype)) for a in leaves],
                sorted((k, repr(v)) for k, v in self.settings.items() if k not in ("state", "devices"))]

    def update(self, batch: Batch, state: SumState) -> int | None:
        if self.view is None:
            self._prepare(batch)
        elif example_signature(batch.x) != self._inputs:
            self._switch_inputs(batch)
        n, index, options = batch.n, batch.index, self.options
        check_output_shape((n,) + self.out_shape, options, index, n)
        tokens = self.out_shape[0] if len(self.out_shape) == 2 else None
        deferred = (tokens is None and not callable(options.loss) and self._updates > 0
                    and self._deferred_labels(batch.y))
        # The Hessian-vector products use class indices (n,) on the device before the checks: their
        # loss compares them with the classes, so a bad one selects nothing until the checks refuse
        # it (other forms, one-hot rows, are converted by the data contract on the host).
        indices = deferred and not isinstance(self.kernel, GGN) and tuple(batch.y.shape) == (n,) and bool(
            jnp.issubdtype(batch.y.dtype, jnp.integer))
        if deferred and (isinstance(self.kernel, GGN) or indices):
            batch.y.copy_to_host_async()
            self._label_checks[index] = replace(batch, x=None)  # the inputs need not live until the checks
            labels = None
        else:
            # JAX models have no config telling a causal LM: shift_labels=None means no shift (method §6.3).
            labels = labels_for(batch, self.num_classes, self.adapter, options, tokens=tokens,
                                shift=bool(options.shift_labels) if tokens is not None else False)
        x = cast_inputs(batch.x, self.dtype)
        xl = jax.tree_util.tree_leaves(x)
        terms = None
        if tokens is not None and labels is not None and not callable(options.loss):
            # The built-in losses sum over the counted tokens (ignore_index is negative); a custom
            # loss returns its own mean, which the kernels scale by the number of sequences.
            terms = int(np.count_nonzero(labels >= 0))
        if isinstance(self.kernel, GGN):
            # The GGN does not depend on the labels; for token logits it needs which tokens count.
            y = jnp.asarray(labels >= 0, dtype=self.dtype) if tokens is not None else None
        elif callable(options.loss):
            y = to_jax(batch.y)  # the custom loss receives y as given
        elif labels is None:  # deferred class indices, on the device
            y = batch.y.astype(jnp.int32)
        else:
            y = jnp.asarray(labels, dtype=jnp.int32)
        vals, stats = self.kernel.batch(self.run, xl, y, n, batch.offset)
        # Dispatched after the kernel, so that they do not delay its start: the input check
        # (of the cast arrays) and, once, the canonical weights for the report.
        inputs_ok = device_inputs_finite(batch.x, cast=x)
        if self._weights is None:
            self._weights = _canonical_weights(self.view)
        if callable(options.loss):
            # A per-sample loss is known at trace time: refuse it at once (engine message).
            shape = getattr(self.kernel, "loss_shape", ())
            if int(np.prod(shape, dtype=np.int64)) != 1:
                check_loss_value(shape, True, index, options)
        self._sum_state = state
        if len(state.sums) < len(self.layers):
            # The layers are known from the first batch on (tracing needs an input).
            state.sums.extend([None] * (len(self.layers) - len(state.sums)))
        for i, v in enumerate(vals):
            state.add_sums(i, v, options.sum_groups)  # an exact head: its one shared sum (GGN kernel)
        self._pending.append((index, stats, inputs_ok))
        self._updates += 1
        if self.comm is not None or len(self._pending) >= PENDING_CHECKS:
            self._run_checks()  # every process must learn of a bad batch in this step
        return terms

    def forward_error(self, batch: Batch) -> BaseException | None:
        """:func:`forward_error_of` once the view exists (before, its first forward refuses such
        inputs) (engine protocol)."""
        return None if self.view is None else forward_error_of(self.view, batch, self.dtype)

    def zeros(self, layer: int) -> Any:
        shape = self._canonical_shape(layer) if self.kernel is not None else ()
        zero = jnp.zeros(tuple(shape), self.dtype if self.kernel is not None else jnp.float32)
        return GroupSums([zero] * self.options.sum_groups)

    def all_finite(self, array: Any) -> bool:
        # The engine's first call after the data: evaluate the deferred checks first, so that
        # bad logits or inputs get their own message rather than "the diagonal is not finite";
        # the same synchronisation fetches whether each layer's sums are finite (the engine
        # asks layer by layer, in order; a diagonal is a sum divided by positive counts).
        i, self._finite_calls = self._finite_calls, self._finite_calls + 1
        if self._flags is None:
            state = self._sum_state
            sums = state.sums if state is not None else []
            # A kernel-summed layer's diagonal is its full-size numerator (state.means) divided;
            # the layer being finalized has already left the state: its diagonal itself.
            parts = [(state.means[j],) if state.compacted(j)
                     else () if g is None else (g.parts if isinstance(g, GroupSums) else (g,))
                     for j, g in enumerate(sums)]
            if i < len(parts) and isinstance(array, jax.Array):
                parts[i] = (array,)
            self._run_checks(extra=_finite_each(parts))
        if self.kernel is not None and i < len(self._flags) and tuple(array.shape) == self._canonical_shape(i):
            return bool(self._flags[i])
        return bool(_finite(array)) if isinstance(array, jax.Array) else bool(np.isfinite(array).all())

    def canonical(self, layer: int, array: Any) -> Any:
        # The kernels hand over their sums in the canonical layout already (transposed inside
        # the compiled split of each batch), so this session's "native" layout is canonical.
        return self._handover(array)

    def kernel_axes(self, layer: int) -> tuple[int, ...]:
        """The canonical kernel axes (the sums are canonical): the groups are kept as kernel sums."""
        if self.kernel is None:
            return ()
        shape = self._canonical_shape(layer)
        return tuple(range(2, len(shape))) if int(np.prod(shape[2:], dtype=np.int64)) > 1 else ()

    def _canonical_shape(self, layer: int) -> tuple:
        return tuple(canonical_shape(self.kernel.shapes[layer], self.view.weights[layer].layout))

    def weight(self, layer: int) -> Any:
        if self._weights is None:
            # One compiled call for every layer (dispatched early, next to the first batch).
            self._weights = _canonical_weights(self.view)
        return self._handover(self._weights[layer])

    def _handover(self, array: Any) -> Any:
        """A result as the engine hands it on: a JAX array (``hessian_diagonal`` returns the
        framework's arrays), numpy where JAX cannot hold it, and numpy for the report's
        problems when it lives in host memory.

        The core runs eagerly, op by op; JAX compiles each new op and shape on its first use
        (about 3 s of a first analyze on a CPU), where numpy on the same memory has no such
        cost. An accelerator's arrays stay there, so that the core runs on the device.
        """
        if self.host_outputs or isinstance(array, np.ndarray):
            return np.asarray(array)
        array = jnp.asarray(array)
        if self.host_results and all(device.platform == "cpu" for device in array.devices()):
            return np.asarray(array)
        return array

    def metadata(self) -> dict[str, Any]:
        ws = self.run.ws if self.run is not None else []
        device = str(next(iter(ws[0].devices()))) if ws and hasattr(ws[0], "devices") else "cpu"
        self._finished = True  # the engine asks for the metadata after the last batch and the checks
        backend = {"model_type": self.view.framework, "devices": self.run.ndev,
                   "processes": self.comm.size if self.comm is not None else 1}
        if self.view.vmap is not None:
            backend["vmap"] = self.view.vmap
        if getattr(self.view, "stripped_softmax", None) is not None:  # a Keras model's, as on TensorFlow
            backend["stripped_softmax"] = self.view.stripped_softmax
        chunk = self.run.chunk if self.run is not None and self.run.chunk is not None else self.kernel.max_block
        return {"dtype": str(jnp.dtype(self.dtype)), "device": device, "chunk_size": chunk,
                "memory_budget": self.settings["memory_budget"], "backend": backend,
                "token_logits": self.kernel is not None and self.kernel.tokens is not None}

    def close(self) -> None:
        if not self._finished:
            # normflat never writes into the user's model; after an error or an interrupt
            # the state is checked (and put back) all the same.
            self._state.restore()
        # Drop references to this model's arrays (the kernels are cached, the run is not).
        self.run = None
        self._pending = []
        self._label_checks = {}

    # ------------------------------------------------------------------ preparation

    def _prepare(self, batch: Batch) -> None:
        settings, options = self.settings, self.options
        view = view_for(self.model, batch, settings, options)
        self._state = ModelState(self.model, getattr(view, "user_states", ()))
        self.parameters = view.parameters
        self.unsupported = view.skipped.report(options.on_unsupported)
        check_has_weights(view)
        dtype = view.dtype
        self._inputs = example_signature(batch.x)
        prog, self.out_shape = trace_layers(view, batch)
        ws, others = view.split()
        num_classes = check_output_shape((batch.n,) + self.out_shape, options, batch.index, batch.n)
        # "auto" becomes ggn or ggn-topk now that C (and T for token logits, whose signals it counts per
        # sequence, method §6.3) is known; the driver reads self.options for the finalize and the report,
        # and the kernel (and its cache key) takes the resolved options.
        tokens = self.out_shape[0] if len(self.out_shape) == 2 else None
        options = self.options = resolve_estimator(options, num_classes, tokens=tokens)
        if options.estimator == "exact":
            total = sum(int(np.prod(w.shape)) for w in ws)
            if total > settings["max_exact_params"] and not settings["force"]:
                raise ValueError(
                    f"estimator='exact' needs one Hessian-vector product per weight entry ({total} here, more "
                    f"than max_exact_params={settings['max_exact_params']}). Use estimator='ggn' or "
                    "'hutchinson', or pass force=True if you really want it."
                )
        kernel = self._kernel_for(prog, ws, dtype, num_classes)
        self.run = kernel.begin(ws, others, self._mesh, seed=options.seed, stream=self._stream,
                                weights=view.weights)
        self.view, self.kernel, self.dtype, self.num_classes = view, kernel, dtype, num_classes
        self._programs = {self._inputs: (kernel, self.run, self.out_shape)}
        self.layers = []
        for w, path, why in zip(view.weights, kernel.paths, kernel.reasons):
            spec = LayerSpec(w.name, w.kind, w.path, groups=w.groups, path=path, reason=why,
                             extra={"leaf": w.path}, blocks=w.blocks)
            if why == UNUSED_REASON:
                # No operation uses it: zero curvature at no cost (its per-example gradients are
                # symbolic zeros), reported as the other backends report it, unused, no path.
                spec.path, spec.reason, spec.extra["unused"] = "fast", None, UNUSED_NOTE
            self.layers.append(spec)

    def _kernel_for(self, prog: Any, ws: list, dtype: Any, num_classes: int) -> Any:
        """The estimator's kernel for a traced program, shared by analyses of the same program."""
        settings, options = self.settings, self.options
        # per_sequence: the same program and estimator back-propagate other signals per token or per sequence.
        key = (prog.text, tuple(str(w.dtype) for w in ws), options.estimator, options.samples,
               options.top_classes, options.per_sequence, options.pooled,
               options.loss if callable(options.loss) else str(options.loss), options.temperature,
               settings["chunk_size"], settings["memory_budget"], settings["exact_chunk"], settings["probe_chunk"],
               settings["fast"])
        cached = _CACHE.get(key)
        if cached is not None and _same_consts(cached[0], prog.consts):
            return cached[1]
        kernel = _KERNELS[self.options.estimator](options, prog, ws, dtype, num_classes, settings)
        _CACHE.put(key, (prog.consts, kernel))
        return kernel

    def _switch_inputs(self, batch: Batch) -> None:
        """Take the program traced for this batch's example shapes (a later batch of another
        sequence length, as a collator that pads each batch gives), tracing it on the first batch
        of those shapes: its own kernel and run, the same weights and sums. The number of classes
        must be the first program's; the layers' reported paths merge over the programs
        (:meth:`_merge_paths`)."""
        signature = example_signature(batch.x)
        entry = self._programs.get(signature)
        if entry is None:
            view = self.view
            names = [w.path for w in view.weights]
            prog, out_shape = trace_layers(view, batch)
            if [w.path for w in view.weights] != names:
                raise RuntimeError("normflat: the model's weights came in another order for inputs of another "
                                   "shape; please report this model")
            classes = check_output_shape((batch.n,) + out_shape, self.options, batch.index, batch.n,
                                         seen=(batch.n,) + self.out_shape)
            ws, others = view.split()
            kernel = self._kernel_for(prog, ws, self.dtype, classes)
            self._merge_paths(kernel)
            entry = (kernel, kernel.begin(ws, others, self._mesh, seed=self.options.seed, stream=self._stream,
                                          weights=view.weights), out_shape)
            self._programs[signature] = entry
        self.kernel, self.run, self.out_shape = entry
        self._inputs = signature

    def _merge_paths(self, kernel: Any) -> None:
        """Report each layer as the programs of all input shapes took it: the generic path, with its
        reason, where any program's kernel took it; no longer unused where one uses it."""
        for spec, path, why in zip(self.layers, kernel.paths, kernel.reasons):
            if why == UNUSED_REASON:
                continue
            if spec.extra.pop("unused", None) is not None:
                spec.path, spec.reason = path, why
            elif path != "fast" and spec.path == "fast":
                spec.path, spec.reason = path, why

    # ------------------------------------------------------------------ deferred checks

    @staticmethod
    def _deferred_labels(y: Any) -> bool:
        """Whether labels are copied to the host without waiting and checked after the loop: a
        JAX array on an accelerator, whose read would wait for it."""
        return isinstance(y, jax.Array) and any(d.platform != "cpu" for d in y.devices())

    def _run_checks(self, extra: Any = None) -> None:
        """Evaluate the deferred value checks with one device synchronisation; raise the first failure.

        Args:
            extra: Per-layer finiteness flags of the sums, fetched in the same synchronisation.
        """
        pending, self._pending = self._pending, []
        values, flags = jax.device_get(([(stats, ok) for _, stats, ok in pending], extra))
        if extra is not None:
            self._flags = [bool(f) for f in flags]
        eps = float(np.finfo(np.dtype(self.dtype)).eps)
        for (index, _, _), (stats, ok) in zip(pending, values):
            held = self._label_checks.pop(index, None)
            if held is not None:  # in the order of the eager checks: labels, inputs, logits
                labels_for(held, self.num_classes, self.adapter, self.options)
            if ok is not None and not bool(ok):
                raise non_finite_inputs(index)
            st = combine_stats(stats)
            self.saturation = min(self.saturation, check_logit_stats(st[:LOGIT_STATS], self.options, index,
                                                                     self.num_classes, eps))
            check_loss_value(getattr(self.kernel, "loss_shape", ()) if callable(self.options.loss) else (),
                             bool(st[LOGIT_STATS] > 0), index, self.options)


def _same_consts(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x is y:
            continue
        if np.shape(x) != np.shape(y) or getattr(x, "dtype", None) != getattr(y, "dtype", None):
            return False
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            return False
    return True
