"""Framework-free description of small networks for cross-framework tests.

A :class:`NetSpec` is a sequence of layers with numpy weights in the canonical
layout (dense ``(out, in)``, conv and transposed conv ``(out, in/groups, kh, kw)``) and a numpy
reference forward pass. Each framework's builder (``tests/builders/*.py``)
turns a spec into a native model with exactly these weights, so the same
network can be analyzed in every framework and transformed by the
function-preserving reparametrizations of method §8 without touching framework
code. Image inputs are NCHW here; builders of NHWC frameworks transpose.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Union

import numpy as np


@dataclass
class Dense:
    weight: np.ndarray  # (out, in)
    bias: np.ndarray | None = None


@dataclass
class Conv2d:
    weight: np.ndarray  # (out, in/groups, kh, kw)
    bias: np.ndarray | None = None
    stride: int = 1
    padding: int = 0  # symmetric zero padding
    groups: int = 1


@dataclass
class ConvTranspose2d:
    """torch's ``ConvTranspose2d`` (one group): input channel ``i`` at position ``p`` adds
    ``x[i, p] · weight[o, i, a]`` to output position ``p·stride + a − padding``; output size
    ``(size − 1)·stride − 2·padding + k``."""

    weight: np.ndarray  # (out, in, kh, kw): canonical (method §3)
    bias: np.ndarray | None = None
    stride: int = 1
    padding: int = 0  # symmetric crop of the full output


@dataclass
class Relu:
    pass


@dataclass
class Tanh:
    pass


@dataclass
class MaxPool2d:
    size: int = 2  # kernel = stride = size


@dataclass
class GlobalAvgPool2d:
    """(N, C, H, W) -> (N, C)."""


@dataclass
class Flatten:
    """Only used when the spatial size is 1x1, so NCHW and NHWC orders agree."""


@dataclass
class BatchNorm:
    """Inference-mode batch normalization over the channel (or feature) axis."""

    gamma: np.ndarray
    beta: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    eps: float = 0.0


@dataclass
class LayerNorm:
    """Layer normalization over the last (feature) axis of a 2-D activation."""

    gamma: np.ndarray
    beta: np.ndarray
    eps: float = 0.0


@dataclass
class Residual:
    """``x + body(x)``."""

    body: list = field(default_factory=list)


Layer = Union[Dense, Conv2d, ConvTranspose2d, Relu, Tanh, MaxPool2d, GlobalAvgPool2d, Flatten, BatchNorm, LayerNorm,
              Residual]


#: The layers with a weight matrix.
WEIGHT_LAYERS = (Dense, Conv2d, ConvTranspose2d)


@dataclass
class NetSpec:
    layers: list
    input_shape: tuple[int, ...]  # per example: (features,) or (C, H, W)
    num_classes: int

    def copy(self) -> "NetSpec":
        return copy.deepcopy(self)

    def weight_layers(self) -> list:
        """Dense/Conv2d/ConvTranspose2d layers in model order (residual bodies inlined)."""
        out = []
        for layer in self.layers:
            if isinstance(layer, Residual):
                out.extend(l for l in layer.body if isinstance(l, WEIGHT_LAYERS))
            elif isinstance(layer, WEIGHT_LAYERS):
                out.append(layer)
        return out


# ----------------------------------------------------------------------------- forward


def forward(spec: NetSpec, x: np.ndarray) -> np.ndarray:
    """Reference forward pass in float64 numpy (NCHW images)."""
    return _run(spec.layers, np.asarray(x, dtype=np.float64))


def _run(layers, h):
    for layer in layers:
        h = _apply(layer, h)
    return h


def _apply(layer, h):
    if isinstance(layer, Dense):
        out = h @ layer.weight.T
        return out + layer.bias if layer.bias is not None else out
    if isinstance(layer, Conv2d):
        return _conv2d(h, layer)
    if isinstance(layer, ConvTranspose2d):
        return _conv_transpose2d(h, layer)
    if isinstance(layer, Relu):
        return np.maximum(h, 0.0)
    if isinstance(layer, Tanh):
        return np.tanh(h)
    if isinstance(layer, MaxPool2d):
        n, c, hh, ww = h.shape
        s = layer.size
        h = h[:, :, : hh // s * s, : ww // s * s]
        return h.reshape(n, c, hh // s, s, ww // s, s).max(axis=(3, 5))
    if isinstance(layer, GlobalAvgPool2d):
        return h.mean(axis=(2, 3))
    if isinstance(layer, Flatten):
        return h.reshape(h.shape[0], -1)
    if isinstance(layer, BatchNorm):
        shape = (1, -1) + (1,) * (h.ndim - 2)
        scale = layer.gamma / np.sqrt(layer.var + layer.eps)
        return (h - layer.mean.reshape(shape)) * scale.reshape(shape) + layer.beta.reshape(shape)
    if isinstance(layer, LayerNorm):
        mu = h.mean(axis=-1, keepdims=True)
        var = ((h - mu) ** 2).mean(axis=-1, keepdims=True)
        return (h - mu) / np.sqrt(var + layer.eps) * layer.gamma + layer.beta
    if isinstance(layer, Residual):
        return h + _run(layer.body, h)
    raise TypeError(f"unknown layer {layer!r}")


def _conv2d(h, layer: Conv2d):
    w = layer.weight
    p, s, g = layer.padding, layer.stride, layer.groups
    if p:
        h = np.pad(h, ((0, 0), (0, 0), (p, p), (p, p)))
    n, c, hh, ww = h.shape
    out, cin_g, kh, kw = w.shape
    windows = np.lib.stride_tricks.sliding_window_view(h, (kh, kw), axis=(2, 3))[:, :, ::s, ::s]
    # windows: (n, c, oh, ow, kh, kw)
    outs = []
    out_g = out // g
    for gi in range(g):
        win = windows[:, gi * cin_g : (gi + 1) * cin_g]
        wg = w[gi * out_g : (gi + 1) * out_g]
        outs.append(np.einsum("ncijkl,ockl->noij", win, wg))
    y = np.concatenate(outs, axis=1)
    if layer.bias is not None:
        y = y + layer.bias.reshape(1, -1, 1, 1)
    return y


def _conv_transpose2d(h, layer: ConvTranspose2d):
    w, s, p = layer.weight, layer.stride, layer.padding
    n, _, hh, ww = h.shape
    _, _, kh, kw = w.shape
    full = np.zeros((n, w.shape[0], (hh - 1) * s + kh, (ww - 1) * s + kw))
    for a in range(kh):
        for b in range(kw):
            full[:, :, a:a + (hh - 1) * s + 1:s, b:b + (ww - 1) * s + 1:s] += np.einsum("nipq,oi->nopq", h,
                                                                                         w[:, :, a, b])
    y = full[:, :, p:full.shape[2] - p, p:full.shape[3] - p]
    if layer.bias is not None:
        y = y + layer.bias.reshape(1, -1, 1, 1)
    return y


# ----------------------------------------------------------------------------- factories


def mlp(sizes, *, activation="relu", bias=True, seed=0, layernorm=False, batchnorm=False) -> NetSpec:
    """Dense network with the given layer sizes, e.g. ``(6, 8, 5, 3)``."""
    rng = np.random.default_rng(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(Dense(rng.normal(size=(b, a)) / np.sqrt(a), rng.normal(size=b) * 0.1 if bias else None))
        if i < len(sizes) - 2:
            if layernorm:
                layers.append(LayerNorm(1 + 0.1 * rng.normal(size=b), 0.1 * rng.normal(size=b)))
            if batchnorm:
                layers.append(_random_bn(rng, b))
            layers.append(Relu() if activation == "relu" else Tanh())
    return NetSpec(layers, (sizes[0],), sizes[-1])


def cnn(*, channels=(2, 4, 6), image=6, classes=3, batchnorm=False, seed=0, activation="relu",
        maxpool=True, groups=1) -> NetSpec:
    """Small conv net: conv3x3(pad 1)[-BN]-act-[maxpool]-conv3x3[-BN]-act-GAP-dense."""
    rng = np.random.default_rng(seed)
    c0, c1, c2 = channels
    act = Relu if activation == "relu" else Tanh
    layers = [Conv2d(rng.normal(size=(c1, c0, 3, 3)) / 3.0, None if batchnorm else 0.1 * rng.normal(size=c1), padding=1)]
    if batchnorm:
        layers.append(_random_bn(rng, c1))
    layers.append(act())
    if maxpool:
        layers.append(MaxPool2d(2))
    layers.append(Conv2d(rng.normal(size=(c2, c1 // groups, 3, 3)) / 3.0,
                         None if batchnorm else 0.1 * rng.normal(size=c2), padding=1, groups=groups))
    if batchnorm:
        layers.append(_random_bn(rng, c2))
    layers += [act(), GlobalAvgPool2d(), Dense(rng.normal(size=(classes, c2)) / np.sqrt(c2), 0.1 * rng.normal(size=classes))]
    return NetSpec(layers, (c0, image, image), classes)


def resnet_block(*, channels=3, image=5, classes=3, seed=0) -> NetSpec:
    """conv-BN-relu, residual(conv-BN-relu-conv-BN), relu, GAP, dense."""
    rng = np.random.default_rng(seed)
    c = channels
    body = [Conv2d(rng.normal(size=(c, c, 3, 3)) / 3.0, padding=1), _random_bn(rng, c), Relu(),
            Conv2d(rng.normal(size=(c, c, 3, 3)) / 3.0, padding=1), _random_bn(rng, c)]
    layers = [Conv2d(rng.normal(size=(c, 2, 3, 3)) / 3.0, padding=1), _random_bn(rng, c), Relu(),
              Residual(body), Relu(), GlobalAvgPool2d(), Dense(rng.normal(size=(classes, c)), rng.normal(size=classes) * 0.1)]
    return NetSpec(layers, (2, image, image), classes)


def decoder(*, channels=(2, 3, 4, 2), image=3, classes=3, seed=0) -> NetSpec:
    """A convolution (3×3, pad 1), then two transposed convolutions that upsample (4×4 stride 2
    pad 1, as a GAN generator's; 2×2 stride 2 pad 0), relu between, GAP, dense."""
    rng = np.random.default_rng(seed)
    c0, c1, c2, c3 = channels
    layers = [Conv2d(rng.normal(size=(c1, c0, 3, 3)) / 3.0, 0.1 * rng.normal(size=c1), padding=1), Relu(),
              ConvTranspose2d(rng.normal(size=(c2, c1, 4, 4)) / 3.0, 0.1 * rng.normal(size=c2), stride=2, padding=1),
              Relu(),
              ConvTranspose2d(rng.normal(size=(c3, c2, 2, 2)) / 2.0, 0.1 * rng.normal(size=c3), stride=2), Relu(),
              GlobalAvgPool2d(), Dense(rng.normal(size=(classes, c3)) / np.sqrt(c3), 0.1 * rng.normal(size=classes))]
    return NetSpec(layers, (c0, image, image), classes)


def _random_bn(rng, n, eps=0.0):
    return BatchNorm(1 + 0.2 * rng.normal(size=n), 0.1 * rng.normal(size=n), 0.1 * rng.normal(size=n),
                     0.5 + rng.random(size=n), eps)


def data(spec: NetSpec, n=12, seed=1):
    """Random inputs and integer labels for ``spec``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *spec.input_shape))
    y = rng.integers(0, spec.num_classes, size=n)
    return x, y


# ----------------------------------------------------------------------------- reparametrizations (method §8)


def rescale_layers(spec: NetSpec, first: int, second: int, c: float) -> NetSpec:
    """Dinh et al.: weight layer ``first`` (and its bias) × c, ``second`` ÷ c (ReLU between)."""
    out = spec.copy()
    wl = out.weight_layers()
    wl[first].weight = wl[first].weight * c
    if wl[first].bias is not None:
        wl[first].bias = wl[first].bias * c
    # Biases of layers in between scale too (none in the specs used); the second
    # layer's bias stays, its input is c times larger and its weight c times smaller.
    wl[second].weight = wl[second].weight / c
    return out


def rescale_units(spec: NetSpec, layer: int, factors: np.ndarray) -> NetSpec:
    """Hidden unit k of weight layer ``layer``: incoming row and bias × c_k, outgoing column ÷ c_k."""
    out = spec.copy()
    wl = out.weight_layers()
    factors = np.asarray(factors, dtype=np.float64)
    wl[layer].weight = wl[layer].weight * factors.reshape((-1,) + (1,) * (wl[layer].weight.ndim - 1))
    if wl[layer].bias is not None:
        wl[layer].bias = wl[layer].bias * factors
    nxt = wl[layer + 1]
    groups = getattr(nxt, "groups", 1)
    if groups == 1:
        nxt.weight = nxt.weight / factors.reshape((1, -1) + (1,) * (nxt.weight.ndim - 2))
    else:
        # Input channel k of a grouped convolution is column k mod (in/groups) of the rows
        # of group k div (in/groups) only.
        weight = nxt.weight.copy()
        in_g, out_g = weight.shape[1], weight.shape[0] // groups
        for k, f in enumerate(factors):
            g = k // in_g
            weight[g * out_g:(g + 1) * out_g, k % in_g] /= f
        nxt.weight = weight
    return out


def rescale_before_norm(spec: NetSpec, layer: int, factors) -> NetSpec:
    """Scale weight layer ``layer`` (followed by BatchNorm/LayerNorm) by c or per channel c_k.

    BatchNorm running statistics are adjusted (mean × c_k, var × c_k²) so the
    inference function is unchanged; LayerNorm needs a scalar c and no bias.
    """
    out = spec.copy()
    flat = []
    for l in out.layers:
        flat.extend(l.body if isinstance(l, Residual) else [l])
    wl = [l for l in flat if isinstance(l, WEIGHT_LAYERS)]
    target = wl[layer]
    norm = flat[flat.index(target) + 1]
    factors = np.broadcast_to(np.asarray(factors, dtype=np.float64), (target.weight.shape[0],)).copy()
    target.weight = target.weight * factors.reshape((-1,) + (1,) * (target.weight.ndim - 1))
    if target.bias is not None:
        target.bias = target.bias * factors
    if isinstance(norm, BatchNorm):
        norm.mean = norm.mean * factors
        norm.var = norm.var * factors**2
    elif isinstance(norm, LayerNorm):
        if not np.allclose(factors, factors[0]):
            raise ValueError("LayerNorm is invariant to one scalar only")
    else:
        raise ValueError(f"weight layer {layer} is not followed by a normalization layer")
    return out


def scale_shift_logits(spec: NetSpec, c: float, shift: float) -> NetSpec:
    """Last dense layer: logits → c · logits + shift."""
    out = spec.copy()
    last = out.weight_layers()[-1]
    last.weight = last.weight * c
    bias = last.bias if last.bias is not None else np.zeros(last.weight.shape[0])
    last.bias = bias * c + shift
    return out
