"""Shared by the tests of normflat.measures: cheap settings and one call on a netspec network."""

from __future__ import annotations

import normflat
from tests import netspec

#: Cheap settings: every code path, few passes (epsilon=0: the magnitude-aware measure is then
#: exactly scale invariant, method §10.5).
CHEAP = dict(steps=6, average_draws=3, magnitude_draws=2, bisections=10, bound_draws=4, lambda_grid=16,
             epsilon=0.0)


def measures_of(builder, spec, names=None, n=14, batch_size=5, **settings):
    """``normflat.measures`` of ``spec`` built by ``builder`` on its netspec data, with the
    variances of a ``ggn`` analysis for the bound."""
    x, y = netspec.data(spec, n=n, seed=5)
    model = builder.build(spec)
    data = builder.make_data(x, y, batch_size)
    report = normflat.analyze(model, data, loss="nsce", estimator="ggn", progress=False, **builder.ANALYZE_KWARGS)
    return normflat.measures(model, data, names, report=report, progress=False, seed=3,
                             backend_options=builder.ANALYZE_KWARGS, **{**CHEAP, **settings})
