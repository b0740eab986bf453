"""Keras 3 / TensorFlow backend over the engine: Hessian and GGN diagonals of Keras models (method §6, §7).

The engine (:mod:`normflat.engine`) owns the data contract, the loop, the
estimator sums, the distributed protocol, the losses and the ``LayerProblem``
construction; this package supplies what is Keras-specific:

``layers``
    the layer registry (:func:`register_layer`), built-in entries, model walk;
``state``
    record/restore of the few layer-instance attributes an analysis sets;
``data``
    the engine's ``DataAdapter`` for tensors, numpy arrays and ``tf.data``;
``session``
    the engine's ``Session``: the layers, one batch's kernels, canonical layout;
``ggn`` / ``hvp``
    the ``ggn``/``ggn-topk``/``ggn-mc`` and ``exact``/``hutchinson`` kernels;
``distributed``
    ``tf.distribute`` replicas and the multi-worker ``Comm``;
``perturbation``
    the engine's ``PerturbationModel`` for the rival measures (method §10): the
    loss at moved weights, run statelessly;
``calls``, ``ops``
    replacement layer calls (grouped convolutions, normalization) and the array
    namespace the engine's losses run on;
``compat``
    every touch of a private Keras API.

The model is only read: every estimator differentiates with respect to the
model's own variables through ``tf.GradientTape`` and never assigns them.

Backend options (keyword arguments of ``normflat.analyze``):

``layers`` (list of str, default all)
    Analyze only these layers (names as reported).
``chunk_size`` (int, default automatic)
    Samples per compiled step; lower it if memory runs out. Results do not
    depend on it. Default for the GGN estimators, without ``memory_budget``: the
    largest chunk whose estimated step (the memory estimate of ``memory_budget``)
    stays within about twice a training step of the model on the batch (per
    replica under a strategy): :func:`normflat.core.memory.default_budget` of
    :func:`~normflat.core.memory.training_step_bytes` (every model variable; the
    tapped layers' pre-activations and the logits), less the per-layer sums the
    estimator holds (``state_groups`` per analyzed weight entry), at least
    :data:`~normflat.core.memory.DEFAULT_BUDGET_FLOOR` (32 MiB) and at most 256 MiB,
    and at most 1024 samples; the same rule as the torch backend. ``exact`` and
    ``hutchinson``: 512.
``batch_size`` (int)
    Deprecated alias of ``chunk_size`` (a single ``(x, y)`` pair is one batch).
``memory_budget`` (int bytes or str such as ``"512MB"``/``"2GiB"``, default None)
    Bounds the estimated memory of the per-sample work of one GGN step; the
    chunk size is the largest that fits (see :mod:`normflat.core.memory`).
    Exclusive with ``chunk_size``; with a strategy it applies per replica. Used
    by the GGN estimators (``ggn``, ``ggn-topk``, ``ggn-mc``); ``exact`` and
    ``hutchinson`` process their probes in fixed blocks.
``distributed`` (bool or None, default None = automatic)
    A model built under a ``tf.distribute.MirroredStrategy`` or
    ``MultiWorkerMirroredStrategy`` scope (or analyzed inside one) is analyzed
    with the strategy's replicas: each batch's chunks are dealt to this
    worker's replicas; with several workers every worker passes its own shard
    and the sums are reduced over workers. ``False`` analyzes on one device;
    ``True`` requires a strategy.
``max_exact_params`` (int, default 20000) and ``force`` (bool, default False)
    ``estimator="exact"`` refuses models with more analyzed weights than
    ``max_exact_params`` unless ``force=True``.
``fast`` (bool, default True)
    ``False`` sends every layer through the generic per-sample Jacobian GGN
    path (slower; for cross-checks).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import keras

try:
    import tensorflow as tf  # noqa: F401 - imported first for the clear error below
except ImportError as _err:  # Keras on JAX/torch without TensorFlow installed
    raise ImportError(
        "normflat's Keras support needs TensorFlow: it analyzes Keras 3 models on Keras' 'tensorflow' "
        "backend. Install tensorflow and set KERAS_BACKEND=tensorflow before importing keras."
    ) from _err

from normflat.backends.keras.distributed import Replicas, StrategyComm, detect_strategy, worker_count
from normflat.backends.keras.layers import KerasWeight, register_layer, registered_layers
from normflat.backends.keras.perturbation import perturbation_model
from normflat.backends.keras.session import BackendConfig, KerasSession
from normflat.core.memory import parse_memory_budget
from normflat.engine import driver
from normflat.engine.options import AnalysisOptions, check_flags
from normflat.engine.registry import warn_user

__all__ = [
    "KerasWeight",
    "register_layer",
    "registered_layers",
    "layer_problems",
    "hessian_diagonal",
    "perturbation_model",
    "BACKEND_OPTIONS",
]

#: The Keras backend's own options (``batch_size`` is a deprecated alias of ``chunk_size``).
BACKEND_OPTIONS = ("layers", "chunk_size", "batch_size", "memory_budget", "max_exact_params", "force", "fast",
                   "distributed")
_DEFAULT_EXACT_MAX_PARAMS = 20_000


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return value


def _config(backend_options: dict[str, Any]) -> BackendConfig:
    """Check the Keras backend options.

    Raises:
        TypeError: For an unknown option or a wrong type.
        ValueError: For out-of-range values or conflicting options.
    """
    unknown = sorted(set(backend_options) - set(BACKEND_OPTIONS))
    if unknown:
        raise TypeError(
            f"Unknown Keras backend option(s) {unknown}; the Keras backend accepts {list(BACKEND_OPTIONS)}."
        )
    check_flags(backend_options)
    chunk_size = backend_options.get("chunk_size")
    if "batch_size" in backend_options:
        warn_user(
            "batch_size is deprecated: a single (x, y) pair is one batch in every framework, and "
            "batch_size now only sets chunk_size, the samples per compiled step (results do not depend "
            "on it). Pass chunk_size=..., or a tf.data.Dataset / list of (x, y) batches.",
            DeprecationWarning,
        )
        if chunk_size is not None:
            raise ValueError("Pass chunk_size only (batch_size is its deprecated alias), not both.")
        chunk_size = backend_options["batch_size"]
    if chunk_size is not None:
        _positive_int("chunk_size", chunk_size)
    memory_budget = parse_memory_budget(backend_options.get("memory_budget"))
    if memory_budget is not None and chunk_size is not None:
        raise ValueError(
            "Pass either chunk_size (samples per step) or memory_budget (the chunk size is then chosen "
            "from it), not both."
        )
    distributed = backend_options.get("distributed")
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True, False or None (automatic), got {distributed!r}.")
    exact_max: float = _positive_int("max_exact_params",
                                     backend_options.get("max_exact_params", _DEFAULT_EXACT_MAX_PARAMS))
    if backend_options.get("force", False):
        exact_max = math.inf
    return BackendConfig(layers=backend_options.get("layers"), chunk_size=chunk_size, memory_budget=memory_budget,
                         max_exact_params=exact_max, fast=backend_options.get("fast", True),
                         distributed=distributed)


def _setup(model: Any, options: AnalysisOptions, backend_options: dict[str, Any], as_tensors: bool):
    config = _config(backend_options)
    strategy = detect_strategy(model, config.distributed) if isinstance(model, keras.layers.Layer) else None
    comm = None
    if strategy is not None and worker_count(strategy) > 1:
        comm = StrategyComm(Replicas(strategy))
    rank = comm.rank if comm is not None else 0

    def make_session() -> KerasSession:
        return KerasSession(model, options, config, strategy=strategy, rank=rank, as_tensors=as_tensors)

    return make_session, comm


def layer_problems(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any):
    """Per-layer problems of a Keras model (backend contract, see ``normflat.backends``).

    Returns:
        ``(problems, metadata)``: one ``LayerProblem`` per analyzed weight tensor in
        model order (float64 numpy arrays, canonical ``(out, in/groups, *k)``
        layout, ``groups`` set for grouped and depthwise convolutions) and the
        engine's metadata (``normflat.engine.METADATA_KEYS``).
    """
    make_session, comm = _setup(model, options, backend_options, as_tensors=False)
    return driver.layer_problems(make_session, data, options, comm)


def hessian_diagonal(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any) -> dict[str, Any]:
    """``{layer name: tf.Tensor}`` of the Hessian (or GGN) diagonal, canonical layout, kernel dtype.

    Only the mean of the group estimates is wanted: ``ggn-mc`` and ``ggn-topk`` keep one sum
    per weight for all their groups (``AnalysisOptions.pooled``), as in every backend.
    """
    options = replace(options, group_estimates=False)
    make_session, comm = _setup(model, options, backend_options, as_tensors=True)
    return driver.hessian_diagonal(make_session, data, options, comm)

