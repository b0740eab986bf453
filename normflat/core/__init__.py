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
from normflat.core.options import ESTIMATORS, LOSSES, NSCE_EPS, ON_UNSUPPORTED, AnalysisOptions, validate_options
from normflat.core.problem import LayerProblem
from normflat.core.report import LayerResult, Report
from normflat.core.solver import ScalingSolution, solve_scaling

__all__ = [
    "AnalysisOptions", "ESTIMATORS", "LOSSES", "LayerProblem", "LayerResult", "MEASURES", "MEASURE_LABELS",
    "NSCE_EPS", "ON_UNSUPPORTED", "Report", "ScalingSolution", "analyze_problems",
    "curvature_and_weight_matrices", "evaluate_layer", "normalized_sharpness", "solve_scaling",
    "validate_options",
]
