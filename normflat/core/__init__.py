"""Framework-free core: the per-layer problem, the measures, the solver, the report.

Everything here is written against the array API standard and never imports a
deep-learning framework.
"""

from normflat.core.constants import MEASURE_LABELS, MEASURES
from normflat.core.measures import (
    analyze_problems,
    curvature_and_weight_matrices,
    evaluate_layer,
    normalized_sharpness,
)
from normflat.core.problem import LayerProblem
from normflat.core.report import LayerResult, Report
from normflat.core.solver import ScalingSolution, solve_scaling

__all__ = [
    "LayerProblem", "LayerResult", "MEASURES", "MEASURE_LABELS", "Report", "ScalingSolution",
    "analyze_problems", "curvature_and_weight_matrices", "evaluate_layer", "normalized_sharpness",
    "solve_scaling",
]
