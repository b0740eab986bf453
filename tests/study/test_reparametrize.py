"""Function-preserving rescalings: the function is unchanged, the parameters are not."""

from __future__ import annotations

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch")

import torch  # noqa: E402

import normflat  # noqa: E402
from normflat.study.models import build_model  # noqa: E402
from normflat.study.reparametrize import (  # noqa: E402
    FunctionChangedError,
    apply_rescaling,
    check_same_function,
    random_rescaling,
)
from normflat.study.run import torch_loader  # noqa: E402
from normflat.study.training import corrupt_labels  # noqa: E402


def trained_like(arch, shape=(1, 8, 8), seed=0):
    """A float64 model with non-trivial BatchNorm statistics and parameters."""
    model = build_model(arch, shape, 10, seed=seed, width=16 if arch == "mlp" else None).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen, dtype=torch.float64))
                m.running_var.copy_(torch.rand(m.num_features, generator=gen, dtype=torch.float64) + 0.1)
                m.weight.copy_(torch.randn(m.num_features, generator=gen, dtype=torch.float64))
    return model.eval()


@pytest.mark.parametrize("arch", ["mlp", "cnn", "cnn-bn"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28)])
def test_rescaling_preserves_function_and_changes_parameters(arch, shape):
    model = trained_like(arch, shape)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    resc = random_rescaling(model, orders=3.0, seed=5)
    assert resc.spread > 4.0  # the draws really cover several decades
    if arch == "cnn-bn":
        assert set(resc.kinds.values()) == {"before-batchnorm", "relu-unit"}
    new = apply_rescaling(model, resc)
    x = torch.rand(20, *shape, dtype=torch.float64)
    assert check_same_function(model, new, x, rtol=1e-12) <= 1e-12
    for k, v in model.state_dict().items():  # the original is untouched
        assert torch.equal(v, before[k])
    changed = [k for k, v in new.state_dict().items() if k.endswith("weight") and not torch.allclose(v, before[k])]
    assert len(changed) >= 2


def test_check_same_function_detects_a_change():
    model = trained_like("mlp")
    other = apply_rescaling(model, random_rescaling(model, orders=1.0, seed=0))
    with torch.no_grad():
        other[-1].weight.mul_(1.01)  # the output layer is not part of any symmetry
    with pytest.raises(FunctionChangedError, match="not function-preserving"):
        check_same_function(model, other, torch.rand(5, 1, 8, 8, dtype=torch.float64))


def test_normalized_sharpness_is_invariant_and_trace_is_not():
    require_frameworks("normflat.backends.torch")
    model = trained_like("cnn-bn")
    x = torch.rand(40, 1, 8, 8, dtype=torch.float64)
    y = torch.as_tensor(np.arange(40) % 10)
    loader = torch_loader(x, y, 16)
    base = normflat.analyze(model, loader, estimator="ggn", progress=False)
    new = apply_rescaling(model, random_rescaling(model, orders=2.0, seed=3))
    rep = normflat.analyze(new, loader, estimator="ggn", progress=False)
    assert rep.normalized_sharpness == pytest.approx(base.normalized_sharpness, rel=1e-8)
    assert rep.elementwise_bound == pytest.approx(base.elementwise_bound, rel=1e-8)
    for a, b in zip(base.layers, rep.layers):
        assert b.normalized_sharpness == pytest.approx(a.normalized_sharpness, rel=1e-8)
    assert abs(np.log10(rep.hessian_trace / base.hessian_trace)) > 0.3


def test_corrupt_labels():
    y = np.arange(1000) % 10
    for ratio in (0.0, 0.3, 1.0):
        z = corrupt_labels(y, ratio, 10, seed=1)
        changed = np.mean(z != y)
        # Redrawn labels keep their value with probability 1/10.
        assert changed == pytest.approx(ratio * 0.9, abs=0.04)
        np.testing.assert_array_equal(z, corrupt_labels(y, ratio, 10, seed=1))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        corrupt_labels(y, 1.5, 10, seed=0)
