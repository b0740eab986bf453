"""Array-API helpers shared by the core: namespaces, float64 promotion, export.

The core computes with whatever array library the caller used (numpy, torch,
jax, any array-API library), so that large layers stay on their device. Only
small per-layer results are exported to numpy for reporting.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

__all__ = ["namespace_of", "as_float64", "holds_float64", "to_numpy", "to_float"]


def namespace_of(*arrays: Any) -> Any:
    """Return the array-API namespace of ``arrays``.

    Python scalars, lists and other non-array inputs are treated as numpy.
    """
    try:
        return array_api_compat.array_namespace(*arrays)
    except TypeError:
        return array_api_compat.array_namespace(*(np.asarray(a) for a in arrays))


def as_float64(x: Any, xp: Any) -> tuple[Any, Any]:
    """Return ``(x as float64, namespace)``.

    Libraries that cannot hold float64 (jax without ``jax_enable_x64``) silently
    keep float32; the computation then moves to numpy, because the solver's
    exponentials need the float64 range.
    """
    if x.dtype == xp.float64:
        return x, xp
    if holds_float64(xp):
        return xp.astype(x, xp.float64), xp
    xp_np = array_api_compat.array_namespace(np.empty(0))
    return np.asarray(to_numpy(x), dtype=np.float64), xp_np


def holds_float64(xp: Any) -> bool:
    """Whether the namespace ``xp`` can hold float64 arrays (not jax without ``jax_enable_x64``).

    Decided without creating an array and without touching the warning filters: a
    ``warnings.catch_warnings`` block is not thread-safe (two analyses in threads could leave
    the user's process with the other thread's filters, an "ignore" among them).
    """
    if array_api_compat.is_numpy_namespace(xp) or array_api_compat.is_torch_namespace(xp) \
            or array_api_compat.is_cupy_namespace(xp):
        return True
    if array_api_compat.is_jax_namespace(xp):
        import jax  # already imported: xp is jax.numpy

        # jax maps a float64 request to float32 when x64 is off, globally or in this thread's
        # context (jax.enable_x64); canonicalize_dtype answers the same, without a warning.
        return jax.dtypes.canonicalize_dtype(np.float64) == np.dtype(np.float64)
    try:  # another array-API library: one that lacks float64 refuses it or gives another dtype
        return xp.asarray(0.0, dtype=xp.float64).dtype == xp.float64
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return False


def to_numpy(x: Any) -> np.ndarray:
    """Copy any array (CPU or accelerator, any array-API library) to numpy."""
    if isinstance(x, np.ndarray):
        return x
    if array_api_compat.is_torch_array(x):
        return x.detach().cpu().numpy()
    if array_api_compat.is_jax_array(x):
        return np.asarray(x)
    try:
        return np.from_dlpack(x)
    except (TypeError, AttributeError, RuntimeError, BufferError):
        pass
    try:
        cpu = array_api_compat.to_device(x, "cpu")
        return np.from_dlpack(cpu)
    except Exception:  # noqa: BLE001 - last resort below gives the clearer error
        return np.asarray(x)


def to_float(x: Any) -> float:
    """Convert a 0-d array of any library to a Python float."""
    return float(to_numpy(x).reshape(()))
