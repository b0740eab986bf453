"""Every touch of a private or internal Keras / TensorFlow API, in one place.

Keras 3 has no public way to list a layer's direct sub-layers, to find the
layer producing a functional model's output, to tell Keras' own ``call`` of a
convolution from a user's override, or to read the strategy a model was built
under. Each helper below says why it needs the internal name and degrades to a
safe answer (the generic path, no stripping, no strategy) when a Keras release
moves it. Those that Keras on the JAX backend needs too (a functional model's output layer,
the recursive layer listing, the instance attributes) live in
:mod:`normflat.backends.keras_shared`, which imports no TensorFlow, and are re-exported here.
"""

from __future__ import annotations

from typing import Any, Callable

import keras

# The helpers that Keras on the JAX backend needs too live where no TensorFlow is imported.
from normflat.backends.keras_shared import (del_instance_attr, flatten_layers, functional_class, instance_attr,
                                            output_layer, set_instance_attr)

__all__ = [
    "children",
    "flatten_layers",
    "base_conv_class",
    "functional_class",
    "output_layer",
    "dense_kernel",
    "causal_padding",
    "model_strategy",
    "set_instance_attr",
    "del_instance_attr",
    "instance_attr",
    "group_norm_helpers",
    "rnn_loop",
    "onednn_enabled",
    "with_backward",
]

def children(layer: Any) -> list[Any]:
    """Direct sub-layers of ``layer`` in tracking order.

    ``Layer._layers`` is the only list of *direct* children (``_flatten_layers``
    recurses and the public ``layers`` exists on models only); the model walk
    needs them to prefix the names of nested models.
    """
    return [child for child in getattr(layer, "_layers", []) if isinstance(child, keras.layers.Layer)]


def base_conv_class() -> type | None:
    """Keras' internal ``BaseConv``: its ``call``/``convolution_op`` identify a plain convolution.

    The fast GGN path taps a convolution's input and pre-activation, which is only
    right when the layer runs Keras' own ``call``; ``None`` (another Keras layout)
    sends convolutions to the generic path.
    """
    try:
        from keras.src.layers.convolutional.base_conv import BaseConv
    except ImportError:  # pragma: no cover - other Keras layouts
        return None
    return BaseConv


def base_conv_transpose_class() -> type | None:
    """Keras' internal ``BaseConvTranspose`` (``Conv1DTranspose/2D/3D``): its ``call`` identifies a
    plain transposed convolution, tapped like :func:`base_conv_class`'s (``None``: the generic path)."""
    try:
        from keras.src.layers.convolutional.base_conv_transpose import BaseConvTranspose
    except ImportError:  # pragma: no cover - other Keras layouts
        return None
    return BaseConvTranspose


def dense_kernel(layer: Any) -> Any:
    """The variable of a ``Dense`` kernel.

    ``Dense.kernel`` is a property that, for LoRA or quantized layers, computes a
    tensor; ``_kernel`` is the variable itself, which is what is differentiated.
    """
    return layer._kernel if hasattr(layer, "_kernel") else layer.kernel


def causal_padding(layer: Any) -> Any:
    """``BaseConv._compute_causal_padding``: the exact padding Keras applies for ``padding="causal"``."""
    return layer._compute_causal_padding()


def model_strategy(model: Any) -> Any | None:
    """The ``tf.distribute`` strategy a model was built under (``Trainer._distribute_strategy``).

    Keras records it privately at construction; there is no public accessor.
    """
    return getattr(model, "_distribute_strategy", None)


def rnn_loop() -> Callable[..., Any] | None:
    """Keras' backend ``rnn`` (the loop ``RNN.inner_loop`` runs: masks, ``go_backwards``, ``unroll``).

    It has no public name; the recorded recurrence of the GGN step
    (:func:`normflat.backends.keras.calls.recorded_inner_loop`) runs its own step function in it,
    so that the masks and the time order are Keras' own. ``None`` (another Keras layout): the
    recurrent weights take the generic path.
    """
    try:
        from keras.src import backend
    except ImportError:  # pragma: no cover - other Keras layouts
        return None
    return getattr(backend, "rnn", None)


def onednn_enabled() -> bool:
    """Whether TensorFlow runs its oneDNN kernels (``TF_ENABLE_ONEDNN_OPTS``, on by default only on
    CPUs with AVX-512 and later).

    TensorFlow has no public query; its ``_pywrap_util_port.IsMklEnabled`` reads the setting in
    force. Without it the answer is ``False`` (Eigen's kernels), which only chooses between two
    products of the same value (:func:`normflat.backends.keras.ggn.dense_product`).
    """
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # pragma: no cover - other TensorFlow layouts
        return False
    return bool(getattr(_pywrap_util_port, "IsMklEnabled", lambda: False)())


def group_norm_helpers(layer: Any) -> tuple[Any, Any]:
    """``GroupNormalization``'s private reshape helpers (its own group layout, reused as is)."""
    return layer._reshape_into_groups, layer._create_broadcast_shape


def with_backward(output: Any, inputs: list[Any], backward: Callable[[Any], list[Any]]) -> Any | None:
    """``output`` (a graph tensor computed from ``inputs``) whose gradient a ``GradientTape`` takes as
    ``backward(g)`` (one gradient per input), as ``tf.custom_gradient`` does, without its global
    gradient registry entry; ``None`` where TensorFlow's tape API moved (the caller then uses
    ``tf.custom_gradient``).

    In a graph, ``tf.custom_gradient`` registers each call's gradient function under a fresh name
    in TensorFlow's process-wide gradient registry, for symbolic ``tf.gradients``, and never
    removes it: the function holds the graph it was traced in, so every analysis of a new model
    kept its steps' graphs (3 MiB per analysis of a new small MLP, checkpoint after checkpoint). The tape
    needs only the record of the operation, which it keeps as long as it lives: here
    ``tf.identity_n`` of the output and the inputs, recorded with ``backward`` (private API:
    ``tensorflow.python.eager.record.record_operation``, which ``tf.custom_gradient`` calls); the
    output's own gradient path is cut, as ``tf.custom_gradient`` cuts it. Nothing differentiates
    normflat's compiled steps symbolically.
    """
    import tensorflow as tf

    try:
        from tensorflow.python.eager import record
    except ImportError:  # pragma: no cover - other TensorFlow layouts
        return None
    operation = getattr(record, "record_operation", None)
    if operation is None:  # pragma: no cover - other TensorFlow layouts
        return None
    originals = [output, *inputs]
    outputs = tf.identity_n(originals)

    def gradient(*output_grads: Any) -> list[Any]:
        g = output_grads[0]
        grads = backward(g) if g is not None else [None] * len(inputs)
        return [None, *grads]

    operation("NormflatWithBackward", outputs, originals, gradient)
    return outputs[0]
