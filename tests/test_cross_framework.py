"""The same network (same weights, same data) gives the same report in every framework.

PyTorch is the reference; every other builder must match its totals and its
per-layer values to 1e-6 relative (float64).
"""

from __future__ import annotations

import numpy as np
import pytest

import normflat
from tests import netspec
from tests.builders import load_builder

OTHERS = ("keras", "equinox", "flax_nnx", "flax_linen")

SPECS = {
    "mlp-relu": lambda: netspec.mlp((6, 9, 7, 4), seed=11),
    "mlp-tanh-layernorm": lambda: netspec.mlp((6, 8, 4), activation="tanh", layernorm=True, seed=12),
    "cnn-maxpool": lambda: netspec.cnn(seed=13),
    "cnn-batchnorm": lambda: netspec.cnn(batchnorm=True, activation="tanh", seed=14),
    "resnet-block": lambda: netspec.resnet_block(seed=15),
    "decoder-transposed-conv": lambda: netspec.decoder(seed=17),
}
# ggn under nsce and the exact Hessian under ce: together they cross-check both losses and both
# kernel families (the loss's signals are engine code shared by every framework).
SETTINGS = [("nsce", "ggn"), ("ce", "exact")]


def _report(builder, spec, loss, estimator):
    x, y = netspec.data(spec, n=10, seed=3)
    model = builder.build(spec)
    data = builder.make_data(x, y, 4)  # batches of 4, 4, 2: uneven sizes
    return normflat.analyze(model, data, loss=loss, estimator=estimator, progress=False, **builder.ANALYZE_KWARGS)


@pytest.fixture(scope="module")
def torch_builder():
    return load_builder("torch")


_TORCH_REPORTS: dict = {}


def _torch_report(builder, spec_name, loss, estimator):
    """The torch reference, computed once per setting for all the other frameworks."""
    key = (spec_name, loss, estimator)
    if key not in _TORCH_REPORTS:
        _TORCH_REPORTS[key] = _report(builder, SPECS[spec_name](), loss, estimator)
    return _TORCH_REPORTS[key]


@pytest.mark.parametrize("other", OTHERS)
@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("loss, estimator", SETTINGS)
def test_same_report_as_torch(torch_builder, other, spec_name, loss, estimator):
    builder = load_builder(other)
    spec = SPECS[spec_name]()
    ref = _torch_report(torch_builder, spec_name, loss, estimator)
    got = _report(builder, spec, loss, estimator)
    assert len(got.layers) == len(ref.layers) == len(spec.weight_layers())
    for measure in normflat.MEASURES:
        assert getattr(got, measure) == pytest.approx(getattr(ref, measure), rel=1e-6), measure
    for lg, lr in zip(got.layers, ref.layers):
        assert lg.shape == lr.shape
        assert lg.normalized_sharpness == pytest.approx(lr.normalized_sharpness, rel=1e-6, abs=1e-12)
        assert lg.hessian_trace == pytest.approx(lr.hessian_trace, rel=1e-6, abs=1e-12)
    assert got.metadata["examples"] == ref.metadata["examples"] == 10


@pytest.mark.parametrize("other", OTHERS)
@pytest.mark.parametrize("spec_name", ["cnn-grouped", "decoder-transposed-conv"])
def test_same_hessian_diagonal_as_torch(torch_builder, other, spec_name):
    """Entry by entry in the canonical layout (method §3): a transposed convolution's kernel in torch's
    orientation in every framework, whichever way round each stores it."""
    builder = load_builder(other)
    spec = netspec.cnn(seed=16, groups=2, channels=(2, 4, 6)) if spec_name == "cnn-grouped" else \
        netspec.decoder(seed=18)
    x, y = netspec.data(spec, n=6, seed=4)
    ref = normflat.hessian_diagonal(torch_builder.build(spec), torch_builder.make_data(x, y, 3), loss="ce",
                                    estimator="exact", progress=False, **torch_builder.ANALYZE_KWARGS)
    got = normflat.hessian_diagonal(builder.build(spec), builder.make_data(x, y, 3), loss="ce",
                                    estimator="exact", progress=False, **builder.ANALYZE_KWARGS)
    assert len(got) == len(ref)
    for (name_g, hg), (name_r, hr) in zip(got.items(), ref.items()):
        hg = np.asarray(hg)
        hr = hr.detach().numpy() if hasattr(hr, "detach") else np.asarray(hr)
        np.testing.assert_allclose(hg, hr, rtol=1e-7, atol=1e-12, err_msg=f"{name_g} vs {name_r}")
