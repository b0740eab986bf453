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

# The state and the lock live where no TensorFlow is imported: Keras on the JAX backend takes
# the same ones (normflat.backends.jax.layers, its Keras view), so that both Keras paths share
# one lock per model and the same restored attributes.
from normflat.backends.keras_shared import ModelState, model_lock

__all__ = ["ModelState", "model_lock"]
