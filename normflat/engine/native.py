"""A few whole-array operations on a backend's native arrays, for the engine.

The engine never imports a framework at module level; the few operations its
estimator state and driver need beyond ``+``, ``/`` and indexing (stack, concatenate,
zeros) are looked up from the array's own library when called.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

__all__ = ["library", "mutable", "repeats_rows", "stack", "concat", "zeros_like", "kernel_sums", "weighted_sum"]

#: Per library: (module, stack, concatenate along axis 0, zeros_like).
_OPERATIONS = {
    "torch": ("torch", "stack", "cat", "zeros_like"),
    "jax": ("jax.numpy", "stack", "concatenate", "zeros_like"),
    "jaxlib": ("jax.numpy", "stack", "concatenate", "zeros_like"),
    "tensorflow": ("tensorflow", "stack", "concat", "zeros_like"),
}


def library(array: Any) -> str:
    """The top-level package of ``array``'s type (``"torch"``, ``"jax"``, ``"numpy"``...)."""
    return type(array).__module__.split(".")[0]


def mutable(array: Any) -> bool:
    """Whether ``array[i] += x`` writes into ``array`` (numpy and torch; not JAX or TensorFlow)."""
    return library(array) in ("numpy", "torch")


def repeats_rows(array: Any) -> bool:
    """Whether a 2-D array is one row repeated as a view, without copies (a numpy or torch
    broadcast: stride 0 along its first axis)."""
    lib = library(array)
    if lib == "numpy":
        return array.ndim == 2 and array.shape[0] > 1 and array.strides[0] == 0
    if lib == "torch":
        return array.dim() == 2 and array.shape[0] > 1 and array.stride(0) == 0
    return False


def _operation(array: Any, which: int) -> Any:
    entry = _OPERATIONS.get(library(array))
    if entry is None:
        return None
    return getattr(importlib.import_module(entry[0]), entry[which])


def stack(arrays: list[Any]) -> Any:
    """Same-shape native arrays stacked along a new axis 0."""
    op = _operation(arrays[0], 1)
    return np.stack([np.asarray(a) for a in arrays]) if op is None else op(arrays)


def concat(arrays: list[Any]) -> Any:
    """Native arrays concatenated along axis 0."""
    op = _operation(arrays[0], 2)
    if op is None:
        return np.concatenate(arrays)
    return op(arrays, 0) if library(arrays[0]) == "tensorflow" else op(arrays)


def zeros_like(array: Any) -> Any:
    """Zeros of ``array``'s shape, dtype and device."""
    op = _operation(array, 3)
    return np.zeros_like(array) if op is None else op(array)


def kernel_sums(value: Any, axes: tuple[int, ...]) -> Any:
    """``(K, ...)`` ``value`` summed over ``axes`` of each ``value[k]``, kept with size 1 (a new array)."""
    dims = tuple(a + 1 for a in axes)
    lib = library(value)
    if lib == "torch":
        return value.sum(dim=dims, keepdim=True)
    if lib == "tensorflow":
        return importlib.import_module("tensorflow").reduce_sum(value, axis=dims, keepdims=True)
    if lib in ("jax", "jaxlib"):
        return importlib.import_module("jax.numpy").sum(value, axis=dims, keepdims=True)
    return np.sum(value, axis=dims, keepdims=True)


def weighted_sum(value: Any, weights: np.ndarray) -> Any:
    """``Σ_k weights_k · value[k]`` of a ``(K, ...)`` array (a new array of one ``value[k]``'s shape)."""
    total = value[0] * float(weights[0])
    in_place = mutable(total)
    for k in range(1, int(value.shape[0])):
        part = value[k] * float(weights[k]) if float(weights[k]) != 1.0 else value[k]
        if in_place:
            total += part
        else:
            total = total + part
    return total
