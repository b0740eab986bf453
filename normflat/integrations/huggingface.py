"""Hugging Face ``transformers``: a ``TrainerCallback`` that logs normalized sharpness.

Importing this module imports ``transformers`` and torch.

A transformers model takes keyword inputs (``input_ids``, ``attention_mask``,
...) and returns a ``ModelOutput``. ``normflat.analyze`` takes such models and
their dict batches directly (``docs/guide/huggingface.md``); the callback
analyzes the model through :class:`HFLogits`, a thin view that shares the
model's submodules (so the layer names are the model's own,
``bert.encoder.layer.0...`` and ``classifier``), calls the model with the
batch's keys and returns ``.logits``, so that every label key of the
``Trainer``'s batches (``label_ids`` too) stays out of the model inputs.
Batches are the ``Trainer``'s: mappings with ``labels`` (or ``label``) and the
model inputs; ``(x, y)`` pairs work too.

Every weight matrix of the common architectures is analyzed (embeddings,
attention projections, GPT-2's ``Conv1D``; see ``docs/guide/huggingface.md``);
a layer normflat cannot analyze is reported once by a warning
(``on_unsupported="skip"`` analyzes the others quietly). Causal language models
have their labels shifted as their own loss does (method §6.3): the torch
backend looks through the view to the model's class.

Example:
    >>> from normflat.integrations.huggingface import SharpnessCallback
    >>> cb = SharpnessCallback(eval_dataset, every_n_steps=50, max_batches=4, on_unsupported="skip")
    >>> trainer = transformers.Trainer(model=model, args=args, train_dataset=train, callbacks=[cb])
    >>> cb.attach(trainer)       # optional: log through trainer.log (TensorBoard, W&B, ...)
    >>> trainer.train()
    >>> cb.history.plot("sharpness.png")
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch
import transformers
from torch import nn

from normflat.integrations.torch import model_device, to_device
from normflat.integrations.tracking import Tracker

__all__ = ["SharpnessCallback", "HFLogits"]

_LABEL_KEYS = ("labels", "label", "label_ids")


class HFLogits(nn.Module):
    """A transformers model seen as ``forward(*inputs) -> logits`` (shares its submodules).

    Args:
        model: The transformers model (any ``nn.Module`` returning an object with
            ``.logits``, a tuple whose first entry is the logits, or the logits).
        keys: The keyword names of the positional inputs, in order (``None``: pass
            them positionally).
    """

    def __init__(self, model: nn.Module, keys: Sequence[str] | None = None) -> None:
        super().__init__()
        # Sharing _modules (not registering `model` as a child) keeps the layer names
        # those of the model itself, without a "model." prefix.
        object.__setattr__(self, "_modules", model._modules)
        object.__setattr__(self, "_inner", model)
        self.keys = None if keys is None else tuple(keys)

    def train(self, mode: bool = True) -> "HFLogits":
        """Switch the model's own flag too (its forward may read ``self.training``)."""
        super().train(mode)
        self._inner.training = mode
        return self

    def forward(self, *inputs: Any) -> torch.Tensor:
        """Logits of the model on the inputs."""
        if self.keys is None:
            out = self._inner(*inputs)
        else:
            out = self._inner(**dict(zip(self.keys, inputs)))
        if hasattr(out, "logits"):
            return out.logits
        if isinstance(out, (tuple, list)):
            return out[0]
        return out


def _split_labels(batch: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    key = next((k for k in _LABEL_KEYS if k in batch), None)
    if key is None:
        raise ValueError(
            f"A batch of the analysis data has keys {sorted(batch)} but no labels; the analysis needs "
            "class labels under 'labels' (as the Trainer's batches have) or (x, y) pairs."
        )
    return {k: v for k, v in batch.items() if k not in _LABEL_KEYS}, batch[key]


class SharpnessCallback(transformers.TrainerCallback):
    """Analyze the model every N epochs or steps of ``Trainer.train`` and log the values.

    Logging: with :meth:`attach` (or ``trainer=``) the values go through
    ``trainer.log``, so they reach ``state.log_history`` and every reporting
    integration (TensorBoard, W&B, ...). Without it they are appended to
    ``state.log_history`` as an entry of their own and added to the ``logs`` of
    the next ``on_log`` call (seen by callbacks after this one).

    The model is analyzed in eval mode and restored exactly (weights, modes,
    gradients, buffers); the global random streams are restored after each
    analysis, so a run with the callback ends bit-identical to one without it.

    Args:
        data: The analysis data: a DataLoader of the Trainer's dict batches, a
            map-style dataset of examples (batched here with ``data_collator``,
            ``batch_size``), a list of batches, or one ``(x, y)`` pair.
        every_n_epochs: Analyze at the end of every N-th epoch.
        every_n_steps: Analyze after every N-th optimizer step
            (``state.global_step``); give one of the two, neither means every epoch.
        max_batches: A fixed subset: the first N batches of ``data``, drawn once.
        log: Totals to log (default all four of :data:`normflat.MEASURES`).
        per_layer: Also log each layer's normalized sharpness.
        prefix: Prepended to the logged keys.
        trainer: The ``Trainer`` to log through (same as :meth:`attach`).
        batch_size: Batch size when ``data`` is a dataset of examples.
        data_collator: Collator when ``data`` is a dataset of examples (default
            ``transformers.default_data_collator``).
        keep_reports: Keep each Report in :attr:`history`.
        **analyze_options: Passed to :func:`normflat.analyze` (``estimator``,
            ``loss``, ``on_unsupported``, ``chunk_size``, ...).
    """

    def __init__(self, data: Any, *, every_n_epochs: int | None = None, every_n_steps: int | None = None,
                 max_batches: int | None = None, log: Sequence[str] | str | None = None, per_layer: bool = False,
                 prefix: str = "", trainer: Any = None, batch_size: int = 32,
                 data_collator: Callable[[list], Any] | None = None, keep_reports: bool = True,
                 **analyze_options: Any) -> None:
        if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
            # The Trainer's eval_dataset: single examples, batched here in order.
            data = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False,
                                               collate_fn=data_collator or transformers.default_data_collator)
        self.tracker = Tracker(data, every_n_epochs=every_n_epochs, every_n_steps=every_n_steps,
                               max_batches=max_batches, log=log, per_layer=per_layer, prefix=prefix,
                               keep_reports=keep_reports, **analyze_options)
        self.trainer = trainer
        self._pending: dict[str, float] = {}

    @property
    def history(self) -> Any:
        """The analyses so far (a :class:`~normflat.integrations.history.TrackingHistory`)."""
        return self.tracker.history

    def attach(self, trainer: Any) -> "SharpnessCallback":
        """Add this callback to ``trainer`` (if not there yet) and log through ``trainer.log``."""
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    # ------------------------------------------------------------------ hooks

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Analyze after every N-th optimizer step (``every_n_steps``)."""
        if self.tracker.by_steps and self.tracker.due_step(int(state.global_step)):
            epoch = max(math.ceil(state.epoch or 0.0) - 1, 0)
            self._analyze(kwargs["model"], state, epoch)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Analyze after every N-th epoch (``every_n_epochs``)."""
        epoch = max(int(round(state.epoch or 0.0)) - 1, 0)
        if not self.tracker.by_steps and self.tracker.due_epoch(epoch):
            self._analyze(kwargs["model"], state, epoch)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Add the values of an analysis not yet logged to ``logs`` (for later callbacks)."""
        if logs is not None and self._pending:
            logs.update(self._pending)
            self._pending = {}

    # ------------------------------------------------------------------ analysis

    def _analyze(self, model: nn.Module, state: Any, epoch: int) -> None:
        view = HFLogits(model)
        device = model_device(model)
        root_training = model.training

        def to_batch(batch: Any) -> Any:
            if isinstance(batch, Mapping) and not ("x" in batch and "y" in batch):
                inputs, labels = _split_labels(batch)
                keys = tuple(sorted(inputs))
                if view.keys is None:
                    view.keys = keys
                elif view.keys != keys:
                    raise ValueError(f"The analysis batches have different keys: {list(view.keys)} and "
                                     f"{list(keys)}; every batch needs the same model inputs.")
                batch = (tuple(inputs[k] for k in keys), labels)
            return batch if device is None else to_device(batch, device)

        try:
            metrics = self.tracker.run(view, step=int(state.global_step), epoch=epoch, transform=to_batch)
        finally:
            model.training = root_training  # the view's train() set it; the backend restores the rest
        if self.trainer is not None:
            self.trainer.log(dict(metrics))
        else:
            state.log_history.append({**metrics, "epoch": state.epoch, "step": int(state.global_step)})
            self._pending.update(metrics)
