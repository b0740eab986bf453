"""Stacks of identical layers in JAX: one weight per layer along new leading axes (method §3, "Stacked layers").

``nn.scan`` over a linen block (the scan-over-layers of large transformers), ``nnx.vmap`` over the
creation of nnx layers then ``nnx.scan`` over them, and ``eqx.filter_vmap`` over equinox layers then
``lax.scan`` keep a ``(layers, in, out)`` kernel owned by one ``Dense``. Each layer is its own
matrix: the report has ``<path>.0``, ``<path>.1``, ... with the numbers of the same network written
layer by layer. Until 2026-12-07 the stack was read as one convolution kernel with the layers as its
kernel positions (a single, different normalized sharpness, silently).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("jax", "flax", "equinox")

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import normflat  # noqa: E402

jax.config.update("jax_enable_x64", True)
LAYERS = 2
RNG = np.random.default_rng(11)
X, Y = RNG.normal(size=(6, 4, 8)), RNG.integers(0, 3, 6)
F64 = jnp.float64


def _numbers(model, estimator="ggn"):
    report = normflat.analyze(model, (X, Y), loss="ce", estimator=estimator, progress=False)
    assert report.metadata["unsupported"] == [] and report.metadata["coverage"] == 1.0
    return {layer.name: (layer.normalized_sharpness, layer.hessian_trace) for layer in report.layers}


def _assert_same(got, want, names):
    """``got[a] == want[b]`` for every ``(a, b)`` of ``names``, and nothing else reported."""
    assert sorted(got) == sorted(a for a, _ in names) and sorted(want) == sorted(b for _, b in names)
    for a, b in names:
        assert got[a] == pytest.approx(want[b], rel=1e-10), (a, b)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        h = h + nn.MultiHeadDotProductAttention(num_heads=2, param_dtype=F64)(h, h)
        return h + jnp.tanh(nn.Dense(8, param_dtype=F64)(h)), None


class _Stack(nn.Module):
    """``LAYERS`` copies of ``block`` (a linen module ``(h, _) -> (h, None)``) under ``nn.scan``, then a
    dense head on the mean over the tokens."""

    block: Any

    @nn.compact
    def __call__(self, x):
        h, _ = nn.scan(self.block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)()(x, None)
        return nn.Dense(3, param_dtype=F64)(h.mean(1))


class _Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = x
        for i in range(LAYERS):
            h, _ = _Block(name=f"b{i}")(h, None)
        return nn.Dense(3, param_dtype=F64)(h.mean(1))


@pytest.mark.parametrize("estimator", ["ggn", "exact"])
def test_linen_scan_over_attention_blocks_equals_the_unrolled_network(estimator):
    """``nn.scan`` over an attention + dense block: every projection of every layer (multi-axis
    ``DenseGeneral`` kernels included) is its own matrix, with the unrolled network's numbers."""
    scanned = _Stack(_Block)
    stacked = scanned.init(jax.random.PRNGKey(0), X[:1])
    scan = next(k for k in stacked["params"] if k.startswith("Scan"))  # linen's name of the scanned block
    layer = stacked["params"][scan]
    unrolled = {"params": {"Dense_0": stacked["params"]["Dense_0"],
                           **{f"b{i}": jax.tree_util.tree_map(lambda a, i=i: a[i], layer) for i in range(LAYERS)}}}
    np.testing.assert_array_equal(scanned.apply(stacked, X), _Unrolled().apply(unrolled, X))
    parts = ["Dense_0"] + [f"MultiHeadDotProductAttention_0/{p}" for p in ("query", "key", "value", "out")]
    names = [("Dense_0", "Dense_0")] + [(f"{scan}/{p}.{i}", f"b{i}/{p}") for p in parts for i in range(LAYERS)]
    _assert_same(_numbers((scanned, stacked), estimator), _numbers((_Unrolled(), unrolled), estimator), names)


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, param_dtype=F64, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.lin(h))


class _NnxStack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _NnxBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(8, 3, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, block):
            return block(h)

        return self.head(body(x, self.blocks).mean(1))


class _NnxUnrolled(nnx.Module):
    def __init__(self, stack):
        self.blocks = nnx.List([_NnxBlock(nnx.Rngs(i)) for i in range(LAYERS)])
        for i, block in enumerate(self.blocks):
            block.lin.kernel[...] = stack.blocks.lin.kernel[i]
            block.lin.bias[...] = stack.blocks.lin.bias[i]
        self.head = stack.head

    def __call__(self, x):
        h = x
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def test_nnx_vmap_created_layers_scanned_equal_the_unrolled_network():
    stack = _NnxStack(nnx.Rngs(0))
    unrolled = _NnxUnrolled(stack)
    np.testing.assert_allclose(np.asarray(stack(X)), np.asarray(unrolled(X)), rtol=1e-14)
    names = [("head", "head")] + [(f"blocks/lin.{i}", f"blocks/{i}/lin") for i in range(LAYERS)]
    _assert_same(_numbers(stack), _numbers(unrolled), names)


class _EqxStack(eqx.Module):
    blocks: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k, dtype=F64))(jax.random.split(k1, LAYERS))
        self.head = eqx.nn.Linear(8, 3, key=k2, dtype=F64)

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def body(h, p):
            return jnp.tanh(jax.vmap(eqx.combine(p, static))(h)), None

        h, _ = jax.lax.scan(body, x, params)
        return self.head(h.mean(0))


class _EqxUnrolled(eqx.Module):
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, stack):
        params, static = eqx.partition(stack.blocks, eqx.is_array)
        self.blocks = [eqx.combine(jax.tree_util.tree_map(lambda a, i=i: a[i], params), static)
                       for i in range(LAYERS)]
        self.head = stack.head

    def __call__(self, x):
        for block in self.blocks:
            x = jnp.tanh(jax.vmap(block)(x))
        return self.head(x.mean(0))


def test_equinox_filter_vmap_layers_scanned_equal_the_unrolled_network():
    stack = _EqxStack(jax.random.PRNGKey(0))
    unrolled = _EqxUnrolled(stack)
    np.testing.assert_allclose(np.asarray(stack(X[0])), np.asarray(unrolled(X[0])), rtol=1e-14)
    names = [("head", "head")] + [(f"blocks.{i}", f"blocks/{i}") for i in range(LAYERS)]
    _assert_same(_numbers(stack), _numbers(unrolled), names)


class _ReluBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.relu(nn.Dense(8, use_bias=False, param_dtype=F64)(h)), None


def test_unit_rescaling_between_stacked_layers_leaves_normalized_sharpness_unchanged():
    """Layer 0's output units times c_k, layer 1's input columns times 1/c_k (ReLU between, no bias): the
    same function; every layer's normalized sharpness unchanged, their traces moved (method §8 item 2)."""
    stack = _Stack(_ReluBlock)
    params = stack.init(jax.random.PRNGKey(1), X[:1])
    c = jnp.exp(jnp.linspace(-1.0, 1.0, 8))
    scan = next(k for k in params["params"] if k.startswith("Scan"))
    kernel = params["params"][scan]["Dense_0"]["kernel"]  # (layers, in, out)
    moved = jax.tree_util.tree_map(lambda a: a, params)
    moved["params"][scan]["Dense_0"]["kernel"] = kernel.at[0].multiply(c[None, :]).at[1].divide(c[:, None])
    np.testing.assert_allclose(stack.apply(moved, X), stack.apply(params, X), rtol=1e-12, atol=1e-13)
    before, after = _numbers((stack, params), "exact"), _numbers((stack, moved), "exact")
    for name in before:
        assert after[name][0] == pytest.approx(before[name][0], rel=1e-8), name
    for i in range(LAYERS):
        name = f"{scan}/Dense_0.{i}"
        assert abs(after[name][1] - before[name][1]) > 1e-3 * abs(before[name][1]), name


class _ConvBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Conv(8, (3,), padding="SAME", param_dtype=F64)(h)), None


def test_a_stack_of_convolutions_is_skipped_with_the_reason():
    """A scanned convolution's kernel ``(layers, k, in, out)`` is not read as one 2-D convolution kernel:
    it is skipped, named in the warning and in ``unsupported``, with the reason."""
    stack = _Stack(_ConvBlock)
    params = stack.init(jax.random.PRNGKey(2), X[:1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = normflat.analyze((stack, params), (X, Y), loss="ce", progress=False)
    assert [layer.name for layer in report.layers] == ["Dense_0"]
    assert any("a stack of convolution layers" in str(w.message) for w in caught)
    assert any("/Conv_0/kernel (2, 3, 8, 8)" in m and "stack of convolution" in m
               for m in report.metadata["unsupported"]), report.metadata["unsupported"]
