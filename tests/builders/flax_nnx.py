"""flax nnx builder of :mod:`tests.netspec` networks (NHWC, kernels (*k, in, out))."""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import flax.linen as linen  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tests import netspec  # noqa: E402

FRAMEWORKS = ("jax", "flax")
ANALYZE_KWARGS: dict = {}


class Fn(nnx.Module):
    """A parameter-free layer: relu, tanh, maxpool, gap, flatten."""

    def __init__(self, kind: str, size: int = 0):
        self.kind, self.size = kind, size

    def __call__(self, h):
        if self.kind == "relu":
            return jax.nn.relu(h)
        if self.kind == "tanh":
            return jnp.tanh(h)
        if self.kind == "maxpool":
            return linen.max_pool(h, (self.size, self.size), strides=(self.size, self.size))
        if self.kind == "gap":
            return h.mean(axis=(1, 2))
        return h.reshape(h.shape[0], -1)


class Residual(nnx.Module):
    def __init__(self, body):
        self.body = nnx.List(body)

    def __call__(self, h):
        out = h
        for layer in self.body:
            out = layer(out)
        return h + out


class Net(nnx.Module):
    def __init__(self, layers):
        self.layers = nnx.List(layers)

    def __call__(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def _convert(layers, dtype):
    rngs = nnx.Rngs(0)
    out = []
    for layer in layers:
        if isinstance(layer, netspec.Dense):
            o, i = layer.weight.shape
            m = nnx.Linear(i, o, use_bias=layer.bias is not None, param_dtype=dtype, rngs=rngs)
            m.kernel.set_value(jnp.asarray(layer.weight.T, dtype))
            if layer.bias is not None:
                m.bias.set_value(jnp.asarray(layer.bias, dtype))
        elif isinstance(layer, netspec.Conv2d):
            o, ig, kh, kw = layer.weight.shape
            p = layer.padding
            m = nnx.Conv(ig * layer.groups, o, (kh, kw), strides=layer.stride, padding=[(p, p), (p, p)],
                         feature_group_count=layer.groups, use_bias=layer.bias is not None, param_dtype=dtype,
                         rngs=rngs)
            m.kernel.set_value(jnp.asarray(layer.weight.transpose(2, 3, 1, 0), dtype))
            if layer.bias is not None:
                m.bias.set_value(jnp.asarray(layer.bias, dtype))
        elif isinstance(layer, netspec.ConvTranspose2d):
            o, i, kh, kw = layer.weight.shape
            crop = [(kh - 1 - layer.padding,) * 2, (kw - 1 - layer.padding,) * 2]
            m = nnx.ConvTranspose(i, o, (kh, kw), strides=layer.stride, padding=crop,
                                  use_bias=layer.bias is not None, param_dtype=dtype, rngs=rngs)
            # flax correlates the dilated, padded input with its kernel (kh, kw, in, out): torch's kernel
            # flipped, the padding k − 1 − torch's.
            m.kernel.set_value(jnp.asarray(layer.weight[:, :, ::-1, ::-1].transpose(2, 3, 1, 0), dtype))
            if layer.bias is not None:
                m.bias.set_value(jnp.asarray(layer.bias, dtype))
        elif isinstance(layer, netspec.Relu):
            m = Fn("relu")
        elif isinstance(layer, netspec.Tanh):
            m = Fn("tanh")
        elif isinstance(layer, netspec.MaxPool2d):
            m = Fn("maxpool", layer.size)
        elif isinstance(layer, netspec.GlobalAvgPool2d):
            m = Fn("gap")
        elif isinstance(layer, netspec.Flatten):
            m = Fn("flatten")
        elif isinstance(layer, netspec.BatchNorm):
            m = nnx.BatchNorm(len(layer.gamma), epsilon=layer.eps, use_running_average=True, param_dtype=dtype,
                              rngs=rngs)
            m.scale.set_value(jnp.asarray(layer.gamma, dtype))
            m.bias.set_value(jnp.asarray(layer.beta, dtype))
            m.mean.set_value(jnp.asarray(layer.mean, dtype))
            m.var.set_value(jnp.asarray(layer.var, dtype))
        elif isinstance(layer, netspec.LayerNorm):
            m = nnx.LayerNorm(len(layer.gamma), epsilon=layer.eps, param_dtype=dtype, rngs=rngs)
            m.scale.set_value(jnp.asarray(layer.gamma, dtype))
            m.bias.set_value(jnp.asarray(layer.beta, dtype))
        elif isinstance(layer, netspec.Residual):
            m = Residual(_convert(layer.body, dtype))
        else:
            raise TypeError(f"unknown layer {layer!r}")
        out.append(m)
    return out


def build(spec: netspec.NetSpec, dtype="float64"):
    return Net(_convert(spec.layers, jnp.dtype(dtype)))


def to_nhwc(x):
    x = np.asarray(x)
    return x.transpose(0, 2, 3, 1) if x.ndim == 4 else x


def predict(model, x):
    return np.asarray(model(jnp.asarray(to_nhwc(x))), dtype=np.float64)


def make_data(x, y, batch_size):
    x = to_nhwc(x)
    return [(jnp.asarray(x[i:i + batch_size]), jnp.asarray(y[i:i + batch_size]))
            for i in range(0, len(x), batch_size)]
