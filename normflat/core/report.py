"""Results: one :class:`LayerResult` per weight tensor, totals in a :class:`Report`."""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# MEASURES lives in a leaf module so that the figures can use it without importing
# this one; it stays importable from here.
from normflat.core.constants import MEASURES

__all__ = ["LayerResult", "Report", "MEASURES", "standard_error_of"]


def standard_error_of(values: Any) -> float:
    """Standard error of the mean of ``K >= 2`` group values, ``std(ddof=1) / sqrt(K)``.

    Formed in units of the largest deviation, so values near the float64 limits
    give the right number rather than an overflow.

    Raises:
        OverflowError: If a group value is not finite (a measure beyond float64).
    """
    values = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise OverflowError("a standard error is beyond the float64 range (non-finite group values).")
    k = values.size
    top = float(np.max(np.abs(values)))
    if top == 0.0:
        return 0.0
    deviation = values / top - np.mean(values / top)
    spread = float(np.max(np.abs(deviation)))
    if spread == 0.0:
        return 0.0
    std = spread * math.sqrt(float(np.sum((deviation / spread) ** 2)) / (k - 1))
    return float(std * top / math.sqrt(k))


@dataclass(frozen=True, eq=False)
class LayerResult:
    """All measures and solver diagnostics of one weight tensor.

    Attributes:
        name: Layer name in its framework.
        kind: Layer kind (``"dense"``, ``"conv2d"``, ...).
        shape: Canonical weight shape ``(out, in, *kernel)``.
        normalized_sharpness: ``NS(A, B)`` (method §4); also available as ``value``.
        matrix_normalized_sharpness: ``sqrt(ΣA · ΣB)``.
        hessian_trace: ``Σ H`` (unclipped).
        elementwise_bound: ``Σ sqrt(A ⊙ B)``.
        row_sigma: Optimal per-row scales ``σ_i = e^{a_i}`` (``inf``/``0`` for
            degenerate rows whose optimum is at infinity, 1 for empty rows; a
            finite optimum beyond the float64 range, possible only for weights or
            curvature beyond about 1e±150, also reads ``inf``/``0``, and
            ``degenerate_rows`` tells the two apart).
        col_sigma: Optimal per-column scales ``σ'_j``, geometric mean 1 over the
            non-degenerate columns (per group for grouped convolutions, whose
            columns index all ``in`` input channels).
        iterations: Solver sweeps.
        imbalance: Final relative row/column imbalance (optimality residual).
        converged: Whether the solver reached its tolerance.
        degenerate_rows: Rows with all-zero curvature or all-zero weights.
        degenerate_cols: Columns likewise.
        clipped: Number of ``(out, in)`` entries whose curvature sum was negative
            and was clipped to zero.
        standard_error: Standard error of each measure when the estimator is
            stochastic and supplied independent estimates, else ``None``.
        details: Backend information (estimator path, sample counts, ...).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    normalized_sharpness: float
    matrix_normalized_sharpness: float
    hessian_trace: float
    elementwise_bound: float
    row_sigma: np.ndarray
    col_sigma: np.ndarray
    iterations: int
    imbalance: float
    converged: bool
    degenerate_rows: tuple[int, ...]
    degenerate_cols: tuple[int, ...]
    clipped: int
    standard_error: dict[str, float] | None = None
    details: dict[str, Any] = field(default_factory=dict)
    _group_values: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @property
    def value(self) -> float:
        """The normalized sharpness (alias of :attr:`normalized_sharpness`)."""
        return self.normalized_sharpness

    @property
    def sigma(self) -> np.ndarray:
        """Optimal posterior standard deviation per canonical ``(out, in/groups)`` entry,
        ``sqrt(σ_i σ'_j)``; the variance ``v_ij = σ_i σ'_j`` is shared by the
        kernel entries of that pair."""
        out, cols = self.shape[0], self.shape[1]
        groups = self.col_sigma.size // cols
        col_index = (np.arange(out) // (out // groups))[:, None] * cols + np.arange(cols)[None, :]
        with np.errstate(invalid="ignore", over="ignore"):
            return np.sqrt(self.row_sigma[:, None] * self.col_sigma[col_index])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; infinite sigmas (optimum at infinity) become ``None``."""
        return {
            "name": self.name,
            "kind": self.kind,
            "shape": list(self.shape),
            **{m: getattr(self, m) for m in MEASURES},
            "row_sigma": _json_floats(self.row_sigma),
            "col_sigma": _json_floats(self.col_sigma),
            "iterations": self.iterations,
            "imbalance": self.imbalance,
            "converged": self.converged,
            "degenerate_rows": list(self.degenerate_rows),
            "degenerate_cols": list(self.degenerate_cols),
            "clipped": self.clipped,
            "standard_error": self.standard_error,
            "details": _jsonable(self.details),
        }


@dataclass(frozen=True, eq=False)
class Report:
    """Normalized sharpness and companion measures of a model, per layer and in total.

    Attributes:
        layers: One :class:`LayerResult` per weight tensor, in model order.
        metadata: How the report was produced (framework, loss, estimator,
            samples, number of examples, ...).
    """

    layers: list[LayerResult]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def normalized_sharpness(self) -> float:
        """Sum over layers of the normalized sharpness."""
        return _total(self.layers, "normalized_sharpness")

    @property
    def matrix_normalized_sharpness(self) -> float:
        """Sum over layers of the matrix-normalized sharpness."""
        return _total(self.layers, "matrix_normalized_sharpness")

    @property
    def hessian_trace(self) -> float:
        """Sum over layers of the Hessian trace of the weight tensors."""
        return _total(self.layers, "hessian_trace")

    @property
    def elementwise_bound(self) -> float:
        """Sum over layers of the element-wise lower bound."""
        return _total(self.layers, "elementwise_bound")

    @property
    def totals(self) -> dict[str, float]:
        """The four totals by name."""
        return {m: getattr(self, m) for m in MEASURES}

    @property
    def standard_error(self) -> dict[str, float] | None:
        """Standard errors of the totals (stochastic estimators only), else ``None``.

        The group estimates of every layer come from the same probes, so totals are
        formed per group before taking the spread; errors of different layers are
        therefore correlated correctly.
        """
        groups = [layer._group_values for layer in self.layers]
        if not groups or any(g is None for g in groups):
            return None
        sizes = {g[m].size for g in groups for m in g}
        if len(sizes) != 1:
            return None
        with np.errstate(over="ignore"):  # an overflowing total is refused just below
            totals = {m: sum(g[m] for g in groups) for m in MEASURES}
        return {m: standard_error_of(totals[m]) for m in MEASURES}

    def layer(self, name: str) -> LayerResult:
        """The layer named ``name``."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"No layer named {name!r}; layers are {[l.name for l in self.layers]}.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with totals, standard errors, metadata and layers."""
        return {
            "totals": self.totals,
            "standard_error": self.standard_error,
            "metadata": _jsonable(self.metadata),
            "layers": [layer.to_dict() for layer in self.layers],
        }

    def to_json(self, path: str | Path | None = None, *, indent: int = 2) -> str:
        """Serialize to JSON (standard-compliant: no NaN/Infinity literals).

        Args:
            path: If given, the JSON is also written to this file.
            indent: Indentation of the JSON text.

        Returns:
            The JSON text.
        """
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=False)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    def to_dataframe(self) -> Any:
        """One row per layer with the scalar fields, as a pandas DataFrame.

        Raises:
            ImportError: If pandas is not installed.
        """
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError(
                "Report.to_dataframe() needs pandas; install it with `pip install pandas` "
                "(or `pip install normflat[all]`)."
            ) from err
        rows = []
        for layer in self.layers:
            row = {"name": layer.name, "kind": layer.kind, "shape": tuple(layer.shape)}
            row.update({m: getattr(layer, m) for m in MEASURES})
            if layer.standard_error:
                row.update({f"{m}_se": v for m, v in layer.standard_error.items()})
            row.update(
                iterations=layer.iterations,
                imbalance=layer.imbalance,
                converged=layer.converged,
                degenerate_rows=len(layer.degenerate_rows),
                degenerate_cols=len(layer.degenerate_cols),
                clipped=layer.clipped,
            )
            rows.append(row)
        return pd.DataFrame(rows).set_index("name")

    def plot(self, measure: str = "normalized_sharpness", **kwargs: Any) -> Any:
        """Bar chart of one measure per layer (matplotlib); see :func:`normflat.plotting.plot_report`."""
        from normflat.plotting import plot_report

        return plot_report(self, measure=measure, **kwargs)

    def _table_rows(self) -> tuple[list[str], list[list[str]]]:
        header = ["layer", "kind", "shape", "norm. sharpness", "matrix-norm.", "Hessian trace",
                  "elementwise", "iters", "degen. r/c", "clipped"]
        rows = []
        for layer in self.layers:
            rows.append([
                layer.name, layer.kind, "x".join(map(str, layer.shape)),
                _fmt(layer.normalized_sharpness), _fmt(layer.matrix_normalized_sharpness),
                _fmt(layer.hessian_trace), _fmt(layer.elementwise_bound),
                str(layer.iterations) + ("" if layer.converged else "!"),
                f"{len(layer.degenerate_rows)}/{len(layer.degenerate_cols)}", str(layer.clipped),
            ])
        rows.append(["total", "", "", _fmt(self.normalized_sharpness),
                     _fmt(self.matrix_normalized_sharpness), _fmt(self.hessian_trace),
                     _fmt(self.elementwise_bound), "", "", ""])
        se = self.standard_error
        if se:
            rows.append(["± std. error", "", "", *(_fmt(se[m]) for m in MEASURES), "", "", ""])
        return header, rows

    def _meta_line(self) -> str:
        keys = ("framework", "loss", "estimator", "samples", "examples")
        parts = [f"{k}={self.metadata[k]}" for k in keys if self.metadata.get(k) is not None]
        return ", ".join(parts)

    def __str__(self) -> str:
        header, rows = self._table_rows()
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        left = {0, 1, 2}

        def line(cells):
            return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        out = ["normflat report" + (f" ({self._meta_line()})" if self._meta_line() else "")]
        out.append(line(header))
        out.append("  ".join("-" * w for w in widths))
        out.extend(line(r) for r in rows[:-1 - bool(self.standard_error)])
        out.append("  ".join("-" * w for w in widths))
        out.extend(line(r) for r in rows[len(self.layers):])
        if any(not layer.converged for layer in self.layers):
            out.append("! solver stopped at max_iter before reaching its tolerance")
        return "\n".join(out)

    def __repr__(self) -> str:
        return (f"Report(layers={len(self.layers)}, normalized_sharpness={self.normalized_sharpness:.6g}, "
                f"matrix_normalized_sharpness={self.matrix_normalized_sharpness:.6g}, "
                f"hessian_trace={self.hessian_trace:.6g}, elementwise_bound={self.elementwise_bound:.6g})")

    def _repr_html_(self) -> str:
        header, rows = self._table_rows()
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
        )
        caption = html.escape(self._meta_line())
        return (f"<table class='normflat-report'><caption>normflat report {caption}</caption>"
                f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def _total(layers: list[LayerResult], measure: str) -> float:
    try:
        return float(math.fsum(getattr(layer, measure) for layer in layers))
    except OverflowError:
        raise OverflowError(
            f"The total {measure} over the layers exceeds the float64 range (1.8e308); the "
            "per-layer values are in report.layers. Divide the loss by a constant c to bring the "
            "totals into range (sharpness measures scale by sqrt(c), the trace by c)."
        ) from None


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _json_floats(values: np.ndarray) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in np.asarray(values, dtype=float).ravel()]


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return repr(value)
