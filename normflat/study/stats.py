"""Rank and linear correlation of a measure with the generalization gap.

- :func:`kendall_tau`: Kendall's tau-b over all models;
- :func:`kendall_tau_ci`: the same with a percentile-bootstrap confidence interval
  (models resampled with replacement);
- :func:`granulated_kendall`: the granulated Kendall coefficient Psi of Jiang et al.
  (2020), which averages tau over groups of models that differ in one
  hyperparameter only;
- :func:`pearson_r`: Pearson's correlation coefficient.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

__all__ = ["granulated_kendall", "kendall_tau", "kendall_tau_ci", "pearson_r"]


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


def kendall_tau_ci(x: Sequence[float], y: Sequence[float], *, level: float = 0.95, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float, float]:
    """Kendall's tau-b with a percentile-bootstrap confidence interval.

    Each resample draws ``n`` of the ``n`` points (models) with replacement and
    computes tau-b on them; the interval is the ``(1 - level) / 2`` and
    ``(1 + level) / 2`` quantiles (linear interpolation) of the resampled taus.
    A point drawn twice forms a pair tied in both variables, which tau-b leaves
    out, as :func:`kendall_tau` of the resampled data does. Resamples whose tau is
    undefined (every drawn point tied in a variable) are dropped.

    The resamples are drawn from their own ``numpy.random.Generator(PCG64(seed))``
    (``numpy.random.default_rng(seed)``), never from numpy's global random state,
    so the same data and seed give the same interval, and two calls with equal
    ``n`` and ``seed`` resample the same models (the intervals of different
    measures of one study are paired). All resamples are computed at once:
    with ``W`` the ``resamples x n`` matrix of how often each point is drawn and
    ``P[k, l] = sign(x_k - x_l) sign(y_k - y_l)``, the numerator of tau-b of
    resample ``b`` is ``W[b] @ P @ W[b] / 2``, and likewise for the untied pair counts:
    ``O(resamples * n^2)`` arithmetic in a few matrix products.

    Args:
        x, y: The two samples (e.g. a measure and the gap, one value per model).
        level: Confidence level of the interval, in (0, 1).
        resamples: Bootstrap resamples.
        seed: Seed of the resampling generator.

    Returns:
        ``(tau, lo, hi)``: :func:`kendall_tau` of the data and the interval; the
        interval is ``(nan, nan)`` with fewer than 3 points, non-finite values, or
        when no resample has a defined tau.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}.")
    if int(resamples) < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}.")
    tau = kendall_tau(x, y)  # also checks the shapes
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(a)
    nan = float("nan")
    if n < 3 or not math.isfinite(tau):
        return tau, nan, nan
    sa, sb = np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :])
    both, untied_a, untied_b = sa * sb, np.abs(sa), np.abs(sb)
    rng = np.random.default_rng(seed)
    taus = []
    chunk = max(1, (1 << 21) // n)  # resamples per block: counts of at most ~2M entries
    for start in range(0, int(resamples), chunk):
        m = min(chunk, int(resamples) - start)
        draws = rng.integers(0, n, size=(m, n))
        counts = np.bincount((draws + n * np.arange(m)[:, None]).ravel(), minlength=m * n).reshape(m, n)
        w = counts.astype(float)
        # Sums over ordered pairs (k, l) of drawn copies; each unordered pair twice.
        s = np.einsum("bk,bk->b", w @ both, w)
        ua = np.einsum("bk,bk->b", w @ untied_a, w)
        ub = np.einsum("bk,bk->b", w @ untied_b, w)
        ok = (ua > 0) & (ub > 0)
        taus.append(np.clip(s[ok] / np.sqrt(ua[ok] * ub[ok]), -1.0, 1.0))
    values = np.concatenate(taus)
    if values.size == 0:
        return tau, nan, nan
    lo, hi = np.quantile(values, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return tau, float(lo), float(hi)


def granulated_kendall(measure: Sequence[float], gap: Sequence[float],
                       hyperparameters: Sequence[Mapping[str, Hashable]], *,
                       replicates: Sequence[str] = ("seed",)) -> dict[str, Any]:
    """The granulated Kendall coefficient Psi of Jiang et al. (2020), §4.2, eq. 4-5.

    For each hyperparameter axis ``i`` (a key of ``hyperparameters`` that takes at
    least two values and is not in ``replicates``), the models are grouped by the
    values of every other key, so that within a group only axis ``i`` varies;
    ``tau_i`` is the mean over the groups of Kendall's tau-b (:func:`kendall_tau`)
    between ``measure`` and ``gap`` within the group, and ``Psi`` is the mean of
    the ``tau_i`` over the axes. A measure with a high Psi orders the models by
    their gap along every hyperparameter separately, not only through the one
    hyperparameter that moves the gap the most.

    Keys in ``replicates`` (the training seed by default) are never axes: their
    values are replicates of the same setting, not a hyperparameter. They are
    held fixed within a group like every other key, so a group compares models
    of the same seed, and each seed contributes its own groups to the mean.

    Groups of fewer than two models, and groups whose tau is undefined (the
    measure or the gap constant within the group, or a non-finite value), are
    skipped; an axis with no usable group is reported as ``None`` and left out of
    the mean.

    Args:
        measure: One value per model.
        gap: The generalization gap, one value per model.
        hyperparameters: One mapping per model, all with the same keys, from
            hyperparameter name to its (hashable) value, e.g.
            ``{"ratio": 0.2, "lr": 1e-3, "seed": 0}``.
        replicates: Keys that identify replicates rather than a hyperparameter.

    Returns:
        ``{"psi": Psi or None, "per_axis": {axis: tau_i or None}}``, the axes in the
        order of the first mapping's keys; ``psi`` is ``None`` when no axis has a
        usable group (e.g. when no hyperparameter takes two values).

    Reference:
        Y. Jiang, B. Neyshabur, H. Mobahi, D. Krishnan, S. Bengio. Fantastic
        generalization measures and where to find them. ICLR 2020, §4.2.
    """
    m, g = list(measure), list(gap)
    hps = [dict(h) for h in hyperparameters]
    if not (len(m) == len(g) == len(hps)):
        raise ValueError(f"granulated_kendall needs one measure value, gap and hyperparameter mapping per model, "
                         f"got {len(m)}, {len(g)} and {len(hps)}.")
    keys = list(hps[0]) if hps else []
    for i, h in enumerate(hps):
        if set(h) != set(keys):
            raise ValueError(f"Every model needs the same hyperparameter keys: model 0 has {sorted(keys)}, "
                             f"model {i} has {sorted(h)}.")
    axes = [k for k in keys if k not in replicates and len({h[k] for h in hps}) >= 2]
    per_axis: dict[str, float | None] = {}
    for axis in axes:
        others = [k for k in keys if k != axis]
        groups: dict[tuple, list[int]] = defaultdict(list)
        for idx, h in enumerate(hps):
            groups[tuple(h[k] for k in others)].append(idx)
        taus = []
        for members in groups.values():
            if len(members) < 2:
                continue
            tau = kendall_tau([m[j] for j in members], [g[j] for j in members])
            if math.isfinite(tau):
                taus.append(tau)
        per_axis[axis] = float(np.mean(taus)) if taus else None
    usable = [t for t in per_axis.values() if t is not None]
    return {"psi": float(np.mean(usable)) if usable else None, "per_axis": per_axis}
