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
* Recurrent layers (``LSTM``, ``GRU``, ``SimpleRNN`` on their own cells): the GGN
  step runs their loop as a recurrence that forms each weight's product where its
  signals can be taken (:func:`recorded_inner_loop`, method §6.1 "Recurrent weights").
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from normflat.backends.keras import compat

__all__ = ["grouped_conv_call", "uses_depthwise_form", "norm_call", "is_plain_norm", "recurrent_cell",
           "state_blocks", "recorded_inner_loop"]


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


#: The recurrent cells whose step :func:`recorded_inner_loop` computes: class name, kind.
_CELLS = (("LSTMCell", "lstm"), ("GRUCell", "gru"), ("SimpleRNNCell", "simple_rnn"))


def recurrent_cell(cell: Any) -> str | None:
    """``"lstm"``, ``"gru"`` or ``"simple_rnn"`` for a Keras cell that runs Keras' own ``call``, else ``None``."""
    for name, kind in _CELLS:
        cls = getattr(keras.layers, name, None)
        if isinstance(cls, type) and isinstance(cell, cls) and type(cell).call is cls.call:
            return kind
    return None


def state_blocks(cell: Any) -> list[tuple[int, int]]:
    """The column ranges of a cell's ``recurrent_kernel`` that multiply one tensor each per step.

    A GRU with ``reset_after=False`` multiplies its candidate columns by ``r ⊙ h_{t-1}`` and its
    update and reset columns by ``h_{t-1}``; every other cell multiplies all columns by ``h_{t-1}``.
    """
    units, width = int(cell.units), int(cell.recurrent_kernel.shape[-1])
    if recurrent_cell(cell) == "gru" and not cell.reset_after:
        return [(0, 2 * units), (2 * units, width)]
    return [(0, width)]


def recorded_inner_loop(layer: Any, original: Callable[..., Any], read: Callable[[], Any],
                        watch: Callable[[Any], None], record: Callable[[int, Any, Any], None],
                        active: Callable[[], bool]) -> Callable[..., Any]:
    """``RNN.inner_loop`` of ``layer`` (an ``LSTM``, ``GRU`` or ``SimpleRNN`` on its own cell) run as a
    recurrence whose weight products can be tapped (method §6.1, "Recurrent weights").

    Keras' cells multiply ``x_t`` by ``kernel`` and ``h_{t-1}`` by ``recurrent_kernel`` inside a
    ``tf.while_loop``, where no gradient can be taken. Here ``x_t W`` is formed for every step at
    once, before the loop (``record(0, sequences, product)``: that tensor's gradient is the signal of
    every step), and to each step's ``h_{t-1} U`` a slice of a zero tensor is added, whose gradient is
    the product's at that step (``record(1, inputs, zeros)``, one record per :func:`state_blocks`
    range, ``inputs`` what the range multiplies at each step in time order). The loop is Keras' own
    backend ``rnn`` with the layer's masks, ``go_backwards`` and ``unroll``; the step is the cell's
    arithmetic in Keras' order, its inference branch (a call with ``training`` and dropout, or while
    ``active()`` is false, runs ``original``).

    Args:
        layer: The ``RNN`` layer; its ``cell`` is read at each call.
        original: The layer's own ``inner_loop``.
        read: A context manager under which the two kernels are read (the taps' own read).
        watch: Watches a tensor on the recording tape (before the operations that use it).
        record: Receives ``(weight, input, product)``: weight 0 for ``kernel``, 1 for ``recurrent_kernel``.
        active: Whether the recording runs (the cell's weights still have their fast rule).
    """
    loop = compat.rnn_loop()

    def inner_loop(sequences, initial_state, mask, training=False):
        cell = layer.cell
        kind = recurrent_cell(cell)
        dropout = bool(training) and (0.0 < float(cell.dropout) < 1.0 or 0.0 < float(cell.recurrent_dropout) < 1.0)
        if loop is None or kind is None or dropout or not active():
            return original(sequences, initial_state, mask, training=training)
        if isinstance(mask, (list, tuple)):
            mask = mask[0]
        if not isinstance(initial_state, (list, tuple)):
            initial_state = [initial_state]
        dtype = sequences.dtype
        with read():
            kernel = tf.cast(cell.kernel.value, dtype)
            recurrent = tf.cast(cell.recurrent_kernel.value, dtype)
        bias = tf.cast(cell.bias.value, dtype) if cell.bias is not None else None
        units = int(cell.units)
        blocks = state_blocks(cell)
        projected = tf.matmul(sequences, kernel)  # every step's x_t W at once: its signals (n, T, G·H)
        watch(projected)
        steps = tf.shape(sequences)[:2]
        zeros = [tf.zeros(tf.concat([steps, [stop - start]], 0), dtype) for start, stop in blocks]
        for z in zeros:
            watch(z)
        act, gate = cell.activation, getattr(cell, "recurrent_activation", None)

        def lstm(x, taps, states):
            h, c = states[0], states[1]
            z = x + (tf.matmul(h, recurrent) + taps[0])
            if bias is not None:
                z = z + bias
            i, f, g, o = tf.split(z, 4, axis=-1)
            c = gate(f) * c + gate(i) * act(g)
            new = gate(o) * act(c)
            return new, [h], [new, c]

        def gru(x, taps, states):
            h = states[0]
            if bias is not None:
                x = x + (bias[0] if cell.reset_after else bias)
            x_z, x_r, x_h = tf.split(x, 3, axis=-1)
            if cell.reset_after:
                inner = tf.matmul(h, recurrent) + taps[0]
                if bias is not None:
                    inner = inner + bias[1]
                r_z, r_r, r_h = tf.split(inner, 3, axis=-1)
                z, r = gate(x_z + r_z), gate(x_r + r_r)
                candidate, inputs = act(x_h + r * r_h), [h]
            else:
                inner = tf.matmul(h, recurrent[:, :2 * units]) + taps[0]
                z, r = gate(x_z + inner[:, :units]), gate(x_r + inner[:, units:])
                reset = r * h
                candidate = act(x_h + (tf.matmul(reset, recurrent[:, 2 * units:]) + taps[1]))
                inputs = [h, reset]
            new = z * h + (1 - z) * candidate
            return new, inputs, [new]

        def simple_rnn(x, taps, states):
            h = states[0]
            if bias is not None:
                x = x + bias
            new = x + (tf.matmul(h, recurrent) + taps[0])
            if act is not None:
                new = act(new)
            return new, [h], [new]

        cell_step = {"lstm": lstm, "gru": gru, "simple_rnn": simple_rnn}[kind]

        def step(inputs, states):
            new, multiplied, new_states = cell_step(inputs[0], inputs[1:], states)
            # One output tensor (the masked and unrolled loops take no nested outputs): the new
            # state, then what each recurrent range multiplied at this step.
            return tf.concat([new, *multiplied], axis=-1), new_states

        last, outputs, states = loop(step, (projected, *zeros), tuple(initial_state), go_backwards=layer.go_backwards,
                                     mask=mask, unroll=layer.unroll, input_length=sequences.shape[1],
                                     zero_output_for_mask=layer.zero_output_for_mask, return_all_outputs=True)
        record(0, sequences, projected)
        for j, ((start, stop), z) in enumerate(zip(blocks, zeros)):
            inputs = outputs[..., units * (j + 1):units * (j + 2)]
            if layer.go_backwards:  # the loop's outputs run in processing order, the taps in time order
                inputs = tf.reverse(inputs, [1])
            record(1, inputs, z)
        outputs = outputs[..., :units]
        return last[..., :units], outputs if layer.return_sequences else outputs[:, -1:], list(states)

    return inner_loop
