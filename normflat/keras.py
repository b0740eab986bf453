"""Alias of :mod:`normflat.integrations.keras`, kept so that old imports keep working.

The Keras callback moved to :mod:`normflat.integrations.keras`, beside the
training-time integrations of the other frameworks; the layer registry is in
:mod:`normflat.backends.keras`. This module re-exports the same objects, so
``from normflat.keras import SharpnessCallback`` (or ``register_layer``,
``KerasWeight``, ``registered_layers``) still works. New code should import from
the new places. Importing this module imports Keras.
"""

from normflat.integrations.keras import KerasWeight, SharpnessCallback, register_layer, registered_layers

__all__ = ["SharpnessCallback", "KerasWeight", "register_layer", "registered_layers"]
