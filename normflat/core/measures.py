"""Per-layer measures of method §4, computed from a :class:`LayerProblem`."""

from __future__ import annotations

import math
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from normflat.core._arrays import holds_float64, as_float64, namespace_of, to_float, to_numpy
from normflat.core.problem import LayerProblem
from normflat.core.report import LayerResult, Report, standard_error_of
from normflat.core.solver import (
    DEFAULT_MAX_ITER,
    DEFAULT_TOL,
    PASS_BLOCK_ENTRIES,
    DerivedEntries,
    Entries,
    ScalingSolution,
    check_solver_options,
    compose,
    degenerate_log,
    safe_log,
    solve_entries,
)

__all__ = [
    "LayerMatrices", "evaluate_layer", "analyze_problems", "normalized_sharpness", "curvature_and_weight_matrices",
]

#: Below this, float64 values lose precision (subnormals start at 2.2e-308).
_TINY = 1e-300
#: Largest spread of one layer's weights whose squares fit one float64 scale.
_WIDE = 1e150
_LN2 = math.log(2.0)
_LOG_HALF = math.log(0.5)
#: A little below log(float64 max): an exponential up to it is finite.
_LOG_FLOAT64_MAX = 709.0


class LayerMatrices(NamedTuple):
    """The ``out × in`` matrices of method §3 and what falls out of forming them."""

    A: Any
    """``max(Σ_k H_ijk, 0)``: curvature summed over the kernel axes, clipped at 0."""
    B: Any
    """``Σ_k W_ijk²``: squared weights summed over the kernel axes."""
    clipped: int
    """Number of ``(out, in)`` entries whose curvature sum was negative."""
    hessian_trace: float
    """``Σ H`` before clipping."""
    xp: Any
    """Array namespace of ``A`` and ``B`` (float64)."""


class _LayerEntries(NamedTuple):
    """``A`` and ``B`` as :class:`Entries`, which hold any finite layer exactly."""

    A: Entries
    B: Entries
    clipped: int
    hessian_trace: float
    xp: Any


def curvature_and_weight_matrices(weight: Any, hessian_diag: Any) -> LayerMatrices:
    """Form ``A`` and ``B`` of method §3 in float64, in the arrays' own library.

    ``A_ij = max(Σ_k H_ijk, 0)`` and ``B_ij = Σ_k W_ijk²``, summed over the
    kernel axes. The measures themselves never need these plain matrices (they
    keep layers whose squared weights leave the float64 range exactly, see
    method §5); this function is for inspecting and benchmarking the per-layer
    problem.

    Raises:
        OverflowError: If an entry of ``A`` or ``B`` exceeds the float64 range
            (weights above about 1e154 in magnitude); entries below about 1e-308
            (weights below about 1e-154) are subnormal or zero here.
    """
    entries = _layer_entries(weight, hessian_diag)
    A, B = (_materialize(e, what) for e, what in ((entries.A, "A (curvature)"), (entries.B, "B (squared weights)")))
    return LayerMatrices(A, B, entries.clipped, entries.hessian_trace, entries.xp)


def _materialize(entries: Entries, what: str) -> Any:
    xp = entries.xp
    if entries.is_log:
        with np.errstate(over="ignore"):
            M = xp.exp(entries.values)
    elif entries.exp2 == 0:
        return entries.dense()
    elif -1022 <= entries.exp2 <= 1023:
        with np.errstate(over="ignore"):
            M = entries.values * 2.0**entries.exp2
    else:
        with np.errstate(over="ignore"):
            M = xp.exp(entries.logs())
    if not bool(xp.all(xp.isfinite(M))):
        raise OverflowError(
            f"An entry of {what} exceeds the float64 range; use normflat.normalized_sharpness, "
            "which handles such layers, or rescale the weights/loss."
        )
    return M


#: Entries of the float64 blocks in which a lower-precision layer with kernel axes is summed.
_BLOCK_ENTRIES = 1 << 20


def _layer_entries(weight: Any, hessian_diag: Any) -> _LayerEntries:
    xp = namespace_of(weight, hessian_diag)
    out, inp = int(weight.shape[0]), int(weight.shape[1])
    kernel = math.prod(int(d) for d in weight.shape[2:])
    if kernel == 1 and _within_float32(xp, weight.dtype) and _within_float32(xp, hessian_diag.dtype) \
            and holds_float64(xp):
        # A float32 dense layer: A and B are formed from the arrays themselves a block of rows at a
        # time wherever they are used (DerivedEntries), never as float64 copies of the layer's size
        # (five of them were the peak of a report on an MLP, several times a training step). Every
        # entry is the float64 value of the plain path: float32 squares are exact in float64.
        H2, W2 = xp.reshape(hessian_diag, (out, inp)), xp.reshape(weight, (out, inp))
        clipped, trace = _blocked_curvature_stats(xp, H2)
        return _LayerEntries(DerivedEntries(H2, xp, "curvature"), DerivedEntries(W2, xp, "squares"),
                             clipped, trace, xp)
    if kernel > 1 and (weight.dtype != xp.float64 or hessian_diag.dtype != xp.float64) and holds_float64(xp):
        # A float32 convolution: its (out, in) kernel sums in float64, a block of rows at a time,
        # never a float64 copy of the whole kernel (three of them were most of the peak of a
        # report on resnet18). The same sums of float64 values as below.
        W3, H3 = xp.reshape(weight, (out, inp, kernel)), xp.reshape(hessian_diag, (out, inp, kernel))
        A, clipped, trace = _curvature(xp, H3, _blocked_sums(xp, H3, square=False))
        B = _squared_weights(xp, W3, _blocked_sums(xp, W3, square=True))
        return _LayerEntries(A, B, clipped, trace, xp)
    # Both arrays share xp, so both stay in it or both move to numpy.
    W, _ = as_float64(weight, xp)
    H, xp = as_float64(hessian_diag, xp)
    A, clipped, trace = _curvature(xp, xp.reshape(H, (out, inp, -1)))
    B = _squared_weights(xp, xp.reshape(W, (out, inp, -1)))
    return _LayerEntries(A, B, clipped, trace, xp)


def _within_float32(xp: Any, dtype: Any) -> bool:
    """Whether a floating dtype's range lies within float32's (float32, float16, bfloat16)."""
    return dtype != xp.float64 and float(xp.finfo(dtype).max) <= float(xp.finfo(xp.float32).max)


def _row_blocks(out: int, inp: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of the blocks of rows of an ``(out, in)`` layer that a single pass over it
    (sums, the element-wise bound, the standard errors' linear terms) forms in float64 at once."""
    rows = max(1, PASS_BLOCK_ENTRIES // max(1, inp))
    for start in range(0, out, rows):
        yield start, min(out, start + rows)


def _blocked_curvature_stats(xp: Any, H2: Any) -> tuple[int, float]:
    """``(clipped, Σ H)`` of a lower-precision ``(out, in)`` diagonal, in float64 blocks of rows."""
    clipped, parts = 0, []
    for start, stop in _row_blocks(int(H2.shape[0]), int(H2.shape[1])):
        block, _ = as_float64(H2[start:stop, :], xp)
        clipped += _count(xp, block < 0)
        parts.append(to_float(xp.sum(block)))
    return clipped, math.fsum(parts)


def _blocked_sums(xp: Any, X3: Any, square: bool) -> Any:
    """``Σ_k X`` (or ``Σ_k X²``) over the kernel axis of ``(out, in, k)`` ``X3`` in float64,
    converting a block of rows at a time."""
    rows = max(1, _BLOCK_ENTRIES // max(1, int(X3.shape[1]) * int(X3.shape[2])))
    parts = []
    with np.errstate(over="ignore"):  # overflowing squares are detected and redone by the caller
        for start in range(0, int(X3.shape[0]), rows):
            block, _ = as_float64(X3[start:min(int(X3.shape[0]), start + rows), ...], xp)
            parts.append(xp.sum(block * block if square else block, axis=2))
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)


def _count(xp: Any, mask: Any) -> int:
    return int(to_float(xp.sum(xp.astype(mask, xp.float64))))


def _curvature(xp: Any, H3: Any, H_sum: Any = None) -> tuple[Entries, int, float]:
    """``A`` with the number of clipped entries and the trace ``Σ H`` (``H_sum``: the float64
    kernel sums when already formed)."""
    if H_sum is None:
        with np.errstate(over="ignore"):  # an overflowing sum is detected and redone below
            H_sum = xp.sum(H3, axis=2)
    if bool(xp.all(xp.isfinite(H_sum))):
        A = xp.where(H_sum > 0, H_sum, xp.zeros_like(H_sum))
        return Entries(A, xp), _count(xp, H_sum < 0), _signed_total(xp, H_sum)
    H3, _ = as_float64(H3, xp)
    # A kernel sum overflowed (entries near 1e308): sum every (row, column) pair in
    # units of its own largest entry and keep the result as a logarithm.
    top = xp.max(xp.abs(H3), axis=2)
    unit = xp.where(top > 0, top, xp.ones_like(top))
    S = xp.sum(H3 / unit[:, :, None], axis=2)
    positive = S > 0
    log_a = xp.where(positive, xp.log(unit) + xp.log(xp.where(positive, S, xp.ones_like(S))),
                     xp.full_like(S, -math.inf))
    return Entries(log_a, xp, log=True), _count(xp, S < 0), _signed_total(xp, S, unit)


def _signed_total(xp: Any, X: Any, unit: Any = None) -> float:
    """``Σ X`` (``Σ X ⊙ unit`` when given, with ``|X|`` moderate) where a plain sum may overflow."""
    if unit is None:
        with np.errstate(over="ignore"):  # an overflowing sum is redone in scaled units
            direct = to_float(xp.sum(X))
        if math.isfinite(direct):
            return direct
        e = math.frexp(to_float(xp.max(xp.abs(X))))[1]  # |X| <= 2^e
        scaled = to_float(xp.sum(X * 2.0**-e))
    else:
        e = math.frexp(to_float(xp.max(unit)))[1]
        scaled = to_float(xp.sum(X * (unit * 2.0**-e)))
    # Powers of two scale exactly; terms far below the largest do not change the sum.
    return math.copysign(compose((abs(scaled),), 0.0, e), scaled) if scaled else 0.0


def _squared_weights(xp: Any, W3: Any, B: Any = None) -> Entries:
    """``B = Σ_k W²`` exactly: plain, scaled by a power of two, or in logs (``B``: the float64
    sums of squares when already formed)."""
    if B is None:
        with np.errstate(over="ignore"):  # squares beyond float64 are detected and redone below
            B = xp.sum(W3 * W3, axis=2)
    if bool(xp.all(xp.isfinite(B))):
        small = B < _TINY
        # Only pairs whose weights are all tiny but not all zero lose their value.
        if not bool(xp.any(small)) or not bool(xp.any(small & xp.any(W3 != 0, axis=2))):
            return Entries(B, xp)
    W3, _ = as_float64(W3, xp)
    top = xp.max(xp.abs(W3), axis=2)
    w_max = to_float(xp.max(top))
    w_min = to_float(xp.min(xp.where(top > 0, top, xp.full_like(top, math.inf))))
    if w_max <= _WIDE * w_min:
        # One power of two brings every pair's squares into range: exact.
        e = math.frexp(w_max)[1]
        scaled = W3 * 2.0**-e
        return Entries(xp.sum(scaled * scaled, axis=2), xp, exp2=2 * e)
    # The squares span more than float64 holds: each pair in units of its largest weight.
    unit = xp.where(top > 0, top, xp.ones_like(top))
    ratio = W3 / unit[:, :, None]
    log_b = xp.where(top > 0, 2.0 * xp.log(unit) + safe_log(xp, xp.sum(ratio * ratio, axis=2)),
                     xp.full_like(top, -math.inf))
    return Entries(log_b, xp, log=True)


def _sqrt_product(p: tuple[float, float, int], q: tuple[float, float, int]) -> float:
    """``sqrt(P · Q)`` of two :meth:`Entries.total` results."""
    if p[0] == 0.0 or q[0] == 0.0:
        return 0.0
    odd = (math.sqrt(2.0),) if (p[2] + q[2]) % 2 else ()
    return compose((math.sqrt(p[0]), math.sqrt(q[0]), *odd), 0.5 * (p[1] + q[1]), (p[2] + q[2]) // 2)


def _elementwise_bound(A: Entries, B: Entries) -> float:
    """``Σ sqrt(A ⊙ B)``."""
    xp = A.xp
    if A.is_log or B.is_log:
        mantissa, log_factor, _ = Entries(0.5 * (A.logs() + B.logs()), xp, log=True).total()
        return compose((mantissa,), log_factor)
    # sqrt of each factor: the product of two tiny entries would underflow.
    if A.derived or B.derived:  # a block of rows at a time (no float64 arrays of the layer's size)
        total = math.fsum(to_float(xp.sum(xp.sqrt(A.block(start, stop)) * xp.sqrt(B.block(start, stop))))
                          for start, stop in _row_blocks(*A.shape))
    else:
        total = to_float(xp.sum(xp.sqrt(A.values) * xp.sqrt(B.values)))
    odd = (math.sqrt(2.0),) if (A.exp2 + B.exp2) % 2 else ()
    return compose((total, *odd), 0.0, (A.exp2 + B.exp2) // 2) if total else 0.0


def evaluate_layer(
    problem: LayerProblem, *, tol: float = DEFAULT_TOL, max_iter: int = DEFAULT_MAX_ITER
) -> LayerResult:
    """Compute every measure of method §4 for one layer.

    Any finite float64 weights and curvature are handled exactly, however large,
    small or mixed their magnitudes (method §5, numerics).

    Args:
        problem: The layer's weight and Hessian diagonal in canonical layout.
        tol: Relative balance tolerance of the solver, finite and ``> 0``.
        max_iter: Maximum number of solver sweeps, an int ``>= 1``.

    Returns:
        A :class:`LayerResult` with the four measures, the optimal row and column
        sigmas, solver diagnostics, and standard errors when the problem carries
        independent estimates of the diagonal.

    Raises:
        TypeError, ValueError: If ``tol`` or ``max_iter`` is invalid.
        OverflowError: If a measure itself exceeds the float64 range (the message
            names the layer and the fix).
    """
    tol, max_iter = check_solver_options(tol, max_iter)
    try:
        return _evaluate(problem, tol, max_iter)
    except OverflowError as err:
        raise OverflowError(f"Layer {problem.name!r}: {err}") from None


def _evaluate(problem: LayerProblem, tol: float, max_iter: int) -> LayerResult:
    entries = _layer_entries(problem.weight, problem.hessian_diag)
    A, B = entries.A, entries.B
    sum_a, sum_b = A.total(), B.total()
    matrix_ns = _sqrt_product(sum_a, sum_b)
    elementwise = _elementwise_bound(A, B)
    solution = _solve_grouped(A, B, problem.groups, tol=tol, max_iter=max_iter)
    # Rounding can put the solver's value a hair outside the sandwich it provably
    # lies in; clamp to keep the documented ordering exact.
    value = min(max(solution.value, elementwise), matrix_ns)

    standard_error = None
    group_values = None
    if problem.hessian_diag_samples is not None:
        group_values = _linearized_group_values(
            problem, entries, solution, sum_a, sum_b,
            {"hessian_trace": entries.hessian_trace, "normalized_sharpness": solution.value,
             "matrix_normalized_sharpness": matrix_ns, "elementwise_bound": elementwise},
        )
        standard_error = {name: standard_error_of(vals) for name, vals in group_values.items()}

    # Sigmas beyond the float64 range (only for weights or curvature beyond about
    # 1e±150) read inf or 0; degenerate_rows/cols tell them from optima at infinity.
    with np.errstate(over="ignore"):
        row_sigma, col_sigma = np.exp(solution.log_row_sigma), np.exp(solution.log_col_sigma)
    return LayerResult(
        name=problem.name,
        kind=problem.kind,
        shape=problem.shape,
        normalized_sharpness=float(value),
        matrix_normalized_sharpness=float(matrix_ns),
        hessian_trace=float(entries.hessian_trace),
        elementwise_bound=float(elementwise),
        row_sigma=row_sigma,
        col_sigma=col_sigma,
        iterations=solution.iterations,
        imbalance=solution.imbalance,
        converged=solution.converged,
        degenerate_rows=solution.degenerate_rows,
        degenerate_cols=solution.degenerate_cols,
        clipped=entries.clipped,
        standard_error=standard_error,
        details=dict(problem.details),
        _group_values=group_values,
    )


def _solve_grouped(A: Entries, B: Entries, groups: int, *, tol: float, max_iter: int) -> ScalingSolution:
    """Solve a grouped layer as independent blocks and assemble one solution.

    Columns of the result index all ``groups · in/groups`` input channels; each
    block keeps its own gauge (geometric mean of its column sigmas is 1).
    """
    if groups == 1:
        return solve_entries(A, B, tol=tol, max_iter=max_iter)
    rows_per_group, cols_per_group = A.shape[0] // groups, A.shape[1]
    if cols_per_group == 1:
        return _solve_depthwise(A, B, groups, tol=tol, max_iter=max_iter)
    parts = [
        solve_entries(A.rows(g * rows_per_group, (g + 1) * rows_per_group),
                      B.rows(g * rows_per_group, (g + 1) * rows_per_group), tol=tol, max_iter=max_iter)
        for g in range(groups)
    ]
    return ScalingSolution(
        value=math.fsum(p.value for p in parts),
        log_row_sigma=np.concatenate([p.log_row_sigma for p in parts]),
        log_col_sigma=np.concatenate([p.log_col_sigma for p in parts]),
        iterations=max(p.iterations for p in parts),
        imbalance=max(p.imbalance for p in parts),
        converged=all(p.converged for p in parts),
        degenerate_rows=tuple(g * rows_per_group + i for g, p in enumerate(parts) for i in p.degenerate_rows),
        degenerate_cols=tuple(g * cols_per_group + j for g, p in enumerate(parts) for j in p.degenerate_cols),
    )


def _solve_depthwise(A: Entries, B: Entries, groups: int, *, tol: float, max_iter: int) -> ScalingSolution:
    """:func:`_solve_grouped` for one input channel per group (a depthwise convolution), in one solve.

    Each block is a column of rows, ``Σ_i ½(A_i e^{a_i + b} + B_i e^{-a_i - b})``: separable in the
    rows, so the whole ``(out, 1)`` matrix taken as one problem has the blocks' summed infimum and
    the same optimal rows, and its one column's gauge (``b = 0``) is each block's. A column is
    degenerate when its block's rows all are, labelled as :func:`~normflat.core.solver.solve_entries`
    labels a degenerate column. One solve instead of one per channel (EfficientNet-B0's depthwise
    layers made ``analyze`` solve 9026 problems, 4.4 s against 1 s for the Hessian diagonal)."""
    whole = solve_entries(A, B, tol=tol, max_iter=max_iter)
    rows_per_group = A.shape[0] // groups
    dead = np.zeros(A.shape[0], bool)
    dead[list(whole.degenerate_rows)] = True
    alive = ~dead.reshape(groups, rows_per_group).all(axis=1)
    has_a = np.asarray(to_numpy(A.positive())).reshape(groups, rows_per_group).any(axis=1)
    has_b = np.asarray(to_numpy(B.positive())).reshape(groups, rows_per_group).any(axis=1)
    log_col = np.where(alive, 0.0, degenerate_log(has_a, has_b))
    return ScalingSolution(
        value=whole.value,
        log_row_sigma=whole.log_row_sigma,
        log_col_sigma=log_col,
        iterations=whole.iterations,
        imbalance=whole.imbalance,
        converged=whole.converged,
        degenerate_rows=whole.degenerate_rows,
        degenerate_cols=tuple(int(g) for g in np.flatnonzero(~alive)),
    )


def _linearized_group_values(
    problem: LayerProblem,
    entries: _LayerEntries,
    solution: ScalingSolution,
    sum_a: tuple[float, float, int],
    sum_b: tuple[float, float, int],
    base: dict[str, float],
) -> dict[str, np.ndarray]:
    """First-order (delta-method) value of each measure for each group estimate.

    Each group's value is ``m(A) + ∇m(A)·(A_k − A)``. By the envelope theorem the
    derivative of ``NS`` with respect to ``A_ij`` is ``½ v_ij`` with
    ``v_ij = e^{a_i + b_j}`` the optimal variance. Entries whose curvature was
    clipped or whose row/column is degenerate have derivative 0. Every product
    ``deviation · derivative`` is formed from logarithms, so no intermediate
    leaves the float64 range unless the result itself does.
    """
    raw = problem.hessian_diag_samples
    k = int(raw.shape[0])
    mns_slope = None
    if sum_a[0] > 0 and sum_b[0] > 0:
        # d sqrt(ΣA·ΣB) / dA_ij = ½ sqrt(ΣB / ΣA), the same for every entry
        mns_slope = _LOG_HALF + 0.5 * (
            math.log(sum_b[0]) + sum_b[1] + sum_b[2] * _LN2 - math.log(sum_a[0]) - sum_a[1] - sum_a[2] * _LN2)
    # The groups' kernel sums, summed in float64 in the samples' own library, in units of 2^e
    # when a plain sum overflows.
    e = 0
    while True:
        values = _group_linear_terms(raw, k, e, entries, solution, problem.groups, mns_slope)
        if values is not None:
            break
        xs = namespace_of(raw)
        e = max(math.frexp(to_float(xs.max(xs.abs(raw[g]))))[1] for g in range(k))
    trace = values.pop("trace")
    result = {
        "hessian_trace": trace,
        "normalized_sharpness": base["normalized_sharpness"] + values["normalized_sharpness"],
        "elementwise_bound": base["elementwise_bound"] + values["elementwise_bound"],
        "matrix_normalized_sharpness": (base["matrix_normalized_sharpness"] + values["matrix_normalized_sharpness"]
                                        if "matrix_normalized_sharpness" in values
                                        else np.full(k, base["matrix_normalized_sharpness"])),
    }
    return {name: result[name] for name in ("hessian_trace", "normalized_sharpness",
                                            "matrix_normalized_sharpness", "elementwise_bound")}


def _group_linear_terms(raw: Any, k: int, e: int, entries: _LayerEntries, solution: ScalingSolution,
                        groups: int, mns_slope: float | None) -> dict[str, np.ndarray] | None:
    """``Σ_ij deviation_kij · e^{slope_ij}`` per group ``k`` and measure (0 where the curvature
    is not positive), and each group's trace, with the deviations ``A_k − A`` in units of
    ``2^e``; ``None`` if a kernel sum overflows.

    The slopes (log-derivatives: ``log ½ v_ij`` for normalized sharpness, ``log ½ √(B/A)`` for
    the element-wise bound, one number for the matrix-normalized one) and the deviations are
    formed a block of rows at a time: a few float64 arrays of a block, never of the layer.
    """
    log_unit = e * _LN2
    out, inp = entries.A.shape
    rows_per_group = out // groups
    names = ["normalized_sharpness", "elementwise_bound"] + (["matrix_normalized_sharpness"] if mns_slope is not None
                                                              else [])
    parts: dict[str, list[list[float]]] = {name: [[] for _ in range(k)] for name in names}
    traces: list[list[float]] = [[] for _ in range(k)]
    for start, stop in _row_blocks(out, inp):
        A, B = entries.A.rows(start, stop), entries.B.rows(start, stop)
        active = np.asarray(to_numpy(A.positive()))
        if A.is_log:
            log_A = np.asarray(to_numpy(A.logs()))
            A_units = np.where(active, np.exp(np.where(active, log_A - log_unit, 0.0)), 0.0)
            del log_A
        else:  # exact: a power-of-two rescaling of the plain values
            A_units = np.asarray(to_numpy(A.dense()), dtype=np.float64) * 2.0 ** (A.exp2 - e)
        # Column sigma of entry (i, j) in the compact grouped layout: input channel j of the group
        # that output channel i belongs to.
        col_index = (np.arange(start, stop) // rows_per_group)[:, None] * inp + np.arange(inp)[None, :]
        with np.errstate(invalid="ignore"):  # inf - inf of two degenerate indices: no term
            log_v = solution.log_row_sigma[start:stop, None] + solution.log_col_sigma[col_index]
        del col_index
        log_v += _LOG_HALF
        with np.errstate(invalid="ignore"):  # -inf - (-inf): zero weight and zero curvature, no term
            log_ratio = np.asarray(to_numpy(B.logs())) - np.asarray(to_numpy(A.logs()))
        log_ratio *= 0.5
        log_ratio += _LOG_HALF
        slopes: dict[str, Any] = {"normalized_sharpness": log_v, "elementwise_bound": log_ratio}
        if mns_slope is not None:
            slopes["matrix_normalized_sharpness"] = mns_slope
        del log_v, log_ratio
        terms = {}
        for name in names:  # each slope released as its weights are formed
            terms[name] = _linear_weight(slopes.pop(name), active, log_unit)
        for g in range(k):
            deviation = _kernel_sums(raw[g, start:stop, ...], stop - start, inp, 2.0**-e if e else 1.0)
            if not np.all(np.isfinite(deviation)):
                return None
            traces[g].append(_signed_total(_np_namespace(), deviation.reshape(-1)))
            deviation -= A_units  # in place: one block of float64 per group
            for name, term in terms.items():
                parts[name][g].append(_linear_term(deviation, term))
    values = {name: np.array([_finite_sum(p) for p in per_group]) for name, per_group in parts.items()}
    trace = np.empty(k)
    for g in range(k):
        total = _finite_sum(traces[g])
        trace[g] = math.copysign(compose((abs(total),), 0.0, e), total) if total and e else total
    values["trace"] = trace
    return values


def _finite_sum(parts: list[float]) -> float:
    """``Σ parts`` of the blocks of :func:`_group_linear_terms`; an overflowing total is refused."""
    try:
        return math.fsum(parts)
    except OverflowError:
        pass
    raise OverflowError(
        "a standard error exceeds the float64 range; divide the loss (hence the Hessian "
        "diagonal and its samples) by a constant."
    )


def _linear_weight(log_weight: Any, active: np.ndarray, log_unit: float) -> tuple[str, Any]:
    """The weight ``e^{log_weight}`` of a linear term (0 off ``active``): ``("plain", weight)``,
    or ``("log", log_weight)`` where weights leave the float64 range (huge variances against
    tiny curvature), whose terms are then formed from logarithms."""
    if isinstance(log_weight, float):
        if log_weight + log_unit <= _LOG_FLOAT64_MAX:
            return "constant", (math.exp(log_weight + log_unit), active)  # Σ over the active entries, times it
        log_weight = np.full(active.shape, log_weight)
    log_weight = np.where(active & np.isfinite(log_weight), log_weight, -math.inf)
    log_weight += log_unit
    if float(np.max(log_weight)) <= _LOG_FLOAT64_MAX:
        np.exp(log_weight, out=log_weight)  # in place: the weights fit float64
        return "plain", log_weight
    return "log", log_weight


def _linear_term(deviation: np.ndarray, term: tuple[str, Any]) -> float:
    """``Σ_ij deviation_ij · weight_ij`` of one group (see :func:`_linear_weight`)."""
    kind, array = term
    if kind == "constant":
        weight, active = array
        with np.errstate(over="ignore"):
            total = float(np.sum(deviation, where=active)) * weight
    elif kind == "plain":
        with np.errstate(over="ignore"):  # an overflowing total is refused below
            total = float(np.einsum("ij,ij->", deviation, array))
    else:
        nonzero = deviation != 0
        log_dev = np.where(nonzero, np.log(np.where(nonzero, np.abs(deviation), 1.0)), -math.inf)
        with np.errstate(over="ignore"):
            total = float((np.sign(deviation) * np.exp(log_dev + array)).sum())
    if not math.isfinite(total):
        raise OverflowError(
            "a standard error exceeds the float64 range; divide the loss (hence the Hessian "
            "diagonal and its samples) by a constant."
        )
    return total


def _kernel_sums(group: Any, out: int, inp: int, scale: float = 1.0) -> np.ndarray:
    """``(out, in)`` float64 numpy sums over the kernel axes of one group estimate."""
    xs = namespace_of(group)
    per_pair = xs.reshape(group, (out, inp, -1))
    if scale != 1.0:
        per_pair = per_pair * scale
    if group.dtype == xs.float64 or not holds_float64(xs):
        per_pair, xs = as_float64(per_pair, xs)
        sums = xs.sum(per_pair, axis=2)
    else:
        with np.errstate(over="ignore"):
            sums = xs.sum(per_pair, axis=2, dtype=xs.float64)  # accumulated in float64, no copy
    return np.asarray(to_numpy(sums), dtype=np.float64)


def _np_namespace() -> Any:
    return namespace_of(np.empty(0))


def analyze_problems(
    problems: Sequence[LayerProblem],
    *,
    metadata: dict[str, Any] | None = None,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
) -> Report:
    """Evaluate every layer and sum the measures into a :class:`Report`.

    Args:
        problems: The layers, in model order; names must be unique.
        metadata: Stored in the report (how it was produced).
        tol: Relative balance tolerance of the solver, finite and ``> 0``.
        max_iter: Maximum number of solver sweeps, an int ``>= 1``.

    Raises:
        TypeError: If an item is not a :class:`LayerProblem`, or ``tol``/``max_iter``
            has the wrong type.
        ValueError: If the list is empty, names repeat, or ``tol``/``max_iter`` are out
            of range.
    """
    tol, max_iter = check_solver_options(tol, max_iter)
    problems = list(problems)
    if not problems:
        raise ValueError(
            "analyze() got an empty list of layer problems; pass at least one "
            "normflat.LayerProblem (or a model and data)."
        )
    for p in problems:
        if not isinstance(p, LayerProblem):
            raise TypeError(
                f"analyze() expects LayerProblem items in its list, got {type(p).__name__}."
            )
    names = [p.name for p in problems]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Layer names must be unique; repeated: {duplicates}.")
    layers = [evaluate_layer(p, tol=tol, max_iter=max_iter) for p in problems]
    return Report(layers=layers, metadata=dict(metadata or {}))


def normalized_sharpness(
    weight: Any,
    hessian_diag: Any,
    *,
    name: str = "layer",
    kind: str = "dense",
    groups: int = 1,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
) -> LayerResult:
    """Normalized sharpness of one layer (method §4).

    Args:
        weight: Weight tensor in canonical layout ``(out, in, *kernel)``.
        hessian_diag: Loss-Hessian diagonal with respect to ``weight``, same shape.
        name: Name used in messages and the result.
        kind: Layer kind label.
        groups: Groups of a grouped convolution (see :class:`LayerProblem`).
        tol: Relative balance tolerance of the solver, finite and ``> 0``.
        max_iter: Maximum number of solver sweeps, an int ``>= 1``.

    Returns:
        A :class:`LayerResult`; ``.value`` is the normalized sharpness, and the
        result also holds the other measures, the optimal sigmas and diagnostics.

    Raises:
        TypeError, ValueError: If the arrays are invalid (see :class:`LayerProblem`)
            or ``tol``/``max_iter`` are.
        OverflowError: If a measure exceeds the float64 range.

    Example:
        >>> import numpy as np, normflat
        >>> w = np.array([[1.0, 2.0], [3.0, 4.0]])
        >>> h = np.array([[4.0, 1.0], [1.0, 0.25]])
        >>> round(normflat.normalized_sharpness(w, h).value, 6)
        9.044878
    """
    tol, max_iter = check_solver_options(tol, max_iter)
    problem = LayerProblem(name, weight, hessian_diag, kind=kind, groups=groups)
    return evaluate_layer(problem, tol=tol, max_iter=max_iter)
