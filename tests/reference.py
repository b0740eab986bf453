"""One brute-force reference for the Hessian and GGN diagonals of :mod:`tests.netspec` networks.

The netspec forward pass is written once more, in ``jax.numpy`` float64, as a
function of the canonical weights of ``spec.weight_layers()`` (biases and
normalization parameters are constants), and differentiated by full autodiff:

* :func:`hessian_diagonal`: the diagonal of the full Hessian (``jax.hessian``) of
  the **mean** loss with respect to each weight layer's canonical weight (method §6,
  ``exact``);
* :func:`ggn_diagonal`: ``diag((1/N) Σ_n J_nᵀ H_n J_n)`` with ``J_n`` the
  per-sample Jacobian of the network outputs and ``H_n`` the softmax
  cross-entropy Hessian ``diag(p) − ppᵀ`` in them (method §6, ``ggn``). For
  ``nsce`` the outputs are the normalized logits ``u = τ ẑ`` (method §7: the
  Gauss-Newton split is taken after the normalization), so ``J_n`` includes the
  normalization's Jacobian and the GGN stays PSD.

Nothing here shares code with normflat: the normalization is the textbook
formula ``τ (z − z̄)/√(mean((z − z̄)²) + ε)`` with ``ε = 1e-12``, ``τ = 1``.
Results are float64 numpy arrays in the canonical layout, in model order.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from tests import netspec

NSCE_EPS = 1e-12
TEMPERATURE = 1.0
LOSSES = ("ce", "nsce")


def _jax():
    import jax
    import jax.numpy as jnp

    return jax, jnp


def _apply(layer, h, weights: dict, jnp, lax):
    if isinstance(layer, netspec.Dense):
        out = h @ weights[id(layer)].T
        return out + jnp.asarray(layer.bias) if layer.bias is not None else out
    if isinstance(layer, netspec.Conv2d):
        p = layer.padding
        out = lax.conv_general_dilated(
            h, weights[id(layer)], window_strides=(layer.stride, layer.stride), padding=[(p, p), (p, p)],
            dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=layer.groups,
            precision=lax.Precision.HIGHEST)
        return out + jnp.asarray(layer.bias).reshape(1, -1, 1, 1) if layer.bias is not None else out
    if isinstance(layer, netspec.Relu):
        return jnp.maximum(h, 0.0)
    if isinstance(layer, netspec.Tanh):
        return jnp.tanh(h)
    if isinstance(layer, netspec.MaxPool2d):
        n, c, hh, ww = h.shape
        s = layer.size
        h = h[:, :, : hh // s * s, : ww // s * s]
        return h.reshape(n, c, hh // s, s, ww // s, s).max(axis=(3, 5))
    if isinstance(layer, netspec.GlobalAvgPool2d):
        return h.mean(axis=(2, 3))
    if isinstance(layer, netspec.Flatten):
        return h.reshape(h.shape[0], -1)
    if isinstance(layer, netspec.BatchNorm):
        shape = (1, -1) + (1,) * (h.ndim - 2)
        scale = jnp.asarray(layer.gamma / np.sqrt(layer.var + layer.eps))
        mean, beta = jnp.asarray(layer.mean).reshape(shape), jnp.asarray(layer.beta).reshape(shape)
        return (h - mean) * scale.reshape(shape) + beta
    if isinstance(layer, netspec.LayerNorm):
        mu = h.mean(axis=-1, keepdims=True)
        var = ((h - mu) ** 2).mean(axis=-1, keepdims=True)
        return (h - mu) / jnp.sqrt(var + layer.eps) * jnp.asarray(layer.gamma) + jnp.asarray(layer.beta)
    if isinstance(layer, netspec.Residual):
        return h + _run(layer.body, h, weights, jnp, lax)
    raise TypeError(f"unknown layer {layer!r}")


def _run(layers, h, weights, jnp, lax):
    for layer in layers:
        h = _apply(layer, h, weights, jnp, lax)
    return h


def _network(spec: netspec.NetSpec) -> Callable:
    """``f(weights, x) -> logits`` with ``weights`` the canonical arrays of ``spec.weight_layers()``."""
    jax, jnp = _jax()
    keys = [id(layer) for layer in spec.weight_layers()]

    def f(weights, x):
        return _run(spec.layers, x, dict(zip(keys, weights)), jnp, jax.lax)

    return f


def _outputs(z, loss: str):
    """What the softmax cross-entropy sees: the logits (``ce``) or the normalized logits (``nsce``)."""
    _, jnp = _jax()
    if loss == "ce":
        return z
    if loss != "nsce":
        raise ValueError(f"unknown loss {loss!r}")
    zc = z - jnp.mean(z, axis=-1, keepdims=True)
    return TEMPERATURE * zc / jnp.sqrt(jnp.mean(zc**2, axis=-1, keepdims=True) + NSCE_EPS)


def _ce(u, y):
    jax, jnp = _jax()
    logp = jax.nn.log_softmax(u, axis=-1)
    return -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]


def _weights(spec):
    _, jnp = _jax()
    return [jnp.asarray(np.asarray(layer.weight, dtype=np.float64)) for layer in spec.weight_layers()]


def forward(spec: netspec.NetSpec, x: np.ndarray) -> np.ndarray:
    """Logits of ``spec`` on NCHW / feature inputs (float64 numpy), computed by jax."""
    jax, jnp = _jax()
    with jax.enable_x64(True):
        out = _network(spec)(_weights(spec), jnp.asarray(np.asarray(x, dtype=np.float64)))
        return np.asarray(out, dtype=np.float64)


def mean_loss(spec: netspec.NetSpec, x: np.ndarray, y: np.ndarray, loss: str) -> float:
    """Mean training loss (float64)."""
    jax, jnp = _jax()
    with jax.enable_x64(True):
        z = _network(spec)(_weights(spec), jnp.asarray(np.asarray(x, dtype=np.float64)))
        return float(jnp.mean(_ce(_outputs(z, loss), jnp.asarray(y))))


def _flat(spec):
    """The weights as one float64 vector, and ``unflatten(θ) -> [canonical weights]``."""
    _, jnp = _jax()
    ws = _weights(spec)
    shapes = [w.shape for w in ws]
    sizes = [int(np.prod(sh)) for sh in shapes]
    bounds = np.cumsum([0] + sizes)

    def unflatten(theta):
        return [theta[a:b].reshape(sh) for a, b, sh in zip(bounds[:-1], bounds[1:], shapes)]

    def split(vector):
        return [np.asarray(vector[a:b]).reshape(sh) for a, b, sh in zip(bounds[:-1], bounds[1:], shapes)]

    return jnp.concatenate([w.ravel() for w in ws]), unflatten, split


def hessian_diagonal(spec: netspec.NetSpec, x: np.ndarray, y: np.ndarray, loss: str) -> list[np.ndarray]:
    """Diagonal of the full Hessian of the mean loss w.r.t. each weight layer (model order).

    The Hessian is taken with respect to all weights at once (one compilation); its
    diagonal blocks are the per-layer Hessians.
    """
    jax, jnp = _jax()
    with jax.enable_x64(True):
        f = _network(spec)
        theta, unflatten, split = _flat(spec)
        xj, yj = jnp.asarray(np.asarray(x, dtype=np.float64)), jnp.asarray(np.asarray(y, dtype=np.int64))

        def objective(t):
            return jnp.mean(_ce(_outputs(f(unflatten(t), xj), loss), yj))

        h = jax.jit(jax.hessian(objective))(theta)
        out = split(jnp.diagonal(h))
        assert all(a.dtype == np.float64 for a in out)
        return out


def ggn_diagonal(spec: netspec.NetSpec, x: np.ndarray, y: np.ndarray, loss: str) -> list[np.ndarray]:
    """``diag((1/N) Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n)`` per weight layer (model order).

    ``J_n`` is the Jacobian of sample ``n``'s softmax inputs (logits, or normalized
    logits for ``nsce``) with respect to the layer's canonical weight; the labels
    do not enter the GGN.
    """
    del y  # the GGN of softmax cross-entropy does not depend on the labels
    jax, jnp = _jax()
    with jax.enable_x64(True):
        f = _network(spec)
        theta, unflatten, split = _flat(spec)
        xj = jnp.asarray(np.asarray(x, dtype=np.float64))

        def outputs(t):
            return _outputs(f(unflatten(t), xj), loss)  # (N, C)

        u = outputs(theta)
        p = jax.nn.softmax(u, axis=-1)
        h = jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]  # (N, C, C)
        jac = jax.jit(jax.jacfwd(outputs))(theta)  # (N, C, P)
        g = jnp.einsum("nak,nab,nbk->k", jac, h, jac) / xj.shape[0]
        return split(g)
