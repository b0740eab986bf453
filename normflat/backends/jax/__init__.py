"""JAX backend: equinox, flax nnx, flax linen and plain ``(apply_fn, params)`` models.

Backend options (keyword arguments of :func:`normflat.analyze`):

``vmap``
    equinox only: ``True`` if the model maps one example to logits of shape
    ``(classes,)`` (equinox's own layers) and is applied with :func:`jax.vmap`,
    ``False`` if it takes a batch. Default: detected from the first batch.
``state``
    equinox only: the ``eqx.nn.State`` of a stateful model (BatchNorm); the
    model is then called as ``model(x, state)`` and must return ``(logits, state)``.
``apply_kwargs``
    linen / ``(apply_fn, params)`` only: extra call arguments, e.g.
    ``{"train": False}``.
``layouts``
    ``{leaf path: layout}`` declaring weight tensors that normflat does not
    recognise (or overriding it): ``"out,in,*k"`` (torch/equinox order),
    ``"*k,in,out"`` (flax/Keras order), or ``None`` to exclude a leaf.
``dtype``
    Compute dtype. Default: the weights' dtype (at least float32). ``"float64"``
    computes in double precision, enabling ``jax_enable_x64`` locally if needed.
``chunk_size``
    Examples per vectorised chunk of ``ggn``/``ggn-mc`` (default: chosen from a
    memory budget). ``probe_chunk``: Hutchinson probes per chunk (default 10).
``force_exact``
    Allow ``estimator="exact"`` on models with more than
    :data:`EXACT_LIMIT` weight entries.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from normflat.backends.jax import _data, _estimators
from normflat.backends.jax._models import make_view
from normflat.backends.jax._program import trace_program
from normflat.core.options import AnalysisOptions, limited, progress_bar
from normflat.core.problem import LayerProblem

__all__ = ["layer_problems", "hessian_diagonal", "EXACT_LIMIT"]

#: estimator="exact" needs one Hessian-vector product per weight entry; above this
#: many entries it refuses unless force_exact=True.
EXACT_LIMIT = 20_000

_OPTIONS = ("vmap", "state", "apply_kwargs", "layouts", "dtype", "chunk_size", "probe_chunk", "force_exact")


def layer_problems(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any):
    """Per-layer problems of a JAX model (see the module docstring for the options)."""
    res = _compute(model, data, options, backend_options)
    problems = []
    for info, w, d, s in zip(res["weights"], res["weight_arrays"], res["diags"], res["samples"]):
        problems.append(LayerProblem(
            info.name, info.to_canonical(w), info.to_canonical(d), kind=info.kind,
            hessian_diag_samples=None if s is None else info.to_canonical(s, batch_dims=1),
            details={"path": res["paths"][info.path], "leaf": info.path},
        ))
    return problems, res["metadata"]


def hessian_diagonal(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any) -> dict:
    """``{layer name: diagonal}`` in canonical ``(out, in, *kernel)`` layout, model order."""
    res = _compute(model, data, options, backend_options)
    return {info.name: info.to_canonical(d) for info, d in zip(res["weights"], res["diags"])}


# ----------------------------------------------------------------------------- driver


def _compute(model, data, options: AnalysisOptions, backend_options: dict) -> dict:
    unknown = set(backend_options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"Unknown option(s) {sorted(unknown)} for a JAX model; the JAX backend accepts "
                        f"{', '.join(_OPTIONS)}.")
    opts = {k: backend_options.get(k) for k in _OPTIONS}
    requested = opts["dtype"]
    if requested is not None:
        requested = jnp.dtype(requested)
        if not jnp.issubdtype(requested, jnp.floating):
            raise ValueError(f"dtype={opts['dtype']!r} is not a floating-point dtype.")
    need_x64 = requested == jnp.float64 and not jax.config.jax_enable_x64
    # float64 without global x64: enable it for this computation only (documented).
    ctx = jax.enable_x64(True) if need_x64 else contextlib.nullcontext()
    with ctx:
        res = _compute_in_dtype(model, data, options, opts, requested)
        if need_x64:
            # JAX cannot hold float64 arrays once x64 is off again: hand numpy arrays over.
            for key in ("weight_arrays", "diags", "samples"):
                res[key] = [None if a is None else np.asarray(a) for a in res[key]]
    return res


def _compute_in_dtype(model, data, options, opts, requested) -> dict:
    batches = _data.batches(data)
    it = progress_bar(limited(batches, options.max_batches), enabled=options.progress,
                      desc=f"normflat {options.estimator}", total=_data.total(data, options.max_batches))
    view = prog = dtype = state = None
    examples = n_batches = 0
    for x, y in it:
        if view is None:
            dtype = requested if requested is not None else _default_dtype(model)
            x = _data.cast_inputs(x, dtype)
            view = make_view(model, x, dtype=dtype, vmap=opts["vmap"], state=opts["state"],
                             apply_kwargs=dict(opts["apply_kwargs"] or {}), layouts=dict(opts["layouts"] or {}),
                             on_unsupported=options.on_unsupported)
            _check_weights(view)
            ws = [view.leaves[w.leaf] for w in view.weights]
            x0 = jax.tree_util.tree_map(lambda a: a[0], x)
            prog = trace_program(lambda ws_, xl: [view.apply_example(view.with_weights(ws_), _data.unflatten(x, xl))],
                                 ws, jax.tree_util.tree_leaves(x0))
            _check_program_output(prog, x0, view)
            # Model order: where each weight first meets the data in the forward pass.
            order = sorted(range(len(ws)), key=lambda k: (prog.first_use[k], k))
            view.weights = [view.weights[k] for k in order]
            ws = [ws[k] for k in order]
            prog = trace_program(lambda ws_, xl: [view.apply_example(view.with_weights(ws_), _data.unflatten(x, xl))],
                                 ws, jax.tree_util.tree_leaves(x0))
            num_classes = prog.shapes[prog.out_refs[0][1]][0]
            est = _estimators.make(options, view, prog, ws, dtype, num_classes, opts)
            if options.estimator == "exact":
                total = sum(int(np.prod(w.shape)) for w in ws)
                if total > EXACT_LIMIT and not opts["force_exact"]:
                    raise ValueError(
                        f"estimator='exact' needs one Hessian-vector product per weight entry ({total} here, "
                        f"more than {EXACT_LIMIT}). Use estimator='ggn' or 'hutchinson', or pass "
                        "force_exact=True if you really want it."
                    )
        else:
            x = _data.cast_inputs(x, dtype)
        n = _data.check_batch(x, y, options, num_classes)
        est.add_batch(x, y, n, n_batches, examples)
        examples += n
        n_batches += 1
    if view is None:
        raise ValueError("The data is empty: it yielded no (x, y) batch. Pass an iterable of (x, y) batches "
                         "or one (x, y) pair of arrays.")
    diags, samples = est.finish(examples)
    for info, d in zip(view.weights, diags):
        if not bool(jnp.all(jnp.isfinite(d))):
            raise ValueError(
                f"The Hessian diagonal of layer {info.name!r} contains NaN or inf; check the data and the "
                "weights for huge or non-finite values, or compute in float64 (dtype='float64')."
            )
    device = str(next(iter(ws[0].devices()))) if hasattr(ws[0], "devices") else "cpu"
    meta = {"examples": examples, "batches": n_batches, "dtype": str(jnp.dtype(dtype)), "device": device,
            "model_type": view.framework}
    if view.vmap is not None:
        meta["vmap"] = view.vmap
    return {"weights": view.weights, "weight_arrays": ws, "diags": diags, "samples": samples,
            "paths": est.paths, "metadata": meta}


def _default_dtype(model) -> Any:
    leaves = [a for a in jax.tree_util.tree_leaves(_weights_like(model))
              if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
    dt = jnp.result_type(*leaves) if leaves else jnp.float32
    # Hessians in half precision are meaningless: compute in at least float32.
    return jnp.promote_types(dt, jnp.float32)


def _weights_like(model):
    import sys

    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(model, nnx.Module):
        return nnx.state(model, nnx.Param)
    if isinstance(model, tuple):
        return model[1]
    return model


def _check_weights(view) -> None:
    for info in view.weights:
        if not bool(jnp.all(jnp.isfinite(view.leaves[info.leaf]))):
            raise ValueError(f"The weight {info.path!r} contains NaN or inf; normflat needs finite weights.")


def _check_program_output(prog, x0, view) -> None:
    if len(prog.out_refs) != 1 or prog.out_refs[0][0] != "ref" or len(prog.shapes[prog.out_refs[0][1]]) != 1:
        shape = prog.shapes.get(prog.out_refs[0][1]) if prog.out_refs and prog.out_refs[0][0] == "ref" else None
        raise ValueError(
            f"The {view.framework} model must return logits of shape (batch, classes) (one vector per "
            f"example); per example it returned shape {shape}."
        )
    c = prog.shapes[prog.out_refs[0][1]][0]
    if c < 2:
        raise ValueError(f"The model returns {c} logit per example; normflat's losses need at least 2 classes.")
