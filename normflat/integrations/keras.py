"""Keras integration: watch normalized sharpness during ``model.fit``.

Importing this module imports Keras (``import normflat`` and
``import normflat.integrations`` do not). The layer registry
(:class:`~normflat.backends.keras.KerasWeight`,
:func:`~normflat.backends.keras.register_layer`,
:func:`~normflat.backends.keras.registered_layers`) belongs to the Keras backend
and is re-exported here for convenience.

Example:
    >>> from normflat.integrations.keras import SharpnessCallback
    >>> cb = SharpnessCallback((x_train[:512], y_train[:512]), every_n_epochs=2, estimator="ggn")
    >>> history = model.fit(x_train, y_train, epochs=10, callbacks=[cb])
    >>> history.history["normalized_sharpness"]   # NaN on epochs that were not analyzed
    >>> cb.history.plot("sharpness.png")
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras

from normflat.backends.keras import KerasWeight, register_layer, registered_layers
from normflat.core.report import Report
from normflat.integrations.tracking import Tracker

__all__ = ["SharpnessCallback", "KerasWeight", "register_layer", "registered_layers"]


class SharpnessCallback(keras.callbacks.Callback):
    """Analyze the model every N epochs or steps of ``fit`` and log into Keras' ``logs``.

    The chosen totals (default all four: ``normalized_sharpness``,
    ``matrix_normalized_sharpness``, ``hessian_trace``, ``elementwise_bound``, each
    with ``prefix`` prepended) are written into the epoch's ``logs``, so they
    appear in ``History.history``, in the progress bar and in any later callback
    (``CSVLogger``, ``TensorBoard``). Epochs without an analysis log NaN, keeping
    one entry per epoch; with ``every_n_steps`` the values are also written into
    the batch ``logs`` of the analyzed step, and an epoch logs its last analysis.

    The model is analyzed without training it (weights, optimizer state,
    non-trainable variables untouched) and the global random streams are restored
    after each analysis, so ``fit`` ends bit-identical to a run without the callback.

    Args:
        data: The data to analyze on (as for :func:`normflat.analyze`): a
            ``tf.data.Dataset``, an ``(x, y)`` pair of arrays or an iterable of
            batches. A fixed subset of the training data keeps it cheap.
        every: Old name of ``every_n_epochs`` (kept for existing code).
        every_n_epochs: Analyze at the end of every N-th epoch.
        every_n_steps: Analyze after every N-th optimizer step (give one of the two;
            neither means every epoch).
        max_batches: A fixed subset: the first N batches of ``data``, drawn once.
        log: Totals to log (default all four of :data:`normflat.MEASURES`).
        per_layer: Also log each layer's normalized sharpness
            (``normalized_sharpness/<layer>``).
        prefix: Prepended to the log keys, e.g. ``"train_"``.
        logger: ``logger(metrics, step)`` called after every analysis as well.
        keep_reports: Keep each Report in :attr:`history`.
        **analyze_kwargs: Passed to :func:`normflat.analyze` (``loss``,
            ``estimator``, ``batch_size``, ``chunk_size``, ...). The progress bar is
            off unless ``progress=True`` is given.

    Attributes:
        history: The :class:`~normflat.integrations.history.TrackingHistory` of the
            analyses (not Keras' ``History``, which the values also reach).
    """

    def __init__(self, data: Any, every: int | None = None, *, every_n_epochs: int | None = None,
                 every_n_steps: int | None = None, max_batches: int | None = None,
                 log: Sequence[str] | str | None = None, per_layer: bool = False, prefix: str = "",
                 logger: Callable[[dict[str, float], int], Any] | None = None, keep_reports: bool = True,
                 **analyze_kwargs: Any):
        super().__init__()
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ValueError(f"every must be a positive int, got {every!r}.")
            if every_n_epochs is not None and every_n_epochs != every:
                raise ValueError("every is the old name of every_n_epochs; give one of them.")
            every_n_epochs = every
        if logger is not None and not callable(logger):
            raise TypeError(f"logger must be a callable logger(metrics, step), got {type(logger).__name__}.")
        self.tracker = Tracker(data, every_n_epochs=every_n_epochs, every_n_steps=every_n_steps,
                               max_batches=max_batches, log=log, per_layer=per_layer, prefix=prefix,
                               keep_reports=keep_reports, **analyze_kwargs)
        self.logger = logger
        self._steps = 0
        self._epoch = 0
        self._epoch_metrics: dict[str, float] | None = None

    # Old attribute names, read by existing code.
    @property
    def data(self) -> Any:
        return self.tracker.data

    @property
    def every(self) -> int | None:
        return self.tracker.every_n_epochs

    @property
    def prefix(self) -> str:
        return self.tracker.prefix

    @property
    def analyze_kwargs(self) -> dict[str, Any]:
        return self.tracker.analyze_options

    @property
    def history(self) -> Any:
        """The analyses so far (a :class:`~normflat.integrations.history.TrackingHistory`)."""
        return self.tracker.history

    @property
    def reports(self) -> list[tuple[int, Report]]:
        """``[(epoch, Report), ...]`` of the analyses whose report was kept."""
        return [(e.epoch, e.report) for e in self.tracker.history if e.report is not None]

    # ------------------------------------------------------------------ hooks

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = int(epoch)
        self._epoch_metrics = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Count optimizer steps; analyze after every N-th (``every_n_steps``)."""
        self._steps = self._optimizer_steps()
        if self.tracker.by_steps and self.tracker.due_step(self._steps):
            metrics = self._run()
            self._epoch_metrics = metrics
            if logs is not None:
                logs.update(metrics)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Analyze (on scheduled epochs) and record the values into ``logs``."""
        self._epoch = int(epoch)
        if self.tracker.by_steps:
            metrics = self._epoch_metrics
        elif self.tracker.due_epoch(int(epoch)):
            metrics = self._run()
        else:
            metrics = None
        if logs is not None:
            logs.update(self.tracker.nan_metrics() if metrics is None else metrics)

    # ------------------------------------------------------------------ helpers

    def _optimizer_steps(self) -> int:
        # optimizer.iterations counts the real steps, also with steps_per_execution > 1,
        # where the batch hook runs once per k steps.
        optimizer = getattr(self.model, "optimizer", None)
        iterations = getattr(optimizer, "iterations", None)
        if iterations is not None:
            try:
                return int(keras.ops.convert_to_numpy(iterations))
            except Exception:  # an optimizer without a readable counter: count the hooks
                pass
        return self._steps + 1

    def _run(self) -> dict[str, float]:
        metrics = self.tracker.run(self.model, step=self._steps, epoch=self._epoch)
        if self.logger is not None:
            self.logger(dict(metrics), self._steps)
        return metrics
