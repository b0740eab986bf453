"""Data handling of the JAX backend: batches of arrays, casts and label checks."""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from normflat.core.options import AnalysisOptions

__all__ = ["batches", "total", "cast_inputs", "unflatten", "check_batch"]


def _is_array(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def _single_pair(data: Any) -> bool:
    return isinstance(data, (tuple, list)) and len(data) == 2 and _is_array(data[0]) and _is_array(data[1])


def batches(data: Any) -> Iterator[tuple[Any, Any]]:
    """Yield ``(x, y)`` as JAX arrays from one pair or an iterable of pairs."""
    if _single_pair(data):
        data = [tuple(data)]
    elif isinstance(data, dict) or _is_array(data) or not hasattr(data, "__iter__"):
        raise TypeError(
            f"data must be an iterable of (x, y) batches or one (x, y) pair of arrays, got {type(data).__name__}."
        )
    for i, item in enumerate(data):
        if isinstance(item, dict) and {"x", "y"} <= set(item):
            item = (item["x"], item["y"])
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"Batch {i} of the data is a {type(item).__name__}; every batch must be an (x, y) pair.")
        x, y = item
        yield jax.tree_util.tree_map(_to_jax, x), _to_jax(y)


def _to_jax(a: Any) -> Any:
    if isinstance(a, jax.Array):
        return a
    if hasattr(a, "detach"):  # torch tensors
        a = a.detach().cpu().numpy()
    return jnp.asarray(np.asarray(a))


def total(data: Any, max_batches: int | None) -> int | None:
    """Number of batches for the progress bar, if known."""
    if _single_pair(data):
        return 1
    try:
        n = len(data)
    except TypeError:
        return max_batches
    return n if max_batches is None else min(n, max_batches)


def cast_inputs(x: Any, dtype: Any) -> Any:
    """Cast floating inputs to the compute dtype (integer inputs, e.g. tokens, stay)."""
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, x)


def unflatten(like: Any, leaves: list) -> Any:
    """Rebuild an input pytree shaped like ``like`` from ``leaves``."""
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def check_batch(x: Any, y: Any, options: AnalysisOptions, num_classes: int) -> int:
    """Validate one batch; return its number of examples.

    JAX clips out-of-range indices silently, so labels are checked explicitly.
    """
    x_leaves = jax.tree_util.tree_leaves(x)
    if not x_leaves or any(a.ndim == 0 for a in x_leaves):
        raise ValueError("Every input batch x needs a leading batch axis.")
    n = int(x_leaves[0].shape[0])
    if any(int(a.shape[0]) != n for a in x_leaves):
        raise ValueError("The input arrays of one batch have different leading (batch) sizes.")
    if n == 0:
        raise ValueError("A batch of the data is empty (0 examples).")
    for a in x_leaves:
        if jnp.issubdtype(a.dtype, jnp.floating) and not bool(jnp.all(jnp.isfinite(a))):
            raise ValueError("The input data contains NaN or inf values; clean or impute it first.")
    if callable(options.loss):
        return n
    if y.ndim != 1 or int(y.shape[0]) != n:
        raise ValueError(
            f"Labels must be a vector of {n} integer class indices (one per example of the batch); got shape "
            f"{tuple(y.shape)}. Convert one-hot labels with y.argmax(-1)."
        )
    if not jnp.issubdtype(y.dtype, jnp.integer):
        raise ValueError(f"Labels must be integer class indices, got dtype {y.dtype}; cast them with "
                         "y.astype(int) (one-hot labels: y.argmax(-1)).")
    lo, hi = int(jnp.min(y)), int(jnp.max(y))
    if lo < 0 or hi >= num_classes:
        raise ValueError(
            f"Labels must lie in [0, {num_classes - 1}] for a model with {num_classes} logits; this batch has "
            f"labels from {lo} to {hi}."
        )
    return n
