"""flax linen builder of :mod:`tests.netspec` networks: ``(module, variables)``, NHWC.

Kernels are (*k, in, out). Submodules get flax's automatic names (``Dense_0``,
``Conv_1``, ``Residual_0/Conv_0``), whose sorted order differs from the model
order, so the test also checks that normflat reports layers in call order.
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tests import netspec  # noqa: E402
from tests.builders.flax_nnx import make_data, to_nhwc  # noqa: E402,F401  (same NHWC data)

FRAMEWORKS = ("jax", "flax")
ANALYZE_KWARGS: dict = {}


class Net(nn.Module):
    """Runs a static description: tuples such as ("dense", out, bias) or ("res", body)."""

    desc: tuple
    dtype: str = "float64"

    @nn.compact
    def __call__(self, h):
        for item in self.desc:
            kind = item[0]
            if kind == "dense":
                h = nn.Dense(item[1], use_bias=item[2], param_dtype=self.dtype)(h)
            elif kind == "conv":
                _, out, k, stride, p, groups, bias = item
                h = nn.Conv(out, (k, k), strides=stride, padding=[(p, p), (p, p)], feature_group_count=groups,
                            use_bias=bias, param_dtype=self.dtype)(h)
            elif kind == "up":
                _, out, k, stride, crop, bias = item
                h = nn.ConvTranspose(out, (k, k), strides=(stride, stride), padding=[(crop, crop), (crop, crop)],
                                     use_bias=bias, param_dtype=self.dtype)(h)
            elif kind == "relu":
                h = nn.relu(h)
            elif kind == "tanh":
                h = jnp.tanh(h)
            elif kind == "maxpool":
                h = nn.max_pool(h, (item[1], item[1]), strides=(item[1], item[1]))
            elif kind == "gap":
                h = h.mean(axis=(1, 2))
            elif kind == "flatten":
                h = h.reshape(h.shape[0], -1)
            elif kind == "bn":
                h = nn.BatchNorm(use_running_average=True, epsilon=item[1], param_dtype=self.dtype)(h)
            elif kind == "ln":
                h = nn.LayerNorm(epsilon=item[1], param_dtype=self.dtype)(h)
            elif kind == "res":
                h = h + Net(item[1], self.dtype, name=None)(h)
        return h


def _describe(layers, params, stats, counters):
    """Static description plus the variables under flax's automatic names."""
    desc = []

    def name(cls):
        i = counters.get(cls, 0)
        counters[cls] = i + 1
        return f"{cls}_{i}"

    for layer in layers:
        if isinstance(layer, netspec.Dense):
            desc.append(("dense", layer.weight.shape[0], layer.bias is not None))
            p = {"kernel": layer.weight.T}
            if layer.bias is not None:
                p["bias"] = layer.bias
            params[name("Dense")] = p
        elif isinstance(layer, netspec.Conv2d):
            o, _, k, _ = layer.weight.shape
            desc.append(("conv", o, k, layer.stride, layer.padding, layer.groups, layer.bias is not None))
            p = {"kernel": layer.weight.transpose(2, 3, 1, 0)}
            if layer.bias is not None:
                p["bias"] = layer.bias
            params[name("Conv")] = p
        elif isinstance(layer, netspec.ConvTranspose2d):
            o, _, k, _ = layer.weight.shape
            # flax correlates the dilated, padded input with its kernel (k, k, in, out): torch's kernel
            # flipped, the padding k − 1 − torch's.
            desc.append(("up", o, k, layer.stride, k - 1 - layer.padding, layer.bias is not None))
            p = {"kernel": layer.weight[:, :, ::-1, ::-1].transpose(2, 3, 1, 0)}
            if layer.bias is not None:
                p["bias"] = layer.bias
            params[name("ConvTranspose")] = p
        elif isinstance(layer, netspec.Relu):
            desc.append(("relu",))
        elif isinstance(layer, netspec.Tanh):
            desc.append(("tanh",))
        elif isinstance(layer, netspec.MaxPool2d):
            desc.append(("maxpool", layer.size))
        elif isinstance(layer, netspec.GlobalAvgPool2d):
            desc.append(("gap",))
        elif isinstance(layer, netspec.Flatten):
            desc.append(("flatten",))
        elif isinstance(layer, netspec.BatchNorm):
            desc.append(("bn", layer.eps))
            n = name("BatchNorm")
            params[n] = {"scale": layer.gamma, "bias": layer.beta}
            stats[n] = {"mean": layer.mean, "var": layer.var}
        elif isinstance(layer, netspec.LayerNorm):
            desc.append(("ln", layer.eps))
            params[name("LayerNorm")] = {"scale": layer.gamma, "bias": layer.beta}
        elif isinstance(layer, netspec.Residual):
            sub_p, sub_s = {}, {}
            desc.append(("res", _describe(layer.body, sub_p, sub_s, {})))
            n = name("Net")
            params[n] = sub_p
            if sub_s:
                stats[n] = sub_s
        else:
            raise TypeError(f"unknown layer {layer!r}")
    return tuple(desc)


def build(spec: netspec.NetSpec, dtype="float64"):
    params, stats = {}, {}
    desc = _describe(spec.layers, params, stats, {})
    module = Net(desc, str(jnp.dtype(dtype)))
    variables = {"params": params}
    if stats:
        variables["batch_stats"] = stats
    variables = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), variables)
    # The hand-built variables must have exactly flax's own structure.
    x0 = jnp.zeros((1,) + tuple(to_nhwc(np.zeros((1,) + spec.input_shape)).shape[1:]), dtype)
    init = jax.eval_shape(module.init, jax.random.key(0), x0)
    assert jax.tree_util.tree_structure(init) == jax.tree_util.tree_structure(variables), (init, variables)
    return module, variables


def predict(model, x):
    module, variables = model
    return np.asarray(module.apply(variables, jnp.asarray(to_nhwc(x))), dtype=np.float64)
