"""A small thread-safe LRU mapping for the backend's caches (traces, compiled kernels).

Two analyses may run in two threads at once; the caches are shared, so every
look-up, insertion and eviction holds one lock (a plain dict's ``pop(next(iter(d)))``
eviction can fail while another thread inserts).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable

__all__ = ["LRU"]

_MISSING = object()


class LRU:
    """``get``/``put`` with least-recently-used eviction beyond ``size`` entries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value of ``key`` (marked recently used), or ``default``; unhashable keys miss."""
        with self._lock:
            try:
                value = self._data.get(key, _MISSING)
            except TypeError:
                return default
            if value is _MISSING:
                return default
            self._data.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value`` (unhashable keys are not stored)."""
        with self._lock:
            try:
                self._data[key] = value
            except TypeError:
                return
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
