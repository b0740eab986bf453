"""Names shared by the core, the figures and the integrations (no imports, so no cycles).

:mod:`normflat.core.report` and :mod:`normflat.plotting` both need the measure
names; keeping them in this leaf module lets each import them without importing
the other.
"""

from __future__ import annotations

__all__ = ["MEASURES", "MEASURE_LABELS"]

#: The four measures of method §4, in display order.
MEASURES = (
    "normalized_sharpness",
    "matrix_normalized_sharpness",
    "hessian_trace",
    "elementwise_bound",
)

#: Display names of the measures (figure axes, printed tables).
MEASURE_LABELS = {
    "normalized_sharpness": "normalized sharpness",
    "matrix_normalized_sharpness": "matrix-normalized sharpness",
    "hessian_trace": "Hessian trace",
    "elementwise_bound": "elementwise bound",
}
