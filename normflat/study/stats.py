"""Rank and linear correlation of a measure with the generalization gap."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["kendall_tau", "pearson_r"]


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b (ties in either variable corrected), by direct pair counting.

    ``tau_b = (C - D) / sqrt((n0 - n1)(n0 - n2))`` with ``C``/``D`` the concordant
    and discordant pairs, ``n0 = n(n-1)/2`` and ``n1``/``n2`` the pairs tied in
    ``x``/``y``. O(n²), which is fine for the tens to hundreds of models of a study.

    Returns:
        tau in [-1, 1]; NaN when fewer than two points remain or either variable is
        constant, or when any value is not finite.
    """
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"kendall_tau needs two 1-D sequences of equal length, got {a.shape} and {b.shape}.")
    if len(a) < 2 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    i, j = np.triu_indices(len(a), k=1)
    sa, sb = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
    s = float(np.sum(sa * sb))
    untied_a, untied_b = float(np.count_nonzero(sa)), float(np.count_nonzero(sb))
    if untied_a == 0 or untied_b == 0:
        return float("nan")
    return s / math.sqrt(untied_a * untied_b)


def pearson_r(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's correlation coefficient; NaN for constant or non-finite input."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"pearson_r needs two 1-D sequences of equal length, got {a.shape} and {b.shape}.")
    if len(a) < 2 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    da, db = a - a.mean(), b - b.mean()
    denom = math.sqrt(float(np.dot(da, da)) * float(np.dot(db, db)))
    if denom == 0.0:
        return float("nan")
    return float(np.clip(np.dot(da, db) / denom, -1.0, 1.0))
