"""normflat.measures (method §10) in every framework: the same network gives the same
numbers everywhere (the invariances are in tests/test_rival_invariance.py)."""

from __future__ import annotations

import pytest

from normflat.engine.rivals import RIVAL_MEASURES
from tests import netspec
from tests._rivals import measures_of
from tests.builders import BUILDERS, load_builder

OTHERS = tuple(b for b in BUILDERS if b != "torch")
SPECS = {
    "mlp": lambda: netspec.mlp((5, 7, 6, 3), seed=21),
    "cnn-maxpool": lambda: netspec.cnn(seed=22),
    "cnn-batchnorm": lambda: netspec.cnn(batchnorm=True, seed=23),
    "cnn-grouped": lambda: netspec.cnn(seed=24, groups=2, channels=(2, 4, 6)),
    # A residual block: the path norm sums the skip paths too, the same in every framework.
    "resnet-block": lambda: netspec.resnet_block(seed=26),
    # Transposed convolutions: the noise is drawn in the canonical layout, the same kernel entries
    # in every framework (flax and equinox store them flipped, method §3).
    "decoder-transposed-conv": lambda: netspec.decoder(seed=27),
}


_TORCH: dict = {}


def _torch(spec_name):
    if spec_name not in _TORCH:
        _TORCH[spec_name] = measures_of(load_builder("torch"), SPECS[spec_name]())
    return _TORCH[spec_name]


#: Every network in Keras and equinox; the flax module systems share the JAX backend's code,
#: so they run the networks whose layouts differ (dense, BatchNorm, grouped and residual
#: convolutions) and skip the plain max-pool CNN, to keep the suite fast.
CASES = [(other, spec) for other in OTHERS for spec in SPECS
         if not (other.startswith("flax") and spec == "cnn-maxpool")]


@pytest.mark.parametrize("other, spec_name", CASES)
def test_same_measures_as_torch(other, spec_name):
    ref = _torch(spec_name)
    got = measures_of(load_builder(other), SPECS[spec_name]())
    assert list(got.values) == list(RIVAL_MEASURES)
    for name in RIVAL_MEASURES:
        assert got.values[name] == pytest.approx(ref.values[name], rel=1e-6, abs=1e-12), name
    assert got.metadata["predictions"] == ref.metadata["predictions"] == 14
    assert got.details["pac_bayes_bound"]["lambda"] == ref.details["pac_bayes_bound"]["lambda"]


def test_the_bound_runs_its_own_analysis_when_no_report_is_given():
    import normflat
    from tests._rivals import CHEAP

    builder = load_builder("torch")
    spec = SPECS["mlp"]()
    x, y = netspec.data(spec, n=14, seed=5)
    model, data = builder.build(spec), builder.make_data(x, y, 5)
    names = ["pac_bayes_bound", "pac_bayes_bound_surrogate"]
    report = normflat.analyze(model, data, estimator="ggn", progress=False)
    given = normflat.measures(model, data, names, report=report, estimator="ggn", progress=False, **CHEAP)
    own = normflat.measures(model, data, names, estimator="ggn", progress=False, **CHEAP)
    assert own.values == given.values and own.metadata["bound_estimator"] == "ggn"


@pytest.mark.parametrize("builder_name", BUILDERS)
def test_non_finite_inputs_are_refused_in_every_framework(builder_name):
    """NaN inputs in a later batch: the engine's error naming it, never a NaN measure (JAX arrays
    and torch tensors on a device are checked by the backends, host arrays by the data contract)."""
    import numpy as np

    import normflat
    from tests._rivals import CHEAP

    builder = load_builder(builder_name)
    spec = SPECS["mlp"]()
    x, y = netspec.data(spec, n=10, seed=5)
    x[7, 1] = np.nan
    with pytest.raises(ValueError, match="Batch 1: the inputs contain NaN or infinite values"):
        normflat.measures(builder.build(spec), builder.make_data(x, y, 5), ["fisher_rao_norm", "adaptive_sharpness"],
                          progress=False, backend_options=builder.ANALYZE_KWARGS, **CHEAP)
