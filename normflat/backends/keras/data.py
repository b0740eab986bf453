"""The engine's data contract for Keras / TensorFlow arrays and datasets.

Everything about what the data may be (pairs, batches, one-hot labels, empty
and infinite data, ``max_batches``) is decided in :mod:`normflat.engine.data`;
this adapter only tells the engine how to read TensorFlow tensors, numpy
arrays and ``tf.data`` datasets.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import tensorflow as tf

import keras

from normflat.engine.data import INFINITE

__all__ = ["KerasDataAdapter", "ADAPTER", "to_tensor"]


def _is_keras_variable(a: Any) -> bool:
    return isinstance(a, keras.Variable)


class KerasDataAdapter:
    """:class:`normflat.engine.data.DataAdapter` for TensorFlow tensors, numpy arrays and ``tf.data``."""

    framework = "keras"

    def is_array(self, a: Any) -> bool:
        return isinstance(a, (np.ndarray, tf.Tensor, tf.Variable)) or _is_keras_variable(a)

    def shape(self, a: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in a.shape)

    def kind(self, a: Any) -> str:
        dtype = a.dtype if isinstance(a, np.ndarray) else tf.as_dtype(a.dtype)
        if isinstance(dtype, tf.DType):
            if dtype.is_floating:
                return "f"
            if dtype.is_integer:
                return "i"
            if dtype.is_bool:
                return "b"
            if dtype.is_complex:
                return "c"
            return "?"
        kind = np.dtype(dtype).kind
        return {"f": "f", "i": "i", "u": "i", "b": "b", "c": "c"}.get(kind, "?")

    def to_numpy(self, a: Any) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        return np.asarray(a.numpy() if hasattr(a, "numpy") else a)

    def all_finite(self, a: Any) -> bool:
        if isinstance(a, np.ndarray):
            return bool(np.all(np.isfinite(a)))
        return bool(tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(a))))

    def cardinality(self, data: Any) -> Any:
        if isinstance(data, tf.data.Dataset):
            card = int(data.cardinality())
            if card == int(tf.data.INFINITE_CARDINALITY):
                return INFINITE
            return card if card >= 0 else None  # UNKNOWN_CARDINALITY (e.g. after .filter)
        try:
            return len(data)
        except TypeError:
            return None

    def reject(self, data: Any) -> str | None:
        if isinstance(data, (tf.distribute.DistributedDataset, tf.distribute.DistributedIterator)):
            return (
                "data is a distributed dataset (strategy.experimental_distribute_dataset); pass the plain "
                "tf.data.Dataset instead: normflat deals each batch to the strategy's replicas itself."
            )
        return None

    def iterate(self, data: Any) -> Iterable[Any]:
        return data


#: The one adapter instance (stateless).
ADAPTER = KerasDataAdapter()


def to_tensor(x: Any) -> Any:
    """Inputs (array or tuple/list/dict of arrays) as TensorFlow tensors, structure kept."""
    if isinstance(x, dict):
        return {k: to_tensor(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_tensor(v) for v in x)
    if _is_keras_variable(x):
        return tf.convert_to_tensor(x.value)
    return tf.convert_to_tensor(x)
