"""normflat: normalized sharpness, a reparametrization-invariant flatness measure.

Implements Tsuzuku, Sato & Sugiyama, "Normalized Flat Minima" (ICML 2020) for
PyTorch, Keras/TensorFlow and JAX models. Importing normflat imports no
deep-learning framework; backends load when a model of theirs is analyzed.
"""

from normflat.api import analyze, hessian_diagonal, measures
from normflat.backends import register_backend
from normflat.core import (
    MEASURES,
    LayerProblem,
    LayerResult,
    Report,
    normalized_sharpness,
    solve_scaling,
)
from normflat.core.report import compare_reports, load_report
from normflat.engine.options import ESTIMATORS, LOSSES
from normflat.engine.perturbation import UnsupportedMeasureError
from normflat.engine.rivals import RIVAL_MEASURES, MeasureSettings, MeasuresReport

__version__ = "0.1.0"

__all__ = [
    "ESTIMATORS",
    "LOSSES",
    "MEASURES",
    "MeasureSettings",
    "MeasuresReport",
    "RIVAL_MEASURES",
    "UnsupportedMeasureError",
    "LayerProblem",
    "LayerResult",
    "Report",
    "analyze",
    "compare_reports",
    "hessian_diagonal",
    "load_report",
    "measures",
    "normalized_sharpness",
    "register_backend",
    "solve_scaling",
    "__version__",
]
