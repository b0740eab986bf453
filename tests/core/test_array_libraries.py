"""The core gives the same numbers for numpy, torch, jax and array_api_strict inputs."""

from __future__ import annotations

import numpy as np
import pytest

import normflat
from tests.builders import require_frameworks


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(0)
    W = rng.normal(size=(6, 4, 3))
    H = rng.normal(size=(6, 4, 3)) + 0.3
    H[2] = 0.0  # exercise the degenerate path in every library
    return W, H, normflat.normalized_sharpness(W, H)


def _same(result, ref):
    for measure in normflat.MEASURES:
        assert getattr(result, measure) == pytest.approx(getattr(ref, measure), rel=1e-12)
    np.testing.assert_allclose(result.row_sigma, ref.row_sigma, rtol=1e-9)
    np.testing.assert_allclose(result.col_sigma, ref.col_sigma, rtol=1e-9)
    assert result.degenerate_rows == ref.degenerate_rows
    assert result.clipped == ref.clipped


def test_torch_inputs(layer):
    require_frameworks("torch")
    import torch

    W, H, ref = layer
    _same(normflat.normalized_sharpness(torch.tensor(W), torch.tensor(H)), ref)
    # float32 inputs are promoted to float64 for the solve.
    res32 = normflat.normalized_sharpness(torch.tensor(W, dtype=torch.float32), torch.tensor(H, dtype=torch.float32))
    assert res32.value == pytest.approx(ref.value, rel=1e-5)


def test_jax_inputs(layer):
    require_frameworks("jax")
    import jax
    import jax.numpy as jnp

    W, H, ref = layer
    with jax.enable_x64(True):
        _same(normflat.normalized_sharpness(jnp.asarray(W), jnp.asarray(H)), ref)
    # Without x64 jax holds float32 only; the core moves the solve to numpy float64.
    res = normflat.normalized_sharpness(jnp.asarray(W, dtype=jnp.float32), jnp.asarray(H, dtype=jnp.float32))
    assert res.value == pytest.approx(ref.value, rel=1e-5)


def test_array_api_strict_inputs(layer):
    require_frameworks("array_api_strict")
    import array_api_strict as xps

    W, H, ref = layer
    _same(normflat.normalized_sharpness(xps.asarray(W), xps.asarray(H)), ref)


def test_float32_numpy(layer):
    W, H, ref = layer
    res = normflat.normalized_sharpness(W.astype(np.float32), H.astype(np.float32))
    assert res.value == pytest.approx(ref.value, rel=1e-5)


def test_float64_support_is_read_without_a_warning_or_a_filter():
    """Which libraries hold float64, told without creating an array and without touching the
    warning filters, in two threads at once (a ``catch_warnings`` block in each thread could
    leave one thread's "ignore" installed for good)."""
    import sys
    import threading
    import warnings

    import array_api_compat
    import array_api_strict as xps
    import torch

    from normflat.core._arrays import holds_float64

    require_frameworks("jax", "torch", "array_api_strict")
    import jax
    import jax.numpy as jnp

    namespaces = [array_api_compat.array_namespace(a)
                  for a in (np.empty(0), torch.empty(0), jnp.empty(0), xps.asarray([0.0]))]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert [holds_float64(xp) for xp in namespaces] == [True, True, bool(jax.config.jax_enable_x64), True]
        with jax.enable_x64(True):
            assert holds_float64(namespaces[2])
        with jax.enable_x64(False):
            assert not holds_float64(namespaces[2])
    assert not seen  # jax's "float64 is not available" warning is never triggered
    filters, interval = list(warnings.filters), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=lambda: [holds_float64(xp) for _ in range(3000) for xp in namespaces])
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert list(warnings.filters) == filters
