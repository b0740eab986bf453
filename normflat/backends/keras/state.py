"""Record and restore what an analysis touches of the user's Keras model.

The backend never assigns a variable, never changes ``trainable`` and calls the
model with ``training=False`` (no BatchNormalization statistics move). What it
does change, for the duration of one analysis, are a few attributes of single
layer *instances* (never of a class or a module): the taps of the fast GGN path,
a stripped final softmax, the twice-differentiable calls of grouped
convolutions and normalization layers. :class:`ModelState` records each one
before setting it and restores all of them, in reverse order, when the
analysis ends, also after an error or a ``KeyboardInterrupt``.

Two analyses of the *same* model in two threads would see each other's
instance attributes, so an analysis holds a per-model lock: they run one after
the other. Analyses of different models run concurrently.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from normflat.backends.keras import compat

__all__ = ["ModelState", "model_lock"]

_LOCKS_GUARD = threading.Lock()
_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_UNHASHABLE: dict[int, threading.RLock] = {}


def model_lock(model: Any) -> threading.RLock:
    """The lock serializing analyses of ``model`` (re-entrant: the same thread may nest)."""
    with _LOCKS_GUARD:
        try:
            lock = _LOCKS.get(model)
            if lock is None:
                lock = _LOCKS[model] = threading.RLock()
        except TypeError:  # not weak-referenceable: key on the id while it is alive
            lock = _UNHASHABLE.setdefault(id(model), threading.RLock())
        return lock


class ModelState:
    """The instance attributes an analysis set on a model, and the lock it holds.

    Args:
        model: The user's model; its lock is acquired here (blocking) and
            released by :meth:`restore`.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._lock = model_lock(model)
        self._lock.acquire()
        self._held = True
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, attr: str, value: Any) -> None:
        """Set ``obj.attr`` on the instance, remembering its previous instance value."""
        self._saved.append((obj, attr, compat.instance_attr(obj, attr)))
        compat.set_instance_attr(obj, attr, value)

    def restore(self) -> None:
        """Undo every :meth:`set` (last first) and release the model's lock; idempotent."""
        try:
            while self._saved:
                obj, attr, old = self._saved.pop()
                compat.del_instance_attr(obj, attr, old)
        finally:
            if self._held:
                self._held = False
                self._lock.release()
