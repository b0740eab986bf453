"""A tiny array namespace over TensorFlow for :mod:`normflat.engine.losses`.

The engine's losses are written once against an array namespace; ``keras.ops``
lacks a few of its names (``astype``, ``permute_dims``) and adds a conversion
layer inside compiled graphs, so the Keras backend passes this adapter over
plain TensorFlow ops. It works eagerly and inside ``tf.function``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["TF"]


class _TensorFlowNamespace:
    """The subset of the array API that :func:`normflat.engine.losses.namespace_check` asks for."""

    float64 = tf.float64
    float32 = tf.float32
    int64 = tf.int64

    @staticmethod
    def argmax(x: Any, axis: int = -1) -> Any:
        return tf.argmax(x, axis=axis)

    @staticmethod
    def take(x: Any, indices: Any, axis: int = 0) -> Any:
        return tf.gather(x, indices, axis=axis)

    @staticmethod
    def mean(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        return tf.reduce_mean(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        return tf.reduce_sum(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def max(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        return tf.reduce_max(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def min(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        return tf.reduce_min(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def all(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        return tf.reduce_all(x, axis=axis, keepdims=keepdims)

    abs = staticmethod(tf.abs)
    sqrt = staticmethod(tf.sqrt)
    exp = staticmethod(tf.exp)
    log = staticmethod(tf.math.log)
    isfinite = staticmethod(tf.math.is_finite)
    zeros_like = staticmethod(tf.zeros_like)
    ones_like = staticmethod(tf.ones_like)

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return tf.where(cond, a, b)

    @staticmethod
    def arange(n: int, device: Any = None) -> Any:  # device: placement follows TF's own rules
        return tf.range(n)

    @staticmethod
    def astype(x: Any, dtype: Any) -> Any:
        return tf.cast(x, dtype)

    @staticmethod
    def stack(arrays: Any, axis: int = 0) -> Any:
        return tf.stack(list(arrays), axis=axis)

    @staticmethod
    def reshape(x: Any, shape: Any) -> Any:
        return tf.reshape(x, shape)

    @staticmethod
    def concat(arrays: Any, axis: int = 0) -> Any:
        return tf.concat(list(arrays), axis=axis)

    @staticmethod
    def permute_dims(x: Any, axes: Any) -> Any:
        return tf.transpose(x, axes)

    @staticmethod
    def cumulative_sum(x: Any, axis: int = -1) -> Any:
        return tf.math.cumsum(x, axis=axis)


#: The namespace passed as ``xp`` to :mod:`normflat.engine.losses`.
TF = _TensorFlowNamespace()
