"""Framework-free orchestration between the core and the framework backends.

One engine under three symmetric backends (method §9):

:mod:`~normflat.engine.options`
    the validated options every framework receives;
:mod:`~normflat.engine.data`
    the data contract: pairs, batches, labels, one-hot rows, empty and infinite data;
:mod:`~normflat.engine.driver`
    the one analysis loop (progress, distributed steps, reduction, restore);
:mod:`~normflat.engine.estimators`
    the ``(init, update, finalize)`` estimator state over per-layer sums;
:mod:`~normflat.engine.problems`
    the one place that builds every ``LayerProblem`` and the report metadata;
:mod:`~normflat.engine.distributed`
    the failure-agreement and reduction protocol over a small ``Comm`` interface;
:mod:`~normflat.engine.losses`
    normalized softmax cross-entropy, GGN factor and Monte-Carlo signals, written
    once against an array namespace;
:mod:`~normflat.engine.random`
    normflat's own counter-based randomness (never a framework's global RNG);
:mod:`~normflat.engine.registry`
    the ``{layer type: extractor}`` registry model and the skipped-layer report.

Nothing here imports a deep-learning framework.
"""

from normflat.engine.data import INFINITE, Batch, DataAdapter, EmptyDataError
from normflat.engine.distributed import Comm
from normflat.engine.driver import Session, hessian_diagonal, layer_problems, run
from normflat.engine.options import AnalysisOptions, validate_options
from normflat.engine.problems import DETAIL_KEYS, METADATA_KEYS, LayerSpec
from normflat.engine.registry import IGNORE, LayerRegistry, Skipped, Unsupported, warn_user

__all__ = [
    "AnalysisOptions", "Batch", "Comm", "DataAdapter", "DETAIL_KEYS", "EmptyDataError", "IGNORE", "INFINITE",
    "LayerRegistry", "LayerSpec", "METADATA_KEYS", "Session", "Skipped", "Unsupported", "hessian_diagonal",
    "layer_problems", "run", "validate_options", "warn_user",
]
