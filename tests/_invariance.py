"""What a function-preserving rescaling must leave as it is, on two reports of any framework
(method §8): shared by the invariance tests of the backends."""

from __future__ import annotations

import pytest

#: Relative tolerance of a normalized sharpness under a rescaling (float64 models).
RTOL_INVARIANT = 1e-8


def assert_reports_invariant(before, after, moved, generic=(), rtol: float = RTOL_INVARIANT) -> None:
    """``after`` analyzes ``before``'s model rescaled: the same layers, each on the path expected in
    both (``generic``: the layers on the generic path, names or a predicate on the name; the others
    on their fast rule), every layer's normalized sharpness and the total the same (``rtol``
    relative, 1e-8 unless the model computes partly in float32), and the Hessian trace of every
    layer in ``moved`` changed by more than 1e-3 relative."""
    assert [layer.name for layer in before.layers] == [layer.name for layer in after.layers]
    is_generic = generic if callable(generic) else generic.__contains__
    for lb, la in zip(before.layers, after.layers):
        path = "generic" if is_generic(lb.name) else "fast"
        assert lb.details["path"] == la.details["path"] == path, (lb.name, lb.details)
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=rtol, abs=1e-300), lb.name
    assert after.normalized_sharpness == pytest.approx(before.normalized_sharpness, rel=rtol)
    for name in moved:
        tb, ta = before.layer(name).hessian_trace, after.layer(name).hessian_trace
        assert abs(ta - tb) > 1e-3 * abs(tb), (name, tb, ta)
