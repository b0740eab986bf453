"""PyTorch Lightning: a ``Callback`` that logs normalized sharpness during ``Trainer.fit``.

Importing this module imports ``lightning`` (the unified package). For the
standalone ``pytorch_lightning`` package, import
:class:`normflat.integrations.lightning.PLSharpnessCallback` instead: the same
callback, subclassing ``pytorch_lightning.Callback`` (a Lightning ``Trainer``
accepts only callbacks of its own package).

Example:
    >>> from normflat.integrations.lightning import SharpnessCallback
    >>> cb = SharpnessCallback(val_loader, every_n_epochs=1, max_batches=4, log=("normalized_sharpness",))
    >>> trainer = lightning.pytorch.Trainer(max_epochs=10, callbacks=[cb])
    >>> trainer.fit(module, train_loader)
    >>> cb.history.plot("sharpness.png")
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import lightning.pytorch as pl
import torch

from normflat.integrations.torch import device_transform
from normflat.integrations.tracking import Tracker

__all__ = ["SharpnessCallback", "PLSharpnessCallback"]


class _Mixin:
    """The callback's behaviour, shared by the ``lightning`` and ``pytorch_lightning`` classes."""

    def __init__(self, data: Any, *, every_n_epochs: int | None = None, every_n_steps: int | None = None,
                 max_batches: int | None = None, log: Sequence[str] | str | None = None, per_layer: bool = False,
                 prefix: str = "", module: str | Callable[[Any], torch.nn.Module] | None = None,
                 prog_bar: bool = False, keep_reports: bool = True, **analyze_options: Any) -> None:
        super().__init__()
        if module is not None and not (isinstance(module, str) or callable(module)):
            raise TypeError("module must be an attribute name of the LightningModule (e.g. 'net') or a callable "
                            f"pl_module -> nn.Module, got {type(module).__name__}.")
        self.tracker = Tracker(data, every_n_epochs=every_n_epochs, every_n_steps=every_n_steps,
                               max_batches=max_batches, log=log, per_layer=per_layer, prefix=prefix,
                               keep_reports=keep_reports, **analyze_options)
        self.module = module
        self.prog_bar = bool(prog_bar)

    @property
    def history(self) -> Any:
        """The analyses so far (a :class:`~normflat.integrations.history.TrackingHistory`)."""
        return self.tracker.history

    def _target(self, pl_module: Any) -> torch.nn.Module:
        if self.module is None:
            return pl_module
        if isinstance(self.module, str):
            try:
                return getattr(pl_module, self.module)
            except AttributeError:
                raise AttributeError(f"SharpnessCallback(module={self.module!r}): the LightningModule "
                                     f"{type(pl_module).__name__} has no attribute {self.module!r}.") from None
        return self.module(pl_module)

    def _analyze(self, trainer: Any, pl_module: Any, *, on_step: bool) -> None:
        model = self._target(pl_module)
        metrics = self.tracker.run(model, step=int(trainer.global_step), epoch=int(trainer.current_epoch),
                                   transform=device_transform(model))
        # batch_size=1: the values are not per-batch means, so Lightning must not try
        # to infer a batch size (it warns) nor weight an epoch aggregate by one.
        # Step-level values of self.log reach the loggers only on steps that are a
        # multiple of Trainer(log_every_n_steps); an analysis is rare and costly, so
        # its values are written to the loggers directly at its own step instead.
        pl_module.log_dict(metrics, on_step=on_step, on_epoch=not on_step, prog_bar=self.prog_bar,
                           logger=not on_step, batch_size=1)
        if on_step:
            for logger in trainer.loggers:
                logger.log_metrics(dict(metrics), step=int(trainer.global_step))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Analyze after every N-th optimizer step (``every_n_steps``)."""
        if self.tracker.by_steps and self.tracker.due_step(int(trainer.global_step)):
            self._analyze(trainer, pl_module, on_step=True)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Analyze after every N-th epoch (``every_n_epochs``)."""
        if not self.tracker.by_steps and self.tracker.due_epoch(int(trainer.current_epoch)):
            self._analyze(trainer, pl_module, on_step=False)

    def state_dict(self) -> dict[str, Any]:
        """Lightning checkpoints the callback's history (totals and per-layer values)."""
        return {"records": self.history.to_records()}


class SharpnessCallback(_Mixin, pl.Callback):
    """Analyze the model every N epochs or steps and log with ``pl_module.log_dict``.

    The logged values reach every logger of the ``Trainer`` (TensorBoard, CSV,
    W&B, ...) and ``trainer.callback_metrics``. The model is analyzed in eval
    mode and restored exactly (weights, modes, gradients, buffers); the global
    random streams are restored after each analysis, so a run with the callback
    ends bit-identical to one without it.

    Args:
        data: The analysis data: a DataLoader (e.g. a validation loader), a list
            of ``(x, y)`` batches or one ``(x, y)`` pair; moved to the model's device.
        every_n_epochs: Analyze at the end of every N-th training epoch.
        every_n_steps: Analyze after every N-th optimizer step (``trainer.global_step``);
            give one of the two, neither means every epoch.
        max_batches: A fixed subset: the first N batches of ``data``, drawn once.
        log: Totals to log (default all four of :data:`normflat.MEASURES`).
        per_layer: Also log each layer's normalized sharpness
            (``normalized_sharpness/<layer>``).
        prefix: Prepended to the logged keys (e.g. ``"val_"``).
        module: What to analyze: ``None`` (the LightningModule, whose ``forward``
            must return logits), an attribute name (``"net"``) or a callable
            ``pl_module -> nn.Module``.
        prog_bar: Show the values in the progress bar.
        keep_reports: Keep each Report in :attr:`history`.
        **analyze_options: Passed to :func:`normflat.analyze` (``estimator``,
            ``loss``, ``on_unsupported``, ``chunk_size``, ...).
    """


def _pl_class() -> Any:
    try:
        import pytorch_lightning
    except ImportError:
        return None

    class PLSharpnessCallback(_Mixin, pytorch_lightning.Callback):
        __doc__ = ("The same callback as :class:`SharpnessCallback`, for ``pytorch_lightning.Trainer`` "
                   "(the standalone package).")

    PLSharpnessCallback.__module__ = __name__
    return PLSharpnessCallback


def __getattr__(name: str) -> Any:
    # PLSharpnessCallback imports pytorch_lightning only when asked for.
    if name == "PLSharpnessCallback":
        cls = _pl_class()
        if cls is None:
            raise ImportError("PLSharpnessCallback needs the pytorch_lightning package (pip install "
                              "pytorch-lightning); with the unified `lightning` package use SharpnessCallback.")
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
