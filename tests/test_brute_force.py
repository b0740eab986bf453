"""Every backend's ``exact`` and ``ggn`` diagonals against one brute-force reference.

:mod:`tests.reference` differentiates a jax float64 re-implementation of the
netspec forward pass with full autodiff (method §6: the Hessian of the mean
loss; the GGN ``J_nᵀ H_n J_n`` with the split after the normalization of
``nsce``, method §7). Each builder's model must give the same per-layer
diagonals, in model order, to 1e-10 relative.
"""

from __future__ import annotations

import numpy as np
import pytest

import normflat
from tests import netspec, reference
from tests.builders import BUILDERS, load_builder

RTOL = 1e-10
N = 8
BATCH = 3  # 3 + 3 + 2: several uneven batches

SPECS = {
    "mlp-bias": lambda: netspec.mlp((5, 7, 4), seed=21),
    "mlp-tanh": lambda: netspec.mlp((5, 6, 3), activation="tanh", seed=22),
    "cnn-maxpool": lambda: netspec.cnn(image=4, seed=23),
    "cnn-grouped": lambda: netspec.cnn(channels=(2, 4, 6), groups=2, image=4, maxpool=False, seed=24),
    "cnn-depthwise": lambda: netspec.cnn(channels=(2, 4, 4), groups=4, image=4, maxpool=False, seed=25),
    "cnn-batchnorm": lambda: netspec.cnn(batchnorm=True, image=4, seed=26),
    "mlp-layernorm": lambda: netspec.mlp((5, 6, 3), layernorm=True, seed=27),
    "resnet-block": lambda: netspec.resnet_block(image=4, seed=28),
}
KINDS = {"exact": reference.hessian_diagonal, "ggn": reference.ggn_diagonal}

_CACHE: dict = {}


def _reference(spec_name, loss, kind):
    """The reference diagonal, computed once per (spec, loss, estimator) for all builders."""
    key = (spec_name, loss, kind)
    if key not in _CACHE:
        spec = SPECS[spec_name]()
        x, y = netspec.data(spec, n=N, seed=5)
        _CACHE[key] = KINDS[kind](spec, x, y, loss)
    return _CACHE[key]


def _numpy(a):
    if hasattr(a, "detach"):
        a = a.detach().cpu()
    return np.asarray(a, dtype=np.float64)


def _assert_layers_close(got, ref, what):
    scale = max(float(np.max(np.abs(r))) for r in ref)
    assert scale > 0, "degenerate reference"
    assert len(got) == len(ref), f"{what}: {len(got)} layers, expected {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape, f"{what}: layer {i} has shape {g.shape}, expected {r.shape}"
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=1e-13 * scale, err_msg=f"{what}: layer {i}")


# ----------------------------------------------------------------------------- the reference itself


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_reference_forward_equals_netspec(spec_name):
    pytest.importorskip("jax")
    spec = SPECS[spec_name]()
    x, _ = netspec.data(spec, n=N, seed=5)
    np.testing.assert_allclose(reference.forward(spec, x), netspec.forward(spec, x), rtol=1e-12, atol=1e-12)


def test_reference_linear_model_closed_form():
    pytest.importorskip("jax")
    from tests.engine._fakes import linear_ggn_diagonal

    spec = netspec.mlp((4, 3), bias=False, seed=29)
    x, y = netspec.data(spec, n=N, seed=5)
    w = spec.weight_layers()[0].weight
    for loss in ("ce", "nsce"):
        (ggn,) = reference.ggn_diagonal(spec, x, y, loss)
        np.testing.assert_allclose(ggn, linear_ggn_diagonal(w, x, loss), rtol=1e-12)
    (hess,) = reference.hessian_diagonal(spec, x, y, "ce")  # linear + ce: Hessian = GGN
    np.testing.assert_allclose(hess, linear_ggn_diagonal(w, x, "ce"), rtol=1e-12)


def test_reference_hessian_matches_finite_differences():
    pytest.importorskip("jax")
    spec = netspec.mlp((3, 4, 3), activation="tanh", seed=30)
    x, y = netspec.data(spec, n=N, seed=5)
    (h0, _) = reference.hessian_diagonal(spec, x, y, "nsce")
    step = 1e-4
    for idx in [(0, 0), (2, 1), (3, 2)]:
        vals = []
        for d in (-step, 0.0, step):
            s = spec.copy()
            s.weight_layers()[0].weight[idx] += d
            vals.append(reference.mean_loss(s, x, y, "nsce"))
        fd = (vals[0] - 2 * vals[1] + vals[2]) / step**2
        assert fd == pytest.approx(h0[idx], rel=1e-5, abs=1e-7)


def test_reference_relu_ce_hessian_equals_ggn():
    # method §6: piecewise linear networks with softmax cross-entropy have Hessian
    # diagonal = GGN diagonal; tanh networks and nsce do not.
    pytest.importorskip("jax")
    for name, same in [("mlp-bias", True), ("cnn-maxpool", True), ("mlp-tanh", False)]:
        h, g = _reference(name, "ce", "exact"), _reference(name, "ce", "ggn")
        close = all(np.allclose(a, b, rtol=1e-10, atol=1e-14) for a, b in zip(h, g))
        assert close == same, name
    h, g = _reference("mlp-bias", "nsce", "exact"), _reference("mlp-bias", "nsce", "ggn")
    assert not all(np.allclose(a, b, rtol=1e-6) for a, b in zip(h, g))


# ----------------------------------------------------------------------------- every backend


def _cases():
    # Measured on the shared 2-core machine: exact Hessians of the conv nets (one HVP
    # per weight entry), the residual block, and Keras' exact path take > 3 s.
    for builder_name in BUILDERS:
        for spec_name in SPECS:
            for loss in reference.LOSSES:
                for kind in KINDS:
                    slow = (spec_name == "resnet-block" or (kind == "exact" and not spec_name.startswith("mlp"))
                            or (kind == "exact" and builder_name == "keras"))
                    yield pytest.param(builder_name, spec_name, loss, kind, marks=[pytest.mark.slow] if slow else [],
                                       id=f"{builder_name}-{spec_name}-{loss}-{kind}")


@pytest.mark.parametrize("builder_name,spec_name,loss,kind", list(_cases()))
def test_backend_equals_brute_force(builder_name, spec_name, loss, kind):
    builder = load_builder(builder_name)
    pytest.importorskip("jax")
    spec = SPECS[spec_name]()
    x, y = netspec.data(spec, n=N, seed=5)
    model = builder.build(spec)
    got = normflat.hessian_diagonal(model, builder.make_data(x, y, BATCH), loss=loss, estimator=kind,
                                    progress=False, **builder.ANALYZE_KWARGS)
    assert len(got) == len(spec.weight_layers())
    _assert_layers_close([_numpy(v) for v in got.values()], _reference(spec_name, loss, kind),
                         f"{builder_name} {spec_name} {loss} {kind}")
