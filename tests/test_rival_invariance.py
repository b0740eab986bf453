"""normflat.measures (method §10) under the function-preserving rescalings of method §8,
in every framework: each measure keeps or loses its value as method §10.5 says."""

from __future__ import annotations

import numpy as np
import pytest

import normflat
from normflat.engine.rivals import INVARIANT, RIVAL_MEASURES
from tests import netspec
from tests._rivals import measures_of
from tests.builders import BUILDERS, load_builder

#: A fine hyperprior grid makes the bound's rounding negligible, so its invariance can be checked.
FINE_GRID = dict(grid_step=1e-7, grid_range=30.0)

SPECS = {
    "mlp": lambda: netspec.mlp((5, 7, 6, 3), seed=21),
    "cnn-batchnorm": lambda: netspec.cnn(batchnorm=True, seed=23),
    "cnn-grouped": lambda: netspec.cnn(seed=24, groups=2, channels=(2, 4, 6)),
    "decoder-transposed-conv": lambda: netspec.decoder(seed=28),
}


def _check_invariance(builder, spec, transformed, *, unit_wise: bool):
    x, _ = netspec.data(spec, n=14, seed=5)
    np.testing.assert_allclose(netspec.forward(transformed, x), netspec.forward(spec, x), rtol=1e-10, atol=1e-11)
    before = measures_of(builder, spec, **FINE_GRID)
    after = measures_of(builder, transformed, **FINE_GRID)
    for name in RIVAL_MEASURES:
        if INVARIANT[name] is False:
            moved = abs(after.values[name] - before.values[name]) > 1e-3 * max(abs(before.values[name]), 1.0)
            assert moved == unit_wise, name  # the norm products survive only whole-layer factors
        else:
            # epsilon=0 makes the magnitude-aware measure exact, a fine grid the bound.
            rel = 1e-5 if name.startswith("pac_bayes") else 1e-7
            assert after.values[name] == pytest.approx(before.values[name], rel=rel, abs=1e-12), name


@pytest.fixture(params=BUILDERS)
def builder(request):
    return load_builder(request.param)


def test_unit_wise_relu_rescaling(builder):
    spec = SPECS["mlp"]()
    factors = 10.0 ** np.random.default_rng(0).uniform(-1.5, 1.5, size=7)
    _check_invariance(builder, spec, netspec.rescale_units(spec, 0, factors), unit_wise=True)


#: Every layer kind in torch, Keras and equinox. The flax module systems share the JAX
#: backend's code with equinox and differ in their layer layouts, which the unit-wise case
#: (every builder), BatchNorm (nnx) and the cross-framework test cover: fewer repeats, to keep
#: the suite within its time.
CORE = ("torch", "keras", "equinox")


@pytest.mark.parametrize("name", CORE)
def test_layer_wise_rescaling(name):
    builder = load_builder(name)
    spec = SPECS["mlp"]()
    _check_invariance(builder, spec, netspec.rescale_layers(spec, 1, 2, 7.0), unit_wise=False)


@pytest.mark.parametrize("name", (*CORE, "flax_nnx"))
def test_per_channel_rescaling_before_batchnorm(name):
    builder = load_builder(name)
    spec = SPECS["cnn-batchnorm"]()
    factors = 10.0 ** np.random.default_rng(1).uniform(-1.5, 1.5, size=4)
    _check_invariance(builder, spec, netspec.rescale_before_norm(spec, 0, factors), unit_wise=True)


@pytest.mark.parametrize("name", CORE)
def test_channel_rescaling_into_a_grouped_convolution(name):
    builder = load_builder(name)
    spec = SPECS["cnn-grouped"]()
    factors = 10.0 ** np.random.default_rng(2).uniform(-1.5, 1.5, size=4)
    _check_invariance(builder, spec, netspec.rescale_units(spec, 0, factors), unit_wise=True)


@pytest.mark.parametrize("name", CORE + ("flax_nnx",))
def test_channel_rescaling_through_a_transposed_convolution(name):
    # The first transposed convolution's output channels against the next one's inputs: its rows and
    # the next one's columns, whichever axes each framework stores them on (flax's kernel moved and
    # flipped, method §3).
    builder = load_builder(name)
    spec = SPECS["decoder-transposed-conv"]()
    factors = 10.0 ** np.random.default_rng(3).uniform(-1.5, 1.5, size=4)
    _check_invariance(builder, spec, netspec.rescale_units(spec, 1, factors), unit_wise=True)


@pytest.mark.parametrize("name", CORE)
def test_magnitude_aware_noise_floor_breaks_invariance(name):
    builder = load_builder(name)
    spec = SPECS["mlp"]()
    factors = 10.0 ** np.random.default_rng(0).uniform(-1.5, 1.5, size=7)
    transformed = netspec.rescale_units(spec, 0, factors)
    names = ["magnitude_aware_sharpness"]
    before = measures_of(builder, spec, names, epsilon=0.05)
    after = measures_of(builder, transformed, names, epsilon=0.05)
    assert abs(after.magnitude_aware_sharpness / before.magnitude_aware_sharpness - 1) > 1e-3


def test_path_norm_is_refused_the_same_way_everywhere(builder):
    spec = netspec.mlp((5, 6, 3), activation="tanh", seed=25)
    with pytest.raises(normflat.UnsupportedMeasureError, match="path_norm is defined for feed-forward ReLU"):
        measures_of(builder, spec, ["path_norm"])
    # The other measures are defined for any model.
    assert measures_of(builder, spec, ["fisher_rao_norm"]).fisher_rao_norm > 0


def test_bad_input_gets_the_same_error_everywhere(builder):
    spec = SPECS["mlp"]()
    x, y = netspec.data(spec, n=6)
    model, data = builder.build(spec), builder.make_data(x, y, 3)
    with pytest.raises(ValueError, match="custom loss callable"):
        normflat.measures(model, data, loss=lambda z, t: z.sum(), progress=False)
    with pytest.raises(TypeError, match="one-shot iterator"):
        normflat.measures(model, iter(list(data) if not isinstance(data, tuple) else [data]), progress=False)
    with pytest.raises(ValueError, match="Unknown measure"):
        normflat.measures(model, data, ["sharpness"], progress=False)
    with pytest.raises(TypeError, match="Unknown measure setting"):
        normflat.measures(model, data, rhoo=1.0, progress=False)
