"""Keras 3 (TensorFlow backend) builder of :mod:`tests.netspec` networks.

Images are NHWC in Keras: conv kernels ``(out, in, kh, kw)`` become
``(kh, kw, in, out)``, dense kernels ``(out, in)`` become ``(in, out)``, and
inputs are transposed from NCHW. Symmetric padding is a ``ZeroPadding2D``
followed by a ``'valid'`` convolution, which reproduces the spec exactly. A
grouped convolution with one input channel per group is a ``DepthwiseConv2D``,
any other a ``Conv2D(groups=...)``.
"""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

FRAMEWORKS = ("tensorflow", "keras")
ANALYZE_KWARGS: dict = {}

from tests import netspec  # noqa: E402


def _nhwc(x: np.ndarray) -> np.ndarray:
    return np.transpose(x, (0, 2, 3, 1)) if x.ndim == 4 else x


def build(spec: netspec.NetSpec, dtype: str = "float64"):
    """A functional Keras model computing ``netspec.forward(spec, ·)`` on NHWC inputs."""
    import keras

    shape = spec.input_shape
    inputs = keras.Input(shape=(shape[1], shape[2], shape[0]) if len(shape) == 3 else shape, dtype=dtype)
    assignments = []
    h = _layers(spec.layers, inputs, dtype, assignments, [0])
    model = keras.Model(inputs, h, name="netspec")
    for fn in assignments:
        fn()
    return model


def _layers(layers, h, dtype, assignments, counter):
    for layer in layers:
        h = _layer(layer, h, dtype, assignments, counter)
    return h


def _layer(layer, h, dtype, assignments, counter):
    import keras

    L = keras.layers

    def name(prefix):
        counter[0] += 1
        return f"{prefix}_{counter[0]}"

    if isinstance(layer, netspec.Dense):
        dense = L.Dense(layer.weight.shape[0], use_bias=layer.bias is not None, dtype=dtype, name=name("dense"))
        out = dense(h)
        weights = [layer.weight.T] + ([layer.bias] if layer.bias is not None else [])
        assignments.append(lambda d=dense, w=weights: d.set_weights(w))
        return out
    if isinstance(layer, netspec.Conv2d):
        if layer.padding:
            h = L.ZeroPadding2D(layer.padding, dtype=dtype, name=name("pad"))(h)
        out_c, in_g, kh, kw = layer.weight.shape
        bias = [layer.bias] if layer.bias is not None else []
        if layer.groups > 1 and in_g == 1 and int(h.shape[-1]) == layer.groups:
            # Depthwise (one input channel per group): Keras' own DepthwiseConv2D, kernel
            # (kh, kw, in, m) with output channel i*m + j reading input channel i.
            m = out_c // layer.groups
            conv = L.DepthwiseConv2D((kh, kw), strides=layer.stride, padding="valid", depth_multiplier=m,
                                     use_bias=layer.bias is not None, dtype=dtype, name=name("depthwise"))
            out = conv(h)
            kernel = layer.weight.reshape(layer.groups, m, kh, kw).transpose(2, 3, 0, 1)
            assignments.append(lambda c=conv, w=[kernel] + bias: c.set_weights(w))
            return out
        conv = L.Conv2D(out_c, (kh, kw), strides=layer.stride, padding="valid", groups=layer.groups,
                        use_bias=layer.bias is not None, dtype=dtype, name=name("conv"))
        out = conv(h)
        weights = [np.transpose(layer.weight, (2, 3, 1, 0))] + bias
        assignments.append(lambda c=conv, w=weights: c.set_weights(w))
        return out
    if isinstance(layer, netspec.ConvTranspose2d):
        out_c, _, kh, kw = layer.weight.shape
        # Keras crops "valid" nothing and "same" (k − stride)/2 on each side (TensorFlow's SAME padding of
        # the convolution it is the input gradient of): torch's symmetric padding of 0 or that.
        if layer.padding == 0:
            padding = "valid"
        elif kh == kw and 2 * layer.padding == kh - layer.stride:
            padding = "same"
        else:
            raise ValueError(f"no Keras padding crops {layer.padding} on each side of a {kh}×{kw} kernel")
        conv = L.Conv2DTranspose(out_c, (kh, kw), strides=layer.stride, padding=padding,
                                 use_bias=layer.bias is not None, dtype=dtype, name=name("up"))
        out = conv(h)
        # (kh, kw, out, in): the kernel of the convolution whose input gradient the layer computes.
        weights = [np.transpose(layer.weight, (2, 3, 0, 1))] + ([layer.bias] if layer.bias is not None else [])
        assignments.append(lambda c=conv, w=weights: c.set_weights(w))
        return out
    if isinstance(layer, netspec.Relu):
        return L.ReLU(dtype=dtype, name=name("relu"))(h)
    if isinstance(layer, netspec.Tanh):
        return L.Activation("tanh", dtype=dtype, name=name("tanh"))(h)
    if isinstance(layer, netspec.MaxPool2d):
        return L.MaxPooling2D(layer.size, strides=layer.size, padding="valid", dtype=dtype, name=name("pool"))(h)
    if isinstance(layer, netspec.GlobalAvgPool2d):
        return L.GlobalAveragePooling2D(dtype=dtype, name=name("gap"))(h)
    if isinstance(layer, netspec.Flatten):
        return L.Flatten(dtype=dtype, name=name("flatten"))(h)
    if isinstance(layer, netspec.BatchNorm):
        bn = L.BatchNormalization(axis=-1, epsilon=layer.eps, dtype=dtype, name=name("bn"))
        out = bn(h)
        weights = [layer.gamma, layer.beta, layer.mean, layer.var]
        assignments.append(lambda b=bn, w=weights: b.set_weights(w))
        return out
    if isinstance(layer, netspec.LayerNorm):
        ln = L.LayerNormalization(axis=-1, epsilon=layer.eps, dtype=dtype, name=name("ln"))
        out = ln(h)
        assignments.append(lambda l=ln, w=[layer.gamma, layer.beta]: l.set_weights(w))
        return out
    if isinstance(layer, netspec.Residual):
        body = _layers(layer.body, h, dtype, assignments, counter)
        return L.Add(dtype=dtype, name=name("add"))([h, body])
    raise TypeError(f"unknown spec layer {layer!r}")


def predict(model, x: np.ndarray) -> np.ndarray:
    """Logits (float64 numpy) for NCHW / feature inputs."""
    return np.asarray(model(_nhwc(np.asarray(x)), training=False), dtype=np.float64)


def make_data(x: np.ndarray, y: np.ndarray, batch_size: int):
    """A ``tf.data.Dataset`` of NHWC ``(x, y)`` batches."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((_nhwc(np.asarray(x)), np.asarray(y))).batch(batch_size)
