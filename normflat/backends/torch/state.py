"""Record and restore everything of the user's model that an analysis touches.

An analysis puts the model in ``eval()`` mode, sets ``requires_grad`` on the
weights of the fast GGN path (so that the layer outputs carry gradients for the
signals) and registers forward hooks; BatchNorm buffers are never updated in
eval mode, but are compared and restored anyway. :class:`ModelState` records all
of it and restores it in :meth:`ModelState.restore`, which the engine's driver
calls through ``Session.close()`` also after an error or a ``KeyboardInterrupt``.

The global RNG is neither read nor restored: normflat draws from
:mod:`normflat.engine.random` only.

Two analyses of the *same* module object cannot run at once (they would flip
each other's modes and flags); :func:`claim` refuses the second with a clear
error instead. Different modules (``copy.deepcopy(model)``) analyze concurrently.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

__all__ = ["ModelState", "claim", "release"]

_LOCK = threading.Lock()
_BUSY: set[int] = set()


def claim(model: nn.Module) -> None:
    """Mark ``model`` as under analysis.

    Raises:
        RuntimeError: If another analysis of the same module object is running.
    """
    with _LOCK:
        if id(model) in _BUSY:
            raise RuntimeError(
                "normflat is already analyzing this model object (in another thread): an analysis "
                "switches the model to eval mode and sets requires_grad temporarily, so two at once "
                "would interfere. Analyze a copy (copy.deepcopy(model)) in the other thread."
            )
        _BUSY.add(id(model))


def release(model: nn.Module) -> None:
    """Undo :func:`claim`."""
    with _LOCK:
        _BUSY.discard(id(model))


class ModelState:
    """Train/eval modes, ``requires_grad``, ``.grad`` and buffers of a module, and hooks to remove."""

    def __init__(self, model: nn.Module) -> None:
        self.modes = [(m, m.training) for m in model.modules()]
        self.params = [(p, p.requires_grad, p.grad) for p in model.parameters()]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.handles: list[Any] = []

    def restore(self) -> None:
        """Put everything back (idempotent)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for m, mode in self.modes:
            if m.training != mode:
                m.training = mode
        for p, req, g in self.params:
            if p.requires_grad != req:
                p.requires_grad_(req)
            if p.grad is not g:
                p.grad = g
        with torch.no_grad():
            for b, saved in self.buffers:
                if b.shape != saved.shape or not torch.equal(b, saved):
                    b.copy_(saved)
