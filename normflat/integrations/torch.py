"""Plain PyTorch: track normalized sharpness in a hand-written training loop.

Importing this module imports torch. Lightning and Hugging Face users have
callbacks of their own (:mod:`normflat.integrations.lightning`,
:mod:`normflat.integrations.huggingface`).

Example:
    >>> from normflat.integrations.torch import SharpnessTracker
    >>> tracker = SharpnessTracker(val_loader, every_n_steps=100, max_batches=4)
    >>> step = 0
    >>> for epoch in range(epochs):
    ...     for x, y in train_loader:
    ...         loss = loss_fn(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
    ...         step += 1
    ...         tracker.step(model, step, epoch=epoch)
    ...     tracker.epoch_end(model, epoch)      # does nothing with every_n_steps
    >>> tracker.history.plot("sharpness.png")
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from normflat.integrations.tracking import LoopTracker

__all__ = ["SharpnessTracker", "to_device"]


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor (in tuples, lists and dicts) moved to ``device``.

    The torch backend refuses data on another device than the model rather than
    copying it silently; a tracker knows the model's device and moves the batches.
    """
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(to_device(v, device) for v in batch)
    if isinstance(batch, list):
        return [to_device(v, device) for v in batch]
    return batch


def model_device(model: torch.nn.Module) -> torch.device | None:
    """The device of the model's first parameter (``None`` for a model without any)."""
    for p in model.parameters():
        return p.device
    return None


def device_transform(model: torch.nn.Module) -> Callable[[Any], Any] | None:
    """A batch transform moving tensors onto the model's device, or ``None`` on CPU."""
    device = model_device(model)
    if device is None or device.type == "cpu":
        return None
    return lambda batch: to_device(batch, device)


class SharpnessTracker(LoopTracker):
    """Analyze a torch model every N steps or epochs of a hand-written loop.

    Call :meth:`step` after each optimizer step and :meth:`epoch_end` after each
    epoch; the tracker decides whether an analysis is due. The model is analyzed
    in eval mode and put back exactly as it was (weights, train/eval modes,
    gradients, buffers); the global random streams (torch, NumPy, Python) are
    restored after each analysis, so the loop continues as if the tracker were
    not there.

    Args:
        data: The analysis data: a DataLoader, a list of ``(x, y)`` batches or one
            ``(x, y)`` pair. Batches are moved to the model's device.
        every_n_epochs: Analyze after every N-th epoch.
        every_n_steps: Analyze after every N-th optimizer step (give one of the two;
            neither means every epoch).
        max_batches: Analyze on a fixed subset: the first N batches, drawn once.
        log: Totals to log (default all four of :data:`normflat.MEASURES`).
        per_layer: Also log each layer's normalized sharpness.
        prefix: Prepended to the logged keys.
        logger: ``logger(metrics: dict, step: int)`` called after every analysis
            (e.g. ``lambda m, s: writer.add_scalars("sharpness", m, s)`` for a
            TensorBoard ``SummaryWriter``, or ``wandb.log``-style adapters).
        keep_reports: Keep each Report in :attr:`history`.
        **analyze_options: Passed to :func:`normflat.analyze` (``estimator``,
            ``loss``, ``samples``, ``on_unsupported``, ``chunk_size``, ...).

    Attributes:
        history: A :class:`~normflat.integrations.history.TrackingHistory`.
    """

    def step(self, model: torch.nn.Module, step: int | None = None, *, epoch: int | None = None) -> dict | None:
        """Call after an optimizer step; analyzes when a step-scheduled analysis is due.

        Args:
            model: The model being trained.
            step: Optimizer steps done so far (1 after the first step). Default: the
                tracker counts the calls.
            epoch: The current zero-based epoch, recorded in the history.

        Returns:
            The logged values when the model was analyzed, else ``None``.
        """
        self._steps = self._steps + 1 if step is None else int(step)
        if not self.tracker.due_step(self._steps):
            return None
        return self._run(model, self._steps, epoch)

    def epoch_end(self, model: torch.nn.Module, epoch: int) -> dict | None:
        """Call after epoch ``epoch`` (zero-based); analyzes when an epoch-scheduled analysis is due."""
        if not self.tracker.due_epoch(int(epoch)):
            return None
        return self._run(model, self._steps, int(epoch))

    def analyze_now(self, model: torch.nn.Module, *, step: int | None = None, epoch: int | None = None) -> dict:
        """Analyze now, whatever the schedule (e.g. before the first step), and log."""
        return self._run(model, self._steps if step is None else int(step), epoch)

    def _run(self, model: torch.nn.Module, step: int, epoch: int | None) -> dict:
        metrics = self.tracker.run(model, step=step, epoch=epoch, transform=device_transform(model))
        if self.logger is not None:
            self.logger(dict(metrics), step)
        return metrics
