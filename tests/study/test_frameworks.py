"""The Keras and JAX study adapters: models mirror the torch ones, rescalings keep the function."""

from __future__ import annotations

import numpy as np
import pytest

from tests.builders import require_frameworks

FRAMEWORK_MODULES = {"torch": ("torch",), "keras": ("keras",), "jax": ("jax", "equinox", "optax")}


def fitted_briefly(fw, arch, shape, seed=0):
    """A model after one epoch on random data, so BatchNorm statistics are not trivial."""
    rng = np.random.default_rng(seed)
    x = fw.inputs(rng.random((32, *shape), dtype=np.float32))
    y = fw.labels(rng.integers(0, 10, 32))
    model = fw.build(arch, shape, 10, width=None, seed=seed)
    fw.train(model, x, y, epochs=1, lr=1e-2, batch_size=16, weight_decay=0.0, optimizer="adam",
             target_accuracy=2.0, seed=seed, progress=False, desc="")
    return model, x


@pytest.mark.parametrize("framework", ["torch", "keras", "jax"])
@pytest.mark.parametrize("arch, shape", [("cnn-bn", (1, 8, 8)), ("cnn", (1, 28, 28))])
def test_rescaling_keeps_the_function(framework, arch, shape):
    require_frameworks(*FRAMEWORK_MODULES[framework])
    from normflat.study.frameworks import adapter

    fw = adapter(framework)
    model, x = fitted_briefly(fw, arch, shape)
    m64 = fw.float64(model)
    xc = fw.check_inputs(x)
    before = fw._logits(m64, xc) if hasattr(fw, "_logits") else None
    rescaled, spread = fw.rescale(m64, orders=3.0, seed=1)
    assert spread > 4.0
    assert fw.function_error(m64, rescaled, xc) < 1e-12
    if before is not None:  # the original float64 model still computes what it did
        np.testing.assert_array_equal(fw._logits(m64, xc), before)
    # float32 accuracy of the trained model and its float64 copy agree.
    y = fw.labels(np.zeros(len(xc), dtype=np.int64))
    assert fw.accuracy(model, x, y) == pytest.approx(fw.accuracy(m64, xc, y), abs=1 / len(xc) + 1e-12)


def test_unknown_framework():
    from normflat.study.frameworks import adapter

    with pytest.raises(ValueError, match="torch, keras, jax"):
        adapter("mxnet")


@pytest.mark.parametrize("framework", ["torch", "keras", "jax"])
def test_rival_measures_under_the_study_arm(framework):
    """The study's own rescaling (unit-wise ReLU and per-channel before BatchNorm) leaves the
    invariant rival measures where they were and moves the norm products (method §10.5)."""
    require_frameworks(*FRAMEWORK_MODULES[framework])
    import normflat
    from normflat.engine.rivals import INVARIANT, RIVAL_MEASURES
    from normflat.study.frameworks import adapter
    from tests._rivals import CHEAP

    fw = adapter(framework)
    model, x = fitted_briefly(fw, "cnn-bn", (1, 8, 8))
    m64 = fw.float64(model)
    rescaled, _ = fw.rescale(m64, orders=2.0, seed=3)
    y = fw.labels(np.random.default_rng(1).integers(0, 10, len(x)))
    data, kwargs = fw.analysis_data(fw.check_inputs(x), y, 16)
    values = []
    for m in (m64, rescaled):
        report = normflat.analyze(m, data, estimator="ggn", progress=False, **kwargs)
        values.append(normflat.measures(m, data, report=report, progress=False, backend_options=kwargs,
                                        grid_step=1e-7, **CHEAP).values)
    before, after = values
    for name in RIVAL_MEASURES:
        if INVARIANT[name] is False:
            assert abs(after[name] - before[name]) > 1e-2, name
        else:
            assert after[name] == pytest.approx(before[name], rel=1e-5 if name.startswith("pac") else 1e-7), name
