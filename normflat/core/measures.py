"""Per-layer measures of SPEC §4, computed from a :class:`LayerProblem`."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np

from normflat.core._arrays import as_float64, namespace_of, to_float, to_numpy
from normflat.core.problem import LayerProblem
from normflat.core.report import LayerResult, Report
from normflat.core.solver import ScalingSolution, solve_scaling

__all__ = [
    "LayerMatrices", "evaluate_layer", "analyze_problems", "normalized_sharpness", "curvature_and_weight_matrices",
]

DEFAULT_TOL = 1e-10
DEFAULT_MAX_ITER = 10_000


class LayerMatrices(NamedTuple):
    """The ``out × in`` matrices of SPEC §3 and what falls out of forming them."""

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


def curvature_and_weight_matrices(weight: Any, hessian_diag: Any) -> LayerMatrices:
    """Form ``A`` and ``B`` of SPEC §3 in float64, in the arrays' own library.

    ``A_ij = max(Σ_k H_ijk, 0)`` and ``B_ij = Σ_k W_ijk²``, summed over the
    kernel axes.
    """
    xp = namespace_of(weight, hessian_diag)
    # Both arrays share xp, so both stay in it or both move to numpy.
    W, _ = as_float64(weight, xp)
    H, xp = as_float64(hessian_diag, xp)
    out, inp = int(W.shape[0]), int(W.shape[1])
    H_sum = xp.sum(xp.reshape(H, (out, inp, -1)), axis=2)
    B = xp.sum(xp.reshape(W * W, (out, inp, -1)), axis=2)
    clipped = int(to_float(xp.sum(xp.astype(H_sum < 0, xp.float64))))
    A = xp.where(H_sum > 0, H_sum, xp.zeros_like(H_sum))
    return LayerMatrices(A, B, clipped, to_float(xp.sum(H_sum)), xp)


def evaluate_layer(
    problem: LayerProblem, *, tol: float = DEFAULT_TOL, max_iter: int = DEFAULT_MAX_ITER
) -> LayerResult:
    """Compute every measure of SPEC §4 for one layer.

    Args:
        problem: The layer's weight and Hessian diagonal in canonical layout.
        tol: Relative balance tolerance of the solver.
        max_iter: Maximum number of solver sweeps.

    Returns:
        A :class:`LayerResult` with the four measures, the optimal row and column
        sigmas, solver diagnostics, and standard errors when the problem carries
        independent estimates of the diagonal.
    """
    A, B, clipped, hessian_trace, xp = curvature_and_weight_matrices(problem.weight, problem.hessian_diag)
    sum_a, sum_b = to_float(xp.sum(A)), to_float(xp.sum(B))
    matrix_ns = math.sqrt(sum_a * sum_b)
    elementwise = to_float(xp.sum(xp.sqrt(A * B)))
    solution = _solve_grouped(A, B, problem.groups, tol=tol, max_iter=max_iter)
    # Rounding can put the solver's value a hair outside the sandwich it provably
    # lies in; clamp to keep the documented ordering exact.
    value = min(max(solution.value, elementwise), matrix_ns)

    standard_error = None
    group_values = None
    if problem.hessian_diag_samples is not None:
        group_values = _linearized_group_values(problem, A, B, xp, solution, sum_a, sum_b)
        k = next(iter(group_values.values())).size
        standard_error = {
            name: float(np.std(vals, ddof=1) / math.sqrt(k)) for name, vals in group_values.items()
        }

    return LayerResult(
        name=problem.name,
        kind=problem.kind,
        shape=problem.shape,
        normalized_sharpness=float(value),
        matrix_normalized_sharpness=float(matrix_ns),
        hessian_trace=float(hessian_trace),
        elementwise_bound=float(elementwise),
        row_sigma=np.exp(solution.log_row_sigma),
        col_sigma=np.exp(solution.log_col_sigma),
        iterations=solution.iterations,
        imbalance=solution.imbalance,
        converged=solution.converged,
        degenerate_rows=solution.degenerate_rows,
        degenerate_cols=solution.degenerate_cols,
        clipped=clipped,
        standard_error=standard_error,
        details=dict(problem.details),
        _group_values=group_values,
    )


def _solve_grouped(A: Any, B: Any, groups: int, *, tol: float, max_iter: int) -> ScalingSolution:
    """Solve a grouped layer as independent blocks and assemble one solution.

    Columns of the result index all ``groups · in/groups`` input channels; each
    block keeps its own gauge (geometric mean of its column sigmas is 1).
    """
    if groups == 1:
        return solve_scaling(A, B, tol=tol, max_iter=max_iter)
    rows_per_group, cols_per_group = int(A.shape[0]) // groups, int(A.shape[1])
    parts = [
        solve_scaling(A[g * rows_per_group : (g + 1) * rows_per_group],
                      B[g * rows_per_group : (g + 1) * rows_per_group], tol=tol, max_iter=max_iter)
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


def _linearized_group_values(problem, A, B, xp, solution, sum_a, sum_b) -> dict[str, np.ndarray]:
    """First-order (delta-method) value of each measure for each group estimate.

    Each group's value is ``m(A) + ∇m(A)·(A_k − A)``. By the envelope theorem the derivative of ``NS`` with respect to ``A_ij`` is ``½ v_ij`` with
    ``v_ij = e^{a_i + b_j}`` the optimal variance. Entries whose curvature was
    clipped or whose row/column is degenerate have derivative 0.
    """
    samples, _ = as_float64(problem.hessian_diag_samples, namespace_of(problem.hessian_diag_samples))
    samples = np.asarray(to_numpy(samples))
    A_np, B_np = np.asarray(to_numpy(A)), np.asarray(to_numpy(B))
    k = samples.shape[0]
    out, inp = A_np.shape
    A_groups = samples.reshape(k, out, inp, -1).sum(axis=3)
    active = A_np > 0
    groups = problem.groups
    # Column sigma of entry (i, j) in the compact grouped layout: input channel
    # j of the group that output channel i belongs to.
    col_index = (np.arange(out) // (out // groups))[:, None] * inp + np.arange(inp)[None, :]
    log_v = solution.log_row_sigma[:, None] + solution.log_col_sigma[col_index]
    finite = np.isfinite(log_v) & active
    v = np.where(finite, np.exp(np.where(finite, log_v, 0.0)), 0.0)
    ratio = np.where(active, np.sqrt(np.where(active, B_np, 0.0) / np.where(active, A_np, 1.0)), 0.0)
    mns_slope = 0.5 * math.sqrt(sum_b / sum_a) if sum_a > 0 else 0.0
    deviation = A_groups - A_np[None]
    return {
        "hessian_trace": samples.reshape(k, -1).sum(axis=1),
        "normalized_sharpness": solution.value + 0.5 * np.einsum("kij,ij->k", deviation, v),
        "matrix_normalized_sharpness": math.sqrt(sum_a * sum_b)
        + mns_slope * np.einsum("kij,ij->k", deviation, active),
        "elementwise_bound": float(np.sqrt(A_np * B_np).sum())
        + 0.5 * np.einsum("kij,ij->k", deviation, ratio),
    }


def analyze_problems(
    problems: Sequence[LayerProblem],
    *,
    metadata: dict[str, Any] | None = None,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
) -> Report:
    """Evaluate every layer and sum the measures into a :class:`Report`."""
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
    """Normalized sharpness of one layer (SPEC §4).

    Args:
        weight: Weight tensor in canonical layout ``(out, in, *kernel)``.
        hessian_diag: Loss-Hessian diagonal with respect to ``weight``, same shape.
        name: Name used in messages and the result.
        kind: Layer kind label.
        groups: Groups of a grouped convolution (see :class:`LayerProblem`).
        tol: Relative balance tolerance of the solver.
        max_iter: Maximum number of solver sweeps.

    Returns:
        A :class:`LayerResult`; ``.value`` is the normalized sharpness, and the
        result also holds the other measures, the optimal sigmas and diagnostics.

    Example:
        >>> import numpy as np, normflat
        >>> w = np.array([[1.0, 2.0], [3.0, 4.0]])
        >>> h = np.array([[4.0, 1.0], [1.0, 0.25]])
        >>> round(normflat.normalized_sharpness(w, h).value, 6)
        9.044878
    """
    problem = LayerProblem(name, weight, hessian_diag, kind=kind, groups=groups)
    return evaluate_layer(problem, tol=tol, max_iter=max_iter)
