"""Exact solver of the per-layer normalized-sharpness problem (method §4-5)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from normflat.core._arrays import as_float64, namespace_of, to_float, to_numpy

__all__ = ["DEFAULT_MAX_ITER", "DEFAULT_TOL", "ScalingSolution", "check_solver_options", "solve_scaling"]

#: Default relative balance tolerance (the optimality criterion of method §5).
DEFAULT_TOL = 1e-10
#: Default maximum number of alternating sweeps.
DEFAULT_MAX_ITER = 10_000

#: Working exponents beyond this are absorbed into the kernels, so that exp()
#: of the working variables stays far from the float64 range.
_ABSORB_LIMIT = 150.0
#: Working row/column sums outside ``[_SAFE_LOW, _SAFE_HIGH]`` would lose precision
#: (subnormals) or overflow; the iteration then re-absorbs or moves to log space.
_SAFE_LOW = 1e-280
_SAFE_HIGH = 1e280
_LN2 = math.log(2.0)


def check_solver_options(tol: Any, max_iter: Any) -> tuple[float, int]:
    """Validate the solver's ``tol`` and ``max_iter`` and return them as float and int.

    Args:
        tol: Relative balance tolerance; a finite number ``> 0``.
        max_iter: Maximum number of sweeps; an int ``>= 1``.

    Returns:
        ``(float(tol), int(max_iter))``.

    Raises:
        TypeError: If ``tol`` is not a real number or ``max_iter`` not an int (bools
            are rejected for both).
        ValueError: If ``tol`` is NaN, infinite or not positive, or ``max_iter < 1``.
    """
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real):
        raise TypeError(
            f"tol must be a real number, the relative balance tolerance of the solver "
            f"(finite and > 0, default {DEFAULT_TOL:g}); got {type(tol).__name__} {tol!r}."
        )
    if not math.isfinite(float(tol)) or float(tol) <= 0.0:
        raise ValueError(
            f"tol must be finite and > 0 (a relative balance tolerance such as the default "
            f"{DEFAULT_TOL:g}; the value's relative error is about tol²); got {tol!r}."
        )
    if isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral):
        raise TypeError(
            f"max_iter must be an int >= 1, the maximum number of solver sweeps (default "
            f"{DEFAULT_MAX_ITER}); got {type(max_iter).__name__} {max_iter!r}."
        )
    if int(max_iter) < 1:
        raise ValueError(
            f"max_iter must be an int >= 1, the maximum number of solver sweeps (default "
            f"{DEFAULT_MAX_ITER}); got {max_iter!r}."
        )
    return float(tol), int(max_iter)


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


def solve_scaling(A: Any, B: Any, *, tol: float = DEFAULT_TOL, max_iter: int = DEFAULT_MAX_ITER) -> ScalingSolution:
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
    value is of order ``tol²`` (method §5).

    Terms whose infimum lies at infinity are found exactly first (strongly
    connected components of the support graph, see :func:`_peel_degenerate`): a
    row whose curvature is zero contributes 0 in the limit ``a_i → +∞``, a row
    whose weights are zero contributes 0 in the limit ``a_i → -∞`` (likewise
    columns), and sparse patterns can let further terms vanish. The remaining
    blocks have attained minima, so the iteration converges linearly and the
    returned value is the infimum even where it is not attained.

    Any finite non-negative float64 entries are handled: the matrices are
    rescaled to unit maximum, the working variables are absorbed into the
    matrices (recomputed from the logarithms of the entries) before their
    exponentials leave a safe range, and when the rows' or columns' totals span
    more than the float64 range the iteration continues with log-sum-exp sums,
    which need no common scale at all.

    Args:
        A: Non-negative curvature matrix ``(out, in)``, any array-API array.
        B: Non-negative squared-weight matrix, same shape and library.
        tol: Relative balance tolerance (optimality criterion), finite and ``> 0``.
        max_iter: Maximum number of sweeps, an int ``>= 1``.

    Returns:
        The :class:`ScalingSolution`; ``converged`` is False if ``max_iter`` was hit
        (the value is then an upper bound that decreased monotonically).

    Raises:
        TypeError: If ``tol`` or ``max_iter`` has the wrong type.
        ValueError: If ``tol``/``max_iter`` are out of range, the shapes differ or
            are not 2-D, or an entry is negative, NaN or infinite.
        OverflowError: If the value itself exceeds the float64 range.
    """
    tol, max_iter = check_solver_options(tol, max_iter)
    xp = namespace_of(A, B)
    A, _ = as_float64(A, xp)
    B, xp = as_float64(B, xp)  # same namespace: both stay in it or both move to numpy
    if A.ndim != 2 or tuple(A.shape) != tuple(B.shape):
        raise ValueError(f"A and B must be matrices of one shape, got {A.shape} and {B.shape}.")
    for name, M in (("A", A), ("B", B)):
        if not bool(xp.all(xp.isfinite(M))):
            raise ValueError(f"{name} contains NaN or infinite entries; the solver needs finite matrices.")
        if bool(xp.any(M < 0)):
            raise ValueError(
                f"{name} has negative entries; curvature and squared weights are non-negative "
                "(clip negative curvature at 0 first, as normflat.normalized_sharpness does)."
            )
    return solve_entries(Entries(A, xp), Entries(B, xp), tol=tol, max_iter=max_iter)


class Entries:
    """A non-negative float64 matrix held either as values or as logarithms.

    ``Entries(M, xp, exp2=k)`` stands for the matrix ``2^k · M`` (``M`` finite and
    non-negative; a power of two keeps the scaling exact); ``Entries(L, xp,
    log=True)`` for ``exp(L)`` with ``L = -inf`` for zero entries. The log form
    holds matrices whose entries do not fit one float64 scale (squared weights of
    a layer whose weights span more than about 1e±150), the scaled form a matrix
    that is uniformly huge or tiny. :class:`DerivedEntries` forms its float64
    entries from a lower-precision array a block of rows at a time. Internal to the
    core.
    """

    derived = False

    def __init__(self, values: Any, xp: Any, *, exp2: int = 0, log: bool = False):
        self.values, self.xp, self.exp2, self.is_log = values, xp, int(exp2), log

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.values.shape[0]), int(self.values.shape[1])

    def positive(self) -> Any:
        """Boolean xp array of the non-zero entries."""
        return self.values > -math.inf if self.is_log else self.values > 0

    def logs(self) -> Any:
        """The entries' natural logarithms (``-inf`` for zeros), without warnings."""
        if self.is_log:
            return self.values
        return safe_log(self.xp, self.values) + self.exp2 * _LN2

    def dense(self) -> Any:
        """The plain float64 values (``2^exp2`` not applied; not for the log form)."""
        return self.values

    def largest(self) -> float:
        """The largest plain value (``2^exp2`` not applied; not for the log form)."""
        return to_float(self.xp.max(self.values))

    def block(self, start: int, stop: int) -> Any:
        """Rows ``start .. stop − 1`` of :meth:`dense`."""
        return self.values[start:stop, :]

    def total(self) -> tuple[float, float, int]:
        """``Σ`` of the entries as ``(mantissa, log_factor, exp2)`` for :func:`compose`.

        The mantissa is 0 when every entry is zero.
        """
        xp = self.xp
        if not self.is_log:
            return to_float(xp.sum(self.values)), 0.0, self.exp2
        top = to_float(xp.max(self.values))
        if top == -math.inf:
            return 0.0, 0.0, 0
        return to_float(xp.sum(xp.exp(self.values - top))), top, 0

    def take(self, index: Any, axis: int) -> Entries:
        return Entries(self.xp.take(self.values, index, axis=axis), self.xp, exp2=self.exp2, log=self.is_log)

    def rows(self, start: int, stop: int) -> Entries:
        return Entries(self.values[start:stop, :], self.xp, exp2=self.exp2, log=self.is_log)

    def masked(self, mask: Any) -> Entries:
        """Set the entries where ``mask`` (xp bool) is False to zero."""
        xp = self.xp
        if self.is_log:
            return Entries(xp.where(mask, self.values, xp.full_like(self.values, -math.inf)), xp, log=True)
        return Entries(xp.where(mask, self.values, xp.zeros_like(self.values)), xp, exp2=self.exp2)


#: Entries of one float64 block of the solver's products with :class:`DerivedEntries` (2 MiB):
#: the float64 copies of a large dense layer exist one block at a time, and a layer of a few
#: hundred thousand weights takes a few blocks per product (every sweep forms them anew, and
#: the operations per block, not the arithmetic, set the time of a small layer).
DERIVED_BLOCK_ENTRIES = 1 << 18
#: Entries of one float64 block of a single pass over :class:`DerivedEntries` (sums, the
#: element-wise bound; 512 KiB): done once per layer, so small blocks cost nothing.
PASS_BLOCK_ENTRIES = 1 << 16


class DerivedEntries(Entries):
    """Float64 entries formed from a lower-precision array, a block of rows at a time.

    ``kind="curvature"``: ``max(S, 0)``; ``kind="squares"``: ``S²``, for an ``(out, in)``
    array ``S`` of at most float32's range (float32, float16, bfloat16), whose every such
    entry float64 holds exactly (a float32 square has at most 48 significant bits and lies
    within ``[1e-90, 1.2e77]``). The solver's matrix-vector products and the measures' sums
    convert one block of rows at a time, so a dense layer never has a float64 copy of its
    size (method §5, numerics): the values are those of the float64 matrix formed at once,
    up to the order of the additions.
    """

    derived = True

    def __init__(self, source: Any, xp: Any, kind: str):
        super().__init__(source, xp)
        self.kind = kind

    def _derive(self, block: Any) -> Any:
        # Few operations per block (each is a call into the array library, the cost of a
        # solver sweep on a small layer) and no second float64 block: the clip in the source's
        # precision (exact), the square in place on the fresh float64 copy.
        xp = self.xp
        if self.kind == "curvature":
            return as_float64(xp.clip(block, min=0.0), xp)[0]
        block, _ = as_float64(block, xp)
        block *= block
        return block

    def positive(self) -> Any:
        return self.values > 0 if self.kind == "curvature" else self.values != 0

    def logs(self) -> Any:
        return safe_log(self.xp, self.dense())

    def dense(self) -> Any:
        return self._derive(self.values)

    def largest(self) -> float:
        xp = self.xp
        # In float64 first: numpy has no bfloat16. A float32 value squared is exact in float64. No
        # abs(): it would copy the layer.
        top, _ = as_float64(xp.max(self.values), xp)
        if self.kind == "curvature":
            return max(to_float(top), 0.0)
        bottom, _ = as_float64(xp.min(self.values), xp)
        return max(to_float(top), -to_float(bottom)) ** 2

    def block(self, start: int, stop: int) -> Any:
        return self._derive(self.values[start:stop, :])

    def total(self) -> tuple[float, float, int]:
        return math.fsum(to_float(self.xp.sum(block)) for block in self.blocks(PASS_BLOCK_ENTRIES)), 0.0, 0

    def blocks(self, entries: int | None = None) -> Iterator[Any]:
        """The float64 blocks of rows, in order, of about ``entries`` entries each (default
        :data:`DERIVED_BLOCK_ENTRIES`)."""
        step = max(1, (entries or DERIVED_BLOCK_ENTRIES) // max(1, self.shape[1]))
        for start in range(0, self.shape[0], step):
            yield self.block(start, min(self.shape[0], start + step))

    def take(self, index: Any, axis: int) -> Entries:
        return DerivedEntries(self.xp.take(self.values, index, axis=axis), self.xp, self.kind)

    def rows(self, start: int, stop: int) -> Entries:
        return DerivedEntries(self.values[start:stop, :], self.xp, self.kind)

    def masked(self, mask: Any) -> Entries:
        return DerivedEntries(self.xp.where(mask, self.values, self.xp.zeros_like(self.values)), self.xp, self.kind)


def safe_log(xp: Any, v: Any) -> Any:
    """``log(v)`` with ``-inf`` for zeros, without a divide-by-zero warning."""
    pos = v > 0
    return xp.where(pos, xp.log(xp.where(pos, v, xp.ones_like(v))), xp.full_like(v, -math.inf))


def compose(factors: tuple[float, ...] = (), log_factor: float = 0.0, exp2: int = 0) -> float:
    """``Π factors · e^{log_factor} · 2^exp2`` without intermediate over- or underflow.

    The factors are positive finite floats. Exact powers of two stay exact, so a
    uniformly rescaled layer scales its measures exactly.

    Raises:
        OverflowError: If the product exceeds the float64 range.
    """
    q = round(log_factor / _LN2)
    mantissa, exponent = math.exp(log_factor - q * _LN2), exp2 + q
    for f in factors:
        fm, fe = math.frexp(f)
        mantissa *= fm
        exponent += fe
    fm, fe = math.frexp(mantissa)
    if fm == 0.0:
        return 0.0
    if exponent + fe > 1024:
        raise OverflowError(
            f"The result is about 2^{exponent + fe}, beyond the float64 range (1.8e308). Divide the "
            "loss (hence the Hessian diagonal) by a constant c: normalized sharpness, the "
            "matrix-normalized sharpness and the element-wise bound scale by sqrt(c), the trace by c."
        )
    return math.ldexp(fm, exponent + fe)


def solve_entries(A: Entries, B: Entries, *, tol: float, max_iter: int) -> ScalingSolution:
    """:func:`solve_scaling` on already validated :class:`Entries` (no checks)."""
    xp = A.xp
    m, n = A.shape
    log_a = np.zeros(m)
    log_b = np.zeros(n)
    pos_a = np.asarray(to_numpy(A.positive()))
    pos_b = np.asarray(to_numpy(B.positive()))
    rows, cols, deg_rows, deg_cols, col_block, row_block, keep = _peel_degenerate(pos_a, pos_b, log_a, log_b)
    if rows.size == 0 or cols.size == 0:
        return ScalingSolution(0.0, log_a, log_b, 0, 0.0, True, deg_rows, deg_cols)

    device = getattr(A.values, "device", None)
    kwargs = {"device": device} if device is not None else {}
    if rows.size < m:
        index = xp.asarray(rows, **kwargs)
        A, B = A.take(index, 0), B.take(index, 0)
    if cols.size < n:
        index = xp.asarray(cols, **kwargs)
        A, B = A.take(index, 1), B.take(index, 1)
    if keep is not None:  # drop the terms that vanish in the infimum
        mask = xp.asarray(keep, **kwargs)
        A, B = A.masked(mask), B.masked(mask)

    iteration = _Iteration(A, B, kwargs)
    total, log_scale, a, b, iterations, imbalance = iteration.run(tol, max_iter)
    # Undo the normalization of the iteration: NS(sA·A', sB·B') = sqrt(sA·sB)·NS(A', B'),
    # with the row log-variances shifted by ½·log(sB/sA).
    half_power = (math.sqrt(2.0),) if (A.exp2 + B.exp2) % 2 else ()
    value = compose((total, math.sqrt(iteration.scale_a), math.sqrt(iteration.scale_b), *half_power),
                    log_scale + 0.5 * (iteration.log_top_a + iteration.log_top_b), (A.exp2 + B.exp2) // 2)
    a = a + 0.5 * (math.log(iteration.scale_b) - math.log(iteration.scale_a)
                   + iteration.log_top_b - iteration.log_top_a + (B.exp2 - A.exp2) * _LN2)

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


def _peel_degenerate(pos_a, pos_b, log_a, log_b):
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

    Takes the numpy boolean supports ``A > 0`` and ``B > 0``. Writes ``+inf`` (only
    weight terms), ``-inf`` (only curvature terms) or 0 (neither, or both kinds
    but all vanishing) into ``log_a``/``log_b`` for degenerate indices. Returns
    ``(rows, cols, deg_rows, deg_cols, component_of_col, component_of_row, keep)``
    where ``keep`` is ``None`` or the boolean ``(len(rows), len(cols))`` mask of
    terms that stay.
    """
    m, n = log_a.size, log_b.size
    # A row without A terms has no outgoing edge and one without B terms no incoming edge (for a
    # column the other way round): such a node lies on no cycle, and removing it leaves the other
    # components as they are. They are peeled until none is left. What remains is usually one
    # block: dead units and dead inputs take whole rows and columns of A away, and the weights
    # are all nonzero, or nearly (with a few weights exactly zero the remaining A is complete).
    # The graph is built only when neither remaining pattern is complete (on AlexNet's 4096 ×
    # 9216 layer, with dead units and two zero weights, the graph of its 38M edges took 22 s; the
    # peeling takes 0.2 s).
    has_a_row, has_b_row, has_a_col, has_b_col = (pos_a.any(axis=1), pos_b.any(axis=1), pos_a.any(axis=0),
                                                  pos_b.any(axis=0))
    rows, cols = np.arange(m), np.arange(n)
    sub_a, sub_b = pos_a, pos_b
    row_alive, col_alive = has_a_row & has_b_row, has_a_col & has_b_col
    while not (row_alive.all() and col_alive.all()):
        rows, cols = rows[row_alive], cols[col_alive]
        sub_a, sub_b = sub_a[np.ix_(row_alive, col_alive)], sub_b[np.ix_(row_alive, col_alive)]
        if not (rows.size and cols.size):
            break
        row_alive = sub_a.any(axis=1) & sub_b.any(axis=1)
        col_alive = sub_a.any(axis=0) & sub_b.any(axis=0)
    row_block, col_block = np.zeros(rows.size, int), np.zeros(cols.size, int)
    keep = None
    if rows.size and cols.size and not (sub_a.all() or sub_b.all() or _strongly_connected(sub_a, sub_b)):
        # If every remaining term of one kind exists, each row reaches every column and back
        # through its own term of the other kind: one block. Otherwise the components.
        rows, cols, row_block, col_block, keep = _components(sub_a, sub_b, rows, cols)
    if rows.size == 0 or cols.size == 0:  # no block: every term vanishes
        rows, cols, row_block, col_block, keep = rows[:0], cols[:0], row_block[:0], col_block[:0], None
    row_alive, col_alive = np.zeros(m, bool), np.zeros(n, bool)
    row_alive[rows], col_alive[cols] = True, True
    log_a[~row_alive] = degenerate_log(has_a_row, has_b_row)[~row_alive]
    log_b[~col_alive] = degenerate_log(has_a_col, has_b_col)[~col_alive]
    deg_rows = tuple(int(i) for i in np.flatnonzero(~row_alive))
    deg_cols = tuple(int(j) for j in np.flatnonzero(~col_alive))
    return rows, cols, deg_rows, deg_cols, col_block, row_block, keep


def degenerate_log(has_a: np.ndarray, has_b: np.ndarray) -> np.ndarray:
    """The log-sigma of a degenerate row or column (one in no block) from whether it has curvature
    terms (``has_a``) and weight terms (``has_b``): ``+inf`` with weight terms only (variance to
    infinity), ``-inf`` with curvature terms only (variance to 0), 0 with neither or both."""
    return np.where(has_b & ~has_a, np.inf, np.where(has_a & ~has_b, -np.inf, 0.0))


def _strongly_connected(sub_a: np.ndarray, sub_b: np.ndarray) -> bool:
    """Whether the graph of :func:`_peel_degenerate` on the supports ``sub_a``, ``sub_b`` is one
    strongly connected component: every node is reached from row 0 and reaches it. A
    breadth-first search each way, one boolean matrix-vector product per step over the whole
    frontier (the peeled patterns of real layers are dense, a few steps across)."""
    for forward in (True, False):
        # Forward, rows lead to columns through A and columns to rows through B; backward, the
        # edges reversed: a column is reached from the rows it has A terms in, and so on.
        to_cols, to_rows = (sub_a, sub_b) if forward else (sub_b, sub_a)
        rows_seen = np.zeros(sub_a.shape[0], bool)
        cols_seen = np.zeros(sub_a.shape[1], bool)
        rows_seen[0] = True
        frontier = rows_seen.copy()
        while frontier.any():
            new_cols = to_cols[frontier].any(axis=0) & ~cols_seen
            cols_seen |= new_cols
            frontier = to_rows[:, new_cols].any(axis=1) & ~rows_seen
            rows_seen |= frontier
        if not (rows_seen.all() and cols_seen.all()):
            return False
    return True


def _components(sub_a: np.ndarray, sub_b: np.ndarray, rows: np.ndarray, cols: np.ndarray):
    """The strongly connected components of the graph of :func:`_peel_degenerate` on the supports
    ``sub_a``, ``sub_b`` of the remaining ``rows`` and ``cols``: ``(rows, cols, component of each
    row, component of each column, keep)`` for those in a non-trivial component, with the
    components numbered from 0 and ``keep`` the mask of the terms inside one (``None``: all)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    m, n = sub_a.shape
    ia, ja = np.nonzero(sub_a)
    ib, jb = np.nonzero(sub_b)
    edges = coo_matrix(
        (np.ones(ia.size + ib.size), (np.concatenate([ia, m + jb]), np.concatenate([m + ja, ib]))),
        shape=(m + n, m + n),
    ).tocsr()
    _, labels = connected_components(edges, directed=True, connection="strong")
    nontrivial = np.bincount(labels)[labels] > 1
    row_alive, col_alive = nontrivial[:m], nontrivial[m:]
    row_label, col_label = labels[:m][row_alive], labels[m:][col_alive]
    keep = row_label[:, None] == col_label[None, :]
    _, compact = np.unique(np.concatenate([row_label, col_label]), return_inverse=True)
    return (rows[row_alive], cols[col_alive], compact[: row_label.size], compact[row_label.size:],
            None if keep.all() else keep)


class _Kernel:
    """A working kernel ``K`` of :class:`_Iteration` with its two matrix-vector products.

    Either a float64 matrix, or ``E / scale`` for :class:`DerivedEntries` ``E``, whose
    products go a block of rows at a time and are divided by ``scale`` afterwards (no
    float64 copy of ``E``; its entries and the working exponentials are far inside the
    float64 range, so the unscaled products neither overflow nor lose precision).
    """

    def __init__(self, matrix: Any, entries: DerivedEntries | None = None, scale: float = 1.0):
        self.matrix, self.entries, self.scale = matrix, entries, scale

    @classmethod
    def of(cls, entries: Entries, scale: float) -> _Kernel:
        """The unit-maximum kernel ``entries / scale`` (``scale`` the largest entry)."""
        if isinstance(entries, DerivedEntries):
            return cls(None, entries, scale)
        return cls(entries.values / scale)

    def times(self, v: Any) -> Any:
        """``K v``."""
        if self.entries is None:
            return self.matrix @ v
        xp = self.entries.xp
        return xp.concat([block @ v for block in self.entries.blocks()]) / self.scale

    def times_left(self, u: Any) -> Any:
        """``uᵀ K``."""
        if self.entries is None:
            return u @ self.matrix
        total, start = None, 0
        for block in self.entries.blocks():
            stop = start + int(block.shape[0])
            part = u[start:stop] @ block
            total, start = (part if total is None else total + part), stop
        return total / self.scale


def _sweep_products(K_A: _Kernel, K_B: _Kernel, eb: Any, emb: Any, xp: Any) -> tuple[Any, Any, Any, Any, Any]:
    """A sweep's four products: the row sums ``K_A e^b``, ``K_B e^{-b}``, the row step ``a``,
    and the column products ``e^aᵀ K_A``, ``e^{-a}ᵀ K_B`` (without the factors ``e^{±b}``).

    Over two :class:`DerivedEntries` kernels each block of rows is formed once: a block's row
    step depends on its own rows only, so its row sums, row step and share of the column
    products are taken in one pass (the numbers of the four products in turn up to the order
    of the additions, with half the float64 blocks formed). Plain matrices take the four
    products in turn.

    The column products are formed before the caller's checks of the row sums and the row step;
    if those fail, the caller discards them (overflows or logarithms of zero there are harmless,
    and numpy is told so in this thread).

    Returns:
        ``(row_a, row_b, a, col_a, col_b)``.
    """
    if K_A.entries is None or K_B.entries is None:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            row_a, row_b = K_A.times(eb), K_B.times(emb)
            a = 0.5 * (xp.log(row_b) - xp.log(row_a))
            ea = xp.exp(a)
            return row_a, row_b, a, K_A.times_left(ea), K_B.times_left(1.0 / ea)
    rows_a, rows_b, steps = [], [], []
    col_a = col_b = None
    # Two blocks at once, each half the size of a product's: the same float64 memory as before
    # (on the MLP of the benchmarks, full-size pairs raised analyze's peak from 6.5 to 9 MiB).
    entries = max(1, DERIVED_BLOCK_ENTRIES // 2)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        for block_a, block_b in zip(K_A.entries.blocks(entries), K_B.entries.blocks(entries)):
            row_a = (block_a @ eb) / K_A.scale
            row_b = (block_b @ emb) / K_B.scale
            a = 0.5 * (xp.log(row_b) - xp.log(row_a))
            ea = xp.exp(a)
            part_a, part_b = ea @ block_a, (1.0 / ea) @ block_b
            col_a = part_a if col_a is None else col_a + part_a
            col_b = part_b if col_b is None else col_b + part_b
            rows_a.append(row_a)
            rows_b.append(row_b)
            steps.append(a)
    return (xp.concat(rows_a), xp.concat(rows_b), xp.concat(steps), col_a / K_A.scale, col_b / K_B.scale)


class _Iteration:
    """Alternating exact block minimization on blocks whose minimum is attained.

    It solves the normalized problem ``(A', B')``: plain matrices divided by their
    largest entry (``scale_a``, ``scale_b``, besides their power-of-two ``exp2``),
    log matrices shifted by their largest log (``log_top_a``, ``log_top_b``). The
    caller undoes the normalization.

    The fast path works on kernels ``K_A = A' e^{x0_i + y0_j - α}`` and
    ``K_B = B' e^{-x0_i - y0_j - β}``, where ``(x0, y0)`` is an absorbed point and
    ``α, β`` are log scales (0 at the start, where the kernels are ``A'`` and
    ``B'`` exactly). By ``NS(e^α K_A, e^β K_B) = e^{(α+β)/2} NS(K_A, K_B)`` the
    working variables ``(a, b)`` on the kernels give the point
    ``x = x0 + a + (β - α)/2``, ``y = y0 + b``. Each sweep costs four
    matrix-vector products. The kernels are recomputed from the logarithms of
    the entries (never by compounding products, which would lose small entries
    for good) when the working variables grow past ``_ABSORB_LIMIT`` or a row or
    column total leaves ``[_SAFE_LOW, _SAFE_HIGH]``. If the totals are out of
    range right after an absorption, their spread exceeds what one common scale
    can hold, and the remaining sweeps use log-sum-exp sums instead: exact in any
    range, a few times slower.
    """

    def __init__(self, A: Entries, B: Entries, kwargs: dict[str, Any]):
        self.xp, self.kwargs = A.xp, kwargs
        self.m, self.n = A.shape
        self.log_mode = A.is_log or B.is_log
        self.scale_a = self.scale_b = 1.0
        self.log_top_a = self.log_top_b = 0.0
        if self.log_mode:
            # Both in logs (the plain one carries its power of two into its logs).
            # The powers of two stay with the caller, so plain operands enter without them.
            log_a, log_b = (E.values if E.is_log else safe_log(self.xp, E.dense()) for E in (A, B))
            self.log_top_a, self.log_top_b = to_float(self.xp.max(log_a)), to_float(self.xp.max(log_b))
            self.logs: tuple[Any, Any] | None = (log_a - self.log_top_a, log_b - self.log_top_b)
        else:
            self.scale_a, self.scale_b = A.largest(), B.largest()
            self.plain = (A, B)
            self.logs = None

    def _log_entries(self) -> tuple[Any, Any]:
        """Logs of the normalized entries; precise where the ratio itself is representable."""
        if self.logs is None:
            xp = self.xp
            out = []
            for entries, scale in zip(self.plain, (self.scale_a, self.scale_b)):
                values = entries.dense()
                ratio = values / scale
                direct = safe_log(xp, ratio)
                # Entries that underflow in the ratio keep their log through log(v) - log(scale).
                tiny = (ratio < 1e-300) & (values > 0)
                out.append(xp.where(tiny, safe_log(xp, values) - math.log(scale), direct))
            self.logs = (out[0], out[1])
        return self.logs

    def _zeros(self, size: int) -> Any:
        return self.xp.zeros((size,), dtype=self.xp.float64, **self.kwargs)

    def _absorb(self, x: Any, y: Any) -> None:
        """Kernels at the point ``(x, y)``, with one common scale.

        One scale for both kernels makes the absorbed point the working origin
        (``α = β``). Near balance the largest terms of ``P`` and ``Q`` differ by at
        most a factor ``out·in``, so both kernels keep entries near 1.
        """
        xp = self.xp
        log_a, log_b = self._log_entries()
        exponent = x[:, None] + y[None, :]
        ea, eb = log_a + exponent, log_b - exponent
        gamma = max(to_float(xp.max(ea)), to_float(xp.max(eb)))
        self.alpha = self.beta = gamma
        self.K_A, self.K_B = _Kernel(xp.exp(ea - gamma)), _Kernel(xp.exp(eb - gamma))
        self.x0, self.y0 = x, y

    def _point(self, a: Any, b: Any) -> tuple[Any, Any]:
        return self.x0 + a + 0.5 * (self.beta - self.alpha), self.y0 + b

    def _safe(self, *sums: Any) -> bool:
        xp = self.xp
        both = xp.concat(sums)
        return bool(xp.all((both > _SAFE_LOW) & (both < _SAFE_HIGH)))

    def run(self, tol: float, max_iter: int) -> tuple[float, float, np.ndarray, np.ndarray, int, float]:
        """Iterate on the normalized problem.

        Returns:
            ``(total, log_scale, x, y, sweeps, imbalance)``: the normalized value is
            ``total · e^{log_scale}``; ``x``, ``y`` (numpy) are its minimizer.
        """
        xp = self.xp
        if self.log_mode:
            return self._run_log(self._zeros(self.m), self._zeros(self.n), 0, tol, max_iter)
        # Unit-maximum start: exact, and all that ordinary layers ever need.
        self.K_A, self.K_B = (_Kernel.of(E, scale) for E, scale in zip(self.plain, (self.scale_a, self.scale_b)))
        self.alpha = self.beta = 0.0
        self.x0, self.y0 = self._zeros(self.m), self._zeros(self.n)
        a, b = self._zeros(self.m), self._zeros(self.n)
        fresh = True  # no column step since the kernels were formed
        absorptions = 0  # in a row, without a completed sweep
        iterations = 0
        while True:
            if absorptions > 2:  # a common scale cannot hold these totals
                return self._run_log(*self._point(a, b), iterations, tol, max_iter)
            eb, emb = xp.exp(b), xp.exp(-b)
            row_a, row_b, step, col_a, col_b = _sweep_products(self.K_A, self.K_B, eb, emb, xp)
            if not self._safe(row_a, row_b):
                if fresh:
                    return self._run_log(*self._point(a, b), iterations, tol, max_iter)
                self._absorb(*self._point(a, b))
                a, b, fresh, absorptions = self._zeros(self.m), self._zeros(self.n), True, absorptions + 1
                continue
            a = step
            if to_float(xp.max(xp.abs(a))) > _ABSORB_LIMIT:
                # Rows far from balance (e.g. the first sweep on a badly scaled
                # matrix): absorb the exact row step so that exp(a) stays moderate.
                self._absorb(*self._point(a, b))
                a, b, fresh, absorptions = self._zeros(self.m), self._zeros(self.n), True, absorptions + 1
                continue
            col_a, col_b = col_a * eb, col_b * emb
            if not self._safe(col_a, col_b):
                if fresh:
                    return self._run_log(*self._point(a, b), iterations, tol, max_iter)
                self._absorb(*self._point(a, b))
                a, b, fresh, absorptions = self._zeros(self.m), self._zeros(self.n), True, absorptions + 1
                continue
            iterations += 1
            absorptions = 0
            imbalance = to_float(xp.max(xp.abs(col_a - col_b) / (col_a + col_b)))
            if imbalance <= tol or iterations >= max_iter:
                total = to_float(xp.sum(xp.sqrt(row_a) * xp.sqrt(row_b)))
                x, y = self._point(a, b)
                return total, 0.5 * (self.alpha + self.beta), _numpy64(x), _numpy64(y), iterations, imbalance
            b = b + 0.5 * (xp.log(col_b) - xp.log(col_a))
            fresh = False
            if to_float(xp.max(xp.abs(b))) > _ABSORB_LIMIT:
                self._absorb(*self._point(a, b))
                a, b, fresh = self._zeros(self.m), self._zeros(self.n), True

    def _run_log(self, x: Any, y: Any, iterations: int, tol: float, max_iter: int):
        """The same sweeps with log-sum-exp sums, from the point ``(x, y)``."""
        xp = self.xp
        log_a, log_b = self._log_entries()
        while True:
            ra = _logsumexp(log_a + y[None, :], axis=1)
            rb = _logsumexp(log_b - y[None, :], axis=1)
            x = 0.5 * (rb - ra)
            exponent = x[:, None] + y[None, :]
            ca = _logsumexp(log_a + exponent, axis=0)
            cb = _logsumexp(log_b - exponent, axis=0)
            iterations += 1
            # |e^u - e^v| / (e^u + e^v) = tanh(|u - v| / 2)
            imbalance = to_float(xp.max(xp.tanh(0.5 * xp.abs(ca - cb))))
            if imbalance <= tol or iterations >= max_iter:
                log_value = to_float(_logsumexp(0.5 * (ra + rb), axis=0))
                return 1.0, log_value, _numpy64(x), _numpy64(y), iterations, imbalance
            y = y + 0.5 * (cb - ca)


def _logsumexp(L: Any, axis: int) -> Any:
    """``log Σ exp(L)`` along ``axis``; every slice must hold a finite entry."""
    xp = namespace_of(L)
    top = xp.max(L, axis=axis)
    shifted = L - (top[:, None] if axis == 1 and L.ndim == 2 else top)
    return top + xp.log(xp.sum(xp.exp(shifted), axis=axis))


def _numpy64(x: Any) -> np.ndarray:
    return np.asarray(to_numpy(x), dtype=np.float64)
