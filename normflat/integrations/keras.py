"""Keras integration: watch normalized sharpness during ``model.fit``.

Importing this module imports Keras (``import normflat`` and
``import normflat.integrations`` do not). The layer registry
(:class:`~normflat.backends.keras.KerasWeight`,
:func:`~normflat.backends.keras.register_layer`,
:func:`~normflat.backends.keras.registered_layers`) belongs to the Keras backend
and is re-exported here for convenience.

Example:
    >>> from normflat.integrations.keras import SharpnessCallback
    >>> cb = SharpnessCallback((x_train[:512], y_train[:512]), every=2, estimator="ggn")
    >>> history = model.fit(x_train, y_train, epochs=10, callbacks=[cb])
    >>> history.history["normalized_sharpness"]   # NaN on epochs that were not analyzed
"""

from __future__ import annotations

import math
from typing import Any

import keras

import normflat
from normflat.backends.keras import KerasWeight, register_layer, registered_layers
from normflat.core.constants import MEASURES
from normflat.core.report import Report

__all__ = ["SharpnessCallback", "KerasWeight", "register_layer", "registered_layers"]


class SharpnessCallback(keras.callbacks.Callback):
    """Analyze the model at the end of every ``every``-th epoch and log the totals.

    The four totals (``normalized_sharpness``, ``matrix_normalized_sharpness``,
    ``hessian_trace``, ``elementwise_bound``, each with ``prefix`` prepended) are
    written into the epoch's ``logs``, so they appear in ``History.history``,
    in the progress bar and in any later callback (CSVLogger, TensorBoard).
    Epochs that are not analyzed log NaN, keeping one entry per epoch.

    Args:
        data: The data to analyze on (as for :func:`normflat.analyze`): a
            ``tf.data.Dataset``, an ``(x, y)`` pair of arrays or an iterable of
            batches. A fixed subset of the training data keeps it cheap.
        every: Analyze every ``every`` epochs (the last of each period).
        prefix: Prepended to the log keys, e.g. ``"train_"``.
        **analyze_kwargs: Passed to :func:`normflat.analyze` (``loss``,
            ``estimator``, ``max_batches``, ``batch_size``, ...). The progress bar is
            off unless ``progress=True`` is given.

    Attributes:
        reports: ``[(epoch, Report), ...]`` of the analyzed epochs.
    """

    def __init__(self, data: Any, every: int = 1, *, prefix: str = "", **analyze_kwargs: Any):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}.")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}.")
        self.data = data
        self.every = every
        self.prefix = prefix
        self.analyze_kwargs = {"progress": False, **analyze_kwargs}
        self.reports: list[tuple[int, Report]] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Analyze (on scheduled epochs) and record the totals into ``logs``."""
        if logs is None:
            return
        if (epoch + 1) % self.every:
            for name in MEASURES:
                logs[self.prefix + name] = math.nan
            return
        report = normflat.analyze(self.model, self.data, **self.analyze_kwargs)
        self.reports.append((epoch, report))
        for name in MEASURES:
            logs[self.prefix + name] = float(getattr(report, name))
