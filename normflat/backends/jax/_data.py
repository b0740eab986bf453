"""Data handling of the JAX backend: batches of arrays, casts and label checks."""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from normflat.core.options import AnalysisOptions

__all__ = ["batches", "total", "cast_inputs", "unflatten", "check_batch", "run_checks"]


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
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype else a, x)


def unflatten(like: Any, leaves: list) -> Any:
    """Rebuild an input pytree shaped like ``like`` from ``leaves``."""
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def check_batch(x: Any, y: Any, options: AnalysisOptions, num_classes: int, index: int, pending: list,
                extra: tuple | None = None) -> int:
    """Validate one batch; return its number of examples.

    Shape and dtype checks raise at once. Value checks (NaN inputs, labels out of
    range — JAX clips out-of-range indices silently, so labels are checked
    explicitly — and, through ``extra = (arrays, check(all_finite))``, the weights)
    are computed in one compiled call and appended to ``pending``; they are
    evaluated together at the end with one device synchronisation.
    """
    x_leaves = jax.tree_util.tree_leaves(x)
    if not x_leaves or any(a.ndim == 0 for a in x_leaves):
        raise ValueError("Every input batch x needs a leading batch axis.")
    n = int(x_leaves[0].shape[0])
    if any(int(a.shape[0]) != n for a in x_leaves):
        raise ValueError("The input arrays of one batch have different leading (batch) sizes.")
    if n == 0:
        raise ValueError("A batch of the data is empty (0 examples).")
    labels = not callable(options.loss)
    if labels:
        if y.ndim != 1 or int(y.shape[0]) != n:
            raise ValueError(
                f"Labels must be a vector of {n} integer class indices (one per example of the batch); got "
                f"shape {tuple(y.shape)}. Convert one-hot labels with y.argmax(-1)."
            )
        if not jnp.issubdtype(y.dtype, jnp.integer):
            raise ValueError(f"Labels must be integer class indices, got dtype {y.dtype}; cast them with "
                             "y.astype(int) (one-hot labels: y.argmax(-1)).")
    floats = [a for a in x_leaves if jnp.issubdtype(a.dtype, jnp.floating)]
    values = _batch_values(floats, y if labels else None, list(extra[0]) if extra else [])

    def check(v):
        if extra is not None:
            extra[1](bool(v[3]))
        if not v[0]:
            raise ValueError(f"Batch {index}: the input data contains NaN or inf values; clean or impute it first.")
        lo, hi = int(v[1]), int(v[2])
        if labels and (lo < 0 or hi >= num_classes):
            raise ValueError(
                f"Labels must lie in [0, {num_classes - 1}] for a model with {num_classes} logits; batch {index} "
                f"has labels from {lo} to {hi}."
            )
    pending.append((values, check))
    return n


@jax.jit
def _batch_values(floats, y, weights):
    def finite(arrays):
        if not arrays:
            return jnp.asarray(True)
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays]))
    lo = jnp.min(y).astype(jnp.int32) if y is not None else jnp.asarray(0, jnp.int32)
    hi = jnp.max(y).astype(jnp.int32) if y is not None else jnp.asarray(0, jnp.int32)
    return jnp.stack([finite(floats).astype(jnp.int32), lo, hi, finite(weights).astype(jnp.int32)])


def run_checks(pending: list) -> None:
    """Evaluate deferred checks with one device synchronisation; raise the first failure."""
    values = jax.device_get([v for v, _ in pending])
    for value, (_, check) in zip(values, pending):
        check(value)

