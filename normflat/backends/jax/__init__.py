"""JAX backend: equinox, flax nnx, flax linen and plain ``(apply_fn, params)`` models.

The backend runs on the framework-free engine (:mod:`normflat.engine`): the
engine's driver owns the data contract, the loop, the estimator state, the
distributed protocol and the report; this package supplies the JAX parts, in
the module layout every backend shares:

``layers``
    the layer registry (:func:`register_layer`, :func:`registered_layers`,
    :class:`LayerRule`) and the model views of the four model kinds;
``state``
    record/restore of the user's model state (only nnx modules are mutable);
``data``
    the engine's ``DataAdapter`` for JAX, numpy and other tensors;
``session``
    the engine's ``Session``: layers in model order, one batch's sums, checks;
``hvp``, ``ggn``
    the compiled estimator kernels (``exact``/``hutchinson``; ``ggn``/``ggn-topk``/``ggn-mc``);
``distributed``
    local device meshes and the engine's ``Comm`` over ``jax.distributed``;
``perturbation``
    the engine's ``PerturbationModel`` for the rival measures (method §10): the loss at moved weights;
``compat``
    every touch of a private JAX / flax API;
``program``, ``kernel``, ``cache``
    JAX-specific: the jaxpr tracing of the fast GGN, what the kernels share, and
    the thread-safe caches.

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
    ``"*k,in,out"`` (flax/Keras order), the role of every axis of a multi-axis
    kernel (``"in,out,out"``, or ``{"out": axes, "in": axes}``; canonical
    ``(∏ out, ∏ in)``, method §3), or ``None`` to exclude a leaf. Layouts are
    checked against the traced program: one that misreads a kernel is refused.
``dtype``
    Compute dtype. Default: the weights' dtype (at least float32). ``"float64"``
    computes in double precision, enabling ``jax_enable_x64`` locally if needed.
``chunk_size``
    Examples per device per vectorised chunk of the GGN estimators. Default:
    chosen on the first batch so that the chunk's working memory (the
    back-propagated signals at every intermediate of the per-example program and
    the per-example squares) stays within about twice a training step of the
    model on that batch: :func:`normflat.core.memory.default_budget` of
    :func:`~normflat.core.memory.training_step_bytes` (every parameter leaf, and
    the outputs of every weight-using op and the logits, per device), less the
    ``K'`` group sums of every analyzed weight, at least
    :data:`~normflat.core.memory.DEFAULT_BUDGET_FLOOR` (32 MiB), and never more
    examples than an internal bound of 2²⁶ per-example intermediate elements; the
    same rule as the torch backend. ``metadata["chunk_size"]`` is the chunk used.
    One example whose signals alone exceed the bound is a chunk of one, its
    signals back-propagated a few at a time (method §9, "Memory").
    ``exact_chunk``: basis vectors per chunk of ``exact`` (default 64);
    ``probe_chunk``: Hutchinson probes per chunk (default 16).
``memory_budget``
    Bound on the memory of the per-example work of one compiled step *per
    device*: an int number of bytes or a string such as ``"512MB"`` or
    ``"2GiB"`` (see :mod:`normflat.core.memory`). Exclusive with ``chunk_size``.
    One example that does not fit takes its GGN signals a few at a time; only a
    budget that one signal does not fit is refused.
``devices``
    Data parallelism over local devices: ``None`` (default) all local devices
    of the default backend, an int ``n`` the first ``n``, or a list of local
    ``jax.Device`` objects. One device means no sharding.
``distributed``
    ``None``/``True`` (default): shard over ``devices`` and, after
    :func:`jax.distributed.initialize` with several processes, treat the data
    each process passes as its shard and combine all processes (the engine's
    protocol). ``False``: one device, this process's data only.
``fast``
    ``False`` takes the generic path (per-example VJPs of each weight) for every
    weight of the GGN estimators, as in the other frameworks (for cross-checks;
    ``details["generic_reason"]`` is ``"fast=False"``). Default ``True``.
``force``, ``max_exact_params``
    ``estimator="exact"`` refuses models with more than ``max_exact_params``
    (default :data:`DEFAULT_MAX_EXACT_PARAMS`) weight entries unless ``force=True``.

Compiled kernels are cached by the traced per-example program (structure,
shapes, dtypes and options), so analysing the same architecture again, with
other weight values, does not recompile.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp

from normflat.backends.jax import distributed
from normflat.backends.jax.compat import enable_x64, x64_enabled
from normflat.backends.jax.layers import LayerRule, register_layer, registered_layers
from normflat.backends.jax.perturbation import perturbation_model
from normflat.backends.jax.session import JaxSession
from normflat.core.memory import parse_memory_budget
from normflat.engine import driver
from normflat.engine.options import AnalysisOptions, check_flags
from normflat.engine.registry import IGNORE, Unsupported

__all__ = ["layer_problems", "hessian_diagonal", "register_layer", "registered_layers", "LayerRule", "IGNORE",
           "Unsupported", "DEFAULT_MAX_EXACT_PARAMS", "JaxSession", "perturbation_model"]

#: estimator="exact" needs one Hessian-vector product per weight entry; above this
#: many entries it refuses unless force=True (same default as the torch backend).
DEFAULT_MAX_EXACT_PARAMS = 20_000

_OPTIONS = {"vmap": None, "state": None, "apply_kwargs": None, "layouts": None, "dtype": None,
            "chunk_size": None, "exact_chunk": 64, "probe_chunk": 16, "force": False, "fast": True,
            "max_exact_params": DEFAULT_MAX_EXACT_PARAMS, "memory_budget": None, "devices": None,
            "distributed": None}


def layer_problems(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any):
    """Per-layer problems and report metadata of a JAX model (see the module docstring for the options)."""
    # The report's problems leave host memory as numpy (JaxSession.host_results).
    return _run(driver.layer_problems, model, data, options, backend_options, host_results=True)


def hessian_diagonal(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any) -> dict:
    """``{layer name: diagonal}`` in canonical ``(out, in/groups, *kernel)`` layout, model order.

    Only the mean of the group estimates is wanted: ``ggn-mc`` and ``ggn-topk`` keep one sum
    per weight for all their groups (``AnalysisOptions.pooled``), as in every backend.
    """
    return _run(driver.hessian_diagonal, model, data, replace(options, group_estimates=False), backend_options)


def _run(entry, model, data, options: AnalysisOptions, backend_options: dict, host_results: bool = False):
    settings = _settings(backend_options)
    need_x64 = settings["dtype"] == jnp.float64 and not x64_enabled()
    comm = distributed.ProcessComm() if distributed.multi_process(settings) else None

    def make_session():
        # JAX cannot hold float64 arrays once x64 is off again: float64 results go out as numpy.
        return JaxSession(model, options, settings, comm, host_outputs=need_x64, host_results=host_results)

    # float64 without global x64: enable it for this computation only (thread-local, documented).
    with enable_x64(True) if need_x64 else contextlib.nullcontext():
        return entry(make_session, data, options, comm)


def _settings(backend_options: dict) -> dict:
    unknown = set(backend_options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"Unknown option(s) {sorted(unknown)} for a JAX model; the JAX backend accepts "
                        f"{', '.join(_OPTIONS)}.")
    check_flags(backend_options)
    s = {**_OPTIONS, **backend_options}
    for name in ("exact_chunk", "probe_chunk", "max_exact_params"):
        v = s[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")
    v = s["chunk_size"]
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {v!r}.")
    if s["memory_budget"] is not None and s["chunk_size"] is not None:
        raise ValueError("Pass either chunk_size (examples per step) or memory_budget (the chunk size is then "
                         "chosen from it), not both.")
    s["memory_budget"] = parse_memory_budget(s["memory_budget"])
    if s["distributed"] is not None and not isinstance(s["distributed"], bool):
        raise TypeError(f"distributed must be True, False or None, got {s['distributed']!r}.")
    d = s["devices"]
    if d is not None and not (isinstance(d, int) and not isinstance(d, bool) and d >= 1):
        if isinstance(d, (str, bytes)) or not hasattr(d, "__iter__"):
            raise TypeError(f"devices must be None, a positive int or a list of jax devices, got {d!r}.")
        d = list(d)
        if not d or not all(isinstance(v, jax.Device) for v in d):
            raise TypeError(f"devices must be a non-empty list of jax.Device objects (e.g. jax.local_devices()), "
                            f"got {s['devices']!r}.")
        s["devices"] = d
    if s["vmap"] is not None and not isinstance(s["vmap"], bool):
        raise TypeError(f"vmap must be True, False or None, got {s['vmap']!r}.")
    for name in ("apply_kwargs", "layouts"):
        if s[name] is not None and not isinstance(s[name], dict):
            raise TypeError(f"{name} must be a dict, got {type(s[name]).__name__}.")
    if s["dtype"] is not None:
        try:
            dt = jnp.dtype(s["dtype"])
        except TypeError as err:
            raise ValueError(f"dtype={s['dtype']!r} is not a dtype.") from err
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"dtype={s['dtype']!r} is not a floating-point dtype.")
        s["dtype"] = dt
    return s
