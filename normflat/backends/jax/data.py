"""The JAX backend's :class:`~normflat.engine.data.DataAdapter`, casts and conversions.

The data contract itself (pairs, batches, one-hot labels, empty and infinite
data, every message) is the engine's (:mod:`normflat.engine.data`); this module
only says what a JAX array is and how to read it. Inputs may be JAX arrays or
numpy arrays; the engine reads other frameworks' tensors (a torch loader's, a
``tf.data`` pipeline's) into numpy before they get here.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from normflat.engine.data import INFINITE

__all__ = ["JaxAdapter", "ADAPTER", "to_jax", "cast_inputs", "device_inputs_finite"]


class JaxAdapter:
    """Arrays of the JAX backend: ``jax.Array`` and numpy."""

    framework = "jax"

    def is_array(self, a: Any) -> bool:
        return isinstance(a, (jax.Array, np.ndarray))

    def shape(self, a: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in a.shape)

    def kind(self, a: Any) -> str:
        dt = _np_dtype(a)
        if dt is None:
            return "?"
        if np.issubdtype(dt, np.floating) or dt == jnp.bfloat16:
            return "f"
        if np.issubdtype(dt, np.integer):
            return "i"
        if np.issubdtype(dt, np.bool_):
            return "b"
        if np.issubdtype(dt, np.complexfloating):
            return "c"
        return "?"

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def all_finite(self, a: Any) -> bool:
        # Device arrays are checked by the session inside one deferred computation (no
        # device synchronisation per batch); host arrays cost nothing to check here.
        if isinstance(a, jax.Array):
            return True
        return bool(np.all(np.isfinite(self.to_numpy(a))))

    def cardinality(self, data: Any) -> Any:
        tf = _tf_dataset_cardinality(data)
        if tf is not None:
            return tf
        try:
            return len(data)
        except TypeError:
            return None

    def reject(self, data: Any) -> str | None:
        return None

    def iterate(self, data: Any) -> Iterable[Any]:
        if type(data).__module__.startswith("tensorflow") and hasattr(data, "as_numpy_iterator"):
            return data.as_numpy_iterator()
        return data


def _np_dtype(a: Any) -> Any:
    dt = getattr(a, "dtype", None)
    return None if dt is None else np.dtype(dt)


def _tf_dataset_cardinality(data: Any) -> Any:
    if not type(data).__module__.startswith("tensorflow") or not hasattr(data, "cardinality"):
        return None
    import tensorflow as tf

    n = int(data.cardinality())
    if n == int(tf.data.INFINITE_CARDINALITY):
        return INFINITE
    return None if n < 0 else n


#: The adapter instance the sessions use.
ADAPTER = JaxAdapter()


def to_jax(a: Any) -> Any:
    """``a`` as a JAX array (JAX arrays are returned as they are)."""
    if isinstance(a, jax.Array):
        return a
    return jnp.asarray(np.asarray(a))


def cast_inputs(x: Any, dtype: Any) -> Any:
    """An input pytree as JAX arrays, floating leaves in the compute dtype (tokens stay integer)."""
    def cast(a):
        a = to_jax(a)
        return a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype else a
    return jax.tree_util.tree_map(cast, x)


@jax.jit
def _all_finite_arrays(arrays):
    """Whether every array of a non-empty list is finite, as one device boolean (compiled once per
    list of shapes)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays]))


def device_inputs_finite(x: Any, cast: Any = None) -> Any:
    """Whether the floating JAX arrays among the inputs ``x`` (those :meth:`JaxAdapter.all_finite`
    leaves to the caller) are all finite, as a device boolean, without waiting for it (``None``
    if there are none).

    Args:
        x: The batch's inputs as given.
        cast: The same inputs cast to the analysis dtype (:func:`cast_inputs`), whose arrays are
            then the ones checked (a float64 input beyond the float32 range is infinite there).
    """
    given = jax.tree_util.tree_leaves(x)
    checked = given if cast is None else jax.tree_util.tree_leaves(cast)
    arrays = [a for a, orig in zip(checked, given)
              if isinstance(orig, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating)]
    return _all_finite_arrays(arrays) if arrays else None
