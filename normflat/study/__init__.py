"""The random-label study behind ``normflat study`` (paper §6.1, Fig. 1).

Trains models on partially random labels, computes every measure on each, and
correlates the measures with the generalization gap, before and after random
function-preserving rescalings. See ``docs/study.md``. The figures of the results
are in :mod:`normflat.study.figures` (matplotlib, imported on demand).
"""

from normflat.study.datasets import (DATASETS, Dataset, DatasetNotFoundError, StudyInputError, load_dataset,
                                     load_user_dataset)
from normflat.study.run import StudyConfig, StudyResult, format_table, load_result, run_study
from normflat.study.stats import granulated_kendall, kendall_tau, kendall_tau_ci, pearson_r

__all__ = [
    "DATASETS",
    "Dataset",
    "DatasetNotFoundError",
    "StudyInputError",
    "StudyConfig",
    "StudyResult",
    "format_table",
    "granulated_kendall",
    "kendall_tau",
    "kendall_tau_ci",
    "load_dataset",
    "load_user_dataset",
    "load_result",
    "pearson_r",
    "run_study",
]
