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
            mean 0 (geometric mean of the column sigmas is 1), in each independent
            block when sparsity splits the problem into several.
        iterations: Number of alternating sweeps.
        imbalance: Largest relative row/column imbalance
            ``|Σ_j P_ij - Σ_j Q_ij| / Σ_j (P_ij + Q_ij)`` at the returned point.
        converged: Whether ``imbalance <= tol`` was reached.
        degenerate_rows: Indices of rows all of whose terms vanish in the infimum
            (all-zero curvature or weights, or a sparse pattern that allows it).
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

    Terms whose infimum lies at infinity are found exactly first (strongly
    connected components of the support graph, see :func:`_peel_degenerate`): a
    row whose curvature is zero contributes 0 in the limit ``a_i → +∞``, a row
    whose weights are zero contributes 0 in the limit ``a_i → -∞`` (likewise
    columns), and sparse patterns can let further terms vanish. The remaining
    blocks have attained minima, so the iteration converges linearly and the
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
    A, _ = as_float64(A, xp)
    B, xp = as_float64(B, xp)  # same namespace: both stay in it or both move to numpy
    if A.ndim != 2 or tuple(A.shape) != tuple(B.shape):
        raise ValueError(f"A and B must be matrices of one shape, got {A.shape} and {B.shape}.")
    m, n = int(A.shape[0]), int(A.shape[1])

    log_a = np.zeros(m)
    log_b = np.zeros(n)
    rows, cols, deg_rows, deg_cols, col_block, row_block, keep = _peel_degenerate(A, B, xp, log_a, log_b)
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

    if keep is not None:  # drop the terms that vanish in the infimum
        mask = xp.asarray(keep.astype(np.float64), **kwargs)
        A, B = A * mask, B * mask

    # Unit-maximum rescaling: NS(sA·A', sB·B') = sqrt(sA·sB)·NS(A', B') with a shift
    # of ½log(sB/sA) in a.
    scale_a, scale_b = to_float(xp.max(A)), to_float(xp.max(B))
    A, B = A / scale_a, B / scale_b
    value, a, b, iterations, imbalance = _alternate(A, B, xp, tol, max_iter, kwargs)
    value *= math.sqrt(scale_a) * math.sqrt(scale_b)
    a = a + 0.5 * (math.log(scale_b) - math.log(scale_a))

    # Gauge: in every independent block the column log-sigmas have mean 0.
    blocks = int(col_block.max()) + 1
    shift = np.bincount(col_block, weights=b, minlength=blocks) / np.bincount(col_block, minlength=blocks)
    log_a[rows] = a + shift[row_block]
    log_b[cols] = b - shift[col_block]
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
    """Find the terms whose infimum lies at infinity and the blocks that remain.

    Substituting ``c_j = -b_j``, a term ``A_ij e^{a_i + b_j}`` can be driven to 0
    along a direction with ``a_i < c_j`` and a term ``B_ij e^{-a_i - b_j}`` along one
    with ``a_i > c_j``. Draw an edge row i → column j for every ``A_ij > 0`` and
    column j → row i for every ``B_ij > 0``: any direction that does not increase a
    term orders the potentials along the edges, so potentials are equal inside a
    strongly connected component and can increase strictly from one component to
    the next. Hence a term vanishes in the infimum exactly when its endpoints lie
    in different components, and the infimum is the sum of the minima (attained)
    of the blocks of the non-trivial components. Rows and columns in no such block
    are degenerate: dead units (no curvature), pruned weights, or any pattern in
    which every term can be sent to 0.

    Writes ``+inf`` (only weight terms), ``-inf`` (only curvature terms) or 0
    (neither, or both kinds but all vanishing) into ``log_a``/``log_b`` for
    degenerate indices. Returns ``(rows, cols, deg_rows, deg_cols, component_of_col,
    component_of_row, keep)`` where ``keep`` is ``None`` or the boolean
    ``(len(rows), len(cols))`` mask of terms that stay.
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    m, n = log_a.size, log_b.size
    pos_a = np.asarray(to_numpy(A > 0))
    pos_b = np.asarray(to_numpy(B > 0))
    if pos_a.all() or pos_b.all():
        # Common case (no pruned weights, or no zero curvature): if every weight term
        # exists, each column reaches every row, so all rows and columns that also
        # have a curvature term form one block and the rest are simply dead (and
        # symmetrically). No graph is needed.
        row_alive = pos_a.any(axis=1) & pos_b.any(axis=1)
        col_alive = pos_a.any(axis=0) & pos_b.any(axis=0)
        log_a[~row_alive] = np.inf if pos_b.all() else -np.inf
        log_b[~col_alive] = np.inf if pos_b.all() else -np.inf
        rows, cols = np.flatnonzero(row_alive), np.flatnonzero(col_alive)
        deg_rows = tuple(int(i) for i in np.flatnonzero(~row_alive))
        deg_cols = tuple(int(j) for j in np.flatnonzero(~col_alive))
        return rows, cols, deg_rows, deg_cols, np.zeros(cols.size, int), np.zeros(rows.size, int), None
    ia, ja = np.nonzero(pos_a)
    ib, jb = np.nonzero(pos_b)
    edges = coo_matrix(
        (np.ones(ia.size + ib.size), (np.concatenate([ia, m + jb]), np.concatenate([m + ja, ib]))),
        shape=(m + n, m + n),
    ).tocsr()
    _, labels = connected_components(edges, directed=True, connection="strong")
    sizes = np.bincount(labels)
    nontrivial = sizes[labels] > 1
    row_alive, col_alive = nontrivial[:m], nontrivial[m:]
    for alive, has_a, has_b, log in (
        (row_alive, pos_a.any(axis=1), pos_b.any(axis=1), log_a),
        (col_alive, pos_a.any(axis=0), pos_b.any(axis=0), log_b),
    ):
        log[~alive & has_b & ~has_a] = np.inf  # only weight terms: variance -> infinity
        log[~alive & has_a & ~has_b] = -np.inf  # only curvature terms: variance -> 0
    rows, cols = np.flatnonzero(row_alive), np.flatnonzero(col_alive)
    row_label, col_label = labels[:m][rows], labels[m:][cols]
    keep = row_label[:, None] == col_label[None, :]
    if keep.all():
        keep = None
    deg_rows = tuple(int(i) for i in np.flatnonzero(~row_alive))
    deg_cols = tuple(int(j) for j in np.flatnonzero(~col_alive))
    _, compact = np.unique(np.concatenate([row_label, col_label]), return_inverse=True)
    return rows, cols, deg_rows, deg_cols, compact[rows.size:], compact[: rows.size], keep


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
