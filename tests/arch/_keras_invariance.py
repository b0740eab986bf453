"""Function-preserving rescalings of Keras models, checked on either Keras backend (method §8).

The Keras rescaling tests run on Keras' TensorFlow backend in the test process and on its JAX
backend in a subprocess (``tests/backends/test_keras_rescalings_on_jax.py``). On the JAX backend
Keras' type promotion maps float64 to float32 (``keras.backend.result_type("float64", "float32")``
is ``"float32"`` there, to match JAX's default), so a float64 model computes its ``tanh``, its means
(normalization, pooling) and its attention scores in float32: the rescaled model is the same
function only to float32's accuracy, and so are the measures. :func:`invariance_tolerance` checks
the function at float64's accuracy and, only on the JAX backend and only where that fails, at
float32's; it returns the tolerance the measures are then held to.
"""

from __future__ import annotations

import keras
import numpy as np

from tests._invariance import RTOL_INVARIANT

#: Whether this process runs Keras' JAX backend.
ON_JAX = keras.backend.backend() == "jax"

#: The relative tolerance of a normalized sharpness where Keras computed part of a float64 model in
#: float32 (the JAX backend's promotion): float32's rounding through a forward and a backward pass.
RTOL_FLOAT32_OPS = 1e-5


def invariance_tolerance(got, want, rtol: float = 1e-12, atol: float = 1e-13) -> float:
    """Check that a rescaled model's output ``got`` is the original's ``want``, and return the relative
    tolerance a normalized sharpness is held to.

    Args:
        got: The rescaled model's output on the test batch (any array).
        want: The original model's output on it.
        rtol: The relative tolerance of float64 computation.
        atol: Its absolute tolerance.

    Returns:
        ``RTOL_INVARIANT`` (1e-8) where the outputs agree to ``rtol``; on Keras' JAX backend, where they
        agree only to float32's accuracy (2e-6 relative), :data:`RTOL_FLOAT32_OPS`.

    Raises:
        AssertionError: The outputs differ (beyond float32's accuracy on the JAX backend).
    """
    got, want = np.asarray(got), np.asarray(want)
    if not ON_JAX:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
        return RTOL_INVARIANT
    if np.allclose(got, want, rtol=rtol, atol=atol):
        return RTOL_INVARIANT
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7 * np.abs(want).max())
    return RTOL_FLOAT32_OPS


def jax_generic(*parts: str):
    """The layers that take the generic path on Keras' JAX backend only (a kernel used inside the
    traced ``scan`` of a recurrent layer has no fast rule there): a predicate on the layer name, true
    where the name contains one of ``parts`` and the process runs the JAX backend."""
    return lambda name: ON_JAX and any(part in name for part in parts)


def tensorflow_generic(predicate):
    """The layers that take the generic path on Keras' TensorFlow backend only: ``predicate`` there,
    false on the JAX backend, whose program analysis finds the fast dense rule for the matrices an
    experts layer or a keras-hub layer multiplies by in its own call (method §6)."""
    return lambda name: not ON_JAX and predicate(name)
