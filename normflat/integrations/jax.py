"""JAX: track normalized sharpness in an optax training loop (flax nnx, flax linen, equinox).

Importing this module imports JAX (not flax or equinox: the model decides which
backend path runs). JAX training loops are written by hand, so the helper has
the plain-PyTorch tracker's shape: call :meth:`SharpnessTracker.step` after each
optimizer update and :meth:`SharpnessTracker.epoch_end` after each epoch.

The model is passed at each call, as the loop holds it:

* flax nnx: the module (``tracker.step(model, step)``); it is analyzed in eval
  mode and its state, ``nnx.Rngs`` counters included, is left as it was;
* equinox: the module, and ``state=`` for a stateful model (BatchNorm);
* flax linen: the module and its parameters, passed explicitly:
  ``tracker.step(module, step, params=params)`` (a ``{"params": ...}`` variables
  dict or the bare parameter tree; ``variables=`` for BatchNorm statistics);
* any ``(apply_fn, params)`` pair, as :func:`normflat.analyze` takes it.

Example (equinox with optax):
    >>> tracker = SharpnessTracker((x_val, y_val), every_n_steps=50)
    >>> for step in range(1, steps + 1):
    ...     model, opt_state = train_step(model, opt_state, next(batches))
    ...     tracker.step(model, step)
    >>> tracker.history.plot("sharpness.png")
"""

from __future__ import annotations

from typing import Any, Mapping

import jax  # noqa: F401  # the helper is for JAX loops: fail early and clearly without JAX

from normflat.integrations.tracking import LoopTracker

__all__ = ["SharpnessTracker"]


class SharpnessTracker(LoopTracker):
    """Analyze a JAX model every N optimizer steps or epochs of an optax loop.

    Args:
        data: The analysis data: an ``(x, y)`` pair of arrays, a list of batches or
            any iterable of batches (numpy or JAX arrays).
        every_n_epochs: Analyze after every N-th epoch.
        every_n_steps: Analyze after every N-th optimizer step (give one of the two;
            neither means every epoch).
        max_batches: A fixed subset: the first N batches of ``data``, drawn once.
        log: Totals to log (default all four of :data:`normflat.MEASURES`).
        per_layer: Also log each layer's normalized sharpness.
        prefix: Prepended to the logged keys.
        logger: ``logger(metrics: dict, step: int)`` called after every analysis
            (TensorBoard writers, ``wandb.log`` adapters, ``print``...).
        keep_reports: Keep each Report in :attr:`history`.
        **analyze_options: Passed to :func:`normflat.analyze` (``estimator``,
            ``loss``, ``samples``, ``seed``, ``chunk_size``, ``vmap``, ``dtype``, ...).

    Attributes:
        history: A :class:`~normflat.integrations.history.TrackingHistory`.
    """

    def step(self, model: Any, step: int | None = None, *, epoch: int | None = None, params: Any = None,
             variables: Any = None, **call_options: Any) -> dict | None:
        """Call after an optimizer update; analyzes when a step-scheduled analysis is due.

        Args:
            model: The nnx / equinox module, a linen module (with ``params`` or
                ``variables``), or an ``(apply_fn, params)`` pair.
            step: Optimizer steps done so far (1 after the first update). Default:
                the tracker counts the calls.
            epoch: The current zero-based epoch, recorded in the history.
            params: A linen module's parameters (the ``"params"`` collection).
            variables: A linen module's full variables (``{"params": ..., "batch_stats": ...}``).
            **call_options: Per-call :func:`normflat.analyze` options, e.g. the
                equinox ``state=``.

        Returns:
            The logged values when the model was analyzed, else ``None``.
        """
        self._steps = self._steps + 1 if step is None else int(step)
        if not self.tracker.due_step(self._steps):
            return None
        return self._run(model, self._steps, epoch, params, variables, call_options)

    def epoch_end(self, model: Any, epoch: int, *, params: Any = None, variables: Any = None,
                  **call_options: Any) -> dict | None:
        """Call after epoch ``epoch`` (zero-based); analyzes when an epoch-scheduled analysis is due."""
        if not self.tracker.due_epoch(int(epoch)):
            return None
        return self._run(model, self._steps, int(epoch), params, variables, call_options)

    def analyze_now(self, model: Any, *, step: int | None = None, epoch: int | None = None, params: Any = None,
                    variables: Any = None, **call_options: Any) -> dict:
        """Analyze now, whatever the schedule (e.g. at initialization), and log."""
        return self._run(model, self._steps if step is None else int(step), epoch, params, variables, call_options)

    def _run(self, model: Any, step: int, epoch: int | None, params: Any, variables: Any,
             call_options: dict[str, Any]) -> dict:
        target = _model_of(model, params, variables)
        tracker = self.tracker
        if call_options:
            saved = tracker.analyze_options
            tracker.analyze_options = {**saved, **call_options}
            try:
                metrics = tracker.run(target, step=step, epoch=epoch)
            finally:
                tracker.analyze_options = saved
        else:
            metrics = tracker.run(target, step=step, epoch=epoch)
        if self.logger is not None:
            self.logger(dict(metrics), step)
        return metrics


def _model_of(model: Any, params: Any, variables: Any) -> Any:
    """What :func:`normflat.analyze` takes: the module, or ``(linen module, variables)``."""
    if params is not None and variables is not None:
        raise TypeError("Give params= (the parameter tree) or variables= (all collections), not both.")
    if variables is not None:
        return (model, variables)
    if params is not None:
        is_variables = isinstance(params, Mapping) and "params" in params
        return (model, params if is_variables else {"params": params})
    return model
