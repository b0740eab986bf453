"""Exact solver of the per-layer normalized-sharpness problem (SPEC §4-5)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from normflat.core._arrays import as_float64, namespace_of, to_float, to_numpy

__all__ = ["ScalingSolution", "solve_scaling"]

#: Exponents beyond this are absorbed into the matrices so exp() never overflows.
_ABSORB_LIMIT = 150.0


@dataclass(frozen=True)
class ScalingSolution:
    """Result of :func:`solve_scaling`.

    Attributes:
        value: The infimum ``NS(A, B)`` (finite, never NaN).
        log_row_sigma: ``a`` (length ``out``), ``+inf``/``-inf`` for degenerate rows
            whose optimum lies at infinity, ``0`` for empty rows.
        log_col_sigma: ``b`` (length ``in``), gauge-fixed so the finite entries have
            mean 0 (geometric mean of the column sigmas is 1).
        iterations: Number of alternating sweeps.
        imbalance: Largest relative row/column imbalance
            ``|Σ_j P_ij - Σ_j Q_ij| / Σ_j (P_ij + Q_ij)`` at the returned point.
        converged: Whether ``imbalance <= tol`` was reached.
        degenerate_rows: Indices of rows removed because their curvature or their
            weights are all zero (in the remaining problem).
        degenerate_cols: Same for columns.
    """

    value: float
    log_row_sigma: np.ndarray
    log_col_sigma: np.ndarray
    iterations: int
    imbalance: float
    converged: bool
    degenerate_rows: tuple[int, ...]
    degenerate_cols: tuple[int, ...]


def solve_scaling(A: Any, B: Any, *, tol: float = 1e-10, max_iter: int = 10_000) -> ScalingSolution:
    r"""Minimize the per-layer PAC-Bayes objective over row and column log-variances.

    Solves, for non-negative ``out × in`` matrices ``A`` (curvature) and ``B``
    (squared weights),

    .. math::

        \mathrm{NS}(A, B) = \inf_{a \in \mathbb{R}^{m},\, b \in \mathbb{R}^{n}}
            \tfrac12 \sum_{ij} \bigl[A_{ij} e^{a_i + b_j} + B_{ij} e^{-a_i - b_j}\bigr].

    The objective is convex and invariant to ``(a + c, b - c)``. The method is
    exact alternating block minimization: for fixed ``b`` the optimal ``a`` is
    ``a_i = ½ log(Σ_j B_ij e^{-b_j} / Σ_j A_ij e^{b_j})`` and symmetrically for
    ``b`` (a Sinkhorn-like matrix-balancing iteration, two matrix-vector products
    per half sweep, monotone decrease). It stops when every row and column is
    balanced, ``|Σ_j P_ij - Σ_j Q_ij| <= tol · Σ_j (P_ij + Q_ij)`` with
    ``P = A e^{a+b}``, ``Q = B e^{-a-b}``; at that point the relative error of the
    value is of order ``tol²``.

    Degenerate rows and columns are removed first, repeatedly: a row whose
    curvature is zero contributes 0 in the limit ``a_i → +∞``, a row whose weights
    are zero contributes 0 in the limit ``a_i → -∞`` (likewise columns), so the
    returned value is the infimum even where it is not attained. The matrices are
    rescaled to unit maximum and large exponents are absorbed into them, so
    entries spanning ``1e-30 .. 1e30`` are handled in float64.

    Args:
        A: Non-negative curvature matrix ``(out, in)``, any array-API array.
        B: Non-negative squared-weight matrix, same shape and library.
        tol: Relative balance tolerance (optimality criterion).
        max_iter: Maximum number of sweeps.

    Returns:
        The :class:`ScalingSolution`; ``converged`` is False if ``max_iter`` was hit
        (the value is then an upper bound that decreased monotonically).
    """
    xp = namespace_of(A, B)
    A, xp = as_float64(A, xp)
    B, xp = as_float64(B, namespace_of(B))
    if A.ndim != 2 or tuple(A.shape) != tuple(B.shape):
        raise ValueError(f"A and B must be matrices of one shape, got {A.shape} and {B.shape}.")
    m, n = int(A.shape[0]), int(A.shape[1])

    log_a = np.zeros(m)
    log_b = np.zeros(n)
    rows, cols, deg_rows, deg_cols = _peel_degenerate(A, B, xp, log_a, log_b)
    if rows.size == 0 or cols.size == 0:
        return ScalingSolution(0.0, log_a, log_b, 0, 0.0, True, deg_rows, deg_cols)

    device = getattr(A, "device", None)
    kwargs = {"device": device} if device is not None else {}
    if rows.size < m:
        A = xp.take(A, xp.asarray(rows, **kwargs), axis=0)
        B = xp.take(B, xp.asarray(rows, **kwargs), axis=0)
    if cols.size < n:
        A = xp.take(A, xp.asarray(cols, **kwargs), axis=1)
        B = xp.take(B, xp.asarray(cols, **kwargs), axis=1)

    # Unit-maximum rescaling: NS(sA·A', sB·B') = sqrt(sA·sB)·NS(A', B') with a shift
    # of ½log(sB/sA) in a.
    scale_a, scale_b = to_float(xp.max(A)), to_float(xp.max(B))
    A, B = A / scale_a, B / scale_b
    value, a, b, iterations, imbalance = _alternate(A, B, xp, tol, max_iter, kwargs)
    value *= math.sqrt(scale_a) * math.sqrt(scale_b)
    a = a + 0.5 * (math.log(scale_b) - math.log(scale_a))

    shift = float(np.mean(b))
    log_a[rows] = a + shift
    log_b[cols] = b - shift
    return ScalingSolution(
        value=float(value),
        log_row_sigma=log_a,
        log_col_sigma=log_b,
        iterations=iterations,
        imbalance=float(imbalance),
        converged=bool(imbalance <= tol),
        degenerate_rows=deg_rows,
        degenerate_cols=deg_cols,
    )


def _peel_degenerate(A, B, xp, log_a, log_b):
    """Remove rows/columns whose optimum is at infinity until none is left.

    Writes ``±inf`` (or 0 for rows/columns that are entirely empty) into
    ``log_a``/``log_b`` for removed indices and returns the remaining indices.
    """
    m, n = log_a.size, log_b.size
    row_alive = np.ones(m, dtype=bool)
    col_alive = np.ones(n, dtype=bool)
    pos_a = to_numpy(A > 0)
    pos_b = to_numpy(B > 0)
    while True:
        row_has_a = (pos_a & col_alive[None, :]).any(axis=1)
        row_has_b = (pos_b & col_alive[None, :]).any(axis=1)
        dead_rows = row_alive & ~(row_has_a & row_has_b)
        log_a[dead_rows & ~row_has_a & row_has_b] = np.inf
        log_a[dead_rows & row_has_a & ~row_has_b] = -np.inf
        row_alive &= ~dead_rows
        col_has_a = (pos_a & row_alive[:, None]).any(axis=0)
        col_has_b = (pos_b & row_alive[:, None]).any(axis=0)
        dead_cols = col_alive & ~(col_has_a & col_has_b)
        log_b[dead_cols & ~col_has_a & col_has_b] = np.inf
        log_b[dead_cols & col_has_a & ~col_has_b] = -np.inf
        col_alive &= ~dead_cols
        if not dead_rows.any() and not dead_cols.any():
            break
    deg_rows = tuple(int(i) for i in np.flatnonzero(~row_alive))
    deg_cols = tuple(int(j) for j in np.flatnonzero(~col_alive))
    return np.flatnonzero(row_alive), np.flatnonzero(col_alive), deg_rows, deg_cols


def _alternate(A, B, xp, tol, max_iter, kwargs):
    """Exact alternating minimization on strictly balanced-able A, B (unit max)."""
    n = int(A.shape[1])
    b = xp.zeros((n,), dtype=xp.float64, **kwargs)
    a_offset = xp.zeros((int(A.shape[0]),), dtype=xp.float64, **kwargs)
    b_offset = xp.zeros((n,), dtype=xp.float64, **kwargs)
    imbalance = math.inf
    value = math.inf
    iterations = 0
    for iterations in range(1, max_iter + 1):
        row_a = A @ xp.exp(b)
        row_b = B @ xp.exp(-b)
        a = 0.5 * (xp.log(row_b) - xp.log(row_a))
        col_a = (xp.exp(a) @ A) * xp.exp(b)
        col_b = (xp.exp(-a) @ B) * xp.exp(-b)
        imbalance = to_float(xp.max(xp.abs(col_a - col_b) / (col_a + col_b)))
        if imbalance <= tol or iterations == max_iter:
            value = to_float(xp.sum(xp.sqrt(row_a * row_b)))
            break
        b = b + 0.5 * (xp.log(col_b) - xp.log(col_a))
        if to_float(xp.max(xp.abs(b))) > _ABSORB_LIMIT or to_float(xp.max(xp.abs(a))) > _ABSORB_LIMIT:
            # Move the scalings into the matrices; exp(a_i + b_j) of the current
            # point has a moderate range because it balances A against B.
            exponent = a[:, None] + b[None, :]
            A = A * xp.exp(exponent)
            B = B * xp.exp(-exponent)
            a_offset = a_offset + a
            b_offset = b_offset + b
            b = xp.zeros_like(b)
    a_total = to_numpy(a + a_offset).astype(np.float64)
    b_total = to_numpy(b + b_offset).astype(np.float64)
    return value, a_total, b_total, iterations, imbalance
