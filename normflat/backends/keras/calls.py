"""Replacement ``call`` methods set on single layer instances while analyzing.

* Grouped convolutions: TensorFlow has no CPU kernel for the derivatives of
  grouped convolutions (``Conv2DBackpropInput`` with groups); one depthwise
  convolution (many small groups) or one convolution per group (few large ones)
  computes the same function and is differentiable to any order.
* ``LayerNormalization`` / ``GroupNormalization``: Keras' TensorFlow
  ``moments`` is ``tf.nn.moments``, which stops the gradient of the mean inside
  the variance. First derivatives are right, second derivatives (``exact``,
  ``hutchinson``) are not. These calls compute the same normalization with the
  plain, twice-differentiable variance. They are set on the layer *instance*
  (:class:`~normflat.backends.keras.state.ModelState`), so no module function
  is swapped and other threads and models are unaffected.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from normflat.backends.keras import compat

__all__ = ["grouped_conv_call", "uses_depthwise_form", "norm_call", "is_plain_norm"]


#: A grouped convolution with at least this many groups per input channel of a group runs as one
#: depthwise convolution (see :func:`grouped_conv_call`); fewer, larger groups run one convolution each.
DEPTHWISE_GROUPS_PER_CHANNEL = 8


def uses_depthwise_form(layer: Any) -> bool:
    """Whether :func:`grouped_conv_call` runs ``layer`` as one depthwise convolution.

    True for 1-D and 2-D convolutions whose groups have one input channel (a depthwise
    convolution with ``depth_multiplier = out/groups``) or many groups of few channels
    (``groups >= DEPTHWISE_GROUPS_PER_CHANNEL · in/groups``, 8): the depthwise form's
    intermediate is ``in/groups`` times the output, cheap there, while the per-group
    form costs ``groups`` operations (and as many again in every back-propagation).
    """
    groups = int(layer.groups)
    cin_g = int(layer.kernel.shape[-2])
    return layer.rank in (1, 2) and (cin_g == 1 or groups >= DEPTHWISE_GROUPS_PER_CHANNEL * cin_g)


def grouped_conv_call(layer: Any) -> Callable[..., Any]:
    """The call of a grouped convolution as CPU-differentiable convolutions (to any order).

    Many small groups (:func:`uses_depthwise_form`, e.g. ConvNeXt's ``groups = channels``)
    run as ONE depthwise convolution: input channel ``c`` of group ``k`` is convolved
    with each of the group's output filters (depthwise kernel ``(*k, in, out/groups)``),
    and the ``in/groups`` products of each output channel are summed. Few large groups
    run as one convolution per group.
    """
    from keras import ops

    groups = int(layer.groups)
    channel_axis = -1 if layer.data_format == "channels_last" else 1
    depthwise = uses_depthwise_form(layer)

    def grouped(inputs, padding):
        xs = ops.split(inputs, groups, axis=channel_axis)
        ks = ops.split(layer.kernel, groups, axis=-1)
        return ops.concatenate(
            [ops.conv(x, k, strides=list(layer.strides), padding=padding, dilation_rate=layer.dilation_rate,
                      data_format=layer.data_format) for x, k in zip(xs, ks)],
            axis=channel_axis,
        )

    def as_depthwise(inputs, padding):
        kernel = layer.kernel  # (*k, in/groups, out)
        k = tuple(int(d) for d in kernel.shape[:-2])
        cin_g, cout = int(kernel.shape[-2]), int(kernel.shape[-1])
        cout_g = cout // groups
        r = len(k)
        # (*k, in/groups, groups, out/groups) -> (*k, groups, in/groups, out/groups) -> (*k, in, out/groups)
        kernel = ops.reshape(kernel, (*k, cin_g, groups, cout_g))
        kernel = ops.transpose(kernel, tuple(range(r)) + (r + 1, r, r + 2))
        kernel = ops.reshape(kernel, (*k, groups * cin_g, cout_g))
        out = ops.depthwise_conv(inputs, kernel, strides=layer.strides, padding=padding,
                                 dilation_rate=layer.dilation_rate, data_format=layer.data_format)
        if cin_g == 1:
            return out  # output channel c·m + j is filter j of input channel c: the grouped layout
        shape = tf.shape(out)  # dynamic: the batch (and maybe spatial) sizes are unknown when tracing
        axis = channel_axis % len(out.shape)
        # Channel (k, i, j): input channel i of group k, filter j; summed over i.
        split = tf.concat([shape[:axis], [groups, cin_g, cout_g], shape[axis + 1:]], 0)
        out = tf.reduce_sum(tf.reshape(out, split), axis=axis + 1)
        return tf.reshape(out, tf.concat([shape[:axis], [cout], shape[axis + 1:]], 0))

    def call(inputs, *args, **kwargs):
        padding = layer.padding
        if padding == "causal":
            inputs = ops.pad(inputs, compat.causal_padding(layer))
            padding = "valid"
        outputs = as_depthwise(inputs, padding) if depthwise else grouped(inputs, padding)
        if layer.use_bias:
            shape = [1] * len(outputs.shape)
            shape[channel_axis] = layer.filters
            outputs = ops.add(outputs, ops.reshape(layer.bias, shape))
        return layer.activation(outputs) if layer.activation is not None else outputs

    return call


def _moments(x: Any, axes: Any) -> tuple[Any, Any]:
    mean = tf.reduce_mean(x, axis=axes, keepdims=True)
    variance = tf.reduce_mean(tf.math.squared_difference(x, mean), axis=axes, keepdims=True)
    return mean, variance


def is_plain_norm(layer: Any) -> bool:
    """Whether ``layer`` is a Layer/GroupNormalization running Keras' own ``call``."""
    L = keras.layers
    for name in ("LayerNormalization", "GroupNormalization"):
        cls = getattr(L, name, None)
        if cls is not None and isinstance(layer, cls) and type(layer).call is cls.call:
            return True
    return False


def _layer_norm_call(layer: Any) -> Callable[..., Any]:
    def call(inputs, *args, **kwargs):
        x = tf.convert_to_tensor(inputs)
        dtype = x.dtype
        compute = tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype
        x = tf.cast(x, compute)
        ndims = len(x.shape)
        axes = sorted([layer.axis] if isinstance(layer.axis, int) else list(layer.axis))
        axes = [a % ndims for a in axes]
        shape = [1] * ndims
        for a in axes:
            shape[a] = x.shape[a]
        gamma = getattr(layer, "gamma", None)
        beta = getattr(layer, "beta", None)

        def bcast(v):
            return tf.reshape(tf.cast(v, compute), shape)

        if getattr(layer, "rms_scaling", False):
            _, variance = _moments(x, axes)
            out = x * tf.math.rsqrt(variance + layer.epsilon)
            if gamma is not None:
                out = out * bcast(gamma)
        else:
            mean, variance = _moments(x, axes)
            inv = tf.math.rsqrt(variance + layer.epsilon)
            if gamma is not None:
                inv = inv * bcast(gamma)
            res = -mean * inv
            if beta is not None:
                res = res + bcast(beta)
            out = x * inv + res
        return tf.cast(tf.cast(out, dtype), layer.compute_dtype)

    return call


def _group_norm_call(layer: Any) -> Callable[..., Any]:
    reshape_into_groups, broadcast_shape_of = compat.group_norm_helpers(layer)

    def call(inputs, *args, **kwargs):
        reshaped = reshape_into_groups(inputs)
        dtype = reshaped.dtype
        compute = tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype
        reshaped = tf.cast(reshaped, compute)
        axes = list(range(1, len(reshaped.shape)))
        axes.pop(-2 if layer.axis == -1 else layer.axis - 1)
        shape = broadcast_shape_of(inputs.shape)
        mean, variance = _moments(reshaped, axes)
        inv = tf.math.rsqrt(variance + layer.epsilon)
        if layer.scale:
            inv = inv * tf.cast(tf.reshape(layer.gamma, shape), compute)
        res = -mean * inv
        if layer.center:
            res = res + tf.cast(tf.reshape(layer.beta, shape), compute)
        out = tf.cast(reshaped * inv + res, dtype)
        return tf.cast(tf.reshape(out, tf.shape(inputs)), layer.compute_dtype)

    return call


def norm_call(layer: Any) -> Callable[..., Any]:
    """The twice-differentiable call of a plain Layer/GroupNormalization instance."""
    group = getattr(keras.layers, "GroupNormalization", None)
    if group is not None and isinstance(layer, group):
        return _group_norm_call(layer)
    return _layer_norm_call(layer)
