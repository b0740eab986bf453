"""Record and restore of the user's model state.

JAX arrays are immutable and normflat never assigns into the user's objects:
equinox modules and linen variables are pytrees that are only read, and an nnx
module is analyzed through a private copy (:mod:`~normflat.backends.jax.layers`).
The only mutable model kind is the nnx module; :class:`ModelState` records its
state (references to its arrays, no copy) and puts it back if anything replaced
an array meanwhile, also after an error or a ``KeyboardInterrupt``.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

__all__ = ["ModelState"]


class ModelState:
    """The state of the user's model at the start of an analysis.

    Args:
        model: The user's model.
        states: For an nnx module, the ``nnx.State`` objects that the model view
            split off it (no second traversal of the module graph).
    """

    def __init__(self, model: Any, states: tuple = ()) -> None:
        nnx = sys.modules.get("flax.nnx")
        self._model = model if nnx is not None and isinstance(model, nnx.Module) and states else None
        self._states = states
        self._ids = {id(a) for s in states for a in jax.tree_util.tree_leaves(s)}

    def restore(self) -> None:
        """Put back every array of an nnx module that was replaced (a no-op otherwise)."""
        if self._model is None:
            return
        from flax import nnx

        now = {id(a) for a in jax.tree_util.tree_leaves(nnx.state(self._model))}
        if now != self._ids:
            nnx.update(self._model, *self._states)
