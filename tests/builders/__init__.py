"""Per-framework builders of :mod:`tests.netspec` networks.

Each module ``tests/builders/<name>.py`` (``torch``, ``keras``, ``equinox``,
``flax_nnx``, ``flax_linen``) defines:

``FRAMEWORKS``
    tuple of top-level modules it needs (checked by :func:`load_builder`).
``build(spec, dtype="float64")``
    a native model with exactly the spec's weights (canonical layouts converted
    to the framework's own), in inference mode for BatchNorm.
``predict(model, x)``
    logits as a float64 numpy array for NCHW / feature numpy inputs ``x``.
``make_data(x, y, batch_size)``
    the data object passed to ``normflat.analyze`` (framework-native batches,
    NHWC-transposed where the framework expects it).
``ANALYZE_KWARGS``
    extra backend options for ``normflat.analyze`` (may be empty).

Weight layers must be reported by normflat in the spec's order (residual bodies
inlined), so per-layer results can be compared across frameworks.
"""

from __future__ import annotations

import importlib
import os

import pytest

BUILDERS = ("torch", "keras", "equinox", "flax_nnx", "flax_linen")


def require_frameworks(*modules: str) -> None:
    """Import ``modules`` or skip; with NORMFLAT_REQUIRE_BACKENDS=1 (CI) fail instead."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError as err:
            if os.environ.get("NORMFLAT_REQUIRE_BACKENDS") == "1":
                pytest.fail(f"{mod} is required in CI (NORMFLAT_REQUIRE_BACKENDS=1) but: {err}")
            pytest.skip(f"{mod} not installed")


def load_builder(name: str):
    """Import ``tests.builders.<name>`` after checking its frameworks."""
    try:
        module = importlib.import_module(f"tests.builders.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"tests.builders.{name}":
            if os.environ.get("NORMFLAT_REQUIRE_BACKENDS") == "1":
                pytest.fail(f"builder tests/builders/{name}.py is missing")
            pytest.skip(f"no builder for {name} yet")
        require_frameworks(err.name or name)  # a framework is missing: skip or fail
        raise
    require_frameworks(*module.FRAMEWORKS)
    return module


def stored_groups(groups, stored_shape):
    """Reference group estimates ``(K, out, in, *kernel)`` as the engine stores them: whole, or
    their kernel sums ``(K, out, in, 1, ...)`` when ``stored_shape`` says so (a layer with
    kernel axes, normflat.engine.estimators)."""
    import numpy as np

    groups = np.asarray(groups)
    if tuple(stored_shape) == groups.shape or groups.ndim <= 3:
        return groups
    return groups.sum(axis=tuple(range(3, groups.ndim)), keepdims=True)
