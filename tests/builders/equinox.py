"""Equinox builder of :mod:`tests.netspec` networks (per-example NCHW, weights (out, in, *k)).

The network is a small user-style ``eqx.Module`` holding its layers and, for
BatchNorm, its ``eqx.nn.State`` with the spec's running statistics; it maps one
example to its logits, as equinox's own layers do, and normflat detects that
it must be vmapped.
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tests import netspec  # noqa: E402

FRAMEWORKS = ("jax", "equinox")
ANALYZE_KWARGS: dict = {}


class Residual(eqx.Module):
    body: tuple


class Net(eqx.Module):
    layers: tuple
    state: eqx.nn.State | None

    def __call__(self, x):
        return _run(self.layers, x, self.state)


def _run(layers, h, state):
    for layer in layers:
        if isinstance(layer, Residual):
            h = h + _run(layer.body, h, state)
        elif isinstance(layer, eqx.nn.BatchNorm):
            h, _ = layer(h, state)
        else:
            h = layer(h)
    return h


def _gap(h):
    return h.mean(axis=(1, 2))


def _convert(layers, dtype, bns):
    out = []
    key = jax.random.key(0)
    for layer in layers:
        if isinstance(layer, netspec.Dense):
            o, i = layer.weight.shape
            m = eqx.nn.Linear(i, o, use_bias=layer.bias is not None, dtype=dtype, key=key)
            m = eqx.tree_at(lambda l: l.weight, m, jnp.asarray(layer.weight, dtype))
            if layer.bias is not None:
                m = eqx.tree_at(lambda l: l.bias, m, jnp.asarray(layer.bias, dtype))
            out.append(m)
        elif isinstance(layer, netspec.Conv2d):
            o, ig, kh, kw = layer.weight.shape
            m = eqx.nn.Conv2d(ig * layer.groups, o, (kh, kw), stride=layer.stride, padding=layer.padding,
                              groups=layer.groups, use_bias=layer.bias is not None, dtype=dtype, key=key)
            m = eqx.tree_at(lambda l: l.weight, m, jnp.asarray(layer.weight, dtype))
            if layer.bias is not None:
                m = eqx.tree_at(lambda l: l.bias, m, jnp.asarray(layer.bias, dtype).reshape(o, 1, 1))
            out.append(m)
        elif isinstance(layer, netspec.ConvTranspose2d):
            o, i, kh, kw = layer.weight.shape
            m = eqx.nn.ConvTranspose2d(i, o, (kh, kw), stride=layer.stride, padding=layer.padding,
                                       use_bias=layer.bias is not None, dtype=dtype, key=key)
            # equinox correlates the dilated input with its weight (out, in, kh, kw): torch's kernel flipped.
            m = eqx.tree_at(lambda l: l.weight, m, jnp.asarray(layer.weight[:, :, ::-1, ::-1], dtype))
            if layer.bias is not None:
                m = eqx.tree_at(lambda l: l.bias, m, jnp.asarray(layer.bias, dtype).reshape(o, 1, 1))
            out.append(m)
        elif isinstance(layer, netspec.Relu):
            out.append(eqx.nn.Lambda(jax.nn.relu))
        elif isinstance(layer, netspec.Tanh):
            out.append(eqx.nn.Lambda(jnp.tanh))
        elif isinstance(layer, netspec.MaxPool2d):
            out.append(eqx.nn.MaxPool2d(layer.size, stride=layer.size))
        elif isinstance(layer, netspec.GlobalAvgPool2d):
            out.append(eqx.nn.Lambda(_gap))
        elif isinstance(layer, netspec.Flatten):
            out.append(eqx.nn.Lambda(jnp.ravel))
        elif isinstance(layer, netspec.BatchNorm):
            m = eqx.nn.BatchNorm(len(layer.gamma), axis_name="batch", eps=layer.eps, inference=True,
                                 mode="ema", dtype=dtype)
            m = eqx.tree_at(lambda l: (l.weight, l.bias), m,
                            (jnp.asarray(layer.gamma, dtype), jnp.asarray(layer.beta, dtype)))
            bns.append((m, layer))
            out.append(m)
        elif isinstance(layer, netspec.LayerNorm):
            m = eqx.nn.LayerNorm(len(layer.gamma), eps=layer.eps, dtype=dtype)
            m = eqx.tree_at(lambda l: (l.weight, l.bias), m,
                            (jnp.asarray(layer.gamma, dtype), jnp.asarray(layer.beta, dtype)))
            out.append(m)
        elif isinstance(layer, netspec.Residual):
            out.append(Residual(tuple(_convert(layer.body, dtype, bns))))
        else:
            raise TypeError(f"unknown layer {layer!r}")
    return out


def build(spec: netspec.NetSpec, dtype="float64"):
    dtype = jnp.dtype(dtype)
    bns: list = []
    layers = tuple(_convert(spec.layers, dtype, bns))
    state = None
    if bns:
        state = eqx.nn.State(layers)
        for m, layer in bns:
            state = state.set(m.ema_state_index, (jnp.asarray(layer.mean, dtype), jnp.asarray(layer.var, dtype)))
    return Net(layers, state)


def predict(model, x):
    return np.asarray(jax.vmap(model)(jnp.asarray(x)), dtype=np.float64)


def make_data(x, y, batch_size):
    return [(jnp.asarray(x[i:i + batch_size]), jnp.asarray(y[i:i + batch_size]))
            for i in range(0, len(x), batch_size)]
